"""PNGs of the benchmark JSONs. Imports no jax; needs matplotlib (`pip install -e .[examples]`).

    python -m benchmarks.plots [--json benchmarks/results/quick.json] [--out benchmarks/results]

From `benchmarks.run`'s records: `comm.png` (wire bytes beside the minimum and the
baseline's), `step_ratio.png` (step time over the baseline's) and
`pipeline_memory.png` (temp memory against micro-batches). From `benchmarks.scaling`:
`scaling_devices.png` and `scaling_width.png` (`plot_sweep`).
"""

import argparse
import json
import math
import pathlib
import textwrap
from collections.abc import Sequence
from typing import Any

MB, MiB = 1e6, 2**20


def figure(*, ncols: int = 1, size: tuple[float, float] = (8.0, 4.5)) -> tuple[Any, list]:
    """A matplotlib `Figure` with `ncols` axes, built without pyplot: no global backend is
    chosen (no GUI, nothing for `filterwarnings = error` to trip over); `savefig` uses Agg."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(
            "benchmark plots need matplotlib: pip install -e .[examples] (or pip install matplotlib)"
        ) from e
    fig = Figure(figsize=size, layout="constrained")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def number(x: Any) -> float | None:
    """`x` as a finite float, or None for anything else (missing, null, text, NaN)."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def _label(record: dict[str, Any]) -> str:
    return str(record.get("strategy", "?"))


