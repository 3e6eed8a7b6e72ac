"""Context-parallel attention: the sequence split over a mesh axis, keys and values
moving between the devices (ring attention) or gathered once, or the sequence
split traded for a head split by all-to-all (Ulysses).

Inside a manual region (`jax.shard_map`) over `axis` (default `"context"`), every
device holds one chunk of the sequence: its queries, keys and values.
`context_attention` returns what dense attention over the whole, globally ordered
sequence gives for this device's queries.

Layouts: `_sequence_layout.py` (the load-balanced order, `context_layout`,
`context_unlayout`, `context_positions`).

Implementations:

- `"ring"`: keys and values travel around the ring with `ppermute` (`i -> i+1`,
  `n-1` transfers), each device folding every visiting block into a float32
  online softmax per query. The transfer of the next block is issued before the
  current one is used, so it can overlap the compute. The backward pass (a custom
  VJP) recomputes each tile's probabilities from the saved local `q`, `k`, `v`,
  output and log-sum-exp, and sends the keys and values around again with float32
  dK/dV accumulators travelling alongside: the accumulator of device `j`'s block
  starts at `j+1` and reaches `j` after `n-1` hops, `j` adding its own share
  locally, so dK/dV cost `n-1` transfers as K/V do.
- `"allgather"`: gather all keys and values once (tiled `all_gather`), then attend
  locally with the right global positions; the backward pass reduce-scatters dK/dV
  (the transpose of the gather).
- `"ulysses"`: all-to-alls turn q, k, v (this device's chunk, every head) into the
  whole sequence for `heads / n` heads (key/value heads repeated to
  `lcm(kv_heads, n)` first when `n` does not divide them); the chunks arrive in
  layout order and are put back in global order (static slices); attention runs
  as a scan over query pieces, each folding only the key blocks at or before it
  under a causal mask (custom VJP, the same tiles as the ring); the output is put
  back in layout order and returned to the sequence split by one more all-to-all.
  The backward pass is the four all-to-alls transposed.

Dropout on the probabilities (`dropout`, `key`) keeps each by a hash of (seed,
batch row, global head, global query position, global key position), the mask
`blockwise_attention` and dense attention use, so the result equals one device's
for the same key, in any layout (positions are then tracked even without `causal`).

Causally masked work is skipped: every pair of (query segment, key segment) whose
keys all come after its queries is a `lax.cond` that does nothing. Segments are the
layout's chunks (two per device when load-balanced), so with `load_balanced=True`
each ring step after the first does half of a full tile on every device.
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._collectives import all_gather, all_to_all
from .._errors import DivisibilityError, PlanError, SpecError
from .._varying import mark_varying, varying_axes
from ._blockwise import (
    accumulation_dtype,
    check_dropout,
    check_segment_ids,
    dropout_rows,
    dropout_scale,
    dropout_seed,
    fold_tile,
    segment_allowed,
)
from ._sequence_layout import (
    _check_even,
    _chunk_order,
    _context_size,
    _Seg,
    _segments,
    context_positions,
)

_IMPLS = ("ring", "allgather", "ulysses")

# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check(q: Array, k: Array, v: Array, impl: str, block_size: int) -> None:
    fn = "context_attention"
    if impl not in _IMPLS:
        raise PlanError(f"{fn}: impl={impl!r}; expected one of {_IMPLS}.")
    if block_size < 1:
        raise PlanError(f"{fn}: block_size={block_size}; expected a positive number of keys per block.")
    b, sq, hq, d = q.shape
    hkv = k.shape[2]
    if k.shape != (b, sq, hkv, d) or v.shape != k.shape:
        raise SpecError(
            f"{fn}: q {q.shape}, k {k.shape}, v {v.shape} do not match; expected k and v of "
            f"shape (batch, seq, kv_heads, head_dim) = ({b}, {sq}, kv_heads, {d}): the same "
            f"local chunk of the sequence as q."
        )
    if hq % hkv:
        raise SpecError(
            f"{fn}: {hq} query heads are not a multiple of {hkv} key/value heads; use a "
            f"number of key/value heads that divides {hq}."
        )


# ---------------------------------------------------------------------------
# Tile kernels (no communication)
# ---------------------------------------------------------------------------


def _kv_blocks(x: Array, block: int) -> tuple[Array, int]:
    # (b, L, h, d) -> float32 (nb, b, block, h, d), padded to whole blocks.
    b, length, h, d = x.shape
    nb = -(-length // block)
    x = jnp.pad(x.astype(accumulation_dtype(x.dtype)), ((0, 0), (0, nb * block - length), (0, 0), (0, 0)))
    return x.reshape(b, nb, block, h, d).swapaxes(0, 1), nb


def _allowed(qpos: Array, kpos: Array, length: int, causal: bool) -> Array:
    # Keys past the segment's end are padding; causal keeps keys at or before the query.
    real = (kpos < length)[None, :]
    return real & (kpos[None, :] <= qpos[:, None]) if causal else real


def _tiles(qs: _Seg, ks: _Seg, block: int, causal: bool, qseg: Array | None, kseg: Array | None, rows, rate):
    """The mask makers of the pair: sub-block `j` of the key segment -> its
    `(q, block)` keep-mask, from the global positions of both segments; with
    segment ids (`qseg`, `kseg`: the pair's `(b, length)` ids) `(b, 1, 1, q, block)`,
    also keeping only keys of the query's segment. And `j` -> the tile's dropout
    scale from the query rows' hashes `rows` and the keys' global positions (None
    without dropout)."""
    qpos = qs.start + jnp.arange(qs.length)
    if kseg is not None:
        # Padded to whole blocks like the keys; the padding keys are dropped by `real`.
        kseg = jnp.pad(kseg, ((0, 0), (0, -ks.length % block)))

    def allowed(j):
        local = j * block + jnp.arange(block)
        keep = _allowed(qpos - ks.start, local, ks.length, causal)
        if kseg is None:
            return keep
        same = segment_allowed(qseg, lax.dynamic_slice_in_dim(kseg, j * block, block, axis=1))
        return keep[None, None, None] & same

    def drop(j):
        if rows is None:
            return None
        return dropout_scale(rows, ks.start + j * block + jnp.arange(block), rate)

    return allowed, drop


def _tile_trips(nb: int, needed: Array | bool) -> Array | int:
    # A pair that is fully masked on this device runs no tile: a loop of 0 trips.
    # Not a `lax.cond`: inside a scanned stack of layers XLA:CPU gives every
    # conditional its own buffers, and a causal ring has one per chunk pair and
    # step, which made temp memory grow with the context size.
    return nb if needed is True else jnp.where(needed, nb, 0)


def _fwd_tiles(
    state, qg: Array, k: Array, v: Array, qs: _Seg, ks: _Seg, causal: bool, block: int,
    qseg=None, kseg=None, rows=None, rate=0.0, needed: Array | bool = True, trips: Array | None = None,
):  # fmt: skip
    """Fold the keys `k`, `v` of segment `ks` into the online softmax `state` =
    (acc, max, sum) of the (pre-scaled, grouped) queries `qg` of segment `qs`
    (none of them where the traced `needed` is False; only the first `trips`
    blocks when given)."""
    block = min(block, ks.length)
    kb, nb = _kv_blocks(k, block)
    vb, _ = _kv_blocks(v, block)
    allowed_at, drop_at = _tiles(qs, ks, block, causal, qseg, kseg, rows, rate)

    def step(j, state):
        kj, vj = (
            lax.dynamic_index_in_dim(kb, j, keepdims=False),
            lax.dynamic_index_in_dim(vb, j, keepdims=False),
        )
        allowed = allowed_at(j)
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kj)
        s = jnp.where(allowed, s, jnp.finfo(s.dtype).min)
        return fold_tile(state, s, allowed, vj, drop_at(j))

    return lax.fori_loop(0, _tile_trips(nb, needed) if trips is None else trips, step, state)


def _bwd_tiles(
    grads, qg, do, lse, delta, k, v, qs: _Seg, ks: _Seg, causal: bool, block: int,
    qseg=None, kseg=None, rows=None, rate=0.0, needed: Array | bool = True, trips: Array | None = None,
):  # fmt: skip
    """Add the gradients of the tiles of (`qs`, `ks`) to `grads` = (dq, dk, dv):
    dq for the queries of `qs` (pre-scaled), dk and dv for the keys of `ks` (nothing
    where the traced `needed` is False; only the first `trips` blocks when given)."""
    dq, dk, dv = grads
    length = ks.length
    block = min(block, length)
    kb, nb = _kv_blocks(k, block)
    vb, _ = _kv_blocks(v, block)
    allowed_at, drop_at = _tiles(qs, ks, block, causal, qseg, kseg, rows, rate)
    pad = ((0, 0), (0, nb * block - length), (0, 0), (0, 0))

    def step(j, carry):
        dq, dk, dv = carry
        kj, vj = (
            lax.dynamic_index_in_dim(kb, j, keepdims=False),
            lax.dynamic_index_in_dim(vb, j, keepdims=False),
        )
        allowed, drop = allowed_at(j), drop_at(j)
        s = jnp.einsum("bqkgd,bskd->bkgqs", qg, kj)
        p = jnp.where(allowed, jnp.exp(s - lse[..., None]), 0.0)
        # Dropout Z: dV = (P * Z)^T dO, dP = (dO V^T) * Z; dS as without (delta
        # is rowsum(dO * O) of the dropped output).
        dvj = jnp.einsum("bkgqs,bqkgd->bskd", p if drop is None else p * drop, do)
        dp = jnp.einsum("bqkgd,bskd->bkgqs", do, vj)
        dp = dp if drop is None else dp * drop
        ds = p * (dp - delta[..., None])
        dq = dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj)
        dkj = jnp.einsum("bkgqs,bqkgd->bskd", ds, qg)

        def add(acc, x):
            return lax.dynamic_update_slice_in_dim(
                acc, lax.dynamic_slice_in_dim(acc, j * block, block, 1) + x, j * block, 1
            )

        return dq, add(dk, dkj), add(dv, dvj)

    trips = _tile_trips(nb, needed) if trips is None else trips
    dq, dk, dv = lax.fori_loop(0, trips, step, (dq, jnp.pad(dk, pad), jnp.pad(dv, pad)))
    return dq, dk[:, :length], dv[:, :length]


def _unless_masked(needed, f, x):
    # Skip a fully masked pair: a Python bool decides at trace time, a traced one
    # (positions depend on axis_index) sets the pair's tile loop to 0 trips (`_tile_trips`).
    if isinstance(needed, bool):
        return f(x) if needed else x
    return f(x, needed=needed)


def _needed(qs: _Seg, ks: _Seg, causal: bool):
    if not causal:
        return True
    needed = ks.start <= qs.start + (qs.length - 1)
    return needed if isinstance(needed, bool) else jnp.asarray(needed)


def _segment_slice(x: Array | None, seg: _Seg, axis: int = 1) -> Array | None:
    if x is None:
        return None
    return lax.slice_in_dim(x, seg.offset, seg.offset + seg.length, axis=axis)


# ---------------------------------------------------------------------------
# Forward / backward over segments
# ---------------------------------------------------------------------------


def _grouped(q: Array, hkv: int) -> Array:
    # (b, s, hq, d) -> float32 (b, s, hkv, g, d), scaled by 1/sqrt(d) once.
    b, s, hq, d = q.shape
    acc = accumulation_dtype(q.dtype)
    return q.astype(acc).reshape(b, s, hkv, hq // hkv, d) / jnp.sqrt(jnp.asarray(d, acc))


def _init_state(qg: Array, qsegs: list[_Seg]) -> list[tuple]:
    # Built from qg (zeros_like) so that inside shard_map it varies like qg.
    states = []
    for qs in qsegs:
        acc = jnp.zeros_like(_segment_slice(qg, qs)).transpose(0, 2, 3, 1, 4)  # (b, hkv, g, sq, d)
        states.append((acc, jnp.full_like(acc[..., 0], -jnp.inf), jnp.zeros_like(acc[..., 0])))
    return states


def _fold(states, qg, qsegs, k, v, ksegs, causal, block, qseg=None, kseg=None, rows=None, rate=0.0):
    """Fold keys/values (segments `ksegs` of `k`, `v`; their segment ids `kseg`)
    into every query segment's state (the queries' segment ids `qseg`)."""
    states = list(states)
    for i, qs in enumerate(qsegs):
        qgi = _segment_slice(qg, qs)
        for ks in ksegs:
            f = functools.partial(
                _fwd_tiles, qg=qgi, k=_segment_slice(k, ks), v=_segment_slice(v, ks), qs=qs, ks=ks,
                causal=causal, block=block, qseg=_segment_slice(qseg, qs), kseg=_segment_slice(kseg, ks),
                rows=_segment_slice(rows, qs, 3), rate=rate,
            )  # fmt: skip
            states[i] = _unless_masked(_needed(qs, ks, causal), f, states[i])
    return states


def _finish(states, q: Array):
    """The output in q's layout and dtype, and per-query float32 `o` and log-sum-exp
    `(b, hkv, g, sq)` (segments concatenated) for the backward pass."""
    b, sq, hq, d = q.shape
    o = jnp.concatenate([acc / total[..., None] for acc, _, total in states], axis=3)
    lse = jnp.concatenate([m + jnp.log(total) for _, m, total in states], axis=3)
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, sq, hq, d).astype(q.dtype)
    return out, o, lse


def _grads(qg, do, lse, delta, qsegs, k, v, ksegs, causal, block, qseg=None, kseg=None, rows=None, rate=0.0):
    """(dq contribution over all of q, dk, dv of `k`, `v`) for one key/value block,
    all float32; dq is with respect to the pre-scaled queries."""
    dqs = [jnp.zeros_like(_segment_slice(qg, qs)) for qs in qsegs]
    dks = [jnp.zeros_like(_segment_slice(k, ks), dtype=accumulation_dtype(k.dtype)) for ks in ksegs]
    dvs = [jnp.zeros_like(_segment_slice(v, ks), dtype=accumulation_dtype(v.dtype)) for ks in ksegs]
    for i, qs in enumerate(qsegs):
        qgi, doi = _segment_slice(qg, qs), _segment_slice(do, qs)
        lsei, deltai = _segment_slice(lse, qs, 3), _segment_slice(delta, qs, 3)
        for j, ks in enumerate(ksegs):
            f = functools.partial(
                _bwd_tiles, qg=qgi, do=doi, lse=lsei, delta=deltai,
                k=_segment_slice(k, ks), v=_segment_slice(v, ks), qs=qs, ks=ks, causal=causal, block=block,
                qseg=_segment_slice(qseg, qs), kseg=_segment_slice(kseg, ks),
                rows=_segment_slice(rows, qs, 3), rate=rate,
            )  # fmt: skip
            dqs[i], dks[j], dvs[j] = _unless_masked(_needed(qs, ks, causal), f, (dqs[i], dks[j], dvs[j]))
    return jnp.concatenate(dqs, axis=1), jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)


def _bwd_setup(q, o, dout, hkv):
    b, sq, hq, d = q.shape
    do = dout.astype(o.dtype).reshape(b, sq, hkv, hq // hkv, d)
    delta = jnp.einsum("bqkgd,bkgqd->bkgq", do, o)  # rowsum(dO * O)
    return _grouped(q, hkv), do, delta


def _dq_out(dq: Array, q: Array) -> Array:
    # dq is w.r.t. the queries scaled by 1/sqrt(d): chain rule back to q.
    b, sq, hq, d = q.shape
    return (dq / jnp.sqrt(jnp.asarray(d, dq.dtype))).reshape(b, sq, hq, d).astype(q.dtype)


# ---------------------------------------------------------------------------
# Ring
# ---------------------------------------------------------------------------


def _ring_setup(q, axis, positional, load_balanced):
    n = lax.axis_size(axis)
    me = lax.axis_index(axis)
    length = q.shape[1]
    # Positions only matter for the causal mask and dropout; without them one
    # segment each.
    lb = load_balanced and positional

    def segs(device):
        return _segments(device, length, n, lb)

    return n, me, segs, [(j, (j + 1) % n) for j in range(n)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8, 9))
def _ring(q, k, v, seg, rows, axis, causal, load_balanced, block, rate):
    return _ring_fwd(q, k, v, seg, rows, axis, causal, load_balanced, block, rate)[0]


def _ring_fwd(q, k, v, seg, rows, axis, causal, load_balanced, block, rate):
    n, me, segs, right = _ring_setup(q, axis, causal or rows is not None, load_balanced)
    qg = _grouped(q, k.shape[2])
    qsegs = segs(me)
    states = _init_state(qg, qsegs)
    # The keys' segment ids (int32, b x seq: small next to K/V) travel with them.
    kv = (k, v, seg)
    for t in range(n):
        # Issue the next block's transfer first: nothing below waits for it.
        nxt = lax.ppermute(kv, axis, right) if t < n - 1 else None
        states = _fold(states, qg, qsegs, *kv[:2], segs((me - t) % n), causal, block, seg, kv[2], rows, rate)
        kv = nxt
    out, o, lse = _finish(states, q)
    return out, (q, k, v, seg, rows, o, lse)


def _ring_bwd(axis, causal, load_balanced, block, rate, res, dout):
    q, k, v, seg, rows, o, lse = res
    n, me, segs, right = _ring_setup(q, axis, causal or rows is not None, load_balanced)
    qg, do, delta = _bwd_setup(q, o, dout, k.shape[2])
    qsegs = segs(me)
    dq = jnp.zeros_like(qg)
    # K and V travel stacked here (separately in the forward): otherwise XLA merges
    # these transfers with the forward's identical ones and keeps every visiting
    # block alive until the backward, n x the local K/V, which a ring must not hold.
    kv, kseg, own, carried = jnp.stack((k, v)), seg, None, None
    for t in range(n):
        nxt = lax.ppermute((kv, kseg), axis, right) if t < n - 1 else None
        dq_t, dk_t, dv_t = _grads(
            qg, do, lse, delta, qsegs, kv[0], kv[1], segs((me - t) % n), causal, block, seg, kseg, rows, rate
        )
        dq = dq + dq_t
        if t == 0:
            own = jnp.stack((dk_t, dv_t))  # this device's block: its owner's share never travels
        else:
            # The accumulator of the block held at step t starts at device owner+1
            # (step 1) and follows the block; after step n-1 it reaches the owner.
            acc = jnp.stack((dk_t, dv_t)) if carried is None else carried + jnp.stack((dk_t, dv_t))
            carried = lax.ppermute(acc, axis, right)
        kv, kseg = nxt if nxt is not None else (None, None)
    dkv = own if carried is None else own + carried
    return _dq_out(dq, q), dkv[0].astype(k.dtype), dkv[1].astype(v.dtype), None, None


_ring.defvjp(_ring_fwd, _ring_bwd)

# ---------------------------------------------------------------------------
# All-gather
# ---------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _gathered(q, k_all, v_all, seg, seg_all, rows, axis, causal, load_balanced, block, rate):
    return _gathered_fwd(q, k_all, v_all, seg, seg_all, rows, axis, causal, load_balanced, block, rate)[0]


def _gathered_segs(q, axis, positional, load_balanced):
    n, me, segs, _ = _ring_setup(q, axis, positional, load_balanced)
    length = q.shape[1]
    lb = load_balanced and positional
    ksegs = [s for j in range(n) for s in _segments(j, length, n, lb, offset=j * length)]
    return segs(me), ksegs


def _gathered_fwd(q, k_all, v_all, seg, seg_all, rows, axis, causal, load_balanced, block, rate):
    qsegs, ksegs = _gathered_segs(q, axis, causal or rows is not None, load_balanced)
    qg = _grouped(q, k_all.shape[2])
    states = _init_state(qg, qsegs)
    states = _fold(states, qg, qsegs, k_all, v_all, ksegs, causal, block, seg, seg_all, rows, rate)
    out, o, lse = _finish(states, q)
    return out, (q, k_all, v_all, seg, seg_all, rows, o, lse)


def _gathered_bwd(axis, causal, load_balanced, block, rate, res, dout):
    q, k_all, v_all, seg, seg_all, rows, o, lse = res
    qsegs, ksegs = _gathered_segs(q, axis, causal or rows is not None, load_balanced)
    qg, do, delta = _bwd_setup(q, o, dout, k_all.shape[2])
    dq, dk, dv = _grads(
        qg, do, lse, delta, qsegs, k_all, v_all, ksegs, causal, block, seg, seg_all, rows, rate
    )
    return _dq_out(dq, q), dk.astype(k_all.dtype), dv.astype(v_all.dtype), None, None, None


_gathered.defvjp(_gathered_fwd, _gathered_bwd)

# ---------------------------------------------------------------------------
# Ulysses: all-to-all from sequence-split to head-split and back
# ---------------------------------------------------------------------------


def _piece(length: int, local: int, block: int) -> int:
    """The length of Ulysses' query pieces and key blocks over the whole sequence
    (`length`): the largest divisor of it up to `block_size` and half the local
    chunk (`local`). A tile is one piece by one block, so tiles stay the ring's
    size or smaller as sequence and context grow together, and the causal mask
    skips all but the diagonal's share of the blocks above it."""
    limit = max(1, min(block, local // 2 or 1))
    return max(p for p in range(1, limit + 1) if length % p == 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _whole(q, k, v, seg, rows, causal, piece, rate):
    return _whole_fwd(q, k, v, seg, rows, causal, piece, rate)[0]


def _piece_inputs(i, piece, qg, seg, rows):
    # Query piece i of the pre-scaled queries, their segment ids and dropout rows.
    start = i * piece
    cut = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=piece)
    return _Seg(0, piece, start), cut(qg, axis=1), _cut(seg, cut, 1), _cut(rows, cut, 3)


def _cut(x, cut, axis):
    return None if x is None else cut(x, axis=axis)


def _whole_fwd(q, k, v, seg, rows, causal, piece, rate):
    """Attention over the whole, globally ordered sequence of this device's heads:
    a scan over query pieces, each folding the key blocks up to its own (causal:
    the later ones run no trip) or all of them, one tile at a time."""
    b, length, hq, d = q.shape
    qg = _grouped(q, k.shape[2])
    keys = _Seg(0, length, 0)

    def step(_, i):
        qs, qgi, qseg, ri = _piece_inputs(i, piece, qg, seg, rows)
        state = _init_state(qgi, [_Seg(0, piece, 0)])[0]
        trips = i + 1 if causal else None
        acc, m, total = _fwd_tiles(
            state, qgi, k, v, qs, keys, causal, piece, qseg, seg, ri, rate, trips=trips
        )
        return None, (acc / total[..., None], m + jnp.log(total))

    _, (o, lse) = lax.scan(step, None, jnp.arange(length // piece))
    # (pieces, b, hkv, g, piece[, d]) -> (b, hkv, g, seq[, d]), as `_finish` gives.
    o = jnp.moveaxis(o, 0, 3).reshape(*o.shape[1:4], length, d)
    lse = jnp.moveaxis(lse, 0, 3).reshape(*lse.shape[1:4], length)
    out = o.transpose(0, 3, 1, 2, 4).reshape(b, length, hq, d).astype(q.dtype)
    return out, (q, k, v, seg, rows, o, lse)


def _whole_bwd(causal, piece, rate, res, dout):
    q, k, v, seg, rows, o, lse = res
    length = q.shape[1]
    qg, do, delta = _bwd_setup(q, o, dout, k.shape[2])
    keys = _Seg(0, length, 0)
    acc = accumulation_dtype(k.dtype)

    def step(dkv, i):
        qs, qgi, qseg, ri = _piece_inputs(i, piece, qg, seg, rows)
        cut = functools.partial(lax.dynamic_slice_in_dim, start_index=i * piece, slice_size=piece)
        grads = (jnp.zeros_like(qgi), *dkv)
        dq, dk, dv = _bwd_tiles(
            grads, qgi, cut(do, axis=1), cut(lse, axis=3), cut(delta, axis=3), k, v, qs, keys, causal, piece,
            qseg, seg, ri, rate, trips=i + 1 if causal else None,
        )  # fmt: skip
        return (dk, dv), dq

    zeros = (jnp.zeros_like(k, dtype=acc), jnp.zeros_like(v, dtype=acc))
    (dk, dv), dq = lax.scan(step, zeros, jnp.arange(length // piece))
    dq = jnp.moveaxis(dq, 0, 1).reshape(qg.shape)
    return _dq_out(dq, q), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_whole.defvjp(_whole_fwd, _whole_bwd)


def _reorder(x: Array, order: list[int], axis: int = 1) -> Array:
    # Static slices, concatenated: chunk `order[i]` of `x` becomes chunk i.
    size = x.shape[axis] // len(order)
    return jnp.concatenate([lax.slice_in_dim(x, c * size, (c + 1) * size, axis=axis) for c in order], axis)


def _ulysses_kv_heads(heads: int, kv_heads: int, n: int) -> int:
    # The key/value heads Ulysses moves: lcm(kv_heads, n), each head repeated when
    # n does not divide kv_heads (grouped-query, fewer key/value heads than devices).
    # Every device then holds whole query groups with the key/value heads they read,
    # and receives what it must: the whole sequence of those heads.
    return math.lcm(kv_heads, n) if heads % n == 0 else kv_heads


def _check_ulysses_heads(hq: int, n: int, axis: str) -> None:
    if hq % n:
        raise DivisibilityError(
            f"context_attention(impl='ulysses'): this device's {hq} query heads do not split over the "
            f"{n} devices of mesh axis {axis!r}: Ulysses gives each device heads / {n} of them for the "
            f"whole sequence. Use a number of heads (per device, after any tensor split) that is a "
            f"multiple of {n}, a {axis!r} axis whose size divides {hq}, or impl='ring' / 'allgather'."
        )


def _ulysses(q, k, v, seg, axis, causal, load_balanced, block, rate, seed, head_offset):
    """Sequence-split q, k, v -> head-split over the whole sequence by all-to-all,
    attention there (`_whole`), and the output back to sequence-split."""
    n, me = lax.axis_size(axis), lax.axis_index(axis)
    b, _, hq, _ = q.shape
    positional = causal or rate > 0
    # The all-to-all concatenates the devices' chunks in device order: the layout's
    # chunk order, which the causal mask and dropout need back in global order.
    order = _chunk_order(n, load_balanced) if positional and load_balanced else None
    inverse = None if order is None else sorted(range(len(order)), key=order.__getitem__)
    hkv = _ulysses_kv_heads(hq, k.shape[2], n)
    if hkv != k.shape[2]:
        # Fewer key/value heads than devices: repeat each so that every device gets
        # the heads its query heads read (query head i reads i // (hq / hkv) either way).
        k, v = (jnp.repeat(x, hkv // x.shape[2], axis=2) for x in (k, v))

    def to_heads(x):
        x = all_to_all(x, axis_name=axis, split_axis=2, concat_axis=1)
        return x if inverse is None else _reorder(x, inverse)

    qf, kf, vf = (to_heads(x) for x in (q, k, v))
    seg_all = None
    if seg is not None:
        seg_all = all_gather(seg, axis_name=axis, axis=1)
        seg_all = seg_all if inverse is None else _reorder(seg_all, inverse)
    rows = None
    if rate > 0:
        heads = hq // n
        offset = head_offset + me * heads
        rows = dropout_rows(seed, b, heads, hkv // n, offset, jnp.arange(qf.shape[1]))
    piece = _piece(qf.shape[1], q.shape[1], block)
    out = _whole(qf, kf, vf, seg_all, rows, causal, piece, rate)
    out = out if order is None else _reorder(out, order)
    return all_to_all(out, axis_name=axis, split_axis=1, concat_axis=2)


# ---------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------


def context_attention(
    q: Float[Array, "batch seq heads head_dim"],
    # Unchecked names (_): a mismatch is context_attention's SpecError, which says more.
    k: Float[Array, "_batch _seq _kv_heads _head_dim"],
    v: Float[Array, "_batch _seq _kv_heads _head_dim"],
    *,
    causal: bool,
    axis: str = "context",
    impl: str = "ring",
    load_balanced: bool = True,
    segment_ids: Int[Array, "_batch _seq"] | None = None,
    block_size: int = 512,
    dropout: float = 0.0,
    key: PRNGKeyArray | None = None,
    head_offset: Int[Array, ""] | int = 0,
) -> Float[Array, "batch seq heads head_dim"]:
    """Attention over a sequence split across the devices of mesh axis `axis`.

    Call inside `jax.shard_map` over `axis`; `q`, `k`, `v` are this device's chunk of
    the sequence in the context layout (see `context_layout`). Returns dense
    `softmax(q k^T / sqrt(head_dim)) v` over the whole, globally ordered sequence,
    for this device's queries. Query head `i` reads key/value head
    `i // (heads / kv_heads)` (grouped-query); `causal` keeps keys at global
    positions `<=` the query's. Accumulation is float32 (float64 for float64 inputs);
    the output has `q`'s dtype.
    Temp memory, forward and backward, is one tile, `O(batch x heads x seq x
    block_size)`, plus one visiting K/V block (ring) or all `n` blocks (allgather);
    Ulysses holds the whole sequence for `heads / n` heads (q, k, v, output: the
    bytes of the local ones) and a tile of `heads / n` heads, a query piece and a
    key block, each of at most `min(block_size, seq / 2)` positions.

    Communication per device, with `B` the bytes of the local `k` plus `v`:

    - `impl="ring"`: forward sends `(n-1) B` (`n-1` ring steps of one K/V block);
      backward sends `(n-1) B` of keys/values again plus `(n-1) B32` of dK/dV
      accumulators, `B32` being `k` plus `v` in float32 (`B` for float32 inputs,
      `2B` for bfloat16): `2 (n-1) B` for float32. The program has `n` unrolled
      steps (n is static), each issuing its transfer before its compute.
    - `impl="allgather"`: forward one all-gather of K and V (`(n-1) B` on a ring);
      backward one reduce-scatter each of dK, dV (`(n-1) B`), with `n B` of gathered
      K/V kept for the backward pass.
    - `impl="ulysses"`: forward all-to-alls of q, k, v and the output, backward
      of their cotangents, each sending `(n-1)/n` of the local array: `2 (n-1)/n
      (2 Q + B')`, with `Q` the bytes of `q` and `B'` those of `k` plus `v` after
      the key/value heads are repeated to `lcm(kv_heads, n)`. Needs `heads`
      divisible by `n`.

    **Arguments:**

    - `q`: `(batch, seq, heads, head_dim)`, this device's queries.
    - `k`, `v`: `(batch, seq, kv_heads, head_dim)`, this device's keys/values.
    - `causal`: mask keys after the query (by global position).
    - `axis`: the manual mesh axis that splits the sequence.
    - `impl`: `"ring"`, `"allgather"` or `"ulysses"`.
    - `load_balanced`: the layout (only matters for `causal`): device `i` holds chunks
      `i` and `2n-1-i` of `2n` (True) or contiguous block `i` (False).
    - `segment_ids`: optional `(batch, seq)` integers, this device's chunk of the
      global ids in the same layout as `q` (`context_layout` them like `q`): query
      `i` reads key `j` only when their ids are equal (packed sequences, padding as
      its own id), ANDed with `causal`. They travel with the keys (ring: one more
      small `ppermute` per step; allgather and ulysses: one more `all_gather`),
      int32 next to K/V's `heads x head_dim` floats per token.
    - `block_size`: keys per tile of the local online softmax.
    - `dropout`, `key`: dropout on the attention probabilities (rate in `[0, 1)`;
      applied only with a `key`, the same on every device, or each device's own
      seed for independent masks): kept by a hash of (seed drawn from `key`, batch
      row, global query head `head_offset + i`, global query and key positions), so
      it equals `blockwise_attention`'s and dense attention's mask for that key.
    - `head_offset`: the global index of this device's first query head (heads
      split over a manual tensor axis), for the dropout mask.

    **Returns:** `(batch, seq, heads, head_dim)`, this device's rows of the output.

    **Raises:** `PlanError` outside a manual region over `axis`, for an unknown
    `impl` or a non-positive `block_size`; `SpecError` for mismatched shapes or
    heads, or `segment_ids` of the wrong shape; `DivisibilityError` for an odd
    local length with `load_balanced` and `causal`, or (ulysses) `heads` that `n`
    does not divide.

    ```python
    mesh = jax.make_mesh((4,), ("context",), axis_types=(jax.sharding.AxisType.Auto,))
    def f(q, k, v):
        return context_attention(q, k, v, causal=True)
    spec = P(None, "context")
    out = jax.shard_map(f, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)(
        *(context_layout(x, 4, load_balanced=True) for x in (q, k, v)))
    out = context_unlayout(out, 4, load_balanced=True)   # == dense causal attention
    ```
    """
    _context_size(axis, "context_attention")
    _check(q, k, v, impl, block_size)
    check_segment_ids(segment_ids, q, k, "context_attention")
    causal, load_balanced = bool(causal), bool(load_balanced)
    rate = check_dropout(dropout, "context_attention")
    rate = rate if key is not None else 0.0
    if (causal or rate > 0) and load_balanced:
        _check_even(q.shape[1], "context_attention")
    if impl == "ulysses":
        _check_ulysses_heads(q.shape[2], lax.axis_size(axis), axis)
    rows = None
    if rate > 0 and impl != "ulysses":
        # Per query row: the hash of (seed, batch row, global head, global position).
        b, length, hq, _ = q.shape
        qpos = context_positions(length, axis=axis, load_balanced=load_balanced)
        rows = dropout_rows(dropout_seed(key), b, hq, k.shape[2], head_offset, qpos)
    # Everything the ring touches varies over `axis`; cast once, outside the loop
    # (a cast inside would put its transpose, a psum, in every backward step).
    vma = varying_axes(q) | varying_axes(k) | varying_axes(v) | {axis}
    for x in (segment_ids, rows):
        vma |= frozenset() if x is None else varying_axes(x)
    q, k, v = (mark_varying(x, vma) for x in (q, k, v))
    seg, rows = (None if x is None else mark_varying(x, vma) for x in (segment_ids, rows))
    if impl == "ring":
        return _ring(q, k, v, seg, rows, axis, causal, load_balanced, int(block_size), rate)
    if impl == "ulysses":
        seed = dropout_seed(key) if rate > 0 else None
        return _ulysses(q, k, v, seg, axis, causal, load_balanced, int(block_size), rate, seed, head_offset)
    k_all = all_gather(k, axis_name=axis, axis=1)
    v_all = all_gather(v, axis_name=axis, axis=1)
    seg_all = None if seg is None else all_gather(seg, axis_name=axis, axis=1)
    return _gathered(q, k_all, v_all, seg, seg_all, rows, axis, causal, load_balanced, int(block_size), rate)
