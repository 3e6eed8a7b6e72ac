"""Decode tokens/s of `eqxpar.models.generate` (key/value cache) against the uncached
loop it replaced, on one device, in one process (benchmarks/README.md):

    python -m benchmarks.decode --json benchmarks/results/quick.json
"""

import argparse
import dataclasses
import json
import pathlib
import time

import equinox as eqx
import jax
import jax.numpy as jnp

from eqxpar.models import GPT, GPTConfig, generate

BATCH, PROMPT, STEPS = 4, 8, (64, 256, 1024)
CONFIG = GPTConfig(vocab_size=512, d_model=128, num_heads=4, num_layers=2, d_hidden=512)


@eqx.filter_jit
def uncached(model: GPT, prompt: jax.Array, steps: int) -> jax.Array:
    """The generate of eqxpar 0.x before the cache (greedy): every token re-reads the
    last `max_seq_len` tokens through the whole model."""
    batch, length = prompt.shape
    window = model.config.max_seq_len
    buffer = jnp.zeros((batch, max(length + steps, window)), prompt.dtype)
    buffer = jax.lax.dynamic_update_slice_in_dim(buffer, prompt, 0, axis=1)

    def body(t, buffer):
        n = length + t
        start = jnp.maximum(n - window, 0)
        ids = jax.lax.dynamic_slice_in_dim(buffer, start, window, axis=1)
        last = jax.lax.dynamic_index_in_dim(model(ids), n - start - 1, axis=1, keepdims=False)
        token = jnp.argmax(last, axis=-1).astype(buffer.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buffer, token[:, None], n, axis=1)

    return jax.lax.fori_loop(0, steps, body, buffer)[:, : length + steps]


def _timed(fn) -> tuple[float, jax.Array]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def measure(steps: int) -> dict:
    # The window the uncached loop re-reads is the model's max_seq_len: exactly the
    # sequence here (rotary positions: the weights do not depend on it).
    config = dataclasses.replace(CONFIG, max_seq_len=PROMPT + steps)
    model = jax.device_put(GPT(config, key=jax.random.key(0)), jax.devices()[0])
    prompt = jax.random.randint(jax.random.key(1), (BATCH, PROMPT), 0, CONFIG.vocab_size)
    kw = dict(key=jax.random.key(2), temperature=0.0, max_length=PROMPT + steps)
    # One compilation per (batch, max_length): a 1-step call compiles what the timed call runs.
    generate(model, prompt, steps=1, **kw).tokens.block_until_ready()
    run = lambda: generate(model, prompt, steps=steps, **kw).tokens  # noqa: E731
    cached_s, tokens = _timed(run)
    cached_s = min(cached_s, _timed(run)[0])  # the better of two runs
    compiled = uncached.lower(model, prompt, steps).compile()
    uncached_s, reference = _timed(lambda: compiled(model, prompt, steps))
    same = bool((tokens == reference).all())
    record = dict(steps=steps, cached_s=cached_s, uncached_s=uncached_s, same_tokens=same)
    record |= dict(
        cached_tokens_per_s=BATCH * steps / cached_s, uncached_tokens_per_s=BATCH * steps / uncached_s
    )
    record["speedup"] = uncached_s / cached_s
    print(json.dumps(record), flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True, help="the JSON to record into")
    args = parser.parse_args()
    record = {
        "command": f"python -m benchmarks.decode --json {args.json}",
        "model": dict(dataclasses.asdict(CONFIG), batch=BATCH, prompt=PROMPT, device=str(jax.devices()[0])),
        "runs": [measure(steps) for steps in STEPS],
    }
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    args.json.write_text(json.dumps({**data, "decode": record}, indent=2) + "\n")


if __name__ == "__main__":
    main()
