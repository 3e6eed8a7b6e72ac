"""`make_step`: one compiled training step for any plan."""

import inspect
import math
import os
import warnings
from collections.abc import Callable, Collection
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from ._errors import PlanError
from ._fsdp import gather_whole, gathered_axes, gathers_of, layer_gathers, prepare_model, wire_dtype
from ._plan import Plan
from ._rules import mesh_axis_names
from ._shard_map import filter_shard_map, region_manual_axes
from ._sharding import check_batch, named_shardings, shard
from ._specs import partition_specs
from ._train_state import TrainState, cast_floating

Metrics = dict[str, Any]


def _learning_rate(opt_state: PyTree) -> Array | None:
    # optax.inject_hyperparams keeps the schedule's current value in its state.
    nodes = jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    for node in nodes:
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and "learning_rate" in hyper:
            return jnp.asarray(hyper["learning_rate"])
    return None


def _vary(x: Array, axes: tuple[str, ...]) -> Array:
    # A weight split over an axis is already varying along it (pcast rejects that).
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def _varies_along(tree: PyTree, axis: str) -> bool:
    """Whether any floating-point array in `tree` varies along manual mesh `axis`."""
    leaves = [x for x in jax.tree.leaves(tree) if eqx.is_inexact_array(x)]
    return any(axis in jax.typeof(x).mat.varying for x in leaves)


def _check_same_on_devices(loss: Array, aux: PyTree, *, allowed: tuple[str, ...]) -> None:
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
            extra = sorted(set(jax.typeof(x).mat.varying) - set(allowed))
            if what == "aux" and not jnp.issubdtype(x.dtype, jnp.inexact) and set(jax.typeof(x).mat.varying):
                raise PlanError(
                    f"the loss function's aux holds an integer array (shape {x.shape}, dtype {x.dtype}) that "
                    f"differs between devices along {sorted(jax.typeof(x).mat.varying)}; a manual step averages aux "
                    "over the data-parallel devices, which integers cannot be. Return it as a float."
                )
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


