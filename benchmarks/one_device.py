"""Measurements on the one device `jax.devices()[0]` is, which simulated CPU devices cannot
make (benchmarks/README.md); each of `SECTIONS` says what it measures, BENCHMARKS.md reads them.

    python -m benchmarks.one_device [--quick] [--only rates,attention] --json PATH
    python -m benchmarks.one_device --render JSON [JSON ...] --markdown BENCHMARKS.md
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import pathlib
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

from eqxpar import nn

from . import _action_flops, _measure, _workload, report


def timed(fn: Callable, *args: Any, reps: int) -> float:
    """Median seconds of `fn(*args)` over `reps` calls after a compile and two warm-ups."""
    return _measure.timed_steps({"fn": lambda: fn(*args)}, warm=3, timed=reps)["fn"]["step_time_s"]


def weighted_sum(fn: Callable, ct: Any) -> Callable:
    """`sum(fn(*args, **kw) * ct)` in float32: its gradient pulls the cotangent `ct` back through `fn`."""
    return lambda *a, **kw: jnp.sum(fn(*a, **kw).astype(jnp.float32) * jnp.asarray(ct, jnp.float32))


@contextlib.contextmanager
def _row(section: str, rows: list, **row: Any) -> Iterator[dict]:
    """The row the block fills, appended to `rows` and printed; its error is recorded, not fatal."""
    try:
        yield row
    except Exception as error:  # noqa: BLE001
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
    rows.append(row)
    print(f"  {section} {row}", flush=True)


def rates(quick: bool, reps: int) -> dict:
    """Dense matmul FLOP/s in bf16 and float32, and the copy (`2 * x`) and read (`sum`) bandwidths."""
    n = 2048 if quick else 8192
    out: dict[str, Any] = {"matmul_n": n}
    for name, dtype in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        a, b = (jax.random.normal(jax.random.key(i), (n, n), dtype) for i in range(2))
        out[f"matmul_{name}_tflops"] = 2 * n**3 / timed(jax.jit(jnp.matmul), a, b, reps=reps) / 1e12
    # 2 GiB on a GPU: a call's fixed cost (tens of microseconds) is noise beside it.
    size = (16 if quick else 2048 if jax.default_backend() == "gpu" else 512) * report.MiB
    x = jnp.ones((size // 4,), jnp.float32)
    for name, b, fn in (("copy", 2 * size, lambda x: 2 * x), ("read", size, jnp.sum)):
        out |= {f"{name}_bytes": b, f"{name}_gbytes_per_s": b / timed(jax.jit(fn), x, reps=reps) / 1e9}
    print(f"  rates {out}", flush=True)
    return out


def attention(quick: bool, reps: int) -> dict:
    """Causal attention per path and sequence: times, temp bytes, difference from blockwise's output."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    seqs = [1024, 4096] if quick else ([4096, 8192, 16384, 32768] if on_gpu else [1024, 4096, 16384])
    # XLA's dense path holds (heads x seq x seq) scores (96 GiB at 32k): longer
    # sequences are compiled for their memory only.
    dense_max, any_max = (16384, 32768) if on_gpu else (4096, 4096)
    dot = functools.partial(jax.nn.dot_product_attention, is_causal=True)
    paths = {"blockwise": functools.partial(nn.blockwise_attention, causal=True, block_size=512)}
    paths |= {"cudnn": functools.partial(dot, implementation="cudnn")} if on_gpu else {}
    paths |= {"xla_dense": functools.partial(dot, implementation="xla")}
    rows: list[dict] = []
    for seq in seqs:
        q, k, v, ct = (jax.random.normal(jax.random.key(i), (1, seq, 8, 64), dtype) for i in range(4))
        reference = None
        for name, fn in paths.items():
            with _row("attention", rows, path=name, seq=seq, dtype=jnp.dtype(dtype).name) as row:
                fwd_bwd = jax.grad(weighted_sum(fn, ct), argnums=(0, 1, 2))
                memory = jax.jit(fwd_bwd).lower(q, k, v).compile().memory_analysis()
                row["temp_bytes_fwd_bwd"] = int(memory.temp_size_in_bytes)
                if seq <= (dense_max if name == "xla_dense" else any_max):
                    out = jax.jit(fn)(q, k, v)
                    reference = out if reference is None else reference
                    diff = jnp.abs(out.astype(jnp.float32) - reference)
                    row["max_abs_diff_vs_blockwise"] = float(jnp.max(diff))
                    row["fwd_s"] = timed(jax.jit(fn), q, k, v, reps=reps)
                    row["fwd_bwd_s"] = timed(jax.jit(fwd_bwd), q, k, v, reps=reps)
                    # Causal: half the (seq x seq) scores; forward 2 matmuls, backward 5.
                    flops = 4 * 8 * seq * seq * 64 / 2
                    row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                    row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_s"] / 1e12
    return {"batch": 1, "heads": 8, "head_dim": 64, "causal": True, "rows": rows}


