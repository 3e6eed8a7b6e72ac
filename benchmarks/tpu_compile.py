"""Published models compiled for TPU slices from shapes, beside MaxText on the same
work and compiler (BENCHMARKS.md, "Compiled for TPU slices", says what each column holds).

    python -m benchmarks.tpu_compile [--only NAME,...] [--json benchmarks/results/quick.json] [--markdown BENCHMARKS.md]

`--predict-only` refreshes the advisor's predictions in the records (seconds, nothing compiled).

Each case compiles in a subprocess of its own (`--case NAME`), one at a time, so
that its peak RSS is its own: `eqxpar.aot.compile_train_step` on a mesh over the
topology's chips (libtpu describes the slice; nothing runs), 1 x 2048 tokens per
chip, full remat, bfloat16 compute over float32 weights and AdamW moments, as
MaxText's defaults. Beside each: MaxText's figures from
`benchmarks/results/maxtext_reference.json` (made by `benchmarks/maxtext_reference.py`
in a venv of its own) and the advisor's prediction for the same plan.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

RESULTS = pathlib.Path(__file__).parent / "results"
MAXTEXT = RESULTS / "maxtext_reference.json"
BEGIN = (
    "<!-- tpu compile tables (python -m benchmarks.tpu_compile --markdown): edit the prose outside them -->"
)
END = "<!-- end of tpu compile tables -->"
GIB = 2**30

#: name: (preset, topology, mesh axes, GPTConfig overrides). Names are MaxText's
#: reference records'.
CASES: dict[str, tuple[str, str, dict[str, int], dict[str, Any]]] = {
    # The head and its loss in tiles of the vocabulary (see LOSS_CHUNK).
    "llama3-8b_v5p-64_fsdp32": ("llama3-8b", "v5p-64", {"fsdp": 32}, {"loss_chunk": 512}),
    "llama3-8b_v5p-64_fsdp8_tensor4": ("llama3-8b", "v5p-64", {"fsdp": 8, "tensor": 4}, {}),
    "llama3-70b_v5p-256_fsdp32_tensor4": ("llama3-70b", "v5p-256", {"fsdp": 32, "tensor": 4}, {}),
    "llama3-70b_v5p-256_pipe4_fsdp32": ("llama3-70b", "v5p-256", {"pipe": 4, "fsdp": 32}, {}),
    "mixtral-8x7b_v5p-128_expert8_fsdp8": ("mixtral-8x7b", "v5p-128", {"expert": 8, "fsdp": 8}, {}),
    # HSDP over slices joined by the data-centre network: fsdp=32 inside each
    # v5p-64 slice, data across the slices (make_mesh(dcn={"data": n})).
    "llama3-8b_2xv5p-64_data2_fsdp32": ("llama3-8b", "2xv5p-64", {"data": 2, "fsdp": 32}, {}),
    "llama3-8b_4xv5p-64_data4_fsdp32": ("llama3-8b", "4xv5p-64", {"data": 4, "fsdp": 32}, {}),
}
#: The factor of each axis that spans slices, for the cases over several slices.
DCN = {
    "llama3-8b_2xv5p-64_data2_fsdp32": {"data": 2},
    "llama3-8b_4xv5p-64_data4_fsdp32": {"data": 4},
}
#: Plan options beyond the mesh (`eqxpar.aot.plan_of`'s keywords). The 70B
#: pipeline gathers its FSDP weights at their uses and keeps its gradient sums
#: split (`Plan(stage_gradients="sharded")`): whole, a stage's float32 sums are
#: 69 GB per chip and the TPU compiler refuses the step. It splits each weight
#: along its first divisible dimension (`rules.FSDP(dim="leading")`): split
#: along its last, the MLP input weight's gradient (d_model, 2, hidden) was
#: all-reduced per layer and micro-batch rather than reduce-scattered (146 GB).
PLAN_OPTIONS: dict[str, dict[str, Any]] = {
    "llama3-70b_v5p-256_pipe4_fsdp32": {"stage_gradients": "sharded", "fsdp_dim": "leading"},
}
#: Cases compiled with host offload (`Plan(offload=...)`, `python -m eqxpar.aot
#: --offload`): name -> (the case it offloads from, the parts offloaded). Their
#: device bytes fall, and host bytes rise, by what is offloaded.
OFFLOAD_CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama3-8b_v5p-64_fsdp32_offload-optimizer": ("llama3-8b_v5p-64_fsdp32", ("optimizer",)),
    "llama3-8b_v5p-64_fsdp32_offload-params": ("llama3-8b_v5p-64_fsdp32", ("params",)),
    "llama3-70b_v5p-256_fsdp32_tensor4_offload-optimizer": (
        "llama3-70b_v5p-256_fsdp32_tensor4",
        ("optimizer",),
    ),
    # MaxText's qkv_proj_offloaded: the query, key and value projections in host
    # memory, the rest recomputed (`aot.plan_of`'s default offloaded names),
    # measured against the same names kept on the device (its full-remat case is
    # the second figure).
    "llama3-8b_v5p-64_fsdp32_offload-activations": (
        "llama3-8b_v5p-64_fsdp32_save-activations",
        ("activations",),
    ),
}
#: Cases that keep named activations on the device for the backward pass
#: (`RematPolicy(saved=...)`, `python -m eqxpar.aot --saved-names`), the rest
#: recomputed: name -> (the case whose model and mesh they compile, the names).
#: MaxText's save_qkv_proj: the base the activations' offload is measured against.
SAVED_CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "llama3-8b_v5p-64_fsdp32_save-activations": (
        "llama3-8b_v5p-64_fsdp32",
        ("query_proj", "key_proj", "value_proj", "qkv_proj"),
    ),
}
#: Cases whose axes cut a side of the chip grid (v5p-128 is 4x4x4), as MaxText's
#: allow_split_physical_axes=true.
SPLIT_PHYSICAL_AXES = {"mixtral-8x7b_v5p-128_expert8_fsdp8"}
BATCH = (1, 2048)
#: Sequence positions per chunk of the output head and its loss (GPTConfig.loss_chunk)
#: where a case does not set it: None, as MaxText's default (num_vocab_tiling=1). Under
#: automatic FSDP a chunk runs the head in tiles of the vocabulary, never whole on a
#: chip: Llama-3-8B on FSDP 32 sets 512 (5.58 GiB of arguments + temporaries per chip
#: against 6.95 unchunked, JAX 0.12.1; BENCHMARKS.md). Under tensor x FSDP the head runs sequence
#: chunks per batch shard, its fsdp shards gathered once: not measured, left unchunked.
LOSS_CHUNK = None


def run_case(name: str) -> dict[str, Any]:
    """Compile case `name` in this process: the report's record and the advisor's prediction."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import jax

    from eqxpar import aot

    config, plan = case_config_and_plan(name)
    model, topology = CASES[plain_case(name)][:2]
    start = time.perf_counter()
    report = aot.compile_train_step(config, plan, batch=BATCH, name=model)
    record = {"name": name, "topology_name": topology, **report.as_dict()}
    record["total_seconds"] = round(time.perf_counter() - start, 1)
    record["versions"] = {"jax": jax.__version__, "libtpu": _libtpu_version()}
    record["predicted"] = predict_case(name)
    return record


