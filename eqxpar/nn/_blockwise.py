"""Blockwise (online-softmax) attention: temp memory linear in the sequence.

`blockwise_attention` computes `softmax(q k^T / sqrt(d)) v` with a `lax.scan` over
blocks of keys and values, keeping a running maximum and sum per query (float32),
so no `(seq, seq)` score matrix is ever formed: each step holds one
`(seq, block)` tile. Its backward pass is a `jax.custom_vjp` that saves only `q`,
`k`, `v`, the output and the per-query maximum and sum (all `O(seq)`), and
recomputes each tile's probabilities in a second scan over the same blocks
(FlashAttention's backward), so the backward is `O(seq x block)` as well. The
arithmetic of one tile is `_flash_tile.py`'s, shared with `context_attention`.

Dropout on the attention probabilities draws no random tensor: whether the
probability of (batch row, global query head, global query position, global key
position) is kept is a counter-based hash of those four integers and a seed
(`dropout_rows`, `dropout_scale`). Any tile, recomputed in the backward pass or on
another device (context or tensor parallelism), therefore sees the same mask, and
the dense, blockwise and context paths drop the same probabilities for one key.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._errors import PlanError, SpecError
from ._flash_tile import (
    TileOptions,
    accumulation_dtype,
    empty_softmax_state,
    fold_tile,
    key_blocks,
    query_and_key_grads,
    tile_scores,
    value_and_score_grads,
)

_U32 = jnp.uint32


def _fmix(h: Array) -> Array:
    # murmur3's 32-bit finalizer: every input bit flips each output bit with
    # probability about 1/2 (uint32 arithmetic wraps).
    h = h ^ (h >> 16)
    h = h * _U32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * _U32(0xC2B2AE35)
    return h ^ (h >> 16)


def _fold(h: Array, x: Array, salt: int) -> Array:
    # Mix one coordinate into the hash; the salt keeps the coordinates apart.
    return _fmix(h ^ _fmix(x.astype(_U32) * _U32(0x9E3779B1) + _U32(salt)))


def check_dropout(rate: float, fn: str) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= float(rate) < 1.0:
        raise PlanError(f"{fn}: dropout={rate!r}; expected a rate in [0, 1) (0: no dropout).")
    return float(rate)


def dropout_seed(key: PRNGKeyArray) -> Array:
    """The uint32 seed of the attention-dropout hash, drawn from `key`."""
    return jax.random.bits(key, (), _U32)


def dropout_rows(
    seed: Array, batch: int, heads: int, kv_heads: int, head_offset: Array | int, qpos: Array
) -> Array:
    """`(batch, kv_heads, heads / kv_heads, q)` uint32: the hash of (seed, batch row,
    global query head `head_offset + i`, global query position `qpos`) per query
    row, the first half of `dropout_scale`'s per-probability hash. Per row, so
    `O(seq)`: the blockwise and context paths carry it like the softmax statistics."""
    g = heads // kv_heads
    h = _fmix(jnp.asarray(seed, _U32))
    h = _fold(h, jnp.arange(batch).reshape(batch, 1, 1, 1), 0x1B873593)
    head = jnp.asarray(head_offset, jnp.int32) + jnp.arange(heads, dtype=jnp.int32)
    h = _fold(h, head.reshape(1, kv_heads, g, 1), 0x68E31DA4)
    return _fold(h, jnp.asarray(qpos).reshape(1, 1, 1, -1), 0x2C1B3C6D)


def dropout_scale(rows: Array, kpos: Array, rate: float) -> Array:
    """`(b, hkv, g, q, k)` float32: `1 / (1 - rate)` where the probability of row
    `rows` (`dropout_rows`) and global key position `kpos` is kept, else 0. Kept
    when the hash is at least `round(rate * 2**32)`: probability `1 - rate`."""
    threshold = min(int(round(rate * 2**32)), 2**32 - 1)
    h = _fold(rows[..., None], jnp.asarray(kpos).reshape(1, 1, 1, 1, -1), 0x165667B1)
    return jnp.where(h >= _U32(threshold), jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


def segment_allowed(q_segments: Array, k_segments: Array) -> Array:
    """`(b, 1, 1, q, k)`: query `i` may read key `j` of the same batch row when
    their segment ids are equal (shaped to broadcast against `(b, hkv, g, q, k)`
    scores). Shared by the dense, blockwise and context paths."""
    return (q_segments[:, :, None] == k_segments[:, None, :])[:, None, None]


def check_segment_ids(segment_ids: Array | None, q: Array, k: Array, fn: str) -> None:
    """Segment ids `(batch, seq)` of integers, for self-attention (`q_seq == kv_seq`)."""
    if segment_ids is None:
        return
    b, sq = q.shape[:2]
    if k.shape[1] != sq:
        raise SpecError(
            f"{fn}: segment_ids are for self-attention, but q has {sq} positions and k "
            f"{k.shape[1]}; pass a mask for cross-attention instead."
        )
    if segment_ids.shape != (b, sq) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise SpecError(
            f"{fn}: segment_ids of shape {segment_ids.shape} and dtype {segment_ids.dtype}; expected "
            f"integers of shape (batch, seq) = {(b, sq)}, one id per token (equal ids attend to each "
            "other: a packed sequence's documents, or padding as its own id)."
        )


def blockwise_attention(
    q: Float[Array, "batch q_seq heads head_dim"],
    k: Float[Array, "batch kv_seq kv_heads head_dim"],
    v: Float[Array, "batch kv_seq kv_heads head_dim"],
    *,
    causal: bool,
    mask: Bool[Array, "q_seq kv_seq"] | None = None,
    segment_ids: Int[Array, "_batch _q_seq"] | None = None,
    block_size: int = 512,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    head_offset: Int[Array, ""] | int = 0,
) -> Float[Array, "batch q_seq heads head_dim"]:
    """`softmax(q k^T / sqrt(head_dim)) v` over blocks of `block_size` keys.

    Same layout and result as dense attention: batch-first, query head `i` reads
    key/value head `i // (heads / kv_heads)` (grouped-query), `causal` keeps key
    `j <= i` for query `i`, `mask[i, j]` (optional) keeps key `j` for query `i`,
    `segment_ids[b, i] == segment_ids[b, j]` (optional, self-attention only) keeps
    key `j` for query `i` of batch row `b` (packed sequences, padding as its own
    segment); the three combine by AND. Masked scores are the accumulation
    dtype's `finfo.min` (a fully masked row averages all keys, as the dense
    softmax does). A key length that is not a multiple of `block_size` is padded
    with keys that take no weight. Accumulation is float32 (float64 for float64
    inputs); the output has `q`'s dtype. Temp memory, forward and backward, is
    `O(batch x heads x q_seq x block_size)`.

    With `dropout > 0` and a `key`, each attention probability is dropped with
    probability `dropout` and the kept ones scaled by `1 / (1 - dropout)`
    (FlashAttention's scheme: the softmax normaliser sums the undropped
    probabilities, the output the dropped ones). Whether one is kept is a hash of
    (seed drawn from `key`, batch row, global query head `head_offset + i`, query
    position, key position), so the dense path, this one and `context_attention`
    drop the same probabilities for the same key, whatever the tiling.

    **Arguments:** `q` `(batch, q_seq, heads, head_dim)`; `k`, `v` `(batch, kv_seq,
    kv_heads, head_dim)`; keyword-only `causal`, `mask` `(q_seq, kv_seq)` bool,
    `segment_ids` `(batch, seq)` integers (needs `q_seq == kv_seq`), `block_size`,
    `dropout` (rate in `[0, 1)`), `key` (without it: no dropout), `head_offset`
    (global index of the first local query head, under tensor parallelism).

    **Returns:** `(batch, q_seq, heads, head_dim)`.

    **Raises:** `ValueError` for mismatched `q`, `k`, `v`, `mask` or `block_size`;
    `eqxpar.SpecError` for `segment_ids` of the wrong shape or dtype.

    ```python
    seg = jnp.array([[0, 0, 0, 1, 1, 2, 2, 2]])   # three packed documents
    out = eqxpar.nn.blockwise_attention(q, k, v, causal=True, segment_ids=seg, block_size=4)
    ```
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if k.shape != (b, sk, hkv, d) or v.shape != k.shape:
        raise ValueError(f"blockwise_attention: q {q.shape}, k {k.shape}, v {v.shape} do not match.")
    if hq % hkv:
        raise ValueError(
            f"blockwise_attention: {hq} query heads are not a multiple of {hkv} key/value heads."
        )
    if mask is not None and mask.shape != (sq, sk):
        raise ValueError(f"blockwise_attention: mask {mask.shape}, expected {(sq, sk)}.")
    if block_size < 1:
        raise ValueError(f"blockwise_attention: block_size={block_size} must be positive.")
    check_segment_ids(segment_ids, q, k, "blockwise_attention")
    rate = check_dropout(dropout, "blockwise_attention")
    rows = None
    if rate > 0 and key is not None:
        rows = dropout_rows(dropout_seed(key), b, hq, hkv, head_offset, jnp.arange(sq))
    else:
        rate = 0.0
    kept = KeptKeys(mask, segment_ids, rows)
    return _flash(q, k, v, kept, TileOptions(bool(causal), int(min(block_size, sk)), rate))


