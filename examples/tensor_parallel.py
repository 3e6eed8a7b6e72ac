"""Tensor parallelism (plus data parallelism) on 8 simulated CPU devices.

Trains a small causal character-level transformer, built from the tensor-parallel
layers of `eqxpar.nn`, on Python's own documentation text. The mesh is 2 (data) x
4 (tensor); `eqxpar.rules.MEGATRON` splits the attention heads, the MLP's hidden
features and the vocabulary over `tensor`. Prints progress, the final evaluation
loss against the unigram entropy of the text (what a model that ignores context
would reach), and the collectives one compiled step issues. Every mode computes
the same losses; they differ in how they communicate:

    python examples/tensor_parallel.py                 # auto: jit; the compiler (GSPMD) places the collectives
    python examples/tensor_parallel.py --mode sync     # shard_map: an all-reduce after each row-parallel layer
    python examples/tensor_parallel.py --mode sp       # + sequence parallel: all-gathers and reduce-scatters
    python examples/tensor_parallel.py --mode overlap  # + ring collective matmuls: collective-permutes
    python examples/tensor_parallel.py --mode partial  # sp with only `tensor` manual; `data` is the compiler's

(In the partial mode the gathers and scatters also run as collective-permute rings:
XLA would otherwise gather the batch that the automatic `data` axis splits.)
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _loop import adamw_warmup_cosine, print_collectives, train  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar import nn  # noqa: E402

TENSOR = 4

#: --mode -> the Plan's keyword arguments.
MODES = {
    "auto": dict(mode="auto"),
    "sync": dict(mode="manual"),
    "sp": dict(mode="manual", sequence_parallel=True),
    "overlap": dict(mode="manual", sequence_parallel=True, tp_overlap=True),
    "partial": dict(mode="manual", manual_axes=("tensor",), sequence_parallel=True),
}


class CharTransformer(eqx.Module):
    """Token + learned position embeddings, transformer blocks, final norm, output head."""

    embed: nn.Embedding
    positions: jax.Array  # a plain array: no rule claims it, so it is replicated
    blocks: list[nn.TransformerBlock]
    norm: nn.LayerNorm
    head: nn.Unembed

    def __init__(self, vocab, max_len, *, d_model, num_heads, d_hidden, num_layers, key):
        k_embed, k_pos, k_head, *k_blocks = jax.random.split(key, 3 + num_layers)
        self.embed = nn.Embedding(vocab, d_model, key=k_embed)
        self.positions = 0.02 * jax.random.normal(k_pos, (max_len, d_model))
        self.blocks = [nn.TransformerBlock(d_model, num_heads, d_hidden, key=k) for k in k_blocks]
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Unembed(d_model, vocab, key=k_head)

    def __call__(self, ids):
        # Under sequence parallelism in shard_map the embedding returns this device's
        # block of the sequence, so it takes the positions of that block (a slice).
        positions = nn.split_sequence(self.positions[: ids.shape[1]], seq_dim=0)
        h = self.embed(ids) + positions  # (batch, seq or seq block, d_model)
        for block in self.blocks:
            h = block(h)
        # Logits come back with the whole sequence and the vocabulary split over
        # `tensor`; cross_entropy reduces them without ever gathering the vocabulary.
        return self.head(self.norm(h))


def loss_fn(model, windows):
    logits = model(windows[:, :-1])
    return jnp.mean(nn.cross_entropy(logits, windows[:, 1:]))


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=list(MODES), default="auto")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64, help=f"a multiple of {TENSOR}")
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4, help=f"a multiple of {TENSOR}")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    data = CharData()
    mesh = eqxpar.make_mesh(data=2, tensor=TENSOR)
    plan = eqxpar.Plan(mesh, rules=eqxpar.rules.MEGATRON, **MODES[args.mode])
    # The vocabulary is split over `tensor`: pad it to a multiple (the extra ids never occur).
    vocab = data.padded_vocab_size(TENSOR)
    print(f"mesh {dict(mesh.shape)}, mode {args.mode}, vocab {vocab}, {len(data.ids):,} characters")

    # Built under jit: one compilation for the whole initialisation, not one per random array.
    model = eqx.filter_jit(CharTransformer)(
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
    step = eqxpar.train.make_step(loss_fn, optimizer, plan)
    # The trained model holds ordinary (sharded) global arrays, so it evaluates
    # under plain jit whatever the mode it was trained in.
    evaluate = eqx.filter_jit(loss_fn)

    rng = np.random.default_rng(0)
    eval_batch = eqxpar.shard_batch(
        data.windows(np.random.default_rng(1), 256, args.seq_len + 1, split="eval"), plan
    )
    state = train(
        step,
        state,
        lambda: data.windows(rng, args.batch_size, args.seq_len + 1),
        lambda model: evaluate(model, eval_batch),
        steps=args.steps,
        every=50,
    )

    final = float(evaluate(state.model, eval_batch))
    print(f"final eval loss {final:.3f} nats/char (unigram entropy {data.unigram_entropy():.3f})")

    print_collectives(step, state, data.windows(rng, args.batch_size, args.seq_len + 1))
    return final


if __name__ == "__main__":
    main()
