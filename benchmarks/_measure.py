"""Measurements: interleaved step timing, collective bytes, memory, parity.

Timing interleaves the sides step by step (eqxpar, baseline, eqxpar, ...) so that
the noise of shared CPU cores hits both alike; only ratios taken in one process
mean anything.
"""

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np
import optax
from jaxtyping import PyTree

import eqxpar

from . import _workload
from ._baseline import OwnStateStep
from ._workload import ADAM_B1

# Keeps the relative error finite on leaves that are exactly zero in the reference.
_TINY = 1e-30


class EqxparRunner:
    """Runs an eqxpar step over pre-placed batches, one per step, in order. With
    `keep_first`, keeps the first step's loss and gradients on the host (`first_loss`,
    `first_grads`, the latter read back from AdamW by `adam_gradients`)."""

    def __init__(
        self, step: Any, plan: eqxpar.Plan, model: Any, optim: Any, batches: Sequence, *, keep_first=False
    ):
        self.step = step
        self.state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
        # Placed up front so the timed steps measure the step, not host-to-device copies.
        self.batches = [eqxpar.shard_batch(b, plan) for b in batches]
        self.done, self.loss, self.keep_first = 0, None, keep_first
        self.first_loss: np.ndarray | None = None
        self.first_grads: PyTree = None

    def __call__(self) -> PyTree:
        self.state, metrics = self.step(self.state, self.batches[self.done])
        self.done += 1
        self.loss = metrics["loss"]
        if self.keep_first and self.done == 1:
            # Copied to the host now: the next step donates these buffers.
            self.first_loss = np.asarray(metrics["loss"])
            self.first_grads = adam_gradients(self.state.opt_state)
        return eqx.filter((self.state, metrics), eqx.is_array)

    def compile(self) -> jax.stages.Compiled:
        return self.step.compile(self.state, self.batches[0])

    def params(self) -> PyTree:
        return eqx.filter(self.state.model, eqx.is_inexact_array)


class BaselineRunner:
    """Runs a hand-written step (`_baseline.OwnStateStep`) over the same batches, placed
    in its own sharding; with `cycle`, round and round (a reference shared by many points)."""

    def __init__(self, step: OwnStateStep, batches: Sequence, *, cycle: bool = False):
        self.step, self.cycle, self.done = step, cycle, 0
        self.batches = [step.put_batch(b) for b in batches]

    def __call__(self) -> PyTree:
        loss = self.step(self.batches[self.done % len(self.batches) if self.cycle else self.done])
        self.done += 1
        return (self.step.params, self.step.opt_state, loss)

    def compile(self) -> jax.stages.Compiled:
        return self.step.compile(self.batches[0])

    def params(self) -> PyTree:
        return self.step.params


def time_interleaved(sides: Sequence[Callable[[], PyTree]], *, warm: int, timed: int) -> list[list[float]]:
    """Wall seconds of each of `timed` steps per side, after `warm` untimed steps per
    side; the sides take turns one step at a time, each waited for to completion."""
    for _ in range(warm):
        for side in sides:
            jax.block_until_ready(side())
    times: list[list[float]] = [[] for _ in sides]
    for _ in range(timed):
        for side, out in zip(sides, times, strict=True):
            start = time.perf_counter()
            jax.block_until_ready(side())
            out.append(time.perf_counter() - start)
    return times


