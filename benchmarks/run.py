"""Measure every registered strategy on the workload, write JSON (and Markdown tables),
and exit non-zero when a record breaks its contract (benchmarks/README.md).

    python -m benchmarks.run [--quick] [--only dp,dp_manual] --json PATH [--markdown PATH]
"""

import functools
import gc
import json
import pathlib
import sys
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

import eqxpar

from . import _measure, _workload, contracts, report
from ._measure import BaselineRunner, EqxparRunner, max_rel_err, norm_rel_err
from ._strategies import STRATEGIES, single_device

# (warm-up steps, timed steps) per side; the first warm-up step compiles.
QUICK, FULL = (1, 2), (5, 30)


class References:
    """Single-device runs, cached: `run(cfg, loss_fn, steps)` is the first batch's loss and
    gradients, and the parameters and last loss after `steps` steps."""

    def __init__(self, optim: Any, steps: int):
        self.optim = optim
        self.model = functools.cache(_workload.make_model)
        self.batches = functools.cache(lambda cfg: _workload.make_batches(steps, cfg))
        self.run = functools.cache(self._run)

    def _run(self, cfg: _workload.Config, loss_fn: Any, steps: int) -> tuple:
        batches = self.batches(cfg)
        model, batch = jax.device_put((self.model(cfg), batches[0]), jax.devices()[0])
        first = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, batch)
        step = single_device(model, self.optim, loss_fn)
        losses = [step(step.put_batch(batch)) for batch in batches[:steps]]
        return (*first, step.params, losses[-1])

    def parity(self, setup: Any, runner: EqxparRunner, cfg: _workload.Config) -> dict:
        """The step's first loss and gradients, and its trajectory, against one device (README.md)."""
        ref_loss, ref_grads, ref_params, ref_last_loss = self.run(cfg, setup.reference_loss_fn, runner.done)
        convert = lambda tree: eqx.filter(setup.convert(tree), eqx.is_inexact_array)  # noqa: E731
        ref_grads, ref_params = convert(ref_grads), convert(ref_params)
        loss, grads = max_rel_err(runner.first_loss, ref_loss), max_rel_err(runner.first_grads, ref_grads)
        return {
            "parity_max_rel_err": max(loss, grads),
            "parity_grads_rel_err": grads,
            "parity_loss_rel_err": loss,
            "parity_grads_norm_rel_err": norm_rel_err(runner.first_grads, ref_grads),
            "trajectory_params_rel_err": max_rel_err(runner.params(), ref_params),
            "trajectory_loss_rel_err": max_rel_err(runner.loss, ref_last_loss),
        }


def measure(name: str, refs: References, *, warm: int, timed: int, cfg=None) -> dict:
    """One record of the JSON for strategy `name` (on the workload, or on variant `cfg`)."""
    started = time.perf_counter()
    strategy = STRATEGIES[name]
    cfg = strategy.config(cfg or _workload.CONFIG)
    model, optim, batches = refs.model(cfg), refs.optim, refs.batches(cfg)
    setup = strategy(model, optim, cfg)
    eqx_model = setup.convert(model)
    runner = EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches)
    base = setup.baseline and setup.baseline(batches)
    others = {k: BaselineRunner(make(model, optim), batches) for k, (_, make) in setup.references.items()}
    sides = {"eqxpar": runner, **({"baseline": base} if base else {}), **others}
    steps = _measure.timed_steps(sides, warm=warm, timed=timed)
    median = {side: t["step_time_s"] for side, t in steps.items()}
    compiled = runner.compile()
    least = setup.minimum(eqx_model, cfg)
    record: dict[str, Any] = {
        "strategy": name,
        "mesh": {k: int(v) for k, v in setup.plan.mesh.shape.items() if v > 1},
        "baseline": setup.baseline_name if base else None,
        "step_time_s": median["eqxpar"],
        # Simulated CPU devices fault in their temp memory on every step (BENCHMARKS.md).
        "step_minor_faults": steps["eqxpar"]["step_minor_faults"],
        "step_system_cpu_s": steps["eqxpar"]["step_system_cpu_s"],
        "baseline_step_time_s": median.get("baseline"),
        **_measure.step_fields(compiled, least),
        "comm_min_parts": {part: {"bytes": b, "wire_bytes": w} for part, (b, w) in least.parts.items()},
        "comm_wire_bytes_baseline": base and eqxpar.inspect.collective_stats(base.compile()).total_wire_bytes,
        **refs.parity(setup, runner, cfg),
    }
    for k, (what, _) in setup.references.items():
        times = dict(steps[k])
        if "baseline" in median:
            times["ratio_to_baseline"] = median[k] / median["baseline"]
        times["eqxpar_over_reference"] = median["eqxpar"] / median[k]
        record.setdefault("references", {})[k] = {"what": what, **times}
    record.update(setup.extra(compiled, eqx_model, runner, least) if setup.extra else {})
    return {**record, "contract": setup.contract, "wall_time_s": time.perf_counter() - started}


def _merged(old: dict, new: dict) -> dict:
    """`old`'s JSON with `new`'s records (an --only run) in the registry's order, and its `updates`."""
    records = {r["strategy"]: r for r in old["records"]} | {r["strategy"]: r for r in new["records"]}
    update = {"command": new["command"], "records": [r["strategy"] for r in new["records"]]}
    # An earlier update whose records were all measured again says nothing any more.
    kept = [u for u in old.get("updates", []) if not set(u["records"]) <= set(update["records"])]
    order = [name for name in STRATEGIES if name in records]
    return {**old, "records": [records[name] for name in order], "updates": [*kept, update]}


def main(argv: Sequence[str] | None = None) -> dict:
    parser = _measure.parser("python -m benchmarks.run", __doc__, QUICK)
    parser.add_argument(
        "--only",
        help=f"comma-separated strategies out of {','.join(STRATEGIES)}; an existing --json keeps its other records",
    )
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the tables into this Markdown file")
    args = parser.parse_args(argv)
    names = list(STRATEGIES) if args.only is None else args.only.split(",")
    if unknown := set(names) - set(STRATEGIES):
        parser.error(f"--only: unknown strategies {sorted(unknown)}; choose from {', '.join(STRATEGIES)}")
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    data: dict[str, Any] = {**_measure.header(parser.prog, argv, warm=warm, timed=timed), "records": []}
    refs = References(_workload.make_optimizer(), warm + timed)
    print(" | ".join(report.COLUMNS))
    for name in names:
        data["records"].append(measure(name, refs, warm=warm, timed=timed))
        print(" | ".join(report.row(data["records"][-1])), flush=True)
        # Each XLA:CPU executable maps its code in regions of its own, and jit's caches
        # keep every record's executables alive: the whole registry in one process
        # passed Linux's 65,530 maps (LLVM: "Cannot allocate memory"). Released here.
        gc.collect()
        jax.clear_caches()
    data["wall_time_s"] = time.perf_counter() - started
    if args.json.exists():  # a full run keeps what other scripts wrote (long_runs, pretrained_load, frozen)
        old = json.loads(args.json.read_text())
        foreign = {k: v for k, v in old.items() if k not in (*data, "updates")}
        data = _merged(old, data) if args.only else foreign | data
    _measure.write_json(args.json, data)
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
