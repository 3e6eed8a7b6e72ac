"""3D parallelism: pipeline x data x tensor (2 x 2 x 2) on 8 simulated CPU devices.

The character-level GPT of `pipeline_parallel.py`, its layers split over
`pipe` (two stages, run with a schedule table), the batch over `data` (one
gradient all-reduce per step) and, inside every stage, the attention heads, MLP
features and vocabulary over `tensor` (Megatron layers issuing their own
all-reduces). One compiled step, manual over all three axes (`pipeline/hybrid`
and `pipeline/hybrid-fsdp` in `_plans.py`):

    python examples/hybrid_3d.py                        # 1F1B
    python examples/hybrid_3d.py --schedule zero_bubble
    python examples/hybrid_3d.py --schedule interleaved --chunks 2
    python examples/hybrid_3d.py --fsdp      # pipe 2 x fsdp 2 x tensor 2: weights split over fsdp too
"""

import os

# 8 simulated devices; and XLA:CPU running each device's collectives in program
# order (plans manual over several axes need it: see eqxpar.train.make_step).
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_cpu_enable_concurrency_optimized_scheduler=false"
).strip()

import argparse  # noqa: E402

import pipeline_parallel  # noqa: E402

import eqxpar  # noqa: E402


def pipeline_argv(argv=None) -> list[str]:
    """The `pipeline_parallel.py --hybrid` command line of this one (its defaults: 4 micro-batches)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schedule", choices=eqxpar.pipeline.SCHEDULES, default="1f1b")
    parser.add_argument("--chunks", type=int, default=1)
    parser.add_argument("--microbatches", type=int, default=4)
    args, rest = parser.parse_known_args(argv)
    options = [
        "--schedule",
        args.schedule,
        "--chunks",
        str(args.chunks),
        "--microbatches",
        str(args.microbatches),
    ]
    return ["--hybrid", *options, *rest]


def parse_args(argv=None) -> argparse.Namespace:
    return pipeline_parallel.parse_args(pipeline_argv(argv))


make_plan = pipeline_parallel.make_plan


def main(argv=None):
    return pipeline_parallel.main(pipeline_argv(argv))


if __name__ == "__main__":
    main()
