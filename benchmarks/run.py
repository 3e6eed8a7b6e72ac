"""Measure every registered strategy on the workload, write JSON (and Markdown tables),
and check every record's contract: exits non-zero when one fails (benchmarks/README.md).

    python -m benchmarks.run [--quick] [--only dp,dp_manual] --json PATH [--markdown PATH]
"""

import argparse
import functools
import json
import pathlib
import shlex
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
    """Single-device runs of the plain workload, shared by the records of a process:
    `model(cfg)`, `run(cfg, loss_fn, steps)` (parameters and last loss after `steps`
    steps) and `gradients(cfg, loss_fn)` (loss and gradients on the first batch)."""

    def __init__(self, optim: Any, batches: Sequence):
        self.optim, self.batches, device = optim, batches, jax.devices()[0]
        self.model = functools.cache(_workload.make_model)

        @functools.cache
        def run(cfg: _workload.Config, loss_fn: Any, steps: int) -> tuple[Any, jax.Array]:
            return reference_run(loss_fn, optim, self.model(cfg), batches[:steps])

        @functools.cache
        def gradients(cfg: _workload.Config, loss_fn: Any) -> tuple[jax.Array, Any]:
            model, batch = jax.device_put((self.model(cfg), batches[0]), device)
            return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, batch)

        self.run, self.gradients = run, gradients


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
    got, want = runner.state.model, None
    if isinstance(base_step, EqxBaseline):
        # Both sides back in the workload's layout (their stacks' orders differ).
        got = _measure.invert(setup.convert, got, refs.model(cfg))
        want = _measure.invert(base_step.convert, base.state.model, refs.model(cfg))
    elif base is not None:
        got, want = runner.params(), setup.convert(base.params())
    params = lambda tree: eqx.filter(tree, eqx.is_inexact_array)  # noqa: E731
    record["trajectory_vs_baseline_rel_err"] = (
        None if want is None else _measure.max_rel_err(params(got), params(want))
    )
    return record


def _baseline_runner(base_step: Any, model: Any, optim: Any, batches: Sequence) -> Any:
    if isinstance(base_step, EqxBaseline):
        return _measure.EqxparRunner(base_step.step, base_step.plan, base_step.convert(model), optim, batches)
    return None if base_step is None else _measure.BaselineRunner(base_step, batches)


def measure(name: str, refs: References, batches: Sequence, *, warm: int, timed: int, cfg=None) -> dict:
    """One record of the JSON for strategy `name` (on the workload, or on variant `cfg`)."""
    started = time.perf_counter()
    strategy = STRATEGIES[name]
    cfg = strategy.config(cfg or _workload.CONFIG)
    model, optim = refs.model(cfg), refs.optim
    setup = strategy(model, optim, cfg)
    eqx_model = setup.convert(model)
    runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches)
    base_step = setup.baseline and setup.baseline()
    base = _baseline_runner(base_step, model, optim, batches)
    others = {
        k: _measure.BaselineRunner(make(model, optim), batches) for k, (_, make) in setup.references.items()
    }
    sides = {"eqxpar": runner, **({"baseline": base} if base else {}), **others}
    median = _measure.median_times(sides, warm=warm, timed=timed)
    compiled = runner.compile()
    least = setup.minimum(eqx_model, cfg)
    record: dict[str, Any] = {
        "strategy": name,
        "mesh": {k: int(v) for k, v in setup.plan.mesh.shape.items() if v > 1},
        "baseline": setup.baseline_name if base else None,
        "step_time_s": median["eqxpar"],
        "baseline_step_time_s": median.get("baseline"),
        **_measure.step_fields(compiled, least),
        "comm_min_parts": {part: {"bytes": b, "wire_bytes": w} for part, (b, w) in least.parts.items()},
        "comm_wire_bytes_baseline": base and _measure.wire_bytes(base.compile()),
        **_parity_fields(setup, runner, base_step, base, refs, cfg),
    }
    for k, (what, _) in setup.references.items():
        times = {"step_time_s": median[k], "ratio_to_baseline": median[k] / median["baseline"]}
        times["eqxpar_over_reference"] = median["eqxpar"] / median[k]
        record.setdefault("references", {})[k] = {"what": what, **times}
    record.update(setup.extra(compiled, eqx_model, runner) if setup.extra else {})
    return {**record, "contract": setup.contract, "wall_time_s": time.perf_counter() - started}


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK[0]} warm + {QUICK[1]} timed steps a side"
    )
    parser.add_argument("--only", help=f"comma-separated strategies out of {','.join(STRATEGIES)}")
    parser.add_argument("--json", required=True, type=pathlib.Path, help="where to write the results")
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the tables into this Markdown file")
    args = parser.parse_args(argv)
    args.names = list(STRATEGIES) if args.only is None else args.only.split(",")
    if unknown := set(args.names) - set(STRATEGIES):
        parser.error(f"--only: unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    args = _parse(argv)
    if jax.device_count() != DEVICES:
        sys.exit(f"benchmarks need {DEVICES} devices, jax sees {jax.device_count()} (jax imported before?)")
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    # Every config shares the batch shape (the 8-layer variant changes the depth only).
    batches = _workload.make_batches(warm + timed)
    refs = References(_workload.make_optimizer(), batches)
    command = "python -m benchmarks.run " + shlex.join(sys.argv[1:] if argv is None else argv)
    data: dict[str, Any] = {**_measure.header(command, warm=warm, timed=timed), "records": []}
    print(f"{command}\njax {jax.__version__}, {jax.device_count()} devices\n" + " | ".join(report.COLUMNS))
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
