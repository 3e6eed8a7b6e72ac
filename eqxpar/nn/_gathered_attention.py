"""All-gather context attention (`context_attention(impl="allgather")`): every
device's keys and values gathered once (tiled `all_gather`, by the caller, so that
its transpose, a reduce-scatter of dK/dV, is the backward's), then attended
locally with the right global positions. The backward pass (a custom VJP)
recomputes the tiles from the saved gathered keys and values."""

import functools

import jax
from jax import lax

from .._collectives import all_gather
from ._attention_tiles import backward_inputs, grouped_queries, key_chunks, query_chunks, query_grad
from ._chunk_attention import chunk_grads, empty_states, finish_softmax, fold_chunks
from ._context_options import ContextOptions
from ._sequence_layout import device_chunks, gathered_chunks


def _layout(q, options: ContextOptions):
    """This device's query chunks and the gathered keys' chunks (device order)."""
    n, me = lax.axis_size(options.axis), lax.axis_index(options.axis)
    length = q.shape[1]
    return device_chunks(me, length, n, options.chunked), gathered_chunks(length, n, options.chunked)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def gathered_attention(q, k_all, v_all, segment_ids, dropout_rows, options: ContextOptions):
    """This device's output of attention over every device's keys and values
    `k_all`, `v_all` (gathered along the sequence, in device order), from its
    chunk of `q` and `segment_ids` (gathered here: integers, no gradient) and the
    queries' dropout row hashes."""
    return _gathered_fwd(q, k_all, v_all, segment_ids, dropout_rows, options)[0]


def _gathered_fwd(q, k_all, v_all, seg, rows, options: ContextOptions):
    seg_all = None if seg is None else all_gather(seg, axis_name=options.axis, axis=1)
    qchunks, kchunks = _layout(q, options)
    queries = query_chunks(grouped_queries(q, k_all.shape[2]), qchunks, seg, rows)
    keys = key_chunks(k_all, v_all, kchunks, seg_all)
    states = fold_chunks(empty_states(queries), queries, keys, options.tiles)
    out, o, lse = finish_softmax(states, q)
    return out, (q, k_all, v_all, seg, seg_all, rows, o, lse)


def _gathered_bwd(options: ContextOptions, res, dout):
    q, k_all, v_all, seg, seg_all, rows, o, lse = res
    qchunks, kchunks = _layout(q, options)
    qg, grads = backward_inputs(q, o, lse, dout, k_all.shape[2])
    queries = query_chunks(qg, qchunks, seg, rows)
    keys = key_chunks(k_all, v_all, kchunks, seg_all)
    dq, dk, dv = chunk_grads(queries, [grads.cut(c) for c in qchunks], keys, options.tiles)
    return query_grad(dq, q), dk.astype(k_all.dtype), dv.astype(v_all.dtype), None, None


gathered_attention.defvjp(_gathered_fwd, _gathered_bwd)
