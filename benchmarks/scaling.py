"""Scaling sweeps on the workload: devices and model width (benchmarks/SCALING.md).

    python -m benchmarks.scaling --json benchmarks/results/scaling.json \
        [--png-dir benchmarks/results] [--markdown benchmarks/SCALING.md] [--quick]
"""

import dataclasses
import functools
import math
import os
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx

import eqxpar

from . import _measure, _workload, plots, report
from ._strategies import STRATEGIES, single_device

# (warm-up steps, timed steps) per side; the first warm-up step compiles.
QUICK, FULL = (2, 3), (3, 10)
#: strategy -> the meshes of the devices sweep (tp: tensor divides the 4 heads).
DEVICE_SWEEP = {
    "dp": tuple({"data": n} for n in (1, 2, 4, 8)),
    "fsdp_manual": tuple({"fsdp": n} for n in (1, 2, 4, 8)),
    "tp": tuple({"tensor": n} for n in (1, 2, 4)),
}
#: strategy -> its mesh in the width sweep (8 devices each).
WIDTH_MESH = {"dp": {"data": 8}, "fsdp_manual": {"fsdp": 8}, "tp": {"data": 2, "tensor": 4}}
WIDTHS = (128, 256, 512)
#: The width sweep under `--quick`: GSPMD's TP baseline recompiles for a minute per width.
WIDTH_QUICK = ("dp", "fsdp_manual")
SINGLE_REFERENCE = "single-device jax.jit"
SAME_SHARDINGS_REFERENCE = "jax.jit, same shardings"


def config(d_model: int) -> _workload.Config:
    """The workload at width `d_model`: MLP 4 x d_model, all else the same."""
    return dataclasses.replace(_workload.CONFIG, d_model=d_model, mlp=4 * d_model)


def measure_point(sweep, strategy, mesh: dict, cfg, model, optim, batches, *, warm, timed, single=None):
    """One point, timed against `single` (one device) if given, else `jax.jit` with the same shardings."""
    started = time.perf_counter()
    setup = STRATEGIES[strategy](model, optim, cfg, mesh)
    eqx_model = setup.convert(model)
    runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches)
    other = single if single is not None else setup.baseline(batches)
    steps = _measure.timed_steps({"eqxpar": runner, "reference": other}, warm=warm, timed=timed)
    median = {side: t["step_time_s"] for side, t in steps.items()}
    least = setup.minimum(eqx_model, cfg)
    record = {"sweep": sweep, "strategy": strategy, "mesh": {k: v for k, v in mesh.items() if v > 1}}
    record.update(devices=math.prod(mesh.values()), d_model=cfg.d_model, params=_workload.param_count(model))
    # After the timed steps: the executable they ran (jit's cache), not a second compile.
    record |= _measure.step_fields(runner.compile(), least)
    wire, min_wire = record["comm_wire_bytes_total"], least.total_wire_bytes
    # 0 / 0 (one device, nothing to move) is "at the minimum".
    record["wire_over_min"] = wire / min_wire if min_wire else float(wire == 0) or None
    record["comm_wire_bytes_baseline"] = record["vs_baseline_params_rel_err"] = None
    if single is None:
        record["comm_wire_bytes_baseline"] = eqxpar.inspect.collective_stats(other.compile()).total_wire_bytes
        # Same init, batches and steps: what eqxpar adds to the strategy shows here.
        want = eqx.filter(setup.convert(other.step.params), eqx.is_inexact_array)
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


#: sweep -> (x field, x label, title) of its PNG, `scaling_{sweep}.png`.
_PLOTS = {
    "devices": ("devices", "devices", "Scaling with devices (d_model 256)"),
    "width": ("d_model", "d_model (4 heads, MLP 4 x d)", "Scaling with width (8 devices)"),
}


def write_outputs(data: dict[str, Any], png_dir: pathlib.Path | None, markdown: pathlib.Path | None) -> list:
    """The sweeps' PNGs into `png_dir` and their tables into `markdown` (each if given)."""
    written = []
    for sweep, (x, xlabel, title) in _PLOTS.items() if png_dir is not None else ():
        path = png_dir / f"scaling_{sweep}.png"
        if plots.plot_sweep(data.get(f"{sweep}_sweep", []), path, x=x, xlabel=xlabel, title=title):
            written.append(path)
    if markdown is not None:
        run = [f"`{data['command']}`", data["jax"], str(data["cpu_count"]), f"{data['wall_time_s']:.0f}"]
        memory = [
            report.fmt(v, ".1f", report.MiB) for k, v in data["single_device"].items() if k.startswith("mem_")
        ]
        single = report.markdown_table(("argument MiB", "temp MiB"), [memory])  # one device's arguments, temp
        tables = {
            "Run": report.markdown_table(("command", "jax", "host cores", "wall time (s)"), [run]),
            "Devices": f"{table(data['devices_sweep'])}\n\nSingle-device reference:\n\n{single}",
            "Width": table(data["width_sweep"]),
        }
        report.splice(markdown, "\n\n".join(f"### {heading}\n\n{text}" for heading, text in tables.items()))
        written.append(markdown)
    return written


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = _measure.parser("python -m benchmarks.scaling", __doc__, QUICK)
    parser.add_argument("--png-dir", type=pathlib.Path, help="also write scaling_{devices,width}.png")
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the tables into this Markdown page")
    parser.add_argument("--sweeps", default="devices,width", help="comma-separated: devices, width")
    args = parser.parse_args(argv)
    if set(sweeps := args.sweeps.split(",")) - {"devices", "width"}:
        parser.error(f"--sweeps {args.sweeps!r}: choose from devices, width")
    if args.png_dir is not None:
        plots.figure()  # fail now, not after the sweeps, without matplotlib
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    data = {**_measure.header(parser.prog, argv, warm=warm, timed=timed), "cpu_count": os.cpu_count()}
    data.update(devices_sweep=[], width_sweep=[])
    model, single = functools.cache(_workload.make_model), None
    optim, batches = _workload.make_optimizer(), _workload.make_batches(warm + timed)
    if "devices" in sweeps:
        # One compiled single-device step serves every devices point, so it keeps
        # training across points: its step time is the reference, its numbers are not.
        single = _measure.BaselineRunner(single_device(model(_workload.CONFIG), optim), batches)
        data["single_device"] = {"d_model": _workload.CONFIG.d_model, **_measure.memory(single.compile())}
    # Every point, in the order they are measured.
    points = [("devices", s, mesh, _workload.CONFIG) for s, meshes in DEVICE_SWEEP.items() for mesh in meshes]
    widths = [(s, mesh, config(d_model)) for d_model in WIDTHS for s, mesh in WIDTH_MESH.items()]
    points += [("width", s, mesh, cfg) for s, mesh, cfg in widths if not args.quick or s in WIDTH_QUICK]
    for sweep, strategy, mesh, cfg in (point for point in points if point[0] in sweeps):
        reference = single if sweep == "devices" else None
        point = measure_point(
            sweep, strategy, mesh, cfg, model(cfg), optim, batches, single=reference, warm=warm, timed=timed
        )
        data[f"{sweep}_sweep"].append(point)
        print(" | ".join(row(point)) + f"  ({point['wall_s']:.0f} s)", flush=True)
    data["wall_time_s"] = time.perf_counter() - started
    _measure.write_json(args.json, data)
    for path in write_outputs(data, args.png_dir, args.markdown):
        print(f"wrote {path}")
    return data


if __name__ == "__main__":
    main()
