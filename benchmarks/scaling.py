"""Scaling sweeps on the workload: devices and model width (benchmarks/SCALING.md).

    python -m benchmarks.scaling --json benchmarks/results/scaling.json \
        [--png-dir benchmarks/results] [--markdown benchmarks/SCALING.md] [--quick] [--replot]

The strategies are the registry's on the sweep's mesh and width. Simulated devices
share the host's cores, so more devices is no speed-up: each step time is a ratio to
a reference timed in the same process, step by step.
"""

import argparse
import dataclasses
import functools
import json
import math
import os
import pathlib
import shlex
import sys
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax

from . import _measure, _workload, plots, report
from ._strategies import STRATEGIES, single_device

DEVICES = 8
# (warm-up steps, timed steps) per side; the first warm-up step compiles.
QUICK = (2, 3)
FULL = (3, 10)
#: strategy -> the meshes of the devices sweep (tp: tensor divides the 4 heads).
DEVICE_SWEEP = {
    "dp": tuple({"data": n} for n in (1, 2, 4, 8)),
    "fsdp_manual": tuple({"fsdp": n} for n in (1, 2, 4, 8)),
    "tp": tuple({"tensor": n} for n in (1, 2, 4)),
}
#: strategy -> its mesh in the width sweep (8 devices each).
WIDTH_MESH = {"dp": {"data": 8}, "fsdp_manual": {"fsdp": 8}, "tp": {"data": 2, "tensor": 4}}
WIDTHS = (128, 256, 512)
#: The width sweep under `--quick`: GSPMD's TP baseline recompiles for a minute per
#: width on 2 cores (it reshuffles the heads of the fused QKV weight).
WIDTH_QUICK = ("dp", "fsdp_manual")
SINGLE_REFERENCE = "single-device jax.jit"
SAME_SHARDINGS_REFERENCE = "jax.jit, same shardings"


def config(d_model: int) -> _workload.Config:
    """The workload at width `d_model`: MLP 4 x d_model, all else the same."""
    return dataclasses.replace(_workload.CONFIG, d_model=d_model, mlp=4 * d_model)


def measure_point(
    sweep: str, strategy: str, mesh: dict, cfg, model, optim, batches, *, warm, timed, single=None
):
    """Compile, time and inspect one point. Timed against `single` (a single-device
    reference) if given, else against the hand-written `jax.jit` step with the same
    shardings, whose wire bytes and parameters after the same steps are recorded too."""
    started = time.perf_counter()
    setup = STRATEGIES[strategy](model, optim, cfg, mesh)
    eqx_model = setup.convert(model)
    runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches)
    other = single if single is not None else _measure.BaselineRunner(setup.baseline(), batches)
    median = _measure.median_times({"eqxpar": runner, "reference": other}, warm=warm, timed=timed)
    # After the timed steps: the executable they ran (jit's cache), not a second compile.
    least = setup.minimum(eqx_model, cfg)
    record = {"sweep": sweep, "strategy": strategy, "mesh": {k: v for k, v in mesh.items() if v > 1}}
    record.update(devices=math.prod(mesh.values()), d_model=cfg.d_model, params=_workload.param_count(model))
    record |= {**_measure.step_fields(runner.compile(), least), "comm_wire_bytes_baseline": None}
    wire, record["vs_baseline_params_rel_err"] = record["comm_wire_bytes_total"], None
    # 0 / 0 (one device, nothing to move) is "at the minimum".
    record["wire_over_min"] = (
        wire / least.total_wire_bytes if least.total_wire_bytes else float(wire == 0) or None
    )
    if single is None:
        record["comm_wire_bytes_baseline"] = _measure.wire_bytes(other.compile())
        # Same init, batches and steps: what eqxpar adds to the strategy shows here.
        want = eqx.filter(setup.convert(other.params()), eqx.is_inexact_array)
        record["vs_baseline_params_rel_err"] = _measure.max_rel_err(runner.params(), want)
    return {
        **record,
        "step_time_s": median["eqxpar"],
        "reference": SINGLE_REFERENCE if single is not None else SAME_SHARDINGS_REFERENCE,
        "reference_step_time_s": median["reference"],
        "step_time_ratio": median["eqxpar"] / median["reference"],
        "wall_s": time.perf_counter() - started,
    }


COLUMNS = ("strategy", "mesh", "d_model", "params (M)", "wire MB", "min MB", "wire/min", "jax.jit wire MB")
COLUMNS += ("argument MiB", "temp MiB", "step time / reference")
#: (field, format, unit) of the columns after strategy and mesh.
_CELLS = (("d_model", ".0f", 1), ("params", ".2f", 1e6), ("comm_wire_bytes_total", ".2f", report.MB))
_CELLS += (("comm_wire_bytes_min", ".2f", report.MB), ("wire_over_min", ".4f", 1))
_CELLS += (("comm_wire_bytes_baseline", ".2f", report.MB), ("mem_argument_bytes", ".1f", report.MiB))
_CELLS += (("mem_temp_bytes", ".1f", report.MiB), ("step_time_ratio", ".2f", 1))


def row(r: dict[str, Any]) -> list[str]:
    """The table cells of one sweep record (a dash for what is missing)."""
    return [r["strategy"], report.mesh(r["mesh"]), *(report.fmt(r.get(k), f, u) for k, f, u in _CELLS)]


