"""Data x FSDP x tensor parallelism (2 x 2 x 2) on 8 simulated CPU devices.

The character-level GPT of `fsdp.py` (defined in `_model.py`), unchanged, on a
mesh data=2 x fsdp=2 x tensor=2 with `eqxpar.rules.MEGATRON_FSDP` (`hybrid/*` in
`_plans.py`): attention
heads, MLP features and the vocabulary split over `tensor` (Megatron), the model
dimension of every weight over `fsdp`, the batch over `data` and `fsdp`. Each device
holds a quarter of the parameters and optimizer state. Prints the bytes each device
holds against the total, progress, the final evaluation loss against the unigram
entropy of the text, and the collectives one compiled step issues.

    python examples/hybrid.py                       # auto: jit; the compiler (GSPMD) places every collective
    python examples/hybrid.py --mode manual         # shard_map over all three axes; eqxpar issues them all
    python examples/hybrid.py --mode partial        # only `tensor` manual; data and fsdp stay automatic
    python examples/hybrid.py --sequence-parallel   # activations between blocks split along the sequence
    python examples/hybrid.py --remat dots          # keep only matmul outputs for the backward pass
    python examples/hybrid.py --bf16                # compute in bfloat16, float32 master weights and moments
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

import eqxpar  # noqa: E402


def make_plan(args) -> eqxpar.Plan:
    return PLANS[f"hybrid/{args.mode}"].plan(sequence_parallel=args.sequence_parallel, **plan_options(args))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=variants("hybrid"), default="auto")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split activations along the sequence over tensor (--seq-len a multiple of 2)",
    )
    parser.add_argument("--table", action="store_true", help="print the full sharding table")
    add_model_args(parser, steps=300)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = make_plan(args)
    print(
        f"data x FSDP x tensor, mode {args.mode}, sequence parallel {args.sequence_parallel}, "
        f"remat {args.remat}, compute {'bfloat16' if args.bf16 else 'float32'}"
    )
    return run(plan, args, show_table=args.table)


if __name__ == "__main__":
    main()
