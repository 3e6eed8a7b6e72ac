"""What eqxpar decides on the way from a plan to a compiled step, for readers who
want to look: no part of the user-facing API, and no promise that it keeps its
shape between releases (as `equinox.internal`).

- `StepLayout`: what a step resolves from the plan and the state outline (how it
  is parallel, the specs of parameters, updates and batch, the manual axes). A
  `Step` gives it for a state: `step.layout(state)`; `layout.resolved` is what the
  step's builder resolved from the plan once, before any model (the manual axes,
  the batch layout, the dtypes).
- `ResolvedPlan`: a plan resolved once, before any model (`ResolvedPlan.of(plan)`):
  what `StepLayout.of` and `DecodeLayout.resolve` take.
- `DecodeLayout`: the same for `eqxpar.models.generate` (the plan it decodes
  under, whether each step is manual, the key/value cache's spec).
- `Buffers`: the buffer slots a pipeline schedule allocates (`Schedule.buffers`).
- `ACTION_NAMES`, `COSTS`: the pipeline actions a schedule table's cells hold, by
  index, and each action's relative cost in forward passes.
- `PREDICTION_SCHEDULES`: schedule names `eqxpar.pipeline.schedule` builds for
  prediction only (empty: the engine runs every built-in schedule).

```python
resolved = eqxpar.internal.ResolvedPlan.of(plan)
layout = eqxpar.internal.StepLayout.of(resolved, eqx.filter(model, eqx.is_inexact_array))
layout.manual_axes, layout.batch
```
"""

from ._plan import PREDICTION_SCHEDULES as PREDICTION_SCHEDULES
from ._train._resolved_plan import ResolvedPlan as ResolvedPlan
from ._train._step_layout import DecodeLayout as DecodeLayout
from ._train._step_layout import StepLayout as StepLayout
from .pipeline._actions import ACTION_NAMES as ACTION_NAMES
from .pipeline._actions import COSTS as COSTS
from .pipeline._buffers import Buffers as Buffers
