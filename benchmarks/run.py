"""Measure every registered strategy on the ANCHORS.md workload and write JSON (and Markdown).

    python -m benchmarks.run [--quick] [--only dp,dp_manual] --json PATH [--markdown PATH]

For each strategy: the eqxpar step's median step time beside a baseline step
(interleaved in this process: a hand-written `jax.jit` step with the same shardings;
for pipelines, eqxpar's GPipe step of the same model and mesh), collective bytes
against the theoretical minimum (`eqxpar.inspect.minimum_comm`) and the baseline,
per-device memory, parity of the loss and gradients of the step's first call with
one device, the parameter trajectory against a single-device run over the same
steps, and the contract the record is held to.
Pipeline records add their schedule, the bytes the engine is designed to send and a
memory sweep over the micro-batch count (compiled, not run).
"""

import os

# 8 simulated CPU devices; XLA reads the flags once, when jax is first imported. The
# scheduler flag keeps XLA:CPU from running two collectives of a multi-axis manual
# plan at once (which can abort the process; eqxpar warns without it).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402

from . import _measure, _workload, report  # noqa: E402
from ._baseline import reference_run  # noqa: E402
from ._strategies import STRATEGIES, EqxBaseline, minimum  # noqa: E402

DEVICES = 8
# (warm-up steps, timed steps) per side; one step takes 1-7 s on 2 cores. The first
# warm-up step compiles; compiles (steps, parity, memory sweeps), not the timed
# steps, are most of --quick's wall time.
QUICK = (1, 2)
FULL = (5, 30)


def _mesh_dict(mesh: jax.sharding.Mesh) -> dict[str, int]:
    # Only the axes that split something; size-1 axes are eqxpar's fixed padding.
    return {name: int(size) for name, size in mesh.shape.items() if size > 1}


class _Workloads:
    """The workload model of each config and its single-device reference runs,
    built once per process and shared by the strategies."""

    def __init__(self, optim: Any, batches: Sequence):
        self.optim, self.batches = optim, batches
        self.models: dict[_workload.Config, Any] = {}
        self.runs: dict[tuple, tuple[Any, jax.Array]] = {}
        self.gradients: dict[tuple, tuple[jax.Array, Any]] = {}

    def model(self, cfg: _workload.Config) -> Any:
        if cfg not in self.models:
            self.models[cfg] = _workload.make_model(cfg)
        return self.models[cfg]

    def reference(self, cfg: _workload.Config, loss_fn: Any, steps: int) -> tuple[Any, jax.Array]:
        """(parameters, last loss) after `steps` single-device steps of `loss_fn`."""
        key = (cfg, loss_fn, steps)
        if key not in self.runs:
            self.runs[key] = reference_run(loss_fn, self.optim, self.model(cfg), self.batches[:steps])
        return self.runs[key]

    def first_gradients(self, cfg: _workload.Config, loss_fn: Any) -> tuple[jax.Array, Any]:
        """Loss and gradients of `loss_fn` at the initial model on the first batch, one device."""
        key = (cfg, loss_fn)
        if key not in self.gradients:
            self.gradients[key] = _measure.reference_gradients(loss_fn, self.model(cfg), self.batches[0])
        return self.gradients[key]


