"""Context attention's tile kernel: the queries of one layout chunk against the
keys of another (`Chunk`s, runs of the global sequence), one key block at a
time, with no communication. Forward: fold each block into the queries' online
softmax (`fold_key_blocks`). Backward: recompute each block's probabilities from
the saved log-sum-exp and add its gradients (`key_block_grads`).

Queries are grouped `(b, q, hkv, g, d)` and scaled by `1/sqrt(d)` once
(`grouped_queries`), accumulated in float32 (float64 for float64 inputs). The
masks come from the chunks' global positions: causal (keys at or before the
query), segment ids (keys of the query's segment), the keys past the chunk's end
that pad it to whole blocks, and dropout's hash of the global positions, so every
layout and device sees the mask one device would. The arithmetic of a tile is
`_flash_tile.py`'s, shared with `blockwise_attention`.
"""

from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._blockwise import dropout_scale, segment_allowed
from ._flash_tile import (
    TileOptions,
    accumulation_dtype,
    fold_tile,
    key_blocks,
    query_and_key_grads,
    tile_scores,
    value_and_score_grads,
)
from ._sequence_layout import Chunk


class QueryChunk(NamedTuple):
    """The queries of one chunk: `grouped` `(b, q, hkv, g, d)` (`grouped_queries`),
    their `segment_ids` `(b, q)` and dropout row hashes `dropout_rows`
    `(b, hkv, g, q)` (`dropout_rows`; each None when unused)."""

    chunk: Chunk
    grouped: Array
    segment_ids: Array | None = None
    dropout_rows: Array | None = None


class KeyChunk(NamedTuple):
    """The keys and values `(b, s, hkv, d)` of one chunk and their `segment_ids`
    `(b, s)` (None when unused)."""

    chunk: Chunk
    k: Array
    v: Array
    segment_ids: Array | None = None


class RowGrads(NamedTuple):
    """What the backward pass needs per query row: the output's cotangent `do`
    `(b, q, hkv, g, d)`, the log-sum-exp `lse` and `delta` = rowsum(dO * O), both
    `(b, hkv, g, q)`."""

    do: Array
    lse: Array
    delta: Array

    def cut(self, chunk: Chunk) -> "RowGrads":
        return RowGrads(chunk.cut(self.do), chunk.cut(self.lse, 3), chunk.cut(self.delta, 3))


def query_chunks(
    grouped: Array, chunks: list[Chunk], segment_ids=None, dropout_rows=None
) -> list[QueryChunk]:
    """The local queries (and their ids and dropout rows) cut into `chunks`."""
    return [QueryChunk(c, c.cut(grouped), c.cut(segment_ids), c.cut(dropout_rows, 3)) for c in chunks]


def key_chunks(k: Array, v: Array, chunks: list[Chunk], segment_ids=None) -> list[KeyChunk]:
    """The local keys and values (and their ids) cut into `chunks`."""
    return [KeyChunk(c, c.cut(k), c.cut(v), c.cut(segment_ids)) for c in chunks]


