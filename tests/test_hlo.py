"""The collective counter reads result bytes from HLO text and weights loop bodies
by their trip count."""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import collective_stats, shape_bytes

HLO = """
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %cp = f32[8,4]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %cp)
}

%cond (p: (s32[], f32[8,4])) -> pred[] {
  %p = (s32[], f32[8,4]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,4], y: bf16[16]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %y = bf16[16]{0} parameter(1)
  %ar = (f32[8,4]{1,0}, bf16[16]{0}) all-reduce(%x, %y), to_apply=%add
  %ag = f32[16,4]{1,0} all-gather(%x), dimensions={0}
  %rs = f32[2,4]{1,0} reduce-scatter(%x), dimensions={0}, to_apply=%add
  %init = (s32[], f32[8,4]) tuple(s32[] constant(0), %x)
  %w = (s32[], f32[8,4]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = f32[8,4]{1,0} get-tuple-element(%w), index=1
}
"""


def test_shape_bytes():
    assert shape_bytes("f32[8,4]{1,0}") == 128
    assert shape_bytes("(f32[8,4]{1,0}, bf16[16]{0})") == 128 + 32
    assert shape_bytes("f32[]") == 4


def test_hand_written_hlo():
    stats = collective_stats(HLO)
    assert stats.count == {"all-reduce": 1, "all-gather": 1, "reduce-scatter": 1, "collective-permute": 3}
    assert stats.bytes == {
        "all-reduce": 160,
        "all-gather": 256,
        "reduce-scatter": 32,
        "collective-permute": 3 * 128,
    }
    assert stats.total_bytes == 160 + 256 + 32 + 384


def test_compiled_scan_of_ppermutes_is_weighted():
    mesh = eqxpar.make_mesh(data=8)

    def ring(x):
        def body(x, _):
            return jax.lax.ppermute(x, "data", [(i, (i + 1) % 8) for i in range(8)]), None

        return jax.lax.scan(body, x, None, length=5)[0]

    f = jax.jit(jax.shard_map(ring, mesh=mesh, in_specs=P("data"), out_specs=P("data"), axis_names={"data"}))
    stats = collective_stats(f.lower(jnp.ones((64, 16))).compile())
    assert stats.count["collective-permute"] == 5
    assert stats.bytes["collective-permute"] == 5 * 8 * 16 * 4
