"""Render a benchmark JSON (from `benchmarks.run`) as Markdown.

    python -m benchmarks.report benchmarks/results/quick.json > BENCHMARKS.md

Imports no jax, so it runs anywhere the JSON is.
"""

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

MB = 1e6
MiB = 2**20

COLUMNS = (
    "strategy",
    "mesh",
    "step time (s)",
    "ratio to baseline",
    "comm MB total",
    "min MB",
    "wire MB",
    "wire min MB",
    "baseline wire MB",
    "wire/min",
    "argument MiB",
    "temp MiB",
    "parity max rel err",
)

EXPLANATION = """\
- **step time (s)**: median wall time of one compiled step (forward, backward, AdamW update,
  state donated) after warm-up, waiting for every output.
- **ratio to baseline**: eqxpar's step time over that of a hand-written `jax.jit` step with the
  same shardings (no eqxpar code), both timed in the same process with their steps interleaved
  one by one. Timings on 2 shared CPU cores simulating 8 devices are noisy (about ±20 % run to
  run): compare ratios only, never absolute seconds across runs. The eqxpar step also returns
  the gradient norm and counts steps; the baseline returns only the loss.
- **comm MB total**: collective *result* bytes per device per step, read from the compiled HLO
  (all-reduce: the full tensor; all-gather: the gathered tensor; reduce-scatter: the shard;
  collective-permute: the moved tensor), loop bodies weighted by their trip count; kinds and
  counts in parentheses (AR all-reduce, AG all-gather, RS reduce-scatter, CP collective-permute,
  A2A all-to-all). 1 MB = 10^6 bytes.
- **min MB**: the theoretical minimum of the same count for the strategy (data parallel: one
  all-reduce of the gradients = the parameter bytes; tensor parallel: 16 activation
  all-reduces plus the data-axis all-reduce of the local gradients; the scalar loss reduction
  is not counted).
- **wire MB**: the bytes each device sends, with bandwidth-optimal rings over each
  collective's group of n devices: all-reduce 2(n-1)/n x result, all-gather and all-to-all
  (n-1)/n x result, reduce-scatter (n-1) x result, collective-permute its result. This is
  the measure that compares an all-reduce with the all-gather + reduce-scatter pair (sequence
  parallelism) or the ring of permutes (overlap) that replaces it: they move the same wire
  bytes but different result bytes.
- **wire min MB**: the theoretical minimum in wire bytes.
- **baseline wire MB**: the wire bytes of the compiled hand-written `jax.jit` step.
- **wire/min**: wire bytes over the minimum; the contract is at most 1.05.
- **argument MiB / temp MiB**: per-device argument and temporary buffer sizes of the compiled
  eqxpar step (`compiled.memory_analysis()`).
- **parity max rel err**: at the trained parameters, the loss and gradients of the eqxpar
  step's own gradient path (`eqxpar.train.make_value_and_grad`) against
  `eqx.filter_value_and_grad` on one device: max over the loss and every gradient leaf of
  max|eqxpar - reference| / max|reference| (details below). The contract is at most 1e-5.
"""

_SHORT = {
    "all-reduce": "AR",
    "all-gather": "AG",
    "reduce-scatter": "RS",
    "collective-permute": "CP",
    "all-to-all": "A2A",
}


def format_or_dash(x: float | None, fmt: str) -> str:
    """`x` formatted with `fmt`, or a dash for a missing value."""
    return "—" if x is None else format(x, fmt)


