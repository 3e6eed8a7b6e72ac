"""The step layout: where every array of a training step lives, resolved once.

A plan says what the user wants (a mesh, rules, a mode, flags); a `StepLayout`
says what a step built for it does: the specs of the parameters, the gradients,
the optimizer state and the batch, the mesh axes it runs by hand (inside
`shard_map`), the batch axes whose gradients it reduces by hand. `train.init`,
the step, its gradient implementations, the update, checkpoint restore and
`eqxpar.inspect` all read one; none decides these from the plan's flags again.
"""

import dataclasses
import math
import os
import warnings
from collections.abc import Collection
from typing import Any, Literal

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.tree_util import keystr
from jaxtyping import PyTree

from ._batch_layout import BatchLayout
from ._errors import BatchError, PlanError
from ._mesh import CONTEXT_AXIS, EXPERT_AXIS
from ._plan import Plan
from ._rules import mesh_axis_names
from ._shard_map import region_manual_axes
from ._sharding import shardings_of
from ._specs import leaves_with_layout, partition_specs
from ._trainable import split_trainable

Kind = Literal["automatic", "manual", "pipeline"]


def manual_axes_of(plan: Plan, accumulate: int = 1) -> frozenset[str]:
    """The mesh axes a step built for `plan` runs by hand (inside `shard_map`).

    Every axis for a pipeline; the plan's manual axes for a manual plan; the batch
    axes for an automatic ZeRO-1 plan (to reduce-scatter the gradients); none for
    other automatic plans; and, when the step accumulates gradients
    (`accumulate > 1`), the batch axes too, so that each device sums its
    micro-batches' gradients before the one reduction of the step (left to the
    compiler, the reduction would run once per micro-batch). Size-1 axes of a
    partial-manual region are left out, as `shard_map` regions leave them.
    A `context` axis larger than 1 is manual in every mode: attention passes keys
    and values between its devices by hand; so is an `expert` axis larger than 1,
    with every batch axis: mixture-of-experts layers send tokens between its
    devices by hand, and their data-dependent shuffles of tokens must see only
    this device's (a batch axis left automatic would be gathered for them). Beside
    a `context` axis larger than 1 and an automatic tensor axis larger than 1, the
    batch axes are manual too (the compiler cannot partition that region).
    """
    if plan.schedule is not None:
        return frozenset(plan.mesh.axis_names)
    axes: tuple[str, ...] = ()
    if plan.mode == "manual":
        axes = plan.manual_axes or tuple(plan.mesh.axis_names)
    if (plan.zero1 and plan.mode != "manual") or accumulate > 1:
        axes += tuple(a for a in plan.batch_axes if a not in axes)
    if plan.context_size > 1 and CONTEXT_AXIS not in axes:
        axes += (CONTEXT_AXIS,)
    # XLA's partitioner aborts the process (a failed check on its device groups)
    # on a region manual over `context` beside an automatic tensor axis and an
    # automatic batch axis; manual over the batch axes too, the region compiles.
    tensor_auto = plan.mesh.shape.get(plan.tensor_axis, 1) > 1 and plan.tensor_axis not in axes
    if plan.expert_size > 1 or (plan.context_size > 1 and tensor_auto):
        axes += tuple(a for a in plan.batch_axes if a not in axes)
    return region_manual_axes(plan.mesh, axes) if axes else frozenset()


def check_expert_specs(model: PyTree, specs: PyTree) -> None:
    """Raise unless every dimension split over the `expert` axis is an `experts`
    dimension (the stacked experts of an `eqxpar.nn.MoE`).

    A weight split over `expert` is never gathered (each device keeps its own
    experts), so a split of any other dimension would leave a layer computing on
    a fragment of its weight.
    """
    leaves, treedef = jax.tree.flatten(model)
    spec_leaves = treedef.flatten_up_to(specs)
    for (path, _, axes, _), spec in zip(leaves_with_layout(model), spec_leaves, strict=True):
        if not isinstance(spec, PartitionSpec):
            continue
        for dim, entry in enumerate(spec):
            names = mesh_axis_names(entry)
            if EXPERT_AXIS not in names:
                continue
            logical = None if axes is None else axes[dim]
            if logical != "experts" or names != (EXPERT_AXIS,):
                raise PlanError(
                    f"the plan's rules give the weight {keystr(path)} the spec {spec}, splitting its "
                    f"dimension {dim} (logical axis {logical!r}) over {names}; the {EXPERT_AXIS!r} axis "
                    "splits the stacked experts of eqxpar.nn.MoE layers only (logical axis 'experts', "
                    "on its own), which each device keeps and never gathers. Map only 'experts' to "
                    f"{EXPERT_AXIS!r} (rules.EXPERT), and shard other weights over 'fsdp'."
                )


