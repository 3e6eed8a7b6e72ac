"""The plan advisor against measurements: every benchmarked plan's predicted memory
and wire bytes beside its compiled step's (compiled, never run), and the advisor's
ranking for the workload at 8, 64 and 512 devices (predicted only above 8).

    python -m benchmarks.advise --json benchmarks/results/advise.json --markdown BENCHMARKS.md

The Markdown section "## Plan advisor: predicted against measured" is written
(or replaced) just before "## Tables".
"""

import os

os.environ["XLA_FLAGS"] = " ".join(
    [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_force_host_platform_device_count=8",
        "--xla_cpu_enable_concurrency_optimized_scheduler=false",
    ]
).strip()

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import eqxpar  # noqa: E402
from eqxpar._advise._analysis import analyse, outline  # noqa: E402
from eqxpar._advise._predict import predict  # noqa: E402

from . import _workload  # noqa: E402
from ._strategies import MEMORY_ONLY, STRATEGIES  # noqa: E402

TITLE = "## Plan advisor: predicted against measured"
TOLERANCE = 0.10


def compare(name: str) -> dict:
    """One record: the strategy's step compiled (never run) beside the prediction."""
    strategy = STRATEGIES[name]
    cfg = strategy.config()
    optim = _workload.make_optimizer(cfg)
    model = _workload.make_model(cfg)
    setup = strategy(model, optim, cfg)
    model = setup.convert(model)
    batch = _workload.make_batches(1, cfg)[0]
    state = eqxpar.train.init(model, optim, setup.plan, key=jax.random.key(0))
    start = time.perf_counter()
    lowered = setup.step.lower(state, eqxpar.shard_batch(batch, setup.plan))
    compiled = lowered.compile(compiler_options=MEMORY_ONLY)
    memory = eqxpar.inspect.memory_report(compiled)
    stats = eqxpar.inspect.collective_stats(compiled)
    shapes = outline(model)
    params = eqx.filter(
        shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)
    )
    opt = eqx.filter_eval_shape(optim.init, params)
    tokens = outline(batch)
    prediction = predict(
        setup.plan,
        shapes,
        opt,
        tokens,
        setup.loss_fn,
        analyse(shapes, setup.loss_fn, tokens),
        eqxpar.DEVICE_PROFILES["cpu"],
    )
    pairs = {
        "argument_bytes": (prediction.argument_bytes, memory.argument_bytes),
        "temp_bytes": (prediction.temp_bytes, memory.temp_bytes),
        "wire_bytes": (prediction.total_wire_bytes, stats.total_wire_bytes),
    }
    record = {"strategy": name, "mesh": strategy.mesh, "compile_s": time.perf_counter() - start}
    for what, (p, m) in pairs.items():
        record[what] = {"predicted": p, "measured": m, "error": p / m - 1.0 if m else 0.0}
    record["wire_bytes_by_kind"] = {"predicted": prediction.wire_bytes, "measured": stats.wire_bytes}
    print(name, {k: round(record[k]["error"], 4) for k in pairs}, flush=True)
    return record


