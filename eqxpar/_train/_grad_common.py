"""What the three gradient implementations (automatic, manual, pipeline) share:
the loss call with its mixed-precision casts, the micro-batch split, the gradient
reduction and the checks on per-device results.

Every implementation has one signature,
`gradients(loss, layout, model, batch, key) -> (loss, aux, grads)`, over the
global batch, with the gradients in the layout's `updates` specs.

A loss may return a mean, or an `eqxpar.train.WeightedMean` (a weighted sum and
its weight). Means of equal parts average exactly, so a mean is averaged over
devices and micro-batches as before; a weighted mean's parts weigh differently,
so each implementation adds their totals, weights and the totals' gradients over
the whole batch and divides once by the whole batch's weight (`normalised`).
"""

import contextlib
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, PyTree

from .._casting import cast_floating
from .._collectives import wire_dtype
from .._context_split import expect_split
from .._errors import PlanError
from .._fsdp import Gather, layer_gathers
from .._sharding import place_tree
from .._varying import mark_varying, varying_axes
from .._weighted import WeightedMean, constant_weight
from ._step_layout import StepLayout


@dataclasses.dataclass(frozen=True)
class LossFunction:
    """The user's loss with what a step needs to call it: whether it returns aux,
    whether it takes `key=`, and the compute dtype of mixed precision."""

    fn: Callable
    has_aux: bool
    compute_dtype: Any
    takes_key: bool

    @classmethod
    def wrap(cls, fn: Callable, *, has_aux: bool, compute_dtype: Any) -> "LossFunction":
        try:
            takes_key = "key" in inspect.signature(fn).parameters
        except (TypeError, ValueError):  # a callable without a signature takes no key
            takes_key = False
        return cls(fn, has_aux, compute_dtype, takes_key)

    def compute(self, tree: PyTree) -> PyTree:
        """`tree`'s floating-point arrays in the compute dtype (no-op without one).
        Applied to parameters inside the differentiated function, so gradients come
        back in the parameters' (master) dtype."""
        return tree if self.compute_dtype is None else cast_floating(tree, self.compute_dtype, per_layer=True)

    def loss_dtype(self, loss: Array | WeightedMean) -> Array | WeightedMean:
        # Losses are reported (and summed over micro-batches) in float32; a
        # weighted mean's weight is a constant of the batch.
        if isinstance(loss, WeightedMean):
            return WeightedMean(self.loss_dtype(loss.total), constant_weight(self.loss_dtype(loss.weight)))
        return loss if self.compute_dtype is None else loss.astype(jnp.float32)

    def __call__(self, model: PyTree, batch: PyTree, key: Any) -> tuple[Array | WeightedMean, PyTree]:
        out = self.fn(model, batch, key=key) if self.takes_key else self.fn(model, batch)
        loss, aux = out if self.has_aux else (out, None)
        return self.loss_dtype(loss), aux


def summed_over(value: WeightedMean, axes: tuple[str, ...]) -> WeightedMean:
    """Inside a manual region, a weighted mean's sums added over the devices of
    `axes` that hold a share of the batch: the total where it differs between
    them (a total the loss summed over an axis itself is whole there already);
    the weight there too, even where it is the same on each (a count of each
    device's tokens made from a shape is each device's own)."""
    total_axes = tuple(a for a in axes if a in varying_axes(value.total))
    weight_axes = tuple(a for a in axes if a in total_axes or a in varying_axes(value.weight))
    total, weight = value.total, value.weight
    if total_axes:
        total = lax.psum(total, total_axes)
    if weight_axes:
        weight = lax.psum(mark_varying(weight, weight_axes), weight_axes)
    return WeightedMean(total, weight)


def normalised(value: Array | WeightedMean, grads: PyTree) -> tuple[Array, PyTree]:
    """The step's loss and gradients from what its implementation summed over the
    whole batch: a scalar mean and its gradients as they are; a `WeightedMean`'s
    total and the gradients of the total divided by the whole batch's weight."""
    if not isinstance(value, WeightedMean):
        return value, grads
    weight = value.weight
    return value.value(), jax.tree.map(lambda g: g / weight.astype(g.dtype), grads)


