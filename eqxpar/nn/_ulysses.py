"""Ulysses context attention (`context_attention(impl="ulysses")`): all-to-alls
turn q, k, v (this device's chunk of the sequence, every head) into the whole
sequence for `heads / n` heads (key/value heads repeated to `lcm(kv_heads, n)`
first when `n` does not divide them); the chunks arrive in layout order and are
put back in global order (static slices); attention runs as a scan over query
pieces, each folding only the key blocks at or before it under a causal mask
(custom VJP, the ring's tile kernel); the output is put back in layout order and
returned to the sequence split by one more all-to-all. The backward pass is the
four all-to-alls transposed.
"""

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from .._collectives import all_gather, all_to_all
from .._errors import DivisibilityError
from ._attention_tiles import (
    KeyChunk,
    QueryChunk,
    RowGrads,
    backward_inputs,
    fold_key_blocks,
    grouped_queries,
    key_block_grads,
    query_grad,
)
from ._blockwise import dropout_rows
from ._context_options import ContextOptions
from ._flash_tile import TileOptions, accumulation_dtype, empty_softmax_state
from ._sequence_layout import Chunk, chunk_order, inverse_order, reorder_chunks


class DropoutHash(NamedTuple):
    """Where the dropout hash starts: its uint32 `seed` and the global index of
    this device's first query head, `head_offset`."""

    seed: Array
    head_offset: Array | int


def check_local_heads_split(heads: int, n: int, axis: str) -> None:
    if heads % n:
        raise DivisibilityError(
            f"context_attention(impl='ulysses'): this device's {heads} query heads do not split over the "
            f"{n} devices of mesh axis {axis!r}: Ulysses gives each device heads / {n} of them for the "
            f"whole sequence. Use a number of heads (per device, after any tensor split) that is a "
            f"multiple of {n}, a {axis!r} axis whose size divides {heads}, or impl='ring' / 'allgather'."
        )


