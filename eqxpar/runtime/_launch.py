"""Start N JAX processes on this machine, stream their output, stop them all on a failure.

JAX peers of a dead process block in their next collective until the coordinator's
heartbeat gives up (100 s by default), so the launcher watches its children itself:
the first one to exit non-zero gets every other one killed at once, and then, with
restarts left, the whole job starts again. SIGTERM to the launcher is passed on to
the children, which get a grace period to save a checkpoint and exit.
"""

import collections
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ._distributed import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
    ENV_RESTART_COUNT,
    DistributedError,
)

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_TAIL_LINES = 20
#: Seconds the processes get to save and exit after a SIGTERM the launcher forwards
#: (Slurm's default KillWait, and Kubernetes' default terminationGracePeriodSeconds).
DEFAULT_GRACE_PERIOD_S = 30.0
# After a failure elsewhere, how long a child may take to exit after SIGTERM before
# it gets SIGKILL.
_TERM_GRACE_S = 3.0
_POLL_S = 0.05
# How long to wait, after a failure, for near-simultaneous failures of its peers.
_SETTLE_S = 0.2


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for the coordinator).

    ```python
    coordinator = f"127.0.0.1:{eqxpar.launch.free_port()}"
    ```
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _xla_flags(existing: str, devices_per_process: int) -> str:
    flags = [f for f in shlex.split(existing) if not f.startswith(_DEVICE_FLAG)]
    return " ".join([*flags, f"{_DEVICE_FLAG}={devices_per_process}"])


def child_env(
    rank: int,
    processes: int,
    devices_per_process: int,
    coordinator: str,
    extra: Mapping[str, str] | None,
    *,
    restart_count: int = 0,
) -> dict[str, str]:
    """The environment of process `rank`: the launcher's own, plus the run's settings.

    With no `JAX_PLATFORMS` set (or `JAX_PLATFORMS=cpu`), each process simulates
    `devices_per_process` CPU devices. With another platform (e.g.
    `JAX_PLATFORMS=cuda`), it is kept, and process `rank` gets local devices
    `rank * devices_per_process` to `(rank + 1) * devices_per_process - 1`
    (`JAX_LOCAL_DEVICE_IDS`, read by `jax.distributed.initialize`) unless
    `JAX_LOCAL_DEVICE_IDS` is set already.

    **Arguments:**

    - `rank`, `processes`, `devices_per_process`: this process's place in the run.
    - `coordinator`: `"host:port"` of process 0's coordinator.
    - `extra`: environment variables to set on top of the launcher's own.
    - `restart_count`: how many times the job was restarted before this run
      (`EQXPAR_RESTART_COUNT`, read by `eqxpar.distributed.restart_count()`).

    **Returns:** the environment, as a new dict.

    ```python
    env = child_env(1, 2, 4, "127.0.0.1:4321", None)   # rank 1 of 2, 4 CPU devices
    ```
    """
    env = dict(os.environ)
    env.update(extra or {})
    env[ENV_COORDINATOR] = coordinator
    env[ENV_NUM_PROCESSES] = str(processes)
    env[ENV_PROCESS_ID] = str(rank)
    env[ENV_RESTART_COUNT] = str(restart_count)
    platforms = env.get("JAX_PLATFORMS", "").strip()
    if platforms in ("", "cpu"):
        # Nothing chosen (or the CPU): simulate the devices on the CPU.
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = _xla_flags(env.get("XLA_FLAGS", ""), devices_per_process)
    elif not env.get("JAX_LOCAL_DEVICE_IDS"):
        # Real accelerators: each process drives its own share of this host's devices.
        first = rank * devices_per_process
        env["JAX_LOCAL_DEVICE_IDS"] = ",".join(str(i) for i in range(first, first + devices_per_process))
    # Lines must reach the launcher as they are printed, not when a buffer fills.
    env["PYTHONUNBUFFERED"] = "1"
    return env


