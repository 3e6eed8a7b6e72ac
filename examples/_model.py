"""The character-level transformer that `fsdp.py` and `hybrid.py` train, and the
run they share: build the model, print where its parameters and optimizer state
live, train with `_loop.train`, and report the final evaluation loss.

The model is written once in `eqxpar.nn` layers; the examples change only the mesh
and the plan. Its blocks are an `nn.Stacked` (one scanned block, compiled once
whatever the depth), so `Plan(remat=...)` decides what the backward pass keeps and a
manual FSDP step gathers one layer's weights at a time.
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
from eqxpar import nn


class CharLM(eqx.Module):
    """Token + learned position embeddings, a scanned stack of pre-norm transformer
    blocks (SwiGLU MLP, RMSNorm), a final norm and the output head."""

    embed: nn.Embedding
    positions: jax.Array  # a plain array: no logical axes, so no rule splits it (replicated)
    blocks: nn.Stacked
    norm: nn.RMSNorm
    head: nn.Unembed

    def __init__(self, vocab, max_len, *, d_model, num_heads, d_hidden, num_layers, key):
        k_embed, k_pos, k_blocks, k_head = jax.random.split(key, 4)
        self.embed = nn.Embedding(vocab, d_model, key=k_embed)
        self.positions = 0.02 * jax.random.normal(k_pos, (max_len, d_model))
        self.blocks = nn.Stacked(
            lambda k: nn.TransformerBlock(
                d_model, num_heads, d_hidden, activation="swiglu", norm="rms", key=k
            ),
            depth=num_layers,
            key=k_blocks,
        )
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Unembed(d_model, vocab, key=k_head)

    def __call__(self, ids):
        # Under sequence parallelism inside shard_map the embedding returns this
        # device's block of the sequence, so it takes that block of the positions.
        positions = nn.split_sequence(self.positions[: ids.shape[1]], seq_dim=0)
        h = self.embed(ids) + positions  # (batch, seq or seq block, d_model)
        h = self.blocks(h)
        # Logits (vocabulary split over `tensor` where a plan says so); cross_entropy
        # reduces them without gathering the vocabulary.
        return self.head(self.norm(h))


def loss_fn(model, windows):
    logits = model(windows[:, :-1])
    return jnp.mean(nn.cross_entropy(logits, windows[:, 1:]))


def add_model_args(parser: argparse.ArgumentParser, *, steps: int) -> None:
    """The flags every example shares: training length, model size, remat, bf16."""
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=32, help="a multiple of the data-parallel size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64, help="a multiple of the fsdp size")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--remat",
        choices=("none", "dots", "inputs", "full"),
        default="none",
        help="what the scanned stack keeps for the backward pass",
    )
    parser.add_argument("--bf16", action="store_true", help="compute in bfloat16 (float32 master weights)")


def plan_dtypes(args) -> dict:
    """The Plan keywords of `--bf16`."""
    return dict(compute_dtype=jnp.bfloat16) if args.bf16 else {}


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


def run(plan, args, *, vocab_multiple: int = 1, show_table: bool = False) -> float:
    """Train `CharLM` under `plan` with the shared flags; returns the final eval loss."""
    start = time.perf_counter()
    data = CharData()
    # The vocabulary may be split over `tensor`: pad it to a multiple (the extra ids never occur).
    vocab = data.padded_vocab_size(vocab_multiple)
    mesh_text = " x ".join(f"{k}={v}" for k, v in plan.mesh.shape.items() if v > 1)
    print(f"mesh {mesh_text}, vocab {vocab}, {len(data.ids):,} characters")

    # Built under jit: one compilation for the whole initialisation.
    model = eqx.filter_jit(CharLM)(
        vocab,
        args.seq_len,
        d_model=args.d_model,
        num_heads=args.heads,
        d_hidden=4 * args.d_model,
        num_layers=args.layers,
        key=jax.random.key(0),
    )
    optimizer = adamw_warmup_cosine(args.lr, args.steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    if show_table:
        print(eqxpar.inspect.sharding_table(state, plan))
    print("bytes held (parameters and AdamW moments, float32):")
    print(memory_summary(state, plan))

    step = eqxpar.train.make_step(loss_fn, optimizer, plan)
    # The trained model holds ordinary (sharded) global arrays, so it evaluates
    # under plain jit (in float32) whatever the plan it was trained with.
    evaluate = eqx.filter_jit(loss_fn)
    rng = np.random.default_rng(0)
    eval_batch = eqxpar.shard_batch(
        data.windows(np.random.default_rng(1), 128, args.seq_len + 1, split="eval"), plan
    )
    state = train(
        step,
        state,
        lambda: data.windows(rng, args.batch_size, args.seq_len + 1),
        lambda model: evaluate(model, eval_batch),
        steps=args.steps,
        every=args.eval_every,
    )
    final = float(evaluate(state.model, eval_batch))
    print(
        f"final eval loss {final:.3f} nats/char (unigram entropy {data.unigram_entropy():.3f}); "
        f"{time.perf_counter() - start:.1f} s"
    )

    print_collectives(step, state, data.windows(rng, args.batch_size, args.seq_len + 1))
    return final
