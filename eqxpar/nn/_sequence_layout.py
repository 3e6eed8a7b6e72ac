"""The sequence layout of context parallelism, shared by the attention
strategies (`_ring_attention.py`, `_gathered_attention.py`, `_ulysses.py`) and the
code around the layers that follows the sequence split (`_sequence.py`).

Layouts. With `load_balanced=True` the global sequence is cut into `2n` chunks and
device `i` holds chunks `i` and `2n-1-i`, concatenated: under a causal mask the
early chunks see few keys and the late ones many, so pairing them gives every
device the same unmasked work. With `load_balanced=False` device `i` holds the
contiguous block `i`. `context_layout` / `context_unlayout` permute a global array
into / out of the order whose contiguous `n` blocks are the devices' chunks, and
`context_positions` gives this device's global token positions (for rotary
embeddings and masks).

Inside the attention a device's local sequence is a list of `Chunk`s, each a run
of the global sequence (`device_chunks`: two when load-balanced, one otherwise);
the attention strategies read their global positions for the causal mask and
dropout.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Int, Shaped

from .._errors import DivisibilityError, PlanError, SpecError


def chunk_order(n: int, load_balanced: bool) -> list[int]:
    # The global chunks in device order: device i's chunks are entries [2i, 2i+1]
    # when load-balanced (chunks i and 2n-1-i), entry i otherwise.
    if not load_balanced:
        return list(range(n))
    return [c for i in range(n) for c in (i, 2 * n - 1 - i)]


def _permute_chunks(x: Array, n: int, load_balanced: bool, seq_dim: int, inverse: bool, fn: str) -> Array:
    if n < 1:
        raise SpecError(f"{fn}: n={n} devices; expected a positive number of devices.")
    if not -x.ndim <= seq_dim < x.ndim:
        raise SpecError(
            f"{fn}: seq_dim={seq_dim} is out of range for an array of shape {x.shape}; "
            f"expected -{x.ndim} <= seq_dim < {x.ndim}."
        )
    seq_dim %= x.ndim
    order = chunk_order(n, load_balanced)
    chunks = len(order)
    length = x.shape[seq_dim]
    if length % chunks:
        raise DivisibilityError(
            f"{fn}: the sequence (dimension {seq_dim} of shape {x.shape}) has length {length}, "
            f"which does not split into {chunks} equal chunks ({n} devices"
            f"{', two chunks each (load_balanced=True)' if load_balanced else ''}). "
            f"Use a sequence length that is a multiple of {chunks}."
        )
    if inverse:
        order = inverse_order(order)
    size = length // chunks
    shape = (*x.shape[:seq_dim], chunks, size, *x.shape[seq_dim + 1 :])
    y = jnp.take(x.reshape(shape), jnp.asarray(order), axis=seq_dim)
    return y.reshape(x.shape)


def context_layout(
    x: Shaped[Array, "..."], n: int, *, load_balanced: bool, seq_dim: int = 1
) -> Shaped[Array, "..."]:
    """A global array's sequence reordered so that its contiguous `n` blocks are
    the `n` devices' chunks (the order `context_attention` expects).

    With `load_balanced=True` the sequence is cut into `2n` chunks and block `i`
    of the result is chunk `i` followed by chunk `2n-1-i`; with `False` the
    sequence is unchanged (device `i` holds the contiguous block `i`).

    **Arguments:** `x`: any global array; `n`: the size of the context axis;
    keyword-only `load_balanced` and `seq_dim` (the sequence dimension).

    **Returns:** `x`'s shape, its sequence permuted.

    **Raises:** `DivisibilityError` if the sequence does not split into `2n` (or
    `n`) equal chunks; `SpecError` if `seq_dim` is out of range.

    ```python
    q = context_layout(q, 4, load_balanced=True)   # then split over "context"
    out = jax.shard_map(f, mesh=mesh, in_specs=P(None, "context"), out_specs=P(None, "context"))(q)
    out = context_unlayout(out, 4, load_balanced=True)
    ```
    """
    return _permute_chunks(x, n, load_balanced, seq_dim, False, "context_layout")


def context_unlayout(
    x: Shaped[Array, "..."], n: int, *, load_balanced: bool, seq_dim: int = 1
) -> Shaped[Array, "..."]:
    """The inverse of `context_layout`: devices' chunks, concatenated in device
    order, back to the global sequence order.

    **Arguments / Returns / Raises:** as `context_layout`.

    ```python
    y = context_unlayout(context_layout(x, 4, load_balanced=True), 4, load_balanced=True)  # == x
    ```
    """
    return _permute_chunks(x, n, load_balanced, seq_dim, True, "context_unlayout")


class Chunk(NamedTuple):
    """A run of a local array that is contiguous in the global sequence: its
    offset and length in the local array, and its first global position."""

    offset: int
    length: int
    start: Array | int

    def cut(self, x: Array | None, axis: int = 1) -> Array | None:
        """This chunk of the local array `x` along `axis` (None for None)."""
        if x is None:
            return None
        return lax.slice_in_dim(x, self.offset, self.offset + self.length, axis=axis)


def device_chunks(
    device: Array | int, length: int, n: int, load_balanced: bool, offset: int = 0
) -> list[Chunk]:
    """The chunks of device `device`'s local sequence of `length` tokens (of `n`
    devices), at `offset` in the local array: chunks `device` and `2n-1-device` of
    `2n` when load-balanced, block `device` otherwise."""
    if not load_balanced:
        return [Chunk(offset, length, device * length)]
    half = length // 2
    return [Chunk(offset, half, device * half), Chunk(offset + half, half, (2 * n - 1 - device) * half)]


def gathered_chunks(length: int, n: int, load_balanced: bool) -> list[Chunk]:
    """The chunks of every device's local sequence (of `length` tokens each),
    gathered in device order into one array of `n * length`."""
    return [c for j in range(n) for c in device_chunks(j, length, n, load_balanced, offset=j * length)]


def reorder_chunks(x: Array, order: list[int], axis: int = 1) -> Array:
    """Static slices, concatenated: chunk `order[i]` of `x` (of `len(order)` equal
    chunks along `axis`) becomes chunk i."""
    size = x.shape[axis] // len(order)
    return jnp.concatenate([lax.slice_in_dim(x, c * size, (c + 1) * size, axis=axis) for c in order], axis)


def inverse_order(order: list[int]) -> list[int]:
    """The permutation that undoes `order`."""
    return sorted(range(len(order)), key=order.__getitem__)


def context_positions(
    local_len: int, *, axis: str = "context", load_balanced: bool
) -> Int[Array, " local_len"]:
    """This device's global token positions under the context layout.

    Call it inside `jax.shard_map` over `axis`. With `load_balanced=True`, device
    `i` of `n` holds chunks `i` and `2n-1-i` of length `local_len / 2`; with
    `False`, positions `i * local_len` to `(i+1) * local_len - 1`.

    **Arguments:** `local_len`: this device's sequence length; keyword-only `axis`
    and `load_balanced`.

    **Returns:** int32 positions, shape `(local_len,)`.

    **Raises:** `PlanError` outside a manual region over `axis`;
    `DivisibilityError` if `load_balanced` and `local_len` is odd.

    ```python
    pos = context_positions(x.shape[1], load_balanced=True)
    q = apply_rotary(q, pos)   # rotary angles at the global positions
    ```
    """
    n = _context_size(axis, "context_positions")
    if load_balanced:
        _check_even(local_len, "context_positions")
    me = lax.axis_index(axis)
    parts = [
        s.start + jnp.arange(s.length, dtype=jnp.int32)
        for s in device_chunks(me, local_len, n, load_balanced)
    ]
    return jnp.concatenate(parts).astype(jnp.int32)


def _context_size(axis: str, fn: str) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    manual = () if mesh.empty else tuple(mesh.manual_axes)
    if axis not in manual:
        raise PlanError(
            f"{fn}: axis={axis!r} is not a manual mesh axis here (manual axes: {manual}). "
            f"Call {fn} inside jax.shard_map over a mesh with an axis {axis!r} that splits "
            f"the sequence (or pass axis= the name of that axis)."
        )
    return lax.axis_size(axis)


def _check_even(local_len: int, fn: str) -> None:
    if local_len % 2:
        raise DivisibilityError(
            f"{fn}: load_balanced=True needs an even local sequence length (two chunks per "
            f"device), got {local_len}. Use a global length that is a multiple of 2n, or "
            f"load_balanced=False."
        )
