"""Pipeline parallelism on 8 simulated CPU devices.

Trains a small causal character-level transformer (`eqxpar.models.GPT`: GELU,
LayerNorm, learned positions) on Python's own documentation text, its blocks an
`eqxpar.nn.Stacked` whose layers are split over the mesh axis `pipe`: stage `s`
holds a contiguous run of layers (with `--chunks v`, `v` runs interleaved around
the devices). The embedding and the head are replicated and run on the first and
last stage (`eqxpar.models.gpt_first` / `gpt_last`). The step is one `lax.scan`
over the ticks of a schedule table; the script prints the table and its bubble
fractions first (the plans are `pipeline/*` in `_plans.py`):

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

from _model import add_model_args, plan_options, run  # noqa: E402
from _plans import PLANS  # noqa: E402

import eqxpar  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
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
    parser.add_argument("--png", default=None, help="save a picture of the schedule here")
    add_model_args(parser, steps=200, layers=8)
    return parser.parse_args(argv)


def make_plan(args) -> eqxpar.Plan:
    variant = "-".join(name for name, on in (("hybrid", args.hybrid), ("fsdp", args.fsdp)) if on)
    return PLANS[f"pipeline/{variant or 'data'}"].plan(
        mesh=dict(pipe=args.stages) if args.stages else None,
        schedule=args.schedule,
        microbatches=args.microbatches,
        chunks=args.chunks,
        **plan_options(args),
    )


def main(argv=None):
    args = parse_args(argv)
    plan = make_plan(args)
    schedule = eqxpar.pipeline.schedule(
        args.schedule, stages=plan.mesh.shape["pipe"], microbatches=args.microbatches, chunks=args.chunks
    )
    print(schedule)
    if args.png:
        eqxpar.pipeline.save_schedule_png(schedule, args.png)
        print(f"schedule picture saved to {args.png}")
    # Evaluation runs lm_loss on the model put back in layer order, under plain jit.
    return run(plan, args, style=dict(activation="gelu", norm="layer"), memory=False, collectives=False)


if __name__ == "__main__":
    main()
