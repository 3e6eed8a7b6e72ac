"""`python -m eqxpar.aot`: the command line of `compile_train_step`."""

import argparse
import json
import math
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp

from .._errors import EqxparError, PlanError
from .._mesh import AXES, make_mesh
from .._plan import Plan
from .._remat import OFFLOAD_PARTS, RematPolicy
from ..models import PRESET_NAMES, preset
from ..pipeline import stage_rules
from ..rules import EXPERT_FSDP, FSDP, MEGATRON, MEGATRON_FSDP
from ._compile import compile_train_step

#: The activations `--offload activations` moves to host memory by default:
#: MaxText's `qkv_proj_offloaded` (the query, key and value projections), and the
#: fused projection's output where the model stores them as one weight (GPT-2).
OFFLOADED_NAMES = ("query_proj", "key_proj", "value_proj", "qkv_proj")

_DTYPES = {"bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16, "f32": jnp.float32, "float32": jnp.float32}


def parse_axes(text: str, option: str = "--plan") -> dict[str, int]:
    """`"fsdp=8,tensor=4"` as `{"fsdp": 8, "tensor": 4}` (eqxpar's mesh axes only)."""
    sizes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.replace(" ", ",").split(","))):
        axis, _, size = part.partition("=")
        if axis not in AXES or not size.isdigit() or int(size) < 1:
            raise PlanError(
                f"{option} {text!r}: {part!r} is not AXIS=SIZE with AXIS one of {list(AXES)} and SIZE a "
                f"positive integer. Example: {option} {'data=2' if option == '--dcn' else 'fsdp=8,tensor=4'}"
            )
        sizes[axis] = int(size)
    if not sizes:
        raise PlanError(f"{option} {text!r}: expected at least one AXIS=SIZE, e.g. {option} data=2")
    return sizes


def parse_batch(text: str) -> tuple[int, int]:
    """`"1x2048"` as `(1, 2048)`: rows per chip x sequence length."""
    rows, _, length = text.lower().partition("x")
    if not (rows.isdigit() and length.isdigit() and int(rows) > 0 and int(length) > 0):
        raise PlanError(f"--batch {text!r}: expected ROWSxLENGTH per chip, e.g. --batch 1x2048")
    return int(rows), int(length)