def comm(compiled: jax.stages.Compiled) -> dict[str, dict[str, int]]:
    """Collective result bytes, counts and wire bytes by kind, per device (kinds that occur only)."""
    stats = eqxpar.inspect.collective_stats(compiled)
    kinds = [k for k in stats.count if stats.count[k]]
    return {
        "comm_bytes": {k: int(stats.bytes[k]) for k in kinds},
        "comm_counts": {k: int(stats.count[k]) for k in kinds},
        "comm_wire_bytes": {k: int(stats.wire_bytes[k]) for k in kinds},
    }


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device argument and temporary bytes of a compiled step."""
    analysis = compiled.memory_analysis()
    return {
        "mem_argument_bytes": int(analysis.argument_size_in_bytes),
        "mem_temp_bytes": int(analysis.temp_size_in_bytes),
    }


def _pairs(got: PyTree, want: PyTree) -> list[tuple[np.ndarray, np.ndarray]]:
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"parity: {len(got_leaves)} leaves against {len(want_leaves)} in the reference")
    pairs = [
        (np.asarray(a, np.float64), np.asarray(b, np.float64))
        for a, b in zip(got_leaves, want_leaves, strict=True)
    ]
    for a, b in pairs:
        if a.shape != b.shape:
            raise ValueError(f"parity: shape {a.shape} against {b.shape} in the reference")
    return pairs


def max_rel_err(got: PyTree, want: PyTree) -> float:
    """Max over leaves of max|got - want| / max(max|want|, floor), `floor` 1e-3 of the
    largest magnitude in the whole reference: a leaf whose exact value is zero (an
    attention key bias: softmax ignores it) holds pure rounding, whose ratio to
    itself says nothing; against a thousandth of the tree's scale it is judged as
    what it is."""
    pairs = _pairs(got, want)
    floor = max(1e-3 * max((float(np.max(np.abs(b))) for _, b in pairs), default=0.0), _TINY)
    return max(
        (float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor)) for a, b in pairs), default=0.0
    )


def norm_rel_err(got: PyTree, want: PyTree) -> float:
    """||got - want|| / ||want|| over the whole tree: the error of the gradient as one
    vector, which leaves of pure rounding noise cannot dominate."""
    pairs = _pairs(got, want)
    diff = sum(float(np.sum((a - b) ** 2)) for a, b in pairs)
    return math.sqrt(diff) / max(math.sqrt(sum(float(np.sum(b**2)) for _, b in pairs)), _TINY)


def adam_gradients(opt_state: PyTree, *, b1: float = ADAM_B1) -> PyTree:
    """The gradients of the first step, as float64 host arrays, from AdamW's state after it.

    From zero, Adam's first moment after one step is `(1 - b1) * g` (one float32
    multiply), so dividing by `1 - b1` gives the compiled step's own gradient to
    within two roundings, with no second program to compile. Raises unless the
    state is exactly one step old.
    """
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    if len(found) != 1:
        raise ValueError(
            f"adam_gradients: expected one AdamW state in the optimizer state, found {len(found)}"
        )
    if int(found[0].count) != 1:
        raise ValueError(f"adam_gradients: the AdamW state is {int(found[0].count)} steps old, not 1")
    scale = np.float64(np.float32(1 - b1))
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / scale, found[0].mu)


def reference_gradients(loss_fn: Callable, model: Any, batch: PyTree) -> tuple[jax.Array, PyTree]:
    """`eqx.filter_value_and_grad(loss_fn)` of `model` on `batch`, on one device."""
    device = jax.devices()[0]
    value_and_grad = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))
    return value_and_grad(jax.device_put(model, device), jax.device_put(batch, device))


def step_parity(
    runner: EqxparRunner, reference: tuple[jax.Array, PyTree], convert: Callable
) -> dict[str, float]:
    """The loss and gradients of `runner`'s first step (`keep_first=True`) against
    `reference` (`reference_gradients` of the plain workload at the same weights and
    batch), its gradients mapped by `convert`, a pure re-layout."""
    if runner.first_grads is None:
        raise ValueError("step_parity: the runner kept no first step (keep_first=True, then run it)")
    ref_loss, ref_grads = reference
    ref_grads = eqx.filter(convert(ref_grads), eqx.is_inexact_array)
    loss, grads = max_rel_err(runner.first_loss, ref_loss), max_rel_err(runner.first_grads, ref_grads)
    return {
        "parity_max_rel_err": max(loss, grads),
        "parity_grads_rel_err": grads,
        "parity_loss_rel_err": loss,
        "parity_grads_norm_rel_err": norm_rel_err(runner.first_grads, ref_grads),
    }


def invert(convert: Callable, model: Any, template: Any) -> Any:
    """The workload model `w` shaped like `template` with `convert(w) == model`."""
    # `convert` only moves and reshapes weights: a permutation, whose inverse is its
    # transpose, i.e. its VJP.
    weights, rest = eqx.partition(template, eqx.is_inexact_array)
    _, pullback = jax.vjp(convert, weights)
    return eqx.combine(pullback(eqx.filter(model, eqx.is_inexact_array))[0], rest)


def header(command: str, *, warm: int, timed: int) -> dict[str, Any]:
    """What every benchmark JSON starts with: versions, devices, workload, timing, command."""
    return {
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "workload": _workload.describe(),
        "timing": {
            "warm_steps": warm,
            "timed_steps": timed,
            "statistic": "median",
            "interleaved": "step by step",
        },
        "command": command,
    }
