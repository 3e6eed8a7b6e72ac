"""eqxpar.nn.context_attention: ring, all-gather and Ulysses context-parallel attention equal
dense attention of the whole sequence, forward and backward, for both layouts,
causal or not, with grouped-query heads; the ring moves exactly the bytes its
docstring states; the layout helpers agree with each other; bad input raises
eqxpar errors."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import collective_stats
from eqxpar.nn import context_attention, context_layout, context_positions, context_unlayout

from ._helpers import CONTEXT_AXIS as AX
from ._helpers import CONTEXT_SPEC as SPEC
from ._helpers import assert_trees_close, context_attention_fn, context_mesh, output_and_grads

B, S, H, D = 2, 48, 4, 8
# float32 contract; entries near zero need an absolute bound (other summation order):
# ATOL is its floor, raised to rtol x each leaf's largest magnitude (assert_trees_close).
RTOL, ATOL = 1e-5, 2e-6


def _dense(q, k, v, causal):
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        keep = jnp.arange(s.shape[-1])[None, :] <= jnp.arange(s.shape[-2])[:, None]
        s = jnp.where(keep, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _inputs(kv_heads, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, cot = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((B, S, H, D), (B, S, kv_heads, D), (B, S, kv_heads, D), (B, S, H, D))
    )
    return (q, k, v), cot


CASES = [
    (n, impl, causal, lb)
    for n in (2, 4)
    for impl in ("ring", "allgather", "ulysses")
    for causal, lb in ((True, True), (True, False), (False, True))
] + [(1, "ring", True, True)]


@pytest.mark.parametrize(("n", "impl", "causal", "load_balanced"), CASES)
def test_matches_dense_attention_forward_and_backward(n, impl, causal, load_balanced):
    kv_heads = 2 if (n, impl) != (4, "ring") or not causal else 4
    args, cot = _inputs(kv_heads, seed=n)
    out, grads = output_and_grads(
        context_attention_fn(n, causal=causal, load_balanced=load_balanced, impl=impl), args, cot
    )
    out_d, grads_d = output_and_grads(lambda q, k, v: _dense(q, k, v, causal), args, cot)
    assert_trees_close(out, out_d, rtol=RTOL, atol=ATOL)
    for name, g, g_d in zip("qkv", grads, grads_d, strict=True):
        assert_trees_close(g, g_d, rtol=RTOL, atol=ATOL, err_msg=f"d{name}")


def test_bfloat16_inputs_give_bfloat16_outputs_and_gradients():
    args, cot = _inputs(2)
    low = tuple(x.astype(jnp.bfloat16) for x in args)
    out, grads = output_and_grads(
        context_attention_fn(2, causal=True, load_balanced=True, impl="ring"), low, cot.astype(jnp.bfloat16)
    )
    assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
    # float32 accumulation: only the rounding of inputs and results differs from float32.
    out_d = _dense(*(x.astype(jnp.float32) for x in low), causal=True)
    np.testing.assert_allclose(out.astype(jnp.float32), out_d, rtol=2e-2, atol=2e-2)


def _local_kv_bytes(n, kv_heads=2):
    return 2 * B * (S // n) * kv_heads * D * 4


def _compiled(n, impl, backward):
    """The compiled context-parallel forward (or forward and backward), on inputs
    already in the layout, so that only the attention's own collectives remain."""
    attend = functools.partial(context_attention, causal=True, impl=impl, block_size=4)
    sharded = jax.shard_map(attend, mesh=context_mesh(n), in_specs=(SPEC,) * 3, out_specs=SPEC)

    def run(q, k, v, cot):
        if not backward:
            return sharded(q, k, v)
        return jax.vjp(sharded, q, k, v)[1](cot)

    (q, k, v), cot = _inputs(2)
    return jax.jit(run).lower(q, k, v, cot).compile()


@pytest.mark.parametrize("n", [2, 4])
def test_ring_moves_the_stated_bytes(n):
    kv = _local_kv_bytes(n)
    fwd = collective_stats(_compiled(n, "ring", backward=False))
    assert set(fwd.count) == {"collective-permute"}, fwd.as_dict()
    # n-1 ring steps of this device's K and V.
    assert fwd.bytes["collective-permute"] == (n - 1) * kv
    both = collective_stats(_compiled(n, "ring", backward=True))
    assert set(both.count) == {"collective-permute"}, both.as_dict()
    # Backward: K/V around the ring again, plus float32 dK/dV accumulators (n-1 hops).
    assert both.bytes["collective-permute"] - fwd.bytes["collective-permute"] == 2 * (n - 1) * kv