class KeptKeys(NamedTuple):
    """Which keys each query keeps, beside `TileOptions.causal`: the `(q_seq,
    kv_seq)` mask, the `(batch, seq)` segment ids and the dropout rows' hashes
    (`dropout_rows`); each None when not used. Not differentiated."""

    mask: Array | None
    segments: Array | None
    dropout_rows: Array | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, kept: KeptKeys, options: TileOptions):
    return _forward(q, k, v, kept, options)[0]


def _setup(q, k, v, kept: KeptKeys, options: TileOptions):
    """Grouped float32 queries, keys and values stacked in blocks `(n, b, block, hkv, d)`
    (padded to whole blocks), the mask padded likewise, and a per-block mask maker."""
    causal, block, rate = options.causal, options.block_size, options.dropout_rate
    mask, seg, rows = kept
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    nb = -(-sk // block)
    pad = nb * block - sk
    acc = accumulation_dtype(q.dtype)
    qg = q.astype(acc).reshape(b, sq, hkv, hq // hkv, d)
    mask = None if mask is None else jnp.pad(mask, ((0, 0), (0, pad)))
    kseg = None if seg is None else jnp.pad(seg, ((0, 0), (0, pad)))

    def masks(j):
        # real: keys inside the sequence (padding takes no weight at all);
        # allowed: real keys the causal / given mask / segments keep (others score
        # finfo.min), (q, block) or, with segment ids, (b, 1, 1, q, block).
        kpos = j * block + jnp.arange(block)
        real = (kpos < sk)[None, :]
        allowed = real
        if causal:
            allowed = allowed & (kpos[None, :] <= jnp.arange(sq)[:, None])
        if mask is not None:
            allowed = allowed & lax.dynamic_slice_in_dim(mask, j * block, block, axis=1)
        if kseg is not None:
            same = segment_allowed(seg, lax.dynamic_slice_in_dim(kseg, j * block, block, axis=1))
            allowed = allowed[None, None, None] & same
        drop = None if rows is None else dropout_scale(rows, kpos, rate)
        return real, allowed, drop

    return qg, key_blocks(k, block, acc)[0], key_blocks(v, block, acc)[0], masks, jnp.arange(nb)


def _scores(qg, kj, allowed, d):
    s = tile_scores(qg, kj) / jnp.sqrt(jnp.asarray(d, qg.dtype))
    return jnp.where(allowed, s, jnp.finfo(s.dtype).min)


def _forward(q, k, v, kept: KeptKeys, options: TileOptions):
    b, sq, hq, d = q.shape
    qg, kb, vb, masks, idx = _setup(q, k, v, kept, options)

    def step(state, xs):
        j, kj, vj = xs
        real, allowed, drop = masks(j)
        return fold_tile(state, _scores(qg, kj, allowed, d), real, vj, drop), None

    (acc, m, total), _ = lax.scan(step, empty_softmax_state(qg), (idx, kb, vb))
    o = acc / total[..., None]  # (b, hkv, g, sq, d)
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d).astype(q.dtype)
    return out, (q, k, v, kept, o, m, total)


def _flash_fwd(q, k, v, kept: KeptKeys, options: TileOptions):
    return _forward(q, k, v, kept, options)


def _flash_bwd(options: TileOptions, res, dout):
    q, k, v, kept, o, m, total = res
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qg, kb, vb, masks, idx = _setup(q, k, v, kept, options)
    do = dout.astype(qg.dtype).reshape(b, sq, hkv, g, d)
    delta = jnp.einsum("bqkgd,bkgqd->bkgq", do, o)  # rowsum(dO * O), O the dropped output
    inv_l = 1.0 / total

    def step(dq, xs):
        j, kj, vj = xs
        real, allowed, drop = masks(j)
        s = _scores(qg, kj, allowed, d)
        p = jnp.where(real, jnp.exp(s - m[..., None]), 0.0) * inv_l[..., None]
        dv, ds = value_and_score_grads(p, drop, do, vj, delta)
        # The scores were scaled after the dot product and masked keys kept in p.
        ds = jnp.where(allowed, ds, 0.0) / jnp.sqrt(jnp.asarray(d, qg.dtype))
        dq_j, dk = query_and_key_grads(ds, qg, kj)
        return dq + dq_j, (dk, dv)

    dq, (dk, dv) = lax.scan(step, jnp.zeros_like(qg), (idx, kb, vb))

    def unblock(x, like):
        return x.swapaxes(0, 1).reshape(b, -1, hkv, d)[:, :sk].astype(like.dtype)

    # The kept keys are masks and hashes: no cotangent.
    no_cotangent = KeptKeys(None, None, None)
    return dq.reshape(b, sq, hq, d).astype(q.dtype), unblock(dk, k), unblock(dv, v), no_cotangent


_flash.defvjp(_flash_fwd, _flash_bwd)
