"""`make_step`: one compiled training step for any plan."""

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._errors import AccumulationWarning, OffloadWarning, PlanError
from .._mesh import mesh_platform
from .._outline_jit import OutlineJit, refuse_outlines
from .._plan import Plan
from .._sharding import check_batch, place_tree
from .._specs import is_array_like
from .._tpu_compiler import tpu_compiler_options
from .._update_layout import UpdateLayout, updating
from ._grad_automatic import automatic_gradients
from ._grad_common import LossFunction
from ._grad_manual import manual_gradients
from ._nonfinite import (
    check_cpu_skip_nonfinite,
    count_skipped,
    gradient_norm,
    is_finite_step,
    keep_unless_finite,
)
from ._resolved_plan import ResolvedPlan, warn_cpu_collective_order, warn_cpu_offload
from ._step_layout import StepLayout
from ._streamed_update import chunk_count, elementwise_update, streamed_update
from ._train_state import TrainState
from ._trainable import optimized, trainable_mask

Metrics = dict[str, Any]


def _learning_rate(opt_state: PyTree) -> Array | None:
    # optax.inject_hyperparams keeps the schedule's current value in its state.
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    for node in nodes:
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and "learning_rate" in hyper:
            return jnp.asarray(hyper["learning_rate"])
    return None


def _gradients(loss: LossFunction, layout: StepLayout, model: PyTree, batch: PyTree, key: Any) -> tuple:
    """The gradient implementation the layout calls for; one signature for all three."""
    if layout.kind == "pipeline":
        # Imported here: the pipeline package imports eqxpar.nn (a PipelineLoss
        # names an nn.Stacked), which the core does not.
        from ..pipeline._engine import pipeline_gradients

        return pipeline_gradients(loss, layout, model, batch, key)
    implementation = manual_gradients if layout.kind == "manual" else automatic_gradients
    return implementation(loss, layout, model, batch, key)


def _apply(
    optimizer: optax.GradientTransformation,
    layout: StepLayout,
    state: TrainState,
    grads: PyTree,
    *,
    streamed: bool = False,
    finite: Array | None = None,
) -> TrainState:
    """The optimizer update: the new state. `streamed`: the offloaded optimizer
    state streams through the device chunk by chunk (`_streams_update`), and then
    a non-finite step (`finite` False) keeps its old parameters and state chunk by
    chunk."""
    model = state.model
    if streamed:
        params, rest = layout.differentiated(model)
        new_params, opt_state = streamed_update(
            optimizer,
            grads,
            state.opt_state,
            params,
            chunks=chunk_count(model, layout.updates),
            mesh=layout.plan.mesh,
            state_specs=layout.opt_state,
            update_specs=layout.updates,
            finite=finite,
        )
        return TrainState(
            model=eqx.combine(new_params, rest),
            opt_state=opt_state,
            step=state.step + 1,
            key=state.key,
            skipped_steps=state.skipped_steps,
        )
    if layout.sliced_update:
        # ZeRO-1: update this device's slice of every parameter (slicing a
        # replicated array moves nothing), then gather the new parameters.
        model = place_tree(model, layout.plan.mesh, layout.updates)
    params, _ = layout.differentiated(model)
    # Published for plan-aware transformations (eqxpar.optim.muon): the arrays'
    # specs, which they cannot read from the traced arrays themselves.
    with updating(UpdateLayout.of(layout.plan.mesh, layout.updates)):
        updates, opt_state = optimizer.update(grads, state.opt_state, params)
    model = eqx.apply_updates(model, updates)
    if layout.sliced_update:
        model = place_tree(model, layout.plan.mesh, layout.params)
    return TrainState(
        model=model,
        opt_state=opt_state,
        step=state.step + 1,
        key=state.key,
        skipped_steps=state.skipped_steps,
    )


