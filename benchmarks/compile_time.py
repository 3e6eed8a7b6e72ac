"""Compile time of the workload's scanned stack against its depth (benchmarks/README.md).

python -m benchmarks.compile_time --json benchmarks/results/compile_time.json [--unrolled]
"""

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp

import eqxpar
from eqxpar.models import gpt_first, gpt_last

from . import _workload


def _unrolled_loss(model, tokens):
    h = gpt_first(model, tokens)
    for i in range(model.blocks.depth):
        h = model.blocks[i](h)
    return gpt_last(model, h, tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, help="where to write the results")
    parser.add_argument("--unrolled", action="store_true", help="also compile the blocks in a Python loop")
    args = parser.parse_args()
    results: dict = {"command": "python -m benchmarks.compile_time"}
    for kind in ("scanned", "unrolled") if args.unrolled else ("scanned",):
        for depth in (4, 32):
            cfg = dataclasses.replace(_workload.CONFIG, layers=depth, batch=16)
            plan, optim = eqxpar.Plan(eqxpar.make_mesh(data=8)), _workload.make_optimizer(cfg)
            state = eqxpar.train.init(_workload.make_model(cfg), optim, plan, key=jax.random.key(1))
            loss = _workload.loss_fn if kind == "scanned" else _unrolled_loss
            tokens = jnp.zeros((cfg.batch, cfg.seq_len + 1), jnp.int32)
            lowered = eqxpar.train.make_step(loss, optim, plan).lower(state, tokens)
            start = time.perf_counter()
            lowered.compile()
            results[f"{kind}_{depth}"] = seconds = time.perf_counter() - start
            print(f"{kind}_{depth}: {seconds:.2f} s compile", flush=True)
        results[f"{kind}_ratio_32_to_4"] = ratio = results[f"{kind}_32"] / results[f"{kind}_4"]
        print(f"{kind} 32 / 4 blocks: {ratio:.2f}x (scanned: target < 1.5x)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