def _split_microbatches(batch: PyTree, k: int) -> PyTree:
    # Micro-batch j takes rows j, k + j, 2k + j, ...: each device already holds its
    # share of every micro-batch, so splitting moves no data between devices.
    def split(x):
        x = x.reshape(x.shape[0] // k, k, *x.shape[1:])
        return jnp.swapaxes(x, 0, 1)

    return jax.tree.map(split, batch)


class _Gradients:
    """Loss, aux and gradients of `loss_fn` over a batch, accumulated over k
    micro-batches with `lax.scan` when k > 1."""

    def __init__(
        self,
        loss_fn: Callable,
        *,
        has_aux: bool,
        accumulate: int,
        plan: Plan,
        local_axes: tuple[str, ...] = (),
        vary_axes: tuple[str, ...] | None = None,
        prepare: Callable | None = None,
        gather: Callable | None = None,
    ):
        # `local_axes`: inside shard_map, the manual axes the batch is split over.
        # The parameters are marked as varying along them before differentiating,
        # so each device's gradient stays local (no implicit psum per micro-batch)
        # and the caller reduces the accumulated gradient once.
        # `prepare`: applied to the model inside the differentiated function (manual
        # FSDP gathers weight shards there, so gradients flow back as reduce-scatters).
        # `vary_axes` (default `local_axes`): the axes the parameters are marked
        # varying along, a superset of `local_axes` (see `_gradient_fn`).
        # `gather`: with k > 1 micro-batches, used instead of `prepare`: it maps the
        # parameters to whole (gathered) ones once, before the micro-batch loop,
        # so the gradients are reduce-scattered once, after it, by its transpose.
        self.gather = gather
        self.local_axes = local_axes
        self.vary_axes = local_axes if vary_axes is None else vary_axes
        self.prepare = prepare
        self.loss_fn = loss_fn
        self.has_aux = has_aux
        self.accumulate = accumulate
        self.plan = plan
        self.takes_key = "key" in inspect.signature(loss_fn).parameters

    def _value_and_grad(self, params, static, batch, key, prepare):
        compute = self.plan.compute_dtype
        if compute is not None:
            batch = cast_floating(batch, compute)

        def scalar_loss(params):
            if compute is not None:
                # Mixed precision: the cast sits inside the differentiated function,
                # so gradients come back in the parameters' (master) dtype.
                params = cast_floating(params, compute)
            model = eqx.combine(params, static)
            per_layer = {}
            if prepare is not None:
                model, per_layer = prepare(model)
            with layer_gathers(per_layer):
                out = self.loss_fn(model, batch, key=key) if self.takes_key else self.loss_fn(model, batch)
            loss, aux = out if self.has_aux else (out, None)
            return loss.astype(jnp.float32) if compute is not None else loss, aux

        (loss, aux), grads = jax.value_and_grad(scalar_loss, has_aux=True)(params)
        _check_same_on_devices(loss, aux, allowed=self.vary_axes)
        return loss, aux, grads

    def __call__(self, model, batch, key):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        if self.vary_axes:
            params = jax.tree.map(lambda p: _vary(p, self.vary_axes), params)
        k = self.accumulate
        if k == 1:
            return self._value_and_grad(params, static, batch, key, self.prepare)
        micro = _split_microbatches(batch, k)
        # Sums are kept in the parameters' dtype whatever the compute dtype.
        sum_dtypes = jax.tree.map(lambda p: p.dtype, params)
        prepare, pull = self.prepare, None
        if self.gather is not None:
            compute = self.plan.compute_dtype
            # Cast before gathering, as the one-batch step does (its gathers move
            # the compute dtype).
            gather = self.gather if compute is None else (lambda p: self.gather(cast_floating(p, compute)))
            params, pull = jax.vjp(gather, params)
            prepare = None

        def accumulate(carry, xs):
            grads_sum, loss_sum = carry
            index, mb = xs
            mb = shard(mb, self.plan, specs=self.plan.batch_spec)
            loss, aux, grads = self._value_and_grad(
                params, static, mb, jax.random.fold_in(key, index), prepare
            )
            grads_sum = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), grads_sum, grads)
            return (grads_sum, loss_sum + loss), aux

        loss_zero = jnp.zeros((), jnp.float32)
        if self.local_axes:
            # The carry's types must match the per-device loss, which varies.
            loss_zero = jax.lax.pcast(loss_zero, self.local_axes, to="varying")
        zeros = jax.tree.map(lambda p, dtype: jnp.zeros_like(p, dtype=dtype), params, sum_dtypes)
        (grads, loss), aux = jax.lax.scan(accumulate, (zeros, loss_zero), (jnp.arange(k), micro))
        grads = jax.tree.map(lambda g: g / k, grads)
        if pull is not None:
            (grads,) = pull(jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params))
        return loss / k, aux, grads


def _apply(optimizer, plan: Plan, state: TrainState, grads, loss, aux, has_aux) -> tuple[TrainState, Metrics]:
    model = state.model
    if plan.zero1:
        # ZeRO-1: update this device's slice of every parameter (slicing a
        # replicated array moves nothing), then gather the new parameters.
        model = shard(model, plan, specs=partition_specs(model, plan.optimizer_rules, mesh=plan.mesh))
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, opt_state = optimizer.update(grads, state.opt_state, params)
    model = eqx.apply_updates(model, updates)
    if plan.zero1:
        model = shard(model, plan)
    metrics: Metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    lr = _learning_rate(opt_state)
    if lr is not None:
        metrics["learning_rate"] = lr
    if has_aux:
        metrics["aux"] = aux
    new_state = TrainState(model=model, opt_state=opt_state, step=state.step + 1, key=state.key)
    return new_state, metrics


