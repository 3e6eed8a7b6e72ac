"""The collective counter reads result bytes from HLO text and weights loop bodies
by their trip count; wire bytes follow each collective's replica-group size."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import collective_stats, shape_bytes

HLO = """
HloModule m, num_partitions=8

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
  %ar = (f32[8,4]{1,0}, bf16[16]{0}) all-reduce(%x, %y), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %ag = f32[16,4]{1,0} all-gather(%x), replica_groups=[4,2]<=[8], dimensions={0}
  %rs = f32[2,4]{1,0} reduce-scatter(%x), replica_groups=[2,4]<=[4,2]T(1,0), dimensions={0}, to_apply=%add
  %a2a = f32[8,4]{1,0} all-to-all(%x), replica_groups={}, dimensions={0}
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
    assert stats.count == {
        "all-reduce": 1,
        "all-gather": 1,
        "reduce-scatter": 1,
        "all-to-all": 1,
        "collective-permute": 3,
    }
    assert stats.bytes == {
        "all-reduce": 160,
        "all-gather": 256,
        "reduce-scatter": 32,
        "all-to-all": 128,
        "collective-permute": 3 * 128,
    }
    assert stats.total_bytes == 160 + 256 + 32 + 128 + 384
    assert stats.wire_bytes == {
        "all-reduce": 2 * 3 * 160 // 4,  # explicit groups of 4
        "all-gather": 1 * 256 // 2,  # iota [4,2]: groups of 2
        "reduce-scatter": 3 * 32,  # iota [2,4] transposed: groups of 4
        "all-to-all": 7 * 128 // 8,  # empty groups: num_partitions=8
        "collective-permute": 3 * 128,
    }
    assert stats.total_wire_bytes == 240 + 128 + 96 + 112 + 384
    assert stats.as_dict()["all-to-all"] == {"count": 1, "bytes": 128, "wire_bytes": 112}
    # Only the permute sits in the while body.
    assert stats.in_loops == {"collective-permute": 3}


