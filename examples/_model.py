"""The character-level GPT that `tensor_parallel.py`, `fsdp.py`, `hybrid.py` and
`pipeline_parallel.py` train, and the run they share: build the model, print where
its parameters and optimizer state live, train with `_loop.train`, and report the
final evaluation loss and what one step communicates.

The model is `eqxpar.models.GPT` with learned positions, biases and an untied head;
the examples change only the plan (from `_plans.PLANS`). Its blocks are an
`nn.Stacked` (one scanned block, compiled once whatever the depth), so
`Plan(remat=...)` decides what the backward pass keeps, a manual FSDP step gathers
one layer's weights at a time, and a pipeline plan splits the layers into stages.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from _loop import adamw_warmup_cosine, print_collectives, train
from _text import CharData

import eqxpar
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss

#: `lm_loss` cut into the pieces a pipeline runs: the embedding on the first stage,
#: the stacked blocks over the stages, the head and the loss on the last.
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)


def add_model_args(parser: argparse.ArgumentParser, *, steps: int, layers: int = 2) -> None:
    """The flags every GPT example shares: training length, model size, remat, bf16."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="a multiple of the data-parallel size")
    parser.add_argument(
        "--seq-len", type=int, default=64, help="a multiple of the tensor size under sequence parallelism"
    )
    parser.add_argument("--d-model", type=int, default=64, help="a multiple of the fsdp size")
    parser.add_argument("--heads", type=int, default=4, help="a multiple of the tensor size")
    parser.add_argument("--layers", type=int, default=layers, help="a multiple of the pipeline stages")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--remat",
        choices=("none", "dots", "inputs", "full"),
        default="none",
        help="what the scanned stack keeps for the backward pass",
    )
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 (float32 master weights)")


def plan_options(args: argparse.Namespace) -> dict:
    """The Plan keywords of `--remat` and `--bf16`."""
    return dict(remat=args.remat, **(dict(compute_dtype=jnp.bfloat16) if args.bf16 else {}))


def char_config(args: argparse.Namespace, vocab: int, **style) -> GPTConfig:
    """The examples' GPT: learned positions, biases, an untied head; SwiGLU and
    RMSNorm unless `style` says otherwise (`activation=`, `norm=`, `rotary=`, ...)."""
    return GPTConfig(
        vocab_size=vocab,
        d_model=args.d_model,
        num_heads=args.heads,
        num_layers=args.layers,
        d_hidden=4 * args.d_model,
        max_seq_len=args.seq_len,
        tied=False,
        use_bias=True,
        **{"activation": "swiglu", "norm": "rms", "rotary": False, "learned_positions": True, **style},
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def memory_summary(state, plan) -> str:
    """Per-device vs total bytes of the parameters and the optimizer state."""
    table = eqxpar.inspect.sharding_table(state, plan)
    lines = []
    for name, prefix in (("parameters", ".model"), ("optimizer state", ".opt_state")):
        rows = [r for r in table.rows if r.path.startswith(prefix)]
        total = sum(r.bytes for r in rows)
        per_device = sum(r.bytes_per_device for r in rows)
        lines.append(
            f"  {name:<16} {_mb(per_device):>10} per device of {_mb(total):>10} ({per_device / total:.0%})"
        )
    lines.append(
        f"  {'together':<16} {_mb(table.bytes_per_device):>10} per device of {_mb(table.bytes):>10} "
        f"({table.bytes_per_device / table.bytes:.0%})"
    )
    return "\n".join(lines)


def run(
    plan: eqxpar.Plan,
    args: argparse.Namespace,
    *,
    style: dict | None = None,
    memory: bool = True,
    collectives: bool = True,
    show_table: bool = False,
) -> float:
    """Train the examples' GPT (`char_config(args, vocab, **style)`) under `plan` with
    the shared flags; returns the final eval loss. A pipeline plan trains
    `PIPELINE_LOSS`, any other `lm_loss`."""
    start = time.perf_counter()
    data = CharData()
    # The vocabulary is split over `tensor`: pad it to a multiple (the extra ids never occur).
    vocab = data.padded_vocab_size(plan.mesh.shape.get("tensor", 1))
    mesh_text = " x ".join(f"{k}={v}" for k, v in plan.mesh.shape.items() if v > 1)
    print(f"mesh {mesh_text}, {args.layers} layers, vocab {vocab}, {len(data.ids):,} characters")

    # Built under jit: one compilation for the whole initialisation. In natural
    # layer order: init stores the stack in the order the plan runs it in.
    model = eqx.filter_jit(GPT)(char_config(args, vocab, **(style or {})), key=jax.random.key(0))
    optimizer = adamw_warmup_cosine(args.lr, args.steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    if show_table:
        print(eqxpar.inspect.sharding_table(state, plan))
    if memory:
        print("bytes held (parameters and AdamW moments, float32):")
        print(memory_summary(state, plan))

    loss_fn = PIPELINE_LOSS if plan.schedule else lm_loss
    step = eqxpar.train.make_step(loss_fn, optimizer, plan)
    # Held-out loss under the same plan (a pipeline runs its forwards only).
    eval_step = eqxpar.train.make_eval_step(loss_fn, plan)
    rng = np.random.default_rng(0)
    eval_batches = [data.windows(np.random.default_rng(1), 128, args.seq_len + 1, split="eval")]
    state = train(
        step,
        state,
        lambda: data.windows(rng, args.batch_size, args.seq_len + 1),
        eval_step,
        eval_batches,
        steps=args.steps,
        every=args.eval_every,
    )
    final = float(eqxpar.train.evaluate(eval_step, state, eval_batches)["loss"])
    print(
        f"final eval loss {final:.3f} nats/char (unigram entropy {data.unigram_entropy():.3f}); "
        f"{time.perf_counter() - start:.1f} s"
    )
    if collectives:
        print_collectives(step, state, data.windows(rng, args.batch_size, args.seq_len + 1))
    return final
