"""Running across processes: launching them, joining them into one JAX run,
feeding them data, and checkpointing what they train.

The public modules are `eqxpar.launch`, `eqxpar.distributed`, `eqxpar.data` and
`eqxpar.checkpoint`; this package holds their implementations and re-exports their
public names in one place:

- `_launch`: `run` and `free_port` (`python -m eqxpar.launch` is the command line);
- `_distributed`: `initialize`, `restart_count`, process-aware printing and logging;
- `_preemption`: `PreemptionGuard`, stopping every process at the same step on SIGTERM;
- `_data`: `ShardedIterator`, `global_batch`, `process_slice`;
- `_token_file`: `TokenFile`, token ids on disk read as sequences;
- `_grain`: `GrainSampler`, `grain_sampler`, `grain_loader` (grain is imported
  only when a sampler's shard options or a loader are built);
- `_checkpoint`: `CheckpointManager` (orbax-checkpoint is imported only when a
  manager is built);
- `_xla_flags`: `supported_xla_flags`, the XLA flags the installed jaxlib knows.
"""

from ._checkpoint import CheckpointError as CheckpointError
from ._checkpoint import CheckpointManager as CheckpointManager
from ._data import ShardedIterator as ShardedIterator
from ._data import global_batch as global_batch
from ._data import process_slice as process_slice
from ._distributed import DistributedError as DistributedError
from ._distributed import RankLoggerAdapter as RankLoggerAdapter
from ._distributed import get_logger as get_logger
from ._distributed import initialize as initialize
from ._distributed import is_main_process as is_main_process
from ._distributed import log as log
from ._distributed import print_once as print_once
from ._distributed import process_count as process_count
from ._distributed import process_index as process_index
from ._distributed import rank_prefix as rank_prefix
from ._distributed import restart_count as restart_count
from ._grain import GrainSampler as GrainSampler
from ._grain import grain_loader as grain_loader
from ._grain import grain_sampler as grain_sampler
from ._launch import free_port as free_port
from ._launch import run as run
from ._preemption import PreemptionGuard as PreemptionGuard
from ._token_file import TokenFile as TokenFile
from ._xla_flags import supported_xla_flags as supported_xla_flags
