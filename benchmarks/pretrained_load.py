"""Host memory of `eqxpar.models.from_pretrained` under a plan, per process (benchmarks/README.md):

    python benchmarks/pretrained_load.py --write /tmp/big-llama
    python -m eqxpar.launch -n 2 --devices-per-process 4 benchmarks/pretrained_load.py --load /tmp/big-llama

`--write` writes a Llama-shaped float32 checkpoint of over 1 GB; `--load` loads it under `fsdp=8` as
2 processes x 4 devices, and fails if a process's peak grew by the whole model, or its anonymous
memory by twice its shards (benchmarks/README.md says what each process prints).
"""

import argparse
import json
import math
import pathlib


def _status(field: str) -> int:
    # Linux: resident set now (VmRSS) and its peak so far (VmHWM), in bytes.
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _tensor_bytes(directory: pathlib.Path) -> list[int]:
    """Each float32 tensor's bytes, as the checkpoint's safetensors headers give its shape."""
    from safetensors import safe_open

    sizes = []
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "numpy") as f:
            sizes += [math.prod(f.get_slice(name).get_shape()) * 4 for name in f.keys()]
    return sizes


def write(directory: pathlib.Path) -> None:
    # The library's public writer (one tensor at a time) on a model built in memory.
    import jax

    from eqxpar.models import GPT, GPTConfig, save_pretrained

    # 4 x 218 MB of blocks + 262 MB of embedding: 1.13 GB in float32.
    sizes = dict(vocab_size=32000, d_model=2048, num_heads=16, num_layers=4, d_hidden=5632)
    config = GPTConfig(**sizes, tied=True, norm_eps=1e-5, max_seq_len=4096)
    save_pretrained(GPT(config, key=jax.random.key(0)), directory)
    tensors = _tensor_bytes(directory)
    print(f"wrote {directory}: {len(tensors)} tensors, {sum(tensors) / 1e9:.2f} GB")


def load(directory: pathlib.Path, json_path: pathlib.Path | None) -> None:
    import eqxpar.distributed as dist

    dist.initialize()
    import jax

    import eqxpar
    from eqxpar.models import from_pretrained

    sizes = _tensor_bytes(directory)
    total, largest = sum(sizes), max(sizes)
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=1))
    before = _status("VmRSS")
    model = from_pretrained(directory, plan)
    jax.block_until_ready(jax.tree.leaves(model))
    peak = _status("VmHWM")
    local = sum(s.data.nbytes for leaf in jax.tree.leaves(model) for s in leaf.addressable_shards)
    anonymous = _status("RssAnon")
    print(
        f"process {jax.process_index()}: RSS before load {before / 1e6:.0f} MB, peak {peak / 1e6:.0f} MB, "
        f"growth {(peak - before) / 1e6:.0f} MB ({(peak - before) / (local + largest):.2f} x its shards "
        f"{local / 1e6:.0f} MB of {total / 1e6:.0f} MB + the largest tensor {largest / 1e6:.0f} MB); "
        f"anonymous after the load {anonymous / 1e6:.0f} MB"
    )
    if json_path is not None:
        _record(json_path, [before, peak, anonymous, local], total=total, largest=largest)
    # The contract: never the whole model on one host, never a second copy of its half.
    if peak - before >= total or anonymous - before >= 2 * local:
        raise SystemExit(f"process {jax.process_index()}: the load held more than its share")


def _record(path: pathlib.Path, mine: list[int], *, total: int, largest: int) -> None:
    """Every process's figures, written by process 0 into the benchmark JSON (key "pretrained_load")."""
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int64)))
    if jax.process_index() != 0:
        return
    data = json.loads(path.read_text()) if path.exists() else {}
    command = "python -m eqxpar.launch -n 2 --devices-per-process 4 benchmarks/pretrained_load.py"
    fields = ("rss_before", "peak", "growth", "anonymous_after", "shards")
    processes = [
        dict(zip(fields, map(int, (b, p, p - b, a, s)), strict=True))
        | {"growth_over_shards_plus_largest": round(float(p - b) / float(s + largest), 3)}
        for b, p, a, s in rows
    ]
    data["pretrained_load"] = {"command": f"{command} --load DIR --json {path}", "model_bytes": total}
    data["pretrained_load"] |= {"largest_tensor_bytes": largest, "processes": processes}
    path.write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", type=pathlib.Path)
    group.add_argument("--load", type=pathlib.Path)
    parser.add_argument("--json", type=pathlib.Path, help="with --load: record the figures in this JSON")
    args = parser.parse_args()
    write(args.write) if args.write else load(args.load, args.json)
