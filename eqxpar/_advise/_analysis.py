"""What the advisor reads off the model and loss once, on one device, for every
candidate plan: the loss's saved residuals, its matmul FLOPs and the model's
structure. Traced on shape outlines; nothing is compiled or run."""

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.extend import core as jcore

from .._errors import PlanError
from .._specs import is_array_like
from .._text import short


def outline(tree: Any) -> Any:
    """`tree` with every array leaf a `jax.ShapeDtypeStruct`."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if is_array_like(x) else x, tree)


def nbytes(x: Any) -> int:
    return int(x.size) * jnp.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Analysis:
    """The loss on the whole global batch on one device.

    - `residuals`: outlines of the values its backward pass reads that are not
      parameters or batch (`jax.vjp`'s residuals).
    - `forward_flops`: 2 x the multiply-adds of its matmuls (forward only).
    - `batch_size`, `seq_len`: the batch's leading dimension and its sequence
      dimension (None without one).
    - `row_bytes`: bytes per batch row of the activations between blocks.
    - `routed`: the outline of one MoE layer's routed rows (global), or None.
    - `layers`: attention layers (`eqxpar.nn.Attention`, stacked ones counted per layer).
    """

    residuals: tuple[jax.ShapeDtypeStruct, ...]
    forward_flops: float
    batch_size: int
    seq_len: int | None
    row_bytes: int
    routed: jax.ShapeDtypeStruct | None
    layers: int


def _dot_flops(jaxpr: Any) -> float:
    # Matmul FLOPs of a jaxpr, scans counted `length` times, other sub-jaxprs once.
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            a = eqn.invars[0].aval
            contracted = 1
            for d in lc:
                contracted *= a.shape[d]
            total += 2.0 * eqn.outvars[0].aval.size * contracted
        elif eqn.primitive.name == "ragged_dot_general" or eqn.primitive.name == "ragged_dot":
            a, b = eqn.invars[0].aval, eqn.invars[1].aval
            total += 2.0 * a.size * b.shape[-1]
        for value in eqn.params.values():
            inner = value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value
            if isinstance(inner, jcore.Jaxpr):
                repeat = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
                total += repeat * _dot_flops(inner)
            elif isinstance(value, tuple):
                for branch in value:
                    if isinstance(branch, jcore.ClosedJaxpr):
                        total += _dot_flops(branch.jaxpr) / len(value)
    return total


def analyse(model: Any, loss: Callable, batch: Any) -> Analysis:
    """Trace `loss(model, batch)` and its VJP on outlines (global batch, one device)."""
    from ..nn._moe import record_dispatches

    model, batch = outline(model), outline(batch)
    floating = lambda x: is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    params, static = eqx.partition(model, floating)

    def residuals(params: Any, batch: Any) -> list:
        f = lambda p: loss(eqx.combine(p, static), batch)  # noqa: E731
        return jax.tree.leaves(jax.vjp(f, params)[1])

    try:
        with record_dispatches() as routed:
            closed = jax.make_jaxpr(residuals)(params, batch)
        forward = jax.make_jaxpr(lambda p, b: loss(eqx.combine(p, static), b))(params, batch)
    except PlanError:
        raise
    except Exception as e:
        raise PlanError(
            f"advise: tracing loss_fn(model, batch) on their outlines failed ({type(e).__name__}: "
            f"{short(str(e))}). Pass the loss the step differentiates, with a global batch it accepts."
        ) from e
    inputs = set(v for v in closed.jaxpr.invars)
    saved = tuple(
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v in closed.jaxpr.outvars
        if not isinstance(v, jcore.Literal) and v not in inputs and v.aval.shape
    )
    leaves = [x for x in jax.tree.leaves(batch) if is_array_like(x) and x.ndim]
    if not leaves:
        raise PlanError("advise(batch=...): the batch has no array with a leading (batch) dimension.")
    size = int(leaves[0].shape[0])
    # The sequence: a batch dimension beyond the first (or one less: next-token
    # targets), the one the residuals have most often.
    options = {d - k for x in leaves for d in x.shape[1:] for k in (0, 1) if d - k > 1}
    counts = Counter(d for r in saved for d in r.shape if d in options)
    seq = counts.most_common(1)[0][0] if counts else None
    # Bytes per batch row of the activations between blocks: (seq, features) with
    # the features the residuals end in most often after the sequence.
    ends = Counter((r.shape[-1], r.dtype) for r in saved if r.ndim >= 3 and r.shape[-2] == seq)
    width, dtype = ends.most_common(1)[0][0] if ends else (0, jnp.float32)
    row = (seq or 1) * width * jnp.dtype(dtype).itemsize
    return Analysis(
        residuals=saved,
        forward_flops=_dot_flops(forward.jaxpr),
        batch_size=size,
        seq_len=seq,
        row_bytes=row,
        routed=routed[0] if routed else None,
        layers=_layers(model),
    )


def _layers(model: Any) -> int:
    from ..inspect._minimum import _attentions

    return sum(a.wo.shape[0] if a.wo.ndim == 4 else 1 for a in _attentions(model))


def _dependent(jaxpr: Any, sources: set) -> set:
    """The variables of `jaxpr` that vary as `sources` do inside `shard_map`: those
    computed from them (an equation with one such input makes all its outputs
    so), and the other operands of such equations (`shard_map` casts them to
    the varying type, and a residual is then that cast copy)."""
    found = set(sources)
    operands = set()
    for eqn in jaxpr.eqns:
        invars = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
        if any(v in found for v in invars):
            found.update(eqn.outvars)
            operands.update(invars)
    return found | operands


@dataclasses.dataclass(frozen=True)
class Stage:
    """One pipeline virtual stage on one micro-batch, whole (not split over a
    tensor axis): `residuals[(first, last)]`, the outlines its forward keeps for
    its backward actions as the engine stores them, per kind of virtual stage
    (the first runs `first` before its layers, the last `last` after them);
    `activation`, the outline of what crosses a stage boundary."""

    residuals: dict[tuple[bool, bool], tuple[jax.ShapeDtypeStruct, ...]]
    activation: jax.ShapeDtypeStruct


def stage(model: Any, loss: Any, micro_batch: Any, layers: int, dtype: Any = None) -> Stage:
    """Trace one virtual stage of `layers` layers of `loss`'s stack (an
    `eqxpar.pipeline.PipelineLoss`) on one micro-batch, the weights in `dtype`
    (None: their own), as the pipeline engine does (`_Device._resolve_residuals`):
    the residuals of `jax.vjp` of the stage w.r.t. its weights and (off the first
    stage) its input, less the weights, the input and the micro-batch themselves
    and what the micro-batch alone determines (the engine keeps only what varies
    along `pipe`; see `_dependent`). On outlines; nothing runs."""
    model, micro_batch = outline(model), outline(micro_batch)
    floating = lambda x: is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    blocks = loss.stack_of(model).blocks
    chunk = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((layers, *x.shape[1:]), x.dtype) if is_array_like(x) else x, blocks
    )
    # The engine swaps a chunk's layers into the stack the same way (its depth field unchanged).
    model = eqx.tree_at(lambda m: loss.stack(m).blocks, model, chunk)
    if dtype is not None:
        model = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype) if floating(x) else x, model)
    params, static = eqx.partition(model, floating)
    h = jax.eval_shape(lambda p, b: loss.first(eqx.combine(p, static), b), params, micro_batch)
    out = {}
    for first, last in ((True, False), (False, False), (False, True), (True, True)):

        def run(p, x, b, first=first, last=last):
            m = eqx.combine(p, static)
            y = loss.stack(m)(loss.first(m, b) if first else x)
            return loss.last(m, y, b) if last else y

        def residuals(p, x, b, run=run, first=first):
            if first:
                return jax.tree.leaves(jax.vjp(lambda p: run(p, None, b), p)[1])
            return jax.tree.leaves(jax.vjp(lambda p, x: run(p, x, b), p, x)[1])

        jaxpr = jax.make_jaxpr(residuals)(params, h, micro_batch).jaxpr
        n = len(jax.tree.leaves(params)) + len(jax.tree.leaves(h))
        varying = _dependent(jaxpr, set(jaxpr.invars[:n]))
        inputs = set(jaxpr.invars)
        out[(first, last)] = tuple(
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
            for v in jaxpr.outvars
            if not isinstance(v, jcore.Literal) and v not in inputs and v in varying
        )
    return Stage(residuals=out, activation=jax.ShapeDtypeStruct(h.shape, h.dtype))