def _piece_length(length: int, local: int, block: int) -> int:
    """The length of Ulysses' query pieces and key blocks over the whole sequence
    (`length`): the largest divisor of it up to `block_size` and half the local
    chunk (`local`). A tile is one piece by one block, so tiles stay the ring's
    size or smaller as sequence and context grow together, and the causal mask
    skips all but the diagonal's share of the blocks above it."""
    limit = max(1, min(block, local // 2 or 1))
    return max(p for p in range(1, limit + 1) if length % p == 0)


def _ulysses_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    # The key/value heads Ulysses moves: lcm(kv_heads, n), each head repeated when
    # n does not divide kv_heads (grouped-query, fewer key/value heads than devices).
    # Every device then holds whole query groups with the key/value heads they read,
    # and receives what it must: the whole sequence of those heads.
    return math.lcm(kv_heads, n) if heads % n == 0 else kv_heads


def _query_piece(i, grouped, segment_ids, rows, options: TileOptions) -> QueryChunk:
    # Query piece i (of `block_size` positions) of the grouped, scaled queries,
    # their segment ids and dropout rows.
    piece = options.block_size
    cut = functools.partial(lax.dynamic_slice_in_dim, start_index=i * piece, slice_size=piece)
    return QueryChunk(
        Chunk(0, piece, i * piece),
        cut(grouped, axis=1),
        None if segment_ids is None else cut(segment_ids, axis=1),
        None if rows is None else cut(rows, axis=3),
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _sequence_attention(q, k, v, segment_ids, rows, options: TileOptions):
    return _sequence_fwd(q, k, v, segment_ids, rows, options)[0]


def _sequence_fwd(q, k, v, seg, rows, options: TileOptions):
    """Attention over the whole, globally ordered sequence of this device's heads:
    a scan over query pieces of `block_size`, each folding the key blocks up to its
    own (causal: the later ones run no trip) or all of them, one tile at a time."""
    b, length, hq, d = q.shape
    qg = grouped_queries(q, k.shape[2])
    keys = KeyChunk(Chunk(0, length, 0), k, v, seg)

    def step(_, i):
        queries = _query_piece(i, qg, seg, rows, options)
        trips = i + 1 if options.causal else None
        acc, m, total = fold_key_blocks(empty_softmax_state(queries.grouped), queries, keys, options, trips)
        return None, (acc / total[..., None], m + jnp.log(total))

    _, (o, lse) = lax.scan(step, None, jnp.arange(length // options.block_size))
    # (pieces, b, hkv, g, piece[, d]) -> (b, hkv, g, seq[, d]), as `finish_softmax` gives.
    o = jnp.moveaxis(o, 0, 3).reshape(*o.shape[1:4], length, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(*lse.shape[1:4], length)
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, length, hq, d).astype(q.dtype)
    return out, (q, k, v, seg, rows, o, lse)


def _sequence_bwd(options: TileOptions, res, dout):
    q, k, v, seg, rows, o, lse = res
    length, piece = q.shape[1], options.block_size
    qg, grads = backward_inputs(q, o, lse, dout, k.shape[2])
    keys = KeyChunk(Chunk(0, length, 0), k, v, seg)

    def step(dkv, i):
        queries = _query_piece(i, qg, seg, rows, options)
        cut = functools.partial(lax.dynamic_slice_in_dim, start_index=i * piece, slice_size=piece)
        piece_rows = RowGrads(cut(grads.do, axis=1), cut(grads.lse, axis=3), cut(grads.delta, axis=3))
        trips = i + 1 if options.causal else None
        dq, dk, dv = key_block_grads(
            (jnp.zeros_like(queries.grouped), *dkv), queries, keys, piece_rows, options, trips
        )
        return (dk, dv), dq

    zeros = (
        jnp.zeros_like(k, dtype=accumulation_dtype(k.dtype)),
        jnp.zeros_like(v, dtype=accumulation_dtype(k.dtype)),
    )
    (dk, dv), dq = lax.scan(step, zeros, jnp.arange(length // piece))
    dq = jnp.moveaxis(dq, 0, 1).reshape(qg.shape)
    return query_grad(dq, q), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_sequence_attention.defvjp(_sequence_fwd, _sequence_bwd)


def ulysses_attention(q, k, v, segment_ids, dropout: DropoutHash | None, options: ContextOptions) -> Array:
    """Sequence-split q, k, v -> head-split over the whole sequence by all-to-all,
    attention there (`_sequence_attention`), and the output back to sequence-split.
    `dropout`: the hash's seed and head offset, None without dropout."""
    n, me = lax.axis_size(options.axis), lax.axis_index(options.axis)
    b, _, hq, _ = q.shape
    # The all-to-all concatenates the devices' chunks in device order: the layout's
    # chunk order, which the causal mask and dropout need back in global order.
    order = chunk_order(n, options.load_balanced) if options.chunked else None
    inverse = None if order is None else inverse_order(order)
    hkv = _ulysses_kv_heads(hq, k.shape[2], n)
    if hkv != k.shape[2]:
        # Fewer key/value heads than devices: repeat each so that every device gets
        # the heads its query heads read (query head i reads i // (hq / hkv) either way).
        k, v = (jnp.repeat(x, hkv // x.shape[2], axis=2) for x in (k, v))

    def to_heads(x):
        x = all_to_all(x, axis_name=options.axis, split_axis=2, concat_axis=1)
        return x if inverse is None else reorder_chunks(x, inverse)

    qf, kf, vf = (to_heads(x) for x in (q, k, v))
    seg_all = None
    if segment_ids is not None:
        seg_all = all_gather(segment_ids, axis_name=options.axis, axis=1)
        seg_all = seg_all if inverse is None else reorder_chunks(seg_all, inverse)
    rows = None
    if options.dropout_rate > 0:
        heads = hq // n
        offset = dropout.head_offset + me * heads
        rows = dropout_rows(dropout.seed, b, heads, hkv // n, offset, jnp.arange(qf.shape[1]))
    piece = _piece_length(qf.shape[1], q.shape[1], options.block_size)
    tiles = TileOptions(options.causal, piece, options.dropout_rate)
    out = _sequence_attention(qf, kf, vf, seg_all, rows, tiles)
    out = out if order is None else reorder_chunks(out, order)
    return all_to_all(out, axis_name=options.axis, split_axis=1, concat_axis=2)
