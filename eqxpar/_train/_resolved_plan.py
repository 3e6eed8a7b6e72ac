"""The plan a step is built for, resolved once: every answer that does not
depend on the model, and the refusals, decided when a builder starts.

A `Plan` is what the user asked for. A builder (`make_step`, `make_value_and_grad`,
`make_eval_step`, `train.init`, ...) turns it into a `ResolvedPlan` once and passes
that down: no function below a builder takes the plan, and none decides again from
its options. The state's outline then adds the specs (`StepLayout`, built from
this object). After torchtitan, whose trainer builds `ParallelDims` once and passes
it down.
"""

import dataclasses
import os
import warnings
from typing import Any, Literal

import jax.numpy as jnp
from jax.sharding import Mesh

from .._batch_layout import BatchLayout
from .._errors import OffloadWarning, PlanError
from .._mesh import CONTEXT_AXIS, mesh_platform
from .._parallel_dims import ParallelDims
from .._plan import Plan
from .._rules import mesh_axis_names
from .._shard_map import region_manual_axes
from .._stack_order import StackOrder

Kind = Literal["automatic", "manual", "pipeline"]


def _manual_axes(dims: ParallelDims, mesh: Mesh, accumulate: int) -> frozenset[str]:
    """The mesh axes a step built for a plan (its `dims`, on `mesh`) runs by hand
    (inside `shard_map`).

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
    if dims.pipelined:
        return frozenset(mesh.axis_names)
    axes: tuple[str, ...] = ()
    if dims.mode == "manual":
        axes = dims.manual_axes or tuple(mesh.axis_names)
    if (dims.zero1 and dims.mode != "manual") or accumulate > 1:
        axes += tuple(a for a in dims.batch_axes if a not in axes)
    if dims.context_size > 1 and CONTEXT_AXIS not in axes:
        axes += (CONTEXT_AXIS,)
    # XLA's partitioner aborts the process (a failed check on its device groups)
    # on a region manual over `context` beside an automatic tensor axis and an
    # automatic batch axis; manual over the batch axes too, the region compiles.
    tensor_auto = dims.tensor_size > 1 and dims.tensor_axis not in axes
    if dims.expert_size > 1 or (dims.context_size > 1 and tensor_auto):
        axes += tuple(a for a in dims.batch_axes if a not in axes)
    return region_manual_axes(mesh, axes) if axes else frozenset()


@dataclasses.dataclass(frozen=True, eq=False)
class ResolvedPlan:
    """A plan resolved for a step: what every function below a builder reads.

    Build one with `ResolvedPlan.of(plan, accumulate=...)`; with
    `training="make_step"` (the builder, for messages) it also refuses what a
    training step cannot run (`check_reduce_dtype`,
    `check_cpu_partial_manual_dtypes`).

    **Fields:**

    - `plan`: the plan itself, for its mesh and rules, and for the `with plan:`
      context the layers read while a step traces (its options are read here only).
    - `dims`: the plan's `ParallelDims` (axis sizes, options as given, the batch's
      `BatchLayout`).
    - `accumulate`: the gradient-accumulation micro-batches it was resolved for.
    - `manual_axes`: the mesh axes the step runs inside `shard_map`.
    - `pipeline`: the `eqxpar.pipeline` `PipelinePlan` (schedule table, stage
      sizes), or None without a schedule.

    ```python
    resolved = ResolvedPlan.of(plan)   # in a builder (private: eqxpar._train)
    resolved.kind, resolved.batch.spec, resolved.manual_axes
    ```
    """

    plan: Plan
    dims: ParallelDims
    accumulate: int
    manual_axes: frozenset[str]
    pipeline: Any  # PipelinePlan | None (the pipeline package imports eqxpar.nn)

    @classmethod
    def of(cls, plan: Plan, accumulate: int = 1, *, training: str | None = None) -> "ResolvedPlan":
        """Resolve `plan` for a step that accumulates `accumulate` micro-batches.

        `training`: the builder of a training step (`"make_step"`, for messages),
        which also checks `accumulate` and refuses what a training step cannot run
        (`check_cpu_partial_manual_dtypes`, `check_reduce_dtype`)."""
        if not isinstance(plan, Plan):
            if training is not None:
                raise PlanError(f"{training}(..., plan={plan!r}): expected an eqxpar.Plan.")
            raise PlanError(f"expected an eqxpar.Plan, got {plan!r}.")
        if training is not None and (
            not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1
        ):
            raise PlanError(f"{training}(accumulate={accumulate!r}): expected an integer >= 1.")
        pipeline = None
        if plan.schedule is not None:
            # Imported here: the pipeline package imports eqxpar.nn, which the core does not.
            from ..pipeline._pipeline_plan import PipelinePlan

            pipeline = PipelinePlan.of(plan)
        dims = ParallelDims.of(plan)
        resolved = cls(plan, dims, accumulate, _manual_axes(dims, plan.mesh, accumulate), pipeline)
        if training is not None:
            check_cpu_partial_manual_dtypes(resolved, training)
            check_reduce_dtype(resolved, training)
        return resolved

    @property
    def mesh(self) -> Mesh:
        """The plan's mesh."""
        return self.plan.mesh

    def stack_order(self, depth: int) -> StackOrder | None:
        """The order the plan stores a scanned stack of `depth` layers in (`Plan.stack_order`)."""
        return self.plan.stack_order(depth)

    @property
    def batch(self) -> BatchLayout:
        """How a batch splits (the one home of the batch spec and the data-parallel size)."""
        return self.dims.batch

    @property
    def kind(self) -> Kind:
        """Which gradient implementation runs: compiler-placed collectives
        (`"automatic"`), a `shard_map` region (`"manual"`), or the pipeline engine."""
        if self.dims.pipelined:
            return "pipeline"
        return "manual" if self.manual_axes else "automatic"

    @property
    def microbatches(self) -> int:
        """The equal parts a batch is split into: a pipeline's micro-batches, or the accumulated ones."""
        return self.batch.parts(self.accumulate)

    @property
    def partial(self) -> bool:
        """Whether the step's region is manual over some mesh axes only."""
        return bool(self.manual_axes) and self.manual_axes != frozenset(self.mesh.axis_names)

    @property
    def compute_dtype(self) -> Any:
        """The dtype the loss computes in (`Plan(compute_dtype=)`): the model's and
        batch's floating-point arrays are cast to it; None keeps theirs."""
        return self.dims.compute_dtype

    @property
    def param_dtype(self) -> Any:
        """The dtype `train.init` stores floating-point weights in (`Plan(param_dtype=)`), or None."""
        return self.dims.param_dtype

    @property
    def reduce_dtype(self) -> Any:
        """The dtype gradients are reduced in (`Plan(reduce_dtype=)`), or None for theirs."""
        return self.dims.reduce_dtype

    @property
    def tensor_axis(self) -> str:
        """The mesh axis tensor-parallel layers split their weights over."""
        return self.dims.tensor_axis

    @property
    def activation_axes(self) -> frozenset[str]:
        """The mesh axes the plan splits activations over, whatever the model's
        weights: the batch axes, the axes of its annotations, the tensor axis under
        sequence parallelism, and the context axis."""
        used = set(self.batch.axes)
        for spec in self.plan.annotation_specs.values():
            used.update(a for entry in spec for a in mesh_axis_names(entry))
        if self.dims.sequence_parallel:
            used.add(self.dims.tensor_axis)  # the activations' sequence is split over it
        used.add(CONTEXT_AXIS)  # it always splits the sequence
        return frozenset(used)


