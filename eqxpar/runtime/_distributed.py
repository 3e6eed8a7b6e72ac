"""Starting a multi-process JAX run, and logging that says which process speaks."""

import atexit
import importlib.util
import logging
import os
import re
import signal
import sys
from collections.abc import MutableMapping, Sequence
from typing import Any, NoReturn

import jax

from .._errors import EqxparError

#: Environment variables `eqxpar.launch` sets for each process it starts, read by
#: `initialize()` when it is called without arguments.
ENV_COORDINATOR = "EQXPAR_COORDINATOR"
ENV_NUM_PROCESSES = "EQXPAR_NUM_PROCESSES"
ENV_PROCESS_ID = "EQXPAR_PROCESS_ID"
#: How many times `eqxpar.launch --max-restarts` restarted the job before this run.
ENV_RESTART_COUNT = "EQXPAR_RESTART_COUNT"
# Slurm's count of a requeued job's restarts, read when the launcher's is absent.
_SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"

_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
# Where initialize() started the run, to tell a repeated call apart from a conflicting one.
_STARTED: dict[str, Any] = {}
# The excepthook found when the exit hooks were installed (once per process).
_EXIT_HOOKS: dict[str, Any] = {}


class DistributedError(EqxparError):
    """A multi-process run cannot be started as asked (bad coordinator, count or id)."""


