"""Fully sharded data parallelism (FSDP), ZeRO-1 and HSDP on 8 simulated CPU devices.

Trains the small character-level GPT of `_model.py` (`eqxpar.models.GPT`, its
blocks a scanned `nn.Stacked`) on Python's own documentation text. By default
the mesh is fsdp=8: the batch is split eight ways, and so is the model dimension
("embed") of every weight, and with it the gradients and AdamW's moments; each
device holds about 1/8 of the parameters and optimizer state, and the step gathers
the weights when it needs them and reduce-scatters the gradients. It prints the
bytes each device holds against the total, progress, the final evaluation loss
against the unigram entropy of the text (what a model that ignores context would
reach), and the collectives one compiled step issues.

    python examples/fsdp.py                    # FSDP, auto: jit; the compiler (GSPMD) places the collectives
    python examples/fsdp.py --mode manual      # shard_map: eqxpar gathers one layer at a time inside the scan
    python examples/fsdp.py --zero1            # ZeRO-1: data=8, parameters replicated, optimizer state split
    python examples/fsdp.py --hsdp             # HSDP: data=2 x fsdp=4, sharded in groups of 4, replicated across
    python examples/fsdp.py --remat inputs     # keep only each block's input for the backward pass
    python examples/fsdp.py --bf16             # compute in bfloat16, float32 master weights and moments

Every variant trains the same model on the same batches; they differ in what each
device stores and what the step communicates. The plans are `fsdp/*` in `_plans.py`.
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
from _plans import PLANS  # noqa: E402

import eqxpar  # noqa: E402


def make_plan(args) -> eqxpar.Plan:
    variant = "zero1" if args.zero1 else "hsdp" if args.hsdp else "fsdp"
    return PLANS[f"fsdp/{variant}"].plan(mode=args.mode, **plan_options(args))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=["auto", "manual"], default="auto")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--zero1", action="store_true", help="ZeRO-1 on data=8 instead of FSDP")
    group.add_argument("--hsdp", action="store_true", help="data=2 x fsdp=4 instead of fsdp=8")
    parser.add_argument("--table", action="store_true", help="print the full sharding table")
    add_model_args(parser, steps=300)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    plan = make_plan(args)
    kind = "ZeRO-1" if args.zero1 else "HSDP" if args.hsdp else "FSDP"
    print(f"{kind}, mode {args.mode}, remat {args.remat}, compute {'bfloat16' if args.bf16 else 'float32'}")
    return run(plan, args, show_table=args.table)


if __name__ == "__main__":
    main()