def plot_comm(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Grouped bars per strategy: eqxpar's wire bytes, the minimum and the baseline's (MB)."""
    records = [r for r in records if number(r.get("comm_wire_bytes_total")) is not None]
    if not records:
        return False
    fig, (ax,) = figure(size=(max(8.0, 0.9 * len(records) + 2), 4.5))
    series = (
        ("comm_wire_bytes_total", "eqxpar", "tab:blue"),
        ("comm_wire_bytes_min", "theoretical minimum", "tab:green"),
        ("comm_wire_bytes_baseline", "baseline: jax.jit (GSPMD); eqxpar GPipe for pipelines", "tab:gray"),
    )
    for i, (field, name, colour) in enumerate(series):
        # A missing value (no baseline, say) leaves a gap in its group, not a zero bar.
        points = [(j, number(r.get(field))) for j, r in enumerate(records)]
        points = [(j + (i - 1) * 0.8 / 3, v / MB) for j, v in points if v is not None]
        if points:
            ax.bar(*zip(*points, strict=True), 0.8 / 3, label=name, color=colour)
    ax.set_xticks(range(len(records)), [_label(r) for r in records], rotation=30, ha="right")
    ax.set(ylabel="MB sent per device per step (ring)", title="Collective wire bytes per step")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110)
    return True


def plot_step_ratio(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Bars of step time over the baseline's, coloured by what the baseline is (legend)."""
    rows = [(r, number(r.get("step_time_s")), number(r.get("baseline_step_time_s"))) for r in records]
    rows = [(r, t / b) for r, t, b in rows if t is not None and b]
    if not rows:
        return False
    fig, (ax,) = figure(size=(max(8.0, 0.8 * len(rows) + 2), 5.5))
    groups: dict[str, list[int]] = {}
    for i, (r, _) in enumerate(rows):
        name = r.get("baseline") if isinstance(r.get("baseline"), str) and r.get("baseline") else None
        groups.setdefault(name or "the baseline (the record does not name it)", []).append(i)
    for colour, (name, indices) in enumerate(groups.items()):
        label = "vs " + textwrap.shorten(name, 110, placeholder=" ...")
        bars = ax.bar(indices, [rows[i][1] for i in indices], 0.6, color=f"C{colour}", label=label)
        ax.bar_label(bars, [f"{rows[i][1]:.2f}" for i in indices], fontsize=8, padding=2)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", zorder=0)
    ax.set_xticks(range(len(rows)), [_label(r) for r, _ in rows], rotation=30, ha="right")
    ax.set_ylim(0, max(max(x for _, x in rows), 1.0) * 1.15)
    ax.set(ylabel="step time / baseline step time")
    ax.set_title("Step time relative to the baseline (same process, interleaved; < 1 is faster)")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", fontsize=7, ncols=1)
    fig.savefig(path, dpi=110)
    return True


def memory_sweep(record: dict[str, Any]) -> list[tuple[float, float]]:
    """`(micro-batches, temp bytes)` of a record's `memory_sweep`, sorted; incomplete points dropped."""
    sweep = record.get("memory_sweep")
    points = [
        (number(e.get("microbatches")), number(e.get("mem_temp_bytes")))
        for e in (sweep if isinstance(sweep, list) else [])
        if isinstance(e, dict)
    ]
    return sorted((m, t) for m, t in points if m is not None and t is not None)


def plot_pipeline_memory(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Temp memory per device against micro-batches, one line per record with a sweep."""
    sweeps = [(r, memory_sweep(r)) for r in records]
    sweeps = [(r, points) for r, points in sweeps if points]
    if not sweeps:
        return False
    fig, (ax,) = figure()
    for r, points in sweeps:
        xs, ys = zip(*points, strict=True)
        ax.plot(xs, [y / MiB for y in ys], marker="o", label=_label(r))
    ticks = sorted({m for _, points in sweeps for m, _ in points})
    if ticks[0] > 0:  # usually powers of two
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    ax.set_xticks(ticks, [f"{m:g}" for m in ticks])
    ax.set(xlabel="micro-batches per step", ylabel="temp MiB per device")
    ax.set_title("Pipeline activation memory against micro-batches")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.savefig(path, dpi=110)
    return True


#: PNG name -> plot of `benchmarks.run`'s records.
PLOTS = {
    "comm.png": plot_comm,
    "step_ratio.png": plot_step_ratio,
    "pipeline_memory.png": plot_pipeline_memory,
}
_COLOURS = {"dp": "tab:blue", "fsdp_manual": "tab:orange", "tp": "tab:green"}
# DP's and FSDP's wire bytes coincide: the larger marker under the smaller keeps both visible.
_MARKERS = {"dp": ("o", 9), "fsdp_manual": ("s", 5), "tp": ("^", 6)}


def _series(rows: Sequence[dict], x: str, field: str) -> tuple[list, list]:
    points = [(r[x], number(r.get(field))) for r in rows]
    return [a for a, b in points if b is not None], [b for _, b in points if b is not None]


def plot_sweep(
    records: Sequence[dict[str, Any]], path: pathlib.Path, *, x: str, xlabel: str, title: str
) -> bool:
    """A scaling sweep against `x` (log 2): per-device memory, wire bytes beside the
    minimum (and `jax.jit`'s), and the step-time ratio, one colour per strategy."""
    lines: dict[str, list[dict]] = {}
    for r in records:
        if number(r.get(x)) is not None:
            lines.setdefault(_label(r), []).append(r)
    if not lines:
        return False
    fig, (mem_ax, wire_ax, time_ax) = figure(ncols=3, size=(15.0, 4.6))
    wire_all = []
    for strategy, rows in lines.items():
        rows.sort(key=lambda r: r[x])
        colour = _COLOURS.get(strategy)
        marker, size = _MARKERS.get(strategy, ("D", 5))
        style = {"color": colour, "marker": marker, "markersize": size}
        for field, line, ax, unit, what in (
            ("mem_argument_bytes", "-", mem_ax, MiB, "arguments"),
            ("mem_temp_bytes", "--", mem_ax, MiB, "temp"),
            ("comm_wire_bytes_total", "-", wire_ax, MB, "eqxpar"),
            ("step_time_ratio", "-", time_ax, 1.0, None),
        ):
            xs, ys = _series(rows, x, field)
            wire_all += ys if field == "comm_wire_bytes_total" else []
            ax.plot(
                xs, [y / unit for y in ys], line, **style, label=f"{strategy}: {what}" if what else strategy
            )
        xs, ys = _series(rows, x, "comm_wire_bytes_min")
        wire_ax.plot(
            xs, [y / MB for y in ys], ":", color=colour, linewidth=3, alpha=0.5, label=f"{strategy}: minimum"
        )
        xs, ys = _series(rows, x, "comm_wire_bytes_baseline")
        if xs:
            wire_ax.plot(
                xs, [y / MB for y in ys], "x", color=colour, markersize=9, label=f"{strategy}: jax.jit"
            )
    xs_all = sorted({r[x] for rows in lines.values() for r in rows})
    for ax in (mem_ax, wire_ax, time_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, [str(v) for v in xs_all])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    mem_ax.set_yscale("log")
    if wire_all and min(wire_all) > 0:  # a one-device point moves 0 bytes, which log cannot show
        wire_ax.set_yscale("log")
    mem_ax.set(ylabel="MiB per device (memory_analysis)", title="Per-device memory")
    wire_ax.set(ylabel="MB sent per device per step (ring)", title="Collective wire bytes (dotted: minimum)")
    time_ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    time_ax.set_ylim(bottom=0)
    time_ax.set_ylabel("step time / reference step time")
    references = sorted({str(r["reference"]) for rows in lines.values() for r in rows if r.get("reference")})
    time_ax.set_title(
        f"Step time vs {' / '.join(references) or 'reference'}\n(shared cores: not a speed-up)", fontsize=10
    )
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True


def write_all(data: dict[str, Any], out: pathlib.Path) -> dict[str, bool]:
    """Every plot of `PLOTS` for a benchmark JSON's contents into folder `out`: name -> written."""
    records = data.get("records") if isinstance(data, dict) else None
    records = [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []
    out.mkdir(parents=True, exist_ok=True)
    return {name: plot(records, out / name) for name, plot in PLOTS.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, bool]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("benchmarks/results/quick.json"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    try:
        figure()
    except ImportError as e:
        parser.exit(1, f"{e}\n")
    written = write_all(json.loads(args.json.read_text()), args.out)
    for name, done in written.items():
        print(
            f"wrote {args.out / name}"
            if done
            else f"skipped {name}: no record in {args.json} has what it plots"
        )
    return written


if __name__ == "__main__":
    main()