def grouped_matmul(quick: bool, reps: int) -> dict:
    """Routed rows times per-expert weights: `lax.ragged_dot`, a masked dense loop and capacity padding."""
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    # XLA:CPU runs ragged_dot as a loop (tens of seconds at the GPU's size): CPU sizes are small.
    small = quick or jax.default_backend() != "gpu"
    tokens, d, hidden, experts, top_k = (1024, 256, 512, 8, 2) if small else (16384, 1024, 4096, 8, 2)
    rows_n = tokens * top_k
    capacity = math.ceil(1.25 * rows_n / experts)
    x = jax.random.normal(jax.random.key(0), (rows_n, d), dtype)
    w = jax.random.normal(jax.random.key(1), (experts, d, hidden), dtype) / math.sqrt(d)
    assign = jnp.sort(jax.random.randint(jax.random.key(2), (rows_n,), 0, experts))
    balanced = jnp.bincount(assign, length=experts).astype(jnp.int32)
    skewed = jnp.zeros((experts,), jnp.int32).at[0].set(rows_n)

    def dense(x, w, group_sizes):
        masked = (jnp.where((assign == e)[:, None], x @ w[e], 0).astype(dtype) for e in range(experts))
        return sum(masked, jnp.zeros((rows_n, hidden), dtype))

    def padded(x, w, group_sizes):
        # The rows laid out as `experts` buffers of `capacity`: the compute, not the dispatch.
        xp = jnp.pad(x, ((0, experts * capacity - rows_n), (0, 0)))
        return jnp.einsum("ecd,edh->ech", xp.reshape(experts, capacity, d), w)

    flops, rows = 2 * rows_n * d * hidden, []
    ragged = jax.lax.ragged_dot
    paths = {"ragged_dot": (ragged, balanced), "ragged_dot_one_expert": (ragged, skewed)}
    paths |= {"dense_every_expert": (dense, balanced), "capacity_padded_1.25": (padded, balanced)}
    for name, (fn, sizes) in paths.items():
        with _row("grouped_matmul", rows, path=name, dtype=jnp.dtype(dtype).name) as row:
            loss = weighted_sum(functools.partial(fn, group_sizes=sizes), 1.0)
            row["fwd_s"] = timed(jax.jit(fn), x, w, sizes, reps=reps)
            row["fwd_bwd_s"] = timed(jax.jit(jax.grad(loss, argnums=(0, 1))), x, w, reps=reps)
            row["fwd_useful_tflops"] = flops / row["fwd_s"] / 1e12
            row["fwd_bwd_useful_tflops"] = 3 * flops / row["fwd_bwd_s"] / 1e12
    sizes = dict(tokens=tokens, top_k=top_k, d=d, hidden=hidden, experts=experts, capacity=capacity)
    return {**sizes, "rows": rows}