def test_wire_bytes_device_count_and_edge_cases():
    # An explicit count overrides num_partitions; without either, empty groups raise.
    assert collective_stats(HLO, num_devices=4).wire_bytes["all-to-all"] == 3 * 128 // 4
    with pytest.raises(ValueError, match="num_devices"):
        collective_stats(HLO.replace(", num_partitions=8", ""))
    text = """
HloModule m
ENTRY %main (x: f32[8,4]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %one = f32[8,4]{1,0} all-gather(%x), replica_groups={{0},{1},{2}}, dimensions={0}
  ROOT %three = f32[8,4]{1,0} all-to-all(%one), replica_groups={{0,1,2}}, dimensions={0}
}
"""
    stats = collective_stats(text)
    assert stats.wire_bytes == {"all-gather": 0, "all-to-all": 2 * 128 // 3}  # n=1; rounded down
    # XLA's named-mesh form: groups span the axes in braces (here 2 of the 8 devices).
    named = """
HloModule m, num_partitions=8
ENTRY %main (x: f32[8,4]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  ROOT %r = f32[8,4]{1,0} all-reduce(%x), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, to_apply=%add
}
"""
    assert collective_stats(named).wire_bytes == {"all-reduce": 2 * 1 * 128 // 2}


def test_a_ragged_all_to_all_counts_the_smaller_buffer():
    """A ragged all-to-all (the MoE dispatch on TPU) moves data-dependent rows: it
    counts as an all-to-all of the smaller of its operand and output buffers
    (the routed rows, sent one way and received the other), (n-1)/n of them."""
    text = """
HloModule m, num_partitions=4
ENTRY %main (x: bf16[16,8], o: bf16[64,8], s: s32[4]) -> bf16[16,8] {
  %x = bf16[16,8]{1,0} parameter(0)
  %o = bf16[64,8]{1,0} parameter(1)
  %s = s32[4]{0} parameter(2)
  %out = bf16[64,8]{1,0} ragged-all-to-all(bf16[16,8]{1,0} %x, bf16[64,8]{1,0} %o, s32[4]{0} %s, s32[4]{0} %s, s32[4]{0} %s, s32[4]{0} %s), replica_groups={{0,1,2,3}}
  %z = bf16[16,8]{1,0} slice(%out), slice={[0:16], [0:8]}
  ROOT %back = bf16[16,8]{1,0} ragged-all-to-all(bf16[64,8]{1,0} %out, bf16[16,8]{1,0} %z, s32[4]{0} %s, s32[4]{0} %s, s32[4]{0} %s, s32[4]{0} %s), replica_groups={{0,1,2,3}}
}
"""
    stats = collective_stats(text)
    assert stats.count == {"all-to-all": 2}
    assert stats.wire_bytes == {"all-to-all": 2 * (3 * 16 * 8 * 2 // 4)}
    # Compiled TPU text names the operands without their types: read from their definitions.
    untyped = re.sub(r"(ragged-all-to-all\()[^)]*\)", r"\1%x, %o, %s, %s, %s, %s)", text)
    assert "bf16[16,8]{1,0} %x," not in untyped
    assert collective_stats(untyped).wire_bytes == stats.wire_bytes


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


def test_compiled_psums_wire_bytes_follow_group_size():
    mesh = eqxpar.make_mesh(data=2, tensor=4)

    def f(x, y):
        return jax.lax.psum(x, "tensor"), jax.lax.psum(y, "data")

    # Per device: x f32[16,32] (2048 bytes) summed over 4, y f32[8,8] (256 bytes)
    # over 2. Different groups, so XLA cannot combine the two all-reduces.
    g = jax.shard_map(
        f,
        mesh=mesh,
        in_specs=(P("data", "tensor"), P("data", "tensor")),
        out_specs=(P("data"), P(None, "tensor")),
    )
    compiled = jax.jit(g).lower(jnp.ones((32, 128)), jnp.ones((16, 32))).compile()
    stats = collective_stats(compiled)
    assert stats.count == {"all-reduce": 2}
    assert stats.bytes["all-reduce"] == 2048 + 256
    assert stats.wire_bytes["all-reduce"] == 2 * 3 * 2048 // 4 + 2 * 1 * 256 // 2


def test_a_conditional_counts_its_heaviest_branch_only():
    # Each device runs one branch per execution: the 4 KiB all-reduce branch counts
    # (3 times, in a loop of 3), not the sum with the 1 KiB branch.
    def f(x, i):
        def body(carry, _):
            carry = jax.lax.switch(
                i,
                [
                    lambda c: jax.lax.psum(c, "d"),
                    lambda c: c.at[:2].set(jax.lax.psum(c[:2], "d")),
                    lambda c: c,
                ],
                carry,
            )
            return carry, None

        return jax.lax.scan(body, x, None, length=3)[0]

    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
    stats = collective_stats(g.lower(jnp.zeros((8, 128)), jnp.int32(0)).compile())
    assert stats.count["all-reduce"] == 3, stats.count
    assert stats.bytes["all-reduce"] == 3 * 8 * 128 * 4, stats.bytes


def test_a_pipeline_tick_counts_each_devices_own_branch():
    # Two ticks, as the pipeline engine names them: in the first, the devices at
    # pipe position 0 sum 4 KiB over `tensor` and those at 1 idle; in the second the
    # other way round. Each device sums once per iteration, not twice.
    def tick(c, stage_that_sums):
        branches = [lambda c: jax.lax.psum(c, "tensor"), lambda c: c]
        index = jnp.where(jax.lax.axis_index("pipe") == stage_that_sums, 0, 1)
        by_position = "_".join("0" if k == stage_that_sums else "1" for k in range(2))
        # partition // 4 % 2 is the position along pipe of the (pipe 2, tensor 4) mesh
        with jax.named_scope(f"eqxpar_tick_s4_b{by_position}"):
            return jax.lax.switch(index, branches, c)

    def f(x):
        def body(carry, _):
            return tick(tick(carry, 0), 1), None

        return jax.lax.scan(body, x, None, length=3)[0]

    mesh = jax.make_mesh((2, 4), ("pipe", "tensor"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
    text = g.lower(jnp.zeros((8, 128))).compile().as_text()
    assert "eqxpar_tick_s4_b0_1" in text and "eqxpar_tick_s4_b1_0" in text
    stats = collective_stats(text)
    assert stats.count["all-reduce"] == 3, stats.count
    assert stats.bytes["all-reduce"] == 3 * 8 * 128 * 4
    assert stats.wire_bytes["all-reduce"] == 3 * 2 * 3 * 8 * 128 * 4 // 4
    # Unnamed, each tick counts its costliest branch: an upper bound, twice that.
    unnamed = re.sub(r"eqxpar_tick_s4_b\d_\d", "tick", text)
    assert collective_stats(unnamed).count["all-reduce"] == 6


def test_dtypes_name_what_each_kind_moves():
    stats = collective_stats(HLO)
    assert stats.dtypes == {
        "all-reduce": ("bf16", "f32"),
        **dict.fromkeys(("all-gather", "reduce-scatter", "collective-permute", "all-to-all"), ("f32",)),
    }
    # Async starts: the moved element of the tuple (not the operands or a permute's
    # u32 scratch), in bytes and dtypes; all-reduce-start's result is all-reduce's.
    text = """
HloModule m, num_partitions=2
ENTRY %main (x: bf16[4,4]) -> bf16[8,4] {
  %x = bf16[4,4]{1,0} parameter(0)
  %ags = (f32[4,4]{1,0}, bf16[8,4]{1,0}) all-gather-start(%x), replica_groups={{0,1}}, dimensions={0}
  %cps = (s32[4,4]{1,0}, f16[4,4]{1,0}, u32[], u32[]) collective-permute-start(%x), source_target_pairs={{0,1}}
  %ars = (bf16[4,4]{1,0}, f32[2]{0}) all-reduce-start(%x, %y), replica_groups={{0,1}}, to_apply=%add
  ROOT %agd = bf16[8,4]{1,0} all-gather-done(%ags)
}
"""
    stats = collective_stats(text)
    assert stats.bytes == {"all-gather": 64, "collective-permute": 32, "all-reduce": 32 + 8}
    assert stats.dtypes == {
        "all-gather": ("bf16",),
        "collective-permute": ("f16",),
        "all-reduce": ("bf16", "f32"),
    }
    mesh = eqxpar.make_mesh(data=8)
    f = jax.shard_map(lambda i: jax.lax.psum(i, "data"), mesh=mesh, in_specs=P("data"), out_specs=P())
    compiled = jax.jit(f).lower(jnp.ones(8, jnp.int32)).compile()
    assert collective_stats(compiled).dtypes == {"all-reduce": ("s32",)}


def test_collective_permute_wire_is_the_busiest_senders():
    """A pipeline's forward permute has no sender on its last stage and its
    backward one none on its first: wire bytes are what the busiest device sends
    (here the middle one: both), not every permute's result on every device."""
    text = """
HloModule m, num_partitions=3

ENTRY %main (x: f32[8,4]) -> f32[8,4] {
  %x = f32[8,4]{1,0} parameter(0)
  %f = f32[8,4]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}
  %g = f32[8,4]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}
  ROOT %b = f32[8,4]{1,0} collective-permute(%f), source_target_pairs={{1,0},{2,1}}
}
"""
    stats = collective_stats(text)
    assert stats.count["collective-permute"] == 3
    assert stats.bytes["collective-permute"] == 3 * 128
    # Device 1 sends in all three, devices 0 and 2 in two and one.
    assert stats.wire_bytes["collective-permute"] == 3 * 128
    one_way = text.replace("{{1,0},{2,1}}", "{{2,0}}")
    assert collective_stats(one_way).wire_bytes["collective-permute"] == 2 * 128


COUNTED_LOOP = """
HloModule m, num_partitions=2

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[16]{0} all-gather(%x), replica_groups={{0,1}}, dimensions={0}
  %s = f32[8]{0} slice(%ag), slice={[0:8]}
  %step = s32[] constant(STEP)
  %next = s32[] OP(%i, %step)
  ROOT %t = (s32[], f32[8]{0}) tuple(%next, %s)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(BOUND)
  ROOT %c = pred[] compare(%i, %n), direction=DIRECTION
}

ENTRY %main (x: f32[8]) -> f32[8] {
  %x = f32[8]{0} parameter(0)
  %start = s32[] constant(START)
  %init = (s32[], f32[8]{0}) tuple(%start, %x)
  %w = (s32[], f32[8]{0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8]{0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize(
    ("start", "op", "step", "direction", "bound", "trips"),
    [
        (0, "add", 1, "LT", 32, 32),  # a scan over 32 layers
        (0, "add", 2, "LT", 16, 8),  # a windowed einsum, two blocks a trip
        (0, "add", 2, "LE", 16, 9),
        (10, "subtract", 3, "GT", 0, 4),  # 10, 7, 4, 1
        (0, "add", 1, "NE", 5, 5),
        (0, "multiply", 2, "LT", 16, 1),  # not a counted loop: its body counts once
    ],
)
def test_trip_count_read_from_a_loop_without_known_trip_count(start, op, step, direction, bound, trips):
    """TPU executables state no known_trip_count: the count is read from the
    loop's condition, step and initial value, or the body counts once."""
    text = COUNTED_LOOP
    for key, value in {
        "START": start,
        "OP": op,
        "STEP": step,
        "DIRECTION": direction,
        "BOUND": bound,
    }.items():
        text = text.replace(key, str(value))
    stats = collective_stats(text)
    assert stats.count["all-gather"] == stats.in_loops["all-gather"] == trips


def test_trip_count_read_through_copies_of_the_counter():
    """libtpu copies the counter before adding the step (the pipeline's loop of
    MaxText's Llama-3-70B): still a counted loop."""
    text = COUNTED_LOOP.replace(
        "%next = s32[] OP(%i, %step)", "%ci = s32[] copy(%i)\n  %next = s32[] add(%ci, %step)"
    )
    for key, value in {"START": 0, "STEP": 1, "DIRECTION": "LT", "BOUND": 83}.items():
        text = text.replace(key, str(value))
    assert collective_stats(text).count["all-gather"] == 83


# As a TPU executable writes a reduce-scatter: a fusion of an all-reduce and this
# device's slice, in a computation named all-reduce-scatter, here in a loop of 2.
TPU_REDUCE_SCATTER = """
HloModule m, num_partitions=8

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%all-reduce-scatter.1 (input.1: f32[8,16]) -> f32[8,4] {
  %input.1 = f32[8,16]{1,0} parameter(0)
  %all-reduce.1 = f32[8,16]{1,0} all-reduce(%input.1), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  %zero = u32[] constant(0)
  %pid = u32[] partition-id()
  ROOT %slice = f32[8,4]{1,0} dynamic-slice(%all-reduce.1, %zero, %pid), dynamic_slice_sizes={8,4}
}

%body (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %rs = f32[8,4]{1,0} fusion(%x), kind=kCustom, calls=%all-reduce-scatter.1
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]) tuple(%i, %x)
}

%cond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x: f32[8,16]) -> f32[8,16] {
  %x = f32[8,16]{1,0} parameter(0)
  %init = (s32[], f32[8,16]) tuple(s32[] constant(0), %x)
  %w = (s32[], f32[8,16]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %out = f32[8,16]{1,0} get-tuple-element(%w), index=1
}
"""


def test_a_fused_tpu_reduce_scatter_counts_as_one():
    stats = collective_stats(TPU_REDUCE_SCATTER)
    # Its shard (8 x 4 f32, 128 bytes) over groups of 4, twice: (4 - 1) x 128 each;
    # the all-reduce inside is not counted apart.
    assert stats.count == {"reduce-scatter": 2}
    assert stats.bytes["reduce-scatter"] == 2 * 128
    assert stats.wire_bytes["reduce-scatter"] == 2 * 3 * 128
    assert stats.in_loops["reduce-scatter"] == 2
