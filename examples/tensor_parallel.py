"""Tensor parallelism (plus data parallelism) on 8 simulated CPU devices.

Trains a small causal character-level transformer (`eqxpar.models.GPT`, built from
the tensor-parallel layers of `eqxpar.nn`; GELU, LayerNorm, learned positions) on
Python's own documentation text. The mesh is 2 (data) x 4 (tensor);
`eqxpar.rules.MEGATRON` splits the attention heads, the MLP's hidden features and
the vocabulary over `tensor` (the plans are `tensor/*` in `_plans.py`). Prints
progress, the final evaluation loss against the unigram entropy of the text (what
a model that ignores context would reach), and the collectives one compiled step
issues. Every mode computes the same losses; they differ in how they communicate:

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

from _model import add_model_args, plan_options, run  # noqa: E402
from _plans import PLANS, variants  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=variants("tensor"), default="auto")
    add_model_args(parser, steps=300)
    return parser.parse_args(argv)


def make_plan(args):
    return PLANS[f"tensor/{args.mode}"].plan(**plan_options(args))


def main(argv=None):
    args = parse_args(argv)
    print(f"tensor parallel, mode {args.mode}, compute {'bfloat16' if args.bf16 else 'float32'}")
    return run(make_plan(args), args, style=dict(activation="gelu", norm="layer"), memory=False)


if __name__ == "__main__":
    main()
