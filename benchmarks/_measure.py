"""Measurements: interleaved step timing, collective bytes, memory, parity.

Timing interleaves the sides step by step (eqxpar, baseline, eqxpar, ...) so that the
noise of 2 shared CPU cores hits both alike; only ratios taken in one process mean
anything (ANCHORS.md: about +-20 % run to run).
"""

import math
import statistics
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
from ._baseline import JitStep

# Keeps the relative error finite on leaves that are exactly zero in the reference.
_TINY = 1e-30


class EqxparRunner:
    """Runs an eqxpar step over pre-placed batches, one batch per step, in order.

    With `keep_first=True` it keeps, on the host, what the first step computed:
    its loss (`first_loss`) and its gradients (`first_grads`, read back from
    AdamW's first moment by `adam_gradients`), for `step_parity`.
    """

    def __init__(
        self,
        step: eqxpar.train.Step,
        plan: eqxpar.Plan,
        model: Any,
        optim: Any,
        batches: Sequence,
        *,
        keep_first: bool = False,
    ):
        self.step = step
        self.state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
        # Placed up front so the timed steps measure the step, not host-to-device copies.
        self.batches = [eqxpar.shard_batch(b, plan) for b in batches]
        self.done = 0
        self.loss: jax.Array | None = None
        self.keep_first = keep_first
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
    """Runs a hand-written `JitStep` over the same batches, placed in its own sharding."""

    def __init__(self, step: JitStep, batches: Sequence):
        self.step = step
        self.batches = [step.put_batch(b) for b in batches]
        self.done = 0

    def __call__(self) -> PyTree:
        loss = self.step(self.batches[self.done])
        self.done += 1
        return (self.step.params, self.step.opt_state, loss)

    def compile(self) -> jax.stages.Compiled:
        return self.step.compile(self.batches[0])

    def params(self) -> PyTree:
        return self.step.params


def time_interleaved(sides: Sequence[Callable[[], PyTree]], *, warm: int, timed: int) -> list[list[float]]:
    """Wall seconds of each of `timed` steps per side, after `warm` untimed steps per side.

    The sides take turns one step at a time, each step waited for to completion
    (`block_until_ready` on everything it returns) before the next starts.
    """
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


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def comm(compiled: jax.stages.Compiled) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """Collective result bytes, counts and wire bytes by kind, per device (kinds that occur only)."""
    stats = eqxpar.inspect.collective_stats(compiled)
    kinds = [k for k in stats.count if stats.count[k]]
    return (
        {k: int(stats.bytes[k]) for k in kinds},
        {k: int(stats.count[k]) for k in kinds},
        {k: int(stats.wire_bytes[k]) for k in kinds},
    )


def memory(compiled: jax.stages.Compiled) -> tuple[int, int]:
    """Per-device argument and temporary bytes of a compiled step."""
    analysis = compiled.memory_analysis()
    return int(analysis.argument_size_in_bytes), int(analysis.temp_size_in_bytes)


def max_rel_err(got: PyTree, want: PyTree) -> float:
    """Max over leaves of max|got - want| / max(max|want|, floor): the error relative
    to each leaf's scale.

    `floor` is 1e-3 of the largest magnitude in the whole reference tree. A leaf
    whose exact value is zero (an attention *key* bias: softmax ignores it) holds
    pure rounding, ~1e-11 here, whose ratio to itself says nothing; against a
    thousandth of the tree's scale it is judged as what it is.
    """
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"parity: {len(got_leaves)} leaves against {len(want_leaves)} in the reference")
    scale = max((float(np.max(np.abs(np.asarray(b, np.float64)))) for b in want_leaves), default=0.0)
    floor = max(1e-3 * scale, _TINY)
    worst = 0.0
    for a, b in zip(got_leaves, want_leaves, strict=True):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            raise ValueError(f"parity: shape {a.shape} against {b.shape} in the reference")
        worst = max(worst, float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor)))
    return worst


