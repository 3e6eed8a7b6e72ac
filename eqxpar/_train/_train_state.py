"""The train state and its sharded initialisation."""

import warnings
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import Array, Int, Key, PRNGKeyArray, PyTree

from .._casting import cast_floating
from .._errors import PlanError, UnusedAxisWarning
from .._outline_jit import has_outlines
from .._plan import Plan
from .._rules import mesh_axis_names
from .._sharding import place_tree
from .._sharding import shardings_of as shardings_of_specs
from .._specs import is_array_like, partition_specs
from .._stack_order import in_plan_order
from ._resolved_plan import ResolvedPlan
from ._step_layout import StepLayout
from ._trainable import optimized, trainable_mask


def _warn_unused_axes(model: PyTree, resolved: ResolvedPlan) -> None:
    """Warn when a mesh axis of size > 1 splits neither the batch, nor a weight,
    nor an annotated activation: its devices would only repeat each other's work."""
    used = set(resolved.activation_axes)
    mesh = resolved.mesh
    specs = partition_specs(model, resolved.plan.rules, mesh=mesh)
    for spec in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, PartitionSpec)):
        if isinstance(spec, PartitionSpec):
            used.update(a for entry in spec for a in mesh_axis_names(entry))
    idle = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in used]
    if idle:
        sizes = ", ".join(f"{a}={mesh.shape[a]}" for a in idle)
        warnings.warn(
            f"mesh axes {sizes} split nothing: the plan's rules give no weight of this model a spec "
            f"over {idle!r}, and the batch is split over {resolved.batch.axes} only, so those devices hold "
            "and compute the same as each other. Rules such as rules.MEGATRON place only weights that "
            "carry eqxpar logical axes (eqxpar.nn layers, eqxpar.param(axes=...)); for any other model "
            "use rules.FSDP(axis=...), rules.ByPath([...]), or a mesh without those axes.",
            UnusedAxisWarning,
            stacklevel=3,
        )


class TrainState(eqx.Module):
    """Everything a training run carries from step to step.

    - `model`: the Equinox model (arrays sharded per the plan's rules).
    - `opt_state`: the optax state, sharded like the parameters it mirrors.
    - `step`: the number of completed steps (int32 scalar).
    - `key`: a PRNG key; a loss function that takes `key=` receives
      `jax.random.fold_in(key, step)` each step, so runs are reproducible.
    - `skipped_steps`: how many of those steps a step built with
      `make_step(..., skip_nonfinite=True)` skipped for a non-finite loss or
      gradient (int32 scalar; default 0). A skipped step advances `step` but not
      the parameters or optimizer state, so `step - skipped_steps` updates were
      applied. Saved and restored with the rest of the state.

    A state built with `init(..., abstract=True)` holds `jax.ShapeDtypeStruct`
    outlines in every array's place: it compiles a step (`Step.lower`), it does
    not run one.
    """

    model: PyTree
    opt_state: PyTree
    step: Int[Array | jax.ShapeDtypeStruct, ""]
    key: PRNGKeyArray | Key[jax.ShapeDtypeStruct, ""]
    # A default keeps states built by hand with the four fields above valid.
    skipped_steps: Int[Array | jax.ShapeDtypeStruct, ""] = eqx.field(
        default_factory=lambda: jnp.zeros((), jnp.int32)
    )


