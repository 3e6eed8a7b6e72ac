"""Scaling sweeps on the ANCHORS.md workload: devices and model width.

    python -m benchmarks.scaling --json benchmarks/results/scaling.json \
        [--png-dir benchmarks/results] [--markdown benchmarks/SCALING.md] [--quick]

What 8 simulated devices on 2 shared CPU cores measure reliably: the collective
bytes of the compiled step (against the theoretical minimum) and its per-device
memory (`memory_analysis()`). Step times are recorded too, but simulated devices
share the same 2 cores, so more devices is no speed-up: each step time is reported
as a ratio to a reference timed in the same process, one step each in turn.

- **devices**: `dp` (data = n), `fsdp_manual` (fsdp = n, `rules.FSDP`, manual) for
  n in 1, 2, 4, 8, and `tp` (tensor = n, Megatron layout, data 1) for n dividing the
  4 heads; the reference is a plain single-device `jax.jit` step of the workload.
- **width**: d_model 128, 256, 512 (4 heads, MLP 4 x d_model) on 8 devices for `dp`,
  `fsdp_manual` and, without `--quick`, `tp` (data 2 x tensor 4); the reference is
  the hand-written `jax.jit` step with the same shardings, as in `benchmarks.run`.
"""

import os

# 8 simulated CPU devices; XLA reads the flag once, when jax is first imported. Not
# added twice: the tests import this module after conftest has set it.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import shlex  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from typing import Any  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402
from jax.sharding import PartitionSpec  # noqa: E402
from jaxtyping import PyTree  # noqa: E402

import eqxpar  # noqa: E402

from . import _measure, _tp_model, _workload, plots  # noqa: E402
from ._baseline import JitStep  # noqa: E402
from ._strategies import (  # noqa: E402
    Minimum,
    Setup,
    _gspmd_baseline,
    _tp_baseline_specs,
    local_param_bytes,
    min_comm_bytes,
    sharded_minimum,
)

DEVICES = 8
# (warm-up steps, timed steps) per side. The first warm-up step compiles; each point
# compiles once (its `.compile()` for the HLO and memory reuses the cached executable).
QUICK = (2, 3)
FULL = (3, 10)

#: strategy -> the meshes of the devices sweep (tp: tensor divides the 4 heads).
DEVICE_SWEEP: dict[str, tuple[dict[str, int], ...]] = {
    "dp": tuple({"data": n} for n in (1, 2, 4, 8)),
    "fsdp_manual": tuple({"fsdp": n} for n in (1, 2, 4, 8)),
    "tp": tuple({"tensor": n} for n in (1, 2, 4)),
}
#: strategy -> its mesh in the width sweep (8 devices each).
WIDTH_MESH: dict[str, dict[str, int]] = {
    "dp": {"data": 8},
    "fsdp_manual": {"fsdp": 8},
    "tp": {"data": 2, "tensor": 4},
}
WIDTHS = (128, 256, 512)
#: The width sweep's strategies under `--quick`: GSPMD's TP baseline recompiles for
#: a minute per width on 2 cores (it reshuffles the heads of the fused QKV weight).
WIDTH_QUICK = ("dp", "fsdp_manual")

SINGLE_REFERENCE = "single-device jax.jit"
SAME_SHARDINGS_REFERENCE = "jax.jit, same shardings"


def config(d_model: int) -> _workload.Config:
    """The workload at width `d_model`: 4 heads, MLP 4 x d_model, all else as ANCHORS.md."""
    return dataclasses.replace(_workload.CONFIG, d_model=d_model, mlp=4 * d_model)


def mesh_devices(mesh: dict[str, int]) -> int:
    """How many devices a mesh of these axis sizes takes."""
    return math.prod(mesh.values())


