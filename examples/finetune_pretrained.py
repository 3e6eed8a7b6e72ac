"""Fine-tune a Hugging Face checkpoint under a plan given on the command line.

`eqxpar.models.from_pretrained` reads the directory (config.json + safetensors)
straight into the plan's sharding, each device reading only its block; a few
AdamW steps train on the shipped text (`_text.py`, Python's help texts); the
result is written back in Hugging Face format with `save_pretrained` (one tensor
at a time) and read again, and the reloaded model's loss is printed beside the
trained one's (they are equal: the round trip is exact).

With no `--path` it first writes a tiny random Llama-shaped checkpoint itself.
The text is tokenised by characters (ids below the checkpoint's vocabulary): a
stand-in that fits only that tiny model. For a real checkpoint, tokenise with the
`tokenizers` package and its tokenizer.json (docs/guides/pretrained.md).

    python examples/finetune_pretrained.py                              # tiny random checkpoint, hybrid plan
    python examples/finetune_pretrained.py --plan fsdp/fsdp --steps 50
    python examples/finetune_pretrained.py --path Llama-3.2-1B --plan fsdp/fsdp --bf16 --out finetuned
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import pathlib  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _plans import PLANS  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar.models import GPT, GPTConfig, from_pretrained, gpt_first, gpt_last, lm_loss, save_pretrained  # noqa: E402

# Plans of the table that train a GPT on a (batch, seq + 1) token batch.
CHOICES = [name for name in PLANS if not name.startswith(("vit/", "context/", "demo/"))]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--path", help="a Hugging Face checkpoint directory (default: make a tiny one)")
    parser.add_argument("--plan", choices=CHOICES, default="hybrid/auto", help="a plan of examples/_plans.py")
    parser.add_argument("--out", help="where to save the fine-tuned model (default: a temporary directory)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="hold the weights in bfloat16")
    parser.add_argument("--d-model", type=int, default=64, help="of the tiny checkpoint")
    parser.add_argument("--layers", type=int, default=2, help="of the tiny checkpoint")
    return parser.parse_args(argv)


def tiny_checkpoint(directory: pathlib.Path, data: CharData, args) -> pathlib.Path:
    """A random Llama-shaped model written in Hugging Face format: a stand-in for a download."""
    config = GPTConfig(
        vocab_size=data.padded_vocab_size(8),
        d_model=args.d_model,
        num_heads=4,
        num_kv_heads=2,
        num_layers=args.layers,
        d_hidden=2 * args.d_model,
        tied=False,
        norm_eps=1e-5,
        max_seq_len=args.seq_len,
    )
    save_pretrained(GPT(config, key=jax.random.key(0)), directory)
    return directory


def main(argv=None) -> float:
    args = parse_args(argv)
    data = CharData()
    work = pathlib.Path(tempfile.mkdtemp(prefix="finetune-"))
    path = pathlib.Path(args.path) if args.path else tiny_checkpoint(work / "initial", data, args)
    plan = PLANS[args.plan].plan()
    model = from_pretrained(path, plan, dtype=jnp.bfloat16 if args.bf16 else None)
    c = model.config
    print(
        f"loaded {path}: {c.num_layers} layers, d_model {c.d_model}, vocab {c.vocab_size}, plan {args.plan}"
    )
    if data.vocab_size > c.vocab_size:
        raise SystemExit(
            f"the text's {data.vocab_size} characters do not fit the vocabulary of {c.vocab_size}"
        )
    pipeline = plan.schedule is not None
    loss_fn = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last) if pipeline else lm_loss
    optim = optax.adamw(args.lr)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss_fn, optim, plan)
    rng = np.random.default_rng(0)
    for i in range(args.steps):
        state, metrics = step(state, data.windows(rng, args.batch_size, args.seq_len + 1))
        print(f"step {i + 1}: loss {float(metrics['loss']):.3f}")
    out = pathlib.Path(args.out) if args.out else work / "finetuned"
    save_pretrained(state.model, out)
    print(f"saved {out}: {sorted(p.name for p in out.iterdir())}")
    held_out = jnp.asarray(
        data.windows(np.random.default_rng(1), args.batch_size, args.seq_len + 1, split="eval")
    )
    value = eqxpar.train.make_value_and_grad(loss_fn, plan)
    trained = float(value(state.model, held_out)[0])
    reloaded = float(value(from_pretrained(out, plan), held_out)[0])
    print(f"held-out loss: trained {trained:.4f}, reloaded {reloaded:.4f}")
    return reloaded


if __name__ == "__main__":
    main()
