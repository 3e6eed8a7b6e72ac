"""A plan's pipeline options, resolved once for the pipeline package: the
schedule's table, its sizes, what the stages keep and how they may split weights.

The engine, its checks and its program ask this object instead of reading the
plan's options (the plan owns the options; the step's and batch's layouts and this
one own what follows from them).
"""

import dataclasses
from typing import Any

from .._plan import Plan
from ._builtin import schedule
from ._schedule import Schedule

#: The mesh axis a pipeline splits its stages over.
PIPE = "pipe"


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """What a pipeline step of `plan` runs.

    - `name`: the schedule as the plan was given it (a name or a user's table), for
      messages.
    - `stages`: devices along `pipe`; `chunks`: virtual stages per device;
      `microbatches`: micro-batches per step.
    - `table`: the schedule's table for those sizes.
    - `stage_layers`: layers per virtual stage (None: even).
    - `keeps_residuals`: a stage's forward keeps its residuals for the backward
      (every remat policy but `"full"`).
    - `tensor_axis`, `batch_axes`: the other axes a stage may split weights over.
    - `reduce_dtype`: the dtype gradients are reduced in (None: theirs).
    - `ring_tensor_matmuls`: `tp_overlap` over a tensor axis of size > 1 (which a
      stage cannot run).
    - `sharded_gradients`: `Plan(stage_gradients="sharded")`: FSDP weights are
      gathered where used (a layer at a time in the stack) and each action's
      gradients reduce-scattered into sums split like the weights, instead of
      gathered once before the loops and reduce-scattered once after them.
    """

    name: Any
    stages: int
    chunks: int
    microbatches: int
    table: Schedule
    stage_layers: tuple[int, ...] | None
    keeps_residuals: bool
    tensor_axis: str
    batch_axes: tuple[str, ...]
    reduce_dtype: Any
    ring_tensor_matmuls: bool
    sharded_gradients: bool

    @classmethod
    def of(cls, plan: Plan) -> "PipelinePlan":
        stages = int(plan.mesh.shape[PIPE])
        if isinstance(plan.schedule, Schedule):  # a user's table, validated by Plan
            table = plan.schedule
        else:
            table = schedule(plan.schedule, stages=stages, microbatches=plan.microbatches, chunks=plan.chunks)
        return cls(
            name=plan.schedule,
            stages=stages,
            chunks=plan.chunks,
            microbatches=plan.microbatches,
            table=table,
            stage_layers=plan.stage_layers,
            keeps_residuals=plan.remat != "full",
            tensor_axis=plan.tensor_axis,
            batch_axes=plan.batch_layout.axes,
            reduce_dtype=plan.reduce_dtype,
            ring_tensor_matmuls=bool(plan.tp_overlap) and plan.mesh.shape[plan.tensor_axis] > 1,
            sharded_gradients=plan.stage_gradients == "sharded",
        )