def build(
    strategy: str,
    model: _workload.Transformer,
    optim: optax.GradientTransformation,
    mesh: dict[str, int],
    cfg: _workload.Config,
    *,
    baseline: bool,
) -> Setup:
    """The `Setup` of `strategy` on the first `mesh_devices(mesh)` devices.

    The builders of `benchmarks._strategies` fix their mesh to all 8 devices and the
    workload to ANCHORS.md's; these are the same plans (and the same `jax.jit`
    baselines) on a mesh and width of the sweep's choosing.

    **Arguments:**

    - `strategy`: `"dp"`, `"fsdp_manual"` or `"tp"`.
    - `model`, `optim`: the plain workload model at width `cfg`, and its optimizer.
    - `mesh`: eqxpar axis sizes, e.g. `{"fsdp": 4}`.
    - `cfg`: the workload configuration `model` was made with.
    - `baseline`: whether to build the hand-written `jax.jit` step with the same
      shardings (it copies the model's weights, so only where it is measured).

    **Returns:** the `Setup`; its `baseline` is None when `baseline` is False.
    """
    devices = jax.devices()[: mesh_devices(mesh)]
    if strategy == "dp":
        plan = eqxpar.Plan(eqxpar.make_mesh(**mesh, devices=devices))
        step = eqxpar.train.make_step(_workload.loss_fn, optim, plan)
        base = JitStep(
            _workload.loss_fn,
            optim,
            model,
            plan.mesh,
            param_specs=PartitionSpec(),
            batch_spec=plan.batch_spec,
        )
        return Setup(plan=plan, step=step, baseline=base if baseline else None, min_kind="dp")
    if strategy == "fsdp_manual":
        plan = eqxpar.Plan(
            eqxpar.make_mesh(**mesh, devices=devices), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual"
        )
        step = eqxpar.train.make_step(_workload.loss_fn, optim, plan)
        base = None
        if baseline:
            specs = eqxpar.partition_specs(eqx.filter(model, eqx.is_inexact_array), plan)
            base = _gspmd_baseline(model, optim, plan, specs)
        return Setup(plan=plan, step=step, baseline=base, min_kind="sharded")
    if strategy == "tp":
        plan = eqxpar.Plan(eqxpar.make_mesh(**mesh, devices=devices), rules=eqxpar.rules.MEGATRON)
        step = eqxpar.train.make_step(_tp_model.loss_fn, optim, plan)
        base = _gspmd_baseline(model, optim, plan, _tp_baseline_specs(model)) if baseline else None
        return Setup(
            plan=plan,
            step=step,
            baseline=base,
            min_kind="tp",
            loss_fn=_tp_model.loss_fn,
            convert=functools.partial(_tp_model.convert, cfg=cfg),
        )
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(WIDTH_MESH)}")


def minimum(setup: Setup, model: Any, eqx_model: Any, cfg: _workload.Config) -> Minimum:
    """The theoretical communication minimum of a setup, as `benchmarks.run` counts it."""
    if setup.min_kind == "sharded":
        return sharded_minimum(eqx_model, setup.plan, cfg)
    return min_comm_bytes(
        setup.min_kind,
        param_bytes=sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))),
        mesh_shape={k: int(v) for k, v in setup.plan.mesh.shape.items()},
        local_param_bytes=local_param_bytes(eqx_model, setup.plan),
        cfg=cfg,
    )


class SingleDeviceRunner(_measure.BaselineRunner):
    """The plain workload under `jax.jit` on device 0 alone, cycling through its batches.

    One instance serves every point of the devices sweep (compiled once), so it keeps
    training across points: its step time is the reference, its numbers are not.
    """

    def __init__(self, model: Any, optim: optax.GradientTransformation, batches: Sequence):
        mesh = eqxpar.make_mesh(devices=jax.devices()[:1])
        step = JitStep(
            _workload.loss_fn, optim, model, mesh, param_specs=PartitionSpec(), batch_spec=PartitionSpec()
        )
        super().__init__(step, batches)

    def __call__(self) -> PyTree:
        loss = self.step(self.batches[self.done % len(self.batches)])
        self.done += 1
        return (self.step.params, self.step.opt_state, loss)