def _streams_update(
    optimizer: optax.GradientTransformation, layout: StepLayout, state: TrainState, grads: PyTree
) -> bool:
    """Whether the update streams an offloaded optimizer state through the device
    chunk by chunk (`_streamed_update`): the plan offloads it, off XLA:CPU, the model has stacked
    layers to chunk it by, each device updates whole parameters (not ZeRO-1's
    slices), and the optimizer's update is elementwise. An offloaded state that
    cannot stream comes onto the device whole, with a warning saying why."""
    if layout.memory_kind("optimizer") is None or layout.sliced_update:
        return False
    if mesh_platform(layout.plan.mesh) == "cpu":
        # XLA:CPU's host and device memory are one, so streaming saves nothing
        # there; and it fuses a chunk's update otherwise than the whole one's (a
        # new moment recomputed inside the parameter's fusion), a rounding apart
        # from the plain step, which the CPU matches bit for bit.
        return False
    if chunk_count(state.model, layout.updates) == 1:
        return False
    params, _ = layout.differentiated(state.model)
    if elementwise_update(optimizer.update, grads, state.opt_state, params):
        return True
    warnings.warn(
        "Plan(offload=('optimizer',)): the optimizer's update is not elementwise (each new moment a "
        "function of the same positions of the gradients, moments and parameters: a global-norm clip "
        "or a per-matrix transformation is not), so the offloaded state cannot stream through the "
        "device a layer at a time and comes onto it whole for the update; the device's peak falls by "
        "less than the state's size. To silence: warnings.filterwarnings('ignore', "
        "category=eqxpar.OffloadWarning).",
        OffloadWarning,
        stacklevel=2,
    )
    return False


def _train_step(
    loss: LossFunction,
    optimizer: optax.GradientTransformation,
    layout: StepLayout,
    state: TrainState,
    batch: PyTree,
    *,
    skip_nonfinite: bool,
) -> tuple[TrainState, Metrics]:
    key = jax.random.fold_in(state.key, state.step)
    # Every implementation (automatic, manual, pipeline; accumulated or not) ends
    # here with the global loss and gradients, so the check and the update below
    # are one code path for every plan.
    value, aux, grads = _gradients(loss, layout, state.model, batch, key)
    # An offloaded model's stacked weights stayed in host memory through the
    # passes (each layer's slice came over in the stack's scan): whole on the
    # device now, for the update.
    model = layout.stacked_params_onto_device(state.model)
    state = eqx.tree_at(lambda s: s.model, state, model, is_leaf=lambda x: x is None)
    # Their gradients came out where the slices came from (a transfer's
    # transpose moves the cotangent back): onto the device too.
    grads = layout.stacked_params_onto_device(grads)
    grad_norm = gradient_norm(grads)
    metrics: Metrics = {"loss": value, "grad_norm": grad_norm}
    if _streams_update(optimizer, layout, state, grads):
        # The offloaded state streams through the device chunk by chunk; a
        # non-finite step keeps each old chunk there.
        finite = is_finite_step(value, grad_norm) if skip_nonfinite else None
        new_state = _apply(optimizer, layout, state, grads, streamed=True, finite=finite)
        if finite is not None:
            skipped = count_skipped(state.skipped_steps, finite)
            new_state = eqx.tree_at(lambda s: s.skipped_steps, new_state, skipped)
    else:
        # An offloaded optimizer state comes onto the device now, for the update
        # (and the skip's select), and goes back to host memory with the new state.
        opt_state = layout.optimizer_state_onto_device(state.opt_state)
        state = eqx.tree_at(lambda s: s.opt_state, state, opt_state, is_leaf=lambda x: x is None)
        new_state = _apply(optimizer, layout, state, grads)
        if skip_nonfinite:
            finite = is_finite_step(value, grad_norm)
            new_state = keep_unless_finite(state, new_state, finite)
    if skip_nonfinite:
        metrics["skipped"] = jnp.logical_not(finite)
        metrics["skipped_steps"] = new_state.skipped_steps
    lr = _learning_rate(new_state.opt_state)
    if lr is not None:
        metrics["learning_rate"] = lr
    if loss.has_aux:
        metrics["aux"] = aux
    return new_state, metrics