def device_key(key: Any, layout: StepLayout) -> Any:
    """Inside a manual region, `key` made this device's own: folded with its index
    along each reduced batch axis (distinct examples), and along the tensor axis
    under sequence parallelism (distinct sequence blocks). None stays None."""
    if key is None:
        return None
    axes = layout.reduced_axes + ((layout.tensor_axis,) if layout.sequence_split else ())
    for axis in axes:
        key = jax.random.fold_in(key, lax.axis_index(axis))
    return key


def context_guard(layout: StepLayout) -> Any:
    """A context manager for each trace of a manual region's loss: under context
    parallelism attention must see this device's part of a sequence split over
    `context` (checked while tracing); otherwise nothing."""
    return expect_split() if layout.context_axes else contextlib.nullcontext()


def varies_along(tree: PyTree, axis: str) -> bool:
    """Whether any floating-point array in `tree` varies along manual mesh `axis`."""
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return any(axis in varying_axes(x) for x in leaves)


def split_microbatches(batch: PyTree, k: int) -> PyTree:
    """Every leaf `(n, ...)` as `(k, n / k, ...)`: micro-batch j takes rows j, k + j,
    2k + j, ..., so each device already holds its share of every micro-batch and
    splitting moves no data between devices."""

    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


def reduce_gradient(
    g: Array, *, scatter: Gather, psum_axes: tuple[str, ...], divide: int, dtype: Any
) -> Array:
    """Sum a per-device gradient over the data-parallel devices and divide:
    reduce-scatter along each `(dim, axes)` of `scatter` (in that order), all-reduce
    over `psum_axes`, in `dtype` on the wire (`Plan(reduce_dtype=...)`, else the
    gradient's); the result keeps the gradient's dtype."""
    out_dtype = g.dtype
    g = g.astype(wire_dtype(dtype or out_dtype))
    for dim, axes in scatter:
        g = lax.psum_scatter(g, axes, scatter_dimension=dim, tiled=True)
    if psum_axes:
        g = lax.psum(g, psum_axes)
    return (g / divide).astype(out_dtype)


def mean_over(x: Array, axes: tuple[str, ...]) -> Array:
    """`pmean` of `x` over `axes`, in a dtype XLA:CPU compiles there (see
    `_collectives.wire_dtype`)."""
    return lax.pmean(x.astype(wire_dtype(x.dtype)), axes).astype(x.dtype)


def mean_aux(aux: PyTree, axes: tuple[str, ...]) -> PyTree:
    """Floating-point aux averaged over `axes`; other leaves as they are."""
    return jax.tree.map(lambda a: mean_over(a, axes) if jnp.issubdtype(a.dtype, jnp.inexact) else a, aux)


def check_same_on_devices(loss: Array, aux: PyTree, *, allowed: tuple[str, ...]) -> None:
    """Inside a manual region, raise if the per-device loss or aux differs along a
    manual axis the step does not reduce over (`allowed`: the batch axes, which it
    averages). JAX would only say that the region's out_specs "require replication"."""
    manual = set(jax.sharding.get_abstract_mesh().manual_axes)
    if not manual:
        return
    for what, tree in (("loss", loss), ("aux", aux)):
        for x in jax.tree.leaves(tree):
            if not isinstance(x, jax.Array):
                continue
            varying = set(varying_axes(x))
            if what == "aux" and not jnp.issubdtype(x.dtype, jnp.inexact) and varying:
                raise PlanError(
                    f"the loss function's aux holds an integer array (shape {x.shape}, dtype {x.dtype}) that "
                    f"differs between devices along {sorted(varying)}; a manual step averages aux "
                    "over the data-parallel devices, which integers cannot be. Return it as a float."
                )
            extra = sorted(varying - set(allowed))
            if extra:
                raise PlanError(
                    f"the {what} computed on each device (shape {x.shape}) differs along manual mesh axes "
                    f"{extra}, which the step does not average over (the manual batch axes it averages "
                    f"over: {tuple(allowed) or 'none'}). Each device of those axes must end with the same {what}. "
                    "Likely causes: weights the rules split over the tensor axis used by code other than "
                    "eqxpar.nn layers (raw matmuls on shards issue no collectives: use eqxpar.nn layers, "
                    "or mode='auto'); or, with sequence_parallel=True, a loss that does not reduce its "
                    "per-token values with eqxpar.nn.sequence_mean, or takes labels for a replicated head "
                    "without eqxpar.nn.split_sequence."
                )


