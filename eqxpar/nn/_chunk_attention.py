"""Attention between this device's query chunks and a set of key chunks, with no
communication: the forward fold and the backward gradients of every (query
chunk, key chunk) pair, through the tile kernel (`_attention_tiles.py`). The ring
calls them once per visiting key/value block, the all-gather strategy once for
all of them.

Causally masked work is skipped: a pair whose keys all come after its queries
runs no tile. The chunks are the layout's (two per device when load-balanced),
so with `load_balanced=True` each ring step after the first does half of a full
tile on every device.
"""

import jax.numpy as jnp
from jaxtyping import Array

from ._attention_tiles import (
    KeyChunk,
    QueryChunk,
    RowGrads,
    fold_key_blocks,
    key_block_count,
    key_block_grads,
)
from ._flash_tile import TileOptions, accumulation_dtype, empty_softmax_state


def _pair_needed(queries: QueryChunk, keys: KeyChunk, options: TileOptions) -> Array | bool:
    # Whether any key of the pair is at or before one of its queries: a Python bool
    # when the positions are static, traced when they depend on axis_index.
    if not options.causal:
        return True
    qs, ks = queries.chunk, keys.chunk
    needed = ks.start <= qs.start + (qs.length - 1)
    return needed if isinstance(needed, bool) else jnp.asarray(needed)


def _unless_masked(run, carry, queries: QueryChunk, keys: KeyChunk, options: TileOptions):
    """`run(carry)` over the pair's key blocks, or `carry` unchanged for a pair the
    causal mask empties: decided at trace time when the positions are static,
    else by a tile loop of 0 trips. Not a `lax.cond`: inside a scanned stack of
    layers XLA:CPU gives every conditional its own buffers, and a causal ring has
    one per chunk pair and step, which made temp memory grow with the context size."""
    needed = _pair_needed(queries, keys, options)
    if isinstance(needed, bool):
        return run(carry) if needed else carry
    return run(carry, trips=jnp.where(needed, key_block_count(keys, options), 0))


def empty_states(queries: list[QueryChunk]) -> list[tuple]:
    """The online softmax of every query chunk before any key."""
    return [empty_softmax_state(qc.grouped) for qc in queries]


def fold_chunks(
    states: list[tuple], queries: list[QueryChunk], keys: list[KeyChunk], options: TileOptions
) -> list[tuple]:
    """Fold every key chunk into every query chunk's online softmax `states`."""
    states = list(states)
    for i, qc in enumerate(queries):
        for kc in keys:

            def run(state, trips=None, qc=qc, kc=kc):
                return fold_key_blocks(state, qc, kc, options, trips)

            states[i] = _unless_masked(run, states[i], qc, kc, options)
    return states


def finish_softmax(states: list[tuple], q: Array) -> tuple[Array, Array, Array]:
    """The output in q's layout and dtype, and per-query float32 `o` and log-sum-exp
    `(b, hkv, g, sq)` (chunks concatenated) for the backward pass."""
    b, sq, hq, d = q.shape
    o = jnp.concatenate([acc / total[..., None] for acc, _, total in states], axis=3)
    lse = jnp.concatenate([m + jnp.log(total) for _, m, total in states], axis=3)
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d).astype(q.dtype)
    return out, o, lse


def chunk_grads(
    queries: list[QueryChunk], rows: list[RowGrads], keys: list[KeyChunk], options: TileOptions
) -> tuple[Array, Array, Array]:
    """(dq of all the queries, dk, dv of all the keys), float32, the chunks
    concatenated; dq is with respect to the grouped, scaled queries."""
    dqs = [jnp.zeros_like(qc.grouped) for qc in queries]
    dks = [jnp.zeros_like(kc.k, dtype=accumulation_dtype(kc.k.dtype)) for kc in keys]
    dvs = [jnp.zeros_like(kc.v, dtype=accumulation_dtype(kc.v.dtype)) for kc in keys]
    for i, (qc, rc) in enumerate(zip(queries, rows, strict=True)):
        for j, kc in enumerate(keys):

            def run(grads, trips=None, qc=qc, rc=rc, kc=kc):
                return key_block_grads(grads, qc, kc, rc, options, trips)

            dqs[i], dks[j], dvs[j] = _unless_masked(run, (dqs[i], dks[j], dvs[j]), qc, kc, options)
    return jnp.concatenate(dqs, axis=1), jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)
