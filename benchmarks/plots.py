"""PNGs of the benchmark JSONs. Imports no jax; needs matplotlib (`pip install -e .[examples]`).

python -m benchmarks.plots [--json benchmarks/results/quick.json] [--out benchmarks/results]
"""

import argparse
import json
import pathlib
import textwrap
from collections.abc import Sequence
from typing import Any

from .report import MB, MiB, ratio


def figure(*, ncols: int = 1, size: tuple[float, float] = (8.0, 4.5)) -> tuple[Any, list]:
    """A matplotlib `Figure` with `ncols` axes, without pyplot (no global backend; `savefig` uses Agg)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("benchmark plots need matplotlib: pip install -e .[examples]") from e
    fig = Figure(figsize=size, layout="constrained")
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _bars(ax: Any, records: Sequence[dict], ylabel: str, title: str) -> None:
    ax.set_xticks(range(len(records)), [r["strategy"] for r in records], rotation=30, ha="right")
    ax.set(ylabel=ylabel, title=title)
    ax.grid(axis="y", alpha=0.3)


def _log2_x(ax: Any, ticks: Sequence[int], xlabel: str) -> None:
    ax.set_xscale("log", base=2)  # micro-batches, devices, widths: powers of two
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set(xlabel=xlabel)
    ax.grid(alpha=0.3)


def plot_comm(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Grouped bars per strategy: eqxpar's wire bytes, the minimum and the baseline's (MB)."""
    if not records:
        return False
    fig, (ax,) = figure(size=(max(8.0, 0.9 * len(records) + 2), 4.5))
    series = {"comm_wire_bytes_total": "eqxpar", "comm_wire_bytes_min": "theoretical minimum"}
    series["comm_wire_bytes_baseline"] = "baseline: jax.jit (GSPMD); eqxpar GPipe for pipelines"
    width = 0.8 / len(series)
    for i, (field, name) in enumerate(series.items()):
        # A missing value (no baseline, say) leaves a gap in its group, not a zero bar.
        if points := [(j, r[field] / MB) for j, r in enumerate(records) if r.get(field) is not None]:
            xs, ys = zip(*points, strict=True)
            ax.bar([x + (i - 1) * width for x in xs], ys, width, label=name, color=f"C{i}")
    _bars(ax, records, "MB sent per device per step (ring)", "Collective wire bytes per step")
    ax.legend()
    fig.savefig(path, dpi=110)
    return True


