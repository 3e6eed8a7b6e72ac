"""`validate`: whether a schedule's table is runnable, checked before anything
compiles. Shared with `eqxpar._plan` (which validates a `Plan(schedule=...)`
table with it); the public name is `eqxpar.pipeline.validate`.
"""

from typing import Any

from .._errors import PipelineScheduleError
from ._schedule import Schedule
from ._table_checks import check_schedule


def validate(schedule: Any) -> None:
    """Check that a schedule's table is runnable, before anything compiles.

    Checks, in order: the counts and placement; the table's shape `(ticks,
    stages, 3)` and values (action codes 0-4, micro-batch and chunk in range
    where not idle; one cell per device and tick, so two actions of a device in
    one tick cannot be written); each action once, and every (micro-batch,
    virtual stage) with a forward and either a backward or a backward-input and
    a backward-weight; each action at a later tick than what it depends on (the
    previous stage's forward; the same stage's forward and the next stage's
    backward or backward-input; for backward-weight, its backward-input): an
    activation or cotangent sent at the end of tick `t` is usable from `t + 1`.

    **Arguments:** `schedule`.

    **Raises:** `PipelineScheduleError` (a `PlanError`) naming the tick and device
    of the first problem and the fix.

    ```python
    eqxpar.pipeline.validate(eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=8))
    ```
    """
    if not isinstance(schedule, Schedule):
        raise PipelineScheduleError(
            f"validate({schedule!r}): expected an eqxpar.pipeline.Schedule; build one with "
            "eqxpar.pipeline.schedule(...) or Schedule.from_table / from_orders."
        )
    check_schedule(schedule)


def check_table(schedule: Any) -> None:
    """Raise `PipelineScheduleError` (a `PlanError`) unless the table is runnable:
    the same checks as `validate` (used by the tests on every built table)."""
    validate(schedule)
