"""Gradients under a manual plan: the loss runs per device inside `shard_map`,
and eqxpar issues the gradient reduction itself, once per step.

Under a partial-manual plan (or an automatic plan that reduces by hand: ZeRO-1,
accumulation) only some mesh axes are manual; the compiler handles the others,
as in an automatic step.
"""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
from jax.sharding import PartitionSpec
from jaxtyping import Array, PyTree

from .._errors import PlanError
from .._fsdp import added_splits, gather_whole, gathered_axes, prepare_model
from .._rules import mesh_axis_names
from .._shard_map import filter_shard_map
from .._sharding import place_tree
from .._varying import mark_varying, varying_axes
from .._weighted import WeightedMean
from ._grad_common import (
    LossFunction,
    accumulated_value_and_grad,
    context_guard,
    device_key,
    mean_aux,
    mean_over,
    normalised,
    reduce_gradient,
    specs_for,
    summed_over,
    value_and_grad,
    varies_along,
)
from ._step_layout import StepLayout


def _check_manual_specs(specs: PyTree, layout: StepLayout) -> None:
    # Inside the manual region a weight split over a manual axis arrives as a shard.
    # eqxpar.nn layers know what to do with shards of the tensor axis, and the step
    # gathers shards of the batch axes (FSDP); nothing would gather a weight split
    # over another manual axis, so such a model would silently compute on fragments.
    allowed, manual_axes, mesh = layout.weight_axes, layout.manual_axes, layout.plan.mesh
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)):
        if not isinstance(spec, PartitionSpec):
            continue
        for entry in spec:
            for axis in mesh_axis_names(entry):
                if axis in manual_axes and axis not in allowed and mesh.shape[axis] > 1:
                    raise PlanError(
                        f"mode='manual' splits weights over the tensor axis {layout.tensor_axis!r} and "
                        f"the batch axes {layout.resolved.batch.axes} (FSDP) only, but the plan's rules give a "
                        f"weight the spec {spec}, over manual axis {axis!r}. Use mode='auto' for "
                        f"such weights, or Plan(manual_axes=...) without {axis!r}."
                    )


def _check_foreign_tensor_splits(model: PyTree, specs: PyTree, layout: StepLayout) -> None:
    # eqxpar.nn layers know what to do with a shard of the tensor axis; equinox's
    # own layers (eqx.nn.Linear, eqx.nn.MLP, ...) compute on whole weights, so a
    # weight of theirs split over a manual tensor axis would fail deep inside the
    # loss with a shape error (or compute on a fragment).
    tensor = layout.tensor_axis
    if tensor not in layout.manual_axes or layout.plan.mesh.shape.get(tensor, 1) <= 1:
        return

    def walk(node: Any, spec: Any, path: str) -> None:
        if isinstance(node, eqx.Module) and type(spec) is type(node):
            foreign = type(node).__module__.split(".")[0] == "equinox"
            for field in dataclasses.fields(node):
                value, sub = getattr(node, field.name, None), getattr(spec, field.name, None)
                where = f"{path}.{field.name}" if path else field.name
                if foreign and eqx.is_array(value) and isinstance(sub, PartitionSpec):
                    if any(tensor in mesh_axis_names(e) for e in sub):
                        raise PlanError(
                            f"the plan's rules give {where} (shape {tuple(value.shape)}, a field of "
                            f"equinox's {type(node).__qualname__}) the spec {sub}, which splits it over "
                            f"the manual tensor axis {tensor!r}; inside the manual region it would "
                            f"arrive as one device's shard, but equinox's layers compute on whole "
                            f"weights (expected a spec without {tensor!r}). Leave it unsplit over "
                            f"{tensor!r} (narrow the rule), use eqxpar.nn layers (ColumnLinear, "
                            f"RowLinear, MLP) for tensor parallelism, or use mode='auto'."
                        )
                else:
                    walk(value, sub, where)
        elif isinstance(node, (list, tuple)) and isinstance(spec, (list, tuple)) and len(node) == len(spec):
            for i, (n, sp) in enumerate(zip(node, spec, strict=True)):
                walk(n, sp, f"{path}[{i}]")
        elif isinstance(node, dict) and isinstance(spec, dict):
            for k, n in node.items():
                walk(n, spec.get(k), f"{path}[{k!r}]")

    walk(model, specs, "")


def _local_gradients(
    loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any, *, vary: tuple[str, ...]
) -> tuple[Array | WeightedMean, PyTree, PyTree]:
    """This device's loss, aux and (accumulated) gradients, before any reduction
    over the batch axes.

    The parameters are marked varying along `vary` (the reduced batch axes, and
    maybe `tensor`) before differentiating, so each device's gradient stays
    local (no implicit psum per micro-batch) and the caller reduces once. Manual
    FSDP gathers weight shards inside the differentiated function (gradients flow
    back as reduce-scatters); when accumulating, it gathers once before the
    micro-batch loop instead, so the gradients are reduce-scattered once, after it.
    """
    axes = layout.reduced_axes
    params, static = layout.differentiated(model)
    if vary:
        params = jax.tree.map(lambda p: mark_varying(p, vary), params)
    batch = loss.compute(batch)
    if layout.accumulate == 1:
        prepare = (
            (lambda m: prepare_model(m, layout.params, axes, unsplit=layout.unsplit_axes)) if axes else None
        )
        return value_and_grad(loss, params, static, batch, key, prepare=prepare, allowed=vary)
    sum_dtypes = jax.tree.map(lambda p: p.dtype, params)
    pull = None
    if axes:
        # Cast before gathering, as the one-batch step does (its gathers move the
        # compute dtype).
        params, pull = jax.vjp(
            lambda p: gather_whole(loss.compute(p), layout.params, axes, unsplit=layout.unsplit_axes), params
        )
        # Frozen weights are gathered once too (outside the differentiated function).
        frozen, rest = eqx.partition(static, eqx.is_inexact_array)
        static = eqx.combine(
            gather_whole(loss.compute(frozen), layout.params, axes, unsplit=layout.unsplit_axes), rest
        )
    value, aux, grads = accumulated_value_and_grad(
        loss,
        params,
        static,
        batch,
        key,
        layout=layout,
        allowed=vary,
        sum_dtypes=sum_dtypes,
    )
    if pull is not None:
        (grads,) = pull(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params))
    return value, aux, grads


