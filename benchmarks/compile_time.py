"""Compile time of a scanned stack against its depth.

`eqxpar.nn.Stacked` runs its blocks with `lax.scan`, so the compiled program holds
one block whatever the depth and compile time should stay flat: the same train step
(data 8, AdamW) compiled for 4 and 32 transformer blocks, and with `--unrolled` for
the same blocks as a Python list.

    python -m benchmarks.compile_time --json benchmarks/results/compile_time.json [--unrolled]
"""

import argparse
import json
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

import eqxpar
from eqxpar import nn

VOCAB, D, HEADS, HIDDEN, SEQ, BATCH = 512, 256, 4, 1024, 128, 16


class LM(eqx.Module):
    embed: nn.Embedding
    blocks: nn.Stacked | list
    head: nn.Unembed

    def __init__(self, depth: int, *, scanned: bool, key):
        k = jax.random.split(key, 3)
        self.embed, self.head = nn.Embedding(VOCAB, D, key=k[0]), nn.Unembed(D, VOCAB, key=k[2])
        make = lambda kk: nn.TransformerBlock(D, HEADS, HIDDEN, key=kk)  # noqa: E731
        keys = jax.random.split(k[1], depth)
        self.blocks = nn.Stacked(make, depth=depth, key=k[1]) if scanned else [make(kk) for kk in keys]

    def __call__(self, ids):
        h = self.embed(ids)
        for block in [self.blocks] if isinstance(self.blocks, nn.Stacked) else self.blocks:
            h = block(h)
        return self.head(h)


def loss_fn(model, batch):
    ids, labels = batch
    return jnp.mean(nn.cross_entropy(model(ids), labels))


def compile_seconds(depth: int, *, scanned: bool) -> float:
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    optim = optax.adamw(1e-3)
    model = LM(depth, scanned=scanned, key=jax.random.key(0))
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    tokens = jnp.zeros((BATCH, SEQ + 1), jnp.int32)
    lowered = eqxpar.train.make_step(loss_fn, optim, plan).lower(state, (tokens[:, :-1], tokens[:, 1:]))
    start = time.perf_counter()
    lowered.compile()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, help="where to write the results")
    parser.add_argument("--unrolled", action="store_true", help="also compile the blocks as a Python list")
    args = parser.parse_args()
    results = {}
    for scanned in (True, False) if args.unrolled else (True,):
        for depth in (4, 32):
            name = f"{'scanned' if scanned else 'unrolled'}_{depth}"
            results[name] = compile_seconds(depth, scanned=scanned)
            print(f"{name}: {results[name]:.2f} s compile", flush=True)
    for kind in ("scanned", "unrolled") if args.unrolled else ("scanned",):
        results[f"{kind}_ratio_32_to_4"] = results[f"{kind}_32"] / results[f"{kind}_4"]
        print(f"{kind} 32 / 4 blocks: {results[f'{kind}_ratio_32_to_4']:.2f}x (scanned: target < 1.5x)")
    if args.json:
        args.json.write_text(
            json.dumps({"command": "python -m benchmarks.compile_time", **results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
