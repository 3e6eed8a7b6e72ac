"""eqxpar: Equinox-native parallelism for JAX.

Write the model once with ordinary-looking Equinox layers; choose data, FSDP,
tensor, sequence or pipeline parallelism by changing only the mesh and the plan.
"""

from . import checkpoint as checkpoint
from . import collectives as collectives
from . import data as data
from . import distributed as distributed
from . import inspect as inspect
from . import internal as internal
from . import models as models
from . import nn as nn
from . import optim as optim
from . import pipeline as pipeline
from . import rules as rules
from . import runtime as runtime
from . import train as train
from ._advise import PROFILES as DEVICE_PROFILES  # noqa: F401  (re-exported under this name)
from ._advise import Advice as Advice
from ._advise import DeviceProfile as DeviceProfile
from ._advise import advise as advise
from ._errors import (
    AccumulationWarning as AccumulationWarning,
)
from ._errors import (
    AxisNameError as AxisNameError,
)
from ._errors import (
    BatchError as BatchError,
)
from ._errors import (
    DivisibilityError as DivisibilityError,
)
from ._errors import (
    EqxparError as EqxparError,
)
from ._errors import (
    MeshError as MeshError,
)
from ._errors import (
    NonFiniteError as NonFiniteError,
)
from ._errors import (
    OffloadWarning as OffloadWarning,
)
from ._errors import (
    PipelineScheduleError as PipelineScheduleError,
)
from ._errors import (
    PlanError as PlanError,
)
from ._errors import (
    SpecError as SpecError,
)
from ._errors import (
    UnmatchedLeafError as UnmatchedLeafError,
)
from ._errors import (
    UnusedAxisWarning as UnusedAxisWarning,
)
from ._mesh import AXES as AXES
from ._mesh import BATCH_AXES as BATCH_AXES
from ._mesh import DCN_AXES as DCN_AXES
from ._mesh import make_mesh as make_mesh
from ._param import param as param
from ._param import stacked as stacked
from ._plan import Plan as Plan
from ._plan import current_plan as current_plan
from ._remat import ACTIVATION_NAMES as ACTIVATION_NAMES
from ._remat import OFFLOAD_PARTS as OFFLOAD_PARTS
from ._remat import RematPolicy as RematPolicy
from ._shard_map import filter_shard_map as filter_shard_map
from ._sharding import (
    annotate as annotate,
)
from ._sharding import (
    named_shardings as named_shardings,
)
from ._sharding import (
    shard as shard,
)
from ._sharding import (
    shard_batch as shard_batch,
)
from ._specs import partition_specs as partition_specs
from ._version import __version__ as __version__