class Step:
    """A compiled training step `(state, batch) -> (state, metrics)`.

    Built by `eqxpar.train.make_step`. Compiled once per state layout and batch
    shape (later calls reuse it); `.lower(state, batch)` gives the
    `jax.stages.Lowered` for reading the HLO, and `.compile(...)` the compiled
    executable.
    """

    def __init__(self, body: Callable, plan: Plan, *, loss_fn: Callable, donate: bool, accumulate: int):
        #: The loss function the step differentiates (read by `eqxpar.inspect`).
        self.loss_fn = loss_fn
        self._body = body
        self._plan = plan
        self._donate = donate
        self._accumulate = accumulate
        self._cache: dict[Any, tuple[Callable, PyTree]] = {}

    def _jitted(self, state: TrainState, batch: PyTree) -> tuple[Callable, PyTree]:
        dynamic, static = eqx.partition(state, eqx.is_array)
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
        plan = self._plan
        state_shardings = named_shardings(dynamic, plan)
        batch_sharding = plan.sharding(plan.batch_spec)
        replicated = plan.sharding(PartitionSpec())
        body = self._body

        def step(dynamic, batch):
            with plan:
                new_state, metrics = body(eqx.combine(dynamic, static), batch)
            new_dynamic, new_static = eqx.partition(new_state, eqx.is_array)
            if jax.tree.structure(new_static) != static_def:
                raise PlanError(
                    "the step changed the non-array part of the train state; the "
                    "optimizer update must keep the model's structure."
                )
            return new_dynamic, metrics

        jitted = jax.jit(
            step,
            in_shardings=(state_shardings, batch_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=(0,) if self._donate else (),
        )
        self._cache[cache_key] = (jitted, static)
        return self._cache[cache_key]

    def _prepare(self, state: TrainState, batch: PyTree) -> tuple[Callable, PyTree, PyTree]:
        if not isinstance(state, TrainState):
            raise PlanError(
                f"a step takes (state, batch) with state an eqxpar.train.TrainState, got "
                f"{type(state).__name__}; build it with eqxpar.train.init(model, optimizer, plan, key=...)."
            )
        check_batch(batch, self._plan, microbatches=self._accumulate)
        jitted, static = self._jitted(state, batch)
        return jitted, static, eqx.filter(state, eqx.is_array)

    def __call__(self, state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        jitted, static, dynamic = self._prepare(state, batch)
        batch = shard(batch, self._plan, specs=self._plan.batch_spec, copy=False)
        new_dynamic, metrics = jitted(dynamic, batch)
        return eqx.combine(new_dynamic, static), metrics

    def lower(self, state: TrainState, batch: PyTree) -> jax.stages.Lowered:
        """Lower the step for `state` and `batch` (concrete arrays; nothing runs)."""
        jitted, _, dynamic = self._prepare(state, batch)
        # Placed as `__call__` places it, so that `.compile()` is the executable
        # the step runs (jit caches by the inputs' shardings).
        return jitted.lower(dynamic, shard(batch, self._plan, specs=self._plan.batch_spec, copy=False))

    def compile(self, state: TrainState, batch: PyTree) -> jax.stages.Compiled:
        """The compiled executable for `state` and `batch` (for HLO, memory, cost)."""
        return self.lower(state, batch).compile()


#: The XLA flag that makes XLA:CPU run each device's collectives in program order.
CPU_COLLECTIVE_ORDER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def step_manual_axes(plan: Plan, accumulate: int = 1) -> frozenset[str]:
    """The mesh axes a step built for `plan` runs manually (inside `shard_map`):
    every axis for a pipeline; the plan's `manual_axes` for a manual plan; the
    batch axes for an automatic ZeRO-1 plan (to reduce-scatter the gradients);
    none for other automatic plans; and, when the step accumulates gradients
    (`accumulate > 1`), the batch axes too, so that each device sums its
    micro-batches' gradients before the one reduction of the step (left to the
    compiler, the reduction would run once per micro-batch). Kept as
    `region_manual_axes` keeps them."""
    if plan.schedule is not None:
        return frozenset(plan.mesh.axis_names)
    axes = tuple(plan.manual_axes) if plan.mode == "manual" else ()
    if plan.zero1 and plan.mode == "auto" or accumulate > 1:
        axes += tuple(a for a in plan.batch_axes if a not in axes)
    return region_manual_axes(plan.mesh, axes) if axes else frozenset()


def _warn_cpu_collective_order(plan: Plan, accumulate: int) -> None:
    """Warn when `plan` runs manual collectives over two or more axes on XLA:CPU
    without `CPU_COLLECTIVE_ORDER_FLAG`.

    JAX gives every collective of a `shard_map` the same channel id, and XLA:CPU
    keys its rendezvous by (device group, kind, channel id). Its default
    concurrency-optimised scheduler may start two independent collectives of one
    kind over one group at once (two FSDP weight gathers of a layer; the
    reduce-scatters of their gradients), and the simulated devices then join each
    other's rendezvous: the process aborts ("Unexpected number of participants")
    or hangs. It happens with a region manual over `fsdp` and `tensor` with
    sequence parallelism. The flag can only be set before JAX starts its CPU
    backend (a per-compilation option is ignored), so eqxpar can only say so.
    """
    if plan.mesh.devices.flat[0].platform != "cpu":
        return
    manual = sorted(step_manual_axes(plan, accumulate), key=plan.mesh.axis_names.index)
    if sum(plan.mesh.shape[a] > 1 for a in manual) < 2:
        return
    if CPU_COLLECTIVE_ORDER_FLAG.split("=")[0] in os.environ.get("XLA_FLAGS", ""):
        return
    warnings.warn(
        f"this plan issues its own collectives over several mesh axes ({', '.join(manual)}) on "
        "XLA:CPU, whose default scheduler can run two of them at once and abort the process "
        "('Unexpected number of participants'). Set XLA_FLAGS to include "
        f"{CPU_COLLECTIVE_ORDER_FLAG} before importing jax (as the eqxpar examples do).",
        RuntimeWarning,
        stacklevel=3,
    )


def _is_bfloat16(dtype: Any) -> bool:
    return dtype is not None and jnp.dtype(dtype) == jnp.bfloat16


def _check_cpu_partial_manual_dtypes(plan: Plan, accumulate: int, where: str) -> None:
    """Refuse the bfloat16 all-reduces eqxpar cannot widen in a partial-manual
    region on XLA:CPU.

    In a region manual over some axes only, JAX lowers an all-reduce's reduction
    with a sharding annotation (a `copy` in HLO); XLA:CPU widens bfloat16
    all-reduces to float32 and, cloning that reduction, aborts the process
    ("Invalid binary instruction opcode copy"). float16 is not widened and
    compiles. The step's own gradient reductions and FSDP gathers there run in
    float32 instead (`_fsdp.wire_dtype`); what remains are the
    tensor-parallel layers' all-reduces under `compute_dtype=bfloat16`.
    """
    if plan.mesh.devices.flat[0].platform != "cpu":
        return
    manual = step_manual_axes(plan, accumulate)
    if not manual or manual == frozenset(plan.mesh.axis_names):
        return
    # The layers compute in the compute dtype, else in the parameters'.
    if not (_is_bfloat16(plan.compute_dtype or plan.param_dtype) and plan.tensor_axis in manual):
        return
    left = sorted(set(plan.mesh.axis_names) - manual, key=plan.mesh.axis_names.index)
    raise PlanError(
        f"{where}: this plan runs a partial-manual region (manual over "
        f"{sorted(manual, key=plan.mesh.axis_names.index)}, automatic over {left}) with "
        "bfloat16 compute (compute_dtype, or param_dtype without one), so the tensor-parallel "
        "layers issue bfloat16 all-reduces there, "
        "which XLA:CPU aborts the process compiling. On CPU, drop Plan(manual_axes=...) so every "
        "axis is manual, use mode='auto', or compute in float32 or float16 (XLA:CPU moves bfloat16 "
        "collectives as float32 anyway)."
    )


def _validate(plan: Plan, accumulate: int, where: str) -> None:
    if not isinstance(plan, Plan):
        raise PlanError(f"{where}(..., plan={plan!r}): expected an eqxpar.Plan.")
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise PlanError(f"{where}(accumulate={accumulate!r}): expected an integer >= 1.")
    _check_cpu_partial_manual_dtypes(plan, accumulate, where)


def _check_manual_specs(specs: PyTree, plan: Plan, manual_axes: Collection[str]) -> None:
    # Inside the manual region a weight split over a manual axis arrives as a shard.
    # eqxpar.nn layers know what to do with shards of the tensor axis, and the step
    # gathers shards of the batch axes (FSDP); nothing would gather a weight split
    # over another manual axis, so such a model would silently compute on fragments.
    allowed = {plan.tensor_axis, *plan.batch_axes}
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)):
        if not isinstance(spec, PartitionSpec):
            continue
        for entry in spec:
            for axis in mesh_axis_names(entry):
                if axis in manual_axes and axis not in allowed and plan.mesh.shape[axis] > 1:
                    raise PlanError(
                        f"mode='manual' splits weights over the tensor axis {plan.tensor_axis!r} and "
                        f"the batch axes {plan.batch_axes} (FSDP) only, but the plan's rules give a "
                        f"weight the spec {spec}, over manual axis {axis!r}. Use mode='auto' for "
                        f"such weights, or Plan(manual_axes=...) without {axis!r}."
                    )