def init(
    model: PyTree,
    optimizer: optax.GradientTransformation,
    plan: Plan,
    *,
    key: PRNGKeyArray | jax.ShapeDtypeStruct,
    trainable: Any = None,
    # Any: checked below, with an eqxpar error that names the value.
    abstract: Any = False,
) -> TrainState:
    """Place `model` on the plan's mesh and build its sharded optimizer state.

    The optimizer state is created directly in its final sharding (inside jit), so a
    state too large for one device never exists whole on one device; every moment
    gets the sharding of the parameter it mirrors (under `Plan(zero1=True)`, that
    plus a split over the batch axes), scalar counters are replicated. With
    `Plan(param_dtype=...)` floating-point weights are cast to it first. Every
    `eqxpar.nn.Stacked` is stored in the order the plan runs it in
    (`Plan.stack_order`: a pipeline's order for interleaved or uneven stages), from
    whatever order it records: pass the model in natural order, as built or loaded.

    **Arguments:**

    - `model`: an Equinox model (any pytree; non-array leaves are kept).
    - `optimizer`: an optax gradient transformation.
    - `plan`: the plan giving mesh and rules.
    - `key`: a PRNG key stored in the state (keyword-only).
    - `trainable`: the filter of the weights that train, as `make_step` takes it
      (pass the same to both); the optimizer state holds nothing for the others.
      Default None: every array.
    - `abstract`: build the state's outline only (default False): every array a
      `jax.ShapeDtypeStruct` carrying the `NamedSharding` the step keeps it in,
      and nothing allocated. That is what `Step.lower` / `Step.compile` take to
      compile a step from shapes, e.g. for a TPU topology this machine does not
      have (see `eqxpar.aot`). A model given as outlines (built under
      `eqx.filter_eval_shape`) gives an outline whatever `abstract` says, and so
      does calling `init` under `eqx.filter_eval_shape`.

    **Returns:** a `TrainState` with `step == 0` and `skipped_steps == 0` (its
    outline with `abstract=True`).

    ```python
    state = eqxpar.train.init(model, optax.adamw(1e-3), plan, key=jax.random.key(0))
    # From shapes: no weight is ever allocated.
    outline = eqx.filter_eval_shape(Model, key=jax.random.key(0))
    state = eqxpar.train.init(outline, optax.adamw(1e-3), plan, key=jax.random.key(0), abstract=True)
    ```
    """

    # Built inside jit so that the state owns fresh buffers (each step donates
    # them; they must not be the caller's model arrays) and is created directly in
    # its sharding.
    resolved = ResolvedPlan.of(plan)

    @eqx.filter_jit
    def place(model: Any) -> tuple[Any, Any]:
        with plan:
            # The plan owns how stacks are stored (a pipeline's layer order): the
            # model enters it here, from whatever order it records.
            model = in_plan_order(model, resolved)
            if resolved.param_dtype is not None:
                model = cast_floating(model, resolved.param_dtype)
            mask = trainable_mask(model, trainable, resolved, where="eqxpar.train.init")
            opt_state = jax.eval_shape(optimizer.init, optimized(model, mask))
            layout = StepLayout.of(resolved, model, opt_state, trainable=mask)
            model = place_tree(model, resolved.mesh, layout.params)
            opt_state = optimizer.init(optimized(model, mask))
            return model, place_tree(opt_state, resolved.mesh, layout.opt_state)

    # Checked on the model as the plan stores it: a stack of uneven pipeline stages
    # has rows (padded per device) the pipe axis divides where its depth may not.
    _warn_unused_axes(eqx.filter_eval_shape(lambda m: in_plan_order(m, resolved), model), resolved)
    if not isinstance(abstract, bool):
        raise PlanError(f"eqxpar.train.init(abstract={abstract!r}): expected True or False.")
    if abstract or has_outlines(model):
        return _outline(place, model, resolved, key, trainable)
    try:
        model, opt_state = place(model)
    except ValueError as e:
        if not any(words in str(e) for words in ("incompatible devices", "different devices")):
            raise
        # jit refuses arrays committed to other devices than the mesh's (a model
        # loaded onto one device, e.g. from_pretrained(path) without a plan).
        raise PlanError(
            "eqxpar.train.init: the model holds arrays committed to devices outside the plan's mesh "
            f"{dict(plan.mesh.shape)} (JAX: {str(e).splitlines()[0][:160]}). Load it straight into the "
            "plan (eqxpar.models.from_pretrained(path, plan)), build it without placing it, or move it "
            "first: jax.device_put(model, plan.sharding(PartitionSpec()))."
        ) from e
    replicated = plan.sharding(PartitionSpec())
    # Built from host values: a key made by jax.random.key lives on one local
    # device, which device_put cannot place on a mesh spanning several processes.
    step = jax.device_put(np.zeros((), np.int32), replicated)
    skipped_steps = jax.device_put(np.zeros((), np.int32), replicated)
    key_data = jax.random.key_data(key)
    # Traced (init under eval_shape or jit), the key is already where the trace
    # puts it: only a concrete key is moved, from host values.
    if not isinstance(key_data, jax.core.Tracer):
        key_data = jax.device_put(np.asarray(key_data), replicated)
        key = jax.random.wrap_key_data(key_data, impl=jax.random.key_impl(key))
    state = TrainState(model=model, opt_state=opt_state, step=step, key=key, skipped_steps=skipped_steps)
    return _offloaded(state, resolved, trainable)


