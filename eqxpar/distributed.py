"""Multi-process runs: `initialize`, process-aware printing and logging.

```python
import eqxpar.distributed as dist
dist.initialize()                    # reads eqxpar.launch's environment, or Slurm/MPI/k8s
dist.print_once("only process 0 prints this")
dist.log("every process logs this, as [rank k/n] ...")
guard = dist.PreemptionGuard()       # with initialize(preemption_service=True): stop on SIGTERM
```
"""

from .runtime._distributed import DistributedError as DistributedError
from .runtime._distributed import RankLoggerAdapter as RankLoggerAdapter
from .runtime._distributed import get_logger as get_logger
from .runtime._distributed import initialize as initialize
from .runtime._distributed import is_main_process as is_main_process
from .runtime._distributed import log as log
from .runtime._distributed import print_once as print_once
from .runtime._distributed import process_count as process_count
from .runtime._distributed import process_index as process_index
from .runtime._distributed import rank_prefix as rank_prefix
from .runtime._distributed import restart_count as restart_count
from .runtime._preemption import PreemptionGuard as PreemptionGuard
