"""Measurements on one device, the inputs of the predictions the distributed records
cannot make on simulated CPU devices (benchmarks/README.md):

`SECTIONS`, each function's docstring says what it measures (BENCHMARKS.md, "One
device", reads the results).

    python -m benchmarks.one_device [--quick] [--only rates,attention] --json PATH
    python -m benchmarks.one_device --render JSON [JSON ...] --markdown BENCHMARKS.md

Runs on whatever `jax.devices()[0]` is; a GPU run is how BENCHMARKS.md's GPU figures
were made (`--json benchmarks/results/one_device_gpu.json`).
"""

import argparse
import dataclasses
import functools
import json
import math
import pathlib
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from eqxpar import nn

from . import _action_flops, _workload, report

MiB = 2**20


def timed(fn: Callable, *args: Any, reps: int) -> float:
    """Median seconds of `fn(*args)` over `reps` calls after a compile and two warm-ups."""
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def temp_bytes(fn: Callable, *args: Any) -> int:
    return int(jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes)


def weighted_sum(fn: Callable, ct: Any) -> Callable:
    """`(*args, **kw) -> sum(fn(*args, **kw) * ct)` in float32: a scalar whose
    gradient pulls the cotangent `ct` back through `fn`."""

    def loss(*args: Any, **kw: Any) -> jax.Array:
        return jnp.sum(fn(*args, **kw).astype(jnp.float32) * jnp.asarray(ct, jnp.float32))

    return loss


def _error(error: Exception) -> str:
    """A path that does not run here is recorded, not fatal."""
    return f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"


