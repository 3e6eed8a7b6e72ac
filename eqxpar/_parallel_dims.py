"""Every parallel fact of a plan that does not depend on the model, resolved once.

Inspection, the advisor and the layers (which read the plan in effect, with no
model at hand) ask `ParallelDims` instead of the plan's options; the step's layout
(`eqxpar._train._step_layout`) adds what depends on the model. This module imports only
the plan and the batch layout, so that `eqxpar.nn` can import it.
"""

import dataclasses
from typing import Any

from ._batch_layout import BatchLayout
from ._plan import Plan


@dataclasses.dataclass(frozen=True)
class ParallelDims:
    """Every parallel fact of a plan that does not depend on the model, resolved
    once (as torchtitan's `ParallelDims`): mesh sizes along each strategy, the
    batch split, the pipeline's sizes, the options as given. Inspection and the
    advisor read this instead of the plan's options; a step reads it through its
    `ResolvedPlan`. `batch` is the plan's `BatchLayout` (the batch axes and the
    data-parallel size live there only).

    `split_saved_inputs`: a scanned stack (`eqxpar.nn.Stacked`) keeps the layer
    inputs it saves for the backward pass split over the tensor axis along their
    last (feature) dimension: under remat `"inputs"` or `"full"` in automatic
    mode, where the rules split weights over a tensor axis of more than one
    device that the batch is not split over, with no sequence parallelism, no
    context axis and no pipeline.

    Fields of the same name as `Plan`'s hold the plan's option as given (`schedule`
    and `context_attention` may be None); `context_attention_run` is the attention a
    step runs: the plan's `context_attention`, by default `"ring"`, or `"allgather"`
    in a pipeline.
    """

    mode: str | None
    manual_axes: tuple[str, ...] | None
    schedule: Any
    microbatches: int
    chunks: int
    placement: str | None
    remat: Any  # str | RematPolicy
    offload: tuple[str, ...]
    sequence_parallel: bool
    tp_overlap: bool
    stage_gradients: str
    zero1: bool
    compute_dtype: Any
    reduce_dtype: Any
    param_dtype: Any
    tensor_axis: str
    tensor_size: int
    batch: BatchLayout
    context_size: int
    context_attention: str | None
    context_attention_run: str
    expert_size: int
    split_saved_inputs: bool

    @classmethod
    def of(cls, plan: Plan) -> "ParallelDims":
        # By default ring, or allgather in a pipeline (whose stages run one
        # micro-batch at a time).
        attention = plan.context_attention or ("allgather" if plan.schedule is not None else "ring")
        return cls(
            mode=plan.mode,
            manual_axes=plan.manual_axes,
            schedule=plan.schedule,
            microbatches=plan.microbatches,
            chunks=plan.chunks,
            placement=plan.placement,
            remat=plan.remat,
            offload=plan.offload,
            sequence_parallel=plan.sequence_parallel,
            tp_overlap=plan.tp_overlap,
            stage_gradients=plan.stage_gradients,
            zero1=plan.zero1,
            compute_dtype=plan.compute_dtype,
            reduce_dtype=plan.reduce_dtype,
            param_dtype=plan.param_dtype,
            tensor_axis=plan.tensor_axis,
            tensor_size=int(plan.mesh.shape.get(plan.tensor_axis, 1)),
            batch=plan.batch_layout,
            context_size=plan.context_size,
            context_attention=plan.context_attention,
            context_attention_run=attention,
            expert_size=plan.expert_size,
            # Between blocks a tensor-parallel model's activations are whole on
            # every device of the tensor axis; a stack that saves each layer's
            # input for the backward pass would hold `tensor` copies of it.
            # Sequence parallelism already splits it (along the sequence); a
            # context axis splits the sequence too, and a pipeline runs manual
            # over every axis. Only where the stack saves nothing but its layers'
            # inputs (remat "inputs" or "full"): elsewhere the saved matmul
            # outputs dominate.
            split_saved_inputs=(
                plan.remat in ("inputs", "full")
                and plan.mode == "auto"
                and plan.schedule is None
                and int(plan.mesh.shape.get(plan.tensor_axis, 1)) > 1
                and not plan.sequence_parallel
                and plan.context_size == 1
                and plan.tensor_axis not in plan.batch_axes
                and plan.tensor_axis in _declared_axes(plan.rules)
            ),
        )

    @property
    def batch_axes(self) -> tuple[str, ...]:
        """The mesh axes a batch is split over (`batch.axes`)."""
        return self.batch.axes

    @property
    def batch_size_multiple(self) -> int:
        """The data-parallel size (`batch.blocks`)."""
        return self.batch.blocks

    @property
    def pipelined(self) -> bool:
        """A pipeline schedule runs the step."""
        return self.schedule is not None

    def streams_stacked_params_on(self, platform: str) -> bool:
        """Whether a step on devices of `platform` leaves an offloaded model's
        stacked weights in host memory through the passes, the stack's scan
        bringing one layer's slice at a time onto the device: under
        `Plan(offload=("params",))`, off XLA:CPU (one memory there, nothing to
        gain, and the transfers in the loop changed its float32 rounding) and
        outside pipelines (whose stages run the stack themselves)."""
        return "params" in self.offload and not self.pipelined and platform != "cpu"

    @property
    def token_shards(self) -> int:
        """The devices a batch's tokens are split over: the batch axes' times the
        context axis' (each holds a part of the sequence)."""
        return self.batch_size_multiple * self.context_size


def _declared_axes(rules: tuple) -> set[str]:
    """The mesh axes `rules` may split weights over."""
    declared: set[str] = set()
    for rule in rules:
        found = getattr(rule, "mesh_axes", None)
        declared |= set(found() if found else ())
    return declared