def grouped_queries(q: Array, kv_heads: int) -> Array:
    """`(b, s, hq, d)` -> `(b, s, kv_heads, hq / kv_heads, d)` in the accumulation
    dtype, scaled by `1/sqrt(d)` once (every tile's scores are then one dot)."""
    b, s, hq, d = q.shape
    acc = accumulation_dtype(q.dtype)
    return q.astype(acc).reshape(b, s, kv_heads, hq // kv_heads, d) / jnp.sqrt(jnp.asarray(d, acc))


def backward_inputs(q: Array, o: Array, lse: Array, dout: Array, kv_heads: int) -> tuple[Array, RowGrads]:
    """The backward pass's grouped queries and `RowGrads` from the saved `q`, float32
    output `o` `(b, hkv, g, q, d)`, log-sum-exp and the output's cotangent `dout`."""
    b, sq, hq, d = q.shape
    do = dout.astype(o.dtype).reshape(b, sq, kv_heads, hq // kv_heads, d)
    delta = jnp.einsum("bqkgd,bkgqd->bkgq", do, o)  # rowsum(dO * O)
    return grouped_queries(q, kv_heads), RowGrads(do, lse, delta)


def query_grad(dq: Array, q: Array) -> Array:
    """The gradient of `q` from `dq`, that of the grouped, scaled queries (chain
    rule through the `1/sqrt(d)`), in `q`'s layout and dtype."""
    b, sq, hq, d = q.shape
    return (dq / jnp.sqrt(jnp.asarray(d, dq.dtype))).reshape(b, sq, hq, d).astype(q.dtype)


def key_block_count(keys: KeyChunk, options: TileOptions) -> int:
    """The key blocks of a chunk: a tile holds at most `block_size` keys and no
    more than the chunk's (`_key_blocks`)."""
    length = keys.chunk.length
    return -(-length // min(options.block_size, length))


def _keys_allowed(qpos: Array, kpos: Array, length: int, causal: bool) -> Array:
    # Keys past the chunk's end are padding; causal keeps keys at or before the query.
    real = (kpos < length)[None, :]
    return real & (kpos[None, :] <= qpos[:, None]) if causal else real


def _tile_masks(queries: QueryChunk, keys: KeyChunk, block: int, options: TileOptions):
    """The mask makers of the pair: key block `j` -> its `(q, block)` keep-mask,
    from the global positions of both chunks; with segment ids `(b, 1, 1, q,
    block)`, also keeping only keys of the query's segment. And `j` -> the tile's
    dropout scale from the query rows' hashes and the keys' global positions (None
    without dropout)."""
    qs, ks = queries.chunk, keys.chunk
    qpos = qs.start + jnp.arange(qs.length)
    kseg = keys.segment_ids
    if kseg is not None:
        # Padded to whole blocks like the keys; the padding keys are dropped by `real`.
        kseg = jnp.pad(kseg, ((0, 0), (0, -ks.length % block)))

    def allowed(j):
        local = j * block + jnp.arange(block)
        keep = _keys_allowed(qpos - ks.start, local, ks.length, options.causal)
        if kseg is None:
            return keep
        same = segment_allowed(queries.segment_ids, lax.dynamic_slice_in_dim(kseg, j * block, block, axis=1))
        return keep[None, None, None] & same

    def drop(j):
        if queries.dropout_rows is None:
            return None
        return dropout_scale(
            queries.dropout_rows, ks.start + j * block + jnp.arange(block), options.dropout_rate
        )

    return allowed, drop


class _KeyBlocks(NamedTuple):
    """A key chunk's keys and values in blocks `(count, b, size, hkv, d)`, in the
    accumulation dtype, padded to whole blocks."""

    size: int
    count: int
    k: Array
    v: Array

    def at(self, j: Array) -> tuple[Array, Array]:
        return lax.dynamic_index_in_dim(self.k, j, keepdims=False), lax.dynamic_index_in_dim(
            self.v, j, keepdims=False
        )


def _key_blocks(keys: KeyChunk, options: TileOptions) -> _KeyBlocks:
    # A tile holds at most `block_size` keys and no more than the chunk's.
    size = min(options.block_size, keys.chunk.length)
    kb, count = key_blocks(keys.k, size, accumulation_dtype(keys.k.dtype))
    vb, _ = key_blocks(keys.v, size, accumulation_dtype(keys.v.dtype))
    return _KeyBlocks(size, count, kb, vb)


def fold_key_blocks(
    state: tuple, queries: QueryChunk, keys: KeyChunk, options: TileOptions, trips: Array | None = None
) -> tuple:
    """Fold the keys and values of `keys` into the online softmax `state` = (acc,
    max, sum) of `queries`, one block at a time: every block, or the first `trips`
    (a traced count; 0 for a pair the causal mask empties on this device)."""
    blocks = _key_blocks(keys, options)
    allowed_at, drop_at = _tile_masks(queries, keys, blocks.size, options)

    def step(j, state):
        kj, vj = blocks.at(j)
        allowed = allowed_at(j)
        s = tile_scores(queries.grouped, kj)
        s = jnp.where(allowed, s, jnp.finfo(s.dtype).min)
        return fold_tile(state, s, allowed, vj, drop_at(j))

    return lax.fori_loop(0, blocks.count if trips is None else trips, step, state)


def key_block_grads(
    grads: tuple,
    queries: QueryChunk,
    keys: KeyChunk,
    rows: RowGrads,
    options: TileOptions,
    trips: Array | None = None,
) -> tuple:
    """Add the gradients of the tiles of (`queries`, `keys`) to `grads` = (dq, dk,
    dv): dq for the grouped, scaled queries, dk and dv for the keys (float32), over
    every key block or the first `trips` (as `fold_key_blocks`)."""
    dq, dk, dv = grads
    blocks = _key_blocks(keys, options)
    allowed_at, drop_at = _tile_masks(queries, keys, blocks.size, options)
    length, size = keys.chunk.length, blocks.size
    pad = ((0, 0), (0, blocks.count * size - length), (0, 0), (0, 0))

    def step(j, carry):
        dq, dk, dv = carry
        kj, vj = blocks.at(j)
        s = tile_scores(queries.grouped, kj)
        p = jnp.where(allowed_at(j), jnp.exp(s - rows.lse[..., None]), 0.0)
        dvj, ds = value_and_score_grads(p, drop_at(j), rows.do, vj, rows.delta)
        dqj, dkj = query_and_key_grads(ds, queries.grouped, kj)

        def add(acc, x):
            return lax.dynamic_update_slice_in_dim(
                acc, lax.dynamic_slice_in_dim(acc, j * size, size, 1) + x, j * size, 1
            )

        return dq + dqj, add(dk, dkj), add(dv, dvj)

    trips = blocks.count if trips is None else trips
    dq, dk, dv = lax.fori_loop(0, trips, step, (dq, jnp.pad(dk, pad), jnp.pad(dv, pad)))
    return dq, dk[:, :length], dv[:, :length]
