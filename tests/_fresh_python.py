"""Run a script or a code block as a fresh interpreter would, without paying for
the imports each time.

The docs blocks and the examples each ran in a new `python` process, and ~2.3 s
of each went to importing JAX, Equinox, optax and eqxpar before their own work:
~150 s of the suite's time. Here a fork server (one per pytest worker) imports
those once, without starting a JAX backend, and each run is a fork of it: a
process of its own, with its own environment (XLA reads XLA_FLAGS when the first
backend starts, after the fork), working directory, argv, exit status and
output, and nothing left from an earlier run (each fork starts from the server's
state, never from another run's).

`run(...)` returns a `subprocess.CompletedProcess`, as `subprocess.run` did.
"""

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from typing import Any

# Heavy, and imported by nearly every block and example; none starts a backend.
PRELOAD = ["jax", "jax.numpy", "equinox", "optax", "numpy", "eqxpar", "eqxpar.models", "eqxpar.pipeline"]

_context: Any = None


def _server() -> Any:
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def _child(kind: str, what: str, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    # In the fork: become the process `python <script> <argv>` / `python -c <code>`
    # would have been.
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        handle = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    sys.stdin = open(os.devnull)  # noqa: SIM115
    status = 0
    try:
        if kind == "script":
            sys.argv = [what, *argv]
            sys.path.insert(0, os.path.dirname(what))
            runpy.run_path(what, run_name="__main__")
        else:
            sys.argv = ["-c", *argv]
            sys.path.insert(0, "")
            exec(compile(what, "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as python reports it, status 1
        traceback.print_exc()
        status = 1
    # What an interpreter does at exit (multiprocessing's child skips it).
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run(
    *,
    script: str | None = None,
    code: str | None = None,
    argv: list[str] = (),
    cwd: Any,
    env: dict,
    timeout: float,
) -> subprocess.CompletedProcess:
    """`python script *argv` (or `python -c code`) in `cwd` with environment `env`,
    forked from the pre-imported server; stdout and stderr captured as text."""
    kind, what = ("script", script) if script is not None else ("code", code)
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        process = _server().Process(
            target=_child, args=(kind, what, list(argv), str(cwd), dict(env), out, err), daemon=True
        )
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([what], timeout)
        with open(out) as f_out, open(err) as f_err:
            stdout, stderr = f_out.read(), f_err.read()
    return subprocess.CompletedProcess([sys.executable, what, *argv], process.exitcode, stdout, stderr)
