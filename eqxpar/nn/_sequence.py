"""Helpers for code around the layers that must follow the sequence split
(context parallelism over `context`, sequence parallelism over the tensor axis):
replicated embeddings, replicated output heads, losses."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from .._collectives import all_gather
from .._context_split import context_size, note_split
from .._errors import DivisibilityError, SpecError
from .._mesh import CONTEXT_AXIS
from ._context import TensorContext, tensor_context
from ._sequence_layout import context_unlayout, device_chunks


def check_sequence_splits(length: int, ctx: TensorContext, where: str) -> None:
    """Raise, naming the padding to use, when sequence parallelism cannot split a
    sequence of `length` tokens evenly over `ctx`'s devices."""
    if length % ctx.size:
        pad = -length % ctx.size
        raise DivisibilityError(
            f"{where}: Plan(sequence_parallel=True) splits the sequence ({length} tokens) over the "
            f"{ctx.size} devices of mesh axis {ctx.axis!r}, which do not divide it. Pad every sequence "
            f"by {pad} to {length + pad} tokens (and leave the padded positions out of the loss), or "
            f"use a length that is a multiple of {ctx.size}."
        )


def split_context(x: Shaped[Array, "..."], *, seq_dim: int = 1) -> Shaped[Array, "..."]:
    """This device's part of a whole sequence under context parallelism: with the
    `context` axis of size `n` manual here, chunks `i` and `2n-1-i` of `2n`
    (concatenated; `eqxpar.nn.context_layout`'s order) on device `i`, two slices
    and no communication; elsewhere `x` unchanged. `split_sequence` calls it first.

    **Raises:** `DivisibilityError` naming the padding when `2n` does not divide
    the sequence.
    """
    n = context_size()
    if n == 1:
        return x
    if not -x.ndim <= seq_dim < x.ndim:
        raise SpecError(f"split_sequence: seq_dim={seq_dim} is out of range for shape {x.shape}.")
    length = x.shape[seq_dim]
    if length % (2 * n):
        pad = -length % (2 * n)
        raise DivisibilityError(
            f"context parallelism cuts the sequence ({length} tokens, shape {x.shape}) into 2 x {n} "
            f"equal chunks, two per device of mesh axis {CONTEXT_AXIS!r} (load balancing for causal "
            f"attention), and {2 * n} does not divide it. Pad every sequence by {pad} to "
            f"{length + pad} tokens (and leave the padded positions out of the loss), or use a length "
            f"that is a multiple of {2 * n}."
        )
    note_split()
    # The layout context_attention reads: its chunks' global starts and lengths.
    chunks = device_chunks(jax.lax.axis_index(CONTEXT_AXIS), length // n, n, True)
    parts = [jax.lax.dynamic_slice_in_dim(x, c.start, c.length, axis=seq_dim) for c in chunks]
    return jnp.concatenate(parts, axis=seq_dim)


def split_sequence(
    x: Shaped[Array, "..."], *, axis: str = "tensor", seq_dim: int = 1
) -> Shaped[Array, "..."]:
    """This device's block of the sequence where the layers expect one.

    Under context parallelism (a `context` axis of size `n > 1`, manual inside
    eqxpar's steps) it first takes this device's part of the whole sequence:
    chunks `i` and `2n-1-i` of `2n` (load-balanced; `split_context`). Then, under
    sequence parallelism in a manual region over `axis`, block `j` (of `t`) of
    that on device `j` of `axis`: slices, no communication. In automatic mode it
    constrains a batch-first `x` to be split over `axis` (GSPMD does the rest);
    without either it returns `x` unchanged.

    Use it to feed the residual stream from a replicated embedding (split the
    token ids, and the position table with `seq_dim=0`, *before* the lookup: the
    backward pass then sums the small table gradients over `axis` rather than the
    whole activation), or to take the labels matching a replicated head's logits.

    **Arguments:** `x` (any dtype); keyword-only `axis` (the tensor axis) and
    `seq_dim` (the sequence dimension: 1 for `(batch, seq, ...)`, 0 for a table).

    **Returns:** `x` with dimension `seq_dim` divided by the context size, and by
    the tensor axis' size `t` (manual, sequence parallel).

    ```python
    ids = eqxpar.nn.split_sequence(ids)                       # (batch, seq')
    pos = eqxpar.nn.split_sequence(positions[:seq], seq_dim=0)
    h = embed[ids] + pos
    ```
    """
    return split_tensor_sequence(split_context(x, seq_dim=seq_dim), axis=axis, seq_dim=seq_dim)


def split_tensor_sequence(x: Shaped[Array, "..."], *, axis: str, seq_dim: int = 1) -> Shaped[Array, "..."]:
    """`split_sequence`'s second half: the block of the tensor axis' device under
    sequence parallelism (`x` already this device's part of the context split)."""
    ctx = tensor_context(axis)
    if not ctx.sequence_parallel:
        return x
    if not ctx.manual:
        if seq_dim != 1:
            return x
        return ctx.constrain(x, ctx.seq(), *([None] * (x.ndim - 2)))
    length = x.shape[seq_dim]
    check_sequence_splits(length, ctx, f"split_sequence (dimension {seq_dim} of shape {x.shape})")
    block = length // ctx.size
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * block, block, axis=seq_dim)


