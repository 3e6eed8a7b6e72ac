"""Rotary position embeddings: `eqxpar.nn.apply_rotary` against a complex-number
reference and its relative-position property; `AttentionConfig(rotary=True)` (with
grouped-query heads) against a NumPy attention. Parity of rotary attention across
every parallel mode is in tests/test_models.py (the GPT uses it in every plan)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxpar
from eqxpar import nn

from ._helpers import assert_trees_close


def complex_rotary(x: np.ndarray, positions: np.ndarray, base: float = 10000.0) -> np.ndarray:
    """Feature pairs (i, i + d/2) as complex numbers, times exp(i * pos * base^(-2i/d))."""
    d = x.shape[-1]
    half = d // 2
    z = x[..., :half] + 1j * x[..., half:]
    theta = positions[:, None] * base ** (-np.arange(half) * 2.0 / d)
    z = z * np.exp(1j * theta)[None, :, None, :]
    return np.concatenate([z.real, z.imag], axis=-1)


def test_apply_rotary_matches_complex_rotation():
    x = jax.random.normal(jax.random.key(0), (2, 6, 3, 8))
    out = jax.jit(lambda x: nn.apply_rotary(x, base=100.0))(x)
    expected = complex_rotary(np.asarray(x, np.float64), np.arange(6.0), base=100.0)
    assert_trees_close(np.asarray(out), expected)
    # Position 0 is not rotated; every position keeps each pair's length.
    np.testing.assert_allclose(out[:, 0], x[:, 0], rtol=1e-6)
    assert_trees_close(jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1))


def test_scores_depend_only_on_relative_position():
    kq, kk = jax.random.split(jax.random.key(1))
    q = jax.random.normal(kq, (1, 1, 1, 16))
    k = jax.random.normal(kk, (1, 1, 1, 16))

    @jax.jit
    def score_of(m, n):
        rq = nn.apply_rotary(q, positions=m[None])
        rk = nn.apply_rotary(k, positions=n[None])
        return jnp.sum(rq * rk)

    def score(m, n):
        return float(score_of(jnp.asarray(m), jnp.asarray(n)))

    # Rotations by other angles round differently in float32; a score's rounding
    # scales with |q| |k| (its largest possible value), not with the score itself.
    bound = 1e-5 * float(jnp.linalg.norm(q) * jnp.linalg.norm(k))
    assert abs(score(3, 1) - score(10, 8)) <= bound
    assert abs(score(0, 5) - score(7, 12)) <= bound
    # ... and does depend on it.
    assert abs(score(3, 1) - score(3, 2)) > 1e-3


def test_apply_rotary_rejects_odd_head_dim_and_wrong_positions():
    with pytest.raises(eqxpar.SpecError, match="head_dim 5"):
        nn.apply_rotary(jnp.ones((1, 4, 2, 5)))
    with pytest.raises(eqxpar.SpecError, match=r"shape \(4,\)"):
        nn.apply_rotary(jnp.ones((1, 4, 2, 6)), positions=jnp.arange(3))
    with pytest.raises(eqxpar.DivisibilityError, match="head_dim=3"):
        nn.Attention(12, nn.AttentionConfig(4, rotary=True), key=jax.random.key(0))


def numpy_attention(attn: nn.Attention, x: np.ndarray) -> np.ndarray:
    """Causal grouped-query attention with rotary positions, written out in NumPy."""
    wq, wk, wv, wo = (np.asarray(w, np.float64) for w in (attn.wq, attn.wk, attn.wv, attn.wo))
    s = x.shape[1]
    q = np.einsum("bsd,dhe->bshe", x, wq)
    k = np.einsum("bsd,dhe->bshe", x, wk)
    v = np.einsum("bsd,dhe->bshe", x, wv)
    q, k = complex_rotary(q, np.arange(s * 1.0)), complex_rotary(k, np.arange(s * 1.0))
    group = attn.num_heads // attn.num_kv_heads
    k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)  # query head i -> kv head i // group
    scores = np.einsum("bqhe,bkhe->bhqk", q, k) / np.sqrt(attn.head_dim)
    scores = np.where(np.tril(np.ones((s, s), bool))[None, None], scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    heads = np.einsum("bhqk,bkhe->bqhe", weights, v)
    return np.einsum("bqhe,hed->bqd", heads, wo)


def test_rotary_attention_matches_numpy_reference():
    config = nn.AttentionConfig(4, num_kv_heads=2, rotary=True, use_bias=False)
    attn = nn.Attention(16, config, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (2, 7, 16))
    out = eqx.filter_jit(lambda a, x: a(x))(attn, x)
    assert_trees_close(np.asarray(out), numpy_attention(attn, np.asarray(x, np.float64)), atol=2e-5)
    # Without rotary the same weights give a different (position-blind) result.
    plain = nn.Attention(16, dataclasses.replace(config, rotary=False), key=jax.random.key(2))
    assert float(jnp.max(jnp.abs(eqx.filter_jit(lambda a, x: a(x))(plain, x) - out))) > 1e-3