def _reduce(
    layout: StepLayout, merged: bool, divide: int, spec: Any, out_spec: Any, g: Array | None
) -> Array | None:
    """One gradient summed over the reduced batch axes (and `tensor` when merged).

    A weight split over batch axes (FSDP) was gathered in the loss, so its
    gradient arrives reduce-scattered over those axes and is summed over the
    remaining ones only. Under ZeRO-1 a gradient whose out spec adds batch axes is
    reduce-scattered along that dimension instead: each device keeps the slice it
    updates.
    """
    if g is None:
        return None
    axes, tensor = layout.reduced_axes, layout.tensor_axis
    gathered = gathered_axes(spec, axes)
    scatter = added_splits(spec, out_spec, axes)
    rest = tuple(a for a in axes if a not in gathered and all(a not in z for _, z in scatter))
    if merged and tensor not in gathered_axes(spec, (tensor,)):
        rest = rest + (tensor,)
    return reduce_gradient(g, scatter=scatter, psum_axes=rest, divide=divide, dtype=layout.reduce_dtype)


def _per_device(
    loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any
) -> tuple[Array, PyTree, PyTree]:
    axes, tensor = layout.reduced_axes, layout.tensor_axis
    split_sequence = layout.sequence_split
    # Distinct examples (and sequence blocks) per device need distinct randomness.
    key = device_key(key, layout)
    # Under sequence parallelism every use of a weight replicated over `tensor`
    # sits on a sequence block, so its gradient is a sum of per-device partials.
    # Left to autodiff, that sum is an all-reduce over `tensor` followed by the
    # step's own over the batch axes; marking those weights varying along
    # `tensor` too keeps the partials local, and one all-reduce over both axes
    # sums them (fewer bytes, one collective).
    merged = bool(axes) and split_sequence and tensor not in axes
    # Attention must see this device's part of a sequence split over `context`:
    # checked in every trace of the loss (a context manager per trace).
    with context_guard(layout):
        value, aux, grads = _local_gradients(
            loss, layout, model, batch, key, vary=axes + ((tensor,) if merged else ())
        )
    if merged and varies_along((value, aux), tensor):
        # A replicated weight reaches the loss off the sequence blocks (say, a
        # scale applied after `sequence_mean`), where its uses are not per-device
        # partials: trace again and let autodiff sum over `tensor` (the unused
        # first trace is dead code, removed before compiling).
        merged = False
        with context_guard(layout):
            value, aux, grads = _local_gradients(loss, layout, model, batch, key, vary=axes)
    if isinstance(value, WeightedMean):
        return _weighted(layout, merged, value, aux, grads, has_aux=loss.has_aux)
    if not axes:
        return value, aux, grads
    divide = layout.loss_divisor(varying_axes(value))
    # Along the tensor axis check_vma does the right thing unaided: a weight split
    # over it gets its own shard's gradient, and a replicated weight used on
    # sequence shards gets its partial gradients summed (unless merged above).
    is_spec = lambda s: isinstance(s, PartitionSpec) or s is None  # noqa: E731
    grads = jax.tree.map(
        functools.partial(_reduce, layout, merged, divide),
        layout.params,
        layout.updates,
        grads,
        is_leaf=is_spec,
    )
    return mean_over(value, axes), (mean_aux(aux, axes) if loss.has_aux else aux), grads


def _weighted(
    layout: StepLayout, merged: bool, value: WeightedMean, aux: PyTree, grads: PyTree, *, has_aux: bool
) -> tuple[Array, PyTree, PyTree]:
    """`_per_device`'s end for a weighted mean: the totals, weights
    (`summed_over`) and the totals' gradients summed over the reduced axes, then
    the loss and the gradients divided by the whole batch's weight."""
    axes = layout.reduced_axes
    if axes:
        is_spec = lambda s: isinstance(s, PartitionSpec) or s is None  # noqa: E731
        grads = jax.tree.map(
            functools.partial(_reduce, layout, merged, 1),
            layout.params,
            layout.updates,
            grads,
            is_leaf=is_spec,
        )
    loss, grads = normalised(summed_over(value, axes), grads)
    return loss, (mean_aux(aux, axes) if has_aux and axes else aux), grads


def manual_gradients(
    loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any
) -> tuple[Array, PyTree, PyTree]:
    """Loss, aux and gradients over the global batch, computed per device inside
    `shard_map` over the layout's manual axes; the gradients take the layout's
    `updates` specs (one reduction of the gradient bytes per step)."""
    plan = layout.plan
    _check_manual_specs(layout.params, layout)
    _check_foreign_tensor_splits(model, layout.params, layout)
    value, aux, grads = filter_shard_map(
        functools.partial(_per_device, loss, layout),
        plan,
        in_specs=(layout.params, layout.batch, PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec(), layout.updates),
        axis_names=layout.manual_axes,
    )(model, batch, key)
    if layout.partial:
        # Automatic axes: gradients take their sharding there, as in auto mode.
        grads = place_tree(grads, plan.mesh, specs_for(grads, layout.updates))
    return value, aux, grads