def _int_from_env(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise DistributedError(
            f"environment variable {name}={raw!r} is not an integer. Set it to a whole "
            "number (eqxpar.launch sets it for you), or unset it."
        ) from None


def _validate(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    if coordinator_address is not None:
        if not isinstance(coordinator_address, str) or not _ADDRESS.match(coordinator_address):
            raise DistributedError(
                f"initialize(coordinator_address={coordinator_address!r}): expected 'host:port', "
                "e.g. '10.0.0.1:1234' (the address of process 0 and a free port on it)."
            )
        port = int(coordinator_address.rsplit(":", 1)[1])
        if not 0 < port < 65536:
            raise DistributedError(
                f"initialize(coordinator_address={coordinator_address!r}): port {port} is not "
                "in 1..65535. Choose a free port on process 0's host."
            )
    for name, value, low in (("num_processes", num_processes, 1), ("process_id", process_id, 0)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < low):
            raise DistributedError(f"initialize({name}={value!r}): expected an integer >= {low}.")
    if num_processes is not None and process_id is not None and process_id >= num_processes:
        raise DistributedError(
            f"initialize(process_id={process_id}, num_processes={num_processes}): process ids "
            f"run from 0 to {num_processes - 1}. Give each process a distinct id below "
            f"{num_processes}."
        )


def _use_gloo_on_cpu() -> None:
    # Cross-process collectives on the CPU backend need an implementation chosen
    # before the backend starts; gloo ships with jaxlib. A user who picked MPI keeps it.
    current = jax.config.jax_cpu_collectives_implementation
    if current in (None, "gloo"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_ids: int | Sequence[int] | None = None,
    cluster_detection_method: str | None = None,
    initialization_timeout: int = 300,
    heartbeat_timeout_seconds: int = 100,
    preemption_service: bool = False,
) -> bool:
    """Join this process to a multi-process JAX run (`jax.distributed.initialize`).

    Call it first, before anything touches JAX devices. Arguments left as None are
    taken, in order, from the environment `eqxpar.launch` sets
    (`EQXPAR_COORDINATOR`, `EQXPAR_NUM_PROCESSES`, `EQXPAR_PROCESS_ID`), then from
    JAX's own cluster detection (Slurm, Open MPI, Kubernetes, TPU on GKE). When none
    of these says the run has several processes, nothing is started and the
    program runs as one process, so a script that calls `initialize()` also runs
    without a launcher. On CPU, cross-process collectives use gloo.

    Once joined, a process that fails exits at once with its status: an uncaught
    exception exits with 1 (after printing the traceback), `sys.exit(n)` with
    `n`, skipping the remaining `atexit` handlers. Without this, JAX's own
    `atexit` shutdown would wait for every other process to exit too, so a
    failing process would hang, unseen by a launcher or scheduler, while its
    peers wait on it. A clean exit (the end of the script, `sys.exit(0)`) still
    shuts the run down together with the other processes. (`raise SystemExit(n)`
    written out, rather than `sys.exit(n)`, is not seen and exits as before.)
    SIGTERM ends the process, as it does any program, unless
    `preemption_service=True`.

    Calling it again with the same (or no) arguments does nothing.

    **Arguments:**

    - `coordinator_address`: `"host:port"` of process 0's coordinator service.
    - `num_processes`: number of processes in the run.
    - `process_id`: this process's id, `0 <= process_id < num_processes`.
    - `local_device_ids`: restrict this process to these local (GPU) devices.
    - `cluster_detection_method`: passed to JAX (e.g. `"mpi4py"`, `"deactivate"`).
    - `initialization_timeout`: seconds to wait for all processes to connect.
    - `heartbeat_timeout_seconds`: seconds after which a silent peer counts as dead.
    - `preemption_service`: start JAX's preemption service, which catches SIGTERM
      so that `eqxpar.distributed.PreemptionGuard` (on
      `jax.experimental.multihost_utils.reached_preemption_sync_point`) can make
      every process save and stop at the same step. With it, SIGTERM no longer
      stops the process by itself: the training loop must ask the guard.

    **Returns:** True when this process is part of a multi-process run (now or
    from an earlier call), False when it runs alone.

    **Raises:** `DistributedError` for a malformed address, count or id, a call
    that conflicts with an earlier one, or a call after JAX already started its
    backend in a run that needs several processes.

    ```python
    import eqxpar.distributed as dist
    dist.initialize()                       # under eqxpar.launch, Slurm, mpirun, ...
    dist.print_once(f"{jax.device_count()} devices in {jax.process_count()} processes")
    ```
    """
    asked = _asked(coordinator_address, num_processes, process_id)
    if jax.distributed.is_initialized():
        _check_same_run(asked)
        return True
    if not _needs_a_run(asked, cluster_detection_method):
        return False
    _start_jax(
        asked,
        preemption_service,
        local_device_ids=local_device_ids,
        cluster_detection_method=cluster_detection_method,
        initialization_timeout=initialization_timeout,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
    )
    _STARTED.update(asked)
    _install_exit_hooks()
    return True


def _asked(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> dict[str, Any]:
    """The run `initialize` was asked for: its arguments, with the gaps filled from
    the environment `eqxpar.launch` sets, each checked."""
    _validate(coordinator_address, num_processes, process_id)
    coordinator_address = coordinator_address or os.environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _int_from_env(ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _int_from_env(ENV_PROCESS_ID)
    _validate(coordinator_address, num_processes, process_id)
    return {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }


def _check_same_run(asked: dict[str, Any]) -> None:
    """Raise when a repeated `initialize` call asks for another run than the first."""
    for name, value in asked.items():
        previous = _STARTED.get(name)
        if value is not None and previous is not None and value != previous:
            raise DistributedError(
                f"initialize({name}={value!r}): this process already joined a run with "
                f"{name}={previous!r}. A process can join one run only; call initialize() "
                "once, at the start of the program."
            )


def _needs_a_run(asked: dict[str, Any], cluster_detection_method: str | None) -> bool:
    """Whether this process should join a multi-process run (False: it runs alone).

    Raises when some of the run's settings were given and nothing supplies the rest."""
    explicit = any(v is not None for v in asked.values())
    if asked["num_processes"] == 1 and asked["coordinator_address"] is None:
        return False  # a run of one process needs no coordinator
    detected = cluster_detection_method is not None or _cluster_detected()
    if not explicit and not detected:
        return False
    if explicit and None in asked.values() and not detected:
        missing = [name for name, value in asked.items() if value is None]
        raise DistributedError(
            f"initialize(): {', '.join(missing)} not given, and no cluster environment "
            "(Slurm, Open MPI, Kubernetes, TPU) was detected to supply it. Pass "
            "coordinator_address, num_processes and process_id, or start the program "
            "with `python -m eqxpar.launch -n N script.py`."
        )
    return True


def _start_jax(asked: dict[str, Any], preemption_service: bool, **options: Any) -> None:
    """`jax.distributed.initialize`, its failures turned into `DistributedError`s."""
    _use_gloo_on_cpu()
    # JAX's preemption service swallows SIGTERM (it only records a preemption
    # notice), so a process told to stop by a launcher, a scheduler or `kill` would
    # carry on; it is started only for programs that ask for it.
    jax.config.update("jax_enable_preemption_service", bool(preemption_service))
    try:
        jax.distributed.initialize(
            asked["coordinator_address"], asked["num_processes"], asked["process_id"], **options
        )
    except RuntimeError as e:
        if "before any JAX calls" in str(e) or "backend" in str(e).lower():
            raise DistributedError(
                "initialize() was called after JAX started its backend (some earlier "
                "jax.devices(), jnp array or jit call), so this process cannot join a "
                "multi-process run any more. Call eqxpar.distributed.initialize() at the "
                "very start of the program, before any other JAX call."
            ) from e
        raise DistributedError(f"jax.distributed.initialize failed: {e}") from e
    except (ValueError, TypeError) as e:
        raise DistributedError(
            f"jax.distributed.initialize rejected the run's settings ({e}). Pass "
            "coordinator_address, num_processes and process_id explicitly."
        ) from e


def _install_exit_hooks() -> None:
    """Make this process exit at once, with its status, when it fails.

    JAX's `atexit` handler ends a multi-process run with a barrier that waits for
    every process. A process that fails while its peers run on (and wait for it in
    their next collective) would block there, neither exiting nor being seen as
    dead. Two hooks catch a failure at the moment the interpreter ends the
    program, and exit with `os._exit` instead:

    - `sys.excepthook`, for an exception no code caught (status 1; a
      KeyboardInterrupt ends the process by SIGINT, as Python does);
    - `sys.exit`, whose `SystemExit` reports its status when it is discarded
      with no Python code left running, i.e. when it ended the program rather
      than being caught.

    A clean exit (status 0) goes through the normal shutdown.
    """
    if _EXIT_HOOKS:
        return
    _EXIT_HOOKS["excepthook"] = sys.excepthook
    sys.excepthook = _excepthook
    sys.exit = _sys_exit


def _excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
    _EXIT_HOOKS["excepthook"](kind, value, tb)
    # Also called by code that only reports an exception (a REPL, a notebook);
    # there the program goes on.
    if sys._getframe().f_back is not None:
        return
    _flush_output()
    if issubclass(kind, KeyboardInterrupt):
        # Python ends a program interrupted by Ctrl-C by SIGINT itself.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(1)


class _Exit(SystemExit):
    """The `SystemExit` that `sys.exit` raises once `initialize()` has joined a run."""

    def __del__(self) -> None:
        # Discarded with no Python frame below: it ended the program (one that
        # was caught is discarded by the code that caught it, which goes on).
        if sys._getframe().f_back is not None:
            return
        code = self.code
        if code is None or code == 0:
            return
        if isinstance(code, int):
            _exit_now(code)
        # A message (`sys.exit("bad input")`): Python prints it and exits with 1,
        # after this; an atexit handler registered now runs first, before JAX's.
        atexit.register(_exit_now, 1)


def _sys_exit(status: object = None, /) -> NoReturn:
    """`sys.exit`, raising `_Exit` so that a failing exit is noticed."""
    raise _Exit(status)


def _flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or broken stream must not keep the process alive
            pass
    logging.shutdown()


def _exit_now(status: int) -> None:
    _flush_output()
    os._exit(status)


def _cluster_detected() -> bool:
    # The markers JAX's own cluster detection looks for (jax/_src/clusters). Asking
    # JAX directly is not possible once the backend runs, and raises when no cluster
    # is present, so the same environment variables are read here.
    env = os.environ
    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in env for name in slurm):
        return True
    if "OMPI_MCA_orte_hnp_uri" in env or "JAX_COORDINATOR_ADDRESS" in env:
        return True
    if "KUBERNETES_SERVICE_HOST" in env and importlib.util.find_spec("kubernetes") is not None:
        return True
    return "TPU_WORKER_HOSTNAMES" in env or "TPU_PROCESS_ADDRESSES" in env


def process_index() -> int:
    """This process's index in the run (0 when it runs alone).

    Safe to call before `initialize()`: it then reads the launcher's environment
    instead of starting JAX's backend (which would make joining a run impossible).

    ```python
    if eqxpar.distributed.process_index() == 0: ...
    ```
    """
    if jax.distributed.is_initialized():
        return jax.process_index()
    return _int_from_env(ENV_PROCESS_ID) or 0


def process_count() -> int:
    """Number of processes in the run (1 when it runs alone); safe before `initialize()`.

    ```python
    n = eqxpar.distributed.process_count()
    ```
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    return _int_from_env(ENV_NUM_PROCESSES) or 1


def restart_count() -> int:
    """How many times this job was restarted before this run (0 on its first run).

    `python -m eqxpar.launch --max-restarts N` starts the whole job again when a
    process fails, and tells each process how many restarts came before
    (`EQXPAR_RESTART_COUNT`, as torchrun's `TORCHELASTIC_RESTART_COUNT`). Without
    it, Slurm's `SLURM_RESTART_COUNT` (set in a requeued job) is read; with
    neither, 0. Safe to call before `initialize()`.

    **Returns:** the number of restarts, `>= 0`.

    **Raises:** `DistributedError` when the variable is set to something other
    than a whole number `>= 0`.

    ```python
    if eqxpar.distributed.restart_count() > 0:
        eqxpar.distributed.print_once("restarted; resuming from the latest checkpoint")
    ```
    """
    for name in (ENV_RESTART_COUNT, _SLURM_RESTART_COUNT):
        value = _int_from_env(name)
        if value is not None:
            if value < 0:
                raise DistributedError(
                    f"environment variable {name}={value} is negative; a restart count is a "
                    "whole number >= 0 (eqxpar.launch sets it for you), or unset it."
                )
            return value
    return 0


def is_main_process() -> bool:
    """Whether this is process 0, the one that prints and writes shared files.

    ```python
    if eqxpar.distributed.is_main_process():
        json.dump(metrics, open("metrics.json", "w"))
    ```
    """
    return process_index() == 0


def rank_prefix() -> str:
    """`"[rank k/n]"` for this process (e.g. `"[rank 1/2]"`).

    ```python
    print(eqxpar.distributed.rank_prefix(), "loaded")
    ```
    """
    return f"[rank {process_index()}/{process_count()}]"


def print_once(*args: Any, **kwargs: Any) -> None:
    """`print(*args, **kwargs)` on process 0 only; flushed, so launchers see it at once.

    ```python
    eqxpar.distributed.print_once(f"step {i}: loss {loss:.4f}")
    ```
    """
    if is_main_process():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def log(msg: str, *, level: int = logging.INFO, logger: logging.Logger | None = None) -> None:
    """Log `msg` from every process, prefixed with `[rank k/n]`.

    With no `logger`, prints to standard error (flushed), so it works without any
    logging configuration; with one, goes through `get_logger(logger)`.

    **Arguments:**

    - `msg`: the message.
    - `level`: the logging level (used with `logger`).
    - `logger`: a `logging.Logger` to send the message through.

    ```python
    eqxpar.distributed.log(f"holding rows {rows} of the batch")
    ```
    """
    if logger is None:
        print(f"{rank_prefix()} {msg}", file=sys.stderr, flush=True)
    else:
        get_logger(logger).log(level, msg)


class RankLoggerAdapter(logging.LoggerAdapter):
    """A `logging.LoggerAdapter` that prefixes each message with `[rank k/n]`.

    Built by `get_logger`. The rank is read at each message, so an adapter made
    before `initialize()` reports the right rank afterwards.

    ```python
    logger = eqxpar.distributed.RankLoggerAdapter(logging.getLogger("train"), {})
    ```
    """

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{rank_prefix()} {msg}", kwargs


def get_logger(logger: str | logging.Logger = "eqxpar") -> RankLoggerAdapter:
    """A logger whose messages start with this process's `[rank k/n]`.

    **Arguments:**

    - `logger`: a logger name or a `logging.Logger`.

    **Returns:** a `RankLoggerAdapter` (use it like a logger: `.info`, `.warning`, ...).

    ```python
    logger = eqxpar.distributed.get_logger(__name__)
    logger.info("restored step %d", step)      # "[rank 1/2] restored step 3"
    ```
    """
    if isinstance(logger, str):
        logger = logging.getLogger(logger)
    if not isinstance(logger, logging.Logger):
        raise DistributedError(f"get_logger({logger!r}): expected a logger name or a logging.Logger.")
    return RankLoggerAdapter(logger, {})