class Step:
    """A compiled training step `(state, batch) -> (state, metrics)`.

    Built by `eqxpar.train.make_step`. Compiled once per state layout and batch
    shape (later calls reuse it); `.lower(state, batch)` gives the
    `jax.stages.Lowered` for reading the HLO, and `.compile(...)` the compiled
    executable.
    """

    def __init__(
        self,
        loss: LossFunction,
        optimizer: optax.GradientTransformation,
        resolved: ResolvedPlan,
        *,
        donate: bool,
        skip_nonfinite: bool,
        trainable: Any = None,
    ):
        #: The loss function the step differentiates (read by `eqxpar.inspect`).
        self.loss_fn = loss.fn
        self._loss, self._optimizer = loss, optimizer
        self._resolved = resolved
        self._donate = donate
        self._skip_nonfinite = skip_nonfinite
        self._trainable = trainable
        self._cache: dict[Any, tuple[Callable, PyTree]] = {}

    def layout(self, state: TrainState) -> StepLayout:
        """The `StepLayout` this step resolves for `state`: every array's spec, the
        manual axes, the batch axes it reduces by hand, the leaves it trains."""
        mask = trainable_mask(state.model, self._trainable, self._resolved, where="make_step")
        return StepLayout.of(self._resolved, state.model, state.opt_state, trainable=mask)

    def _jitted(self, state: TrainState, batch: PyTree) -> tuple[Callable, PyTree]:
        dynamic, static = eqx.partition(state, is_array_like)
        static_leaves, static_def = jax.tree.flatten(static)
        try:
            cache_key = (
                static_def,
                tuple(static_leaves),
                jax.tree.structure(dynamic),
                jax.tree.structure(batch),
            )
            hash(cache_key)
        except TypeError as e:
            raise PlanError(
                "the train state holds an unhashable non-array leaf; make it an array "
                "or a hashable static field (eqx.field(static=True))."
            ) from e
        cached = self._cache.get(cache_key)
        if cached is not None:
            return cached
        resolved = self._resolved
        plan = resolved.plan  # entered while tracing: the layers read it
        _warn_batch_statistics(state.model, resolved, stacklevel=4)
        layout = self.layout(state)
        _check_optimizer_state(state, self._optimizer, layout)
        state_shardings = layout.state_shardings(dynamic)
        batch_sharding = resolved.batch.sharding
        replicated = NamedSharding(resolved.mesh, PartitionSpec())

        def step(dynamic, batch):
            with plan:
                # What the plan offloads comes onto the device here, inside the
                # program, and goes back to host memory at its end.
                state = eqx.combine(layout.onto_device(dynamic), static)
                new_state, metrics = _train_step(
                    self._loss, self._optimizer, layout, state, batch, skip_nonfinite=self._skip_nonfinite
                )
            new_dynamic, new_static = eqx.partition(new_state, eqx.is_array)
            new_dynamic = layout.onto_host(new_dynamic)
            if jax.tree.structure(new_static) != static_def:
                raise PlanError(
                    "the step changed the non-array part of the train state; the "
                    "optimizer update must keep the model's structure."
                )
            return new_dynamic, metrics

        # On TPU, the compiler options eqxpar chooses for this plan (`_tpu_compiler`):
        # in the jit itself, so that the step run on attached chips and its
        # `lower(...).compile()` ahead of time (`eqxpar.aot`) are one program.
        on_tpu = mesh_platform(resolved.mesh) == "tpu"
        jitted = jax.jit(
            step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=(0,) if self._donate else (),
            compiler_options=(tpu_compiler_options(resolved.dims, resolved.mesh) or None) if on_tpu else None,
        )
        if self._skip_nonfinite:
            check_cpu_skip_nonfinite(layout, lambda: jax.make_jaxpr(step)(dynamic, batch))
        self._cache[cache_key] = (jitted, static)
        return self._cache[cache_key]

    def _prepare(self, state: TrainState, batch: PyTree) -> tuple[Callable, PyTree, PyTree]:
        if not isinstance(state, TrainState):
            raise PlanError(
                f"a step takes (state, batch) with state an eqxpar.train.TrainState, got "
                f"{type(state).__name__}; build it with eqxpar.train.init(model, optimizer, plan, key=...)."
            )
        check_batch(batch, self._resolved.batch, microbatches=self._resolved.microbatches)
        jitted, static = self._jitted(state, batch)
        return jitted, static, eqx.filter(state, is_array_like)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        refuse_outlines((state, batch), "a train step")
        jitted, static, dynamic = self._prepare(state, batch)
        batch = self._placed_batch(batch)
        new_dynamic, metrics = jitted(dynamic, batch)
        return eqx.combine(new_dynamic, static), metrics

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """Lower the step for `state` and `batch`; nothing runs.

        Either may be arrays or outlines (`jax.ShapeDtypeStruct`s: the state from
        `train.init(..., abstract=True)` or built under `eqx.filter_eval_shape`),
        and both lower to the same program: the one `step(state, batch)` runs.
        From outlines nothing is allocated, so a step can be compiled for a
        model or a TPU topology this machine could not hold (`eqxpar.aot`)."""
        jitted, _, dynamic = self._prepare(state, batch)
        # Placed as `__call__` places it, so that `.compile()` is the executable
        # the step runs (jit caches by the inputs' shardings).
        return jitted.lower(dynamic, self._placed_batch(batch))

    def _placed_batch(self, batch: PyTree) -> PyTree:
        return place_tree(batch, self._resolved.mesh, self._resolved.batch.spec, copy=False)

    def compile(self, state: TrainState, batch: PyTree) -> jax.stages.Compiled:
        """The compiled executable for `state` and `batch`, arrays or outlines as
        `lower` takes them (for HLO, memory, cost)."""
        return self.lower(state, batch).compile()