def _outline(place: Any, model: PyTree, resolved: ResolvedPlan, key: Any, trainable: Any) -> TrainState:
    """`init`'s state as outlines: `place` traced for shapes only (nothing is
    allocated or compiled), every array a `jax.ShapeDtypeStruct` with the sharding
    the step keeps it in."""
    model, opt_state = eqx.filter_eval_shape(place, model)
    mask = trainable_mask(model, trainable, resolved, where="eqxpar.train.init")
    layout = StepLayout.of(resolved, model, opt_state, trainable=mask)
    replicated = NamedSharding(resolved.mesh, PartitionSpec())
    if isinstance(key, jax.ShapeDtypeStruct):
        if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            raise PlanError(
                f"eqxpar.train.init(key=ShapeDtypeStruct(dtype={key.dtype})): expected a typed PRNG key or "
                "its outline, e.g. jax.random.key(0) or jax.eval_shape(jax.random.key, 0)."
            )
        key_outline = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=replicated)
    else:
        key_outline = jax.ShapeDtypeStruct(jnp.shape(key), key.dtype, sharding=replicated)
    counter = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    state = TrainState(
        model=place_tree(model, resolved.mesh, layout.params),
        opt_state=place_tree(opt_state, resolved.mesh, layout.opt_state),
        step=counter,
        key=key_outline,
        skipped_steps=counter,
    )
    return _offloaded(state, resolved, trainable)


def _offloaded(state: TrainState, resolved: ResolvedPlan, trainable: Any) -> TrainState:
    """`state` with the parts the plan offloads (`Plan(offload=...)`) in host
    memory: arrays moved there, outlines given the host sharding (what a step
    compiled from them expects)."""
    if not resolved.dims.offload:
        return state
    mask = trainable_mask(state.model, trainable, resolved, where="eqxpar.train.init")
    layout = StepLayout.of(resolved, state.model, state.opt_state, trainable=mask)
    dynamic, static = eqx.partition(state, is_array_like)
    shardings = layout.state_shardings(dynamic)

    def put(x: Any, sharding: Any) -> Any:
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding, weak_type=x.weak_type)
        return jax.device_put(x, sharding)

    return eqx.combine(jax.tree.map(put, dynamic, shardings), static)


def specs_of(tree: PyTree, resolved: ResolvedPlan) -> PyTree:
    """The PartitionSpec of every array leaf of `tree` where a train step keeps it:
    a `TrainState` (or its outline) per its `StepLayout` (under ZeRO-1 the
    optimizer state is split over the batch axes), anything else per the plan's
    rules (`eqxpar.partition_specs`). For checkpoint restore and `sharding_table`,
    which resolve the plan they are given."""
    if isinstance(tree, TrainState):
        return StepLayout.of(resolved, tree.model, tree.opt_state).state_specs(tree)
    return partition_specs(tree, resolved.plan)


def shardings_of(tree: PyTree, resolved: ResolvedPlan) -> PyTree:
    """The `NamedSharding` of every array leaf of `tree` where a train step keeps
    it (None elsewhere): `specs_of`'s specs on the plan's mesh, and for a
    `TrainState` in host memory for the parts the plan offloads
    (`Plan(offload=...)`). For checkpoint restore, which reads each array
    straight into it."""
    if isinstance(tree, TrainState):
        return StepLayout.of(resolved, tree.model, tree.opt_state).state_shardings(tree)
    return shardings_of_specs(partition_specs(tree, resolved.plan), resolved.mesh)