def rates(quick: bool, reps: int) -> dict:
    """Dense matmul FLOP/s in bf16 and float32 (XLA's default precision) and the copy
    bandwidth (bytes read + written per second) of `2 * x` on a large array."""
    n = 2048 if quick else 8192
    out: dict[str, Any] = {"matmul_n": n}
    for name, dtype in (("bf16", jnp.bfloat16), ("f32", jnp.float32)):
        a, b = (jax.random.normal(jax.random.key(i), (n, n), dtype) for i in range(2))
        seconds = timed(jax.jit(jnp.matmul), a, b, reps=reps)
        out[f"matmul_{name}_tflops"] = 2 * n**3 / seconds / 1e12
    # 2 GiB on a GPU: a call's fixed cost (tens of microseconds) is noise beside it.
    on_gpu = jax.default_backend() == "gpu"
    size = (16 if quick else 2048 if on_gpu else 512) * MiB
    x = jnp.ones((size // 4,), jnp.float32)
    seconds = timed(jax.jit(lambda x: 2 * x), x, reps=reps)
    out |= {"copy_bytes": 2 * size, "copy_gbytes_per_s": 2 * size / seconds / 1e9}
    seconds = timed(jax.jit(jnp.sum), x, reps=reps)
    out |= {"read_bytes": size, "read_gbytes_per_s": size / seconds / 1e9}
    print(f"  rates {out}", flush=True)
    return out


def _attention_paths(on_gpu: bool) -> dict[str, Callable]:
    dot_product = functools.partial(jax.nn.dot_product_attention, is_causal=True)
    paths = {"blockwise": functools.partial(nn.blockwise_attention, causal=True, block_size=512)}
    if on_gpu:
        paths["cudnn"] = functools.partial(dot_product, implementation="cudnn")
    return {**paths, "xla_dense": functools.partial(dot_product, implementation="xla")}


def attention(quick: bool, reps: int) -> dict:
    """Causal attention, batch 1, 8 heads, head dim 64: for each path and sequence,
    forward and forward + backward time, temp bytes of forward + backward, and
    the largest difference of the output from the blockwise path's."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    seqs = [1024, 4096] if quick else ([4096, 8192, 16384, 32768] if on_gpu else [1024, 4096, 16384])
    # XLA's dense path holds (heads x seq x seq) scores: run up to 16k on GPU (at 32k
    # its backward needs 96 GiB); on CPU every path runs up to 4k, longer sequences
    # are compiled for their memory only (seconds per call).
    dense_max, any_max = (16384, 32768) if on_gpu else (4096, 4096)
    rows = []
    for seq in seqs:
        shape = (1, seq, 8, 64)
        q, k, v, ct = (jax.random.normal(jax.random.key(i), shape, dtype) for i in range(4))
        reference = None
        for name, fn in _attention_paths(on_gpu).items():
            row: dict[str, Any] = {"path": name, "seq": seq, "dtype": jnp.dtype(dtype).name}
            fwd_bwd = jax.grad(weighted_sum(fn, ct), argnums=(0, 1, 2))
            try:
                row["temp_bytes_fwd_bwd"] = temp_bytes(fwd_bwd, q, k, v)
                if seq <= (dense_max if name == "xla_dense" else any_max):
                    out = jax.jit(fn)(q, k, v)
                    reference = out if reference is None else reference
                    diff = jnp.max(jnp.abs(out.astype(jnp.float32) - reference))
                    row["max_abs_diff_vs_blockwise"] = float(diff)
                    row["fwd_s"] = timed(jax.jit(fn), q, k, v, reps=reps)
                    row["fwd_bwd_s"] = timed(jax.jit(fwd_bwd), q, k, v, reps=reps)
                    # Causal: half the (seq x seq) scores; forward 2 matmuls, backward 5.
                    flops = 4 * 8 * seq * seq * 64 / 2
                    row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                    row["fwd_bwd_tflops"] = 3.5 * flops / row["fwd_bwd_s"] / 1e12
            except Exception as error:  # noqa: BLE001
                row["error"] = _error(error)
            rows.append(row)
            print(f"  attention {row}", flush=True)
    return {"batch": 1, "heads": 8, "head_dim": 64, "causal": True, "rows": rows}


def grouped_matmul(quick: bool, reps: int) -> dict:
    """Routed tokens (tokens x top-k rows, sorted by expert) times per-expert weights
    `(experts, d, hidden)`: `lax.ragged_dot` on the exact groups (dropless), every
    expert on every row with a mask (the dense loop), and capacity-padded batches of
    1.25 x the mean group (what capacity dispatch computes); balanced routing, and
    for ragged_dot also every row on one expert."""
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    # XLA:CPU runs ragged_dot as a loop (tens of seconds at the GPU's size): CPU sizes are small.
    small = quick or not on_gpu
    tokens, d, hidden, experts, top_k = (1024, 256, 512, 8, 2) if small else (16384, 1024, 4096, 8, 2)
    rows_n = tokens * top_k
    capacity = math.ceil(1.25 * rows_n / experts)
    x = jax.random.normal(jax.random.key(0), (rows_n, d), dtype)
    w = jax.random.normal(jax.random.key(1), (experts, d, hidden), dtype) / math.sqrt(d)
    assign = jnp.sort(jax.random.randint(jax.random.key(2), (rows_n,), 0, experts))
    balanced = jnp.bincount(assign, length=experts).astype(jnp.int32)
    skewed = jnp.zeros((experts,), jnp.int32).at[0].set(rows_n)

    def dense(x, w, group_sizes):
        del group_sizes
        out = jnp.zeros((rows_n, hidden), dtype)
        for e in range(experts):
            out = out + jnp.where((assign == e)[:, None], x @ w[e], 0).astype(dtype)
        return out

    def padded(x, w, group_sizes):
        del group_sizes
        # The rows laid out as `experts` buffers of `capacity` (the layout, not the
        # dispatch, is what is timed: the compute of capacity-based routing).
        xp = jnp.pad(x, ((0, experts * capacity - rows_n), (0, 0)))
        return jnp.einsum("ecd,edh->ech", xp.reshape(experts, capacity, d), w)

    flops = 2 * rows_n * d * hidden
    rows = []
    for name, fn, sizes in (
        ("ragged_dot", jax.lax.ragged_dot, balanced),
        ("ragged_dot_one_expert", jax.lax.ragged_dot, skewed),
        ("dense_every_expert", dense, balanced),
        ("capacity_padded_1.25", padded, balanced),
    ):
        row: dict[str, Any] = {"path": name, "dtype": jnp.dtype(dtype).name}
        loss = weighted_sum(functools.partial(fn, group_sizes=sizes), 1.0)
        try:
            row["fwd_s"] = timed(jax.jit(fn), x, w, sizes, reps=reps)
            row["fwd_bwd_s"] = timed(jax.jit(jax.grad(loss, argnums=(0, 1))), x, w, reps=reps)
            row["fwd_useful_tflops"] = flops / row["fwd_s"] / 1e12
            row["fwd_bwd_useful_tflops"] = 3 * flops / row["fwd_bwd_s"] / 1e12
        except Exception as error:  # noqa: BLE001
            row["error"] = _error(error)
        rows.append(row)
        print(f"  grouped_matmul {row}", flush=True)
    sizes = dict(tokens=tokens, top_k=top_k, d=d, hidden=hidden, experts=experts, capacity=capacity)
    return {**sizes, "rows": rows}


_WIDE = dataclasses.replace(_workload.CONFIG, d_model=1024, heads=16, mlp=4096, seq_len=1024)
#: The stages timed, `(config, micro-batch, unrolled)`: the benchmark workload's
#: pipeline stage (pipe 4 of the 8-layer variant: 2 blocks, one 128-token sequence
#: per micro-batch), and a wider one; each also with its blocks unrolled
#: (`NAME_unrolled`: `nn.Stacked(unroll=True)`, no loop) and as a chunk of two
#: (`NAME_chunk`: 1 block), what an interleaved, ZB-V or DualPipeV device runs per
#: action (a launch-bound device does not halve its time).
STAGES = {
    "workload": (dataclasses.replace(_workload.CONFIG, layers=2), 1, False),
    "workload_unrolled": (dataclasses.replace(_workload.CONFIG, layers=2), 1, True),
    "workload_chunk": (dataclasses.replace(_workload.CONFIG, layers=1), 1, False),
    "wide": (dataclasses.replace(_WIDE, layers=2), 4, False),
    "wide_unrolled": (dataclasses.replace(_WIDE, layers=2), 4, True),
    "wide_chunk": (dataclasses.replace(_WIDE, layers=1), 4, False),
}
#: A stage's actions: F forward, F_keep forward keeping its residuals, B backward from
#: them, I and W the input and weight gradients alone (two pull-backs: W re-runs the
#: chain of activation cotangents), I_split and W_split the engine's zero-bubble halves
#: (one backward split in two, `eqxpar/pipeline/_split_backward.py`), B_recompute
#: forward again, then backward.
ACTIONS = ("F", "F_keep", "B", "I", "W", "I_split", "W_split", "B_recompute")


def stage_actions(quick: bool, reps: int) -> dict:
    """Per-action seconds (`ACTIONS`) of each of `STAGES` on one micro-batch."""
    out = {}
    for name, (cfg, micro, unrolled) in STAGES.items():
        if quick and not name.startswith("workload"):
            continue
        out[name] = _stage_actions(cfg, micro, reps, unrolled=unrolled)
        print(f"  stage_actions {name} {out[name]['seconds']}", flush=True)
    return out


def _run_stage(static: Any, params: Any, x: jax.Array) -> jax.Array:
    return eqx.combine(params, static)(x)


def _stage_actions(cfg: _workload.Config, micro: int, reps: int, *, unrolled: bool) -> dict:
    blocks = _workload.make_model(cfg).blocks
    if unrolled:
        blocks = nn.Stacked.from_blocks([blocks[i] for i in range(blocks.depth)], unroll=True)
    params, static = eqx.partition(blocks, eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(0), (micro, cfg.seq_len, cfg.d_model), jnp.float32)
    ct = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
    stage = functools.partial(_run_stage, static)
    # The engine's actions: F keeping residuals, B from them, and zero-bubble's
    # halves (one pull-back split, `_split_backward`).
    engine = {
        k: (jax.jit(fn), args) for k, (fn, args) in _action_flops.engine_actions(stage, params, x, ct).items()
    }
    pullback, both = engine["B"][0], engine["B"][1][0]
    _, input_only = jax.jit(lambda p, x: jax.vjp(lambda x: stage(p, x), x))(params, x)
    _, weight_only = jax.jit(lambda p, x: jax.vjp(lambda p: stage(p, x), p))(params, x)
    recompute = jax.jit(lambda p, x, ct: jax.vjp(stage, p, x)[1](ct))
    calls = {
        "F": (jax.jit(stage), params, x),
        "F_keep": (engine["F"][0], *engine["F"][1]),
        "B": (pullback, both, ct),
        "I": (pullback, input_only, ct),
        "W": (pullback, weight_only, ct),
        "B_recompute": (recompute, params, x, ct),
        "I_split": (engine["I"][0], *engine["I"][1]),
        "W_split": (engine["W"][0], *engine["W"][1]),
    }
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))  # noqa: E731
    return {
        "config": dataclasses.asdict(cfg),
        "micro_batch": micro,
        "unrolled": unrolled,
        "seconds": {k: timed(*call, reps=reps) for k, call in calls.items()},
        "residual_bytes_beyond_params": int(nbytes(both) - nbytes(params)),
    }


def _rel(got: Any, want: Any) -> float:
    """||got - want|| / ||want|| over the whole tree as one vector (a leaf whose exact
    gradient is zero, the key bias's, holds only rounding: judged leafwise, it says nothing).
    As `_measure.norm_rel_err`, but the recorded figures divide before the square root."""
    pairs = [
        (np.asarray(a, np.float64), np.asarray(b, np.float64))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    ]
    return math.sqrt(sum(np.sum((a - b) ** 2) for a, b in pairs) / sum(np.sum(b**2) for _, b in pairs))


def _attention_grads_and_output(
    path: str, dtype: Any, dropout: float, x: jax.Array, ct: jax.Array, kwargs: dict
):
    """The gradients (pulled back from `ct`) and output of `nn.Attention` by `path` in `dtype`."""
    layer = nn.Attention(512, 8, attention=path, dropout=dropout, key=jax.random.key(0))
    layer = jax.tree.map(lambda w: w.astype(dtype), layer)
    call = lambda layer, x, kwargs: layer(x, **kwargs)  # noqa: E731
    _, grads = eqx.filter_jit(eqx.filter_value_and_grad(weighted_sum(call, ct)))(layer, x, kwargs)
    return grads, eqx.filter_jit(call)(layer, x, kwargs)


def attention_agreement(quick: bool, reps: int) -> dict:
    """`nn.Attention`'s paths on this device against its dense path, output and
    gradients (inputs and weights; 2-norm of the difference over the reference's, the
    tree as one vector): `auto` (cuDNN on GPU in bf16), `blockwise`, and blockwise with segment
    ids (two packed sequences) and attention dropout (the same key) against dense with
    the same. Also the blockwise path's fwd+bwd time against its key block size."""
    seq = 512 if quick else 2048
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x, ct = (jax.random.normal(jax.random.key(i), (2, seq, 512), dtype) for i in (1, 2))
        segments = (jnp.arange(seq)[None, :] >= jnp.array([[seq // 3], [seq // 2]])).astype(jnp.int32)
        for case, kwargs, rate in (
            ("plain", {}, 0.0),
            ("segment_ids", {"segment_ids": segments}, 0.0),
            ("dropout", {"key": jax.random.key(3)}, 0.1),
        ):
            want_grads, want_out = _attention_grads_and_output("dense", dtype, rate, x, ct, kwargs)
            for path in ("blockwise", "auto"):
                grads, out = _attention_grads_and_output(path, dtype, rate, x, ct, kwargs)
                row = {"dtype": jnp.dtype(dtype).name, "case": case, "path": path, "seq": seq}
                row |= {
                    "out_rel_err": _rel(out, want_out),
                    "grads_rel_err": _rel(grads, want_grads),
                }
                rows.append(row)
                print(f"  attention_agreement {row}", flush=True)
    shape = (1, 4 * seq, 8, 64)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(3))
    blocks = {}
    for block in (256, 512, 1024, 2048):
        loss = weighted_sum(functools.partial(nn.blockwise_attention, causal=True, block_size=block), 1.0)
        blocks[block] = timed(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), q, k, v, reps=reps)
    print(f"  blockwise fwd+bwd seconds by block size at seq {4 * seq}: {blocks}", flush=True)
    return {
        "rows": rows,
        "blockwise_fwd_bwd_s_by_block": {"seq": 4 * seq, "dtype": "bfloat16", "seconds": blocks},
    }


SECTIONS = {
    "rates": rates,
    "attention": attention,
    "grouped_matmul": grouped_matmul,
    "stage_actions": stage_actions,
    "attention_agreement": attention_agreement,
}

BEGIN = "<!-- one-device tables (python -m benchmarks.one_device --render): edit the prose outside them -->"
END = "<!-- end of one-device tables -->"


def _cell(r: dict, key: str, spec: str, scale: float = 1.0, missing: str = "-") -> str:
    return format(scale * r[key], spec) if r.get(key) is not None else missing


def _ms(r: dict, key: str) -> str:
    return _cell(r, key, ".3f", 1e3)


def _stage(name: str, stage: dict) -> str:
    c = stage["config"]
    blocks = f"{c['layers']} block{'s' * (c['layers'] > 1)}{' unrolled' * stage.get('unrolled', False)}"
    return f"{name}: {blocks}, d {c['d_model']}, {stage['micro_batch']} x {c['seq_len']} tokens"


def render(files: list[dict]) -> str:
    """Markdown tables of one or more JSONs written by this module (one per device)."""

    def rows(section: str, cells: Callable) -> list[list]:
        return [
            [f["device_kind"], *cells(f[section], r)]
            for f in files
            for r in f.get(section, {}).get("rows", [])
        ]

    rates = [
        [f["device_kind"], *(_cell(r, k, ".1f") for k in ("matmul_bf16_tflops", "matmul_f32_tflops"))]
        + [_cell(r, k, ".0f") for k in ("copy_gbytes_per_s", "read_gbytes_per_s")]
        for f in files
        if "matmul_n" in (r := f.get("rates", {}))
    ]
    stages = [
        [f["device_kind"], _stage(name, stage), *(_ms(stage["seconds"], k) for k in ACTIONS)]
        for f in files
        for name, stage in f.get("stage_actions", {}).items()
        if "seconds" in stage
    ]
    grouped = "{tokens} tokens x top-{top_k}, d {d} -> {hidden}, {experts} experts"
    tables = {
        "Rates": (
            ["matmul bf16 TFLOP/s", "matmul f32 TFLOP/s", "copy GB/s (read + write)", "sum GB/s (read)"],
            rates,
        ),
        "Attention (batch 1, 8 heads, head dim 64, causal)": (
            ["dtype", "seq", "path", "fwd ms", "fwd+bwd ms", "fwd+bwd TFLOP/s", "temp MiB (fwd+bwd)"],
            rows(
                "attention",
                lambda _, r: [
                    *(r["dtype"], r["seq"], r["path"], _ms(r, "fwd_s"), _ms(r, "fwd_bwd_s")),
                    *(_cell(r, "fwd_bwd_tflops", ".3g"), _cell(r, "temp_bytes_fwd_bwd", ",.0f", 1 / MiB)),
                ],
            ),
        ),
        "Grouped expert matmul": (
            ["size", "path", "fwd ms", "fwd+bwd ms", "useful fwd+bwd TFLOP/s"],
            rows(
                "grouped_matmul",
                lambda g, r: [
                    *(grouped.format(**g), r["path"], _ms(r, "fwd_s"), _ms(r, "fwd_bwd_s")),
                    _cell(r, "fwd_bwd_useful_tflops", ".3g", missing=r.get("error", "-")),
                ],
            ),
        ),
        "One pipeline stage's actions (ms)": (["stage", *ACTIONS], stages),
        "`nn.Attention` against its dense path (2-norm relative error)": (
            ["dtype", "seq", "case", "path", "output rel err", "gradients rel err"],
            rows(
                "attention_agreement",
                lambda _, r: [
                    *(r[k] for k in ("dtype", "seq", "case", "path")),
                    *(f"{r[k]:.1e}" for k in ("out_rel_err", "grads_rel_err")),
                ],
            ),
        ),
    }
    return "\n\n".join(
        f"#### {title}\n\n{report.markdown_table(['device', *head], body, rule=' --- |')}"
        for title, (head, body) in tables.items()
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.one_device", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU smoke run)")
    parser.add_argument(
        "--only", help=f"comma-separated sections out of {','.join(SECTIONS)} (the file's others are kept)"
    )
    parser.add_argument("--reps", type=int, default=10, help="timed calls per measurement (median)")
    parser.add_argument("--json", type=pathlib.Path, help="where to write the measurements")
    parser.add_argument("--render", type=pathlib.Path, nargs="+", help="JSONs to render (measures nothing)")
    parser.add_argument(
        "--markdown", type=pathlib.Path, help="with --render: the page to write the tables into"
    )
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
    data |= {
        "jax": jax.__version__,
        "platform": device.platform,
        "device_kind": device.device_kind,
        "command": " ".join(["python -m benchmarks.one_device", *(sys.argv[1:] if argv is None else argv)]),
        "reps": args.reps,
        "statistic": "median",
    }
    print(f"{data['command']}\njax {jax.__version__} on {device.device_kind}", flush=True)
    for name in names:
        print(name, flush=True)
        try:
            data[name] = SECTIONS[name](args.quick, args.reps)
        except Exception:  # noqa: BLE001 - the other sections still run and are written
            data[name] = {"error": traceback.format_exc(limit=3)}
            print(data[name]["error"], flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(data, indent=2, default=_plain) + "\n")
    print(f"wrote {args.json}")
    return data


def _plain(x: Any) -> Any:
    return x.item() if isinstance(x, np.generic) else str(x)


if __name__ == "__main__":
    main()