def value_and_grad(
    loss: LossFunction,
    params: PyTree,
    static: PyTree,
    batch: PyTree,
    key: Any,
    *,
    prepare: Callable | None = None,
    allowed: tuple[str, ...] = (),
) -> tuple[Array | WeightedMean, PyTree, PyTree]:
    """Loss, aux and gradients w.r.t. `params` of one batch (already in the compute
    dtype). `prepare` maps the model inside the differentiated function to
    `(model, per-layer gathers)` (manual FSDP: gradients flow back through its
    gathers as reduce-scatters). `allowed`: manual axes the loss may vary along."""

    # Frozen weights (`make_step(trainable=...)`) sit in `static`: not
    # differentiated, so autodiff computes no weight gradient for them, but cast
    # to the compute dtype like the rest.
    static = loss.compute(static)

    def scalar_loss(params):
        model = eqx.combine(loss.compute(params), static)
        per_layer = {}
        if prepare is not None:
            model, per_layer = prepare(model)
        with layer_gathers(per_layer):
            value, aux = loss(model, batch, key)
        # A weighted mean: differentiate its total; the caller divides by the
        # whole batch's weight once the totals of every part are added.
        if isinstance(value, WeightedMean):
            return value.total, (aux, value.weight)
        return value, (aux, None)

    (value, (aux, weight)), grads = jax.value_and_grad(scalar_loss, has_aux=True)(params)
    check_same_on_devices(value, aux, allowed=allowed)
    return (value if weight is None else WeightedMean(value, weight)), aux, grads


def accumulated_value_and_grad(
    loss: LossFunction,
    params: PyTree,
    static: PyTree,
    batch: PyTree,
    key: Any,
    *,
    layout: StepLayout,
    prepare: Callable | None = None,
    allowed: tuple[str, ...] = (),
    sum_dtypes: PyTree | None = None,
) -> tuple[Array | WeightedMean, PyTree, PyTree]:
    """As `value_and_grad`, averaged over the layout's `accumulate` micro-batches
    with `lax.scan`, each constrained to the layout's batch spec: the gradients
    are summed on each device (in `sum_dtypes`, default the parameters' dtypes)
    and divided once. A loss returning a `WeightedMean` gives the `WeightedMean`
    of the micro-batches' summed totals and weights, and the gradients of the
    summed totals (not divided: the whole batch's weight is the caller's)."""
    k = layout.accumulate
    micro = split_microbatches(batch, k)
    # Frozen weights cast to the compute dtype once, before the loop, rather than
    # in every micro-batch (`value_and_grad` then finds them cast already).
    static = loss.compute(static)

    def step(grads_sum, xs):
        index, mb = xs
        value, aux, grads = value_and_grad(
            loss,
            params,
            static,
            place_tree(mb, layout.plan.mesh, layout.batch),
            jax.random.fold_in(key, index),
            prepare=prepare,
            allowed=allowed,
        )
        grads_sum = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), grads_sum, grads)
        # The losses leave as outputs, not a carry: they keep the type (varying
        # along which axes) the loss gives them, which the reduction reads.
        return grads_sum, (aux, value)

    if sum_dtypes is None:
        sum_dtypes = jax.tree.map(lambda p: p.dtype, params)
    zeros = jax.tree.map(lambda p, dtype: jnp.zeros_like(p, dtype=dtype), params, sum_dtypes)
    grads, (aux, values) = lax.scan(step, zeros, (jnp.arange(k), micro))

    def summed(x: Array) -> Array:
        # At least float32 (a bfloat16 loss summed over micro-batches loses bits),
        # and float64 stays float64 under jax_enable_x64.
        return jnp.sum(x.astype(jnp.promote_types(x.dtype, jnp.float32)))

    if isinstance(values, WeightedMean):
        return WeightedMean(summed(values.total), summed(values.weight)), aux, grads
    return summed(values) / k, aux, jax.tree.map(lambda g: g / k, grads)


def specs_for(tree: PyTree, specs: PyTree) -> PyTree:
    """`specs` (resolved over a whole model) cut to `tree`, a filtered copy of it
    (gradients: None where the model holds no floating-point array)."""
    return jax.tree.map(lambda x, s: None if x is None else s, tree, specs, is_leaf=lambda x: x is None)
