"""Pipeline parallelism: a scan-based engine that follows schedules given as data.

A model's blocks live in an `eqxpar.nn.Stacked` (a leading "layers" axis); a
pipeline plan splits that axis over mesh axis `pipe`, so device `s` holds a
contiguous run of layers, and runs the train step as one `lax.scan` over the
ticks of a schedule table inside `shard_map`. The parts before and after the
stack (embedding, head) are replicated over `pipe` and run on the first and last
stage; the loss is given in those three parts as a `PipelineLoss`.

```python
plan = eqxpar.Plan(eqxpar.make_mesh(pipe=4, data=2),
                   rules=eqxpar.pipeline.stage_rules(),
                   schedule="1f1b", microbatches=8)
loss = eqxpar.pipeline.PipelineLoss(first, lambda m: m.blocks, last)
step = eqxpar.train.make_step(loss, optax.adam(1e-3), plan)
```

- `schedule(name, *, stages, microbatches, chunks=1) -> Schedule`: the tables
  (`"gpipe"`, `"1f1b"`, `"interleaved"`, `"zero_bubble"`, and in a V placement,
  device `d` holding virtual stages `d` and `2p - 1 - d`, `"zb_v"` and
  `"dualpipe_v"`) with
  their bubble fractions and buffer sizes; `save_schedule_png` draws one.
- `Schedule.from_table(table, ...)` / `Schedule.from_orders(orders, ...)`: a
  user's schedule, checked by `validate` (raising `PipelineScheduleError` with
  the tick and device) before anything compiles; `Plan(schedule=...)` takes it.
- `simulate(schedule, costs, *, send=0.0) -> Simulation`: the step time
  predicted from per-action times, free-running and lockstep.
- `PipelineLoss(first, stack, last)`: the loss in three parts.
- `stage_rules(*rules)`: rules that also split every stack's layers over `pipe`.
- `to_pipeline_order` / `from_pipeline_order`: the storage order of interleaved
  (several chunks per device) stacks and of uneven ones (`Plan(stage_layers=...)`:
  each chunk in `max(stage_layers)` slots, padded with zeros).
"""

from .._plan import PIPELINE_SCHEDULES as SCHEDULES
from ._builtin import forward_only as forward_only
from ._builtin import schedule as schedule
from ._layout import StageRules as StageRules
from ._layout import from_pipeline_order as from_pipeline_order
from ._layout import stage_rules as stage_rules
from ._layout import to_pipeline_order as to_pipeline_order
from ._loss import PipelineLoss as PipelineLoss
from ._picture import save_schedule_png as save_schedule_png
from ._placement import PLACEMENTS as PLACEMENTS
from ._schedule import Schedule as Schedule
from ._simulate import simulate as simulate
from ._timeline import Simulation as Simulation
from ._validate import check_table as check_table
from ._validate import validate as validate

__all__ = [
    "SCHEDULES",
    "PLACEMENTS",
    "PipelineLoss",
    "Schedule",
    "Simulation",
    "StageRules",
    "check_table",
    "from_pipeline_order",
    "save_schedule_png",
    "schedule",
    "simulate",
    "stage_rules",
    "to_pipeline_order",
    "validate",
]
