"""The two tensor-parallel matmuls every layer is built from.

*Column-parallel* (`column_matmul`): the weight's output features are split over
the tensor axis; the input must be whole along the sequence, so under sequence
parallelism it is all-gathered first (or gathered block by block around a ring
while multiplying, with overlap). *Row-parallel* (`row_matmul`): the weight's
input features are split; each device's product is partial and is summed over the
axis (all-reduce), or summed and split along the sequence under sequence
parallelism (reduce-scatter, or a ring of partial sums with overlap).

Activations are batch-first: `(batch, seq, *features)`.
"""

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from .._collectives import all_gather, all_gather_matmul, matmul_reduce_scatter, psum_scatter
from .._errors import DivisibilityError, PlanError
from .._varying import mark_varying, varying_axes
from ._context import TensorContext
from ._sequence import check_sequence_splits


def lift(b: jax.Array, ndim: int) -> jax.Array:
    """`b` with leading unit dims up to rank `ndim`: an explicit broadcast (eqxpar
    runs under `jax_numpy_rank_promotion="raise"`)."""
    return b.reshape((1,) * (ndim - b.ndim) + b.shape)


def check_split(actual: int, full: int, ctx: TensorContext, *, what: str) -> None:
    """Check a weight dimension that is split over the tensor axis has the size
    this context expects: `full / size` inside a manual region, `full` outside."""
    if full % max(ctx.size, 1):
        raise DivisibilityError(
            f"{what} has {full} entries, which the {ctx.size} devices of mesh axis {ctx.axis!r} "
            f"do not divide. Make it a multiple of {ctx.size}, or use a smaller tensor axis."
        )
    expected = full // ctx.size if ctx.manual else full
    if actual == expected:
        return
    if ctx.manual and actual == full:
        raise PlanError(
            f"{what}: the layer runs inside a shard_map over {ctx.axis!r} but its weight is whole "
            f"({full} entries, expected this device's {expected}). Pass the model's in_specs from "
            f"the plan's rules (eqxpar.filter_shard_map does by default), with rules that map its "
            f"logical axes to {ctx.axis!r} (e.g. eqxpar.rules.MEGATRON)."
        )
    if not ctx.manual and actual * max(ctx.size, 1) == full:
        raise PlanError(
            f"{what}: the weight is one device's shard ({actual} of {full} entries) but mesh axis "
            f"{ctx.axis!r} is not manual here. Call the layer inside "
            f"eqxpar.filter_shard_map(..., axis_names={{{ctx.axis!r}}}), or give it whole weights."
        )
    raise PlanError(f"{what}: expected {expected} entries along the split dimension, got {actual}.")


def check_bias(
    bias: jax.Array | None, full: int, ctx: TensorContext, *, what: str, like: str, split: bool, dim: int = -1
) -> None:
    """Check a bias is split over the tensor axis like the weight dimension it adds
    to: `split=True` (a column-parallel output: `full / size` entries inside a
    manual region) or `split=False` (a row-parallel output: whole, `full`)."""
    if bias is None:
        return
    actual = bias.shape[dim]
    expected = full // max(ctx.size, 1) if (split and ctx.manual) else full
    if actual == expected:
        return
    if split:
        how = (
            f"{like} is split over {ctx.axis!r} along the dimension this bias adds to ({expected} of "
            f"{full} entries on each device) but the bias has {actual}. Split the bias the same way "
            f"(its {full}-entry dimension over {ctx.axis!r}, as the weight's), e.g. a rule for the "
            f"bias's path next to the weight's in rules.ByPath; eqxpar.rules.MEGATRON does."
        )
    else:
        how = (
            f"{like}'s output is whole ({full} entries, summed over {ctx.axis!r}) but the bias has "
            f"{actual} on this device. Leave the bias whole (replicated over {ctx.axis!r}); "
            f"eqxpar.rules.MEGATRON does."
        )
    raise PlanError(f"{what} (shape {tuple(bias.shape)}): {how}")


def _check_seq(x: jax.Array, ctx: TensorContext, *, what: str) -> None:
    if x.ndim < 3:
        raise PlanError(
            f"{what}: expected batch-first activations (batch, seq, features), got shape {x.shape}. "
            "eqxpar.nn layers take whole batches; do not jax.vmap them over examples."
        )