@dataclasses.dataclass(frozen=True, eq=False)
class StepLayout:
    """Where a training step's arrays live and which collectives it runs by hand.

    Build one with `StepLayout.resolve(plan, model, opt_state)` (arrays or
    `jax.eval_shape` outlines) or `StepLayout.of_state(state, plan)`.

    **Fields:**

    - `plan`, `accumulate`: what it was resolved for.
    - `manual_axes`: the mesh axes the step runs inside `shard_map`.
    - `params`: a PartitionSpec per array leaf of the model (None elsewhere).
    - `updates`: the specs the gradients and optimizer updates come out in: the
      parameters', or under ZeRO-1 the optimizer state's split over the batch axes.
    - `opt_state`: a PartitionSpec per array leaf of the optimizer state, or None
      when resolved without one.
    - `trainable`: a bool per leaf of the model, True where a floating-point array
      trains (`make_step(..., trainable=...)`), or None: every one does.

    ```python
    layout = eqxpar.internal.StepLayout.of_state(state, plan)
    layout.kind, layout.reduced_axes, layout.state_specs(state).opt_state
    ```
    """

    plan: Plan
    accumulate: int
    manual_axes: frozenset[str]
    params: PyTree
    updates: PyTree
    opt_state: PyTree | None
    trainable: PyTree | None = None

    @classmethod
    def resolve(
        cls,
        plan: Plan,
        model: PyTree,
        opt_state: PyTree | None = None,
        *,
        accumulate: int = 1,
        trainable: PyTree | None = None,
    ) -> "StepLayout":
        """Resolve the layout of a step over `model` (and `opt_state`) under `plan`;
        `trainable` is the step's resolved filter (`_trainable.trainable_mask`)."""
        if not isinstance(plan, Plan):
            raise PlanError(f"StepLayout.resolve(plan={plan!r}): expected an eqxpar.Plan.")
        rules, mesh = plan.optimizer_rules, plan.mesh
        params = partition_specs(model, plan.rules, mesh=mesh)
        if plan.expert_size > 1:
            check_expert_specs(model, params)
        updates = params if rules == plan.rules else partition_specs(model, rules, mesh=mesh)
        opt = None if opt_state is None else partition_specs(opt_state, rules, mesh=mesh)
        return cls(plan, accumulate, manual_axes_of(plan, accumulate), params, updates, opt, trainable)

    @classmethod
    def of_state(
        cls, state: Any, plan: Plan, *, accumulate: int = 1, trainable: PyTree | None = None
    ) -> "StepLayout":
        """The layout of a `TrainState` (or its outline) under `plan`."""
        return cls.resolve(plan, state.model, state.opt_state, accumulate=accumulate, trainable=trainable)

    def differentiated(self, model: PyTree) -> tuple[PyTree, PyTree]:
        """`(params, rest)` of `model` (the global model, or one device's inside a
        manual region: the same structure): the arrays the step differentiates and
        updates, None elsewhere, and everything else (frozen weights included)."""
        return split_trainable(model, self.trainable)

    @property
    def kind(self) -> Kind:
        """Which gradient implementation runs: compiler-placed collectives
        (`"automatic"`), a `shard_map` region (`"manual"`), or the pipeline engine."""
        if self.plan.schedule is not None:
            return "pipeline"
        return "manual" if self.manual_axes else "automatic"

    @property
    def batch(self) -> PartitionSpec:
        """The spec of a batch leaf: leading dimension over the plan's batch axes."""
        return BatchLayout.of(self.plan).spec

    @property
    def tensor_axis(self) -> str:
        """The mesh axis tensor-parallel layers split their weights over."""
        return tensor_axis_of(self.plan)

    @property
    def mode(self) -> str | None:
        """The plan's mode as the user gave it (`"auto"`, `"manual"`, or None under a pipeline), for messages."""
        return self.plan.mode

    @property
    def reduce_dtype(self) -> Any:
        """The dtype gradients are reduced in (`Plan(reduce_dtype=)`), or None for theirs."""
        return self.plan.reduce_dtype

    @property
    def weight_axes(self) -> frozenset[str]:
        """The manual axes a weight may be split over in a manual region: the tensor
        axis (eqxpar.nn layers take its shards) and the batch axes (FSDP: the step
        gathers them)."""
        return frozenset({self.plan.tensor_axis, *self.plan.batch_axes})

    @property
    def sequence_split(self) -> bool:
        """Whether each device of the tensor axis holds its own sequence block in the
        manual region (sequence parallelism over a manual tensor axis of size > 1)."""
        tensor = self.plan.tensor_axis
        return (
            self.plan.sequence_parallel
            and tensor in self.manual_axes
            and self.plan.mesh.shape.get(tensor, 1) > 1
        )

    @property
    def reduced_axes(self) -> tuple[str, ...]:
        """The axes whose devices each compute a share of the loss that the step
        averages, and whose gradients it so reduces itself: the batch axes it splits
        the batch over by hand (batch axes left automatic are the compiler's), then
        `context` when it splits the sequence (each device's loss is the mean over
        its own part of the sequence)."""
        axes = tuple(a for a in self.plan.batch_axes if a in self.manual_axes)
        return axes + self.context_axes

    @property
    def context_axes(self) -> tuple[str, ...]:
        """`("context",)` when the step splits the sequence over it (size > 1), else `()`."""
        return (CONTEXT_AXIS,) if self.plan.context_size > 1 else ()

    @property
    def data_parallel_size(self) -> int:
        """Devices the loss is averaged over by hand: those of `reduced_axes` (the
        divisor of the gradient reduction)."""
        return math.prod(self.plan.mesh.shape[a] for a in self.reduced_axes)

    def loss_divisor(self, varying: Collection[str]) -> int:
        """The divisor of the gradient reduction for a per-device loss that differs
        between devices along the manual axes `varying`: the sizes of the reduced
        axes along which it does. Marked varying, the weights get the gradient of the
        sum of those devices' losses, which the step averages; along a reduced axis
        where the loss is one value on every device (averaged inside the loss), they
        get its gradient already."""
        return math.prod(self.plan.mesh.shape[a] for a in self.reduced_axes if a in varying)

    @property
    def partial(self) -> bool:
        """Whether the step's region is manual over some mesh axes only."""
        return bool(self.manual_axes) and self.manual_axes != frozenset(self.plan.mesh.axis_names)

    @property
    def sliced_update(self) -> bool:
        """Whether each device updates a slice of the parameters (ZeRO-1): the
        updates' specs differ from the parameters'."""
        return self.updates is not self.params

    def state_specs(self, state: Any) -> Any:
        """`state` (a `TrainState` or its outline) with a PartitionSpec at every
        array leaf: the model's and optimizer's from this layout, the step, key
        and skipped-step count replicated."""
        if self.opt_state is None:
            raise PlanError(
                "this StepLayout was resolved without an optimizer state; build it with "
                "StepLayout.of_state(state, plan)."
            )
        return eqx.tree_at(
            lambda s: (s.model, s.opt_state, s.step, s.key, s.skipped_steps),
            state,
            (self.params, self.opt_state, PartitionSpec(), PartitionSpec(), PartitionSpec()),
            is_leaf=lambda x: x is None,
        )

    def shardings(self, specs: PyTree) -> PyTree:
        """`specs` (PartitionSpecs, None elsewhere) as NamedShardings on the plan's mesh."""
        return shardings_of(specs, self.plan)