def rankings(counts=(8, 64, 512), top: int = 8) -> list[dict]:
    """The advisor's ranking for the workload (batch 32 per 8 devices, H100 profile,
    80 GB), pipelines included."""
    cfg = _workload.CONFIG
    model = eqx.filter_eval_shape(_workload.make_model, cfg)
    out = []
    for n in counts:
        batch = jax.ShapeDtypeStruct((cfg.batch * max(1, n // 8), cfg.seq_len + 1), jnp.int32)
        advice = eqxpar.advise(
            model,
            _workload.loss_fn,
            _workload.make_optimizer(cfg),
            batch,
            devices=n,
            device="h100",
            pipeline_loss=_workload.PIPELINE_LOSS,
        )
        rows = [
            {
                "plan": c.name,
                "memory_bytes": c.prediction.memory_bytes,
                "wire_bytes": c.prediction.total_wire_bytes,
                "step_time_s": c.prediction.step_time_s,
            }
            for c in advice.candidates[:top]
        ]
        out.append({"devices": n, "batch": batch.shape[0], "candidates": len(advice.candidates), "top": rows})
    return out


def markdown(records: list[dict], ranks: list[dict]) -> str:
    def err(r: dict, what: str) -> str:
        e = r[what]["error"]
        mark = "" if abs(e) <= TOLERANCE else " **>10 %**"
        return f"{r[what]['predicted']:,} / {r[what]['measured']:,} ({e:+.1%}){mark}"

    lines = [
        TITLE,
        "",
        "`python -m benchmarks.advise --json benchmarks/results/advise.json --markdown BENCHMARKS.md`.",
        "`eqxpar.advise` predicts each plan from shapes only (no compile); here every benchmarked",
        "plan's step is compiled (never run, XLA:CPU, 8 simulated devices) and XLA's",
        "`memory_analysis()` and the compiled HLO's wire bytes are put beside the prediction.",
        "Bytes per device: predicted / measured (error). Arguments come exactly from the",
        "layout; temporaries from the loss's traced residuals plus gradients, gathered",
        "weights, an optimizer share fitted on these records (`UPDATE_SHARE`); pipelines:",
        "the schedule's residual slots times one virtual stage's traced `jax.vjp` residuals,",
        "plus its input / cotangent slots; dropless expert parallelism: `n` times the routed",
        "rows and their dispatch buffers. Wire bytes are `minimum_comm` plus eqxpar's known",
        "overheads (pipelines: a boundary buffer each way on the ticks the engine sends).",
        "",
        "| record | mesh | arguments | temporaries | wire bytes |",
        "|---|---|---|---|---|",
    ]
    for r in records:
        mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items())
        lines.append(
            f"| {r['strategy']} | {mesh} | {err(r, 'argument_bytes')} | {err(r, 'temp_bytes')} | {err(r, 'wire_bytes')} |"
        )
    bad = {
        w: [r["strategy"] for r in records if abs(r[w]["error"]) > TOLERANCE]
        for w in ("argument_bytes", "temp_bytes", "wire_bytes")
    }
    lines += [
        "",
        "Outside 10 %: " + "; ".join(f"{w}: {', '.join(v) or 'none'}" for w, v in bad.items()) + ".",
    ]
    lines += [
        "",
        "### The advisor's ranking for the workload",
        "",
        "H100 profile (measured matmul and copy rates; NVLink / InfiniBand from public specs),",
        "80 GB per device, batch 32 x 128 tokens per 8 devices, pipelines via the workload's",
        "`PipelineLoss`. 8 devices: predicted (the same predictions are checked above);",
        "**64 and 512 devices: predicted only**, on placeholder meshes (nothing can be compiled",
        "for them here). Step times are predictions with communication not overlapped.",
    ]
    for rank in ranks:
        lines += [
            "",
            f"{rank['devices']} devices (batch {rank['batch']}, {rank['candidates']} plans fit; top {len(rank['top'])}):",
            "",
            "| # | plan | memory / device | wire bytes / device | step (predicted) |",
            "|---|---|---|---|---|",
        ]
        for i, row in enumerate(rank["top"]):
            lines.append(
                f"| {i} | {row['plan']} | {row['memory_bytes']:,} | {row['wire_bytes']:,} | {row['step_time_s'] * 1e3:.3g} ms |"
            )
    return "\n".join(lines) + "\n\n"


def write_section(path: pathlib.Path, section: str) -> None:
    text = path.read_text()
    if TITLE in text:
        start = text.index(TITLE)
        end = text.index("## Tables", start)
        text = text[:start] + text[end:]
    at = text.index("## Tables")
    path.write_text(text[:at] + section + text[at:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True)
    parser.add_argument("--markdown", type=pathlib.Path)
    parser.add_argument("--only", default=None, help="comma-separated strategy names")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(STRATEGIES)
    records = [compare(name) for name in names]
    ranks = rankings()
    args.json.write_text(json.dumps({"records": records, "rankings": ranks}, indent=1) + "\n")
    if args.markdown:
        write_section(args.markdown, markdown(records, ranks))


if __name__ == "__main__":
    main()
