"""Markdown tables of a benchmark JSON (from `benchmarks.run`), and `splice`, which writes
tables between markers in a hand-written page and leaves its prose alone. Imports no jax.

    python -m benchmarks.report benchmarks/results/quick.json BENCHMARKS.md
"""

import argparse
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from . import contracts

MB, MiB = 1e6, 2**20
BEGIN = "<!-- generated tables (python -m benchmarks.report): edit the prose outside them -->"
END = "<!-- end of generated tables -->"
_SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS", "collective-permute": "CP"}


def fmt(x: Any, spec: str, unit: float = 1.0) -> str:
    """`x / unit` formatted with `spec`, or a dash for a missing value."""
    return "—" if x is None else format(x / unit, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def mesh(axes: dict[str, int]) -> str:
    return " × ".join(f"{k} {v}" for k, v in axes.items()) or "1 device"


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]], *, rule: str = "---|") -> str:
    """A Markdown table; `rule`: each column's cell of the line under the header."""
    lines = ["| " + " | ".join(columns) + " |", "|" + rule * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(map(str, cells)) + " |" for cells in rows])


COLUMNS = ("strategy", "mesh", "step time (s)", "ratio to baseline", "comm MB total", "min MB", "wire MB")
COLUMNS += ("wire min MB", "baseline wire MB", "wire/min", "argument MiB", "temp MiB", "parity max rel err")


def row(r: dict[str, Any]) -> list[str]:
    """The main table's cells of one record."""
    kinds = ", ".join(f"{_SHORT.get(k, k)} {n}" for k, n in r["comm_counts"].items())
    wire, least = r["comm_wire_bytes_total"], r["comm_wire_bytes_min"]
    return [
        *(r["strategy"], mesh(r["mesh"]), fmt(r["step_time_s"], ".3f")),
        fmt(ratio(r["step_time_s"], r["baseline_step_time_s"]), ".3f"),
        fmt(r["comm_bytes_total"], ".2f", MB) + (f" ({kinds})" if kinds else ""),
        *(fmt(x, ".2f", MB) for x in (r["comm_bytes_min"], wire, least, r["comm_wire_bytes_baseline"])),
        fmt(ratio(wire, least), ".4f"),
        *(fmt(r["mem_argument_bytes"], ".1f", MiB), fmt(r["mem_temp_bytes"], ".1f", MiB)),
        fmt(r["parity_max_rel_err"], ".2e"),
    ]


_PARITY = ("parity_loss_rel_err", "parity_grads_rel_err", "parity_grads_norm_rel_err")
_PARITY += ("trajectory_params_rel_err", "trajectory_loss_rel_err")


def _reference_rows(r: dict) -> list[list[str]]:
    if "references" not in r:
        return []
    ratio_ = fmt(ratio(r["step_time_s"], r["baseline_step_time_s"]), ".3f")
    rows = [[r["strategy"], "eqxpar", fmt(r["step_time_s"], ".3f"), ratio_, "1"]]
    for x in r["references"].values():
        cells = (x["step_time_s"], x.get("ratio_to_baseline"), x["eqxpar_over_reference"])
        rows.append([r["strategy"], x["what"], *(fmt(c, ".3f") for c in cells)])
    return rows


def _pipeline_row(r: dict) -> list[str]:
    wire, least = r["comm_wire_bytes_total"], r["comm_wire_bytes_min"]
    permute = r["comm_bytes"].get("collective-permute", 0)
    # The predicted speed-up over GPipe of the H200's wide stage, free-running / lockstep.
    got = r.get("predicted_speedup_over_gpipe", {}).get("H200", {}).get("wide_unrolled")
    return [
        *(r["strategy"], r["schedule"], f"{r['microbatches']} × {r['chunks']}", str(r["ticks"])),
        f"{r['bubble_fraction']:.3f} ({r['lockstep_bubble_fraction']:.3f})",
        *(fmt(x, ".2f", MB) for x in (permute, wire, least)),
        fmt(ratio(wire, least), ".3f"),
        " / ".join(fmt(s["mem_temp_bytes"], ".1f", MiB) for s in r["memory_sweep"]),
        fmt(r.get("flops_per_device"), ".2f", 1e9),
        fmt(r.get("flops_over_reference"), ".3f"),
        fmt(r.get("flops_over_table"), ".4f"),
        fmt(r.get("lockstep_bubble_fraction_at_flops"), ".3f"),
        fmt(ratio(r["step_time_s"], r["baseline_step_time_s"]), ".3f"),
        f"{got['free']:.2f} / {got['lockstep']:.2f}" if got else "—",
    ]


