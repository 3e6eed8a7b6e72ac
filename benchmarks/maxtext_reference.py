"""MaxText's compiled train step for TPU topologies, as reference figures beside eqxpar's.

Two steps, each run with its own Python:

    # 1. compile (MaxText's virtual environment, not the project's):
    /path/to/maxtextvenv/bin/python benchmarks/maxtext_reference.py compile [--only NAME,...]
    # 2. read the collectives of the saved HLO (the project's environment):
    python benchmarks/maxtext_reference.py summarize

`compile` builds each case's train step ahead of time for a TPU topology on a
machine without TPUs (libtpu compiles for a topology description), one case per
subprocess and one at a time, the way MaxText's own
`maxtext.trainers.pre_train.train_compile` does: the same config parsing, abstract
state, shardings and `jit(...).lower(...).compile(...)`, called from here so that
the `Compiled` object is at hand. It records per case the per-device
`memory_analysis()` fields, the seconds of `lower` + `compile` (timed around
MaxText's `jit_and_compile`, tracing included; not config parsing or the
abstract state), the whole subprocess's seconds, its peak resident memory
(`ru_maxrss` of that child, from `os.wait4`), the settings, and the versions. The
compiled (scheduled) HLO text is written gzipped to `--hlo-dir` (default: a
`maxtext_hlo` folder in the system's temporary directory; about 2 MB of text a
case, kept out of the repository). A case that fails records its error instead.
Compile seconds depend on the host: the committed ones come from a 2-core machine
that other jobs shared, and are slower than on a workstation.

`summarize` reads those HLO files and adds to each record the collective wire
bytes per kind (`eqxpar.inspect.collective_stats`) and the share of them that
the schedule overlaps with compute (`eqxpar.inspect.overlap_stats`). A ragged
all-to-all (MaxText's expert dispatch) has no kind there: what it moves depends
on the routing, not on its buffers' shapes. Such instructions are listed by
opcode under `uncounted_instructions` (not weighted by loop trips) and are
missing from the wire bytes.

Every case: MaxText's defaults (`configs/base.yml` plus the model's file) but for
the topology, the mesh and 1 x 2048 tokens per device (`per_device_batch_size=1`,
`max_target_length=2048`): full remat, scanned layers, its default attention
(`autoselected`), bf16 activations over f32 weights, AdamW, synthetic data.
The pipeline case keeps MaxText's default number of micro-batches, one per stage
(4): with 128 sequences per step, 8 micro-batches would hold 16 sequences each,
fewer than the 32 devices of the FSDP axis they are split over. Mixtral uses
MaxText's default MoE path (`sparse_matmul=true`, `megablox=true`, no token
dropping), and `allow_split_physical_axes=true`: v5p-128 is a 4 x 4 x 4 torus,
so mesh axes of 8 and 8 (expert, fsdp) cannot each be a product of whole physical
axes, and without that setting MaxText refuses the mesh.

Environment that worked (Python 3.12):

    pip install "maxtext[tpu]==0.2.5" "jax[tpu]==0.12.0"

which resolved jaxlib 0.12.0, libtpu 0.0.50.1, flax 0.12.12 (the versions each
record states).
"""

import argparse
import datetime
import gzip
import json
import os
import pathlib
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results" / "maxtext_reference.json"
HLO_DIR = pathlib.Path(tempfile.gettempdir()) / "maxtext_hlo"
_UNCOUNTED = re.compile(r"\s((?:ragged-all-to-all|collective-broadcast)(?:-start)?)\(")
TOKENS = {"per_device_batch_size": "1", "max_target_length": "2048"}

# name: (model, topology, chips, mesh settings)
CASES = {
    "llama3-8b_v5p-64_fsdp32": ("llama3-8b", "v5p-64", 32, {"ici_fsdp_parallelism": "32"}),
    "llama3-8b_v5p-64_fsdp8_tensor4": (
        "llama3-8b",
        "v5p-64",
        32,
        {"ici_fsdp_parallelism": "8", "ici_tensor_parallelism": "4"},
    ),
    "llama3-70b_v5p-256_fsdp32_tensor4": (
        "llama3-70b",
        "v5p-256",
        128,
        {"ici_fsdp_parallelism": "32", "ici_tensor_parallelism": "4"},
    ),
    "llama3-70b_v5p-256_pipe4_fsdp32": (
        "llama3-70b",
        "v5p-256",
        128,
        {"ici_pipeline_parallelism": "4", "ici_fsdp_parallelism": "32", "num_pipeline_microbatches": "4"},
    ),
    "mixtral-8x7b_v5p-128_expert8_fsdp8": (
        "mixtral-8x7b",
        "v5p-128",
        64,
        {"ici_expert_parallelism": "8", "ici_fsdp_parallelism": "8", "allow_split_physical_axes": "true"},
    ),
}


