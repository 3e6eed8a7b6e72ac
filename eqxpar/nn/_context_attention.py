"""Context-parallel attention: the sequence split over a mesh axis, keys and values
moving between the devices (ring attention) or gathered once, or the sequence
split traded for a head split by all-to-all (Ulysses).

Inside a manual region (`jax.shard_map`) over `axis` (default `"context"`), every
device holds one chunk of the sequence: its queries, keys and values.
`context_attention` checks its inputs and hands them to one strategy; each
returns what dense attention over the whole, globally ordered sequence gives for
this device's queries.

The modules:

- `_sequence_layout.py`: the layout (which chunks of the global sequence each
  device holds: `context_layout`, `context_unlayout`, `context_positions`,
  `device_chunks`).
- The strategies: `_ring_attention.py` (`"ring"`), `_gathered_attention.py`
  (`"allgather"`), `_ulysses.py` (`"ulysses"`); their static options are
  `_context_options.py`'s `ContextOptions`.
- `_chunk_attention.py`: the forward and backward over every (query chunk, key
  chunk) pair, causally empty pairs skipped; `_attention_tiles.py`: the tile
  kernel of one pair, over its key blocks, with the masks; `_flash_tile.py`: one
  tile's arithmetic, shared with `blockwise_attention`.

Dropout on the probabilities (`dropout`, `key`) keeps each by a hash of (seed,
batch row, global head, global query position, global key position), the mask
`blockwise_attention` and dense attention use, so the result equals one device's
for the same key, in any layout (positions are then tracked even without `causal`).
"""

from jax import lax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._collectives import all_gather, wire_dtype
from .._errors import PlanError, SpecError
from .._varying import mark_varying, varying_axes
from ._blockwise import check_dropout, check_segment_ids, dropout_rows, dropout_seed
from ._context_options import ContextOptions
from ._gathered_attention import gathered_attention
from ._ring_attention import ring_attention
from ._sequence_layout import _check_even, _context_size, context_positions
from ._ulysses import DropoutHash, check_local_heads_split, ulysses_attention

_IMPLS = ("ring", "allgather", "ulysses")


def _check_inputs(q: Array, k: Array, v: Array, impl: str, block_size: int) -> None:
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
    _check_inputs(q, k, v, impl, block_size)
    check_segment_ids(segment_ids, q, k, "context_attention")
    rate = check_dropout(dropout, "context_attention")
    options = ContextOptions(
        axis, bool(load_balanced), bool(causal), int(block_size), rate if key is not None else 0.0
    )
    if options.positional and options.load_balanced:
        _check_even(q.shape[1], "context_attention")
    if impl == "ulysses":
        check_local_heads_split(q.shape[2], lax.axis_size(axis), axis)
    rows = None
    if options.dropout_rate > 0 and impl != "ulysses":
        # Per query row: the hash of (seed, batch row, global head, global position).
        b, length, hq, _ = q.shape
        qpos = context_positions(length, axis=axis, load_balanced=options.load_balanced)
        rows = dropout_rows(dropout_seed(key), b, hq, k.shape[2], head_offset, qpos)
    # Everything the ring touches varies over `axis`; cast once, outside the loop
    # (a cast inside would put its transpose, a psum, in every backward step).
    vma = varying_axes(q) | varying_axes(k) | varying_axes(v) | {axis}
    for x in (segment_ids, rows):
        vma |= frozenset() if x is None else varying_axes(x)
    q, k, v = (mark_varying(x, vma) for x in (q, k, v))
    seg, rows = (None if x is None else mark_varying(x, vma) for x in (segment_ids, rows))
    if impl == "ring":
        return ring_attention(q, k, v, seg, rows, options)
    if impl == "ulysses":
        dropout_hash = DropoutHash(dropout_seed(key), head_offset) if options.dropout_rate > 0 else None
        return ulysses_attention(q, k, v, seg, dropout_hash, options)
    # The gathers' transposes reduce-scatter dK and dV: in bfloat16 inside a
    # partial-manual region XLA:CPU aborts compiling them, so run them in the wire
    # dtype (float32 there, the same values both ways; a no-op elsewhere).
    wire = wire_dtype(k.dtype)
    k_all, v_all = (all_gather(x.astype(wire), axis_name=axis, axis=1).astype(x.dtype) for x in (k, v))
    return gathered_attention(q, k_all, v_all, seg, rows, options)
