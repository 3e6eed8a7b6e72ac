"""Stopping a training loop, on every process at the same step, when the job is told to stop.

A scheduler announces preemption (or the end of a time limit) with SIGTERM, then
kills the job a grace period later. To save a checkpoint every process can restore,
all processes must save the same step: one that got the signal cannot just stop,
since its peers would wait on it in their next collective. In a multi-process run
JAX's preemption service agrees on that step out of band (through the coordination
service, not a device collective, so a step costs no extra synchronisation); alone,
a SIGTERM handler is enough.
"""

import signal
import threading
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from ._distributed import DistributedError


class PreemptionGuard:
    """Tells the training loop when to save and stop, at a step all processes agree on.

    Make one after `eqxpar.distributed.initialize(preemption_service=True)` and
    call `should_stop(step)` once after every training step, on every process,
    with the step just finished. When the job gets SIGTERM (from
    `eqxpar.launch`, which forwards its own, from Slurm or Kubernetes, or sent to
    any one process), `should_stop` returns True on every process at the same
    step, a step or a few after the signal: save a checkpoint of that step, wait
    for it, and exit 0. A rerun resumes from it exactly.

    In a multi-process run this is JAX's preemption sync point
    (`jax.experimental.multihost_utils.reached_preemption_sync_point`), which
    needs the preemption service started by `initialize(preemption_service=True)`;
    the service takes SIGTERM over, so the loop must ask the guard, or the
    process ignores SIGTERM. A process that runs alone catches SIGTERM with a
    Python handler instead (restored by `close()`). JAX's service notices the
    signal within about a second; leave the grace period room for that and for
    the save.

    **Raises:** `DistributedError` in a multi-process run started without the
    preemption service, or, alone, when made outside the main thread (Python
    handles signals there only).

    ```python
    guard = eqxpar.distributed.PreemptionGuard()
    while int(state.step) < steps:
        state, metrics = step(state, eqxpar.data.global_batch(next(batches), plan))
        stop = guard.should_stop(int(state.step))
        if stop or int(state.step) % save_every == 0:
            manager.save(int(state.step), state, data_state=batches.get_state())
        if stop:
            break
    manager.close()                  # waits for the save; then exit 0
    ```
    """

    def __init__(self) -> None:
        self._last: int | None = None
        self._stop_step: int | None = None
        self._requested = threading.Event()
        self._previous: Any = None
        self._handler_installed = False
        self._joined = jax.distributed.is_initialized()
        if self._joined:
            if not jax.config.jax_enable_preemption_service:
                raise DistributedError(
                    "PreemptionGuard() in a multi-process run needs JAX's preemption service, "
                    "which agrees on the step every process stops at; it was not started. Call "
                    "eqxpar.distributed.initialize(preemption_service=True) at the start of "
                    "the program."
                )
            return
        if threading.current_thread() is not threading.main_thread():
            raise DistributedError(
                "PreemptionGuard() in a process that runs alone catches SIGTERM with a Python "
                "signal handler, which only the main thread can install. Make the guard in the "
                "main thread."
            )
        self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._handler_installed = True

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._requested.set()

    def should_stop(self, step: int) -> bool:
        """Whether the job is to stop after `step`: True on every process at the same step.

        Call it once per training step, on every process, with increasing steps
        (the step just finished, e.g. `int(state.step)`); the processes agree on
        the step by counting these calls. Once True, it stays True.

        **Arguments:**

        - `step`: the step just finished (>= 0, larger than the previous call's).

        **Returns:** True when this process, and every other, should save `step`
        and stop.

        **Raises:** `DistributedError` for a step that is not an integer larger
        than the previous one.

        ```python
        if guard.should_stop(int(state.step)):
            manager.save(int(state.step), state, data_state=batches.get_state())
        ```
        """
        if not isinstance(step, int | np.integer) or isinstance(step, bool) or step < 0:
            raise DistributedError(f"PreemptionGuard.should_stop(step={step!r}): expected an integer >= 0.")
        step = int(step)
        if self._stop_step is not None:
            return True
        if self._last is not None and step <= self._last:
            raise DistributedError(
                f"PreemptionGuard.should_stop(step={step}) after step {self._last}: call it once per "
                "training step, with increasing steps (the step just finished), on every process."
            )
        self._last = step
        if self._joined:
            reached = multihost_utils.reached_preemption_sync_point(step)
        else:
            reached = self._requested.is_set()
        if reached:
            self._stop_step = step
        return reached

    @property
    def stop_step(self) -> int | None:
        """The step at which `should_stop` first returned True (None until then)."""
        return self._stop_step

    def close(self) -> None:
        """Put back the SIGTERM handler the guard replaced (alone; in a multi-process
        run JAX's service keeps SIGTERM until the run ends). Also on `with` exit.

        ```python
        with eqxpar.distributed.PreemptionGuard() as guard:
            ...
        ```
        """
        if self._handler_installed:
            self._handler_installed = False
            # A handler installed from C reads as None; the default is the closest.
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._previous is None else self._previous)

    def __enter__(self) -> "PreemptionGuard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "JAX preemption service" if self._joined else "SIGTERM handler"
        return f"PreemptionGuard({mode}, stop_step={self._stop_step})"