def test_allgather_gathers_forward_and_reduce_scatters_backward():
    n = 4
    kv = _local_kv_bytes(n)
    fwd = collective_stats(_compiled(n, "allgather", backward=False))
    assert set(fwd.count) == {"all-gather"}, fwd.as_dict()
    assert fwd.wire_bytes["all-gather"] == (n - 1) * kv
    both = collective_stats(_compiled(n, "allgather", backward=True))
    assert set(both.count) == {"all-gather", "reduce-scatter"}, both.as_dict()
    assert both.wire_bytes["reduce-scatter"] == (n - 1) * kv


@pytest.mark.parametrize("load_balanced", [True, False])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_layout_round_trip_and_positions(n, load_balanced):
    x = jnp.arange(3 * S).reshape(3, S)
    y = context_layout(x, n, load_balanced=load_balanced)
    np.testing.assert_array_equal(context_unlayout(y, n, load_balanced=load_balanced), x)
    np.testing.assert_array_equal(context_layout(x.T, n, load_balanced=load_balanced, seq_dim=0), y.T)
    local = S // n
    positions = jax.shard_map(
        lambda: context_positions(local, load_balanced=load_balanced),
        mesh=context_mesh(n),
        in_specs=(),
        out_specs=P(AX),
    )()
    # Device i's positions are the global tokens it holds: block i of the layout.
    np.testing.assert_array_equal(
        positions, context_layout(jnp.arange(S), n, load_balanced=load_balanced, seq_dim=0)
    )
    assert positions.dtype == jnp.int32


def test_load_balanced_layout_pairs_first_and_last_chunks():
    y = context_layout(jnp.arange(8)[None], 2, load_balanced=True)
    np.testing.assert_array_equal(y[0], [0, 1, 6, 7, 2, 3, 4, 5])


def _trace(n, q_shape, kv_shape, **kwargs):
    kwargs.setdefault("causal", True)
    f = jax.shard_map(
        lambda q, k, v: context_attention(q, k, v, **kwargs),
        mesh=context_mesh(n),
        in_specs=(SPEC,) * 3,
        out_specs=SPEC,
    )
    q = jax.ShapeDtypeStruct(q_shape, jnp.float32)
    kv = jax.ShapeDtypeStruct(kv_shape, jnp.float32)
    return jax.eval_shape(f, q, kv, kv)


def test_outside_shard_map_is_a_plan_error():
    (q, k, v), _ = _inputs(2)
    with pytest.raises(eqxpar.PlanError, match=r"axis='context'.*shard_map"):
        context_attention(q, k, v, causal=True)
    with pytest.raises(eqxpar.PlanError, match=r"axis='seq'"):
        _trace(2, (B, S, H, D), (B, S, 2, D), axis="seq")
    with pytest.raises(eqxpar.PlanError, match="context_positions"):
        context_positions(8, load_balanced=True)


@pytest.mark.parametrize(
    ("kv_shape", "kwargs", "error", "match"),
    [
        ((B, S // 2, 2, D), {}, eqxpar.SpecError, r"do not match"),
        ((B, S, 2, D + 1), {}, eqxpar.SpecError, r"do not match"),
        ((B, S, 3, D), {}, eqxpar.SpecError, r"4 query heads are not a multiple of 3"),
        ((B, S, 2, D), {"impl": "tree"}, eqxpar.PlanError, r"impl='tree'.*'ring', 'allgather', 'ulysses'"),
        ((B, S, 2, D), {"block_size": 0}, eqxpar.PlanError, r"block_size=0"),
    ],
)
def test_bad_input_raises(kv_shape, kwargs, error, match):
    with pytest.raises(error, match=match):
        _trace(2, (B, S, H, D), kv_shape, **kwargs)


def test_odd_local_length_with_load_balancing_is_a_divisibility_error():
    with pytest.raises(eqxpar.DivisibilityError, match=r"even local sequence length.*got 3"):
        _trace(2, (B, 6, H, D), (B, 6, 2, D))
    _trace(2, (B, 6, H, D), (B, 6, 2, D), load_balanced=False)  # contiguous blocks: fine
    with pytest.raises(eqxpar.DivisibilityError, match=r"length 6.*multiple of 4"):
        context_layout(jnp.zeros((1, 6)), 2, load_balanced=True)
