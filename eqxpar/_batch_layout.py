"""How a plan splits a batch, decided once: which mesh axes hold its rows, into
how many blocks, the sharding a batch leaf gets, and what cuts it into
micro-batches.

This is the one home of the batch spec and the data-parallel size: `Plan`'s
`batch_spec` and `batch_size_multiple` are this layout's (`Plan.batch_layout`),
and the step, gradients, evaluation, `shard_batch`, the multi-process data helpers
and the advisor ask it instead of reading the plan's options. It imports no plan
(the plan builds it), so that the plan's conveniences can delegate to it.
"""

import dataclasses
import math
from typing import Any

from jax.sharding import Mesh, NamedSharding, PartitionSpec


@dataclasses.dataclass(frozen=True)
class BatchLayout:
    """A plan's batch split, resolved (built by `Plan.batch_layout`).

    - `mesh`: the plan's mesh.
    - `axes`: the mesh axes a batch's leading dimension is split over (data, fsdp,
      expert, ...), outermost first.
    - `pipelined`: a pipeline schedule cuts each batch into `microbatches`.
    - `microbatches`: the pipeline's micro-batch count (1 without a schedule).

    ```python
    layout = plan.batch_layout
    layout.spec, layout.blocks   # PartitionSpec(("data",)), 8 under data=8
    ```
    """

    mesh: Mesh
    axes: tuple[str, ...]
    pipelined: bool
    microbatches: int

    @classmethod
    def of(cls, plan: Any) -> "BatchLayout":
        """The batch layout of an `eqxpar.Plan` (`plan.batch_layout`; `Any`: this
        module cannot import the plan, which imports it)."""
        return plan.batch_layout

    @property
    def blocks(self) -> int:
        """How many equal blocks of rows the batch is split into: the data-parallel size."""
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def spec(self) -> PartitionSpec:
        """The PartitionSpec of a batch leaf: its leading dimension over `axes`."""
        return PartitionSpec(self.axes)

    @property
    def sharding(self) -> NamedSharding:
        """A batch leaf's sharding on the plan's mesh."""
        return NamedSharding(self.mesh, self.spec)

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
