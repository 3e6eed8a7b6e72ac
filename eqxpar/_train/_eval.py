"""`make_eval_step` and `evaluate`: the loss of a batch, or the mean over a
dataset, under any plan, with no update."""

import functools
from collections.abc import Callable, Iterable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._errors import BatchError, PlanError
from .._fsdp import layer_gathers, prepare_model
from .._outline_jit import OutlineJit, has_outlines
from .._plan import Plan
from .._shard_map import filter_shard_map
from .._sharding import place_tree
from .._stack_order import in_plan_order
from .._varying import varying_axes
from .._weighted import WeightedMean
from ._grad_common import LossFunction, context_guard, device_key, mean_aux, mean_over, summed_over
from ._resolved_plan import ResolvedPlan
from ._step_layout import StepLayout
from ._train_state import TrainState


def _device_loss(loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any) -> tuple:
    # As a manual step's loss (`_grad_manual`), without differentiating: the key
    # made this device's, FSDP shards made whole where used, the sequence checked
    # split over `context`.
    axes = layout.reduced_axes
    key = device_key(key, layout)
    model = loss.compute(model)
    per_layer: dict = {}
    if axes:
        model, per_layer = prepare_model(model, layout.params, axes, unsplit=layout.unsplit_axes)
    with context_guard(layout), layer_gathers(per_layer):
        return loss(model, loss.compute(batch), key)


def _per_device(loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any) -> tuple:
    # Each device's mean averaged over the devices it differs between; a weighted
    # mean's sums added over them.
    axes = layout.reduced_axes
    value, aux = _device_loss(loss, layout, model, batch, key)
    varying = tuple(
        a for a in axes if a in varying_axes(value.total if isinstance(value, WeightedMean) else value)
    )
    if isinstance(value, WeightedMean):
        value = summed_over(value, axes)
    elif varying:
        value = mean_over(value, varying)
    return value, (mean_aux(aux, axes) if loss.has_aux and axes else aux)


def _check_rows(values: Any, batch: PyTree) -> Array:
    """`values`, refused unless one per row of `batch` (whose leaves the call has
    checked share one leading size)."""
    rows = next(int(x.shape[0]) for x in jax.tree.leaves(batch) if np.ndim(x))
    if not hasattr(values, "shape") or tuple(values.shape) != (rows,):
        got = tuple(values.shape) if hasattr(values, "shape") else type(values).__name__
        raise PlanError(
            f"make_eval_step(..., per_row=True): loss_fn returned {got} on a batch of {rows} rows; "
            f"expected one loss per row, shape ({rows},). Return the per-row losses (no mean over "
            "the batch), or build the step with per_row=False for a loss that is a mean over rows."
        )
    return values


def _per_device_rows(loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any) -> Array:
    # This device's rows' losses, averaged over the non-batch axes they differ
    # between (context: each device's part of a sequence holds as many tokens).
    values = _check_rows(_device_loss(loss, layout, model, batch, key)[0], batch)
    batch_axes = layout.resolved.batch.axes
    others = tuple(a for a in layout.reduced_axes if a not in batch_axes and a in varying_axes(values))
    return mean_over(values, others) if others else values


def _batch_loss(loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any) -> tuple:
    """The mean loss (and aux) of one batch whose size the plan divides."""
    if layout.kind == "pipeline":
        from ..pipeline._engine import pipeline_loss  # the pipeline package imports eqxpar.nn

        return pipeline_loss(loss, layout, model, batch), None
    if layout.kind == "automatic":
        return loss(loss.compute(model), loss.compute(batch), key)
    return filter_shard_map(
        functools.partial(_per_device, loss, layout),
        layout.plan,
        in_specs=(layout.params, layout.batch, PartitionSpec()),
        out_specs=(PartitionSpec(), PartitionSpec()),
        axis_names=layout.manual_axes,
    )(model, batch, key)


def _batch_rows(loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any) -> Array:
    """The per-row losses of one batch whose size the plan divides, `(rows,)`
    split over the batch axes."""
    if layout.kind == "automatic":
        return _check_rows(loss(loss.compute(model), loss.compute(batch), key)[0], batch)
    return filter_shard_map(
        functools.partial(_per_device_rows, loss, layout),
        layout.plan,
        in_specs=(layout.params, layout.batch, PartitionSpec()),
        out_specs=layout.batch,
        axis_names=layout.manual_axes,
    )(model, batch, key)


