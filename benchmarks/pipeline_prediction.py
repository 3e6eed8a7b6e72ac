"""Predicted pipeline step times from one stage's measured per-action times.

For `p` in {4, 8} stages and `m = 4p` micro-batches, every schedule table of
`SCHEDULES` is simulated with `eqxpar.pipeline.simulate`, free-running and lockstep,
from the per-action times of `benchmarks/one_device.py`'s `stage_actions` (`SOURCES`),
under two engine models (`engine_costs`): `recompute` (`Plan(remat="full")`) and
`residuals kept` (every other remat policy). A chunk (2 per device) takes what
`stage_actions` measured on one block where the source has that, else half the stage's
time. No communication time: the prediction is the schedule's bubble under measured
action costs, not a network model (BENCHMARKS.md, "Predicted pipeline step"). CPU-only,
seconds:

    python -m benchmarks.pipeline_prediction [--json benchmarks/results/pipeline_prediction.json]
                                             [--markdown BENCHMARKS.md]
"""

import argparse
import json
import pathlib
from collections.abc import Sequence
from typing import Any

from eqxpar.pipeline import schedule, simulate

from . import report

RESULTS = pathlib.Path(__file__).parent / "results"
#: (results file, label). The H100's file (`one_device_gpu.json`) was measured before
#: the engine split its backward for zero-bubble, so it has no `I_split`/`W_split`.
SOURCES = (("one_device_h200.json", "H200"), ("one_device_cpu.json", "CPU"))
STAGES = (4, 8)
#: (schedule name, chunks, column title).
SCHEDULES = (
    ("gpipe", 1, "GPipe"),
    ("1f1b", 1, "1F1B"),
    ("interleaved", 2, "interleaved v=2"),
    ("zero_bubble", 1, "ZB-H1"),
    ("zb_v", 2, "ZB-V"),
    ("dualpipe_v", 2, "DualPipeV"),
)
MODELS = ("recompute", "residuals kept")
BEGIN = "<!-- pipeline prediction table (python -m benchmarks.pipeline_prediction --markdown): edit the prose outside it -->"
END = "<!-- end of pipeline prediction table -->"


def engine_costs(seconds: dict[str, float], model: str) -> dict[str, float]:
    """Per-action times of one whole stage under an engine model. `recompute`: the
    engine keeps only a stage's input, so its backward re-runs the forward (B =
    B_recompute; zero-bubble's I and W each re-run it, + F). `residuals kept`: the
    forward keeps its residuals (F = F_keep); I and W are the engine's split backward's
    halves where the source measured them, else two separate pull-backs."""
    if model == "recompute":
        f = seconds["F"]
        return {"F": f, "B": seconds["B_recompute"], "I": seconds["I"] + f, "W": seconds["W"] + f}
    halves = ("I_split", "W_split") if "I_split" in seconds else ("I", "W")
    return {"F": seconds["F_keep"], "B": seconds["B"], "I": seconds[halves[0]], "W": seconds[halves[1]]}


def chunk_of(measured: dict, stage: str) -> dict:
    """The measured one-block chunk of `stage` (`NAME_chunk`; `{}` if not timed). A
    chunk's one block runs in no loop, whether its stage's are scanned or not."""
    return measured.get(f"{stage.removesuffix('_unrolled')}_chunk", {})


def chunk_costs(
    costs: dict[str, float], stage: dict, chunk: dict, chunks: int, model: str
) -> dict[str, float]:
    """Per-action times of one of a stage's `chunks` chunks: the measured chunk's
    where the source timed one of that size (`NAME_chunk`), else the stage's split
    evenly."""
    if chunks == 1:
        return costs
    if "seconds" in chunk and chunk["config"]["layers"] * chunks == stage["config"]["layers"]:
        return engine_costs(chunk["seconds"], model)
    return {k: v / chunks for k, v in costs.items()}


#: The stages a pipeline record's prediction is made from: the benchmark workload's
#: own (2 blocks, one sequence per micro-batch; launch-bound on a GPU), and the wide
#: one unrolled (compute-bound; its chunk, one block, runs in no loop either).
RECORD_STAGES = ("workload", "wide_unrolled")


