"""The plan advisor against measurements (BENCHMARKS.md, "Plan advisor", says what each table holds).

python -m benchmarks.advise --json benchmarks/results/advise.json [--markdown BENCHMARKS.md]
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
from eqxpar._advise._analysis import analyse, outline
from eqxpar._advise._predict import predict

from . import _workload, report
from ._strategies import MEMORY_ONLY, STRATEGIES

TOLERANCE = 0.10
EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
BEGIN = "<!-- advisor tables (python -m benchmarks.advise --markdown): edit the prose outside them -->"
END = "<!-- end of advisor tables -->"
#: The predicted / measured pairs of every record.
MEASURES = ("argument_bytes", "temp_bytes", "wire_bytes")


def _errors(label: str, name: str, pairs: dict) -> dict:
    """`what -> {predicted, measured, error}` of `pairs` (`what -> (predicted, measured)`), printed."""
    out = {
        w: {"predicted": p, "measured": m, "error": p / m - 1.0 if m else 0.0} for w, (p, m) in pairs.items()
    }
    print(label, name, {w: round(e["error"], 4) for w, e in out.items()}, flush=True)
    return out


def compare(name: str) -> dict:
    """One record: the strategy's step compiled (never run) beside the prediction."""
    strategy = STRATEGIES[name]
    cfg = strategy.config()
    optim, model = _workload.make_optimizer(cfg), _workload.make_model(cfg)
    setup = strategy(model, optim, cfg)
    model, batch = setup.convert(model), _workload.make_batches(1, cfg)[0]
    state = eqxpar.train.init(model, optim, setup.plan, key=jax.random.key(0))
    start = time.perf_counter()
    lowered = setup.step.lower(state, eqxpar.shard_batch(batch, setup.plan))
    compiled = lowered.compile(compiler_options=MEMORY_ONLY)
    memory, stats = eqxpar.inspect.memory_report(compiled), eqxpar.inspect.collective_stats(compiled)
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
    record |= _errors("", name, pairs)
    return record | {"wire_bytes_by_kind": {"predicted": prediction.wire_bytes, "measured": stats.wire_bytes}}


def _check_every(advice, label: str) -> list[dict]:
    """Every candidate of `advice` compiled (never run, one at a time) beside its prediction."""
    records = []
    for i, candidate in enumerate(advice.candidates):
        start = time.perf_counter()
        errors = _errors(label, candidate.name, {w: getattr(advice.compare(i), w) for w in MEASURES})
        records.append({"plan": candidate.name, **errors, "compile_s": time.perf_counter() - start})
    return records


def demo(*, moe: bool = False) -> list[dict]:
    """Every candidate the advisor ranks for `examples/demo.py`'s GPT (with `moe`, MoE every second block)."""
    sys.path.insert(0, str(EXAMPLES))
    import demo as script

    if not moe:
        with contextlib.redirect_stdout(io.StringIO()):
            return _check_every(script.main(["--advise"])["advice"], "demo")
    args = script.parse_args([])
    config = script.gpt_config(args, script.CharData(), moe_every=2, experts=8, top_k=2)
    model = eqx.filter_jit(eqxpar.models.GPT)(config, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((args.batch_size, args.seq_len + 1), jnp.int32)
    optimizer = script.adamw_warmup_cosine(args.lr, args.steps)
    advice = eqxpar.advise(model, eqxpar.models.lm_loss, optimizer, tokens, devices=8, device="cpu")
    return _check_every(advice, "demo_moe")


def rankings(counts=(8, 64, 512), top: int = 8) -> list[dict]:
    """The advisor's top plans for the workload (batch 32 per 8 devices, H100 profile), pipelines included."""
    cfg, out = _workload.CONFIG, []
    model = eqx.filter_eval_shape(_workload.make_model, cfg)
    for n in counts:
        batch = jax.ShapeDtypeStruct((cfg.batch * max(1, n // 8), cfg.seq_len + 1), jnp.int32)
        advice = eqxpar.advise(
            model, _workload.loss_fn, _workload.make_optimizer(cfg), batch, devices=n, device="h100",
            pipeline_loss=_workload.PIPELINE_LOSS,
        )  # fmt: skip
        rows = [
            {"plan": c.name, "memory_bytes": (p := c.prediction).memory_bytes}
            | {"wire_bytes": p.total_wire_bytes, "step_time_s": p.step_time_s}
            for c in advice.candidates[:top]
        ]
        out.append({"devices": n, "batch": batch.shape[0], "candidates": len(advice.candidates), "top": rows})
    return out


def _err(r: dict, what: str) -> str:
    e = r[what]["error"]
    mark = "" if abs(e) <= TOLERANCE else " **>10 %**"
    return f"{r[what]['predicted']:,} / {r[what]['measured']:,} ({e:+.1%}){mark}"


def _table(records: list[dict], name: str, head: tuple, first) -> str:
    """Each record's cells `first(record)` and predicted / measured bytes, and those outside the tolerance."""
    rows = [[*first(r), *(_err(r, w) for w in MEASURES)] for r in records]
    bad = {w: [r[name] for r in records if abs(r[w]["error"]) > TOLERANCE] for w in MEASURES}
    outside = "; ".join(f"{w}: {', '.join(v) or 'none'}" for w, v in bad.items())
    return f"{report.markdown_table((*head, 'arguments', 'temporaries', 'wire bytes'), rows)}\n\nOutside 10 %: {outside}."


def markdown(data: dict) -> str:
    """The tables of an advise JSON (`main`'s), as Markdown."""
    mesh = lambda r: [r["strategy"], " x ".join(f"{a}={n}" for a, n in r["mesh"].items())]  # noqa: E731
    plan = lambda r: [r["plan"]]  # noqa: E731
    parts = [
        "#### The benchmarked plans\n\n" + _table(data["records"], "strategy", ("record", "mesh"), mesh),
        "#### The demo's GPT: every candidate\n\n" + _table(data["demo"], "plan", ("plan",), plan),
        "#### The demo's GPT with mixture-of-experts blocks: every candidate\n\n"
        + _table(data["demo_moe"], "plan", ("plan",), plan),
    ]
    head = ("#", "plan", "memory / device", "wire bytes / device", "step (predicted)")
    for rank in data["rankings"]:
        cells = lambda r: [r["plan"], f"{r['memory_bytes']:,}", f"{r['wire_bytes']:,}"]  # noqa: E731
        rows = [[str(i), *cells(r), f"{r['step_time_s'] * 1e3:.3g} ms"] for i, r in enumerate(rank["top"])]
        title = f"{rank['devices']} devices (batch {rank['batch']}, {rank['candidates']} plans fit; top {len(rows)})"
        table = report.markdown_table(head, rows)
        parts.append(f"#### The advisor's ranking for the workload: {title}\n\n{table}")
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True)
    parser.add_argument("--markdown", type=pathlib.Path)
    parser.add_argument("--only", default=None, help="comma-separated strategy names")
    args = parser.parse_args()
    records = [compare(name) for name in (args.only.split(",") if args.only else STRATEGIES)]
    data = {"records": records, "demo": demo(), "demo_moe": demo(moe=True), "rankings": rankings()}
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    if args.markdown:
        report.splice(args.markdown, markdown(data), begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