def make_record(
    *,
    sweep: str,
    strategy: str,
    mesh: dict[str, int],
    cfg: _workload.Config,
    params: int,
    minimum: Minimum,
    comm_bytes: dict[str, int],
    comm_counts: dict[str, int],
    comm_wire: dict[str, int],
    mem_argument_bytes: int,
    mem_temp_bytes: int,
    step_times_s: Sequence[float],
    reference: str,
    reference_step_times_s: Sequence[float],
    comm_wire_baseline: int | None = None,
    vs_baseline_rel_err: float | None = None,
    wall_s: float | None = None,
) -> dict[str, Any]:
    """One point of a sweep as a JSON-ready dict (no jax: the numbers are measured already).

    **Arguments:** what the point is (`sweep`, `strategy`, `mesh` with every axis
    size, `cfg`, `params`), its minimum, the per-kind collective result bytes, counts
    and wire bytes of the compiled step, its per-device memory, the timed steps of
    both sides and the name of the reference; optionally the baseline's wire bytes,
    the parameter error of eqxpar against the same-shardings baseline after the same
    steps, and the point's wall time.

    **Returns:** the record; ratios are None where their denominator is missing or 0.
    """
    wire = sum(comm_wire.values())
    step, ref = _measure.median(step_times_s), _measure.median(reference_step_times_s)
    return {
        "sweep": sweep,
        "strategy": strategy,
        "mesh": {k: int(v) for k, v in mesh.items() if v > 1},
        "devices": mesh_devices(mesh),
        "d_model": cfg.d_model,
        "heads": cfg.heads,
        "mlp": cfg.mlp,
        "params": int(params),
        "param_bytes": int(params) * 4,
        "comm_bytes": dict(comm_bytes),
        "comm_counts": dict(comm_counts),
        "comm_bytes_total": sum(comm_bytes.values()),
        "comm_bytes_min": minimum.result_bytes,
        "comm_wire_bytes": dict(comm_wire),
        "comm_wire_bytes_total": wire,
        "comm_wire_bytes_min": minimum.wire_bytes,
        "comm_wire_bytes_baseline": comm_wire_baseline,
        # 0 / 0 (one device, nothing to move) is "at the minimum".
        "wire_over_min": (wire / minimum.wire_bytes) if minimum.wire_bytes else (1.0 if wire == 0 else None),
        "mem_argument_bytes": int(mem_argument_bytes),
        "mem_temp_bytes": int(mem_temp_bytes),
        "step_time_s": step,
        "step_times_s": list(step_times_s),
        "reference": reference,
        "reference_step_time_s": ref,
        "reference_step_times_s": list(reference_step_times_s),
        "step_time_ratio": step / ref if ref else None,
        "vs_baseline_params_rel_err": vs_baseline_rel_err,
        "wall_s": wall_s,
    }


def measure_point(
    sweep: str,
    strategy: str,
    mesh: dict[str, int],
    cfg: _workload.Config,
    model: _workload.Transformer,
    optim: optax.GradientTransformation,
    batches: Sequence,
    *,
    warm: int,
    timed: int,
    single: SingleDeviceRunner | None = None,
) -> dict[str, Any]:
    """Compile, time and inspect one point; returns its `make_record`.

    With `single`, the step is timed against that single-device reference;
    otherwise against the hand-written `jax.jit` step with the same shardings,
    whose wire bytes and parameters after the same steps are recorded too.
    """
    started = time.perf_counter()
    setup = build(strategy, model, optim, mesh, cfg, baseline=single is None)
    eqx_model = setup.convert(model)
    runner = _measure.EqxparRunner(setup.step, setup.plan, eqx_model, optim, batches)
    other = single if single is not None else _measure.BaselineRunner(setup.baseline, batches)
    times = _measure.time_interleaved([runner, other], warm=warm, timed=timed)
    # After the timed steps, so this is the executable they ran (jit's cache), not a second compile.
    compiled = runner.compile()
    comm_bytes, comm_counts, comm_wire = _measure.comm(compiled)
    arg_bytes, temp_bytes = _measure.memory(compiled)
    wire_baseline = vs_baseline = None
    if single is None:
        wire_baseline = sum(_measure.comm(other.compile())[2].values())
        # Same init, same batches, same number of steps: what eqxpar adds to the
        # strategy shows here (DP's reduction order alone is ~1e-4 after AdamW).
        vs_baseline = _measure.max_rel_err(
            runner.params(), eqx.filter(setup.convert(other.params()), eqx.is_inexact_array)
        )
    return make_record(
        sweep=sweep,
        strategy=strategy,
        mesh={k: int(v) for k, v in setup.plan.mesh.shape.items()},
        cfg=cfg,
        params=_workload.param_count(model),
        minimum=minimum(setup, model, eqx_model, cfg),
        comm_bytes=comm_bytes,
        comm_counts=comm_counts,
        comm_wire=comm_wire,
        mem_argument_bytes=arg_bytes,
        mem_temp_bytes=temp_bytes,
        step_times_s=times[0],
        reference=SINGLE_REFERENCE if single is not None else SAME_SHARDINGS_REFERENCE,
        reference_step_times_s=times[1],
        comm_wire_baseline=wire_baseline,
        vs_baseline_rel_err=vs_baseline,
        wall_s=time.perf_counter() - started,
    )


# --- plots ---------------------------------------------------------------------------

_COLOURS = {"dp": "tab:blue", "fsdp_manual": "tab:orange", "tp": "tab:green"}
# Marker and size per strategy: DP's and FSDP's wire bytes coincide, so the larger
# marker under the smaller keeps both visible.
_MARKERS = {"dp": ("o", 9), "fsdp_manual": ("s", 5), "tp": ("^", 6)}


