"""Run a script as several JAX processes on this machine.

    python -m eqxpar.launch -n 2 --devices-per-process 4 train.py --steps 10

or, from Python, `eqxpar.launch.run("train.py", ["--steps", "10"], processes=2,
devices_per_process=4)`. The script calls `eqxpar.distributed.initialize()`, which
reads the coordinator, process count and id the launcher passes in the
environment. Output lines are prefixed `[rank k]`; if any process fails, the
others are killed and the launcher exits non-zero, naming the failing rank, or,
with `--max-restarts N`, starts the whole job again (up to N times). SIGTERM to
the launcher is forwarded to the processes, which get `--grace-period` seconds
(default 30) to save and exit.
"""

import sys

from .runtime._launch import free_port as free_port
from .runtime._launch import main as main
from .runtime._launch import run as run

if __name__ == "__main__":
    sys.exit(main())
