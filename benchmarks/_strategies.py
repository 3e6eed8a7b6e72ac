"""The registry of benchmarked strategies and their theoretical communication minimum.

A strategy is a builder `(model, optim) -> Setup`: the eqxpar plan and step, the
hand-written `jax.jit` step with the same shardings (or None where none exists), and
the inputs of `min_comm_bytes`. Adding FSDP, TP or a pipeline means adding a builder
to `STRATEGIES` and, for a new kind of parallelism, a case to `min_comm_bytes`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec

import eqxpar

from . import _workload
from ._baseline import JitStep


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything the runner needs to measure one strategy."""

    plan: eqxpar.Plan
    step: eqxpar.train.Step
    baseline: JitStep | None
    # What the minimum is the minimum *of*: a kind `min_comm_bytes` knows.
    min_kind: str


def min_comm_bytes(kind: str, *, param_bytes: int, mesh_shape: dict[str, int]) -> int:
    """Theoretical minimum collective *result* bytes per device per step for `kind`.

    Counted as `eqxpar.inspect.collective_stats` counts (all-reduce: the full tensor),
    so the record's total can be divided by it directly.

    - `"dp"` (every weight replicated, batch split over `data` x `fsdp`): the gradients
      must be summed over the data-parallel devices once per step, and nothing else
      must move: one all-reduce of the whole gradient, whose result is
      `param_bytes` (4 x 3,454,464 = 13,817,856 B for this workload; 24.2 MB on the
      wire with a ring). The 4-byte reduction of the scalar loss is not counted.
      With a single data-parallel device nothing moves: 0.
    """
    if kind == "dp":
        dp = mesh_shape.get("data", 1) * mesh_shape.get("fsdp", 1)
        return param_bytes if dp > 1 else 0
    raise ValueError(f"min_comm_bytes: no formula for strategy kind {kind!r}; known: 'dp'")


#: `builder(model, optim) -> Setup`; the model's arrays must not be donated by it.
Builder = Callable[[Any, optax.GradientTransformation], Setup]


def _dp(mode: str) -> Builder:
    """Data parallelism over every device: weights replicated, batch split over `data`."""

    def build(model: Any, optim: optax.GradientTransformation) -> Setup:
        plan = eqxpar.Plan(eqxpar.make_mesh(data=jax.device_count()), mode=mode)
        step = eqxpar.train.make_step(_workload.loss_fn, optim, plan)
        baseline = JitStep(
            _workload.loss_fn,
            optim,
            model,
            plan.mesh,
            param_specs=PartitionSpec(),
            batch_spec=PartitionSpec("data"),
        )
        return Setup(plan=plan, step=step, baseline=baseline, min_kind="dp")

    return build


#: name -> builder, in the order they are run and reported.
STRATEGIES: dict[str, Builder] = {
    "dp": _dp("auto"),
    "dp_manual": _dp("manual"),
}
