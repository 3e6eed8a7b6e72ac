"""A profiler trace of a few training steps, for TensorBoard's profile plugin or xprof."""

import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from .._errors import PlanError


def _new_state(out: Any, where: str) -> Any:
    if not isinstance(out, tuple) or not out:
        raise PlanError(
            f"{where}: the step returned {type(out).__name__}; expected a tuple whose first entry is "
            "the new state, as eqxpar.train.make_step's step returns (state, metrics)."
        )
    return out[0]


def _xplanes(directory: pathlib.Path) -> dict[pathlib.Path, int]:
    return {p: p.stat().st_mtime_ns for p in directory.glob("plugins/profile/*/*.xplane.pb")}


def trace(
    step: Callable[[Any, Any], tuple],
    state: Any,
    batch: Any,
    directory: str | os.PathLike,
    *,
    steps: int = 3,
    warmup: int = 1,
) -> tuple[Any, pathlib.Path]:
    """Run `steps` training steps under `jax.profiler.trace` and return the new state
    and the trace file, which TensorBoard's profile plugin and xprof open.

    The `warmup` steps before the trace compile the step, so compilation stays out
    of it; each traced step is marked with a `jax.profiler.StepTraceAnnotation`
    (the step-time view counts them), and the trace ends only once the last step's
    outputs are ready (a step is dispatched asynchronously, so without waiting the
    trace would stop before the devices finish). The step runs `warmup + steps`
    times on the same `batch`; it donates its state, so `state` is consumed: use
    the state returned.

    Open it with `xprof --logdir=<directory>` (`pip install xprof`; then
    `localhost:8791`) or `tensorboard --logdir=<directory>` (`pip install xprof
    tensorboard`; the Profile tab, `localhost:6006/#profile`); the
    `*.trace.json.gz` beside the file opens in Perfetto (ui.perfetto.dev). Writing
    the trace needs neither: `jax.profiler` writes it on every backend, CPU included.

    **Arguments:**

    - `step`: `step(state, batch) -> (state, ...)`, e.g. an `eqxpar.train.make_step`
      step.
    - `state`, `batch`: what the step takes (`batch` reused for every step).
    - `directory`: where the trace goes (created if missing); each call adds a
      run `plugins/profile/<timestamp>/`.
    - `steps`: steps traced (default 3); `warmup`: steps run before (default 1).

    **Returns:** `(state, path)`: the state after every step, and the
    `<host>.xplane.pb` file written.

    ```python
    state, path = eqxpar.inspect.trace(step, state, batch, "/tmp/trace", steps=2)
    print(path)   # /tmp/trace/plugins/profile/<timestamp>/<host>.xplane.pb
    ```
    """
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise PlanError(f"trace({name}={value!r}): expected an integer >= {least}.")
    if not callable(step):
        raise PlanError(f"trace(step={step!r}): expected a function step(state, batch) -> (state, ...).")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for _ in range(warmup):
        state = _new_state(jax.block_until_ready(step(state, batch)), "trace")
    before = _xplanes(directory)
    with jax.profiler.trace(str(directory)):
        for i in range(steps):
            with jax.profiler.StepTraceAnnotation("train", step_num=i):
                out = step(state, batch)
            state = _new_state(out, "trace")
        jax.block_until_ready(out)
    written = [p for p, t in _xplanes(directory).items() if before.get(p) != t]
    if len(written) != 1:
        raise RuntimeError(
            f"trace: expected jax.profiler to write one new *.xplane.pb under {directory}/plugins/profile, "
            f"found {sorted(map(str, written))}."
        )
    return state, written[0]
