"""Measurements: the hand-written `jax.jit` steps eqxpar is measured against, interleaved
step timing, collective bytes, memory, parity (benchmarks/README.md)."""

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
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import PyTree

import eqxpar

from . import _workload


def train_step(loss_fn: Callable, optim: optax.GradientTransformation) -> Callable:
    """`(params, opt_state, batch) -> (params, opt_state, loss)`: one optax step of `loss_fn`."""

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optim.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


class OwnStateStep:
    """`step(params, opt_state, batch)` jitted on `mesh` with the shardings of `specs`, `opt_specs`
    and `batch_spec`, holding its own (donated) copy of `params` and their optimizer state."""

    def __init__(self, step, optim, params, mesh: Mesh, specs, opt_specs, batch_spec):
        state = jax.tree.map(lambda s: NamedSharding(mesh, s), (specs, opt_specs), is_leaf=is_spec)
        self.batch_sharding = NamedSharding(mesh, batch_spec)
        # Copy inside jit: fresh buffers owned by this step, created in their sharding.
        place = jax.jit(lambda p: (jax.tree.map(jnp.copy, p), optim.init(p)), out_shardings=state)
        self.params, self.opt_state = place(params)
        loss = NamedSharding(mesh, PartitionSpec())
        in_out = {"in_shardings": (*state, self.batch_sharding), "out_shardings": (*state, loss)}
        self.jitted = jax.jit(step, donate_argnums=(0, 1), **in_out)

    def put_batch(self, batch: PyTree) -> PyTree:
        return jax.device_put(batch, self.batch_sharding)

    def __call__(self, batch: PyTree) -> jax.Array:
        """One step on an already placed batch; returns the loss."""
        self.params, self.opt_state, loss = self.jitted(self.params, self.opt_state, batch)
        return loss

    def compile(self, batch: PyTree) -> jax.stages.Compiled:
        return self.jitted.lower(self.params, self.opt_state, batch).compile()


class JitStep(OwnStateStep):
    """A `jax.jit` train step of `loss_fn` on `model` (copied), laid out by `param_specs` (one spec, or
    a pytree), `opt_state_specs` (default: `param_specs`) and `batch_spec` (every batch leaf)."""

    def __init__(self, loss_fn, optim, model, mesh, *, param_specs, batch_spec, opt_state_specs=None):
        params, static = eqx.partition(model, eqx.is_inexact_array)
        step = train_step(lambda p, batch: loss_fn(eqx.combine(p, static), batch), optim)
        opt_state_specs = param_specs if opt_state_specs is None else opt_state_specs
        super().__init__(step, optim, params, mesh, param_specs, opt_state_specs, batch_spec)


def opt_specs(optim: optax.GradientTransformation, model: Any, param_specs: Any) -> Any:
    """Optimizer-state specs mirroring `param_specs` (moments shaped like the parameters)."""
    params = eqx.filter(model, eqx.is_inexact_array)
    params_def = jax.tree.structure(params)
    specs = jax.tree.unflatten(params_def, jax.tree.leaves(param_specs, is_leaf=is_spec))
    is_params = lambda node: jax.tree.structure(node) == params_def  # noqa: E731
    for_node = lambda node: specs if is_params(node) else PartitionSpec()  # noqa: E731
    return jax.tree.map(for_node, jax.eval_shape(optim.init, params), is_leaf=is_params)


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
    """Runs a hand-written step (`OwnStateStep`) over the same batches, placed in its own
    sharding, round and round (a reference may be shared by many points)."""

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
    """Per side, medians over `timed` steps (after `warm`) of the wall seconds, minor page faults
    and system CPU seconds; the sides take turns one step at a time (benchmarks/README.md)."""
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
    columns = {name: zip(*steps, strict=True) for name, steps in seen.items()}
    return {name: dict(zip(fields, map(statistics.median, c), strict=True)) for name, c in columns.items()}


def memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """Per-device argument and temporary bytes of a compiled step."""
    m = compiled.memory_analysis()
    return {"mem_argument_bytes": int(m.argument_size_in_bytes), "mem_temp_bytes": int(m.temp_size_in_bytes)}


def step_fields(compiled: jax.stages.Compiled, least: eqxpar.inspect.Minimum) -> dict[str, Any]:
    """A compiled step's collectives (by kind, and in all) and memory beside the minimum `least`."""
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
    """Max over leaves of max|got - want| / max(max|want|, 1e-3 of the tree's largest magnitude)."""
    pairs = _pairs(got, want)
    floor = max(1e-3 * max(float(np.max(np.abs(b))) for _, b in pairs), 1e-30)
    return max(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), floor)) for a, b in pairs)


def norm_rel_err(got: PyTree, want: PyTree) -> float:
    """||got - want|| / ||want|| over the whole tree (the gradient's error as one vector)."""
    pairs = _pairs(got, want)
    diff = sum(float(np.sum((a - b) ** 2)) for a, b in pairs)
    return math.sqrt(diff) / max(math.sqrt(sum(float(np.sum(b**2)) for _, b in pairs)), 1e-30)


def adam_gradients(opt_state: PyTree, *, b1: float = _workload.ADAM_B1) -> PyTree:
    """The first step's gradients, as float64 host arrays, from AdamW's first moment `(1 - b1) * g`."""
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
    """What every benchmark JSON starts with (versions, devices, workload, timing, command)."""
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
    """`data` as JSON into `path` (its folder made if missing; a numpy scalar as a number, else `str`)."""
    plain = lambda x: x.item() if isinstance(x, np.generic) else str(x)  # noqa: E731
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=plain) + "\n")
    print(f"wrote {path}")
