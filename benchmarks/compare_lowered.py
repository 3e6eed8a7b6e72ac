"""Is the lowered train step the same program? For a refactor that must not change what a
step does: the sha256 of each plan's lowered StableHLO text, and optionally a step time.

    python -m benchmarks.compare_lowered --json /tmp/lowered_before.json
    ... change the code ...
    python -m benchmarks.compare_lowered --against /tmp/lowered_before.json
    python -m benchmarks.compare_lowered --time dp,pp_1f1b   # median step time (2 warm + 10)

The eight plans are the issue-45 comparison's, registry names of `_strategies.STRATEGIES`:
data 8 (`dp`), manual FSDP 8 (`fsdp_manual`), TP 4 + SP (`tp_sp`), ZeRO-1 (`zero1`), 1F1B
(`pp_1f1b`), interleaved (`pp_interleaved`), ring context (`cp`) and expert (`ep`). Each builds
the record's model, state and first batch as `benchmarks.run` does and lowers one step:
`step.lower(state, batch).as_text()`. Identical text is the same program, so identical hashes
say a change kept every plan's step; a different hash says look (`--dump DIR` writes the texts
to diff). Step times on 8 simulated CPU devices are noisy (about +-20 % on a shared host):
compare ratios taken on the same machine, alternating the two versions.
"""

import argparse
import hashlib
import json
import pathlib
import statistics
import time
from typing import Any

import jax

import eqxpar

from . import _workload
from ._strategies import STRATEGIES

#: The issue-45 comparison's plans, by registry name.
PLANS = ("dp", "fsdp_manual", "tp_sp", "zero1", "pp_1f1b", "pp_interleaved", "cp", "ep")


def _built(name: str) -> tuple[Any, Any, Any]:
    """`(step, state, batch)` of strategy `name` on its workload, placed as `benchmarks.run` places them."""
    strategy = STRATEGIES[name]
    cfg = strategy.config(_workload.CONFIG)
    model, optim = _workload.make_model(cfg), _workload.make_optimizer(cfg)
    setup = strategy(model, optim, cfg)
    state = eqxpar.train.init(setup.convert(model), optim, setup.plan, key=jax.random.key(0))
    batch = eqxpar.shard_batch(_workload.make_batches(1, cfg)[0], setup.plan)
    return setup.step, state, batch


def lowered_text(name: str) -> str:
    """The lowered StableHLO text of one train step of strategy `name`."""
    step, state, batch = _built(name)
    return step.lower(state, batch).as_text()


def step_time(name: str, *, warm: int = 2, timed: int = 10) -> float:
    """The median wall time of `timed` steps of strategy `name`, after `warm` steps (seconds)."""
    step, state, batch = _built(name)
    times = []
    for i in range(warm + timed):
        started = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= warm:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare_lowered",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--only", help=f"comma-separated plans out of {','.join(PLANS)}")
    parser.add_argument("--json", type=pathlib.Path, help="write {plan: sha256} here")
    parser.add_argument("--against", type=pathlib.Path, help="a --json of before: exit 1 on any difference")
    parser.add_argument("--dump", type=pathlib.Path, help="also write each lowered text to DIR/<plan>.mlir")
    parser.add_argument("--time", help="comma-separated plans to time instead (median of 2 warm + 10 steps)")
    args = parser.parse_args(argv)
    if args.time:
        times = {name: step_time(name) for name in args.time.split(",")}
        for name, t in times.items():
            print(f"{name}: {t * 1e3:.2f} ms", flush=True)
        if args.json:
            args.json.write_text(json.dumps(times, indent=1) + "\n")
        return times
    names = args.only.split(",") if args.only else list(PLANS)
    hashes = {}
    for name in names:
        text = lowered_text(name)
        hashes[name] = hashlib.sha256(text.encode()).hexdigest()
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / f"{name}.mlir").write_text(text)
        print(f"{name}: {hashes[name]}", flush=True)
        jax.clear_caches()
    if args.json:
        args.json.write_text(json.dumps(hashes, indent=1) + "\n")
    if args.against:
        before = json.loads(args.against.read_text())
        differ = [n for n in names if before.get(n) != hashes[n]]
        print(
            f"differ from {args.against}: {differ}"
            if differ
            else f"all {len(names)} identical to {args.against}"
        )
        if differ:
            raise SystemExit(1)
    return hashes


if __name__ == "__main__":
    main()