def _gradient_fn(loss_fn: Callable, plan: Plan, *, accumulate: int, has_aux: bool) -> Callable:
    """`(model, batch, key) -> (loss, aux, grads)` over the global batch, for the
    plan's mode; gradients come out with the parameters' sharding."""
    if plan.schedule is not None:
        # Pipeline plans run their own engine (eqxpar.pipeline): same contract.
        from .pipeline._engine import pipeline_gradients

        return pipeline_gradients(loss_fn, plan, accumulate=accumulate, has_aux=has_aux)
    manual_axes = step_manual_axes(plan, accumulate)
    if not manual_axes:
        grads_of = _Gradients(loss_fn, has_aux=has_aux, accumulate=accumulate, plan=plan)

        def automatic(model, batch, key):
            loss, aux, grads = grads_of(model, batch, key)
            # Gradients take the parameters' sharding (FSDP: reduce to shards).
            return loss, aux, shard(grads, plan)

        return automatic

    # ZeRO-1 under an automatic plan: only the batch axes are manual, so that the
    # gradients can be reduce-scattered (XLA all-reduces and slices otherwise).
    # Accumulating steps: the batch axes are manual too (see step_manual_axes).
    # The batch axes this step splits the batch over by hand; batch axes left
    # automatic (partial-manual plans) are the compiler's: it sees the whole batch
    # along them, and reduces the gradients over them itself, after the region.
    axes = tuple(a for a in plan.batch_axes if a in manual_axes)
    dp = math.prod(plan.mesh.shape[a] for a in axes)

    # Under sequence parallelism every use of a weight replicated over `tensor` sits
    # on a sequence block, so its gradient is a sum of per-device partials. Left to
    # autodiff, that sum is an all-reduce over `tensor` followed by the step's own
    # over the batch axes; marking those weights varying along `tensor` too keeps
    # the partials local, and one all-reduce over both axes sums them (fewer bytes,
    # one collective). Only where the batch axes are reduced here by hand.
    tensor = plan.tensor_axis
    merge_tensor = (
        bool(axes)
        and plan.sequence_parallel
        and tensor in manual_axes
        and tensor not in axes
        and plan.mesh.shape.get(tensor, 1) > 1
    )

    # Under sequence parallelism each device of the tensor axis holds its own
    # sequence block, so it needs its own randomness (dropout masks) too.
    fold_tensor = plan.sequence_parallel and tensor in manual_axes and plan.mesh.shape.get(tensor, 1) > 1

    def per_device(model, batch, key, specs, out_specs):
        prepare = gather = None
        if axes and accumulate > 1:
            gather = lambda params: gather_whole(params, specs, axes)  # noqa: E731
        elif axes:
            prepare = lambda m: prepare_model(m, specs, axes)  # noqa: E731

        def gradients(vary_axes):
            grads_of = _Gradients(
                loss_fn,
                has_aux=has_aux,
                accumulate=accumulate,
                plan=plan,
                local_axes=axes,
                vary_axes=vary_axes,
                prepare=prepare,
                gather=gather,
            )
            return grads_of(model, batch, key)

        # Distinct examples per device need distinct randomness (e.g. dropout).
        for axis in axes + ((tensor,) if fold_tensor else ()):
            key = jax.random.fold_in(key, jax.lax.axis_index(axis))
        merged = merge_tensor
        loss, aux, grads = gradients(axes + ((tensor,) if merged else ()))
        if merged and _varies_along((loss, aux), tensor):
            # A replicated weight reaches the loss off the sequence blocks (say, a
            # scale applied after `sequence_mean`), where its uses are not per-device
            # partials: trace again and let autodiff sum over `tensor` (the unused
            # first trace is dead code, removed before compiling).
            merged = False
            loss, aux, grads = gradients(axes)
        if not axes:
            return loss, aux, grads

        # `grads_of` differentiated w.r.t. parameters marked varying along the batch
        # axes, so these are this device's (accumulated) gradients: one all-reduce
        # of the gradient bytes makes them global. (Differentiating the replicated
        # parameters directly would make check_vma insert that psum itself, once per
        # micro-batch; a pmean on top of it would reduce twice.) Along the tensor
        # axis check_vma does the right thing unaided: a weight split over it gets
        # its own shard's gradient, and a replicated weight used on sequence shards
        # gets its partial gradients summed (under sequence parallelism those
        # partials are kept local instead and summed here with the batch axes, in
        # the same all-reduce: `merge_tensor`). A weight split over batch axes (FSDP)
        # was gathered in the loss, so its gradient arrives reduce-scattered over
        # those axes and is summed over the remaining ones only.
        # Under ZeRO-1 a gradient whose out spec adds batch axes is reduce-scattered
        # along that dimension instead: each device keeps the slice it updates.
        def reduce(spec, out_spec, g):
            if g is None:
                return None
            gathered = gathered_axes(spec, axes)
            scatter = [(d, a) for d, a in gathers_of(out_spec, axes, where="gradient") if set(a) - gathered]
            rest = tuple(a for a in axes if a not in gathered and all(a not in z for _, z in scatter))
            if merged and tensor not in gathered_axes(spec, (tensor,)):
                rest = rest + (tensor,)
            dtype = g.dtype
            g = g.astype(wire_dtype(plan.reduce_dtype or dtype))
            for dim, over in scatter:
                g = jax.lax.psum_scatter(g, over, scatter_dimension=dim, tiled=True)
            if rest:
                g = jax.lax.psum(g, rest)
            return (g / dp).astype(dtype)

        is_spec = lambda s: isinstance(s, PartitionSpec) or s is None  # noqa: E731
        grads = jax.tree.map(reduce, specs, out_specs, grads, is_leaf=is_spec)
        def mean(x):  # in a dtype XLA:CPU compiles here (see _fsdp.wire_dtype)
            return jax.lax.pmean(x.astype(wire_dtype(x.dtype)), axes).astype(x.dtype)

        loss = mean(loss)
        if has_aux:
            aux = jax.tree.map(lambda a: mean(a) if jnp.issubdtype(a.dtype, jnp.inexact) else a, aux)
        return loss, aux, grads

    def manual(model, batch, key):
        specs = partition_specs(model, plan)
        _check_manual_specs(specs, plan, manual_axes)
        # The gradients' layout: the parameters', or under ZeRO-1 the optimizer's.
        grad_specs = partition_specs(model, plan.optimizer_rules, mesh=plan.mesh)
        loss, aux, grads = filter_shard_map(
            lambda model, batch, key: per_device(model, batch, key, specs, grad_specs),
            plan,
            in_specs=(specs, plan.batch_spec, PartitionSpec()),
            out_specs=(PartitionSpec(), PartitionSpec(), grad_specs),
            axis_names=manual_axes,
        )(model, batch, key)
        if set(manual_axes) != set(plan.mesh.axis_names):
            # Automatic axes: gradients take their sharding there, as in auto mode.
            grads = shard(grads, plan, specs=partition_specs(grads, plan.optimizer_rules, mesh=plan.mesh))
        return loss, aux, grads

    return manual


