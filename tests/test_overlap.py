"""The overlap reader: which collectives a scheduled HLO module runs while compute
goes on (work between the start and the done), weighted like `collective_stats`;
and the trip counts it reads from loops that do not state theirs (TPU executables).
"""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import OverlapStats, collective_stats, overlap_stats

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to compile for',
)

# An all-gather of 4 devices: result 64 x 4 bytes, wire bytes 3/4 of it.
AG_WIRE = 3 * 64 * 4 // 4


def _module(entry: str, extra: str = "") -> str:
    return f"""HloModule m, is_scheduled=true, num_partitions=4
{extra}
%fused (p0: f32[16]) -> f32[16] {{
  %p0 = f32[16]{{0}} parameter(0)
  ROOT %n = f32[16]{{0}} negate(%p0)
}}

ENTRY %main (x: f32[16], y: f32[16]) -> f32[64] {{
  %x = f32[16]{{0}} parameter(0)
  %y = f32[16]{{0}} parameter(1)
{entry}
}}
"""


START = "  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), replica_groups=[1,4]<=[4], dimensions={0}"
DONE = "  ROOT %agd = f32[64]{0} all-gather-done(%ags)"
FUSION = "  %f = f32[16]{0} fusion(%y), kind=kLoop, calls=%fused"


def test_work_between_start_and_done_overlaps():
    stats = overlap_stats(_module("\n".join([START, FUSION, DONE])))
    assert stats.by_kind == {"all-gather": (AG_WIRE, AG_WIRE)}
    assert (stats.async_wire_bytes, stats.wire_bytes, stats.share) == (AG_WIRE, AG_WIRE, 1.0)
    assert "all-gather" in str(stats) and "100.0%" in str(stats)


def test_nothing_but_bookkeeping_between_is_not_overlap():
    between = "  %b = f32[16]{0} bitcast(%y)\n  %c = s32[] constant(1)"
    stats = overlap_stats(_module("\n".join([START, between, DONE])))
    assert stats.by_kind == {"all-gather": (0, AG_WIRE)}
    assert stats.share == 0.0


def test_synchronous_collective_and_no_traffic():
    sync = "  ROOT %ag = f32[64]{0} all-gather(%x), replica_groups=[1,4]<=[4], dimensions={0}"
    assert overlap_stats(_module("\n".join([FUSION, sync]))).by_kind == {"all-gather": (0, AG_WIRE)}
    empty = overlap_stats(_module(FUSION.replace("%f =", "ROOT %f =")))
    assert empty == OverlapStats(0, 0, {}) and empty.share == 0.0


LOOP = """
%body (p: (s32[], f32[16])) -> (s32[], f32[16]) {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[16]{0} get-tuple-element(%p), index=1
  %ags = (f32[16]{0}, f32[64]{0}) all-gather-start(%x), replica_groups=[1,4]<=[4], dimensions={0}
  %f = f32[16]{0} fusion(%x), kind=kLoop, calls=%fused
  %agd = f32[64]{0} all-gather-done(%ags)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[16]{0}) tuple(%next, %f)
}

%cond (p: (s32[], f32[16])) -> pred[] {
  %p = (s32[], f32[16]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
"""


@pytest.mark.parametrize("trip", ["known_trip_count", "read from the loop"])
def test_loop_body_weighted_by_trip_count(trip):
    backend = ', backend_config={"known_trip_count":{"n":"4"}}' if trip == "known_trip_count" else ""
    entry = f"""  %zero = s32[] constant(0)
  %z = s32[] copy(%zero)
  %init = (s32[], f32[16]{{0}}) tuple(%z, %x)
  %w = (s32[], f32[16]{{0}}) while(%init), condition=%cond, body=%body{backend}
  ROOT %out = f32[16]{{0}} get-tuple-element(%w), index=1"""
    text = _module(entry, LOOP)
    assert overlap_stats(text).by_kind == {"all-gather": (4 * AG_WIRE, 4 * AG_WIRE)}
    assert collective_stats(text).count["all-gather"] == 4


def test_async_start_wrapping_reduce_scatter():
    wrapped = """
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%wrapped_reduce_scatter (q: f32[16]) -> f32[4] {
  %q = f32[16]{0} parameter(0)
  ROOT %rs = f32[4]{0} reduce-scatter(%q), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}
"""
    start = "  %s = ((f32[16]{0}), f32[4]{0}, s32[]) async-start(%x), calls=%wrapped_reduce_scatter"
    done = "  %d = f32[4]{0} async-done(%s)"
    rs_wire = 3 * 4 * 4  # (n - 1) x the shard
    root = "  ROOT %r = f32[16]{0} get-tuple-element(%s), index=0"
    overlapped = overlap_stats(_module("\n".join([start, FUSION, done, root]), wrapped))
    assert overlapped.by_kind == {"reduce-scatter": (rs_wire, rs_wire)}
    back_to_back = overlap_stats(_module("\n".join([start, done, FUSION, root]), wrapped))
    assert back_to_back.by_kind == {"reduce-scatter": (0, rs_wire)}


@needs_libtpu
def test_compiled_for_tpu_fsdp_gathers_counted_and_a_ring_overlapped():
    """An FSDP matmul chain compiled for 4 v5p chips: its weight all-gathers are all
    counted (libtpu 0.0.42 schedules them synchronously, before the matmul that
    needs them: share 0). The same gather written as a ring of `ppermute`s, each
    block multiplied while the next one moves: the TPU scheduler puts the matmul
    between each collective-permute's start and done."""
    mesh = eqxpar.make_mesh(fsdp=4, topology="v5p:2x2x1")
    rows = NamedSharding(mesh, P("fsdp", None))

    def chain(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return x

    ws = [jax.ShapeDtypeStruct((1024, 1024), jnp.bfloat16, sharding=rows) for _ in range(3)]
    x = jax.ShapeDtypeStruct((2048, 1024), jnp.bfloat16, sharding=rows)
    compiled = jax.jit(chain).lower(ws, x).compile()
    stats = overlap_stats(compiled)
    total = collective_stats(compiled).wire_bytes["all-gather"]
    assert stats.by_kind["all-gather"][1] == total == 3 * (1024 * 1024 * 2) * 3 // 4

    def ring(w, x):
        n, me = 4, jax.lax.axis_index("fsdp")
        out = jnp.zeros((x.shape[0], w.shape[1]), jnp.float32)
        for k in range(n):
            block = jax.lax.dynamic_slice_in_dim(x, (me + k) % n * w.shape[0], w.shape[0], axis=1)
            following = jax.lax.ppermute(w, "fsdp", [(i, (i - 1) % n) for i in range(n)]) if k < n - 1 else w
            out, w = out + block @ w, following
        return out.astype(x.dtype)

    specs = (P("fsdp", None), P("fsdp", None))
    ringed = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=specs, out_specs=P("fsdp", None)))
    stats = overlap_stats(ringed.lower(ws[0], x).compile())
    overlapped, moved = stats.by_kind["collective-permute"]
    assert moved == 3 * 256 * 1024 * 2 and 0 < overlapped <= moved
