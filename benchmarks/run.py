"""Measure every registered strategy on the workload, write JSON (and Markdown tables),
and check every record's contract: exits non-zero when one fails.

    python -m benchmarks.run [--quick] [--only dp,dp_manual] --json PATH [--markdown PATH]

What a record holds is described in benchmarks/README.md.
"""

import argparse
import json
import pathlib
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from . import _measure, _workload, contracts, report
from ._baseline import reference_run
from ._strategies import STRATEGIES, EqxBaseline

DEVICES = 8
# (warm-up steps, timed steps) per side. The first warm-up step compiles; compiles,
# not the timed steps, are most of --quick's wall time.
QUICK = (1, 2)
FULL = (5, 30)


class References:
    """Single-device runs of the plain workload, shared by the records of a process."""

    def __init__(self, optim: Any, batches: Sequence):
        self.optim, self.batches, self.cache = optim, batches, {}

    def _cached(self, key: tuple, make: Any) -> Any:
        if key not in self.cache:
            self.cache[key] = make()
        return self.cache[key]

    def model(self, cfg: _workload.Config) -> _workload.Transformer:
        return self._cached(("model", cfg), lambda: _workload.make_model(cfg))

    def run(self, cfg: _workload.Config, loss_fn: Any, steps: int) -> tuple[Any, jax.Array]:
        """(parameters, last loss) after `steps` single-device steps."""
        make = lambda: reference_run(loss_fn, self.optim, self.model(cfg), self.batches[:steps])  # noqa: E731
        return self._cached(("run", cfg, loss_fn, steps), make)

    def gradients(self, cfg: _workload.Config, loss_fn: Any) -> tuple[jax.Array, Any]:
        """Loss and gradients at the initial model on the first batch."""
        make = lambda: _measure.reference_gradients(loss_fn, self.model(cfg), self.batches[0])  # noqa: E731
        return self._cached(("grads", cfg, loss_fn), make)


def _comm_fields(setup: Any, compiled: Any, base: Any, eqx_model: Any, cfg: Any) -> dict:
    """Collective bytes of the compiled step, of its baseline, and the library's minimum."""
    record = {**_measure.comm(compiled), **_measure.memory(compiled)}
    record["comm_bytes_total"] = sum(record["comm_bytes"].values())
    record["comm_wire_bytes_total"] = sum(record["comm_wire_bytes"].values())
    least = setup.minimum(eqx_model, cfg)
    record["comm_bytes_min"], record["comm_wire_bytes_min"] = least.total_bytes, least.total_wire_bytes or 0
    record["comm_min_parts"] = {part: {"bytes": b, "wire_bytes": w} for part, (b, w) in least.parts.items()}
    base_comm = _measure.comm(base.compile()) if base is not None else None
    record["comm_bytes_baseline"] = base_comm and sum(base_comm["comm_bytes"].values())
    record["comm_wire_bytes_baseline"] = base_comm and sum(base_comm["comm_wire_bytes"].values())
    return record


def _parity_fields(setup: Any, runner: Any, base_step: Any, base: Any, refs: References, cfg: Any) -> dict:
    """Parity of the step (the contract): the loss and gradients of its first call
    against one device. Separately, the trajectory after the same steps: AdamW divides
    each gradient element by its own running scale, so reduction-order rounding (~1e-7
    on gradients) grows to ~1e-4 on parameters whose gradients are tiny; the
    hand-written baseline shows that this is the strategy's, not eqxpar's."""
    record = _measure.step_parity(runner, refs.gradients(cfg, setup.reference_loss_fn), setup.convert)
    ref_params, ref_loss = refs.run(cfg, setup.reference_loss_fn, runner.done)
    ref_params = eqx.filter(setup.convert(ref_params), eqx.is_inexact_array)
    record["trajectory_params_rel_err"] = _measure.max_rel_err(runner.params(), ref_params)
    record["trajectory_loss_rel_err"] = _measure.max_rel_err(runner.loss, ref_loss)
    vs = None
    if isinstance(base_step, EqxBaseline):
        # Both sides back in the workload's layout (their stacks' orders differ).
        model = refs.model(cfg)
        got = _measure.invert(setup.convert, runner.state.model, model)
        want = _measure.invert(base_step.convert, base.state.model, model)
        vs = _measure.max_rel_err(
            eqx.filter(got, eqx.is_inexact_array), eqx.filter(want, eqx.is_inexact_array)
        )
    elif base is not None:
        want = eqx.filter(setup.convert(base.params()), eqx.is_inexact_array)
        vs = _measure.max_rel_err(runner.params(), want)
    record["trajectory_vs_baseline_rel_err"] = vs
    return record