def measure(name: str, workloads: _Workloads, batches: Sequence, *, warm: int, timed: int) -> dict:
    """One record of the JSON for strategy `name`."""
    started = time.perf_counter()
    builder = STRATEGIES[name]
    # Pipeline records may run a variant of the workload (8 layers: see _pipeline).
    cfg = getattr(builder, "config", _workload.CONFIG)
    model, optim = workloads.model(cfg), workloads.optim
    setup = builder(model, optim)
    eqx_model = setup.convert(model)
    eqx_runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches, keep_first=True)
    base_runner: Any = None
    if isinstance(setup.baseline, EqxBaseline):
        base_runner = _measure.EqxparRunner(
            setup.baseline.step, setup.baseline.plan, setup.baseline.convert(model), optim, batches
        )
    elif setup.baseline is not None:
        base_runner = _measure.BaselineRunner(setup.baseline, batches)
    refs = {
        name: _measure.BaselineRunner(make(model, optim), batches)
        for name, (_, make) in setup.references.items()
    }
    sides = [eqx_runner] + ([base_runner] if base_runner is not None else []) + list(refs.values())
    times = _measure.time_interleaved(sides, warm=warm, timed=timed)
    ref_times = dict(zip(refs, times[len(sides) - len(refs) :], strict=True))

    compiled = eqx_runner.compile()
    comm_bytes, comm_counts, comm_wire = _measure.comm(compiled)
    arg_bytes, temp_bytes = _measure.memory(compiled)
    comm_baseline = wire_baseline = None
    if base_runner is not None:
        base_bytes, _, base_wire = _measure.comm(base_runner.compile())
        comm_baseline, wire_baseline = sum(base_bytes.values()), sum(base_wire.values())

    # Parity of the step: the loss and gradients of its first call (at the initial
    # parameters, on the first batch), against one device (the contract).
    # Separately, the trajectory: parameters and last loss after the same steps from
    # the same init. AdamW divides each gradient element by its own running scale, so
    # DP's reduction-order rounding (~1e-7 on gradients) grows to ~1e-4 on parameters
    # whose gradients are tiny; the hand-written baseline (same shardings, no eqxpar)
    # shows that this is the strategy's, not eqxpar's.
    grad_loss_err, grads_err, grads_norm_err = _measure.step_parity(
        eqx_runner, workloads.first_gradients(cfg, setup.reference_loss_fn), convert=setup.convert
    )
    ref_params, ref_loss = workloads.reference(cfg, setup.reference_loss_fn, eqx_runner.done)
    params_err = _measure.max_rel_err(
        eqx_runner.params(), eqx.filter(setup.convert(ref_params), eqx.is_inexact_array)
    )
    loss_err = _measure.max_rel_err(eqx_runner.loss, ref_loss)
    vs_baseline = None
    if base_runner is not None:
        if base_runner.done != eqx_runner.done:
            raise RuntimeError(f"{name}: baseline ran {base_runner.done} steps, eqxpar {eqx_runner.done}")
        if isinstance(setup.baseline, EqxBaseline):
            # Both sides back in the workload's layout (their stacks' orders differ).
            got = _measure.invert(setup.convert, eqx_runner.state.model, model)
            want = _measure.invert(setup.baseline.convert, base_runner.state.model, model)
            vs_baseline = _measure.max_rel_err(
                eqx.filter(got, eqx.is_inexact_array), eqx.filter(want, eqx.is_inexact_array)
            )
        else:
            vs_baseline = _measure.max_rel_err(
                eqx_runner.params(), eqx.filter(setup.convert(base_runner.params()), eqx.is_inexact_array)
            )
    # The library's theoretical minimum of the plan (eqxpar.inspect.minimum_comm).
    least = minimum(setup, eqx_model, cfg)
    record = {
        "strategy": name,
        "mesh": _mesh_dict(setup.plan.mesh),
        "baseline": setup.baseline_name if base_runner is not None else None,
        "step_time_s": _measure.median(times[0]),
        "baseline_step_time_s": _measure.median(times[1]) if base_runner is not None else None,
        "step_times_s": times[0],
        "baseline_step_times_s": times[1] if base_runner is not None else None,
        "comm_bytes": comm_bytes,
        "comm_counts": comm_counts,
        "comm_bytes_total": sum(comm_bytes.values()),
        "comm_bytes_min": least.result_bytes,
        "comm_bytes_baseline": comm_baseline,
        "comm_wire_bytes": comm_wire,
        "comm_wire_bytes_total": sum(comm_wire.values()),
        "comm_wire_bytes_min": least.wire_bytes,
        "comm_min_parts": {part: {"bytes": b, "wire_bytes": w} for part, (b, w) in least.parts.items()},
        "comm_wire_bytes_baseline": wire_baseline,
        "mem_argument_bytes": arg_bytes,
        "mem_temp_bytes": temp_bytes,
        "parity_max_rel_err": max(grad_loss_err, grads_err),
        "parity_grads_rel_err": grads_err,
        "parity_loss_rel_err": grad_loss_err,
        "parity_grads_norm_rel_err": grads_norm_err,
        "trajectory_params_rel_err": params_err,
        "trajectory_loss_rel_err": loss_err,
        "trajectory_vs_baseline_rel_err": vs_baseline,
        "bubble_fraction": None,
    }
    if refs:
        record["references"] = {
            name: {
                "what": setup.references[name][0],
                "step_time_s": _measure.median(t),
                "step_times_s": t,
                "ratio_to_baseline": _measure.median(t) / record["baseline_step_time_s"],
                "eqxpar_over_reference": record["step_time_s"] / _measure.median(t),
            }
            for name, t in ref_times.items()
        }
    if setup.extra is not None:
        record.update(setup.extra(compiled, eqx_model, eqx_runner))
    record["contract"] = setup.contract
    # Everything this record cost: compiles, timed steps, parity, memory sweep.
    record["wall_time_s"] = time.perf_counter() - started
    return record


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK[0]} warm + {QUICK[1]} timed steps per side"
    )
    parser.add_argument("--only", help=f"comma-separated strategies out of {','.join(STRATEGIES)}")
    parser.add_argument("--json", required=True, type=pathlib.Path, help="where to write the results")
    parser.add_argument("--markdown", type=pathlib.Path, help="also render the results as Markdown here")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other strategies' records already in --json (e.g. with --only, to re-measure some)",
    )
    args = parser.parse_args(argv)
    names = list(STRATEGIES) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in STRATEGIES]
    if unknown or not names:
        parser.error(
            f"--only {args.only!r}: unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}"
        )
    args.names = names
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if jax.device_count() != DEVICES:
        sys.exit(
            f"benchmarks need {DEVICES} devices, jax sees {jax.device_count()} (was jax imported before?)"
        )
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    optim = _workload.make_optimizer()
    # Every config shares the batch shape (the 8-layer variant changes the depth only).
    batches = _workload.make_batches(warm + timed)
    workloads = _Workloads(optim, batches)

    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    data: dict[str, Any] = {
        **_measure.run_header(command, warm=warm, timed=timed),
        "records": [],
    }
    print(
        f"{command}\njax {jax.__version__}, {jax.device_count()} devices; {warm} warm + {timed} timed steps per side"
    )
    print(" | ".join(report.COLUMNS))
    for name in args.names:
        record = measure(name, workloads, batches, warm=warm, timed=timed)
        data["records"].append(record)
        print(" | ".join(report.row(record)), flush=True)
        print(
            f"  parity of the first step: loss {record['parity_loss_rel_err']:.2e}, gradients "
            f"{record['parity_grads_rel_err']:.2e}; trajectory after {warm + timed} steps: parameters "
            f"{record['trajectory_params_rel_err']:.2e} (hand-written jax.jit vs eqxpar: "
            f"{report.format_or_dash(record['trajectory_vs_baseline_rel_err'], '.2e')})",
            flush=True,
        )
    data["wall_time_s"] = time.perf_counter() - started
    if args.merge and args.json.exists():
        # Records of strategies not measured now come from the earlier file, each
        # with the command that made it; the order is the registry's.
        old = json.loads(args.json.read_text())
        fresh = {r["strategy"]: r for r in data["records"]}
        kept = {}
        for r in old.get("records", []):
            if r["strategy"] not in fresh:
                kept[r["strategy"]] = {**r, "command": r.get("command", old.get("command"))}
        for r in data["records"]:
            r["command"] = command
        merged = {**kept, **fresh}
        data["records"] = [merged[n] for n in STRATEGIES if n in merged]
        data["commands"] = sorted({r["command"] for r in data["records"]})
        data["wall_time_s"] = None

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.markdown is not None:
        args.markdown.write_text(report.render(data))
    print(
        f"wrote {args.json}"
        + (f" and {args.markdown}" if args.markdown else "")
        + (f" in {data['wall_time_s']:.0f} s" if data["wall_time_s"] is not None else "")
    )
    return data


if __name__ == "__main__":
    main()