def norm_rel_err(got: PyTree, want: PyTree) -> float:
    """||got - want|| / ||want|| over the whole tree (2-norm of all leaves together):
    the error of the gradient as one vector, which leaves of pure rounding noise
    (exactly zero in the reference's math) cannot dominate."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    if len(got_leaves) != len(want_leaves):
        raise ValueError(f"parity: {len(got_leaves)} leaves against {len(want_leaves)} in the reference")
    diff = sum(
        float(np.sum((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))
        for a, b in zip(got_leaves, want_leaves, strict=True)
    )
    ref = sum(float(np.sum(np.asarray(b, np.float64) ** 2)) for b in want_leaves)
    return math.sqrt(diff) / max(math.sqrt(ref), _TINY)


def adam_gradients(opt_state: PyTree, *, b1: float = _workload.ADAM_B1) -> PyTree:
    """The gradients of the first step, read back from AdamW's state after it.

    From zero, Adam's first moment after one step is `mu = (1 - b1) * g` (one float32
    multiply), so `mu / (1 - b1)` is the step's own gradient to within two roundings
    (~1e-7 relative): the gradients the compiled step used, with no second program
    to compile. Raises if the state is not exactly one step past its init.

    Returns the gradients as float64 host arrays, shaped like the parameters.
    """
    found = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    if len(found) != 1:
        raise ValueError(
            f"adam_gradients: expected one AdamW state in the optimizer state, found {len(found)}"
        )
    (adam,) = found
    if int(adam.count) != 1:
        raise ValueError(f"adam_gradients: the AdamW state is {int(adam.count)} steps old, not 1")
    scale = np.float64(np.float32(1 - b1))
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / scale, adam.mu)


def reference_gradients(loss_fn: Callable, model: Any, batch: PyTree) -> tuple[jax.Array, PyTree]:
    """`eqx.filter_value_and_grad(loss_fn)` of `model` on `batch`, on one device."""
    device = jax.devices()[0]
    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(
        jax.device_put(model, device), jax.device_put(batch, device)
    )


def step_parity(
    runner: EqxparRunner,
    reference: tuple[jax.Array, PyTree],
    *,
    convert: Callable[[Any], Any],
) -> tuple[float, float, float]:
    """Loss and gradient error of the first step `runner` ran against one device.

    The contract (DESIGN.md, parity) is about the loss and gradients a step computes:
    here they are the compiled step's own, from its first call (`keep_first=True`;
    the gradients via `adam_gradients`), at the initial parameters
    `convert(workload_model)` on the runner's first batch. `reference` is
    `reference_gradients` of the plain workload model at those weights on that batch;
    its gradients are mapped by `convert` (a pure re-layout).

    Returns `(loss_rel_err, grads_max_rel_err, grads_norm_rel_err)`.
    """
    if runner.first_grads is None:
        raise ValueError("step_parity: the runner kept no first step (keep_first=True, then run it)")
    ref_loss, ref_grads = reference
    ref_grads = eqx.filter(convert(ref_grads), eqx.is_inexact_array)
    grads = runner.first_grads
    return (
        max_rel_err(runner.first_loss, ref_loss),
        max_rel_err(grads, ref_grads),
        norm_rel_err(grads, ref_grads),
    )


def invert(convert: Callable[[Any], Any], model: Any, template: Any = None) -> Any:
    """The workload model `w` with `convert(w) == model`, shaped like `template`
    (default: `_workload.make_model()`)."""
    # `convert` only moves and reshapes weights: a permutation, whose inverse is its
    # transpose, i.e. its VJP. Pulling `model` back through it gives the workload
    # model with the same weights.
    template = _workload.make_model() if template is None else template
    _, pullback = jax.vjp(lambda w: convert(w), eqx.filter(template, eqx.is_inexact_array))
    (weights,) = pullback(eqx.filter(model, eqx.is_inexact_array))
    return eqx.combine(weights, eqx.filter(template, eqx.is_inexact_array, inverse=True))


def run_header(command: str, *, warm: int, timed: int) -> dict[str, Any]:
    """What every benchmark JSON starts with: versions, devices, the workload, the
    timing protocol and the command that made it."""
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