def _scaled(x: float | None, unit: float) -> float | None:
    return None if x is None else x / unit


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def row(record: dict[str, Any]) -> list[str]:
    """The table cells of one record, as text."""
    mesh = " × ".join(f"{k} {v}" for k, v in record["mesh"].items()) or "1 device"
    kinds = ", ".join(f"{_SHORT.get(k, k)} {n}" for k, n in record["comm_counts"].items())
    total = record["comm_bytes_total"]
    comm_total = f"{total / MB:.2f}" + (f" ({kinds})" if kinds else "")
    wire = record["comm_wire_bytes_total"]
    return [
        record["strategy"],
        mesh,
        format_or_dash(record["step_time_s"], ".3f"),
        format_or_dash(_ratio(record["step_time_s"], record["baseline_step_time_s"]), ".3f"),
        comm_total,
        format_or_dash(_scaled(record["comm_bytes_min"], MB), ".2f"),
        format_or_dash(_scaled(wire, MB), ".2f"),
        format_or_dash(_scaled(record["comm_wire_bytes_min"], MB), ".2f"),
        format_or_dash(_scaled(record["comm_wire_bytes_baseline"], MB), ".2f"),
        format_or_dash(_ratio(wire, record["comm_wire_bytes_min"]), ".4f"),
        format_or_dash(_scaled(record["mem_argument_bytes"], MiB), ".1f"),
        format_or_dash(_scaled(record["mem_temp_bytes"], MiB), ".1f"),
        format_or_dash(record["parity_max_rel_err"], ".2e"),
    ]


PARITY_COLUMNS = (
    "strategy",
    "loss rel err",
    "gradients max rel err",
    "trajectory: params",
    "trajectory: last loss",
    "trajectory: eqxpar vs baseline",
)

PARITY_EXPLANATION = """\
The first two columns are the parity of the step (the contract): at the trained parameters,
the loss and gradients eqxpar computes for the plan against one device, leaf by leaf. The
trajectory columns compare whole runs after the same steps from the same init over the same
batches. Data parallelism sums the gradients in another order than one device does, so they
differ by float32 rounding (~1e-7). AdamW then divides each gradient element by its own running
scale (eps 1e-8): where an element's gradient is tiny, that rounding becomes a visible fraction
of its step, so parameters drift apart far more than gradients do, with any implementation of
the strategy. The last column compares against the hand-written `jax.jit` step with the same
shardings after as many steps: it isolates what eqxpar itself adds (0 means bit-identical).
"""


#: Per-strategy notes rendered under the tables, for the strategies present.
NOTES = {
    "tp": (
        "**tp, tp_sp, tp_overlap** run the workload rewritten with `eqxpar.nn` layers "
        "(`benchmarks/_tp_model.py`: fused-QKV `TransformerBlock`s; embedding, positions and head "
        "replicated, as in ANCHORS.md's Megatron minimum). It is the same function at the same "
        "weights (tested), and parity is measured against the plain workload on one device. The "
        "baseline is the plain workload under `jax.jit` with Megatron shardings (QKV and MLP-up "
        "split by output features, attention-out and MLP-down by input features): the heads inside "
        "its single (768, 256) QKV weight cannot be expressed as one PartitionSpec, so GSPMD "
        "reshuffles them (collective-permutes and all-to-alls on top of the 17 all-reduces). "
        "`tp` (automatic) meets the minimum: the 16 activation all-reduces over `tensor` and one "
        "gradient all-reduce over `data` (plus the scalar loss)."
    ),
    "tp_sp": (
        "**tp_sp / tp_overlap**: the same wire bytes; 3.3 % over the minimum because under "
        "sequence parallelism each device computes the replicated weights' gradients (embedding, "
        "positions, head, norms, row biases: 1.18 MB) on its sequence block only, so they are "
        "summed over `tensor` as well as `data`. Step time: the target is 0.5 x the `jax.jit` TP "
        "step (ANCHORS.md's hand-written sequence-parallel `shard_map`: 0.31); measured 0.50 "
        "(sync) and 0.52 (ring) in the run below, 0.51 and 0.60 in the one before: at the target "
        "for sync, just over it for the ring. On 2 shared cores the ring's permutes cannot overlap anything, "
        "so it costs its loop overhead and buys nothing; it is judged here by bytes and parity."
    ),
    "fsdp_manual": (
        "**fsdp_manual / zero1 / hsdp** run the plain workload (no eqxpar layer) with "
        "`rules.FSDP` (every large weight split over `fsdp` on its largest divisible dimension, "
        "ANCHORS.md's `jax.jit` FSDP layout) or ZeRO-1's `rules.ZeroShard`. The minimum "
        "(`benchmarks/_strategies.py::sharded_minimum`) gathers each split weight once and keeps "
        "it for the backward pass (remat none), reduce-scatters its gradient and all-reduces the "
        "replicated leaves. The baseline, `jax.jit` with the same shardings, all-reduces the whole "
        "gradient on CPU and slices it (36.24 MB on the wire, 1.50x the minimum); eqxpar's manual "
        "FSDP reduce-scatters through the gather's transpose: the minimum, 0.67x GSPMD's wire "
        "bytes. eqxpar's automatic `fsdp` plan *is* that GSPMD step, so it misses the 1.05x "
        "contract and is not listed; `python -m benchmarks.run --quick --only fsdp ...` measures it."
    ),
    "fsdp_tp": (
        "**fsdp_tp / dp_fsdp_tp** run the `eqxpar.nn` workload with `rules.MEGATRON_FSDP` "
        "(heads, MLP features, vocabulary over `tensor`; the model dimension over `fsdp`), manual "
        "with sequence parallelism; the baseline is `jax.jit` with the Megatron shardings plus "
        "`fsdp` on each weight's largest free dimension. Over the minimum by the sequence-parallel "
        "overhead of tp_sp (replicated weights' gradients summed over `tensor` too)."
    ),
}