_PARITY_COLUMNS = ("strategy", "loss rel err", "gradients max rel err", "gradients 2-norm rel err")
_PARITY_COLUMNS += ("trajectory: params", "trajectory: last loss")
_REFERENCE_COLUMNS = ("strategy", "step", "step time (s)", "ratio to baseline", "eqxpar step / this step")
_PIPELINE_COLUMNS = ("strategy", "schedule", "micro-batches × chunks", "ticks", "bubble (lockstep)", "CP MB")
_PIPELINE_COLUMNS += ("wire MB", "min MB", "wire/min", "temp MiB at 4p / 8p / 16p micro-batches")
_PIPELINE_COLUMNS += ("lockstep matmul GFLOP", "÷ (data-parallel's / (1 - lockstep bubble))")
_PIPELINE_COLUMNS += ("÷ the table at each action's FLOPs", "lockstep bubble at each action's FLOPs")
_PIPELINE_COLUMNS += ("step ratio to GPipe", "predicted over GPipe on an H200 (wide stage, free / lockstep)")
#: (heading, columns, the rows of one record), in the order they are rendered.
SECTIONS = (
    ("Records", COLUMNS, lambda r: [row(r)]),
    ("Parity", _PARITY_COLUMNS, lambda r: [[r["strategy"], *(fmt(r.get(k), ".2e") for k in _PARITY)]]),
    ("Sequence parallelism against a hand-written step", _REFERENCE_COLUMNS, _reference_rows),
    ("Pipelines", _PIPELINE_COLUMNS, lambda r: [_pipeline_row(r)] if "schedule" in r else []),
    ("Contracts", ("strategy", "held to"), lambda r: [[r["strategy"], contracts.describe(r["contract"])]]),
)


def render(data: dict[str, Any]) -> str:
    """Every table of one benchmark JSON, as Markdown."""
    run = ("command", "jax", "devices", "platform", "wall time (s)", "warm steps", "timed steps")
    cells = [f"`{data['command']}`", data["jax"], str(data["devices"]), data.get("platform", "—")]
    cells.append(fmt(data.get("wall_time_s"), ".0f"))
    cells += [str(data.get("timing", {}).get(k, "—")) for k in ("warm_steps", "timed_steps")]
    parts = ["### Run", "", markdown_table(run, [cells])]
    for u in data.get("updates", []):  # records an --only run measured after the whole run
        parts += ["", f"Re-measured alone after this run: {', '.join(u['records'])} (`{u['command']}`)."]
    for heading, columns, rows in SECTIONS:
        if chosen := [cells for r in data["records"] for cells in rows(r)]:
            parts += ["", f"### {heading}", "", markdown_table(columns, chosen)]
    return "\n".join(parts)


def splice(path: pathlib.Path, tables: str, *, begin: str = BEGIN, end: str = END) -> None:
    """Write `tables` between `begin` and `end` in `path` (appended if missing), keeping the rest."""
    text = path.read_text() if path.exists() else ""
    if begin not in text or end not in text:
        text = text + ("\n" if text else "") + f"{begin}\n{end}\n"
    head, rest = text.split(begin, 1)
    path.write_text(head + begin + "\n\n" + tables + "\n\n" + end + rest.split(end, 1)[1])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("json", type=pathlib.Path, help="a JSON written by `python -m benchmarks.run`")
    parser.add_argument("markdown", type=pathlib.Path, help="the page to write the tables into")
    args = parser.parse_args(argv)
    splice(args.markdown, render(json.loads(args.json.read_text())))


if __name__ == "__main__":
    main()
