"""A mixture-of-experts GPT on 8 simulated CPU devices.

Trains `eqxpar.models.GPT` with `GPTConfig(moe_every=2, experts=8, top_k=2)`: every
second block's MLP is an `eqxpar.nn.MoE` layer of 8 experts, each token routed to
the 2 its router scores highest. The blocks are one scanned `nn.Stacked` of groups
(a dense block, then an MoE block), so compiling does not grow with depth.
`lm_loss` adds the auxiliary losses the config weighs (load balance 0.01, router
z 1e-3) to the next-character cross-entropy, so the router learns to spread the
tokens over the experts. The data is Python's own documentation text
(`pydoc_data.topics`, no download).

The mesh is expert 4 x data 2 (`Plan(make_mesh(expert=4, data=2),
rules=rules.EXPERT)`): the batch is split over all 8 devices, each device of
`expert` holds 2 of the 8 experts (and their optimizer state), and every MoE layer
sends each token to the device holding its expert and back with two all-to-alls
(backward: two more); everything else is data parallel.

    python examples/moe_gpt.py                          # 4 blocks, 2 of them MoE, 8 experts, top-2
    python examples/moe_gpt.py --moe-every 1 --top-k 1  # every block MoE, Switch-style top-1
    python examples/moe_gpt.py --expert 1               # data 8: every device holds every expert

Prints the evaluation loss before training and as it falls (cross-entropy only,
in nats per character, against the unigram entropy of the text; the training
loss beside it includes the auxiliary losses), then each MoE
block's expert load on the evaluation batch: the share of routed tokens each
expert takes (1 / experts each when perfectly balanced), before and after.
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _loop import adamw_warmup_cosine, train  # noqa: E402
from _model import add_model_args, char_config, plan_options  # noqa: E402
from _text import CharData  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar.models import GPT, lm_loss  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_args(parser, steps=300, layers=4)
    # Smaller batches than the dense examples': on CPU an MoE block costs several
    # dense ones (routing, sorting, all-to-alls and grouped matmuls over every token).
    parser.set_defaults(batch_size=16, seq_len=32)
    parser.add_argument("--moe-every", type=int, default=2, help="every k-th block is MoE; divides --layers")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2, help="experts per token")
    parser.add_argument(
        "--capacity-factor", type=float, default=None, help="cap each expert's tokens (default: dropless)"
    )
    parser.add_argument(
        "--expert", type=int, default=4, help="devices the experts are split over (divides 8 and --experts)"
    )
    return parser.parse_args(argv)


def make_plan(args) -> eqxpar.Plan:
    # The rest of the 8 devices on `data`; rules.EXPERT splits the experts'
    # weights (logical axis "experts") over `expert`, everything else replicated.
    mesh = eqxpar.make_mesh(expert=args.expert, data=8 // args.expert)
    return eqxpar.Plan(mesh, rules=eqxpar.rules.EXPERT, **plan_options(args))


def held_out_loss(model: GPT, batch: jax.Array) -> tuple[jax.Array, eqxpar.nn.MoEAux]:
    """The mean next-character cross-entropy (without the auxiliary losses that
    `lm_loss` adds) and the MoE blocks' aux, on one batch."""
    logits, aux = model.logits_and_aux(batch[:, :-1])
    head = model.embed if model.head is None else model.head
    return jnp.mean(eqxpar.nn.cross_entropy(logits, batch[:, 1:], head=head)), aux


def print_load(aux: eqxpar.nn.MoEAux, when: str) -> None:
    """Each MoE block's share of the routed tokens per expert."""
    load = np.asarray(aux.expert_load)
    share = load / load.sum(axis=1, keepdims=True)
    print(f"{when}: expert load (share of routed tokens; {1 / load.shape[1]:.3f} each when balanced)")
    for i, row in enumerate(share):
        print(
            f"  expert load (share of routed tokens), MoE block {i}: "
            + " ".join(f"{v:.3f}" for v in row)
            + f"  (max / mean {row.max() * len(row):.2f})"
        )


def main(argv=None) -> float:
    args = parse_args(argv)
    start = time.perf_counter()
    plan = make_plan(args)
    data = CharData()
    config = char_config(
        args,
        data.vocab_size,
        moe_every=args.moe_every,
        experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
    )
    mesh_text = " x ".join(f"{k} {v}" for k, v in plan.mesh.shape.items() if v > 1)
    print(
        f"MoE GPT: {config.num_layers} blocks, {config.moe_layers} of them MoE (every {config.moe_every}), "
        f"{config.experts} experts, top-{config.top_k}; mesh {mesh_text} "
        f"({config.experts // plan.expert_size} experts per device), plan mode {plan.mode}"
    )
    # Built under jit: one compilation for the whole initialisation.
    model = eqx.filter_jit(GPT)(config, key=jax.random.key(0))
    params = sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    print(f"{params:,} parameters; vocab {data.vocab_size}, {len(data.ids):,} characters")

    optimizer = adamw_warmup_cosine(args.lr, args.steps)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(lm_loss, optimizer, plan)
    # Held-out loss under the same plan, with the MoE blocks' aux averaged over it.
    eval_step = eqxpar.train.make_eval_step(held_out_loss, plan, has_aux=True)
    eval_batches = [data.windows(np.random.default_rng(1), 128, args.seq_len + 1, split="eval")]
    initial = eqxpar.train.evaluate(eval_step, state, eval_batches)
    print(f"initial eval loss {float(initial['loss']):.3f} nats/char")

    rng = np.random.default_rng(0)
    state = train(
        step,
        state,
        lambda: data.windows(rng, args.batch_size, args.seq_len + 1),
        eval_step,
        eval_batches,
        steps=args.steps,
        every=args.eval_every,
    )
    evaluated = eqxpar.train.evaluate(eval_step, state, eval_batches)
    final, aux, initial_aux = evaluated["loss"], evaluated["aux"], initial["aux"]
    print(
        f"final eval loss {float(final):.3f} nats/char (unigram entropy {data.unigram_entropy():.3f}); "
        f"{time.perf_counter() - start:.1f} s"
    )
    print_load(initial_aux, "before training")
    print_load(aux, "after training")
    return float(final)


if __name__ == "__main__":
    main()