# --- What a step may do with a plan: checks and counts read from its options -----------


#: The XLA flag that makes XLA:CPU run each device's collectives in program order.
CPU_COLLECTIVE_ORDER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def warn_cpu_collective_order(plan: Plan, accumulate: int) -> None:
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
    manual = sorted(manual_axes_of(plan, accumulate), key=plan.mesh.axis_names.index)
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


def check_cpu_partial_manual_dtypes(plan: Plan, accumulate: int, where: str) -> None:
    """Refuse the bfloat16 all-reduces eqxpar cannot widen in a partial-manual
    region on XLA:CPU.

    In a region manual over some axes only, JAX lowers an all-reduce's reduction
    with a sharding annotation (a `copy` in HLO); XLA:CPU widens bfloat16
    all-reduces to float32 and, cloning that reduction, aborts the process
    ("Invalid binary instruction opcode copy"). float16 is not widened and
    compiles. The step's own gradient reductions and FSDP gathers there run in
    float32 instead (`_collectives.wire_dtype`); what remains are the
    tensor-parallel layers' all-reduces under `compute_dtype=bfloat16`.
    """
    if plan.mesh.devices.flat[0].platform != "cpu":
        return
    manual = manual_axes_of(plan, accumulate)
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


def loss_compute_dtype(plan: Plan) -> Any:
    """The dtype a step, gradient or evaluation of `plan` computes its loss in: the
    model's and batch's floating-point arrays are cast to it (`Plan(compute_dtype=)`),
    or None to keep theirs."""
    return plan.compute_dtype


