"""The plan advisor against measurements: every benchmarked plan's predicted memory
and wire bytes beside its compiled step's (compiled, never run), the same for
every plan the advisor ranks for the demo's GPT (`examples/demo.py --advise`),
and the advisor's ranking for the workload at 8, 64 and 512 devices (predicted
only above 8).

    python -m benchmarks.advise --json benchmarks/results/advise.json --markdown BENCHMARKS.md

The Markdown section "## Plan advisor: predicted against measured" is written
(or replaced) just before "## Tables".
"""

import argparse
import contextlib
import io
import json
import pathlib
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp

import eqxpar
from eqxpar._advise._analysis import analyse, outline  # noqa: E402
from eqxpar._advise._predict import predict  # noqa: E402

from . import _workload, report
from ._strategies import MEMORY_ONLY, STRATEGIES

TITLE = "## Plan advisor: predicted against measured"
TOLERANCE = 0.10
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


#: The predicted / measured pairs of every record.
MEASURES = ("argument_bytes", "temp_bytes", "wire_bytes")


def _errors(pairs: dict) -> dict:
    """`what -> {predicted, measured, error}` of `pairs`: `what -> (predicted, measured)`."""
    return {
        w: {"predicted": p, "measured": m, "error": p / m - 1.0 if m else 0.0} for w, (p, m) in pairs.items()
    }


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
    shapes, tokens = outline(model), outline(batch)
    is_param = lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)  # noqa: E731
    opt = eqx.filter_eval_shape(optim.init, eqx.filter(shapes, is_param))
    analysis = analyse(shapes, setup.loss_fn, tokens)
    cpu = eqxpar.DEVICE_PROFILES["cpu"]
    prediction = predict(setup.plan, shapes, opt, tokens, setup.loss_fn, analysis, cpu)
    pairs = {
        "argument_bytes": (prediction.argument_bytes, memory.argument_bytes),
        "temp_bytes": (prediction.temp_bytes, memory.temp_bytes),
        "wire_bytes": (prediction.total_wire_bytes, stats.total_wire_bytes),
    }
    record = {"strategy": name, "mesh": strategy.mesh, "compile_s": time.perf_counter() - start}
    record |= _errors(pairs)
    record["wire_bytes_by_kind"] = {"predicted": prediction.wire_bytes, "measured": stats.wire_bytes}
    print(name, {k: round(record[k]["error"], 4) for k in pairs}, flush=True)
    return record


def _check_every(advice, label: str) -> list[dict]:
    """Every candidate of `advice` compiled (never run, one at a time) beside its
    prediction."""
    records = []
    for i, candidate in enumerate(advice.candidates):
        start = time.perf_counter()
        c = advice.compare(i)
        errors = _errors({w: getattr(c, w) for w in MEASURES})
        record = {"plan": candidate.name, **errors, "compile_s": time.perf_counter() - start}
        print(label, candidate.name, {k: round(record[k]["error"], 4) for k in MEASURES}, flush=True)
        records.append(record)
    return records


def _demo_script():
    sys.path.insert(0, str(EXAMPLES))
    import demo as demo_script

    return demo_script


def demo() -> list[dict]:
    """Every candidate `examples/demo.py --advise` ranks for the demo's GPT (its
    default model, batch 32 x 65 tokens, 8 devices, the "cpu" profile), each
    compiled beside its prediction."""
    with contextlib.redirect_stdout(io.StringIO()):
        advice = _demo_script().main(["--advise"])["advice"]
    return _check_every(advice, "demo")


def demo_moe() -> list[dict]:
    """The demo's GPT with every second block a mixture of 8 experts (top 2,
    dropless), built as `examples/demo.py` builds its GPT: every candidate the
    advisor ranks for 8 devices, each compiled beside its prediction."""
    script = _demo_script()
    args = script.parse_args([])
    config = script.gpt_config(args, script.CharData(), moe_every=2, experts=8, top_k=2)
    model = eqx.filter_jit(eqxpar.models.GPT)(config, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)
    optimizer = script.adamw_warmup_cosine(args.lr, args.steps)
    advice = eqxpar.advise(model, eqxpar.models.lm_loss, optimizer, tokens, devices=8, device="cpu")
    return _check_every(advice, "demo_moe")


