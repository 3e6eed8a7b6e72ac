"""From a pretrained checkpoint to a fine-tuned one, with LoRA, under a hybrid plan.

1. Text: a byte-level BPE tokenizer (the `tokenizers` package) trained on the
   shipped text (Python's help texts), or read from the checkpoint's tokenizer.json.
2. The base: `--base DIR` (a Llama-style Hugging Face checkpoint with its
   tokenizer.json), or, with none, a small Llama-shaped model pre-trained here for
   `--pretrain-steps` and written with `save_pretrained` (no download needed).
3. `from_pretrained(DIR, plan)` reads it straight into the plan (data 2 x fsdp 2 x
   tensor 2); `add_lora` puts rank-`--rank` adapters on every projection;
   `make_step(..., trainable=lora_trainable(model))` trains only them, with the
   held-out loss every `--eval-every` steps (`make_eval_step`, `evaluate`) and every
   step's metrics logged as JSON lines.
4. Samples text with the key/value-cached `generate` under the same plan, then
   writes the merged model (`merge_lora` + `save_pretrained`, which transformers
   reads) and the adapter alone in PEFT's format (`save_lora`).

    python examples/finetune_lora.py                       # pre-trains a small base first
    python examples/finetune_lora.py --base my-llama --out tuned --steps 200
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _loop import adamw_warmup_cosine, train  # noqa: E402
from _text import TokenData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar.models import GPT, GPTConfig, lm_loss  # noqa: E402

PROMPTS = ["The assert statement", "A class definition", "The for loop", "Exceptions are"]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--base", help="a Llama-style checkpoint directory with tokenizer.json (default: make one)"
    )
    parser.add_argument("--out", help="where to write merged/ and adapter/ (default: a temporary directory)")
    parser.add_argument("--pretrain-steps", type=int, default=60, help="of the base made here")
    parser.add_argument("--steps", type=int, default=40, help="LoRA fine-tuning steps")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sample-len", type=int, default=24)
    return parser.parse_args(argv)


def make_plan() -> eqxpar.Plan:
    # Hybrid: the batch over data x fsdp, weights sharded over fsdp, heads and the
    # MLP over tensor (automatic: the compiler places the collectives).
    return eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=2, tensor=2), rules=eqxpar.rules.MEGATRON_FSDP)


def pretrain_base(directory: pathlib.Path, text: TokenData, plan: eqxpar.Plan, args) -> None:
    """A small Llama-shaped model trained briefly on the text, saved as a Hugging Face
    checkpoint with its tokenizer: the stand-in for a downloaded base."""
    config = GPTConfig(
        vocab_size=text.vocab_size,
        d_model=128,
        num_heads=4,
        num_layers=2,
        d_hidden=256,
        num_kv_heads=2,
        max_seq_len=256,
        tied=False,
    )
    model = GPT(config, key=jax.random.key(0))
    optimizer = adamw_warmup_cosine(1e-2, args.pretrain_steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(lm_loss, optimizer, plan)
    rng = np.random.default_rng(0)
    for _ in range(args.pretrain_steps):
        state, metrics = step(state, text.windows(rng, args.batch_size, args.seq_len + 1))
        jax.block_until_ready(metrics["loss"])
    print(f"pre-trained the base for {args.pretrain_steps} steps: loss {float(metrics['loss']):.3f}")
    eqxpar.models.save_pretrained(state.model, directory)
    text.save(directory / "tokenizer.json")


def sample(model: GPT, text: TokenData, plan: eqxpar.Plan, args) -> list[str]:
    """Each prompt and its continuation, the prompts left-padded into one batch,
    top-p sampling."""
    encoded = [text.encode(p) for p in PROMPTS]
    width = max(len(ids) for ids in encoded)
    batch = np.zeros((len(encoded), width), np.int32)
    for row, ids in enumerate(encoded):
        batch[row, width - len(ids) :] = ids
    out = eqxpar.models.generate(
        model,
        jnp.asarray(batch),
        steps=args.sample_len,
        key=jax.random.key(2),
        temperature=0.8,
        top_p=0.9,
        prompt_lengths=[len(ids) for ids in encoded],
        plan=plan,
    )
    tokens = np.asarray(out.tokens)
    return [text.decode(tokens[row, width - len(ids) :]) for row, ids in enumerate(encoded)]


def main(argv=None) -> float:
    args = parse_args(argv)
    plan = make_plan()
    with tempfile.TemporaryDirectory() as tmp:
        base = pathlib.Path(args.base) if args.base else pathlib.Path(tmp) / "base"
        out = pathlib.Path(args.out) if args.out else pathlib.Path(tmp) / "out"
        if args.base is None:
            pretrain_base(base, TokenData(vocab_size=512), plan, args)
        text = TokenData(tokenizer_file=base / "tokenizer.json")
        print(f"tokenizer: {text.vocab_size} BPE ids; {len(text.ids):,} tokens of text")

        model = eqxpar.models.from_pretrained(base, plan)
        model = eqxpar.models.add_lora(
            model, rank=args.rank, targets=("q", "k", "v", "o", "gate", "up", "down"), key=jax.random.key(3)
        )
        trainable = eqxpar.models.lora_trainable(model)
        optimizer = adamw_warmup_cosine(args.lr, args.steps)
        state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(4), trainable=trainable)
        step = eqxpar.train.make_step(lm_loss, optimizer, plan, trainable=trainable)
        adapters = sum(x.size for x in jax.tree.leaves(eqx.filter(state.model, trainable)))
        print(f"LoRA rank {args.rank}: {adapters:,} trainable parameters; mesh {dict(plan.mesh.shape)}")

        eval_step = eqxpar.train.make_eval_step(lm_loss, plan)
        eval_batches = [text.windows(np.random.default_rng(1), 64, args.seq_len + 1, split="eval")]
        before = float(eqxpar.train.evaluate(eval_step, state, eval_batches)["loss"])
        print(f"eval loss before fine-tuning {before:.3f}")
        for line in sample(state.model, text, plan, args):
            print(f"  before | {line!r}")
        rng = np.random.default_rng(5)
        tracker = eqxpar.train.JsonLinesTracker(out / "metrics.jsonl")
        state = train(
            step,
            state,
            lambda: text.windows(rng, args.batch_size, args.seq_len + 1),
            eval_step,
            eval_batches,
            steps=args.steps,
            every=args.eval_every,
            tracker=tracker,
        )
        tracker.close()
        after = float(eqxpar.train.evaluate(eval_step, state, eval_batches)["loss"])
        print(f"final eval loss {after:.3f} (before fine-tuning {before:.3f})")
        for line in sample(state.model, text, plan, args):
            print(f"  after  | {line!r}")

        merged = eqxpar.models.merge_lora(state.model)
        eqxpar.models.save_pretrained(merged, out / "merged")
        text.save(out / "merged" / "tokenizer.json")
        eqxpar.models.save_lora(state.model, out / "adapter")
        # The merged checkpoint read back computes what the adapted model computed.
        reread = eqxpar.models.from_pretrained(out / "merged", plan)
        check = float(eqxpar.train.evaluate(eval_step, reread, eval_batches)["loss"])
        print(
            f"wrote {out / 'merged'} (eval loss read back {check:.3f}) and the PEFT adapter {out / 'adapter'}"
        )
        return after


if __name__ == "__main__":
    main()
