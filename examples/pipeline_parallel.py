"""Pipeline parallelism on 8 simulated CPU devices.

Trains a small causal character-level transformer on Python's own documentation
text, its blocks an `eqxpar.nn.Stacked` whose layers are split over the mesh axis
`pipe`: stage `s` holds a contiguous run of layers (with `--chunks v`, `v` runs
interleaved around the devices). The embedding and the head are replicated and
run on the first and last stage. The step is one `lax.scan` over the ticks of a
schedule table; the script prints the table and its bubble fractions first:

    python examples/pipeline_parallel.py                          # 1F1B, pipe 4 x data 2
    python examples/pipeline_parallel.py --schedule gpipe
    python examples/pipeline_parallel.py --schedule interleaved --chunks 2
    python examples/pipeline_parallel.py --schedule zero_bubble
    python examples/pipeline_parallel.py --hybrid                 # pipe 2 x data 2 x tensor 2
    python examples/pipeline_parallel.py --hybrid --fsdp          # pipe 2 x fsdp 2 x tensor 2

`--png schedule.png` also draws the table (needs matplotlib).
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
from _loop import adamw_warmup_cosine, train  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar import nn  # noqa: E402


class PipelinedTransformer(eqx.Module):
    """Embedding + positions, a stack of transformer blocks, final norm and head."""

    embed: nn.Embedding
    positions: jax.Array
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head: nn.Unembed

    def __init__(self, vocab, max_len, *, d_model, num_heads, d_hidden, num_layers, key):
        k_embed, k_pos, k_blocks, k_head = jax.random.split(key, 4)
        self.embed = nn.Embedding(vocab, d_model, key=k_embed)
        self.positions = 0.02 * jax.random.normal(k_pos, (max_len, d_model))
        self.blocks = nn.Stacked(
            lambda k: nn.TransformerBlock(d_model, num_heads, d_hidden, key=k), depth=num_layers, key=k_blocks
        )
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Unembed(d_model, vocab, key=k_head)


def first(model, windows):
    """Before the stack (first stage): token and position embeddings."""
    ids = windows[:, :-1]
    return model.embed(ids) + model.positions[None, : ids.shape[1]]


def last(model, h, windows):
    """After the stack (last stage): norm, head, mean cross-entropy."""
    return jnp.mean(nn.cross_entropy(model.head(model.norm(h)), windows[:, 1:]))


LOSS = eqxpar.pipeline.PipelineLoss(first, lambda m: m.blocks, last)


def main(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=eqxpar.pipeline.SCHEDULES, default="1f1b")
    parser.add_argument(
        "--stages", type=int, default=None, help="size of `pipe` (default 4, or 2 with --hybrid)"
    )
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=1, help="virtual stages per device (interleaved)")
    parser.add_argument("--hybrid", action="store_true", help="pipe 2 x data 2 x tensor 2")
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="put the other devices on `fsdp` rather than `data`: weights split over them too",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--png", default=None, help="save a picture of the schedule here")
    args = parser.parse_args(argv)

    stages = args.stages or (2 if args.hybrid else 4)
    tensor = 2 if args.hybrid else 1
    batch_axis = "fsdp" if args.fsdp else "data"
    mesh = eqxpar.make_mesh(pipe=stages, tensor=tensor, **{batch_axis: -1})
    schedule = eqxpar.pipeline.schedule(
        args.schedule, stages=stages, microbatches=args.microbatches, chunks=args.chunks
    )
    print(schedule)
    if args.png:
        eqxpar.pipeline.save_schedule_png(schedule, args.png)
        print(f"schedule picture saved to {args.png}")

    data = CharData()
    vocab = data.padded_vocab_size(tensor)  # the vocabulary is split over `tensor`
    plan = eqxpar.Plan(
        mesh,
        # MEGATRON_FSDP also splits the model dimension over `fsdp`; under a pipeline
        # those weights are gathered once per step and their gradients reduce-scattered.
        rules=eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON_FSDP if args.fsdp else eqxpar.rules.MEGATRON),
        schedule=args.schedule,
        microbatches=args.microbatches,
        chunks=args.chunks,
    )
    print(f"mesh {dict(mesh.shape)}, {args.layers} layers, vocab {vocab}")
    model = eqx.filter_jit(PipelinedTransformer)(
        vocab,
        args.seq_len,
        d_model=args.d_model,
        num_heads=args.heads,
        d_hidden=4 * args.d_model,
        num_layers=args.layers,
        key=jax.random.key(0),
    )
    # Interleaved stacks are stored in pipeline order (device d's chunks one after
    # the other); the identity for one chunk.
    model = eqx.tree_at(
        lambda m: m.blocks,
        model,
        eqxpar.pipeline.to_pipeline_order(model.blocks, stages=stages, chunks=args.chunks),
    )
    optimizer = adamw_warmup_cosine(args.lr, args.steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(LOSS, optimizer, plan)

    # Evaluation runs the same loss sequentially (PipelineLoss called as a
    # function) on the model put back in layer order, under plain jit.
    def sequential(model):
        return eqx.tree_at(
            lambda m: m.blocks,
            model,
            eqxpar.pipeline.from_pipeline_order(model.blocks, stages=stages, chunks=args.chunks),
        )

    evaluate = eqx.filter_jit(lambda model, batch: LOSS(sequential(model), batch))
    rng = np.random.default_rng(0)
    eval_batch = data.windows(np.random.default_rng(1), 64, args.seq_len + 1, split="eval")
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
    return final


if __name__ == "__main__":
    main()