def settings(name: str) -> dict[str, str]:
    """The `key=value` settings handed to MaxText's config for case `name`."""
    model, topology, _, mesh = CASES[name]
    return {
        "run_name": name,
        "model_name": model,
        "compile_topology": topology,
        "compile_topology_num_slices": "1",
        **mesh,
        **TOKENS,
    }


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for package in ("maxtext", "jax", "jaxlib", "libtpu", "flax"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "missing"
    return found


def _compile_one(name: str, out: pathlib.Path, hlo_dir: pathlib.Path) -> None:
    """In the subprocess: compile case `name` as train_compile.main does, write its record to `out`."""
    record: dict = {"name": name, "settings": settings(name)}
    try:
        record.update(_compile(name, hlo_dir))
    except Exception as error:  # noqa: BLE001 - a failed case is a result too
        record["error"] = f"{type(error).__name__}: {error}"[:4000]
        record["traceback"] = traceback.format_exc()[-4000:]
    out.write_text(json.dumps(record))


def _compile(name: str, hlo_dir: pathlib.Path) -> dict:
    # The preamble of train_compile.main, then its body up to the compiled object.
    os.environ["LIBTPU_INIT_ARGS"] = (
        os.environ.get("LIBTPU_INIT_ARGS", "") + " --xla_tpu_spmd_rng_bit_generator_unsafe=true"
    )
    import jax
    from flax.core.spmd import logical_axis_rules as axis_rules
    from maxtext.configs import pyconfig
    from maxtext.trainers.pre_train import train, train_compile
    from maxtext.utils import maxtext_utils, sharding

    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    base = pathlib.Path(pyconfig.__file__).parent / "base.yml"
    argv = ["train_compile", str(base)] + [f"{k}={v}" for k, v in settings(name).items()]
    config = pyconfig.initialize(argv)
    train_compile.validate_config(config)
    mesh = train_compile.get_topology_mesh(config)
    args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, config)
    params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(
        config, state_shardings
    )
    input_shardings = sharding.build_zero1_input_state_mesh_shardings(
        config, state_shardings, params_shardings
    )
    data_sharding = sharding.get_input_data_sharding(config, mesh)
    func, in_shard, out_shard, static, donate = maxtext_utils.get_functional_train_with_signature(
        train.train_step, data_sharding, input_shardings, model, config, params_shardings
    )
    start = time.perf_counter()
    compiled = train_compile.jit_and_compile(
        func,
        args,
        kwargs,
        mesh,
        in_shard,
        out_shard,
        static,
        donate,
        config,
        axis_rules(config.logical_axis_rules),
    )
    compile_s = time.perf_counter() - start
    memory = compiled.memory_analysis()
    fields = sorted(f for f in dir(memory) if f.endswith("_in_bytes"))
    text = compiled.as_text()
    hlo_dir.mkdir(parents=True, exist_ok=True)
    with gzip.open(hlo_dir / f"{name}.hlo.txt.gz", "wt") as f:
        f.write(text)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return {
        "mesh": {k: int(v) for k, v in zip(config.mesh_axes, mesh.devices.shape, strict=True) if v > 1},
        "memory_bytes": {f.removesuffix("_in_bytes"): int(getattr(memory, f)) for f in fields},
        "compile_s": round(compile_s, 2),
        "flops_per_device": float((cost or {}).get("flops", 0.0)),
        "num_pipeline_microbatches": int(config.num_pipeline_microbatches),
        "attention": str(config.attention),
        "remat_policy": str(config.remat_policy),
        "hlo_file": f"{name}.hlo.txt.gz",
        "hlo_chars": len(text),
    }