def _check_optimizer_state(
    state: TrainState, optimizer: optax.GradientTransformation, layout: StepLayout
) -> None:
    """Refuse a state whose optimizer state mirrors other leaves than the step
    trains (built with another `trainable` filter, or none): optax would fail deep
    inside the update on mismatched trees, or update the wrong leaves."""
    expected = jax.eval_shape(optimizer.init, optimized(state.model, layout.trainable))
    if jax.tree.structure(expected) == jax.tree.structure(state.opt_state):
        return
    n_expected, n_state = len(jax.tree.leaves(expected)), len(jax.tree.leaves(state.opt_state))
    raise PlanError(
        f"the state's optimizer state ({n_state} arrays) is not the one this step's optimizer keeps for "
        f"the leaves it trains ({n_expected} arrays, "
        f"{'every array' if layout.trainable is None else 'the trainable= filter'}). Build the state "
        "with the same optimizer and the same filter: eqxpar.train.init(model, optimizer, plan, "
        "key=..., trainable=F) with make_step(..., trainable=F) (both None to train every weight)."
    )


def _warn_batch_statistics(model: PyTree, resolved: ResolvedPlan, *, stacklevel: int) -> None:
    """Warn (`AccumulationWarning`) when the step splits the batch into
    micro-batches and a module of the model says its loss holds a term that is not
    a mean over rows (`batch_statistic_loss()`, as an MoE `GPT` with its
    load-balance loss on does). The core asks the model rather than knowing any
    model's class: the models depend on the core, never the reverse."""
    microbatches = resolved.microbatches
    if microbatches == 1:
        return
    declares = lambda x: isinstance(x, eqx.Module) and callable(getattr(x, "batch_statistic_loss", None))  # noqa: E731
    terms = [x.batch_statistic_loss() for x in jax.tree.leaves(model, is_leaf=declares) if declares(x)]
    terms = [t for t in terms if t is not None]
    if not terms:
        return
    what, fix = terms[0]
    warnings.warn(
        f"{resolved.batch.split_by(microbatches)} splits the batch into {microbatches} micro-batches, and {what}: "
        "its mean over the micro-batches is not its value on the whole batch, and the step's gradient is "
        f"not the full batch's mean gradient. Use accumulate=1 (or fewer micro-batches), or {fix}, or "
        "accept the approximation: warnings.filterwarnings('ignore', category=eqxpar.AccumulationWarning).",
        AccumulationWarning,
        stacklevel=stacklevel + 1,
    )