def sequence_mean(
    x: Float[Array, "batch seq *rest"], *, axis: str = "tensor", per_row: bool = False
) -> Float[Array, ""] | Float[Array, " batch"]:
    """The mean of per-token values over this device's sequence (and local batch).

    Under sequence parallelism in a manual region each device holds one sequence
    block (`split_sequence`); the blocks are equal, so the mean is the average of
    the local means over `axis` (a scalar all-reduce). Elsewhere it is `jnp.mean`.
    Under context parallelism it is the mean over this device's part of the
    sequence: a loss, which the step averages over `context` as over the batch.

    **Arguments:** `x`: `(batch, seq', ...)` per-token values; keyword-only `axis`;
    `per_row` (default False): one mean per batch row instead.

    **Returns:** a scalar (with `per_row`, `(batch,)`), the same on every device of
    `axis`.

    ```python
    loss = eqxpar.nn.sequence_mean(per_token_loss)
    ```
    """
    ctx = tensor_context(axis)
    local = jnp.mean(x.reshape(x.shape[0], -1), axis=1) if per_row else jnp.mean(x)
    if ctx.manual and ctx.sequence_parallel:
        return jax.lax.pmean(local, axis)
    return local


def whole_sequence(
    x: Shaped[Array, "batch seq_in *rest"], *, axis: str = "tensor", tensor_blocks: bool = False
) -> Shaped[Array, "batch seq *rest"]:
    """The inverse of `split_sequence` for per-token values: the whole sequence.

    With `tensor_blocks`, under sequence parallelism in a manual region over
    `axis`, `x` is this device's block of its part of the sequence
    (`split_tensor_sequence`): each device writes its block at its place in an
    array of zeros and the arrays are summed over `axis` (an all-reduce of `batch x
    seq` numbers, each added to zeros only, so exact); the result is the same on
    every device of `axis`, and its gradient reaches each block with no
    collective. Under context parallelism `x` is then this device's part
    (`split_context`'s two chunks): the parts are all-gathered over `context` and
    put back in sequence order. As a loss computed on a context-split sequence
    does, the result varies over `context` (its gradient is the reduce-scatter of
    every device's; a step averages such losses over `context`). Elsewhere `x`
    unchanged.

    **Arguments:** `x` `(batch, seq', ...)`; keyword-only `axis` (the tensor axis)
    and `tensor_blocks` (whether `x` is split over `axis` too).

    **Returns:** `(batch, seq, ...)`, `seq` the whole sequence's length.
    """
    ctx = tensor_context(axis)
    if tensor_blocks and ctx.manual and ctx.sequence_parallel and ctx.size > 1:
        block = x.shape[1]
        whole = jnp.zeros((x.shape[0], ctx.size * block, *x.shape[2:]), x.dtype)
        whole = jax.lax.dynamic_update_slice_in_dim(whole, x, jax.lax.axis_index(axis) * block, axis=1)
        x = jax.lax.psum(whole, axis)
    n = context_size()
    if n == 1:
        return x
    return context_unlayout(all_gather(x, axis_name=CONTEXT_AXIS, axis=1), n, load_balanced=True)