def measure(name: str, refs: References, batches: Sequence, *, warm: int, timed: int, cfg=None) -> dict:
    """One record of the JSON for strategy `name` (on the workload, or on variant `cfg`)."""
    started = time.perf_counter()
    strategy = STRATEGIES[name]
    cfg = strategy.config(cfg or _workload.CONFIG)
    model, optim = refs.model(cfg), refs.optim
    setup = strategy(model, optim, cfg)
    eqx_model = setup.convert(model)
    runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches, keep_first=True)
    base_step = setup.baseline() if setup.baseline is not None else None
    if isinstance(base_step, EqxBaseline):
        base = _measure.EqxparRunner(base_step.step, base_step.plan, base_step.convert(model), optim, batches)
    else:
        base = None if base_step is None else _measure.BaselineRunner(base_step, batches)
    others = {
        k: _measure.BaselineRunner(make(model, optim), batches) for k, (_, make) in setup.references.items()
    }
    names = ["eqxpar", *(["baseline"] if base else []), *others]
    sides = [runner, *([base] if base else []), *others.values()]
    times = dict(zip(names, _measure.time_interleaved(sides, warm=warm, timed=timed), strict=True))
    median = {k: statistics.median(t) for k, t in times.items()}
    compiled = runner.compile()
    record: dict[str, Any] = {
        "strategy": name,
        "mesh": {k: int(v) for k, v in setup.plan.mesh.shape.items() if v > 1},
        "baseline": setup.baseline_name if base else None,
        "step_time_s": median["eqxpar"],
        "baseline_step_time_s": median.get("baseline"),
        "step_times_s": times["eqxpar"],
        "baseline_step_times_s": times.get("baseline"),
        **_comm_fields(setup, compiled, base, eqx_model, cfg),
        **_parity_fields(setup, runner, base_step, base, refs, cfg),
        "bubble_fraction": None,
    }
    if others:
        record["references"] = {
            k: {
                "what": setup.references[k][0],
                "step_time_s": median[k],
                "step_times_s": times[k],
                "ratio_to_baseline": median[k] / median["baseline"],
                "eqxpar_over_reference": median["eqxpar"] / median[k],
            }
            for k in others
        }
    if setup.extra is not None:
        record.update(setup.extra(compiled, eqx_model, runner))
    record["contract"] = setup.contract
    record["wall_time_s"] = time.perf_counter() - started
    return record


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK[0]} warm + {QUICK[1]} timed steps per side"
    )
    parser.add_argument("--only", help=f"comma-separated strategies out of {','.join(STRATEGIES)}")
    parser.add_argument("--json", required=True, type=pathlib.Path, help="where to write the results")
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the tables into this Markdown file")
    args = parser.parse_args(argv)
    args.names = (
        list(STRATEGIES) if args.only is None else [n.strip() for n in args.only.split(",") if n.strip()]
    )
    unknown = [n for n in args.names if n not in STRATEGIES]
    if unknown or not args.names:
        parser.error(
            f"--only {args.only!r}: unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}"
        )
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if jax.device_count() != DEVICES:
        sys.exit(
            f"benchmarks need {DEVICES} devices, jax sees {jax.device_count()} (was jax imported before?)"
        )
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    # Every config shares the batch shape (the 8-layer variant changes the depth only).
    batches = _workload.make_batches(warm + timed)
    refs = References(_workload.make_optimizer(), batches)
    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    data: dict[str, Any] = {**_measure.header(command, warm=warm, timed=timed), "records": []}
    print(f"{command}\njax {jax.__version__}, {jax.device_count()} devices", flush=True)
    print(" | ".join(report.COLUMNS))
    for name in args.names:
        data["records"].append(measure(name, refs, batches, warm=warm, timed=timed))
        print(" | ".join(report.row(data["records"][-1])), flush=True)
    data["wall_time_s"] = time.perf_counter() - started
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    if args.markdown is not None:
        report.splice(args.markdown, report.render(data))
    by_name = {r["strategy"]: r for r in data["records"]}
    broken = [clause for r in data["records"] for clause in contracts.broken(r, by_name)]
    print("\n".join(["contracts broken:", *broken] if broken else ["every contract holds"]))
    if broken:
        sys.exit(1)
    return data


if __name__ == "__main__":
    main()
