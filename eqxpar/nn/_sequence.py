"""Helpers for code around the tensor-parallel layers that must follow the
sequence split: replicated embeddings, replicated output heads, losses."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Shaped

from .._errors import DivisibilityError
from ._context import TensorContext, tensor_context


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


def split_sequence(
    x: Shaped[Array, "..."], *, axis: str = "tensor", seq_dim: int = 1
) -> Shaped[Array, "..."]:
    """This device's block of the sequence where the layers expect one.

    Under sequence parallelism in a manual region over `axis`, returns block `i`
    (of `n`) of dimension `seq_dim` on device `i`: a slice, no communication. In
    automatic mode it constrains a batch-first `x` to be split that way (GSPMD
    does the rest); without sequence parallelism it returns `x` unchanged.

    Use it to feed the residual stream from a replicated embedding (split the
    token ids, and the position table with `seq_dim=0`, *before* the lookup: the
    backward pass then sums the small table gradients over `axis` rather than the
    whole activation), or to take the labels matching a replicated head's logits.

    **Arguments:** `x` (any dtype); keyword-only `axis` (the tensor axis) and
    `seq_dim` (the sequence dimension: 1 for `(batch, seq, ...)`, 0 for a table).

    **Returns:** `x` with dimension `seq_dim` divided by `n` (manual, sequence
    parallel), else `x`'s shape.

    ```python
    ids = eqxpar.nn.split_sequence(ids)                       # (batch, seq')
    pos = eqxpar.nn.split_sequence(positions[:seq], seq_dim=0)
    h = embed[ids] + pos
    ```
    """
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


def sequence_mean(x: Float[Array, "batch seq *rest"], *, axis: str = "tensor") -> Float[Array, ""]:
    """The mean of per-token values over the whole sequence (and the local batch).

    Under sequence parallelism in a manual region each device holds one sequence
    block (`split_sequence`); the blocks are equal, so the mean is the average of
    the local means over `axis` (a scalar all-reduce). Elsewhere it is `jnp.mean`.

    **Arguments:** `x`: `(batch, seq', ...)` per-token values; keyword-only `axis`.

    **Returns:** a scalar, the same on every device of `axis`.

    ```python
    loss = eqxpar.nn.sequence_mean(per_token_loss)
    ```
    """
    ctx = tensor_context(axis)
    local = jnp.mean(x)
    if ctx.manual and ctx.sequence_parallel:
        return jax.lax.pmean(local, axis)
    return local
