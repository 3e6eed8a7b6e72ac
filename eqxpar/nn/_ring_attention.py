"""Ring attention (`context_attention(impl="ring")`): keys and values travel
around the ring with `ppermute` (`i -> i+1`, `n-1` transfers), each device
folding every visiting block into a float32 online softmax per query. The
transfer of the next block is issued before the current one is used, so it can
overlap the compute.

The backward pass (a custom VJP) recomputes each tile's probabilities from the
saved local `q`, `k`, `v`, output and log-sum-exp, and sends the keys and values
around again with float32 dK/dV accumulators travelling alongside: the
accumulator of device `j`'s block starts at `j+1` and reaches `j` after `n-1`
hops, `j` adding its own share locally, so dK/dV cost `n-1` transfers as K/V do.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array

from ._attention_tiles import backward_inputs, grouped_queries, key_chunks, query_chunks, query_grad
from ._chunk_attention import chunk_grads, empty_states, finish_softmax, fold_chunks
from ._context_options import ContextOptions
from ._sequence_layout import device_chunks


def _ring_layout(q: Array, options: ContextOptions):
    """The ring's size `n`, this device's index, device -> the chunks of its
    local sequence, and the ring's `ppermute` pairs."""
    n = lax.axis_size(options.axis)
    me = lax.axis_index(options.axis)
    length = q.shape[1]

    def chunks(device):
        return device_chunks(device, length, n, options.chunked)

    return n, me, chunks, [(j, (j + 1) % n) for j in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def ring_attention(q, k, v, segment_ids, dropout_rows, options: ContextOptions):
    """This device's output of ring attention (see the module docstring), from its
    chunk of `q`, `k`, `v`, `segment_ids` and the queries' dropout row hashes."""
    return _ring_fwd(q, k, v, segment_ids, dropout_rows, options)[0]


def _ring_fwd(q, k, v, seg, rows, options: ContextOptions):
    n, me, chunks, right = _ring_layout(q, options)
    queries = query_chunks(grouped_queries(q, k.shape[2]), chunks(me), seg, rows)
    states = empty_states(queries)
    # The keys' segment ids (int32, b x seq: small next to K/V) travel with them.
    kv = (k, v, seg)
    for t in range(n):
        # Issue the next block's transfer first: nothing below waits for it.
        nxt = lax.ppermute(kv, options.axis, right) if t < n - 1 else None
        states = fold_chunks(states, queries, key_chunks(*kv[:2], chunks((me - t) % n), kv[2]), options.tiles)
        kv = nxt
    out, o, lse = finish_softmax(states, q)
    return out, (q, k, v, seg, rows, o, lse)


def _ring_bwd(options: ContextOptions, res, dout):
    q, k, v, seg, rows, o, lse = res
    n, me, chunks, right = _ring_layout(q, options)
    qg, grads = backward_inputs(q, o, lse, dout, k.shape[2])
    queries = query_chunks(qg, chunks(me), seg, rows)
    query_rows = [grads.cut(qc.chunk) for qc in queries]
    dq = jnp.zeros_like(qg)
    # K and V travel stacked here (separately in the forward): otherwise XLA merges
    # these transfers with the forward's identical ones and keeps every visiting
    # block alive until the backward, n x the local K/V, which a ring must not hold.
    kv, kseg, own, carried = jnp.stack((k, v)), seg, None, None
    for t in range(n):
        nxt = lax.ppermute((kv, kseg), options.axis, right) if t < n - 1 else None
        keys = key_chunks(kv[0], kv[1], chunks((me - t) % n), kseg)
        dq_t, dk_t, dv_t = chunk_grads(queries, query_rows, keys, options.tiles)
        dq = dq + dq_t
        if t == 0:
            own = jnp.stack((dk_t, dv_t))  # this device's block: its owner's share never travels
        else:
            # The accumulator of the block held at step t starts at device owner+1
            # (step 1) and follows the block; after step n-1 it reaches the owner.
            acc = jnp.stack((dk_t, dv_t)) if carried is None else carried + jnp.stack((dk_t, dv_t))
            carried = lax.ppermute(acc, options.axis, right)
        kv, kseg = nxt if nxt is not None else (None, None)
    dkv = own if carried is None else own + carried
    return query_grad(dq, q), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


ring_attention.defvjp(_ring_fwd, _ring_bwd)
