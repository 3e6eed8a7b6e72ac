"""A plan resolved once for counting and predicting its traffic: `PlanFacts`.
Shared with `eqxpar._advise`.

`eqxpar.inspect.minimum_comm` and the advisor's `predict` build one at their entry
point and pass it down, so that no helper below them takes the `Plan` or resolves
it again.
"""

import dataclasses
from typing import Any

from jax.sharding import Mesh

from .._parallel_dims import ParallelDims
from .._plan import Plan
from .._specs import partition_specs


@dataclasses.dataclass(frozen=True)
class PlanFacts:
    """What the traffic counts read off a plan: its `ParallelDims` (`dims`), its
    `mesh`, and its `rules` (the specs of whatever tree a helper traces: the model,
    or the model in natural stack order, whose specs differ from the stored one's)."""

    dims: ParallelDims
    mesh: Mesh
    rules: Any

    @classmethod
    def of(cls, plan: Plan) -> "PlanFacts":
        """`plan` resolved: its `ParallelDims`, mesh and rules."""
        return cls(dims=ParallelDims.of(plan), mesh=plan.mesh, rules=plan.rules)

    def specs(self, tree: Any) -> Any:
        """`eqxpar.partition_specs(tree, plan)`: the plan's rules on its mesh."""
        return partition_specs(tree, self.rules, mesh=self.mesh)
