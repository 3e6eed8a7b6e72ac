"""eqxpar: Equinox-native parallelism for JAX.

Write the model once with ordinary-looking Equinox layers; choose data, FSDP,
tensor, sequence or pipeline parallelism by changing only the mesh and the plan.
"""

from . import inspect as inspect, rules as rules, train as train
from ._errors import (
    AxisNameError as AxisNameError,
    BatchError as BatchError,
    DivisibilityError as DivisibilityError,
    EqxparError as EqxparError,
    MeshError as MeshError,
    PlanError as PlanError,
    SpecError as SpecError,
    UnmatchedLeafError as UnmatchedLeafError,
)
from ._mesh import AXES as AXES, BATCH_AXES as BATCH_AXES, make_mesh as make_mesh
from ._param import param as param
from ._plan import Plan as Plan, current_plan as current_plan
from ._shard_map import filter_shard_map as filter_shard_map
from ._sharding import (
    annotate as annotate,
    named_shardings as named_shardings,
    shard as shard,
    shard_batch as shard_batch,
)
from ._specs import partition_specs as partition_specs

__version__ = "0.1.0"