_WIDE = dataclasses.replace(_workload.CONFIG, d_model=1024, heads=16, mlp=4096, seq_len=1024)
#: The stages timed, `(config, micro-batch, unrolled)` (BENCHMARKS.md, "A pipeline stage's actions").
STAGES = {
    name + kind: (dataclasses.replace(cfg, layers=1 if kind == "_chunk" else 2), micro, kind == "_unrolled")
    for name, cfg, micro in (("workload", _workload.CONFIG, 1), ("wide", _WIDE, 4))
    for kind in ("", "_unrolled", "_chunk")
}
#: A stage's actions (benchmarks/README.md, "One device").
ACTIONS = ("F", "F_keep", "B", "I", "W", "I_split", "W_split", "B_recompute")


def stage_actions(quick: bool, reps: int) -> dict:
    """Per-action seconds (`ACTIONS`) of each of `STAGES` on one micro-batch."""
    out = {}
    for name, (cfg, micro, unrolled) in STAGES.items():
        if not quick or name.startswith("workload"):
            out[name] = _stage_actions(cfg, micro, reps, unrolled=unrolled)
            print(f"  stage_actions {name} {out[name]['seconds']}", flush=True)
    return out


def _stage_actions(cfg: _workload.Config, micro: int, reps: int, *, unrolled: bool) -> dict:
    blocks = _workload.make_model(cfg).blocks
    if unrolled:
        blocks = nn.Stacked.from_blocks([blocks[i] for i in range(blocks.depth)], unroll=True)
    params, static = eqx.partition(blocks, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(0), (micro, cfg.seq_len, cfg.d_model), jnp.float32)
    ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    stage = lambda params, x: eqx.combine(params, static)(x)  # noqa: E731
    # The engine's actions: F keeping residuals, B from them (`(pull-back, residuals,
    # ct)`), and zero-bubble's halves (one pull-back split, `_split_backward`).
    engine = {k: (jax.jit(f), *a) for k, (f, a) in _action_flops.engine_actions(stage, params, x, ct).items()}
    pullback, both = engine["B"][:2]
    _, input_only = jax.jit(lambda p, x: jax.vjp(lambda x: stage(p, x), x))(params, x)
    _, weight_only = jax.jit(lambda p, x: jax.vjp(lambda p: stage(p, x), p))(params, x)
    recompute = jax.jit(lambda p, x, ct: jax.vjp(stage, p, x)[1](ct))
    calls = {"F": (jax.jit(stage), params, x), "F_keep": engine["F"], "B": engine["B"]}
    calls |= {"I": (pullback, input_only, ct), "W": (pullback, weight_only, ct)}
    calls |= {"B_recompute": (recompute, params, x, ct), "I_split": engine["I"], "W_split": engine["W"]}
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))  # noqa: E731
    out = {"config": dataclasses.asdict(cfg), "micro_batch": micro, "unrolled": unrolled}
    out["seconds"] = {k: timed(*call, reps=reps) for k, call in calls.items()}
    return out | {"residual_bytes_beyond_params": int(nbytes(both) - nbytes(params))}