class _Child:
    """One launched process, its output pumps and the tail of its output."""

    def __init__(self, rank: int, command: list[str], env: dict[str, str], lock: threading.Lock):
        self.rank = rank
        # Its own session (process group), so killing it also kills whatever it spawned.
        self.proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.pumps = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, lock), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, lock), daemon=True),
        ]
        for pump in self.pumps:
            pump.start()

    def _pump(self, stream: Any, sink: Any, lock: threading.Lock) -> None:
        # `stream`: the child's pipe (binary); `sink`: a text stream such as sys.stdout.
        prefix = f"[rank {self.rank}] "
        for raw in iter(stream.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            with lock:
                self.tail.append(line)
                sink.write(prefix + line + "\n")
                sink.flush()
        stream.close()

    def kill(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def finish_output(self, timeout: float) -> None:
        for pump in self.pumps:
            pump.join(timeout)


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_code(code: int) -> int:
    # A signal death is reported as the shell does (128 + signal number).
    return 128 - code if code < 0 else code


def run(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    processes: int,
    devices_per_process: int = 1,
    timeout: float | int | None = None,
    env: Mapping[str, str] | None = None,
    python: str | None = None,
    max_restarts: int = 0,
    grace_period: float | int = DEFAULT_GRACE_PERIOD_S,
) -> int:
    """Run `python script args...` as `processes` JAX processes on this machine.

    Each process gets `EQXPAR_COORDINATOR` (127.0.0.1 and a free port),
    `EQXPAR_NUM_PROCESSES`, `EQXPAR_PROCESS_ID` and `EQXPAR_RESTART_COUNT`, read
    by `eqxpar.distributed.initialize()` and `restart_count()`. With no
    `JAX_PLATFORMS` set it also gets `JAX_PLATFORMS=cpu` and
    `XLA_FLAGS=--xla_force_host_platform_device_count=<devices_per_process>`
    (simulated devices); a platform that is set (`JAX_PLATFORMS=cuda`) is kept,
    and each process gets its own `devices_per_process` local devices (see
    `child_env`). Their standard output and error are streamed line by line, each
    line prefixed with `[rank k]`. Each process runs in a process group of its
    own. When one exits non-zero (or is killed), every other one is stopped
    (SIGTERM, then SIGKILL), and the rank, its exit status (`rank 1 (pid 4242)
    exited with status 7`, or `was killed by signal SIGKILL`) and the last lines
    of its output are written to standard error. Whatever the processes started
    and left running (their process groups) is killed once they are done, after
    a failure or a success.

    With `max_restarts=N`, a failure then starts the whole job again, all
    processes, on a fresh coordinator port, up to N times, each restart written
    to standard error with the rank and cause (`eqxpar.launch: restart 1 of 3:
    rank 1 exited with status 3`). The script resumes from its latest
    checkpoint (see `eqxpar.checkpoint`); `restart_count()` tells it how many
    restarts came before.

    SIGTERM to the launcher (a scheduler's preemption notice; only while `run`
    runs in the main thread) is forwarded to every process's group, and the
    processes get `grace_period` seconds to save and exit (see
    `eqxpar.distributed.PreemptionGuard`) before SIGKILL. Such a run is not
    restarted, and ends with 143 (128 + SIGTERM), as a program SIGTERM stopped.

    **Arguments:**

    - `script`: path of the Python script to run.
    - `args`: its command-line arguments.
    - `processes`: number of processes (>= 1).
    - `devices_per_process`: devices of each process (>= 1): simulated CPU
      devices, or its share of this host's GPUs when `JAX_PLATFORMS` names one.
    - `timeout`: seconds after which all processes are killed (None: no limit);
      it bounds the whole run, restarts included.
    - `env`: extra environment variables for every process.
    - `python`: the interpreter (default: the one running the launcher).
    - `max_restarts`: how many times to start the job again after a failure
      (>= 0; 0: never).
    - `grace_period`: seconds the processes have to exit after a forwarded
      SIGTERM (>= 0).

    **Returns:** 0 when every process exits with 0; otherwise the last failing
    process's exit code (128 + signal number for a signal), 124 on timeout, or
    143 after SIGTERM to the launcher.

    ```python
    code = eqxpar.launch.run("train.py", ["--steps", "10"], processes=2, devices_per_process=4,
                             max_restarts=3)
    ```
    """
    _validate_run(processes, devices_per_process, timeout, max_restarts, grace_period)
    script = os.fspath(script)
    if not os.path.isfile(script):
        raise DistributedError(
            f"launch.run: script {script!r} does not exist (working directory {os.getcwd()!r}). "
            "Give the path of a Python file."
        )
    if isinstance(args, str):
        raise DistributedError(
            f"launch.run(args={args!r}): expected a sequence of arguments, e.g. {shlex.split(args)!r}."
        )
    command = [python or sys.executable, script, *args]
    lock = threading.Lock()
    limits = _Limits(
        start=time.monotonic(), timeout=None if timeout is None else float(timeout), grace=float(grace_period)
    )
    with _Termination() as term:
        for restart in range(max_restarts + 1):
            coordinator = f"127.0.0.1:{free_port()}"
            environments = [
                child_env(rank, processes, devices_per_process, coordinator, env, restart_count=restart)
                for rank in range(processes)
            ]
            code, failures = _attempt(command, environments, lock, limits, term)
            if not failures or term.received.is_set():
                return code
            if restart < max_restarts:
                causes = ", ".join(f"rank {rank} {_describe(status)}" for rank, status in failures)
                _say(
                    lock,
                    f"restart {restart + 1} of {max_restarts}: {causes}; starting all {processes} "
                    "process(es) again.",
                )
        if max_restarts:
            _say(lock, f"all {max_restarts} restart(s) used; the last failure's status is {code}.")
        return code


def _validate_run(
    processes: int, devices_per_process: int, timeout: Any, max_restarts: int, grace_period: Any
) -> None:
    for name, value, low in (
        ("processes", processes, 1),
        ("devices_per_process", devices_per_process, 1),
        ("max_restarts", max_restarts, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise DistributedError(f"launch.run({name}={value!r}): expected an integer >= {low}.")
    if timeout is not None and (
        not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0
    ):
        raise DistributedError(
            f"launch.run(timeout={timeout!r}): expected a positive number of seconds or None."
        )
    if not isinstance(grace_period, int | float) or isinstance(grace_period, bool) or not grace_period >= 0:
        raise DistributedError(
            f"launch.run(grace_period={grace_period!r}): expected a number of seconds >= 0 "
            f"(default {DEFAULT_GRACE_PERIOD_S:g})."
        )


class _Limits(NamedTuple):
    start: float  # when the run (its first attempt) started, time.monotonic()
    timeout: float | None  # seconds the whole run may take
    grace: float  # seconds the processes have to exit after a forwarded SIGTERM


class _Termination:
    """SIGTERM to the launcher, recorded (not acted on) while `run` runs in the main thread.

    The default action would end the launcher at once and orphan its processes,
    which would then lose their chance to save: instead `_watch` forwards the
    signal to them and gives them the grace period.
    """

    def __init__(self) -> None:
        self.received = threading.Event()
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> "_Termination":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: object) -> None:
        self.received.set()

    def __exit__(self, *exc: object) -> None:
        if self._installed:
            # A handler installed from C reads as None; the default is the closest.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)


def _say(lock: threading.Lock, message: str) -> None:
    with lock:
        sys.stderr.write(f"eqxpar.launch: {message}\n")
        sys.stderr.flush()


def _attempt(
    command: list[str],
    environments: list[dict[str, str]],
    lock: threading.Lock,
    limits: _Limits,
    term: _Termination,
) -> tuple[int, list[tuple[int, int]]]:
    """Start one process per environment and watch them: `(exit code, failures)`, where
    `failures` are the `(rank, status)` that ended a failed run, the cause first
    (empty: success, timeout or termination, none of which is restarted)."""
    children: list[_Child] = []
    try:
        for rank, child_environment in enumerate(environments):
            children.append(_Child(rank, command, child_environment, lock))
        return _watch(children, lock, limits, term)
    except BaseException:
        _stop(children)
        raise


def _watch(
    children: list[_Child], lock: threading.Lock, limits: _Limits, term: _Termination
) -> tuple[int, list[tuple[int, int]]]:
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for child in children:
        threading.Thread(target=lambda c=child: exits.put((c.rank, c.proc.wait())), daemon=True).start()
    codes: dict[int, int] = {}
    while True:
        if term.received.is_set():
            return _terminate(children, exits, codes, lock, limits.grace), []
        try:
            rank, code = exits.get(timeout=_POLL_S)
        except queue.Empty:
            if limits.timeout is not None and time.monotonic() - limits.start > limits.timeout:
                _stop(children)
                _say(
                    lock,
                    f"the {len(children)} processes did not finish within {limits.timeout:g} s; "
                    "killed them all. Raise the timeout or look for a hang.",
                )
                return 124, []
            continue
        codes[rank] = code
        if code == 0:
            if len(codes) == len(children):
                # Whatever the processes left running (a server they started,
                # say) goes with them.
                _stop(children)
                return 0, []
            continue
        failures = _gather_failures(rank, code, exits)
        rank, code = _cause(failures)
        _stop(children)
        _report(children[rank], code, children, failures, lock)
        return _exit_code(code), [(rank, code)] + [f for f in failures if f[0] != rank]


def _gather_failures(rank: int, code: int, exits: "queue.Queue[tuple[int, int]]") -> list[tuple[int, int]]:
    # A crash often makes its peers fail a moment later (broken connections).
    failures = [(rank, code)]
    time.sleep(_SETTLE_S)
    while not exits.empty():
        other = exits.get()
        if other[1] != 0:
            failures.append(other)
    return failures


def _terminate(
    children: list[_Child],
    exits: "queue.Queue[tuple[int, int]]",
    codes: dict[int, int],
    lock: threading.Lock,
    grace: float,
) -> int:
    """Forward SIGTERM to the running processes, give them `grace` seconds to exit,
    kill what is left; report how each ended. Returns 128 + SIGTERM."""
    running = [c for c in children if c.rank not in codes]
    _say(
        lock,
        f"SIGTERM received: forwarded to the {len(running)} running process(es); waiting up to "
        f"{grace:g} s for them to save and exit.",
    )
    for child in running:
        child.kill(signal.SIGTERM)
    deadline = time.monotonic() + grace
    failed = None
    while len(codes) < len(children) and time.monotonic() < deadline:
        try:
            rank, code = exits.get(timeout=min(_POLL_S, max(0.0, deadline - time.monotonic())))
        except queue.Empty:
            continue
        codes[rank] = code
        if code != 0:
            # Its peers may now wait on it in a collective: no use waiting for them.
            failed = rank
            time.sleep(_SETTLE_S)
            while not exits.empty():
                other = exits.get()
                codes[other[0]] = other[1]
            break
    late = ", ".join(str(c.rank) for c in children if c.rank not in codes)
    _stop(children, term_grace=0.0)
    ended = ", ".join(f"rank {c.rank} {_describe(codes[c.rank])}" for c in children if c.rank in codes)
    why = (
        f"did not exit within {grace:g} s"
        if failed is None
        else f"were still running after rank {failed} failed"
    )
    killed = f"; rank(s) {late} {why} and were killed (SIGKILL)" if late else ""
    _say(lock, f"stopped by SIGTERM: {ended or 'no process exited by itself'}{killed}.")
    return 128 + signal.SIGTERM


def _cause(failures: list[tuple[int, int]]) -> tuple[int, int]:
    """The failure, among `(rank, code)` that came together, that caused the others.

    The first to arrive, unless another process was killed by a signal other than
    SIGABRT: a kill from outside is a cause, while SIGABRT is how JAX ends a
    process whose peer died ("Terminating process because the JAX distributed
    service detected fatal errors"), and so a consequence.
    """
    killed = [f for f in failures if f[1] < 0 and -f[1] != signal.SIGABRT]
    return killed[0] if killed else failures[0]


def _stop(children: list[_Child], *, term_grace: float = _TERM_GRACE_S) -> None:
    alive = [c for c in children if c.proc.poll() is None]
    if term_grace > 0:
        for child in alive:
            child.kill(signal.SIGTERM)
    deadline = time.monotonic() + term_grace
    for child in alive:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        # The group may hold grandchildren even after the child itself is gone
        # (a child that already exited included).
        child.kill(signal.SIGKILL)
        child.proc.wait()
        child.finish_output(5.0)


def _report(
    child: _Child, code: int, children: list[_Child], failures: list[tuple[int, int]], lock: threading.Lock
) -> None:
    tail = "\n".join(f"    {line}" for line in child.tail) or "    (no output)"
    also = "".join(
        f" Rank {rank} also {_describe(c)} at about the same time."
        for rank, c in failures
        if rank != child.rank
    )
    with lock:
        sys.stderr.write(
            f"eqxpar.launch: rank {child.rank} (pid {child.proc.pid}) {_describe(code)}; "
            f"stopped the other {len(children) - 1} process(es).{also} "
            f"Last lines of rank {child.rank}'s output:\n{tail}\n"
        )
        sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: `python -m eqxpar.launch -n N [--devices-per-process D] [--timeout S]
    [--max-restarts R] [--grace-period G] script.py [args...]`.

    **Returns:** the exit code of `run` (0 when every process succeeded).

    ```python
    sys.exit(eqxpar.launch.main(["-n", "2", "--devices-per-process", "4", "train.py"]))
    ```
    """
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m eqxpar.launch",
        description="Run a JAX script as N processes on this machine (simulated CPU devices "
        "unless JAX_PLATFORMS names another platform), "
        "streaming their output; if one fails, all are stopped (and, with --max-restarts, "
        "started again). SIGTERM is forwarded to the processes, which get --grace-period "
        "seconds to save and exit.",
    )
    parser.add_argument("-n", "--processes", type=int, required=True, help="number of processes")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=1,
        help="devices per process: simulated CPU devices, or GPUs with JAX_PLATFORMS=cuda (default 1)",
    )
    parser.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="start the whole job again after a failure, up to this many times (default 0)",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=DEFAULT_GRACE_PERIOD_S,
        help="seconds the processes have to exit after a forwarded SIGTERM, before SIGKILL "
        f"(default {DEFAULT_GRACE_PERIOD_S:g})",
    )
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    options = parser.parse_args(argv)
    try:
        # run() itself handles SIGTERM: it forwards it to the processes.
        return run(
            options.script,
            options.args,
            processes=options.processes,
            devices_per_process=options.devices_per_process,
            timeout=options.timeout,
            max_restarts=options.max_restarts,
            grace_period=options.grace_period,
        )
    except DistributedError as e:
        parser.error(str(e))
    except KeyboardInterrupt:
        return 130