def notes(records: Sequence[dict[str, Any]]) -> str:
    """The notes of `NOTES` whose strategy appears in `records`."""
    present = {r["strategy"] for r in records}
    return "\n\n".join(text for name, text in NOTES.items() if name in present)


def parity_table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of each record's parity numbers."""
    lines = ["| " + " | ".join(PARITY_COLUMNS) + " |", "|" + "---|" * len(PARITY_COLUMNS)]
    for r in records:
        cells = [
            r["strategy"],
            format_or_dash(r.get("parity_loss_rel_err"), ".2e"),
            format_or_dash(r.get("parity_grads_rel_err"), ".2e"),
            format_or_dash(r.get("trajectory_params_rel_err"), ".2e"),
            format_or_dash(r.get("trajectory_loss_rel_err"), ".2e"),
            format_or_dash(r.get("trajectory_vs_baseline_rel_err"), ".2e"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table(records: Sequence[dict[str, Any]]) -> str:
    """A Markdown table of `records`, one line per strategy."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row(r)) + " |" for r in records]
    return "\n".join(lines)


def render(data: dict[str, Any]) -> str:
    """The whole Markdown page for one benchmark JSON."""
    workload = data["workload"]
    timing = data.get("timing", {})
    sizes = ", ".join(f"{k} {v}" for k, v in workload.items() if k != "model")
    described = f"{workload['model']}; {sizes}" if "model" in workload else sizes
    parts = [
        "# eqxpar benchmarks",
        "",
        f"Made by `{data['command']}` with jax {data['jax']} on {data['devices']} devices"
        + (f", {data['platform']}" if "platform" in data else "")
        + (f", in {data['wall_time_s']:.0f} s" if data.get("wall_time_s") is not None else "")
        + "."
        + (
            " Records were merged from several runs (`--merge`); each record's `command` in the JSON "
            "says which: " + "; ".join(f"`{c}`" for c in data["commands"]) + "."
            if data.get("commands") and len(data["commands"]) > 1
            else ""
        ),
        "",
        f"Workload (ANCHORS.md): {described}.",
    ]
    if timing:
        parts += ["", "Timing: " + ", ".join(f"{k} {v}" for k, v in timing.items()) + "."]
    parts += ["", table(data["records"]), "", "Columns:", "", EXPLANATION]
    parts += ["## Parity", "", parity_table(data["records"]), "", PARITY_EXPLANATION]
    if notes(data["records"]):
        parts += ["## Notes", "", notes(data["records"]), ""]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", help="a JSON file written by `python -m benchmarks.run`")
    args = parser.parse_args(argv)
    with open(args.json) as f:
        sys.stdout.write(render(json.load(f)))


if __name__ == "__main__":
    main()