def make_step(
    loss_fn: Callable[..., Float[Array, ""] | tuple[Float[Array, ""], Any]],
    optimizer: optax.GradientTransformation,
    plan: Plan,
    *,
    accumulate: int = 1,
    donate: bool = True,
    has_aux: bool = False,
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
      examples so that sharded and accumulated steps equal the full-batch one. If
      it takes a `key=` keyword it gets a fresh key each step.
    - `optimizer`: an optax transformation (wrap it in `optax.inject_hyperparams` to
      report the learning rate).
    - `plan`: the plan.
    - `accumulate`: number of micro-batches the batch is split into; their
      gradients are averaged with a `lax.scan`, equal to the full-batch gradient.
      Each device sums its micro-batches' gradients and the step reduces them
      once, after the loop, under every plan (the batch axes run manual while
      accumulating; manual FSDP gathers its weights once, before the loop), so
      `accumulate=k` moves the bytes of `accumulate=1`.
    - `donate`: donate the input state's buffers to the output state.
    - `has_aux`: whether `loss_fn` returns `(loss, aux)`.

    **Returns:** a `Step`; `step(state, batch) -> (state, metrics)` with metrics
    `{"loss", "grad_norm", "learning_rate" (when exposed), "aux" (with has_aux;
    stacked over micro-batches when accumulate > 1, averaged over data-parallel
    devices in manual mode)}`. Every batch leaf has a leading batch dimension.

    **Warns:** `RuntimeWarning` on XLA:CPU when the step is manual over two or more
    mesh axes of size > 1 (a manual plan, a pipeline, ZeRO-1) and `XLA_FLAGS` lacks
    `--xla_cpu_enable_concurrency_optimized_scheduler=false`: without it XLA:CPU
    may run two collectives of one kind over one device group at once and abort.

    ```python
    step = eqxpar.train.make_step(loss_fn, optim, plan)
    state, metrics = step(state, (x, y))
    ```
    """
    _validate(plan, accumulate, "make_step")
    _warn_cpu_collective_order(plan, accumulate)
    gradients = _gradient_fn(loss_fn, plan, accumulate=accumulate, has_aux=has_aux)

    def body(state: TrainState, batch: PyTree) -> tuple[TrainState, Metrics]:
        key = jax.random.fold_in(state.key, state.step)
        loss, aux, grads = gradients(state.model, batch, key)
        return _apply(optimizer, plan, state, grads, loss, aux, has_aux)

    return Step(body, plan, loss_fn=loss_fn, donate=donate, accumulate=accumulate)


def make_value_and_grad(
    loss_fn: Callable[..., Float[Array, ""] | tuple[Float[Array, ""], Any]],
    plan: Plan,
    *,
    accumulate: int = 1,
    has_aux: bool = False,
) -> Callable:
    """The loss and gradients of a train step, without the update: compiled, and
    computed exactly as `make_step` computes them for `plan`.

    Useful for custom update rules, for gradient inspection, and for checking a
    plan against a single-device `jax.value_and_grad`.

    **Arguments:** as for `make_step` (`loss_fn`, `plan`, `accumulate`, `has_aux`).

    **Returns:** `f(model, batch, *, key=None) -> (loss, grads)`, or
    `((loss, aux), grads)` with `has_aux`; `grads` mirrors the model's floating-point
    arrays (None elsewhere) with the parameters' sharding. `key` reaches a loss
    function that takes `key=` (default `jax.random.key(0)`).

    ```python
    loss, grads = eqxpar.train.make_value_and_grad(loss_fn, plan)(model, batch)
    ```
    """
    _validate(plan, accumulate, "make_value_and_grad")
    gradients = _gradient_fn(loss_fn, plan, accumulate=accumulate, has_aux=has_aux)

    @eqx.filter_jit
    def compiled(model, batch, key):
        with plan:
            model = shard(model, plan)
            batch = shard(batch, plan, specs=plan.batch_spec)
            loss, aux, grads = gradients(model, batch, key)
        return ((loss, aux), grads) if has_aux else (loss, grads)

    def value_and_grad(model: PyTree, batch: PyTree, *, key: PRNGKeyArray | None = None) -> Any:
        check_batch(batch, plan, microbatches=accumulate)
        return compiled(model, batch, jax.random.key(0) if key is None else key)

    return value_and_grad
