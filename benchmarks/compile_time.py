"""Compile time of a scanned stack against its depth.

`eqxpar.nn.Stacked` runs its blocks with `lax.scan`, so the compiled program holds
one block whatever the depth, and compile time should stay flat. This script
compiles the same train step (data 8, AdamW) for a stack of 4 and of 32
transformer blocks (d_model 256, 4 heads, MLP 1024), and for comparison the same
blocks as a Python list (unrolled), and prints and records the times.

    python -m benchmarks.compile_time --json benchmarks/results/compile_time.json [--unrolled]
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar import nn  # noqa: E402

VOCAB, D, HEADS, HIDDEN, SEQ, BATCH = 512, 256, 4, 1024, 128, 16


class LM(eqx.Module):
    embed: nn.Embedding
    blocks: nn.Stacked | list
    head: nn.Unembed

    def __init__(self, depth: int, *, scanned: bool, key):
        k = jax.random.split(key, 3)
        self.embed = nn.Embedding(VOCAB, D, key=k[0])

        def make(kk):
            return nn.TransformerBlock(D, HEADS, HIDDEN, key=kk)

        if scanned:
            self.blocks = nn.Stacked(make, depth=depth, key=k[1])
        else:
            self.blocks = [make(kk) for kk in jax.random.split(k[1], depth)]
        self.head = nn.Unembed(D, VOCAB, key=k[2])

    def __call__(self, ids):
        h = self.embed(ids)
        if isinstance(self.blocks, nn.Stacked):
            h = self.blocks(h)
        else:
            for block in self.blocks:
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
    results["scanned_ratio_32_to_4"] = results["scanned_32"] / results["scanned_4"]
    print(f"scanned 32 / 4 blocks: {results['scanned_ratio_32_to_4']:.2f}x (target < 1.5x)")
    if args.unrolled:
        results["unrolled_ratio_32_to_4"] = results["unrolled_32"] / results["unrolled_4"]
        print(f"unrolled 32 / 4 blocks: {results['unrolled_ratio_32_to_4']:.2f}x")
    if args.json:
        args.json.write_text(
            json.dumps({"command": "python -m benchmarks.compile_time", **results}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