def column_matmul(
    x: jax.Array, weights: Sequence[jax.Array], ctx: TensorContext, *, split_dim: int = -1
) -> list[jax.Array]:
    """`[x @ w for w in weights]` with each `w`'s output features split over the axis.

    `x`: `(batch, seq', d_in)` where `seq'` is the local sequence block under
    sequence parallelism in manual mode; each `w`: `(d_in, *out)` (local shards in
    manual mode), split over the axis along its dimension `split_dim` (e.g. the
    heads of a `(d_in, heads, head_dim)` weight: 1). Returns `(batch, seq, *out)`
    per weight. Several weights share one gather (or one ring) of `x`.
    """
    _check_seq(x, ctx, what="column-parallel layer input")
    if not ctx.manual:
        x = ctx.constrain(x, ctx.seq(), None)
        if len(weights) > 1 and ctx.size > 1:
            return _joined_column_matmul(x, weights, ctx, split_dim)
        outs = []
        for w in weights:
            y = jnp.tensordot(x, w, axes=1)
            # Say which output dimension is split: left to itself, GSPMD may split
            # another one (say head_dim) and then all-reduce attention scores.
            entries: list[str | None] = [None] * w.ndim  # y's seq, then w's output dims
            entries[split_dim % w.ndim] = ctx.axis
            outs.append(ctx.constrain(y, *entries))
        return outs
    if not ctx.sequence_parallel:
        if len(weights) > 1 and any(ctx.axis in varying_axes(w) for w in weights):
            # One cast of the shared input to varying: its transpose sums the input's
            # cotangent over the axis once for all weights. Left to JAX, each product
            # casts `x` on its own, and the backward pass all-reduces it once per weight
            # (three times for separate Q, K and V).
            x = mark_varying(x, (ctx.axis,))
        return [jnp.tensordot(x, w, axes=1) for w in weights]
    # One gather (or one ring) for all weights: concatenate the local shards.
    flat = [w.reshape(w.shape[0], -1) for w in weights]
    joined = flat[0] if len(flat) == 1 else jnp.concatenate(flat, axis=1)
    if ctx.overlap:
        y = all_gather_matmul(x, joined, axis_name=ctx.axis, axis=1)
    else:
        y = all_gather(x, axis_name=ctx.axis, axis=1) @ joined
    outs, start = [], 0
    for w, f in zip(weights, flat, strict=True):
        part = jax.lax.slice_in_dim(y, start, start + f.shape[1], axis=2)
        outs.append(part.reshape(*y.shape[:2], *w.shape[1:]))
        start += f.shape[1]
    return outs


def _joined_column_matmul(
    x: jax.Array, weights: Sequence[jax.Array], ctx: TensorContext, split_dim: int
) -> list[jax.Array]:
    """Automatic mode, several weights on one input: one product with the weights
    joined. Each weight `(d_in, ..., split, ...)` is laid out as `(d_in, n, rest)`,
    its split dimension's `n` device blocks first, and the blocks joined along `rest`,
    so every device's columns stay its own. Apart, each product's input gradient is
    summed over the axis on its own (three all-reduces for separate Q, K and V);
    joined, there is one."""
    n, flat = ctx.size, []
    for w in weights:
        d = split_dim % w.ndim
        blocks = w.reshape(*w.shape[:d], n, w.shape[d] // n, *w.shape[d + 1 :])
        flat.append(jnp.moveaxis(blocks, d, 1).reshape(w.shape[0], n, -1))
    # The output holds the whole sequence (as each product apart does): its heads are split.
    y = ctx.constrain(jnp.tensordot(x, jnp.concatenate(flat, axis=2), axes=1), None, ctx.axis, None)
    outs, start = [], 0
    for w, f in zip(weights, flat, strict=True):
        d = split_dim % w.ndim
        part = jax.lax.slice_in_dim(y, start, start + f.shape[2], axis=3)
        start += f.shape[2]
        before, after = w.shape[1:d], w.shape[d + 1 :]
        part = part.reshape(*y.shape[:3], *before, w.shape[d] // n, *after)
        part = jnp.moveaxis(part, 2, 1 + d).reshape(*y.shape[:2], *w.shape[1:])
        entries: list[str | None] = [None] * w.ndim
        entries[d] = ctx.axis
        outs.append(ctx.constrain(part, *entries))
    return outs


def row_matmul(x: jax.Array, w: jax.Array, ctx: TensorContext, *, in_dims: int = 1) -> jax.Array:
    """`x @ w` contracting `in_dims` trailing dims of `x` that are split over the axis,
    summed over it.

    `x`: `(batch, seq, *in)` (local shards of `in` in manual mode); `w`: `(*in, d_out)`.
    Returns `(batch, seq', d_out)`: `seq'` is this device's sequence block under
    sequence parallelism in manual mode, else the whole sequence.
    """
    _check_seq(x, ctx, what="row-parallel layer input")
    if not ctx.manual:
        y = jnp.tensordot(x, w, axes=in_dims)
        return ctx.constrain(y, ctx.seq(), None)
    if not ctx.sequence_parallel:
        return jax.lax.psum(jnp.tensordot(x, w, axes=in_dims), ctx.axis)
    check_sequence_splits(x.shape[1], ctx, "row-parallel layer output")
    if ctx.overlap:
        k = math.prod(w.shape[:in_dims])
        return matmul_reduce_scatter(
            x.reshape(*x.shape[:2], k), w.reshape(k, w.shape[-1]), axis_name=ctx.axis, axis=1
        )
    return psum_scatter(jnp.tensordot(x, w, axes=in_dims), axis_name=ctx.axis, axis=1)