def tensor_axis_of(plan: Plan) -> str:
    """The mesh axis tensor-parallel layers split their weights over (`Plan(tensor_axis=)`)."""
    return plan.tensor_axis


def param_dtype_of(plan: Plan) -> Any:
    """The dtype `train.init` stores a model's floating-point weights in
    (`Plan(param_dtype=)`), or None to keep theirs."""
    return plan.param_dtype


def activation_axes(plan: Plan) -> frozenset[str]:
    """The mesh axes the plan splits activations over, whatever the model's
    weights: the batch axes, the axes of its annotations, the tensor axis under
    sequence parallelism, and the context axis."""
    used = set(BatchLayout.of(plan).axes)
    for spec in plan.annotation_specs.values():
        used.update(a for entry in spec for a in mesh_axis_names(entry))
    if plan.sequence_parallel:
        used.add(plan.tensor_axis)  # the activations' sequence is split over it
    used.add(CONTEXT_AXIS)  # it always splits the sequence
    return frozenset(used)


def runs_pipeline(plan: Plan) -> bool:
    """Whether a step for `plan` runs the pipeline engine (a schedule is set)."""
    return BatchLayout.of(plan).pipelined


def rows_per_call(plan: Plan) -> int:
    """The batch sizes a step or evaluation of `plan` runs whole are multiples of
    this: the data-parallel devices times a pipeline's micro-batches."""
    return BatchLayout.of(plan).rows_per_call


def microbatch_count(plan: Plan, accumulate: int) -> int:
    # The equal parts a batch is split into: a pipeline's micro-batches, or the
    # accumulated ones.
    return BatchLayout.of(plan).parts(accumulate)