def _check_loss(loss_fn: Any, resolved: ResolvedPlan, has_aux: bool, where: str) -> None:
    """The builder's `loss_fn` checked against its resolved plan (`where`: the builder)."""
    if not callable(loss_fn):
        raise PlanError(f"{where}(loss_fn={loss_fn!r}): expected a callable loss_fn(model, batch).")
    if resolved.pipeline is not None:
        from ..pipeline._engine import check_pipeline_step

        check_pipeline_step(loss_fn, resolved.pipeline, accumulate=resolved.accumulate, has_aux=has_aux)


def make_step(
    loss_fn: Callable[..., Float[Array, ""] | tuple[Float[Array, ""], Any]],
    optimizer: optax.GradientTransformation,
    plan: Plan,
    *,
    accumulate: int = 1,
    donate: bool = True,
    has_aux: bool = False,
    # Any: checked below, with an eqxpar error that names the value.
    skip_nonfinite: Any = False,
    trainable: Any = None,
) -> Step:
    """Build the compiled training step for `plan`.

    One step computes the loss and gradients over the global batch, reduces the
    gradients over the data-parallel devices, applies the optimizer and returns the
    new state and metrics. Under `plan.mode == "auto"` the compiler places the
    collectives (GSPMD); under `"manual"` the loss and gradients are computed per
    device inside `jax.shard_map` and eqxpar reduces the gradients itself (one
    all-reduce of the gradient bytes).

    **Arguments:**

    - `loss_fn`: `loss_fn(model, batch) -> loss` (a float scalar), or
      `-> (loss, aux)` with `has_aux=True`. The loss must be a mean over the batch's
      examples so that sharded and accumulated steps equal the full-batch one. Or
      it returns an `eqxpar.train.WeightedMean(total, weight)` (a weighted sum and
      its weight, as `eqxpar.models.lm_loss` does for packed or masked tokens):
      the step then adds the totals and weights of every part of the batch (the
      data-parallel devices' shares, the `accumulate` micro-batches, a pipeline's
      micro-batches), reports `sum(total) / sum(weight)` as the loss and divides
      the summed totals' gradients by `sum(weight)`: the whole batch's weighted
      mean and its gradient, however the batch is split. If it takes a `key=`
      keyword it gets a fresh key each step.
    - `optimizer`: an optax transformation (wrap it in `optax.inject_hyperparams` to
      report the learning rate).
    - `plan`: the plan.
    - `accumulate`: number of micro-batches the batch is split into; their
      gradients are averaged with a `lax.scan`. That mean equals the full-batch
      gradient exactly when the loss is a mean over rows (equal micro-batches: the
      mean of their means is the batch's mean), as cross-entropy, MSE and an MoE's
      router z-loss (a mean over tokens) are. A term that is a function of batch
      statistics is not: an MoE's load-balance loss (`experts * sum_e f_e * P_e`,
      a product of two batch means) is then the mean of the micro-batches' values,
      and the step warns (`eqxpar.AccumulationWarning`) for a `GPT` whose
      `load_balance_coef` is not 0. A pipeline's micro-batches (`Plan(microbatches=m)`)
      split the batch the same way. Each device sums its micro-batches' gradients and the step reduces them
      once, after the loop, under every plan (the batch axes run manual while
      accumulating; manual FSDP gathers its weights once, before the loop), so
      `accumulate=k` moves the bytes of `accumulate=1`.
    - `donate`: donate the input state's buffers to the output state.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.
    - `skip_nonfinite`: skip a step whose loss or gradient norm is NaN or inf
      (default False): the parameters and the optimizer state, optax's counters
      included, stay exactly as they were; `state.step` still advances (it counts
      the batches consumed) and `state.skipped_steps` counts the skip (it lives in
      the state, so checkpoints keep it). The same under every plan and with
      `accumulate` (a NaN in one micro-batch skips the whole step). It lets a long
      run go on unattended past a bad batch, which would otherwise turn most
      parameters into NaN, while the metrics still show the NaN loss and the skip;
      use `eqxpar.train.SkipMonitor` to stop a run that keeps skipping. Its cost is
      one select per parameter and optimizer-state array, fused into the update,
      and the update then waits for the gradient norm. On XLA:CPU before jaxlib
      0.12 a step that loops (a scanned stack, `accumulate > 1`) over parameters
      sharded over an axis the compiler partitions (automatic FSDP or tensor
      parallelism) raises `PlanError` at its first call: such a step hung there
      (XLA:CPU let a weight gather start while the stack's loop of gathers ran,
      and the devices' waiting collectives held every thread of its pool); use
      jaxlib >= 0.12, `mode="manual"`, or `optax.apply_if_finite`. The check is on
      the loss and the global gradient norm (summed in float32: a norm beyond
      ~1.8e19 counts as non-finite). `optax.apply_if_finite(optimizer, n)` is the
      alternative inside the optimizer: it checks the gradients only (not the
      loss), keeps its counters in the optimizer state, and after `n` consecutive
      bad steps applies the non-finite update anyway. `False`: no check, and a
      non-finite gradient reaches the optimizer.
    - `trainable`: which weights train, as an Equinox filter: a bool, a callable
      `leaf -> bool`, or a pytree of those that is a prefix of the model (built on
      the model as loaded or as the state holds it: the plan's stack order is
      applied to it). Default None: every floating-point array. Frozen weights stay
      bit-identical, have no optimizer state (build the state with
      `train.init(..., trainable=)` and the same filter; the step refuses another),
      get no gradient reduction, and, outside pipelines, no weight-gradient
      computation (they are not differentiated; a pipeline stage's backward still
      computes theirs, and drops them). A filter decides per leaf: an
      `eqxpar.nn.Stacked` weight (every layer of a stack) trains or not as a whole
      (see the fine-tuning guide for training some layers).
      `eqxpar.models.lora_trainable(model)` is the filter that trains only the
      LoRA adapters of `eqxpar.models.add_lora`.

    **Returns:** a `Step`; `step(state, batch) -> (state, metrics)` with metrics
    `{"loss", "grad_norm", "learning_rate" (when exposed), "aux" (with has_aux;
    stacked over micro-batches when accumulate > 1, averaged over data-parallel
    devices in manual mode), "skipped" (bool: this step was skipped) and
    "skipped_steps" (the state's running count) with skip_nonfinite}`. Every batch
    leaf has a leading batch dimension.

    **Warns:** `eqxpar.AccumulationWarning` when the batch is split into
    micro-batches (`accumulate > 1`, or a pipeline's) and the model is an MoE
    `GPT` with `load_balance_coef != 0` (see `accumulate`).
    `RuntimeWarning` on XLA:CPU when the step is manual over two or more
    mesh axes of size > 1 (a manual plan, a pipeline, ZeRO-1) and `XLA_FLAGS` lacks
    `--xla_cpu_enable_concurrency_optimized_scheduler=false`: without it XLA:CPU
    may run two collectives of one kind over one device group at once and abort.

    ```python
    step = eqxpar.train.make_step(loss_fn, optim, plan)
    state, metrics = step(state, (x, y))
    ```
    """
    resolved = ResolvedPlan.of(plan, accumulate, training="make_step")
    _check_loss(loss_fn, resolved, has_aux, "make_step")
    if not isinstance(skip_nonfinite, bool):
        raise PlanError(f"make_step(skip_nonfinite={skip_nonfinite!r}): expected True or False.")
    warn_cpu_collective_order(resolved)
    warn_cpu_offload(resolved)
    loss = LossFunction.wrap(loss_fn, has_aux=has_aux, compute_dtype=resolved.compute_dtype)
    return Step(loss, optimizer, resolved, donate=donate, skip_nonfinite=skip_nonfinite, trainable=trainable)