def plain_case(name: str) -> str:
    """The case of `CASES` whose model, topology and mesh case `name` compiles
    (itself, or the plain case an offloaded or saved-activations case varies)."""
    while name not in CASES:
        name = {**OFFLOAD_CASES, **SAVED_CASES}[name][0]
    return name


def case_config_and_plan(name: str) -> tuple[Any, Any]:
    """The `GPTConfig` and `Plan` case `name` compiles (a mesh over its topology's chips)."""
    import eqxpar
    from eqxpar import aot

    base = plain_case(name)
    offload = OFFLOAD_CASES.get(name, (name, ()))[1]
    saved = SAVED_CASES.get(name, (name, ()))[1]
    model, topology, axes, overrides = CASES[base]
    config = eqxpar.models.preset(model, **{"loss_chunk": LOSS_CHUNK, **overrides})
    options = dict(PLAN_OPTIONS.get(base, {}), **({"offload": offload} if offload else {}))
    if saved:
        options["saved_names"] = saved
    plan = aot.plan_of(
        axes,
        topology=topology,
        rows_per_chip=BATCH[0],
        split_physical_axes=base in SPLIT_PHYSICAL_AXES,
        dcn=DCN.get(base),
        **options,
    )
    return config, plan


def predict_case(name: str) -> dict[str, int]:
    """The advisor's prediction for case `name`'s plan, from shapes (nothing compiled):
    per-device argument and temporary bytes, and wire bytes, on the `tpu_v5p` profile."""
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import eqxpar
    from eqxpar._advise._analysis import analyse
    from eqxpar._advise._predict import predict

    config, plan = case_config_and_plan(name)
    optimizer = optax.adamw(1e-4)
    outline = eqx.filter_eval_shape(eqxpar.models.GPT, config, key=jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((BATCH[0] * plan.mesh.size, BATCH[1] + 1), jnp.int32)
    loss = eqxpar.models.lm_loss
    if plan.schedule is not None:
        loss = eqxpar.pipeline.PipelineLoss(
            eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last
        )
    state = eqxpar.train.init(outline, optimizer, plan, key=jax.random.key(0), abstract=True)
    # Traced under the plan, so that the stack's remat policy decides what the
    # backward keeps (the advisor's own enumeration runs no remat).
    with plan:
        analysis = analyse(outline, eqxpar.models.lm_loss, tokens)
    profile = eqxpar.DEVICE_PROFILES["tpu_v5p"]
    p = predict(plan, state.model, state.opt_state, tokens, loss, analysis, profile)
    return {
        "argument_bytes": p.argument_bytes,
        "temp_bytes": p.temp_bytes,
        "wire_bytes": p.total_wire_bytes,
        "host_bytes": p.host_bytes,
    }


def _libtpu_version() -> str:
    from importlib.metadata import version

    return version("libtpu")


def _maxtext() -> dict[str, dict[str, Any]]:
    if not MAXTEXT.exists():
        return {}
    return {r["name"]: r for r in json.loads(MAXTEXT.read_text())["records"]}


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GIB:.2f}"


