"""Step throughput and model FLOPs utilisation (MFU), measured by the training loop."""

import math
import time
from collections.abc import Callable
from typing import Any

import jax

# The profile module itself, not the advisor package: the advisor imports eqxpar.train.
from ._advise._profile import PROFILES, DeviceProfile
from ._errors import PlanError


def _positive(name: str, value: Any, *, integer: bool) -> None:
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value <= 0:
        what = "a positive integer" if integer else "a positive number"
        raise PlanError(f"Throughput({name}={value!r}): expected {what}.")


class Throughput:
    """Tokens per second and MFU of a training loop, one `tick` per step.

    MFU (model FLOPs utilisation) is the model FLOPs a step needs
    (`flops_per_token x tokens`, e.g. `eqxpar.models.flops_per_token`) per second,
    over the devices' dense peak FLOP/s (`DeviceProfile.peak`): the share of the
    hardware the training does useful work with. Recomputation does not raise it;
    a pipeline's bubble, communication and idle time lower it.

    *Timing an asynchronous step.* JAX dispatches a step and returns before the
    devices have run it, so a clock read right after `step(...)` times the
    dispatch. `tick(*outputs)` first waits for what it is given
    (`jax.block_until_ready`), then reads the clock: pass the step's outputs. The
    loss is ready once the forward and backward passes are; the step's optimizer
    update may still run, and lands in the next step's interval, which in a steady
    loop times the same work. Pass the new state too to wait for everything.

    Each `tick` times the interval since the previous one: the step plus whatever
    the loop does between steps (fetching a batch, logging), which is what the
    loop's throughput is. Call `start()` just before a step to leave out what ran
    since the last tick (an evaluation, a checkpoint). The first `warmup` ticks
    (the first step compiles) are timed but not counted: `warmup_seconds` keeps
    them.

    **Arguments** (keyword-only):

    - `tokens_per_step`: tokens one step trains on, over all devices (global
      batch x sequence length).
    - `flops_per_token`: model FLOPs per token of a training step (forward and
      backward), e.g. `eqxpar.models.flops_per_token(config, seq_len=...)`.
    - `device`: an `eqxpar.DeviceProfile` or a name in `eqxpar.DEVICE_PROFILES`,
      whose `peak(dtype)` is the per-device peak. For `"cpu"` (no published peak)
      that is the measured matmul rate: `peak_is_measured` says so.
    - `devices`: devices the step runs on (default `jax.device_count()`, every
      process's). Simulated CPU devices share one CPU, whose whole measured rate
      is the `"cpu"` profile's: pass 1 there.
    - `dtype`: the dtype the matmuls run in (default `"bfloat16"`).
    - `warmup`: ticks not counted, from the first (default 1: the compiling step).
    - `clock`: seconds since some fixed point (default `time.perf_counter`).

    ```python
    meter = eqxpar.train.Throughput(
        tokens_per_step=batch_size * seq_len,
        flops_per_token=eqxpar.models.flops_per_token(config, seq_len=seq_len),
        device="h100", dtype="bfloat16",
    )
    for batch in batches:
        state, metrics = step(state, batch)
        now = meter.tick(metrics["loss"])   # None for the compiling step
    print(meter.summary())                  # {"tokens_per_s": ..., "mfu": ..., ...}
    ```
    """

    def __init__(
        self,
        *,
        tokens_per_step: int,
        flops_per_token: int | float,
        device: DeviceProfile | str,
        devices: int | None = None,
        dtype: Any = "bfloat16",
        warmup: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ):
        _positive("tokens_per_step", tokens_per_step, integer=True)
        _positive("flops_per_token", flops_per_token, integer=False)
        if isinstance(device, str) and device in PROFILES:
            device = PROFILES[device]
        if not isinstance(device, DeviceProfile):
            raise PlanError(
                f"Throughput(device={device!r}): expected an eqxpar.DeviceProfile or one of "
                f"{sorted(PROFILES)}. Build an eqxpar.DeviceProfile with peak_flops_per_s for other "
                "hardware."
            )
        devices = jax.device_count() if devices is None else devices
        _positive("devices", devices, integer=True)
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise PlanError(
                f"Throughput(warmup={warmup!r}): expected an integer >= 0 (the first ticks, which "
                "time compilation, left out), e.g. 1."
            )
        if not callable(clock):
            raise PlanError(f"Throughput(clock={clock!r}): expected a function returning seconds.")
        self.tokens_per_step, self.flops_per_token = tokens_per_step, flops_per_token
        self.profile, self.devices, self.dtype, self.warmup = device, devices, dtype, warmup
        #: Per-device peak FLOP/s (raises for a dtype the profile has no peak for).
        self.peak_flops_per_s = device.peak(dtype)
        #: True where the profile publishes no peak and MFU is against a measured rate.
        self.peak_is_measured = device.peak_flops_per_s is None
        self.steps, self.seconds = 0, 0.0
        self.warmup_seconds: list[float] = []
        self._clock = clock
        self._last = clock()

    def start(self) -> None:
        """Restart the clock: the next `tick` times from now (leave out an
        evaluation or a checkpoint that ran since the last tick)."""
        self._last = self._clock()

    def tick(self, *outputs: Any) -> dict[str, float] | None:
        """Wait for `outputs`, then time the step since the last tick (or `start`).

        **Arguments:** `outputs`: what the step returned (arrays or pytrees of them,
        at least one array), e.g. `metrics["loss"]`, or `state, metrics`.

        **Returns:** `None` for the first `warmup` ticks; then this step's
        `metrics(seconds)`.

        ```python
        state, metrics = step(state, batch)
        now = meter.tick(metrics["loss"])
        ```
        """
        if not any(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(outputs)):
            given = ", ".join(type(x).__name__ for x in outputs) or "nothing"
            raise PlanError(
                f"Throughput.tick(): given {given}, no JAX array to wait for, "
                "so the clock would time only the dispatch of an asynchronous step. Pass the step's "
                "outputs, e.g. meter.tick(metrics['loss'])."
            )
        jax.block_until_ready(outputs)
        now = self._clock()
        seconds, self._last = now - self._last, now
        if len(self.warmup_seconds) < self.warmup:
            self.warmup_seconds.append(seconds)
            return None
        self.steps += 1
        self.seconds += seconds
        return self.metrics(seconds)

    def metrics(self, seconds: float, steps: int = 1) -> dict[str, float]:
        """The rates of `steps` steps that took `seconds` in all.

        **Returns:** a dict of floats: `step_seconds` (per step), `tokens_per_s`,
        `tokens_per_s_per_device`, `model_flops_per_s` (all devices) and `mfu`
        (`model_flops_per_s / (devices x peak_flops_per_s)`, a fraction).

        ```python
        meter.metrics(0.5)["mfu"]  # the MFU of one step of half a second
        ```
        """
        if not (seconds > 0) or isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise PlanError(
                f"Throughput.metrics(seconds={seconds!r}, steps={steps!r}): expected positive seconds "
                "and an integer >= 1 of steps."
            )
        tokens_per_s = self.tokens_per_step * steps / seconds
        flops_per_s = tokens_per_s * self.flops_per_token
        return {
            "step_seconds": seconds / steps,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_device": tokens_per_s / self.devices,
            "model_flops_per_s": flops_per_s,
            "mfu": flops_per_s / (self.devices * self.peak_flops_per_s),
        }

    def summary(self) -> dict[str, float]:
        """`metrics` over every counted step (total tokens over total time), plus
        `steps`, the number counted.

        Raises `PlanError` before the first counted tick.

        ```python
        s = meter.summary()
        print(f"{s['tokens_per_s']:,.0f} tokens/s, MFU {s['mfu']:.1%}")
        ```
        """
        if not self.steps:
            raise PlanError(
                f"Throughput.summary(): no step counted yet ({len(self.warmup_seconds)} warm-up tick(s) "
                f"of warmup={self.warmup}). Tick at least warmup + 1 times, or build the meter with "
                "warmup=0 to count the first step (compilation included)."
            )
        return {**self.metrics(self.seconds, self.steps), "steps": float(self.steps)}
