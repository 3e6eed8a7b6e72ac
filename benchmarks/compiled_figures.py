"""Compile every registered strategy's step again and compare its compiled figures
(collectives by kind, their bytes and counts, argument and temporary memory, the
library's minimum) with a results file's records, without timing anything: the
check that a change which should leave the programs alone did (a refactor, a new
JAX). Exits non-zero when a figure moved, listing each.

    python -m benchmarks.compiled_figures [--only dp,pp_1f1b] [--against benchmarks/results/quick.json]

The records must have been measured on this JAX (`jax` in the file's header):
another XLA may schedule, fuse and place buffers differently.
"""

import argparse
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

import jax

from . import _measure, _workload
from ._strategies import STRATEGIES

QUICK_JSON = pathlib.Path(__file__).parent / "results" / "quick.json"


def compiled_fields(name: str) -> dict[str, Any]:
    """Strategy `name`'s compiled step figures: the fields of `_measure.step_fields`."""
    strategy = STRATEGIES[name]
    cfg = strategy.config(_workload.CONFIG)
    model, optim = _workload.make_model(cfg), _workload.make_optimizer()
    setup = strategy(model, optim, cfg)
    eqx_model = setup.convert(model)
    runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, _workload.make_batches(1, cfg))
    return _measure.step_fields(runner.compile(), setup.minimum(eqx_model, cfg))


def moved(record: dict[str, Any], fields: dict[str, Any]) -> list[str]:
    """`field: recorded -> now` for each figure of `fields` that differs from `record`'s."""
    return [f"{k}: {record.get(k)!r} -> {v!r}" for k, v in fields.items() if record.get(k) != v]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compiled_figures", description=__doc__)
    parser.add_argument("--against", type=pathlib.Path, default=QUICK_JSON, help="the results file")
    parser.add_argument("--only", help="comma-separated strategies (default: every record of the file)")
    args = parser.parse_args(argv)
    results = json.loads(args.against.read_text())
    if results["jax"] != jax.__version__:
        print(
            f"{args.against} was measured on JAX {results['jax']}, this is {jax.__version__}", file=sys.stderr
        )
        return 2
    records = {r["strategy"]: r for r in results["records"]}
    names = args.only.split(",") if args.only else list(records)
    unknown = sorted(set(names) - set(records))
    if unknown:
        parser.error(f"--only {unknown}: no such record in {args.against}; it has {list(records)}")
    failed = 0
    for name in names:
        changes = moved(records[name], compiled_fields(name))
        print(f"{name}: {'same' if not changes else 'MOVED'}", *changes, sep="\n  ", flush=True)
        failed += bool(changes)
    print(f"{len(names) - failed} of {len(names)} records compile to the recorded figures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