def plan_of(
    sizes: dict[str, int],
    *,
    topology: str | None,
    remat: str = "full",
    compute_dtype: Any = jnp.bfloat16,
    schedule: str | None = None,
    microbatches: int | None = None,
    stage_gradients: str = "whole",
    fsdp_dim: str = "largest",
    mode: str | None = None,
    rows_per_chip: int = 1,
    split_physical_axes: bool = False,
    offload: Sequence[str] = (),
    offloaded_names: Sequence[str] = OFFLOADED_NAMES,
    saved_names: Sequence[str] = (),
    dcn: dict[str, int] | None = None,
    slices: int | None = None,
) -> Plan:
    """The plan the command compiles: a mesh of `sizes` (over `topology`'s chips,
    or this machine's devices; `split_physical_axes` as `make_mesh` takes it),
    `rules.FSDP(dim=fsdp_dim)` over `fsdp`, `rules.MEGATRON_FSDP` (or `MEGATRON` without an
    fsdp axis) where a tensor, expert or context axis is split (`EXPERT_FSDP`
    where both fsdp and expert are), a pipeline's stage
    rules, schedule and `stage_gradients` where `pipe` is, its micro-batches by
    default one row each (`rows_per_chip` x chips / data-parallel devices).
    `offload` as `Plan(offload=...)`; with `"activations"` the remat policy is
    `RematPolicy(offloaded=offloaded_names)` (default MaxText's
    `qkv_proj_offloaded`: the query, key and value projections) instead of
    `remat`. `saved_names` (names of `eqxpar.ACTIVATION_NAMES`) are kept on the
    device, the rest recomputed: `RematPolicy(saved=saved_names)`, beside any
    offloaded names (the base an activation offload is measured against keeps
    the same names on the device). `dcn` and `slices` as `make_mesh` takes them: `plan_of({"data": 2,
    "fsdp": 32}, topology="2xv5p-64", dcn={"data": 2})` is HSDP over two slices."""
    mesh = make_mesh(
        **sizes, topology=topology, split_physical_axes=split_physical_axes, dcn=dcn, slices=slices
    )
    needs_layers = any(sizes.get(a, 1) > 1 for a in ("tensor", "expert", "context"))
    # Megatron's rules name the layers' logical axes; with an fsdp axis, their
    # model dimension splits over it too (first match wins: FSDP() after MEGATRON
    # would never be reached by a weight MEGATRON places).
    rules: Any = FSDP(dim=fsdp_dim)
    if needs_layers:
        rules = MEGATRON_FSDP if sizes.get("fsdp", 1) > 1 else MEGATRON
    if sizes.get("fsdp", 1) > 1 and sizes.get("expert", 1) > 1:
        # The weights outside the experts split over expert too, as MaxText's.
        rules = EXPERT_FSDP
    options: dict[str, Any] = {}
    if sizes.get("pipe", 1) > 1:
        rules = stage_rules(rules)
        batch_devices = math.prod(sizes.get(a, 1) for a in ("data", "fsdp", "expert"))
        rows = rows_per_chip * math.prod(sizes.values()) // batch_devices
        options = dict(
            schedule=schedule or "1f1b", microbatches=microbatches or rows, stage_gradients=stage_gradients
        )
    elif schedule is not None or stage_gradients != "whole":
        what = f"--schedule {schedule}" if schedule is not None else f"--stage-gradients {stage_gradients}"
        raise PlanError(f"{what}: a pipeline option needs a pipe axis, e.g. --plan pipe=4,fsdp=8")
    if sizes.get("context", 1) > 1:
        options["context_attention"] = "ring"
    policy: Any = remat
    if "activations" in offload or saved_names:
        offloaded = tuple(offloaded_names) if "activations" in offload else ()
        policy = RematPolicy(saved=tuple(saved_names), offloaded=offloaded)
    return Plan(
        mesh,
        rules=rules,
        remat=policy,
        offload=tuple(offload),
        compute_dtype=compute_dtype,
        mode=mode,
        **options,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eqxpar.aot",
        description="Compile a model's train step for a TPU topology (or this machine) from shapes, and "
        "report memory per chip, collectives per mesh axis against the plan's minimum, asynchronous "
        "overlap and compile time. Needs libtpu for a TPU topology: pip install 'eqxpar[tpu]'.",
    )
    parser.add_argument("--model", required=True, help=f"a preset: {', '.join(PRESET_NAMES)}")
    parser.add_argument(
        "--topology",
        help="e.g. v5p-64 (32 chips), v5p:4x4x2, or 2xv5p-64 (two slices); default this machine's devices",
    )
    parser.add_argument(
        "--slices", type=int, help="copies of the topology's slice, joined by DCN (default 1)"
    )
    parser.add_argument(
        "--dcn",
        help="the factor of each axis that spans slices, e.g. data=2 (HSDP with --plan data=2,fsdp=32); "
        "default: the slices go to data, then pipe, then fsdp",
    )
    parser.add_argument("--plan", required=True, help="mesh axis sizes, e.g. fsdp=32 or fsdp=8,tensor=4")
    parser.add_argument("--batch", default="1x2048", help="rows per chip x sequence length (default 1x2048)")
    parser.add_argument("--remat", default="full", help="Plan(remat=...) (default full)")
    parser.add_argument(
        "--dtype", default="bf16", choices=sorted(_DTYPES), help="compute dtype (default bf16)"
    )
    parser.add_argument("--schedule", help="pipeline schedule with a pipe axis (default 1f1b)")
    parser.add_argument("--microbatches", type=int, help="pipeline micro-batches (default: one row each)")
    parser.add_argument(
        "--stage-gradients",
        default="whole",
        choices=["whole", "sharded"],
        help="Plan(stage_gradients=...) with a pipe axis: sharded gathers FSDP weights at their uses and "
        "keeps gradient sums split (default whole)",
    )
    parser.add_argument(
        "--fsdp-dim",
        default="largest",
        choices=["largest", "leading"],
        help="rules.FSDP(dim=...): split each weight along its largest divisible dimension (default) or "
        "its first; a pipeline with --stage-gradients sharded reduce-scatters the latter on TPU",
    )
    parser.add_argument("--mode", choices=["auto", "manual"], help="Plan(mode=...) (default the plan's)")
    parser.add_argument(
        "--split-physical-axes",
        action="store_true",
        help="let a mesh axis cut a side of the chip grid (make_mesh(split_physical_axes=True))",
    )
    parser.add_argument(
        "--offload",
        default="",
        help=f"what to keep in host memory, some of {','.join(OFFLOAD_PARTS)} (Plan(offload=...)), "
        "e.g. --offload optimizer,params",
    )
    parser.add_argument(
        "--offload-names",
        default=",".join(OFFLOADED_NAMES),
        help="with --offload activations: the named activations moved to host memory (default "
        f"{','.join(OFFLOADED_NAMES)}; the rest are recomputed)",
    )
    parser.add_argument(
        "--saved-names",
        default="",
        help="named activations kept on the device for the backward pass (RematPolicy(saved=...)), the rest "
        f"recomputed, instead of --remat; e.g. {','.join(OFFLOADED_NAMES)}, the base --offload activations "
        "is measured against",
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE", help="override a GPTConfig field"
    )
    parser.add_argument("--json", type=pathlib.Path, help="also write the report as JSON here")
    return parser


def _value(text: str) -> Any:
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit status (0: compiled, 1: a plan that does
    not fit the chip's memory, 2: a bad argument)."""
    args = _parser().parse_args(argv)
    # libtpu takes a lock per process; compiling beside a test run or another
    # compile needs it lifted.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        overrides = dict((field, _value(value)) for field, _, value in (s.partition("=") for s in args.set))
        config = preset(args.model, **overrides)
        batch = parse_batch(args.batch)
        plan = plan_of(
            parse_axes(args.plan),
            rows_per_chip=batch[0],
            topology=args.topology,
            remat=args.remat,
            compute_dtype=_DTYPES[args.dtype],
            schedule=args.schedule,
            microbatches=args.microbatches,
            stage_gradients=args.stage_gradients,
            fsdp_dim=args.fsdp_dim,
            mode=args.mode,
            split_physical_axes=args.split_physical_axes,
            offload=[p for p in args.offload.split(",") if p],
            offloaded_names=[n for n in args.offload_names.split(",") if n],
            saved_names=[n for n in args.saved_names.split(",") if n],
            dcn=None if args.dcn is None else parse_axes(args.dcn, "--dcn"),
            slices=args.slices,
        )
        report = compile_train_step(config, plan, batch=batch, name=args.model)
    except EqxparError as e:
        print(f"error: {e}")
        return 2
    where = args.topology or "this machine"
    if args.slices:
        where = f"{args.slices}x{where}"
    print(f"[{args.model} on {where}]")
    print(report)
    if args.json is not None:
        args.json.write_text(json.dumps({"topology_name": where, **report.as_dict()}, indent=1) + "\n")
    return 1 if report.fits is False else 0