def _share(x: float | None) -> str:
    return "—" if x is None else f"{x:.0%}"


def markdown(records: dict[str, dict[str, Any]]) -> str:
    """The BENCHMARKS.md tables: eqxpar beside MaxText, then the advisor's errors."""
    maxtext = _maxtext()
    lines = [
        "| case | argument + temp, GiB: eqxpar / MaxText | compiler's peak, GiB: eqxpar / MaxText "
        "| wire GB: eqxpar / MaxText | eqxpar wire / minimum "
        "| async share: eqxpar / MaxText | compile s: eqxpar / MaxText | peak RSS GiB: eqxpar / MaxText |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in records.items():
        if name in OFFLOAD_CASES or name in SAVED_CASES:
            continue  # no MaxText record; the offload table shows them
        m = maxtext.get(name, {})
        memory = m.get("memory_bytes", {})
        theirs = memory.get("argument_size", 0) + memory.get("temp_size", 0) if memory else None
        mine = _gib(r["argument_bytes"] + r["temp_bytes"])
        if r.get("refused"):
            mine = f"{mine} (refused: over HBM)"
        collectives = m.get("collectives", {})
        their_wire = collectives.get("total_wire_bytes")
        ratio = None if r.get("refused") else r.get("wire_ratio_to_minimum")
        wire = "—" if r.get("refused") else f"{r['total_wire_bytes'] / 1e9:.1f}"
        share = None if r.get("refused") else r["async_share"]
        # memory_analysis()'s peak_memory_in_bytes, both sides (AotReport.compiler_peak_bytes).
        peaks = f"{_gib(r.get('compiler_peak_bytes'))} / {_gib(memory.get('peak_memory'))}"
        lines.append(
            f"| {name} | {mine} / {_gib(theirs)} | {peaks} "
            f"| {wire} / {'—' if their_wire is None else f'{their_wire / 1e9:.1f}'} "
            f"| {'—' if ratio is None else f'{ratio:.2f}x'} "
            f"| {_share(share)} / {_share(collectives.get('async_share'))} "
            f"| {r['compile_seconds']:.0f} / {'—' if m.get('compile_s') is None else format(m['compile_s'], '.0f')} "
            f"| {_gib(r['peak_rss_bytes'])} / {_gib(m.get('peak_rss_bytes'))} |"
        )
    lines += [
        "",
        "| case | argument GiB: predicted / compiled (error) | temp GiB: predicted / compiled (error) "
        "| argument + temp GiB: predicted / compiled (error) | against the compiler's peak "
        "| wire GB: predicted / compiled (error) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in records.items():
        if r.get("refused") or name in OFFLOAD_CASES:
            continue
        p = r["predicted"]
        cells = []
        for predicted, measured, unit in (
            (p["argument_bytes"], r["argument_bytes"], GIB),
            (p["temp_bytes"], r["temp_bytes"], GIB),
            (p["argument_bytes"] + p["temp_bytes"], r["argument_bytes"] + r["temp_bytes"], GIB),
            (p["wire_bytes"], r["total_wire_bytes"], 1e9),
        ):
            error = predicted / measured - 1 if measured else 0.0
            cells.append(f"{predicted / unit:.2f} / {measured / unit:.2f} ({error:+.1%})")
        compiler_peak = r.get("compiler_peak_bytes")
        total = p["argument_bytes"] + p["temp_bytes"]
        cells.insert(
            3,
            "—"
            if compiler_peak is None
            else f"{total / GIB:.2f} / {compiler_peak / GIB:.2f} ({total / compiler_peak - 1:+.1%})",
        )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    sliced = {name: r for name, r in records.items() if r.get("slices", 1) > 1 and not r.get("refused")}
    if sliced:
        lines += [
            "",
            "| case | slices | across slices (DCN) MB per chip | its floor (gradient reduction over data) MB "
            "| DCN / floor | mesh axes of the DCN traffic | ICI replica groups |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, r in sliced.items():
            axes = sorted({a for kind in r["dcn_wire_bytes_by_axes"].values() for a in kind})
            lines.append(
                f"| {name} | {r['slices']} | {r['total_dcn_wire_bytes'] / 1e6:.1f} "
                f"| {r['dcn_minimum_wire_bytes'] / 1e6:.1f} | {r['dcn_ratio_to_minimum']:.3f}x "
                f"| {', '.join(axes)} | {', '.join(r['ici_replica_groups'])} |"
            )
    return "\n".join(lines + offload_table(records))


def offload_table(records: dict[str, dict[str, Any]]) -> list[str]:
    """The host-offload rows: each offloaded case beside the case it offloads from
    (device bytes: arguments + outputs not aliased + temporaries, `peak_bytes`;
    host bytes: the offloaded state, the host's arguments, and the host
    temporaries the compiler adds), and the advisor's errors on both: on what
    the offload changes on the device against that case, as a share of what it
    offloads, and on the host bytes. Activations are offloaded from the same
    names saved on the device (`SAVED_CASES`); their fall against the plain
    full-remat case is the second figure."""
    rows = [
        "",
        "| case | device GiB: base / offloaded (fall) | host GiB: arguments + temporaries "
        "| fall / offloaded | device change GiB: predicted / compiled / compiled heap "
        "| miss / offloaded: compiled, heap | host GiB: predicted / compiled (error) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in records.items():
        base = records.get(OFFLOAD_CASES.get(name, ("",))[0])
        if name not in OFFLOAD_CASES or base is None or r.get("refused"):
            continue
        fall = base["peak_bytes"] - r["peak_bytes"]
        host_args, host = r["host_argument_bytes"], r["host_bytes"]
        # Offloaded activations are host temporaries, not arguments.
        offloaded = host_args or host
        p, q = r["predicted"], base["predicted"]
        compiled = r["argument_bytes"] + r["temp_bytes"] - base["argument_bytes"] - base["temp_bytes"]
        predicted = p["argument_bytes"] + p["temp_bytes"] - q["argument_bytes"] - q["temp_bytes"]
        host_error = p["host_bytes"] / host - 1 if host else 0.0
        # The buffer assignment's own temporaries, where the records have them
        # (`AotReport.heap_temp_bytes`): libtpu 0.0.50.1's `temp_bytes` adds an
        # excess over them that the offload changes too.
        heap = None
        if r.get("heap_temp_bytes") is not None and base.get("heap_temp_bytes") is not None:
            heap = (
                r["argument_bytes"] + r["heap_temp_bytes"] - base["argument_bytes"] - base["heap_temp_bytes"]
            )
        misses = f"{(predicted - compiled) / offloaded if offloaded else 0:+.0%}"
        if heap is not None:
            misses += f", {(predicted - heap) / offloaded if offloaded else 0:+.0%}"
        device = f"{_gib(base['peak_bytes'])} / {_gib(r['peak_bytes'])} ({_gib(fall)})"
        share = f"{fall / offloaded if offloaded else 0:.0%}"
        plain = records.get(plain_case(name))
        if plain is not None and plain is not base:
            second = plain["peak_bytes"] - r["peak_bytes"]
            device += f"; full remat {_gib(plain['peak_bytes'])} ({_gib(second)})"
            share += f"; {second / offloaded if offloaded else 0:.0%} against full remat"
        rows.append(
            f"| {name} | {device} | {_gib(host_args)} + {_gib(host - host_args)} | {share} "
            f"| {predicted / GIB:+.2f} / {compiled / GIB:+.2f} / "
            f"{'—' if heap is None else f'{heap / GIB:+.2f}'} | {misses} "
            f"| {_gib(p['host_bytes'])} / {_gib(host)} ({host_error:+.0%}) |"
        )
    return rows if len(rows) > 3 else []


def _write_markdown(path: pathlib.Path, tables: str) -> None:
    text = path.read_text()
    if BEGIN not in text:
        raise SystemExit(f"{path} has no '{BEGIN}' marker: add the section first")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{BEGIN}\n{tables}\n{END}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="compile one case in this process and print its record (JSON)")
    parser.add_argument("--only", help="comma-separated case names (default all)")
    parser.add_argument("--json", type=pathlib.Path, help="merge the records into this results file")
    parser.add_argument("--markdown", type=pathlib.Path, help="rewrite the tables in this file")
    parser.add_argument(
        "--tables-only", action="store_true", help="rewrite the tables from --json's records; compile nothing"
    )
    parser.add_argument(
        "--predict-only",
        action="store_true",
        help="refresh the advisor's predictions in --json's records (--only's, default all), then the tables; "
        "compile nothing",
    )
    args = parser.parse_args(argv)
    if args.case:
        print("RECORD " + json.dumps(run_case(args.case)))
        return
    if args.predict_only:
        if args.json is None:
            raise SystemExit("--predict-only rewrites --json's records: pass it")
        data = json.loads(args.json.read_text())
        records = data["tpu_compile"]
        for name in args.only.split(",") if args.only else list(records):
            if name in records and not records[name].get("refused"):
                records[name]["predicted"] = predict_case(name)
        args.json.write_text(json.dumps(data, indent=1) + "\n")
        if args.markdown is None:
            return  # nothing compiled: the records keep their compiled figures
        args.tables_only = True
    if args.tables_only:
        if args.json is None or args.markdown is None:
            raise SystemExit("--tables-only reads --json and rewrites --markdown: pass both")
        _write_markdown(args.markdown, markdown(json.loads(args.json.read_text())["tpu_compile"]))
        return
    names = args.only.split(",") if args.only else [*CASES, *SAVED_CASES, *OFFLOAD_CASES]
    records = {}
    for name in names:
        result = subprocess.run(
            [sys.executable, "-m", "benchmarks.tpu_compile", "--case", name], capture_output=True, text=True
        )
        lines = [line for line in result.stdout.splitlines() if line.startswith("RECORD ")]
        if result.returncode or not lines:
            raise SystemExit(f"{name} failed ({result.returncode}):\n{result.stderr[-4000:]}")
        records[name] = json.loads(lines[-1].removeprefix("RECORD "))
        print(
            f"{name}: {records[name]['argument_bytes'] / GIB:.2f} + {records[name]['temp_bytes'] / GIB:.2f} GiB, "
            f"compile {records[name]['compile_seconds']:.0f} s",
            flush=True,
        )
    if args.json is not None:
        data = json.loads(args.json.read_text())
        data.setdefault("tpu_compile", {}).update(records)
        data["tpu_compile_command"] = (
            "python -m benchmarks.tpu_compile --json benchmarks/results/quick.json --markdown BENCHMARKS.md"
        )
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    tables = markdown(records)
    print(tables)
    if args.markdown is not None:
        _write_markdown(args.markdown, tables)


if __name__ == "__main__":
    main()
