"""A schedule's step time from per-action times, free-running and lockstep
(`Simulation`): the walk over the table behind `simulate` and behind a
`Schedule`'s bubble fractions (under the unit costs `COSTS`).
"""

import dataclasses
from typing import Any

import numpy as np

from .._errors import PipelineScheduleError
from ._actions import BACKWARD, BACKWARD_INPUT, dependencies, done_key


@dataclasses.dataclass(frozen=True)
class Simulation:
    """A schedule's predicted step time (see `simulate`).

    **Attributes:**

    - `name`, `stages`: the schedule's.
    - `free_s`: step time when every device runs its column's actions in table
      order as soon as their inputs have arrived (independent devices, e.g. one
      program per device).
    - `lockstep_s`: step time in one SPMD program, where every tick lasts as long as
      its costliest action on any device, plus the send time.
    - `work_s`: the sum of all actions' times (over all devices).
    - `bubble_fraction`, `lockstep_bubble_fraction`: the idle share of device time,
      `1 - work_s / (stages * step time)`, free-running and lockstep.

    ```python
    sim = eqxpar.pipeline.simulate(s, {"F": 1.0, "B": 2.0})
    sim.speedup_over(gpipe_sim)          # gpipe_sim.free_s / sim.free_s
    ```
    """

    name: str
    stages: int
    free_s: float
    lockstep_s: float
    work_s: float

    @property
    def bubble_fraction(self) -> float:
        """Idle share of device time, free-running."""
        return 1.0 - self.work_s / (self.stages * self.free_s) if self.free_s else 0.0

    @property
    def lockstep_bubble_fraction(self) -> float:
        """Idle share of device time, lockstep."""
        return 1.0 - self.work_s / (self.stages * self.lockstep_s) if self.lockstep_s else 0.0

    def speedup_over(self, baseline: Any, *, lockstep: bool = False) -> float:
        """How many times faster this step is than `baseline`'s (> 1: faster).

        **Arguments:** `baseline` (another `Simulation`, e.g. GPipe's on the same
        costs); keyword-only `lockstep`: compare lockstep times rather than
        free-running ones.
        """
        if not isinstance(baseline, Simulation):
            raise PipelineScheduleError(
                f"speedup_over({baseline!r}): expected a Simulation (from eqxpar.pipeline.simulate)."
            )
        if lockstep:
            return baseline.lockstep_s / self.lockstep_s
        return baseline.free_s / self.free_s

    def __str__(self) -> str:
        return (
            f"{self.name}: free-running {self.free_s:.6g} s (bubble {self.bubble_fraction:.1%}), "
            f"lockstep {self.lockstep_s:.6g} s (bubble {self.lockstep_bubble_fraction:.1%}), "
            f"work {self.work_s:.6g} s over {self.stages} devices"
        )


def run_times(
    schedule: Any,
    cost: dict[int, float],
    extra: dict[int, float],
    send: float,
    stage_layers: tuple[int, ...] | None = None,
) -> Simulation:
    """The step times of `schedule` (a `Schedule`, which imports this module for
    its bubble fractions) when an action of code `a` takes `cost[a]` seconds
    (times `stage_layers[k]` on virtual stage `k`, where given), `extra[a]` more
    on the last virtual stage, and a send between devices `send` seconds (see
    `simulate`)."""
    entries = schedule.entries()
    stages = schedule.virtual_stages
    scale = (1,) * stages if stage_layers is None else stage_layers

    def time(kind: int, k: int) -> float:
        return cost[kind] * scale[k] + (extra[kind] if k == stages - 1 else 0.0)

    free = [0.0] * schedule.stages
    finish: dict[tuple[int, int, int], tuple[float, int]] = {}  # key -> (end, device)
    work = 0.0
    # In run order (by tick; a fused tick's second action after its first), so
    # whatever an action depends on has its finish time already.
    for _, device, mb, k, kind in entries:
        start = free[device]
        for dep in dependencies((kind, mb, 0), k, stages):
            end, where = finish[done_key(*dep)]
            start = max(start, end + (send if where != device else 0.0))
        end = start + time(kind, k)
        finish[(kind, mb, k)] = (end, device)
        if kind in (BACKWARD, BACKWARD_INPUT):
            finish[done_key(kind, mb, k)] = (end, device)
        free[device] = end
        work += time(kind, k)
    # A tick lasts as long as its costliest device: both of a fused tick's actions.
    per_device = np.zeros(schedule.table.shape[:2])
    for tick, device, _, k, kind in entries:
        per_device[tick, device] += time(kind, k)
    lockstep = float(per_device.max(axis=1).sum()) + send * schedule.ticks
    return Simulation(
        name=schedule.name, stages=schedule.stages, free_s=max(free), lockstep_s=lockstep, work_s=work
    )