def make_value_and_grad(
    loss_fn: Callable[..., Float[Array, ""] | tuple[Float[Array, ""], Any]],
    plan: Plan,
    *,
    accumulate: int = 1,
    has_aux: bool = False,
    trainable: Any = None,
) -> Callable:
    """The loss and gradients of a train step, without the update: compiled, and
    computed exactly as `make_step` computes them for `plan`.

    Useful for custom update rules, for gradient inspection, and for checking a
    plan against a single-device `jax.value_and_grad`.

    **Arguments:** as for `make_step` (`loss_fn`, `plan`, `accumulate`, `has_aux`,
    `trainable`: gradients for those weights only, None at frozen ones).

    **Returns:** a `ValueAndGrad` `f`: `f(model, batch, *, key=None) -> (loss,
    grads)`, or `((loss, aux), grads)` with `has_aux`; `f.lower(model, batch)`
    lowers it from arrays or outlines; `grads` mirrors the model's floating-point
    arrays (None elsewhere) with the parameters' sharding. `key` reaches a loss
    function that takes `key=` (default `jax.random.key(0)`).

    ```python
    loss, grads = eqxpar.train.make_value_and_grad(loss_fn, plan)(model, batch)
    ```
    """
    resolved = ResolvedPlan.of(plan, accumulate, training="make_value_and_grad")
    _check_loss(loss_fn, resolved, has_aux, "make_value_and_grad")
    warn_cpu_offload(resolved)
    loss = LossFunction.wrap(loss_fn, has_aux=has_aux, compute_dtype=resolved.compute_dtype)

    def compiled(model, batch, key):
        with plan:
            mask = trainable_mask(model, trainable, resolved, where="make_value_and_grad")
            layout = StepLayout.of(resolved, model, trainable=mask)
            model = place_tree(model, resolved.mesh, layout.params)
            batch = place_tree(batch, resolved.mesh, layout.batch)
            value, aux, grads = _gradients(loss, layout, model, batch, key)
        return ((value, aux), grads) if has_aux else (value, grads)

    return ValueAndGrad(OutlineJit(compiled, what="make_value_and_grad's function"), resolved)


class ValueAndGrad:
    """The compiled loss-and-gradients function `make_value_and_grad` builds:
    `f(model, batch, *, key=None) -> (loss, grads)`, and `f.lower(model, batch,
    *, key=None)` for arrays or outlines (`jax.ShapeDtypeStruct`s: the model built
    under `eqx.filter_eval_shape`), which lowers the program a call runs."""

    def __init__(self, compiled: OutlineJit, resolved: ResolvedPlan):
        self._compiled, self._resolved = compiled, resolved

    def _checked(self, model: PyTree, batch: PyTree, key: Any) -> tuple:
        check_batch(batch, self._resolved.batch, microbatches=self._resolved.microbatches)
        _warn_batch_statistics(model, self._resolved, stacklevel=4)
        return model, batch, jax.random.key(0) if key is None else key

    def __call__(self, model: PyTree, batch: PyTree, *, key: PRNGKeyArray | None = None) -> Any:
        return self._compiled(*self._checked(model, batch, key))

    def lower(self, model: PyTree, batch: PyTree, *, key: PRNGKeyArray | None = None) -> jax.stages.Lowered:
        """Lower for `model` and `batch` (arrays or outlines); nothing runs."""
        return self._compiled.lower(*self._checked(model, batch, key))
