"""Plot a benchmark JSON (from `benchmarks.run`) as PNGs.

    python -m benchmarks.plots [--json benchmarks/results/quick.json] [--out benchmarks/results]

Writes `comm.png` (wire bytes per strategy beside the theoretical minimum and the
`jax.jit` baseline), `step_ratio.png` (step time over the baseline's) and, when some
record has a `memory_sweep`, `pipeline_memory.png` (temporary memory against the
number of micro-batches). Imports no jax, so it runs anywhere the JSON is; needs
matplotlib (`pip install -e .[examples]`).
"""

import argparse
import json
import math
import pathlib
import textwrap
from collections.abc import Sequence
from typing import Any

MB = 1e6
MiB = 2**20

# The bars of `comm.png`: (record field, legend label, colour).
_COMM_SERIES = (
    ("comm_wire_bytes_total", "eqxpar", "tab:blue"),
    ("comm_wire_bytes_min", "theoretical minimum", "tab:green"),
    ("comm_wire_bytes_baseline", "baseline: jax.jit (GSPMD); eqxpar GPipe for pipelines", "tab:gray"),
)


def figure(*, ncols: int = 1, size: tuple[float, float] = (8.0, 4.5)) -> tuple[Any, Any]:
    """A matplotlib `Figure` with `ncols` axes side by side, drawn off-screen.

    Built from `matplotlib.figure.Figure`, not pyplot: no global backend is chosen or
    changed (so no GUI, and nothing for a test run's `filterwarnings = error` to
    trip over), and `savefig` renders PNGs with Agg.

    **Arguments:**

    - `ncols`: the number of axes.
    - `size`: the figure size in inches.

    **Returns:** `(figure, axes)`, `axes` a list of `ncols` axes.

    **Raises:** `ImportError` naming the extra to install when matplotlib is missing.
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "benchmark plots need matplotlib: pip install -e .[examples] (or pip install matplotlib)"
        ) from e
    fig = Figure(figsize=size, layout="constrained")
    axes = fig.subplots(1, ncols, squeeze=False)[0]
    return fig, list(axes)


def number(x: Any) -> float | None:
    """`x` as a finite float, or None for anything else (missing, null, text, NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def label(record: dict[str, Any]) -> str:
    """A record's axis label: its strategy name, or `?` when it has none."""
    return str(record.get("strategy", "?"))


def plot_comm(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Grouped bars per strategy: eqxpar's wire bytes, the minimum and the baseline's, in MB.

    **Arguments:**

    - `records`: the `records` of a benchmark JSON.
    - `path`: the PNG to write.

    **Returns:** whether a PNG was written (False when no record has wire bytes).
    """
    records = [r for r in records if number(r.get("comm_wire_bytes_total")) is not None]
    if not records:
        return False
    fig, (ax,) = figure(size=(max(8.0, 0.9 * len(records) + 2), 4.5))
    width = 0.8 / len(_COMM_SERIES)
    for i, (field, name, colour) in enumerate(_COMM_SERIES):
        # A missing value (no baseline, say) leaves a gap in its group, not a zero bar.
        points = [(j, number(r.get(field))) for j, r in enumerate(records)]
        points = [(j, v / MB) for j, v in points if v is not None]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.bar([x + (i - 1) * width for x in xs], ys, width, label=name, color=colour)
    ax.set_xticks(range(len(records)), [label(r) for r in records], rotation=30, ha="right")
    ax.set_ylabel("MB sent per device per step (ring)")
    ax.set_title("Collective wire bytes per step")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    return True


def plot_step_ratio(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Bars of `step_time_s / baseline_step_time_s` per strategy, a line at 1.0.

    Each bar carries its ratio, and its colour says what it is measured against: the
    record's `baseline` text (a pipeline's is its GPipe step, say), in the legend.
    Those texts are sentences, too long to print over every bar. Records without
    both times are left out.

    **Arguments:**

    - `records`: the `records` of a benchmark JSON.
    - `path`: the PNG to write.

    **Returns:** whether a PNG was written (False when no record has both times).
    """
    rows = []
    for r in records:
        time, base = number(r.get("step_time_s")), number(r.get("baseline_step_time_s"))
        if time is not None and base:
            rows.append((r, time / base))
    if not rows:
        return False
    fig, (ax,) = figure(size=(max(8.0, 0.8 * len(rows) + 2), 5.5))
    groups: dict[str, list[int]] = {}
    for i, (r, _) in enumerate(rows):
        name = r.get("baseline") if isinstance(r.get("baseline"), str) and r.get("baseline") else None
        groups.setdefault(name or "the baseline (the record does not name it)", []).append(i)
    for colour, (name, indices) in enumerate(groups.items()):
        bars = ax.bar(
            indices,
            [rows[i][1] for i in indices],
            0.6,
            color=f"C{colour}",
            label="vs " + textwrap.shorten(name, 110, placeholder=" ..."),
        )
        for bar, i in zip(bars, indices, strict=True):
            ax.annotate(
                f"{rows[i][1]:.2f}",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                xytext=(0, 2),
                textcoords="offset points",
                ha="center",
                va="bottom",
                fontsize=8,
            )
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", zorder=0)
    ax.set_xticks(range(len(rows)), [label(r) for r, _ in rows], rotation=30, ha="right")
    # Head room for the ratios above the tallest bar.
    ax.set_ylim(0, max(max(ratio for _, ratio in rows), 1.0) * 1.15)
    ax.set_ylabel("step time / baseline step time")
    ax.set_title("Step time relative to the baseline (same process, interleaved; < 1 is faster)")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=7, ncols=1)
    fig.savefig(path, dpi=110)
    return True


def memory_sweep(record: dict[str, Any]) -> list[tuple[float, float]]:
    """`(micro-batches, temp bytes)` points of a record's `memory_sweep`, in micro-batch
    order; entries missing either number are dropped, and so is a sweep that is not a list."""
    sweep = record.get("memory_sweep")
    if not isinstance(sweep, list):
        return []
    points = []
    for entry in sweep:
        if isinstance(entry, dict):
            m, temp = number(entry.get("microbatches")), number(entry.get("mem_temp_bytes"))
            if m is not None and temp is not None:
                points.append((m, temp))
    return sorted(points)


def plot_pipeline_memory(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Temporary memory per device against micro-batches, one line per record with a
    `memory_sweep` (a list of `{"microbatches", "mem_temp_bytes", "mem_argument_bytes"}`).

    **Arguments:**

    - `records`: the `records` of a benchmark JSON.
    - `path`: the PNG to write.

    **Returns:** whether a PNG was written (False when no record has a sweep).
    """
    sweeps = [(r, memory_sweep(r)) for r in records]
    sweeps = [(r, points) for r, points in sweeps if points]
    if not sweeps:
        return False
    fig, (ax,) = figure()
    for r, points in sweeps:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, [y / MiB for y in ys], marker="o", label=label(r))
    # Micro-batch counts are usually powers of two: log 2, ticked at the counts measured.
    ticks = sorted({m for _, points in sweeps for m, _ in points})
    if ticks[0] > 0:
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    ax.set_xticks(ticks, [f"{m:g}" for m in ticks])
    ax.set_xlabel("micro-batches per step")
    ax.set_ylabel("temp MiB per device")
    ax.set_title("Pipeline activation memory against micro-batches")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return True


#: PNG name -> plot function, in the order they are written.
PLOTS = {
    "comm.png": plot_comm,
    "step_ratio.png": plot_step_ratio,
    "pipeline_memory.png": plot_pipeline_memory,
}


def write_all(data: dict[str, Any], out: pathlib.Path) -> dict[str, bool]:
    """Every plot of `PLOTS` for a benchmark JSON's contents, into the folder `out`.

    **Returns:** PNG name -> whether it was written.
    """
    records = data.get("records") if isinstance(data, dict) else None
    records = [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []
    out.mkdir(parents=True, exist_ok=True)
    return {name: plot(records, out / name) for name, plot in PLOTS.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, bool]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json",
        type=pathlib.Path,
        default=pathlib.Path("benchmarks/results/quick.json"),
        help="a JSON written by `python -m benchmarks.run` (default: %(default)s)",
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"), help="folder for the PNGs"
    )
    args = parser.parse_args(argv)
    try:
        figure()
    except ImportError as e:
        parser.exit(1, f"{e}\n")
    written = write_all(json.loads(args.json.read_text()), args.out)
    for name, done in written.items():
        if done:
            print(f"wrote {args.out / name}")
        elif name == "pipeline_memory.png":
            print(f"skipped {name}: no record in {args.json} has a memory_sweep")
        else:
            print(f"skipped {name}: no record in {args.json} has the numbers it plots")
    return written


if __name__ == "__main__":
    main()
