"""Predicted pipeline step times from one stage's measured per-action times (benchmarks/README.md).

python -m benchmarks.pipeline_prediction [--json benchmarks/results/pipeline_prediction.json]
                                         [--markdown BENCHMARKS.md]
"""

import argparse
import itertools
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from eqxpar.pipeline import Schedule, Simulation, schedule, simulate

from . import report

RESULTS = pathlib.Path(__file__).parent / "results"
#: (results file, label). The H100's file predates the split backward (no `I_split`/`W_split`).
SOURCES = (("one_device_h200.json", "H200"), ("one_device_cpu.json", "CPU"))
STAGES = (4, 8)
#: (schedule name, chunks, column title).
SCHEDULES = (("gpipe", 1, "GPipe"), ("1f1b", 1, "1F1B"), ("interleaved", 2, "interleaved v=2"))
SCHEDULES += (("zero_bubble", 1, "ZB-H1"), ("zb_v", 2, "ZB-V"), ("dualpipe_v", 2, "DualPipeV"))
MODELS = ("recompute", "residuals kept")
#: What the predictions assume, written into the JSON; `engine_costs` reads the models.
ASSUMPTIONS = {
    "microbatches": "4 * stages",
    "send_s": 0.0,
    "chunk_cost": "a chunk's (interleaved, zb_v, dualpipe_v) actions as measured on one block"
    " (`NAME_chunk`) where the source has them, else half the stage's",
    "models": {
        "recompute": "F = F, B = B_recompute, I = I + F, W = W + F (remat='full': the engine re-runs the forward)",
        "residuals kept": "F = F_keep, B = B, I = I, W = W (the engine's default)",
    },
    "sources": {label: f"results/{name}" for name, label in SOURCES},
}
#: The stages a pipeline record's prediction is made from: the workload's (launch-bound on a
#: GPU) and the wide one unrolled (compute-bound; its one-block chunk runs in no loop either).
RECORD_STAGES = ("workload", "wide_unrolled")
BEGIN = "<!-- pipeline prediction table (python -m benchmarks.pipeline_prediction --markdown): edit the prose outside it -->"
END = "<!-- end of pipeline prediction table -->"


def engine_costs(seconds: dict[str, float], model: str) -> dict[str, float]:
    """Per-action times of one whole stage under an engine model (`ASSUMPTIONS["models"]`)."""
    if model == "recompute":
        f = seconds["F"]
        return {"F": f, "B": seconds["B_recompute"], "I": seconds["I"] + f, "W": seconds["W"] + f}
    halves = ("I_split", "W_split") if "I_split" in seconds else ("I", "W")
    return {"F": seconds["F_keep"], "B": seconds["B"], "I": seconds[halves[0]], "W": seconds[halves[1]]}


def simulated(measured: dict, stage: str, model: str, table: Schedule) -> Simulation:
    """`table` at the measured `stage`'s costs (a chunk's: `ASSUMPTIONS["chunk_cost"]`)."""
    costs, n = engine_costs(measured[stage]["seconds"], model), table.chunks
    chunk = measured.get(f"{stage.removesuffix('_unrolled')}_chunk", {})
    if n > 1 and "seconds" in chunk and chunk["config"]["layers"] * n == measured[stage]["config"]["layers"]:
        costs = engine_costs(chunk["seconds"], model)
    elif n > 1:
        costs = {k: v / n for k, v in costs.items()}
    return simulate(table, costs)


def speedup_over_gpipe(name: str, *, stages: int, microbatches: int, chunks: int) -> dict[str, dict]:
    """Per source and stage of `RECORD_STAGES`, `name`'s predicted speed-up over GPipe, residuals kept."""
    out = {}
    for file, label in SOURCES:
        measured = json.loads((RESULTS / file).read_text())["stage_actions"]
        out[label] = {"source": f"results/{file}"}
        for stage in (s for s in RECORD_STAGES if "seconds" in measured.get(s, {})):
            size, kept = {"stages": stages, "microbatches": microbatches}, "residuals kept"
            gpipe = simulated(measured, stage, kept, schedule("gpipe", **size))
            ratio = simulated(measured, stage, kept, schedule(name, **size, chunks=chunks)).speedup_over
            out[label][stage] = {"free": ratio(gpipe), "lockstep": ratio(gpipe, lockstep=True)}
    return out


def predict(sources: Sequence[tuple[str, dict]]) -> list[dict[str, Any]]:
    """One row per (device, stage, model, p, schedule)."""
    rows = []
    for device, data in sources:
        measured = data["stage_actions"]
        stages = [s for s, m in measured.items() if "seconds" in m and not s.endswith("_chunk")]
        for stage, model, p in itertools.product(stages, MODELS, STAGES):
            base = None
            for name, chunks, _ in SCHEDULES:
                s = schedule(name, stages=p, microbatches=4 * p, chunks=chunks)
                sim = simulated(measured, stage, model, s)
                base = base or sim
                rows.append(
                    {"device": device, "device_kind": data["device_kind"], "stage": stage, "model": model}
                    | {"stages": p, "microbatches": 4 * p, "schedule": name, "chunks": chunks}
                    | {"free_s": sim.free_s, "lockstep_s": sim.lockstep_s, "work_s": sim.work_s}
                    | {"bubble": sim.bubble_fraction, "lockstep_bubble": sim.lockstep_bubble_fraction}
                    | {"speedup_free": sim.speedup_over(base)}
                    | {"speedup_lockstep": sim.speedup_over(base, lockstep=True), "in_flight": s.in_flight}
                )
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """Per (device, stage, model, p) GPipe's predicted step and every schedule's speed-up over it."""
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["device"], r["stage"], r["model"], r["stages"]), {})[r["schedule"]] = r
    time = lambda s: f"{1e3 * s:.3g} ms" if s < 1 else f"{s:.3g} s"  # noqa: E731
    lines = [
        [*key, f"{time(by['gpipe']['free_s'])} / {time(by['gpipe']['lockstep_s'])}"]
        + [f"{by[n]['speedup_free']:.2f} / {by[n]['speedup_lockstep']:.2f}" for n, _, _ in SCHEDULES[1:]]
        for key, by in groups.items()
    ]
    head = ["device", "stage", "engine", "p", "GPipe step free / lockstep", *(t for _, _, t in SCHEDULES[1:])]
    title = "Predicted pipeline step (m = 4p, no communication time): speed-up over GPipe, free-running / lockstep"
    return f"#### {title}\n\n{report.markdown_table(head, lines, rule=' --- |')}"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        "python -m benchmarks.pipeline_prediction", description=__doc__.splitlines()[0]
    )
    add = parser.add_argument
    add("--json", type=pathlib.Path, help="where to write the predictions")
    add("--markdown", type=pathlib.Path, help="a page with the table's markers to write it into")
    args = parser.parse_args(argv)
    rows = predict([(label, json.loads((RESULTS / name).read_text())) for name, label in SOURCES])
    print(table := markdown(rows))
    if args.json:
        args.json.write_text(json.dumps({"assumptions": ASSUMPTIONS, "rows": rows}, indent=1) + "\n")
    if args.markdown:
        report.splice(args.markdown, table, begin=BEGIN, end=END)
    return rows


if __name__ == "__main__":
    main()