# --- What a training step refuses, or warns about, once resolved ---------------------


#: The XLA flag that makes XLA:CPU run each device's collectives in program order.
CPU_COLLECTIVE_ORDER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _on_cpu(mesh: Mesh) -> bool:
    return mesh_platform(mesh) == "cpu"


def warn_cpu_collective_order(resolved: ResolvedPlan) -> None:
    """Warn when the step runs manual collectives over two or more axes on XLA:CPU
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
    mesh = resolved.mesh
    if not _on_cpu(mesh):
        return
    manual = sorted(resolved.manual_axes, key=mesh.axis_names.index)
    if sum(mesh.shape[a] > 1 for a in manual) < 2:
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


def warn_cpu_offload(resolved: ResolvedPlan) -> None:
    """Warn (`OffloadWarning`) when the plan offloads activations on XLA:CPU,
    which lowers a remat policy's offloaded values to plain saves: they stay in
    device memory (the step's result is the same), so the offload does nothing."""
    if "activations" not in resolved.dims.offload or not _on_cpu(resolved.mesh):
        return
    warnings.warn(
        f"Plan(offload=('activations', ...)) on XLA:CPU (platform {mesh_platform(resolved.mesh)!r}): "
        "this backend ignores activation offload and keeps the activations the remat policy names as "
        f"offloaded ({resolved.dims.remat.offloaded}) in device memory, as saved ones. The step computes "
        "the same; the memory it saves shows on TPU and GPU only (compile for a TPU topology to measure "
        "it: eqxpar.aot). To silence: warnings.filterwarnings('ignore', category=eqxpar.OffloadWarning).",
        OffloadWarning,
        stacklevel=3,
    )


def _is_bfloat16(dtype: Any) -> bool:
    return dtype is not None and jnp.dtype(dtype) == jnp.bfloat16


def check_cpu_partial_manual_dtypes(resolved: ResolvedPlan, where: str) -> None:
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
    mesh, manual = resolved.mesh, resolved.manual_axes
    if not _on_cpu(mesh) or not resolved.partial:
        return
    # The layers compute in the compute dtype, else in the parameters'.
    dtype = resolved.compute_dtype or resolved.param_dtype
    if not (_is_bfloat16(dtype) and resolved.tensor_axis in manual):
        return
    left = sorted(set(mesh.axis_names) - manual, key=mesh.axis_names.index)
    raise PlanError(
        f"{where}: this plan runs a partial-manual region (manual over "
        f"{sorted(manual, key=mesh.axis_names.index)}, automatic over {left}) with "
        "bfloat16 compute (compute_dtype, or param_dtype without one), so the tensor-parallel "
        "layers issue bfloat16 all-reduces there, "
        "which XLA:CPU aborts the process compiling. On CPU, drop Plan(manual_axes=...) so every "
        "axis is manual, use mode='auto', or compute in float32 or float16 (XLA:CPU moves bfloat16 "
        "collectives as float32 anyway)."
    )


def check_reduce_dtype(resolved: ResolvedPlan, where: str) -> None:
    # The option sets the dtype of the reductions eqxpar issues itself; where the
    # compiler reduces every gradient (automatic and partial-manual plans that
    # leave the batch axes automatic) it would be silently ignored.
    if resolved.reduce_dtype is None or resolved.dims.pipelined:
        return
    axes = resolved.batch.axes
    if any(a in resolved.manual_axes for a in axes):
        return
    raise PlanError(
        f"{where}: Plan(reduce_dtype={resolved.reduce_dtype}) sets the dtype of the gradient reductions "
        f"eqxpar issues itself, but this step reduces none by hand: its batch axes {axes} are left to "
        "the compiler (mode='auto', or manual_axes without them), which reduces in the dtype it has there. "
        "Drop reduce_dtype, or use mode='manual' with the batch axes manual."
    )