def _lines(records: Sequence[dict[str, Any]], x: str) -> dict[str, list[dict[str, Any]]]:
    # Records by strategy, each list in order of `x`; records without `x` are skipped.
    out: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if plots.number(r.get(x)) is not None:
            out.setdefault(str(r.get("strategy", "?")), []).append(r)
    return {k: sorted(v, key=lambda r: r[x]) for k, v in out.items()}


def _series(rows: Sequence[dict[str, Any]], x: str, y: Any) -> tuple[list[float], list[float]]:
    # (xs, ys) of the rows where `y(row)` is a number.
    points = [(row[x], plots.number(y(row))) for row in rows]
    points = [(a, b) for a, b in points if b is not None]
    return [a for a, _ in points], [b for _, b in points]


def _plot_sweep(
    records: Sequence[dict[str, Any]], path: pathlib.Path, *, x: str, xlabel: str, title: str
) -> bool:
    """Three panels against `x` (log 2): per-device memory, wire bytes with the minimum,
    and the step-time ratio, one colour per strategy."""
    lines = _lines(records, x)
    if not lines:
        return False
    fig, (mem_ax, wire_ax, time_ax) = plots.figure(ncols=3, size=(15.0, 4.6))
    xs_all = sorted({r[x] for rows in lines.values() for r in rows})
    wire_all = []
    for strategy, rows in lines.items():
        colour = _COLOURS.get(strategy)
        marker, size = _MARKERS.get(strategy, ("D", 5))
        style = {"color": colour, "marker": marker, "markersize": size}
        xs, ys = _series(rows, x, lambda r: r.get("mem_argument_bytes"))
        mem_ax.plot(xs, [y / plots.MiB for y in ys], "-", **style, label=f"{strategy}: arguments")
        xs, ys = _series(rows, x, lambda r: r.get("mem_temp_bytes"))
        mem_ax.plot(xs, [y / plots.MiB for y in ys], "--", **style, label=f"{strategy}: temp")
        xs, ys = _series(rows, x, lambda r: r.get("comm_wire_bytes_total"))
        wire_all += ys
        wire_ax.plot(xs, [y / plots.MB for y in ys], "-", **style, label=f"{strategy}: eqxpar")
        xs, ys = _series(rows, x, lambda r: r.get("comm_wire_bytes_min"))
        wire_ax.plot(
            xs,
            [y / plots.MB for y in ys],
            ":",
            color=colour,
            linewidth=3,
            alpha=0.5,
            label=f"{strategy}: minimum",
        )
        xs, ys = _series(rows, x, lambda r: r.get("comm_wire_bytes_baseline"))
        if xs:
            wire_ax.plot(
                xs, [y / plots.MB for y in ys], "x", color=colour, markersize=9, label=f"{strategy}: jax.jit"
            )
        xs, ys = _series(rows, x, lambda r: r.get("step_time_ratio"))
        time_ax.plot(xs, ys, "-", **style, label=strategy)
    references = sorted(
        {str(r.get("reference")) for rows in lines.values() for r in rows if r.get("reference")}
    )
    for ax in (mem_ax, wire_ax, time_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs_all, [str(v) for v in xs_all])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    mem_ax.set_yscale("log")
    if wire_all and min(wire_all) > 0:
        # Bytes spanning more than a decade (the width sweep) read better in log; a
        # one-device point moves 0 bytes, which log cannot show.
        wire_ax.set_yscale("log")
    mem_ax.set_ylabel("MiB per device (memory_analysis)")
    mem_ax.set_title("Per-device memory")
    wire_ax.set_ylabel("MB sent per device per step (ring)")
    wire_ax.set_title("Collective wire bytes (dotted: minimum)")
    time_ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    time_ax.set_ylim(bottom=0)
    time_ax.set_ylabel("step time / reference step time")
    time_ax.set_title(
        "Step time vs " + (" / ".join(references) or "reference") + "\n(2 shared cores: not a speed-up)",
        fontsize=10,
    )
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    return True