def compile_cases(names: list[str], hlo_dir: pathlib.Path, timeout_s: float) -> None:
    """Compile each case in its own subprocess, one at a time, and merge the records into RESULTS."""
    records = _load()
    for name in names:
        model, topology, chips, _ = CASES[name]
        out = hlo_dir / f"{name}.record.json"
        out.unlink(missing_ok=True)
        hlo_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, __file__, "one", name, "--hlo-dir", str(hlo_dir), "--out", str(out)]
        start = time.perf_counter()
        with open(hlo_dir / f"{name}.log", "w") as log:
            child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=hlo_dir)
            deadline = start + timeout_s
            status, usage = 0, None
            while usage is None:
                pid, status, usage_now = os.wait4(child.pid, os.WNOHANG)
                if pid:
                    usage = usage_now
                elif time.perf_counter() > deadline:
                    child.kill()
                    _, status, usage = os.wait4(child.pid, 0)
                else:
                    time.sleep(1)
        wall = time.perf_counter() - start
        record = json.loads(out.read_text()) if out.exists() else {"name": name, "settings": settings(name)}
        if not out.exists():
            reason = "timed out" if wall > timeout_s else f"exit status {os.waitstatus_to_exitcode(status)}"
            record["error"] = f"the subprocess wrote no record ({reason}; see its log)"
        record.update(
            model=model,
            topology=topology,
            chips=chips,
            tokens_per_device=2048,
            subprocess_s=round(wall, 1),
            peak_rss_bytes=usage.ru_maxrss * 1024,  # Linux: KiB
            versions=_versions(),
            date=datetime.date.today().isoformat(),
            compile_s_measures="jit + lower + compile around MaxText's jit_and_compile",
        )
        records[name] = {k: record[k] for k in _order(record)}
        _save(records)
        print(_line(records[name]), flush=True)


def _order(record: dict) -> list[str]:
    first = ["name", "model", "topology", "chips", "mesh", "settings", "tokens_per_device", "memory_bytes"]
    return [k for k in first if k in record] + [k for k in record if k not in first]


def _load() -> dict:
    if RESULTS.exists():
        return {r["name"]: r for r in json.loads(RESULTS.read_text())["records"]}
    return {}


def _save(records: dict) -> None:
    ordered = [records[n] for n in CASES if n in records]
    body = {"command": "benchmarks/maxtext_reference.py compile, then summarize", "records": ordered}
    RESULTS.write_text(json.dumps(body, indent=1) + "\n")


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _line(record: dict) -> str:
    if "error" in record:
        return f"{record['name']}: FAILED {record['error'][:300]}"
    m = record["memory_bytes"]
    return (
        f"{record['name']}: argument {_gib(m['argument_size'])} GiB, temp {_gib(m['temp_size'])} GiB, "
        f"output {_gib(m['output_size'])} GiB, compile {record['compile_s']} s, "
        f"peak RSS {_gib(record['peak_rss_bytes'])} GiB"
    )


def summarize(hlo_dir: pathlib.Path) -> None:
    """Add collective wire bytes and the async share of each saved HLO to its record."""
    from eqxpar.inspect import collective_stats, overlap_stats

    records = _load()
    for name, record in records.items():
        path = hlo_dir / f"{name}.hlo.txt.gz"
        if "error" in record or not path.exists():
            continue
        with gzip.open(path, "rt") as f:
            text = f.read()
        start = time.perf_counter()
        stats = collective_stats(text)
        overlap = overlap_stats(text)
        record["collectives"] = {
            "wire_bytes": {k: int(v) for k, v in stats.wire_bytes.items() if v},
            "count": {k: int(v) for k, v in stats.count.items() if v},
            "total_wire_bytes": int(stats.total_wire_bytes),
            "async_wire_bytes": {k: a for k, (a, _) in overlap.by_kind.items() if a},
            "async_share": round(overlap.share, 4),
            "read_by": "eqxpar.inspect.collective_stats, overlap_stats",
        }
        # Collectives the reader has no kind for (their sizes depend on the data):
        # instructions in the text, not weighted by loop trips.
        uncounted = Counter(_UNCOUNTED.findall(text))
        if uncounted:
            record["collectives"]["uncounted_instructions"] = dict(uncounted)
        print(f"{name}: read in {time.perf_counter() - start:.1f} s\n{overlap}", flush=True)
    _save(records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("compile", "summarize", "one"))
    parser.add_argument("name", nargs="?", help="(one) the case to compile in this process")
    parser.add_argument("--only", help="compile: comma-separated case names (default: all)")
    parser.add_argument("--hlo-dir", type=pathlib.Path, default=HLO_DIR, help="where the HLO texts go")
    parser.add_argument("--out", type=pathlib.Path, help="(one) where the record goes")
    parser.add_argument("--timeout", type=float, default=900.0, help="compile: seconds per case")
    args = parser.parse_args()
    if args.step == "one":
        _compile_one(args.name, args.out, args.hlo_dir)
    elif args.step == "compile":
        compile_cases(args.only.split(",") if args.only else list(CASES), args.hlo_dir, args.timeout)
    else:
        summarize(args.hlo_dir)


if __name__ == "__main__":
    main()