def plot_step_ratio(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Bars of step time over the baseline's, coloured by what the baseline is (legend)."""
    rows = [(r, x) for r in records if (x := ratio(r["step_time_s"], r["baseline_step_time_s"])) is not None]
    if not rows:
        return False
    fig, (ax,) = figure(size=(max(8.0, 0.8 * len(rows) + 2), 5.5))
    for colour, name in enumerate(dict.fromkeys(r["baseline"] for r, _ in rows)):
        indices = [i for i, (r, _) in enumerate(rows) if r["baseline"] == name]
        label = "vs " + textwrap.shorten(name, 110, placeholder=" ...")
        bars = ax.bar(indices, [rows[i][1] for i in indices], 0.6, color=f"C{colour}", label=label)
        ax.bar_label(bars, [f"{rows[i][1]:.2f}" for i in indices], fontsize=8, padding=2)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", zorder=0)
    ax.set_ylim(0, max(max(x for _, x in rows), 1.0) * 1.15)
    title = "Step time relative to the baseline (same process, interleaved; < 1 is faster)"
    _bars(ax, [r for r, _ in rows], "step time / baseline step time", title)
    fig.legend(loc="outside lower center", fontsize=7, ncols=1)
    fig.savefig(path, dpi=110)
    return True


def memory_sweep(record: dict[str, Any]) -> list[tuple[int, int]]:
    """`(micro-batches, temp bytes)` of a record's `memory_sweep`, sorted."""
    return sorted((e["microbatches"], e["mem_temp_bytes"]) for e in record.get("memory_sweep", []))


def plot_pipeline_memory(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """Temp memory per device against micro-batches, one line per record with a sweep."""
    sweeps = [(r["strategy"], memory_sweep(r)) for r in records if r.get("memory_sweep")]
    if not sweeps:
        return False
    fig, (ax,) = figure()
    for name, points in sweeps:
        ax.plot([m for m, _ in points], [t / MiB for _, t in points], marker="o", label=name)
    _log2_x(ax, sorted({m for _, points in sweeps for m, _ in points}), "micro-batches per step")
    ax.set(ylabel="temp MiB per device", ylim=(0, None))
    ax.set_title("Pipeline activation memory against micro-batches")
    ax.legend()
    fig.savefig(path, dpi=110)
    return True


#: PNG name -> plot of `benchmarks.run`'s records.
PLOTS = {"comm.png": plot_comm, "step_ratio.png": plot_step_ratio}
PLOTS["pipeline_memory.png"] = plot_pipeline_memory
# DP's and FSDP's wire bytes coincide: the larger marker under the smaller keeps both visible.
_STYLES = {"dp": ("tab:blue", "o", 9), "fsdp_manual": ("tab:orange", "s", 5), "tp": ("tab:green", "^", 6)}
#: The sweep plot's lines: (field, axis, line, unit, label suffix, keywords: else the strategy's marker).
_LINES = (
    ("mem_argument_bytes", 0, "-", MiB, ": arguments", None),
    ("mem_temp_bytes", 0, "--", MiB, ": temp", None),
    ("comm_wire_bytes_total", 1, "-", MB, ": eqxpar", None),
    ("comm_wire_bytes_min", 1, ":", MB, ": minimum", {"linewidth": 3, "alpha": 0.5}),
    ("comm_wire_bytes_baseline", 1, "x", MB, ": jax.jit", {"markersize": 9}),
    ("step_time_ratio", 2, "-", 1.0, "", None),
)


def plot_sweep(records: Sequence[dict], path: pathlib.Path, *, x: str, xlabel: str, title: str) -> bool:
    """A scaling sweep against `x` (log 2): memory, wire bytes beside the minimum, and the step-time ratio."""
    if not records:
        return False
    fig, axes = figure(ncols=3, size=(15.0, 4.6))
    for strategy in dict.fromkeys(r["strategy"] for r in records):
        rows = sorted((r for r in records if r["strategy"] == strategy), key=lambda r: r[x])
        colour, marker, size = _STYLES.get(strategy, (None, "D", 5))
        for field, i, line, unit, suffix, style in _LINES:
            if points := [(r[x], r[field] / unit) for r in rows if r.get(field) is not None]:
                xs, ys = zip(*points, strict=True)
                style = style or {"marker": marker, "markersize": size}
                axes[i].plot(xs, ys, line, color=colour, label=strategy + suffix, **style)
    for ax in axes:
        _log2_x(ax, sorted({r[x] for r in records}), xlabel)
        ax.legend(fontsize=7)
    axes[0].set(yscale="log", ylabel="MiB per device (memory_analysis)", title="Per-device memory")
    if min(r["comm_wire_bytes_total"] for r in records) > 0:  # a one-device point moves 0 bytes: no log
        axes[1].set_yscale("log")
    axes[1].set(ylabel="MB sent per device per step (ring)", title="Collective wire bytes (dotted: minimum)")
    axes[2].axhline(1.0, color="black", linewidth=1, linestyle="--")
    axes[2].set(ylim=(0, None), ylabel="step time / reference step time")
    references = " / ".join(sorted({r["reference"] for r in records}))
    axes[2].set_title(f"Step time vs {references}\n(shared cores: not a speed-up)", fontsize=10)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True


def write_all(data: dict[str, Any], out: pathlib.Path) -> dict[str, bool]:
    """Every plot of `PLOTS` for a benchmark JSON's contents into folder `out`: name -> written."""
    out.mkdir(parents=True, exist_ok=True)
    return {name: plot(data["records"], out / name) for name, plot in PLOTS.items()}


def main(argv: Sequence[str] | None = None) -> dict[str, bool]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plots", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, default=pathlib.Path("benchmarks/results/quick.json"))
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"))
    args = parser.parse_args(argv)
    written = write_all(json.loads(args.json.read_text()), args.out)
    for name, done in written.items():
        skipped = f"skipped {name}: no record in {args.json} has what it plots"
        print(f"wrote {args.out / name}" if done else skipped)
    return written


if __name__ == "__main__":
    main()