def rankings(counts=(8, 64, 512), top: int = 8) -> list[dict]:
    """The advisor's ranking for the workload (batch 32 per 8 devices, H100 profile,
    80 GB), pipelines included."""
    cfg = _workload.CONFIG
    model = eqx.filter_eval_shape(_workload.make_model, cfg)
    optim, pipeline = _workload.make_optimizer(cfg), _workload.PIPELINE_LOSS
    out = []
    for n in counts:
        batch = jax.ShapeDtypeStruct((cfg.batch * max(1, n // 8), cfg.seq_len + 1), jnp.int32)
        advice = eqxpar.advise(
            model, _workload.loss_fn, optim, batch, devices=n, device="h100", pipeline_loss=pipeline
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


def _err(r: dict, what: str) -> str:
    e = r[what]["error"]
    mark = "" if abs(e) <= TOLERANCE else " **>10 %**"
    return f"{r[what]['predicted']:,} / {r[what]['measured']:,} ({e:+.1%}){mark}"


def _table(records: list[dict], name: str, head: tuple, first) -> list[str]:
    """A Markdown table of each record's predicted / measured bytes after its cells
    `first(record)` under `head`, and the records outside the tolerance by `name`."""
    rows = [[*first(r), *(_err(r, w) for w in MEASURES)] for r in records]
    table = report.markdown_table((*head, "arguments", "temporaries", "wire bytes"), rows)
    bad = {w: [r[name] for r in records if abs(r[w]["error"]) > TOLERANCE] for w in MEASURES}
    return [
        table,
        "",
        "Outside 10 %: " + "; ".join(f"{w}: {', '.join(v) or 'none'}" for w, v in bad.items()) + ".",
    ]


def _every_table(title: str, intro: list[str], records: list[dict]) -> list[str]:
    """A section of every candidate's predicted / measured bytes."""
    return ["", title, "", *intro, "", *_table(records, "plan", ("plan",), lambda r: [r["plan"]])]


def markdown(
    records: list[dict], ranks: list[dict], demo_records: list[dict], moe_records: list[dict]
) -> str:
    mesh = lambda r: [r["strategy"], " x ".join(f"{a}={n}" for a, n in r["mesh"].items())]  # noqa: E731
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
        "the schedule's residual slots, each as the engine lays one out (its per-device setup",
        "traced on the plan's mesh), its input / cotangent slots, and what a tick holds beside",
        "them (the slot read and the slot written, then a forward's fresh residuals or a",
        "backward's unpacked residuals, one layer's cotangents and the stage's weight",
        "gradients, whichever is larger); dropless expert parallelism: `n` times the routed",
        "rows and their dispatch buffers. Wire bytes are `minimum_comm` plus eqxpar's known",
        "overheads (pipelines: a boundary buffer each way on the ticks the engine sends).",
        "",
        *_table(records, "strategy", ("record", "mesh"), mesh),
    ]
    lines += _every_table(
        "### The demo's GPT: every candidate",
        [
            "`examples/demo.py --advise`'s model (its default flags: 4 layers, d_model 128, 4 heads,",
            "2 key/value heads, batch 32 x 65 tokens): every plan the advisor ranks for 8 devices",
            '("cpu" profile), each compiled (never run, one at a time) beside its prediction.',
        ],
        demo_records,
    )
    lines += _every_table(
        "### The demo's GPT with mixture-of-experts blocks: every candidate",
        [
            "The same GPT with every second block a dropless mixture of 8 experts (top 2):",
            "the advisor skips sequence-parallel plans (the MoE layer refuses them).",
        ],
        moe_records,
    )
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
    head = ("#", "plan", "memory / device", "wire bytes / device", "step (predicted)")
    for rank in ranks:
        rows = [
            [
                str(i),
                row["plan"],
                f"{row['memory_bytes']:,}",
                f"{row['wire_bytes']:,}",
                f"{row['step_time_s'] * 1e3:.3g} ms",
            ]
            for i, row in enumerate(rank["top"])
        ]
        plans = f"{rank['candidates']} plans fit; top {len(rank['top'])}"
        lines += [
            "",
            f"{rank['devices']} devices (batch {rank['batch']}, {plans}):",
            "",
            report.markdown_table(head, rows),
        ]
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
    demo_records, moe_records = demo(), demo_moe()
    ranks = rankings()
    out = {"records": records, "demo": demo_records, "demo_moe": moe_records, "rankings": ranks}
    args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.markdown:
        write_section(args.markdown, markdown(records, ranks, demo_records, moe_records))


if __name__ == "__main__":
    main()
