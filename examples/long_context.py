"""Context parallelism (plus data or tensor parallelism) on 8 simulated CPU devices.

Trains the examples' causal character-level GPT (`eqxpar.models.GPT`, rotary
positions) on Python's own documentation text at a long sequence, split over the
mesh's `context` axis: each device holds two mirrored chunks of every sequence
(chunks i and 2n-1-i of 2n, so causal attention gives every device the same work),
and attention passes keys and values between the devices. Nothing in the model
changes; only the mesh and the plan (the plans are `context/*` in `_plans.py`):

    python examples/long_context.py                    # context 4 x data 2, ring attention (ppermute)
    python examples/long_context.py --mode allgather   # context 8, keys and values all-gathered once
    python examples/long_context.py --mode tensor      # data 2 x context 2 x tensor 2, sequence parallel

Prints progress, the final evaluation loss against the unigram entropy of the text
and the collectives one compiled step issues (collective-permutes for the ring).
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402

from _model import add_model_args, plan_options, run  # noqa: E402
from _plans import PLANS, variants  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=variants("context"), default="ring")
    add_model_args(parser, steps=150)
    parser.set_defaults(seq_len=512, batch_size=8, eval_every=50)
    return parser.parse_args(argv)


def make_plan(args):
    return PLANS[f"context/{args.mode}"].plan(**plan_options(args))


def main(argv=None):
    args = parse_args(argv)
    plan = make_plan(args)
    print(f"context parallel, mode {args.mode}, sequence {args.seq_len} over context={plan.context_size}")
    return run(plan, args, style=dict(rotary=True, learned_positions=False), memory=False)


if __name__ == "__main__":
    main()
