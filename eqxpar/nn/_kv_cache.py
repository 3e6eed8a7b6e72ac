"""Attention and transformer blocks that read and write a key/value cache.

Cached decoding (`eqxpar.models.generate`) runs the same weights as the layers'
`__call__`, through the same projections (`Attention.project` / `output`), but
attends over the keys and values of earlier calls kept in a cache instead of the
input's own. A layer's cache is `(batch, max_len, kv_heads, head_dim)` for keys
and the same for values, laid out like the keys `Attention` computes: heads
split over the tensor axis (this device's heads in manual mode), batch over the
plan's batch axes.
"""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._errors import PlanError
from ._attention import Attention
from ._block import TransformerBlock
from ._context import tensor_context
from ._moe import MoE
from ._rotary import apply_rotary


def cached_attention(
    attn: Attention,
    x: Float[Array, "batch seq d_model"],
    cache_k: Float[Array, "batch max_len kv_heads head_dim"],
    cache_v: Float[Array, "batch max_len kv_heads head_dim"],
    *,
    positions: Int[Array, "batch seq"],
    start: Int[Array, ""] | int,
    segment_ids: Int[Array, "batch seq"] | None = None,
    key_mask: Bool[Array, "batch seq max_len"] | None = None,
) -> tuple[Float[Array, "batch seq d_model"], Array, Array]:
    """`attn` on `x`, whose tokens sit at cache slots `start, start + 1, ...`,
    their keys and values written there.

    Two ways to attend: without `key_mask` (a prefill), `x`'s own keys, causally
    and within `segment_ids` (the layer's ordinary attention path, blockwise for a
    long `x`); with it (a decode step), every slot of the cache, written ones
    included, where `key_mask[b, i, j]` keeps slot `j` for query `i`. `positions`
    are the rotary positions of `x`'s tokens, per row.

    Returns `(y, cache_k, cache_v)`: the attention's output and the updated cache.
    """
    if not attn.causal:
        raise PlanError(
            "cached attention: this Attention has causal=False (an encoder), and a cache holds only "
            "the keys before each token. Decode with causal attention."
        )
    ctx = tensor_context(attn.axis)
    q, k, v = attn.project(x, ctx)
    if attn.rotary:
        rope = dict(base=attn.rotary_base, positions=positions, scaling=attn.rotary_scaling)
        q, k = apply_rotary(q, **rope), apply_rotary(k, **rope)
    cache_k = jax.lax.dynamic_update_slice_in_dim(cache_k, k.astype(cache_k.dtype), start, axis=1)
    cache_v = jax.lax.dynamic_update_slice_in_dim(cache_v, v.astype(cache_v.dtype), start, axis=1)
    cache_k = ctx.constrain(cache_k, None, ctx.axis, None)
    cache_v = ctx.constrain(cache_v, None, ctx.axis, None)
    if key_mask is None:
        core = attn._core(q, k, v, None, segment_ids, {})
    else:
        core = _attend_cache(q, cache_k.astype(q.dtype), cache_v.astype(q.dtype), key_mask)
    return attn.output(core, ctx), cache_k, cache_v


def _attend_cache(q: Array, k: Array, v: Array, key_mask: Array) -> Array:
    # q (b, s, hq, d) against the cache's k, v (b, L, hkv, d), grouped-query: query
    # head i reads key/value head i // (hq / hkv), local heads in manual mode.
    b, s, hq, d = q.shape
    hkv = k.shape[2]
    q = q.reshape(b, s, hkv, hq // hkv, d)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k) / jnp.sqrt(jnp.asarray(d, q.dtype))
    scores = jnp.where(key_mask[:, None, None, :, :], scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, s, hq, d)


def cached_block(
    block: TransformerBlock,
    x: Float[Array, "batch seq d_model"],
    cache_k: Float[Array, "batch max_len kv_heads head_dim"],
    cache_v: Float[Array, "batch max_len kv_heads head_dim"],
    **attend: object,
) -> tuple[Float[Array, "batch seq d_model"], Array, Array]:
    """`block(x)` (no dropout) with its attention through `cached_attention`
    (keyword arguments `attend` are its); an MoE block's auxiliary outputs are
    dropped. Returns `(y, cache_k, cache_v)`."""
    h, cache_k, cache_v = cached_attention(block.attn, block.norm1(x), cache_k, cache_v, **attend)
    x = x + h
    if isinstance(block.mlp, MoE):
        y, _ = block.mlp(block.norm2(x))
    else:
        y = block.mlp(block.norm2(x))
    return x + y, cache_k, cache_v
