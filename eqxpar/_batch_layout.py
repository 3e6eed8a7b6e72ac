"""How a plan splits a batch, decided once: which mesh axes hold its rows, into
how many blocks, the sharding a batch leaf gets, and what cuts it into
micro-batches.

The step, gradients, evaluation, `shard_batch`, the multi-process data helpers and
the advisor all ask this one object instead of reading the plan's options (the
plan owns the options; its layouts own what follows from them, see
`eqxpar._step_layout`).
"""

import dataclasses
import math

from jax.sharding import NamedSharding, PartitionSpec

from ._plan import Plan


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """A plan's batch split, resolved.

    - `axes`: the mesh axes a batch's leading dimension is split over (data, fsdp,
      expert, ...), outermost first.
    - `blocks`: how many equal blocks of rows that makes (the data-parallel size).
    - `pipelined`: a pipeline schedule cuts each batch into `microbatches`.
    - `microbatches`: the pipeline's micro-batch count (1 without a schedule).
    """

    plan: Plan
    axes: tuple[str, ...]
    blocks: int
    pipelined: bool
    microbatches: int

    @classmethod
    def of(cls, plan: Plan) -> "BatchLayout":
        axes = tuple(plan.batch_axes)
        pipelined = plan.schedule is not None
        return cls(
            plan=plan,
            axes=axes,
            blocks=math.prod(plan.mesh.shape[a] for a in axes),
            pipelined=pipelined,
            microbatches=plan.microbatches if pipelined else 1,
        )

    @property
    def spec(self) -> PartitionSpec:
        """The PartitionSpec of a batch leaf: its leading dimension over `axes`."""
        return PartitionSpec(self.axes)

    @property
    def sharding(self) -> NamedSharding:
        """A batch leaf's sharding on the plan's mesh."""
        return NamedSharding(self.plan.mesh, self.spec)

    @property
    def rows_per_call(self) -> int:
        """A batch a step or evaluation runs whole has a multiple of this many rows:
        the data-parallel blocks times a pipeline's micro-batches."""
        return self.blocks * self.microbatches

    def parts(self, accumulate: int) -> int:
        """The equal parts a batch is cut into: a pipeline's micro-batches, or the
        `accumulate` micro-batches of gradient accumulation."""
        return self.microbatches if self.pipelined else accumulate

    def split_by(self, microbatches: int) -> str:
        """What cut the batch into `microbatches`, as the user wrote it: a pipeline's
        `Plan(microbatches=m)` or gradient accumulation's `accumulate=k`."""
        return f"Plan(microbatches={microbatches})" if self.pipelined else f"accumulate={microbatches}"