def attention_agreement(quick: bool, reps: int) -> dict:
    """`nn.Attention`'s `auto` and `blockwise` paths against dense; blockwise's time by block size."""

    def grads_and_output(path: str, dtype: Any, dropout: float, x: jax.Array, ct: jax.Array, kw: dict):
        layer = nn.Attention(512, nn.AttentionConfig(8, kernel=path, dropout=dropout), key=jax.random.key(0))
        layer = jax.tree.map(lambda w: w.astype(dtype), layer)
        call = lambda layer, x, kw: layer(x, **kw)  # noqa: E731
        _, grads = eqx.filter_jit(eqx.filter_value_and_grad(weighted_sum(call, ct)))(layer, x, kw)
        return grads, eqx.filter_jit(call)(layer, x, kw)

    seq, rows, err = 512 if quick else 2048, [], _measure.norm_rel_err
    for dtype in (jnp.float32, jnp.bfloat16):
        x, ct = (jax.random.normal(jax.random.key(i), (2, seq, 512), dtype) for i in (1, 2))
        segments = (jnp.arange(seq)[None, :] >= jnp.array([[seq // 3], [seq // 2]])).astype(jnp.int32)
        cases = {"plain": ({}, 0.0), "segment_ids": ({"segment_ids": segments}, 0.0)}
        for case, (kwargs, rate) in (cases | {"dropout": ({"key": jax.random.key(3)}, 0.1)}).items():
            want_grads, want_out = grads_and_output("dense", dtype, rate, x, ct, kwargs)
            for path in ("blockwise", "auto"):
                grads, out = grads_and_output(path, dtype, rate, x, ct, kwargs)
                rows.append({"dtype": jnp.dtype(dtype).name, "case": case, "path": path, "seq": seq})
                rows[-1] |= {"out_rel_err": err(out, want_out), "grads_rel_err": err(grads, want_grads)}
                print(f"  attention_agreement {rows[-1]}", flush=True)
    q, k, v = (jax.random.normal(jax.random.key(i), (1, 4 * seq, 8, 64), jnp.bfloat16) for i in range(3))
    blocks = {}
    for block in (256, 512, 1024, 2048):
        loss = weighted_sum(functools.partial(nn.blockwise_attention, causal=True, block_size=block), 1.0)
        blocks[block] = timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, reps=reps)
    print(f"  blockwise fwd+bwd seconds by block size at seq {4 * seq}: {blocks}", flush=True)
    by_block = {"seq": 4 * seq, "dtype": "bfloat16", "seconds": blocks}
    return {"rows": rows, "blockwise_fwd_bwd_s_by_block": by_block}


SECTIONS = {f.__name__: f for f in (rates, attention, grouped_matmul, stage_actions, attention_agreement)}
BEGIN = "<!-- one-device tables (python -m benchmarks.one_device --render): edit the prose outside them -->"
END = "<!-- end of one-device tables -->"
#: Section -> "title|column|...": a column is `title=key:spec` (`title=` and `:spec`, a format or a
#: unit of `_UNITS`, optional), "-" where the row has no value.
TABLES = {
    "rates": "Rates|matmul bf16 TFLOP/s=matmul_bf16_tflops:.1f|matmul f32 TFLOP/s=matmul_f32_tflops:.1f"
    "|copy GB/s (read + write)=copy_gbytes_per_s:.0f|sum GB/s (read)=read_gbytes_per_s:.0f",
    "attention": "Attention (batch 1, 8 heads, head dim 64, causal)|dtype|seq|path|fwd ms=fwd_s:ms"
    "|fwd+bwd ms=fwd_bwd_s:ms|fwd+bwd TFLOP/s=fwd_bwd_tflops:.3g|temp MiB (fwd+bwd)=temp_bytes_fwd_bwd:MiB",
    "grouped_matmul": "Grouped expert matmul|size|path|fwd ms=fwd_s:ms|fwd+bwd ms=fwd_bwd_s:ms"
    "|useful fwd+bwd TFLOP/s=fwd_bwd_useful_tflops:.3g",
    "stage_actions": "One pipeline stage's actions (ms)|stage|" + "|".join(f"{a}:ms" for a in ACTIONS),
    "attention_agreement": "`nn.Attention` against its dense path (2-norm relative error)|dtype|seq"
    "|case|path|output rel err=out_rel_err:.1e|gradients rel err=grads_rel_err:.1e",
}
_UNITS = {"ms": (".3f", 1e3), "MiB": (",.0f", 1 / report.MiB)}


def _cell(r: dict, column: str) -> Any:
    key, _, spec = column.rpartition("=")[2].partition(":")
    if not spec or isinstance(r.get(key), str):  # a string in a formatted cell: a path's error
        return r[key]
    spec, scale = _UNITS.get(spec, (spec, 1.0))
    return "-" if r.get(key) is None else format(scale * r[key], spec)


def _rows(f: dict, section: str) -> list[dict]:
    """One file's rows of a table of `TABLES`, with the cells its JSON does not hold."""
    s = f.get(section, {})
    if section == "rates":
        return [s] if "matmul_n" in s else []
    if section == "stage_actions":
        return [{"stage": _stage(name, st), **st["seconds"]} for name, st in s.items() if "seconds" in st]
    if section != "grouped_matmul":
        return s.get("rows", [])
    # A path that did not run shows its error as its useful TFLOP/s.
    size, key = "{tokens} tokens x top-{top_k}, d {d} -> {hidden}, {experts} experts", "fwd_bwd_useful_tflops"
    error = lambda r: {key: r.get("error", "-")} if r.get(key) is None else {}  # noqa: E731
    return [{**r, "size": size.format(**s), **error(r)} for r in s.get("rows", [])]


def _stage(name: str, stage: dict) -> str:
    c = stage["config"]
    blocks = f"{c['layers']} block{'s' * (c['layers'] > 1)}{' unrolled' * stage.get('unrolled', False)}"
    return f"{name}: {blocks}, d {c['d_model']}, {stage['micro_batch']} x {c['seq_len']} tokens"


def render(files: list[dict]) -> str:
    """Markdown tables of one or more JSONs written by this module (one per device)."""
    tables = []
    for section, spec in TABLES.items():
        title, *columns = spec.split("|")
        heads = [c.rpartition("=")[0] or c.partition(":")[0] for c in columns]
        body = [[f["device_kind"], *(_cell(r, c) for c in columns)] for f in files for r in _rows(f, section)]
        tables.append(f"#### {title}\n\n" + report.markdown_table(["device", *heads], body, rule=" --- |"))
    return "\n\n".join(tables)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser("python -m benchmarks.one_device", description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    add("--only", help=f"comma-separated sections out of {','.join(SECTIONS)} (the file's others are kept)")
    add("--reps", type=int, default=10, help="timed calls per measurement (median)")
    add("--json", type=pathlib.Path, help="where to write the measurements")
    add("--render", type=pathlib.Path, nargs="+", help="JSONs to render (measures nothing)")
    add("--markdown", type=pathlib.Path, help="with --render: the page to write the tables into")
    args = parser.parse_args(argv)
    if args.render:
        tables = render([json.loads(path.read_text()) for path in args.render])
        report.splice(args.markdown, tables, begin=BEGIN, end=END) if args.markdown else print(tables)
        return {}
    if args.json is None:
        parser.error("--json is required to measure (or --render JSON... to render)")
    names = list(SECTIONS) if args.only is None else args.only.split(",")
    if unknown := set(names) - set(SECTIONS):
        parser.error(f"--only: unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    device = jax.devices()[0]
    # With --only, the other sections of an existing file are kept.
    data: dict[str, Any] = json.loads(args.json.read_text()) if args.only and args.json.exists() else {}
    command = " ".join(["python -m benchmarks.one_device", *(sys.argv[1:] if argv is None else argv)])
    data |= {"jax": jax.__version__, "platform": device.platform, "device_kind": device.device_kind}
    data |= {"command": command, "reps": args.reps, "statistic": "median"}
    print(f"{command}\njax {jax.__version__} on {device.device_kind}", flush=True)
    for name in names:
        print(name, flush=True)
        try:
            data[name] = SECTIONS[name](args.quick, args.reps)
        except Exception:  # noqa: BLE001 - the other sections still run and are written
            data[name] = {"error": traceback.format_exc(limit=3)}
            print(data[name]["error"], flush=True)
        _measure.write_json(args.json, data)
    return data


if __name__ == "__main__":
    main()
