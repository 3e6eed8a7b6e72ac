"""Data parallelism on 8 simulated CPU devices, in the automatic or manual mode.

Trains a small character-level language model (context of 16 characters ->
next character) on Python's own documentation text, printing progress, and
compares the final evaluation loss with the unigram entropy of the text (what a
model that ignores context would reach). The plans are `data/*` in `_plans.py`.

    python examples/data_parallel.py                 # automatic (GSPMD)
    python examples/data_parallel.py --mode manual   # shard_map, explicit all-reduce
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import argparse  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _loop import adamw_warmup_cosine, train  # noqa: E402
from _plans import PLANS, variants  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402


class CharMLP(eqx.Module):
    """Embeds a window of characters, concatenates them, and predicts the next one."""

    embed: eqx.nn.Embedding
    mlp: eqx.nn.MLP

    def __init__(self, vocab: int, context: int, *, dim: int = 32, hidden: int = 256, key):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(vocab, dim, key=k1)
        self.mlp = eqx.nn.MLP(context * dim, vocab, hidden, 2, activation=jax.nn.gelu, key=k2)

    def __call__(self, context_ids):
        return self.mlp(jax.vmap(self.embed)(context_ids).reshape(-1))


def loss_fn(model, windows):
    logits = jax.vmap(model)(windows[:, :-1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, windows[:, -1]))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=variants("data"), default="auto")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    return parser.parse_args(argv)


def make_plan(args) -> eqxpar.Plan:
    return PLANS[f"data/{args.mode}"].plan()  # every device on `data`, automatic or manual


def main(argv=None):
    args = parse_args(argv)
    data = CharData()
    plan = make_plan(args)
    print(
        f"mesh {dict(plan.mesh.shape)}, mode {args.mode}, vocab {data.vocab_size}, {len(data.ids):,} characters"
    )

    model = CharMLP(data.vocab_size, args.context, key=jax.random.key(0))
    optimizer = adamw_warmup_cosine(3e-3, args.steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(loss_fn, optimizer, plan, accumulate=args.accumulate)
    eval_step = eqxpar.train.make_eval_step(loss_fn, plan)

    rng = np.random.default_rng(0)
    eval_batches = [data.windows(np.random.default_rng(1), 1024, args.context + 1, split="eval")]
    state = train(
        step,
        state,
        lambda: data.windows(rng, args.batch_size, args.context + 1),
        eval_step,
        eval_batches,
        steps=args.steps,
        every=100,
    )

    final = float(eqxpar.train.evaluate(eval_step, state, eval_batches)["loss"])
    print(f"final eval loss {final:.3f} nats/char (unigram entropy {data.unigram_entropy():.3f})")
    return final


if __name__ == "__main__":
    main()
