"""`simulate`: the predicted step time of a schedule table from measured
per-action times (e.g. `benchmarks/one_device.py`'s `stage_actions`), the times
checked, then walked over the table as a `Schedule`'s bubble fractions are
(`_timeline`).
"""

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._errors import PipelineScheduleError
from .._plan import checked_stage_layers
from ._actions import ACTION_NAMES, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE
from ._schedule import Schedule
from ._timeline import Simulation, run_times

#: The keys of `simulate`'s `costs`, by action code.
COST_KEYS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "I", BACKWARD_WEIGHT: "W"}


def _checked_times(name: str, costs: Any, required: list[int]) -> dict[int, float]:
    """`costs` (argument `name` of `simulate`) by action code, every key of
    `required` present; idle costs nothing."""
    if not isinstance(costs, Mapping):
        raise PipelineScheduleError(
            f"simulate({name}={costs!r}): expected a mapping from action ('F', 'B', 'I', 'W') to "
            'seconds, e.g. {"F": 1e-3, "B": 2e-3}.'
        )
    unknown = sorted(str(k) for k in costs if k not in COST_KEYS.values())
    if unknown:
        raise PipelineScheduleError(
            f"simulate({name}=...): unknown key(s) {unknown}; expected 'F' (forward), 'B' "
            "(backward), 'I' (backward-input), 'W' (backward-weight)."
        )
    missing = [COST_KEYS[a] for a in required if COST_KEYS[a] not in costs]
    if missing:
        raise PipelineScheduleError(
            f"simulate({name}={dict(costs)!r}): no time for {missing}, which the table runs "
            f"({', '.join(ACTION_NAMES[a] for a in required)}). Add {missing} to {name} (seconds "
            "for one virtual stage and one micro-batch)."
        )
    out: dict[int, float] = dict.fromkeys(COST_KEYS, 0.0) | {IDLE: 0.0}
    for code, letter in COST_KEYS.items():
        if letter not in costs:
            continue
        value = costs[letter]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
            raise PipelineScheduleError(
                f"simulate({name}[{letter!r}]={value!r}): expected a number of seconds (float)."
            )
        if not math.isfinite(value) or value < 0:
            raise PipelineScheduleError(
                f"simulate({name}[{letter!r}]={value!r}): expected a finite time >= 0 seconds. Pass "
                "the measured time of one action (e.g. from benchmarks/one_device.py's stage_actions)."
            )
        out[code] = float(value)
    return out


def _checked_send(send: Any) -> float:
    if isinstance(send, bool) or not isinstance(send, (int, float, np.floating, np.integer)):
        raise PipelineScheduleError(f"simulate(send={send!r}): expected a number of seconds (float).")
    if not math.isfinite(send) or send < 0:
        raise PipelineScheduleError(
            f"simulate(send={send!r}): expected a finite time >= 0 seconds (0: free communication)."
        )
    return float(send)


def simulate(
    schedule: Any,
    # `Any` for the arguments validated below: a wrong kind of value raises an
    # eqxpar error naming it and the fix (schedule: a Schedule; costs: a mapping
    # of str to seconds; send: seconds).
    costs: Any,
    *,
    send: Any = 0.0,
    last_stage: Any = None,
    stage_layers: Any = None,
) -> Simulation:
    """Predict the step time of `schedule` on its devices from per-action times.

    Two ways to run a table:

    - free-running: each device runs its column's actions in table order, each as
      soon as the device is free and its inputs have arrived; an activation or
      cotangent sent by the action it depends on arrives `send` seconds after that
      action ends (nothing is sent between two actions on the same device);
    - lockstep (one SPMD program, as eqxpar's engine runs it): every tick lasts as
      long as its costliest device (a fused tick's two actions together), plus
      `send` (the engine's per-tick `ppermute`).

    **Arguments:**

    - `schedule`: an `eqxpar.pipeline.Schedule` (any placement).
    - `costs`: seconds of one action of one virtual stage on one micro-batch:
      `"F"` forward, `"B"` backward, `"I"` backward-input, `"W"` backward-weight;
      only the actions the table runs are required. With chunks, a virtual
      stage's (a chunk's) time.
    - `send`: keyword-only, seconds for an activation or cotangent to reach the
      next device (default 0: free communication).
    - `last_stage`: keyword-only, the seconds the last virtual stage's actions take
      on top of `costs` (the model's head and loss, which run there), by the same
      keys, absent keys 0; default none. In lockstep a tick in which the last
      stage's device is the costliest lasts that much longer, on every device.
    - `stage_layers`: keyword-only, layers per virtual stage (as
      `Plan(stage_layers=...)`); `costs` are then one layer's times, and virtual
      stage `k`'s actions take `stage_layers[k]` times them (`last_stage` is
      still added once). Default None: every stage costs `costs`.

    **Returns:** a `Simulation` (`free_s`, `lockstep_s`, `work_s`, the bubble
    fractions, `speedup_over`).

    **Raises:** `PipelineScheduleError` for a missing, unknown, negative or
    non-finite cost or send time; `PlanError` for `stage_layers` that are not one
    positive count per virtual stage.

    ```python
    import eqxpar
    costs = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    gpipe = eqxpar.pipeline.simulate(eqxpar.pipeline.schedule("gpipe", stages=4, microbatches=16), costs)
    zb_schedule = eqxpar.pipeline.schedule("zero_bubble", stages=4, microbatches=16)
    zb = eqxpar.pipeline.simulate(zb_schedule, costs)
    zb.bubble_fraction          # 3 / 51, the schedule's bubble_fraction
    zb.speedup_over(gpipe)      # 1.12
    # A head costing a tenth of a stage forward, on the last stage (its device runs
    # 1.1 F, 1.1 I, 1.1 W): lockstep 55.8, against 51 without.
    eqxpar.pipeline.simulate(zb_schedule, costs, last_stage={"F": 0.1, "I": 0.1, "W": 0.1})
    # 15 layers, a head worth one: a layer less on the last stage balances it.
    layer, head = {"F": 1.0, "B": 2.0}, {"F": 1.0, "B": 2.0}
    one_f_one_b = eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=16)
    eqxpar.pipeline.simulate(one_f_one_b, layer, last_stage=head, stage_layers=(4, 4, 4, 3))
    ```
    """
    if not isinstance(schedule, Schedule):
        raise PipelineScheduleError(
            f"simulate({schedule!r}): expected an eqxpar.pipeline.Schedule; build one with "
            "eqxpar.pipeline.schedule(...) or Schedule.from_table / from_orders."
        )
    entries = schedule.entries()
    used = sorted({kind for *_, kind in entries})
    cost = _checked_times("costs", costs, used)
    extra = _checked_times("last_stage", {} if last_stage is None else last_stage, [])
    send = _checked_send(send)
    if stage_layers is not None:
        stage_layers = checked_stage_layers(stage_layers, stages=schedule.stages, chunks=schedule.chunks)
    return run_times(schedule, cost, extra, send, stage_layers)
