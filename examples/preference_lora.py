"""Preference tuning (DPO) of a loaded model with LoRA, the base as its own reference.

1. Text: Python's shipped help texts (`pydoc_data.topics`), as characters.
2. The base: a small Llama-shaped model pre-trained here for `--pretrain-steps` and
   written with `save_pretrained` (a stand-in for a downloaded checkpoint), then
   read back with `from_pretrained(DIR, plan)` straight into the plan (data 2 x
   fsdp 2 x tensor 2).
3. Preference pairs from the text: a prompt (a window of the text), the chosen
   completion (what the text says next) and the rejected one (the same characters
   shuffled). `add_lora` puts adapters on every projection; `make_step` trains
   them alone with `eqxpar.models.dpo_loss`, whose reference is the same model with
   its adapters switched off: no second copy of the weights. Every step's loss and
   reward metrics go to the trackers (JSON lines), the held-out DPO loss every
   `--eval-every` steps.
4. Writes the adapter in PEFT's format (`save_lora`).

    python examples/preference_lora.py
    python examples/preference_lora.py --steps 100 --out tuned
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from _loop import adamw_warmup_cosine, train  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar.models import GPT, GPTConfig, lm_loss  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--out", help="where to write adapter/ and metrics.jsonl (default: a temporary directory)"
    )
    parser.add_argument("--pretrain-steps", type=int, default=40, help="of the base made here")
    parser.add_argument("--steps", type=int, default=30, help="DPO steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=16, help="preference pairs per step")
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--completion-len", type=int, default=16)
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--lr", type=float, default=5e-3)
    return parser.parse_args(argv)


def make_plan() -> eqxpar.Plan:
    return eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=2, tensor=2), rules=eqxpar.rules.MEGATRON_FSDP)


def pretrain_base(directory: pathlib.Path, text: CharData, plan: eqxpar.Plan, args) -> None:
    """A small model trained briefly on the text, saved as a Hugging Face checkpoint."""
    config = GPTConfig(
        vocab_size=text.padded_vocab_size(2),
        d_model=64,
        num_heads=4,
        num_kv_heads=2,
        num_layers=2,
        d_hidden=128,
        max_seq_len=64,
        tied=False,
    )
    model = GPT(config, key=jax.random.key(0))
    optimizer = adamw_warmup_cosine(1e-2, args.pretrain_steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(lm_loss, optimizer, plan)
    rng = np.random.default_rng(0)
    length = args.prompt_len + args.completion_len
    for _ in range(args.pretrain_steps):
        state, metrics = step(state, text.windows(rng, 2 * args.pairs, length))
        jax.block_until_ready(metrics["loss"])
    print(f"pre-trained the base for {args.pretrain_steps} steps: loss {float(metrics['loss']):.3f}")
    eqxpar.models.save_pretrained(state.model, directory)


def preference_pairs(text: CharData, rng: np.random.Generator, args, *, split: str = "train") -> dict:
    """`dpo_loss`'s batch: per pair a prompt of the text, its true continuation
    (chosen) and those characters shuffled (rejected); the weights mark the
    completions' tokens."""
    n, p, c = args.pairs, args.prompt_len, args.completion_len
    windows = text.windows(rng, n, p + c, split=split)
    shuffled = windows.copy()
    for row in shuffled:
        rng.shuffle(row[p:])
    weights = np.zeros((n, p + c), np.float32)
    weights[:, p:] = 1.0  # aligned with the tokens: the completion's count
    return {"chosen": windows, "rejected": shuffled, "chosen_weights": weights, "rejected_weights": weights}


def main(argv=None) -> dict:
    args = parse_args(argv)
    plan = make_plan()
    text = CharData()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(tmp) / "base"
        out = pathlib.Path(args.out) if args.out else pathlib.Path(tmp) / "out"
        pretrain_base(base, text, plan, args)

        model = eqxpar.models.from_pretrained(base, plan)
        model = eqxpar.models.add_lora(
            model, rank=args.rank, targets=("q", "k", "v", "o", "gate", "up", "down"), key=jax.random.key(3)
        )
        trainable = eqxpar.models.lora_trainable(model)
        optimizer = adamw_warmup_cosine(args.lr, args.steps)
        state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(4), trainable=trainable)
        # The reference is `model` with its adapters off: dpo_loss needs nothing else.
        loss_fn = functools.partial(eqxpar.models.dpo_loss, beta=args.beta, metrics=True)
        step = eqxpar.train.make_step(loss_fn, optimizer, plan, trainable=trainable, has_aux=True)
        eval_step = eqxpar.train.make_eval_step(loss_fn, plan, has_aux=True)
        eval_batches = [preference_pairs(text, np.random.default_rng(1), args, split="eval")]
        before = eqxpar.train.evaluate(eval_step, state, eval_batches)
        print(f"held-out DPO loss before {float(before['loss']):.4f} (log 2 = 0.6931: policy = reference)")

        rng = np.random.default_rng(5)
        tracker = eqxpar.train.JsonLinesTracker(out / "metrics.jsonl")
        state = train(
            step,
            state,
            lambda: preference_pairs(text, rng, args),
            eval_step,
            eval_batches,
            steps=args.steps,
            every=args.eval_every,
            tracker=tracker,
        )
        tracker.close()
        after = eqxpar.train.evaluate(eval_step, state, eval_batches)
        aux = {k: float(v) for k, v in after["aux"].items()}
        print(
            f"held-out DPO loss after {float(after['loss']):.4f}; reward accuracy "
            f"{aux['reward_accuracy']:.2f}, margin {aux['reward_margin']:.4f}"
        )
        eqxpar.models.save_lora(state.model, out / "adapter")
        print(f"wrote the PEFT adapter {out / 'adapter'} and the metrics {out / 'metrics.jsonl'}")
        return {"before": float(before["loss"]), "after": float(after["loss"]), **aux}


if __name__ == "__main__":
    main()