def plot_devices(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """`scaling_devices.png`: memory, wire bytes and step-time ratio against devices.

    **Returns:** whether a PNG was written (False when no record has a device count).
    """
    return _plot_sweep(
        records,
        path,
        x="devices",
        xlabel="devices",
        title="Scaling with devices (ANCHORS workload, d_model 256)",
    )


def plot_width(records: Sequence[dict[str, Any]], path: pathlib.Path) -> bool:
    """`scaling_width.png`: memory, wire bytes and step-time ratio against d_model.

    **Returns:** whether a PNG was written (False when no record has a d_model).
    """
    return _plot_sweep(
        records,
        path,
        x="d_model",
        xlabel="d_model (4 heads, MLP 4 x d_model)",
        title="Scaling with width (8 devices)",
    )


# --- Markdown ------------------------------------------------------------------------

COLUMNS = (
    "strategy",
    "mesh",
    "d_model",
    "params (M)",
    "wire MB",
    "min MB",
    "wire/min",
    "jax.jit wire MB",
    "argument MiB",
    "temp MiB",
    "step time / reference",
)


def row(record: dict[str, Any]) -> list[str]:
    """The table cells of one sweep record, as text (a dash for what is missing)."""
    dash = lambda x, fmt, unit=1.0: "—" if plots.number(x) is None else format(x / unit, fmt)  # noqa: E731
    mesh = record.get("mesh") or {}
    return [
        str(record.get("strategy", "?")),
        " × ".join(f"{k} {v}" for k, v in mesh.items()) or "1 device",
        str(record.get("d_model", "—")),
        dash(record.get("params"), ".2f", 1e6),
        dash(record.get("comm_wire_bytes_total"), ".2f", plots.MB),
        dash(record.get("comm_wire_bytes_min"), ".2f", plots.MB),
        dash(record.get("wire_over_min"), ".4f"),
        dash(record.get("comm_wire_bytes_baseline"), ".2f", plots.MB),
        dash(record.get("mem_argument_bytes"), ".1f", plots.MiB),
        dash(record.get("mem_temp_bytes"), ".1f", plots.MiB),
        dash(record.get("step_time_ratio"), ".2f"),
    ]


def table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of sweep records, one line per point; columns no record has are left out."""
    rows = [row(r) for r in records]
    keep = [i for i in range(len(COLUMNS)) if not rows or any(cells[i] != "—" for cells in rows)]
    lines = ["| " + " | ".join(COLUMNS[i] for i in keep) + " |", "|" + "---|" * len(keep)]
    return "\n".join(lines + ["| " + " | ".join(cells[i] for i in keep) + " |" for cells in rows])


def _mib(x: float) -> str:
    return f"{x / plots.MiB:.1f}"


def findings(data: dict[str, Any]) -> list[str]:
    """What the numbers show, each line computed from `data` (so that it stays true when re-run).

    **Returns:** Markdown bullet texts (without the bullet), for the sweeps present.
    """
    out = []
    by = {(r.get("strategy"), r.get("devices")): r for r in data.get("devices_sweep", [])}
    ns = sorted({n for _, n in by if isinstance(n, int)})
    dp = [(n, by[("dp", n)]) for n in ns if ("dp", n) in by]
    fsdp = [(n, by[("fsdp_manual", n)]) for n in ns if ("fsdp_manual", n) in by]
    tp = [(n, by[("tp", n)]) for n in ns if ("tp", n) in by]
    moving = [(n, r) for n, r in dp if n > 1]
    if moving:
        params = moving[0][1]["param_bytes"]
        cells = ", ".join(
            f"n = {n}: {r['comm_wire_bytes_total'] / plots.MB:.2f} MB "
            f"({r['comm_wire_bytes_total'] / (2 * (n - 1) / n * params):.4f} × that)"
            for n, r in moving
        )
        out.append(
            f"**DP wire bytes = 2(n-1)/n × the {params / plots.MB:.2f} MB of parameters** (one ring "
            f"all-reduce of the gradients): {cells}. Arguments stay at "
            f"{' / '.join(_mib(r['mem_argument_bytes']) for _, r in dp)} MiB for n = "
            f"{' / '.join(str(n) for n, _ in dp)}: every device keeps the whole model and both AdamW "
            f"moments. Temp memory (the activations of the local batch) is what falls with n: "
            f"{' / '.join(_mib(r['mem_temp_bytes']) for _, r in dp)} MiB."
        )
    if len(fsdp) > 1 and fsdp[0][0] == 1:
        one = fsdp[0][1]["mem_argument_bytes"]
        scaled = ", ".join(f"{r['mem_argument_bytes'] * n / one:.3f}" for n, r in fsdp[1:])
        dp_at = dict(dp)
        extra = [
            (n, r["mem_temp_bytes"] - dp_at[n]["mem_temp_bytes"]) for n, r in fsdp if n > 1 and n in dp_at
        ]
        line = (
            "**FSDP per-device memory = 1/n.** Arguments (parameters, AdamW moments and the local "
            f"batch): {' / '.join(_mib(r['mem_argument_bytes']) for _, r in fsdp)} MiB for n = "
            f"{' / '.join(str(n) for n, _ in fsdp)}; times n over the one-device figure: {scaled} "
            "(1 = exactly 1/n). Its wire bytes equal DP's at every n: an all-gather of the weights "
            "((n-1)/n × parameters) plus a reduce-scatter of the gradients (the same) is a ring "
            "all-reduce split in two."
        )
        if extra:
            params_mib = fsdp[0][1]["param_bytes"]
            line += (
                " Temp memory is DP's plus "
                + " / ".join(_mib(x) for _, x in extra)
                + f" MiB (n = {' / '.join(str(n) for n, _ in extra)}), whatever n: about the whole "
                f"gathered model ({_mib(params_mib)} MiB), as when each gathered weight is kept for "
                "the backward pass (the minimum's remat 'none') rather than gathered again."
            )
            n, r = fsdp[-1]
            if n in dp_at:
                line += (
                    f" At n = {n}, arguments + temp per device: FSDP "
                    f"{_mib(r['mem_argument_bytes'] + r['mem_temp_bytes'])} MiB, DP "
                    f"{_mib(dp_at[n]['mem_argument_bytes'] + dp_at[n]['mem_temp_bytes'])} MiB."
                )
        out.append(line)
    split = [(n, r) for n, r in tp if n > 1]
    if split:
        w = {**_workload.describe(), **data.get("workload", {})}
        activation = w["global_batch"] * w["seq_len"] * w["d_model"] * 4
        cells = ", ".join(
            f"n = {n}: {r['comm_wire_bytes_total'] / plots.MB:.2f} MB ({r['wire_over_min']:.4f} × min)"
            for n, r in split
        )
        out.append(
            f"**TP moves activations, not weights:** {4 * w['layers']} all-reduces per step of the "
            f"(batch, seq, d_model) activation ({activation / plots.MB:.2f} MB), 2(n-1)/n × that each "
            f"on the wire: {cells}. Arguments fall less than 1/n "
            f"({' / '.join(_mib(r['mem_argument_bytes']) for _, r in tp)} MiB for n = "
            f"{' / '.join(str(n) for n, _ in tp)}): the embedding, positions, head and norms stay "
            "replicated. Temp memory too "
            f"({' / '.join(_mib(r['mem_temp_bytes']) for _, r in tp)} MiB): every device holds the "
            "whole batch's residual stream, norms and logits; only the heads' and MLP features' "
            "activations are split."
        )
    timed = [r for r in data.get("devices_sweep", []) if plots.number(r.get("step_time_ratio")) is not None]
    if timed:
        ratios = [r["step_time_ratio"] for r in timed]
        out.append(
            f"**Step time against the {SINGLE_REFERENCE} step:** {min(ratios):.2f} to {max(ratios):.2f} "
            "over all points. On 2 shared cores the simulated devices divide the same CPU, so a "
            "step costs about the same total work at every n: these ratios say that splitting the "
            "step costs little extra work, not that it would be faster on real devices. With 3 "
            "timed steps on a shared host, a point's ratio moves by ±20 % or more from run to run "
            "(ANCHORS.md): read the trend, not a point."
        )
    width = data.get("width_sweep", [])
    at_min = [r for r in width if plots.number(r.get("wire_over_min")) is not None]
    if at_min:
        worst = max(at_min, key=lambda r: r["wire_over_min"])
        out.append(
            f"**Width:** every point is within {worst['wire_over_min']:.4f} × its minimum (worst: "
            f"{worst['strategy']} at d_model {worst['d_model']}). DP's and FSDP's bytes grow with the "
            "parameters (about d_model²)"
            + (
                ", TP's activation bytes with d_model."
                if any(r.get("strategy") == "tp" for r in at_min)
                else "."
            )
        )
        gspmd = [
            (r["strategy"], r["d_model"], r["comm_wire_bytes_baseline"] / r["comm_wire_bytes_total"])
            for r in at_min
            if plots.number(r.get("comm_wire_bytes_baseline")) and r["comm_wire_bytes_total"]
        ]
        if gspmd:
            out.append(
                "**`jax.jit` with the same shardings, wire bytes over eqxpar's:** "
                + ", ".join(f"{s} d{d}: {x:.2f}" for s, d, x in gspmd)
                + " (GSPMD all-reduces the whole FSDP gradient on CPU where a reduce-scatter suffices)."
            )
    ratios = [
        (r["strategy"], r["d_model"], r["step_time_ratio"])
        for r in width
        if plots.number(r.get("step_time_ratio")) is not None
    ]
    if ratios:
        out.append(
            "**Step time against `jax.jit` with the same shardings** (interleaved, same process): "
            + ", ".join(f"{s} d{d}: {x:.2f}" for s, d, x in ratios)
            + "."
        )
    return out


def _format_max(records: Sequence[dict[str, Any]], field: str) -> str:
    # The largest value of `field` over `records`, as text; a dash when none has it.
    values = [x for x in (plots.number(r.get(field)) for r in records) if x is not None]
    return format(max(values), ".1e") if values else "—"


def render(data: dict[str, Any]) -> str:
    """The Markdown page for a scaling JSON."""
    timing = data.get("timing", {})
    parts = [
        "# eqxpar scaling sweeps",
        "",
        f"Made by `{data.get('command', '?')}` with jax {data.get('jax', '?')} on {data.get('devices', '?')} "
        f"simulated {data.get('platform', '?')} devices ({data.get('cpu_count', 2)} shared cores)"
        + (f", in {data['wall_time_s']:.0f} s" if plots.number(data.get("wall_time_s")) is not None else "")
        + (
            " (1-minute load average at the start / end: "
            + " / ".join(f"{x:.1f}" for x in data["load_average_1min"].values())
            + ")"
            if isinstance(data.get("load_average_1min"), dict)
            else ""
        )
        + ". Timing: "
        + ", ".join(f"{k} {v}" for k, v in timing.items())
        + ".",
        "",
        "Workload: ANCHORS.md's decoder-only transformer (vocab 512, 4 layers, 4 heads, sequence 128, "
        "global batch 32, AdamW, float32), d_model 256 unless the width sweep says otherwise, MLP 4 × d_model. "
        "Wire bytes are the bytes each device sends per step with bandwidth-optimal rings, read from the "
        "compiled HLO, against the theoretical minimum (`benchmarks/_strategies.py`); memory is "
        "`compiled.memory_analysis()` per device. 1 MB = 10^6 bytes, 1 MiB = 2^20.",
        "",
        "Step times: 8 simulated devices share 2 CPU cores, so more devices are not a speed-up and "
        "absolute seconds mean little. Each point's step is timed one step at a time in turn with a "
        "reference in the same process, and only the ratio is reported.",
        "",
        "## Devices",
        "",
        f"`dp` (data = n), `fsdp_manual` (fsdp = n, `rules.FSDP`, manual) and `tp` (tensor = n, "
        f"`rules.MEGATRON`, automatic; n divides the 4 heads). Reference: a plain {SINGLE_REFERENCE} "
        "step of the same workload (one compiled step shared by all points)"
        + (
            f"; its per-device memory: arguments {data['single_device']['mem_argument_bytes'] / plots.MiB:.1f} MiB, "
            f"temp {data['single_device']['mem_temp_bytes'] / plots.MiB:.1f} MiB"
            if isinstance(data.get("single_device"), dict)
            else ""
        )
        + ".",
        "",
        table(data.get("devices_sweep", [])),
        "",
        "![devices](results/scaling_devices.png)",
        "",
        "## Width",
        "",
        "8 devices: `dp` (data 8), `fsdp_manual` (fsdp 8) and, in a run without `--quick`, `tp` "
        "(data 2 × tensor 4); d_model 128, 256, 512 with MLP 4 × d_model. Reference: the hand-written "
        f"{SAME_SHARDINGS_REFERENCE} (as in BENCHMARKS.md); `jax.jit wire MB` is its wire bytes. "
        "After the same steps from the same init, eqxpar's parameters differ from that baseline's by "
        "at most "
        + _format_max(data.get("width_sweep", []), "vs_baseline_params_rel_err")
        + " (relative to each leaf's scale).",
        "",
        table(data.get("width_sweep", [])),
        "",
        "![width](results/scaling_width.png)",
        "",
        "## What the numbers show",
        "",
        *[f"- {line}" for line in findings(data)],
        "",
    ]
    return "\n".join(parts)


# --- the run -------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scaling", description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, type=pathlib.Path, help="where to write the results")
    parser.add_argument(
        "--png-dir", type=pathlib.Path, help="also write scaling_devices.png and scaling_width.png here"
    )
    parser.add_argument("--markdown", type=pathlib.Path, help="also render the results as Markdown here")
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK[0]} warm + {QUICK[1]} timed steps per side"
    )
    parser.add_argument(
        "--replot",
        action="store_true",
        help="measure nothing: read --json and write only the PNGs and Markdown from it",
    )
    parser.add_argument(
        "--sweeps",
        default="devices,width",
        help="comma-separated sweeps to run: devices, width (default: both)",
    )
    args = parser.parse_args(argv)
    args.sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    if not args.sweeps or set(args.sweeps) - {"devices", "width"}:
        parser.error(f"--sweeps {','.join(args.sweeps)!r}: choose from devices, width")
    return args


def write_outputs(data: dict[str, Any], png_dir: pathlib.Path | None, markdown: pathlib.Path | None) -> list:
    """Write the sweeps' PNGs into `png_dir` and the Markdown page to `markdown` (each if given).

    **Returns:** the paths written.
    """
    written = []
    if png_dir is not None:
        png_dir.mkdir(parents=True, exist_ok=True)
        for name, plot, records in (
            ("scaling_devices.png", plot_devices, data.get("devices_sweep", [])),
            ("scaling_width.png", plot_width, data.get("width_sweep", [])),
        ):
            if plot(records, png_dir / name):
                written.append(png_dir / name)
    if markdown is not None:
        markdown.write_text(render(data))
        written.append(markdown)
    return written


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parse(argv)
    if args.replot:
        data = json.loads(args.json.read_text())
        written = write_outputs(data, args.png_dir, args.markdown)
        print(f"wrote {', '.join(map(str, written)) or 'nothing (give --png-dir or --markdown)'}")
        return data
    if jax.device_count() != DEVICES:
        sys.exit(
            f"the sweeps need {DEVICES} devices, jax sees {jax.device_count()} (was jax imported before?)"
        )
    if args.png_dir is not None:
        try:
            plots.figure()
        except ImportError as e:
            sys.exit(str(e))
    started = time.perf_counter()
    warm, timed = QUICK if args.quick else FULL
    optim = _workload.make_optimizer()
    batches = _workload.make_batches(warm + timed)
    command = "python -m benchmarks.scaling " + shlex.join(sys.argv[1:] if argv is None else argv)
    data: dict[str, Any] = {
        **_measure.run_header(command, warm=warm, timed=timed),
        # How busy the host was: step-time ratios from a loaded machine are noisier.
        "cpu_count": os.cpu_count(),
        "load_average_1min": {"start": os.getloadavg()[0]},
        "devices_sweep": [],
        "width_sweep": [],
    }
    print(f"{command}\njax {jax.__version__}; {warm} warm + {timed} timed steps per side", flush=True)

    def report(record: dict[str, Any]) -> None:
        print(" | ".join(row(record)) + f"  ({record['wall_s']:.0f} s)", flush=True)

    if "devices" in args.sweeps:
        model = _workload.make_model()
        single = SingleDeviceRunner(model, optim, batches)
        print("devices sweep, reference: " + SINGLE_REFERENCE, flush=True)
        for strategy, meshes in DEVICE_SWEEP.items():
            for mesh in meshes:
                record = measure_point(
                    "devices",
                    strategy,
                    mesh,
                    _workload.CONFIG,
                    model,
                    optim,
                    batches,
                    warm=warm,
                    timed=timed,
                    single=single,
                )
                data["devices_sweep"].append(record)
                report(record)
        arg_bytes, temp_bytes = _measure.memory(single.compile())
        data["single_device"] = {
            "d_model": _workload.CONFIG.d_model,
            "mem_argument_bytes": arg_bytes,
            "mem_temp_bytes": temp_bytes,
        }
        del single
    if "width" in args.sweeps:
        print("width sweep, reference: " + SAME_SHARDINGS_REFERENCE, flush=True)
        for d_model in WIDTHS:
            cfg = config(d_model)
            model = _workload.make_model(cfg)
            for strategy, mesh in WIDTH_MESH.items():
                if args.quick and strategy not in WIDTH_QUICK:
                    continue
                record = measure_point(
                    "width", strategy, mesh, cfg, model, optim, batches, warm=warm, timed=timed
                )
                data["width_sweep"].append(record)
                report(record)
    data["wall_time_s"] = time.perf_counter() - started
    data["load_average_1min"]["end"] = os.getloadavg()[0]

    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=2) + "\n")
    written = [args.json, *write_outputs(data, args.png_dir, args.markdown)]
    print(f"wrote {', '.join(map(str, written))} in {data['wall_time_s']:.0f} s")
    return data


if __name__ == "__main__":
    main()