def table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of sweep records; columns no record has are left out."""
    rows = [row(r) for r in records]
    keep = [i for i in range(len(COLUMNS)) if not rows or any(cells[i] != "—" for cells in rows)]
    return report.markdown_table([COLUMNS[i] for i in keep], [[cells[i] for i in keep] for cells in rows])


#: sweep -> (PNG, x field, x label, title).
_PLOTS = {"devices": ("scaling_devices.png", "devices", "devices", "Scaling with devices (d_model 256)")}
_PLOTS["width"] = (
    "scaling_width.png",
    "d_model",
    "d_model (4 heads, MLP 4 x d)",
    "Scaling with width (8 devices)",
)


def write_outputs(data: dict[str, Any], png_dir: pathlib.Path | None, markdown: pathlib.Path | None) -> list:
    """The sweeps' PNGs into `png_dir` and their tables into `markdown` (each if given)."""
    written = []
    for sweep, (name, x, xlabel, title) in _PLOTS.items():
        records = data.get(f"{sweep}_sweep", [])
        if png_dir is not None and plots.plot_sweep(records, png_dir / name, x=x, xlabel=xlabel, title=title):
            written.append(png_dir / name)
    if markdown is not None:
        run = [f"`{data['command']}`", data["jax"], str(data["cpu_count"]), f"{data['wall_time_s']:.0f}"]
        single = [
            report.fmt(data["single_device"][k], ".1f", report.MiB)
            for k in ("mem_argument_bytes", "mem_temp_bytes")
        ]
        parts = [
            "### Run",
            "",
            report.markdown_table(("command", "jax", "host cores", "wall time (s)"), [run]),
        ]
        parts += ["", "### Devices", "", table(data["devices_sweep"]), "", "Single-device reference:", ""]
        parts += [report.markdown_table(("argument MiB", "temp MiB"), [single])]
        report.splice(markdown, "\n".join([*parts, "", "### Width", "", table(data["width_sweep"])]))
        written.append(markdown)
    return written


def _points(sweeps: Sequence[str], quick: bool):
    """`(sweep, strategy, mesh, cfg)` of every point, in the order they are measured."""
    for strategy, meshes in DEVICE_SWEEP.items() if "devices" in sweeps else ():
        yield from (("devices", strategy, mesh, _workload.CONFIG) for mesh in meshes)
    for d_model in WIDTHS if "width" in sweeps else ():
        for strategy, mesh in WIDTH_MESH.items():
            if not quick or strategy in WIDTH_QUICK:
                yield "width", strategy, mesh, config(d_model)


def _sweep(data: dict, sweeps: Sequence[str], quick: bool, optim: Any, batches: Sequence, **timing) -> None:
    model, single = functools.cache(_workload.make_model), None
    if "devices" in sweeps:
        # One compiled single-device step serves every devices point, so it keeps
        # training across points: its step time is the reference, its numbers are not.
        single = _measure.BaselineRunner(single_device(model(_workload.CONFIG), optim), batches)
        data["single_device"] = {"d_model": _workload.CONFIG.d_model, **_measure.memory(single.compile())}
    for sweep, strategy, mesh, cfg in _points(sweeps, quick):
        reference = single if sweep == "devices" else None
        point = measure_point(
            sweep, strategy, mesh, cfg, model(cfg), optim, batches, single=reference, **timing
        )
        data[f"{sweep}_sweep"].append(point)
        print(" | ".join(row(point)) + f"  ({point['wall_s']:.0f} s)", flush=True)


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, type=pathlib.Path, help="where to write the results")
    parser.add_argument("--png-dir", type=pathlib.Path, help="also write scaling_{devices,width}.png")
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the tables into this Markdown page")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK[0]} warm + {QUICK[1]} timed steps a side"
    )
    parser.add_argument("--replot", action="store_true", help="measure nothing: redraw from --json")
    parser.add_argument("--sweeps", default="devices,width", help="comma-separated: devices, width")
    args = parser.parse_args(argv)
    args.sweeps = args.sweeps.split(",")
    if set(args.sweeps) - {"devices", "width"}:
        parser.error(f"--sweeps {','.join(args.sweeps)!r}: choose from devices, width")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.replot:
        data = json.loads(args.json.read_text())
        written = write_outputs(data, args.png_dir, args.markdown)
        print(f"wrote {', '.join(map(str, written)) or 'nothing (give --png-dir or --markdown)'}")
        return data
    if jax.device_count() != DEVICES:
        sys.exit(f"the sweeps need {DEVICES} devices, jax sees {jax.device_count()} (jax imported before?)")
    if args.png_dir is not None:
        plots.figure()  # fail now, not after the sweeps, without matplotlib
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    command = "python -m benchmarks.scaling " + shlex.join(sys.argv[1:] if argv is None else argv)
    data: dict[str, Any] = {**_measure.header(command, warm=warm, timed=timed), "cpu_count": os.cpu_count()}
    # How busy the host was: step-time ratios from a loaded machine are noisier.
    data.update(load_average_1min={"start": os.getloadavg()[0]}, devices_sweep=[], width_sweep=[])
    optim, batches = _workload.make_optimizer(), _workload.make_batches(warm + timed)
    _sweep(data, args.sweeps, args.quick, optim, batches, warm=warm, timed=timed)
    data["wall_time_s"] = time.perf_counter() - started
    data["load_average_1min"]["end"] = os.getloadavg()[0]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    written = [args.json, *write_outputs(data, args.png_dir, args.markdown)]
    print(f"wrote {', '.join(map(str, written))} in {data['wall_time_s']:.0f} s")
    return data


if __name__ == "__main__":
    main()