def check_reduce_dtype(plan: Plan, accumulate: int, where: str) -> None:
    # The option sets the dtype of the reductions eqxpar issues itself; where the
    # compiler reduces every gradient (automatic and partial-manual plans that
    # leave the batch axes automatic) it would be silently ignored.
    if plan.reduce_dtype is None or plan.schedule is not None:
        return
    manual = manual_axes_of(plan, accumulate)
    if any(a in manual for a in plan.batch_axes):
        return
    raise PlanError(
        f"{where}: Plan(reduce_dtype={plan.reduce_dtype}) sets the dtype of the gradient reductions eqxpar "
        f"issues itself, but this step reduces none by hand: its batch axes {plan.batch_axes} are left to "
        "the compiler (mode='auto', or manual_axes without them), which reduces in the dtype it has there. "
        "Drop reduce_dtype, or use mode='manual' with the batch axes manual."
    )


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Where `eqxpar.models.generate`'s arrays live under a plan, resolved once
    (the decoding counterpart of `StepLayout`).

    Build one with `DecodeLayout.resolve(plan, batch)`, which refuses the plans
    decoding cannot serve (pipelines, context and expert parallelism, a batch the
    batch axes do not divide) with an error naming one that can.

    **Fields:**

    - `plan`: the plan decoding runs under: the given one with sequence
      parallelism and ring overlap off (one token has no sequence to split; the
      weights' layout is the same).
    - `manual`: whether each step runs inside `shard_map` (`mode="manual"`).
    - `manual_axes`: the axes of that `shard_map` (None: all of them).
    - `batch_axes`: the axes the batch, and the cache's batch, are split over.

    ```python
    layout = eqxpar.internal.DecodeLayout.resolve(plan, batch=8)
    layout.cache_spec("tensor")    # the cache's spec, heads over "tensor"
    ```
    """

    plan: Plan
    manual: bool
    manual_axes: tuple[str, ...] | None
    batch_axes: tuple[str, ...]

    @classmethod
    def resolve(cls, plan: Plan, batch: int) -> "DecodeLayout":
        """The layout of decoding `batch` rows under `plan`."""
        if not isinstance(plan, Plan):
            raise PlanError(f"generate(plan={plan!r}): expected an eqxpar.Plan or None.")
        serves = "eqxpar.Plan(eqxpar.make_mesh(data=..., tensor=...), rules=eqxpar.rules.MEGATRON)"
        if plan.schedule is not None:
            raise PlanError(
                f"generate under a pipeline plan (schedule={plan.schedule!r}): decoding one token at a "
                f"time through pipeline stages leaves all but one stage idle. Generate under a plan "
                f"without pipe, e.g. {serves}, or on one device with eqxpar.nn.in_natural_order(model)."
            )
        if plan.context_size > 1:
            raise PlanError(
                f"generate under context parallelism (mesh axis {CONTEXT_AXIS!r} of size "
                f"{plan.context_size}): the cache is not split along the sequence. Generate under a "
                f"plan whose mesh has no context axis, e.g. {serves} (long contexts: the cache's "
                "heads split over tensor)."
            )
        if plan.expert_size > 1:
            raise PlanError(
                f"generate under expert parallelism (mesh axis {EXPERT_AXIS!r} of size "
                f"{plan.expert_size}): not supported. Generate under a plan without an expert axis "
                f"(data and tensor), e.g. {serves}."
            )
        if batch % plan.batch_size_multiple:
            raise BatchError(
                f"generate: a batch of {batch} prompts under a plan whose batch axes {plan.batch_axes} "
                f"split it over {plan.batch_size_multiple} devices. Pass a multiple of "
                f"{plan.batch_size_multiple} prompts (pad with copies)."
            )
        decode = dataclasses.replace(plan, sequence_parallel=False, tp_overlap=False)
        return cls(decode, plan.mode == "manual", plan.manual_axes, plan.batch_axes)

    def cache_spec(self, heads: Any) -> PartitionSpec:
        """The spec of a key or value cache `(layers, blocks per layer, batch, slots,
        kv_heads, head_dim)`: batch over the batch axes, heads as `heads` (the spec
        entry of the attention's key heads under the plan's rules)."""
        return PartitionSpec(None, None, self.batch_axes or None, None, heads, None)

    def check_weights(self, specs: PyTree) -> None:
        """Refuse, in manual mode, weights split over a manual batch axis (FSDP):
        a decode step would need every layer gathered by hand."""
        if not self.manual:
            return
        mesh = self.plan.mesh
        manual = region_manual_axes(mesh, mesh.axis_names if self.manual_axes is None else self.manual_axes)
        split = {a for a in self.batch_axes if a in manual and mesh.shape[a] > 1}
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        named = {
            a for spec in jax.tree.leaves(specs, is_leaf=is_spec) for e in spec for a in mesh_axis_names(e)
        }
        if named & split:
            raise PlanError(
                f"generate under a manual plan whose rules split weights over the batch axes "
                f"{sorted(named & split)} (FSDP): a decode step would need every layer gathered by "
                "hand. Generate under the same plan in automatic mode: dataclasses.replace(plan, "
                "mode='auto')."
            )