def _rows(batch: PyTree, where: str) -> int:
    """The batch size every leaf of `batch` shares (arrays or outlines)."""
    sizes = {int(np.shape(x)[0]) for x in jax.tree.leaves(batch) if np.ndim(x)}
    if len(sizes) != 1:
        raise BatchError(
            f"{where}: the batch's leaves have leading sizes {sorted(sizes)}; expected one batch size "
            "shared by every leaf."
        )
    return next(iter(sizes))


class EvalStep:
    """A compiled evaluation `(state or model, batch) -> metrics`, built by
    `eqxpar.train.make_eval_step`."""

    def __init__(self, loss: LossFunction, resolved: ResolvedPlan, *, per_row: bool = False):
        self._loss, self._resolved, self._per_row = loss, resolved, per_row
        # Compiled once per (model structure, batch shape), as a step is.
        self._compiled = OutlineJit(self._evaluate, what="an eval step")

    def _evaluate(self, model: PyTree, batch: PyTree, key: Any) -> tuple | Array:
        resolved = self._resolved
        with resolved.plan:
            layout = StepLayout.of(resolved, model)
            model = place_tree(model, resolved.mesh, layout.params)
            batch = place_tree(batch, resolved.mesh, layout.batch)
            if self._per_row:
                return _batch_rows(self._loss, layout, model, batch, key)
            return _batch_loss(self._loss, layout, model, batch, key)

    @property
    def rows_per_call(self) -> int:
        """The batch sizes a call runs whole are multiples of this: the
        data-parallel devices times a pipeline's micro-batches."""
        return self._resolved.batch.rows_per_call

    def __call__(
        self, state_or_model: Any, batch: PyTree, *, key: PRNGKeyArray | None = None
    ) -> dict[str, Any]:
        model = state_or_model.model if isinstance(state_or_model, TrainState) else state_or_model
        # A model as loaded (natural order) or as a state of this plan holds it.
        model = in_plan_order(model, self._resolved)
        rows = _rows(batch, "make_eval_step")
        if self._per_row:
            return {"loss": self._masked_mean(model, batch, rows, key), "rows": rows}
        q = self.rows_per_call
        whole = rows // q * q
        parts = []  # (rows it stands for, loss, aux)
        if whole:
            head = jax.tree.map(lambda x: x[:whole], batch)
            parts.append((whole, *self._compiled(model, head, key)))
        if rows > whole:
            # The rows left over (fewer than q): each repeated q times, so that the
            # plan divides the batch and its mean is their mean exactly (the loss
            # is a mean over rows), never cut and never mixed with padding. A
            # mask needs the loss per row (per_row=True).
            tail = jax.tree.map(lambda x: jnp.repeat(jnp.asarray(x)[whole:], q, axis=0), batch)
            parts.append((rows - whole, *self._compiled(model, tail, key)))
        metrics: dict[str, Any] = {"rows": rows}
        if isinstance(parts[0][1], WeightedMean):
            # Each part's sums count its rows once: the repeated rows' sums are q times theirs.
            runs = ([whole] if whole else []) + ([q * (rows - whole)] if rows > whole else [])
            total = sum(
                n / run * value.total.astype(jnp.float32)
                for (n, value, _), run in zip(parts, runs, strict=True)
            )
            weight = sum(
                n / run * value.weight.astype(jnp.float32)
                for (n, value, _), run in zip(parts, runs, strict=True)
            )
            metrics |= {"loss": total / weight, "weight": weight}
        else:
            metrics["loss"] = sum(n * value.astype(jnp.float32) for n, value, _ in parts) / rows
        if self._loss.has_aux:
            metrics["aux"] = jax.tree.map(
                lambda *xs: (
                    sum(n * x for (n, _, _), x in zip(parts, xs, strict=True)) / rows
                    if jnp.issubdtype(jnp.result_type(xs[0]), jnp.inexact)
                    else xs[0]
                ),
                *[aux for _, _, aux in parts],
            )
        return metrics

    def lower(
        self, state_or_model: Any, batch: PyTree, *, key: PRNGKeyArray | None = None
    ) -> jax.stages.Lowered:
        """Lower the program a call runs on `batch` whole (a multiple of
        `rows_per_call` rows), for arrays or outlines (`jax.ShapeDtypeStruct`s: a
        state from `train.init(..., abstract=True)`, a model built under
        `eqx.filter_eval_shape`); nothing runs. `.compile()` gives its memory and HLO."""
        model = state_or_model.model if isinstance(state_or_model, TrainState) else state_or_model
        # Outlines are put in the plan's order by tracing it: nothing is allocated.
        order = lambda m: in_plan_order(m, self._resolved)  # noqa: E731
        model = eqx.filter_eval_shape(order, model) if has_outlines(model) else order(model)
        rows, q = _rows(batch, "EvalStep.lower"), self.rows_per_call
        if rows % q:
            raise BatchError(
                f"EvalStep.lower: a batch of {rows} rows; expected a multiple of rows_per_call = {q} (a call "
                "runs other sizes as several programs)."
            )
        return self._compiled.lower(model, batch, key)

    def _masked_mean(self, model: PyTree, batch: PyTree, rows: int, key: Any) -> Array:
        # Padded to the next multiple the plan divides with copies of the first
        # row, which the mask then leaves out: one program per padded size.
        q = self.rows_per_call
        padded = -(-rows // q) * q
        if padded > rows:
            batch = jax.tree.map(
                lambda x: jnp.concatenate([jnp.asarray(x), jnp.repeat(jnp.asarray(x)[:1], padded - rows, 0)]),
                batch,
            )
        values = self._compiled(model, batch, key).astype(jnp.float32)
        real = jnp.arange(padded) < rows
        return jnp.sum(jnp.where(real, values, 0.0)) / rows


def make_eval_step(
    loss_fn: Callable[..., Float[Array, ""] | tuple[Float[Array, ""], Any]],
    plan: Plan,
    *,
    has_aux: bool = False,
    # Any: checked below, with an eqxpar error that names the value.
    per_row: Any = False,
) -> EvalStep:
    """Build the compiled evaluation of `loss_fn` under `plan`: the loss (and aux)
    of a batch, with no gradient, no update and no donation.

    The loss runs as the plan's train step runs it (sharded weights, the batch
    over the data-parallel devices, manual regions, context and expert axes), and
    under a pipeline plan the schedule's forward actions only, in its placement
    (interleaved or V), with no residuals kept. A batch of any size is evaluated
    whole: the largest part the plan divides runs as one batch, and each row left
    over runs repeated over the devices, so that the mean is over exactly the
    batch's rows. That needs the loss to be a mean over rows, as `make_step` does.

    With `per_row=True` the loss returns one value per row instead, and a batch of
    any size is padded to the next size the plan divides, the padding masked out
    of the mean: exact for any per-row loss, one program per padded size (not
    under pipeline plans, whose schedule sums a loss per micro-batch). Either way,
    statistics of the whole batch inside the loss (an MoE layer's load-balance and
    z-losses, its capacity) see the padding (or repeated) rows too.

    A loss returning an `eqxpar.train.WeightedMean` (`lm_loss` with weights or
    segment ids) is the weighted mean over the whole batch: the sums of its parts
    are added before dividing, and the metrics hold their `"weight"` too.

    No dropout unless asked for: the loss gets `key=None` (a loss taking `key=`,
    such as `lm_loss` with LoRA adapter dropout, then drops nothing) unless the
    call passes a key. A model whose layers need a key when not in inference mode
    (`equinox.nn.Dropout`) is evaluated as `equinox.nn.inference_mode(model)`.

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> loss`, or `-> (loss, aux)` with
      `has_aux=True`; a `PipelineLoss` under a pipeline plan. A loss taking `key=`
      gets the key of the call.
    - `plan`: the plan.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)` (not under pipelines).
    - `per_row`: whether `loss_fn` returns per-row losses `(batch,)` (see above; no
      `has_aux`, not under pipelines).

    **Returns:** an `EvalStep`: `eval_step(state_or_model, batch, *, key=None) ->
    {"loss": float32 scalar, "rows": int, "weight": float32 scalar (for a weighted
    mean: the weight it is over), "aux": ... (with has_aux; floating-point leaves
    averaged over the rows)}`. Takes a `TrainState` or a model (as loaded, or
    as a state of this plan holds it), and `key` (default None: no dropout).

    ```python
    eval_step = eqxpar.train.make_eval_step(lm_loss, plan)
    eval_step(state, held_out)["loss"]
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"make_eval_step(..., plan={plan!r}): expected an eqxpar.Plan.")
    if not callable(loss_fn):
        raise PlanError(f"make_eval_step(loss_fn={loss_fn!r}): expected a callable loss_fn(model, batch).")
    if not isinstance(per_row, bool):
        raise PlanError(f"make_eval_step(per_row={per_row!r}): expected True or False.")
    if per_row and has_aux:
        raise PlanError(
            "make_eval_step(per_row=True, has_aux=True): a per-row loss has no aux here; return the "
            "per-row losses alone, or use per_row=False for a mean loss with aux."
        )
    resolved = ResolvedPlan.of(plan)
    if per_row and resolved.kind == "pipeline":
        raise PlanError(
            "make_eval_step(per_row=True) under a pipeline plan: the "
            "schedule sums one loss per micro-batch, not per row. Use per_row=False (a mean loss; rows "
            "left over are repeated, exactly), or evaluate under the plan without its pipe axis."
        )
    if resolved.pipeline is not None:
        from ..pipeline._engine import check_pipeline_step

        check_pipeline_step(loss_fn, resolved.pipeline, accumulate=1, has_aux=has_aux)
    loss = LossFunction.wrap(loss_fn, has_aux=has_aux, compute_dtype=resolved.compute_dtype)
    return EvalStep(loss, resolved, per_row=per_row)


def evaluate(eval_step: EvalStep, state_or_model: Any, batches: Iterable[PyTree]) -> dict[str, Any]:
    """The mean of `eval_step` over `batches`, weighted by their rows: the loss of
    the whole dataset (every row counted once, none cut).

    **Arguments:**

    - `eval_step`: from `make_eval_step`.
    - `state_or_model`: a `TrainState` or a model.
    - `batches`: any iterable of batches (a list, a generator, an
      `eqxpar.data.ShardedIterator` over a `TokenFile` for a given number of steps).

    **Returns:** `{"loss": mean over every row (for a weighted mean, over the
    whole weight), "rows": how many, "batches": how many, "weight": the summed
    weight (weighted means only), "aux": ... (row-weighted mean, with has_aux)}`.

    ```python
    eqxpar.train.evaluate(eval_step, state, [valid[i : i + 16] for i in range(0, len(valid), 16)])
    ```
    """
    if not isinstance(eval_step, EvalStep):
        raise PlanError(
            f"evaluate(eval_step={eval_step!r}): expected the EvalStep of eqxpar.train.make_eval_step."
        )
    total, rows, count, aux = jnp.zeros((), jnp.float32), 0, 0, None
    weight = None
    for batch in batches:
        metrics = eval_step(state_or_model, batch)
        n = metrics["rows"]
        if "weight" in metrics:
            # Weighted means: weighted by what each is over, not by rows.
            w = metrics["weight"]
            weight = w if weight is None else weight + w
            total = total + w * metrics["loss"]
        else:
            total = total + n * metrics["loss"]
        rows, count = rows + n, count + 1
        if "aux" in metrics:
            weighted = jax.tree.map(lambda x, n=n: n * x, metrics["aux"])
            aux = weighted if aux is None else jax.tree.map(jnp.add, aux, weighted)
    if rows == 0:
        raise BatchError("evaluate: `batches` gave no batch; pass at least one.")
    out: dict[str, Any] = {
        "loss": total / (rows if weight is None else weight),
        "rows": rows,
        "batches": count,
    }
    if weight is not None:
        out["weight"] = weight
    if aux is not None:
        out["aux"] = jax.tree.map(lambda x: x / rows, aux)
    return out
