"""Measurements: interleaved step timing, collective bytes, memory, parity."""

import argparse
import json
import math
import pathlib
import resource
import shlex
import statistics
import sys
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


class EqxparRunner:
    """Runs an eqxpar step over pre-placed batches, one per step, in order, keeping
    the first step's loss and gradients on the host (`first_loss`, `first_grads`)."""

    def __init__(self, step: Any, plan: eqxpar.Plan, model: Any, optim: Any, batches: Sequence):
        self.step, self.done, self.loss = step, 0, None
        self.state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
        # Placed up front so the timed steps measure the step, not host-to-device copies.
        self.batches = [eqxpar.shard_batch(b, plan) for b in batches]

    def __call__(self) -> PyTree:
        self.state, metrics = self.step(self.state, self.batches[self.done])
        self.done += 1
        self.loss = metrics["loss"]
        if self.done == 1:  # copied to the host now: the next step donates these buffers
            self.first_loss, self.first_grads = np.asarray(self.loss), adam_gradients(self.state.opt_state)
        return eqx.filter((self.state, metrics), eqx.is_array)

    def compile(self) -> jax.stages.Compiled:
        return self.step.compile(self.state, self.batches[0])

    def params(self) -> PyTree:
        return eqx.filter(self.state.model, eqx.is_inexact_array)


class BaselineRunner:
    """Runs a hand-written step (`_baseline.OwnStateStep`) over the same batches, placed
    in its own sharding, round and round (a reference may be shared by many points)."""

    def __init__(self, step: OwnStateStep, batches: Sequence):
        self.step, self.done = step, 0
        self.batches = [step.put_batch(b) for b in batches]

    def __call__(self) -> PyTree:
        loss = self.step(self.batches[self.done % len(self.batches)])
        self.done += 1
        return (self.step.params, self.step.opt_state, loss)

    def compile(self) -> jax.stages.Compiled:
        return self.step.compile(self.batches[0])


def timed_steps(
    sides: dict[str, Callable[[], PyTree]], *, warm: int, timed: int
) -> dict[str, dict[str, float]]:
    """Per side, medians over `timed` steps (after `warm` untimed steps per side) of
    the wall seconds (`step_time_s`) and of what the process asked of the kernel
    meanwhile (`resource.getrusage`): minor page faults (`step_minor_faults`) and
    system CPU seconds (`step_system_cpu_s`). The sides take turns one step at a
    time, so that the noise of shared CPU cores hits them alike: only ratios taken
    in one process mean anything."""
    seen: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
    for i in range(warm + timed):
        for name, side in sides.items():
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            jax.block_until_ready(side())
            wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            if i >= warm:
                seen[name].append(
                    (wall, after.ru_minflt - before.ru_minflt, after.ru_stime - before.ru_stime)
                )
    fields = ("step_time_s", "step_minor_faults", "step_system_cpu_s")
    return {
        name: {
            field: statistics.median(column)
            for field, column in zip(fields, zip(*steps, strict=True), strict=True)
        }
        for name, steps in seen.items()
    }


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device argument and temporary bytes of a compiled step."""
    m = compiled.memory_analysis()
    return {"mem_argument_bytes": int(m.argument_size_in_bytes), "mem_temp_bytes": int(m.temp_size_in_bytes)}


def step_fields(compiled: jax.stages.Compiled, least: eqxpar.inspect.Minimum) -> dict[str, Any]:
    """A compiled step's collectives (result bytes, counts and wire bytes by kind that
    occurs, and in all, per device) and memory beside the library's minimum `least`."""
    stats = eqxpar.inspect.collective_stats(compiled)
    kinds = [k for k in stats.count if stats.count[k]]
    by_kind = {"comm_bytes": stats.bytes, "comm_counts": stats.count, "comm_wire_bytes": stats.wire_bytes}
    return {
        **{field: {k: counter[k] for k in kinds} for field, counter in by_kind.items()},
        **memory(compiled),
        "comm_bytes_total": stats.total_bytes,
        "comm_wire_bytes_total": stats.total_wire_bytes,
        "comm_bytes_min": least.total_bytes,
        "comm_wire_bytes_min": least.total_wire_bytes or 0,
    }


def _pairs(got: PyTree, want: PyTree) -> list[tuple[np.ndarray, np.ndarray]]:
    leaves = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    return [(np.asarray(a, np.float64), np.asarray(b, np.float64)) for a, b in leaves]


def max_rel_err(got: PyTree, want: PyTree) -> float:
    """Max over leaves of max|got - want| / max(max|want|, floor), `floor` 1e-3 of the
    largest magnitude in the whole reference: a leaf whose exact value is zero (an
    attention key bias: softmax ignores it) holds pure rounding, whose ratio to itself
    says nothing; against a thousandth of the tree's scale it is judged as what it is."""
    pairs = _pairs(got, want)
    floor = max(1e-3 * max(float(np.max(np.abs(b))) for _, b in pairs), 1e-30)
    return max(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor)) for a, b in pairs)


def norm_rel_err(got: PyTree, want: PyTree) -> float:
    """||got - want|| / ||want|| over the whole tree: the gradient's error as one vector,
    which leaves of pure rounding noise cannot dominate."""
    pairs = _pairs(got, want)
    diff = sum(float(np.sum((a - b) ** 2)) for a, b in pairs)
    return math.sqrt(diff) / max(math.sqrt(sum(float(np.sum(b**2)) for _, b in pairs)), 1e-30)


def adam_gradients(opt_state: PyTree, *, b1: float = ADAM_B1) -> PyTree:
    """The gradients of the first step, as float64 host arrays, from AdamW's state after it.

    From zero, Adam's first moment after one step is `(1 - b1) * g` (one float32
    multiply), so dividing by `1 - b1` gives the compiled step's own gradient to
    within two roundings, with no second program to compile.
    """
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)  # noqa: E731
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]
    if len(found) != 1:
        raise ValueError(f"adam_gradients: expected one AdamW state, found {len(found)}")
    if int(found[0].count) != 1:
        raise ValueError(f"adam_gradients: the AdamW state is {int(found[0].count)} steps old, not 1")
    scale = np.float64(np.float32(1 - b1))
    return jax.tree.map(lambda m: np.asarray(m, np.float64) / scale, found[0].mu)


def parser(prog: str, doc: str, quick: tuple[int, int]) -> argparse.ArgumentParser:
    """The options every measuring benchmark takes: `--json` and `--quick`."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--json", required=True, type=pathlib.Path, help="where to write the results")
    parser.add_argument(
        "--quick", action="store_true", help=f"{quick[0]} warm + {quick[1]} timed steps a side"
    )
    return parser


def header(prog: str, argv: Sequence[str] | None, *, warm: int, timed: int) -> dict[str, Any]:
    """What every benchmark JSON starts with: versions, devices, workload, timing, command
    (printed); exits unless jax sees the 8 simulated devices."""
    if jax.device_count() != 8:
        sys.exit(f"benchmarks need 8 devices, jax sees {jax.device_count()} (jax imported before?)")
    command = f"{prog} {shlex.join(sys.argv[1:] if argv is None else argv)}"
    print(f"{command}\njax {jax.__version__}, {jax.device_count()} devices", flush=True)
    return {
        "jax": jax.__version__,
        "devices": jax.device_count(),
        "platform": jax.devices()[0].platform,
        "workload": _workload.describe(),
        "timing": {"warm_steps": warm, "timed_steps": timed, "statistic": "median"},
        "command": command,
    }


def write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")