def speedup_over_gpipe(name: str, *, stages: int, microbatches: int, chunks: int) -> dict[str, dict]:
    """What a pipeline record states of its schedule: per source and per stage of
    `RECORD_STAGES` it measured, the predicted speed-up over GPipe (free-running and
    lockstep) of `name` at this size, with residuals kept (the records'
    `remat="none"`). The ratio depends on the actions' relative times only, so a
    tensor-split stage (3d) takes them too."""
    out = {}
    for file, label in SOURCES:
        measured = json.loads((RESULTS / file).read_text())["stage_actions"]
        out[label] = {"source": f"results/{file}"}
        for stage in RECORD_STAGES:
            if "seconds" not in measured.get(stage, {}):
                continue
            chunk = chunk_of(measured, stage)
            costs = engine_costs(measured[stage]["seconds"], "residuals kept")
            gpipe = simulate(schedule("gpipe", stages=stages, microbatches=microbatches), costs)
            table = schedule(name, stages=stages, microbatches=microbatches, chunks=chunks)
            sim = simulate(table, chunk_costs(costs, measured[stage], chunk, chunks, "residuals kept"))
            out[label][stage] = {
                "free": sim.speedup_over(gpipe),
                "lockstep": sim.speedup_over(gpipe, lockstep=True),
            }
    return out


def predict(sources: Sequence[tuple[str, dict]]) -> list[dict[str, Any]]:
    """One row per (device, stage, model, p, schedule)."""
    rows = []
    for device, data in sources:
        measured_stages = data["stage_actions"]
        for stage, measured in measured_stages.items():
            if "seconds" not in measured or stage.endswith("_chunk"):
                continue
            chunk = chunk_of(measured_stages, stage)
            for model in MODELS:
                costs = engine_costs(measured["seconds"], model)
                for p in STAGES:
                    m = 4 * p
                    base = None
                    for name, chunks, _ in SCHEDULES:
                        s = schedule(name, stages=p, microbatches=m, chunks=chunks)
                        sim = simulate(s, chunk_costs(costs, measured, chunk, chunks, model))
                        base = base or sim
                        rows.append(
                            {
                                **{"device": device, "device_kind": data["device_kind"], "stage": stage},
                                **{"model": model, "stages": p, "microbatches": m, "schedule": name},
                                **{"chunks": chunks, "free_s": sim.free_s, "lockstep_s": sim.lockstep_s},
                                **{"work_s": sim.work_s, "bubble": sim.bubble_fraction},
                                "lockstep_bubble": sim.lockstep_bubble_fraction,
                                "speedup_free": sim.speedup_over(base),
                                "speedup_lockstep": sim.speedup_over(base, lockstep=True),
                                "in_flight": s.in_flight,
                            }
                        )
    return rows


def _time(seconds: float) -> str:
    return f"{1e3 * seconds:.3g} ms" if seconds < 1 else f"{seconds:.3g} s"


def markdown(rows: list[dict[str, Any]]) -> str:
    """The table: per (device, stage, model, p) GPipe's predicted step and every
    schedule's speed-up over it, free-running / lockstep."""
    head = ["device", "stage", "engine", "p", "GPipe step free / lockstep", *(t for _, _, t in SCHEDULES[1:])]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["device"], r["stage"], r["model"], r["stages"]), {})[r["schedule"]] = r
    lines = []
    for key, by in groups.items():
        gpipe = f"{_time(by['gpipe']['free_s'])} / {_time(by['gpipe']['lockstep_s'])}"
        speedups = (
            f"{by[n]['speedup_free']:.2f} / {by[n]['speedup_lockstep']:.2f}" for n, _, _ in SCHEDULES[1:]
        )
        lines.append([*key, gpipe, *speedups])
    table = report.markdown_table(head, lines, rule=" --- |")
    title = "#### Predicted pipeline step (m = 4p, no communication time): speed-up over GPipe, free-running / lockstep"
    return f"{title}\n\n{table}"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.pipeline_prediction", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--json", type=pathlib.Path, help="where to write the predictions")
    parser.add_argument(
        "--markdown", type=pathlib.Path, help="a page with the table's markers to write it into"
    )
    args = parser.parse_args(argv)
    sources = [(label, json.loads((RESULTS / name).read_text())) for name, label in SOURCES]
    rows = predict(sources)
    table = markdown(rows)
    print(table)
    if args.json:
        assumptions = {
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
        args.json.write_text(json.dumps({"assumptions": assumptions, "rows": rows}, indent=1) + "\n")
    if args.markdown:
        report.splice(args.markdown, table, begin=BEGIN, end=END)
    return rows


if __name__ == "__main__":
    main()
