"""LoRA beside a full fine-tune of the same model under the same plan (BENCHMARKS.md,
"LoRA"): optimizer-state bytes, the compiled step's temporary bytes, the step time.

    python -m benchmarks.lora --json benchmarks/results/quick.json --markdown BENCHMARKS.md
"""

import argparse
import json
import pathlib
import sys

import jax

import eqxpar

from . import _measure, _workload, report

#: The workload's Llama-style variant (separate Q, K, V; SwiGLU), every projection adapted.
CFG = _workload.Config(llama=True, kv_heads=2)
RANK, ALPHA, TARGETS = 8, 16, ("q", "k", "v", "o", "gate", "up", "down")
#: The fsdp_tp record's plan: FSDP x tensor x sequence parallel, manual.
MESH = dict(data=2, fsdp=2, tensor=2)
PLAN = dict(rules=_workload.TENSOR_FSDP_RULES, mode="manual", sequence_parallel=True)
BEGIN = "<!-- lora table (python -m benchmarks.lora --markdown): edit the prose outside it -->"
END = "<!-- end of lora table -->"
FIELDS = ("opt_state_bytes", "opt_state_bytes_per_device", "mem_temp_bytes", "matmul_flops", "wire_bytes")
FIELDS += ("step_time_s",)
SIDES = ("full", "lora")


def _bytes(tree) -> dict[str, int]:
    """The arrays of `tree`: bytes in all, and on the first device."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
    first = jax.devices()[0]
    local = sum(s.data.nbytes for x in arrays for s in x.addressable_shards if s.device == first)
    return {"opt_state_bytes": sum(x.nbytes for x in arrays), "opt_state_bytes_per_device": local}


def _side(model, trainable, plan, batches) -> tuple:
    """A step of `model` training `trainable` (None: everything): its runner and figures."""
    optim = _workload.make_optimizer(CFG)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optim, plan, trainable=trainable)
    compiled = step.compile(state, batches[0])
    figures = {**_bytes(state.opt_state), **_measure.memory(compiled)}
    figures["matmul_flops"] = int(eqxpar.inspect.matmul_flops(compiled))
    figures["wire_bytes"] = int(eqxpar.inspect.collective_stats(compiled).total_wire_bytes)
    held = [state, 0]

    def run():
        held[0], metrics = step(held[0], batches[held[1] % len(batches)])
        held[1] += 1
        return held[0], metrics  # all of it: the next step starts after this one ends

    return run, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True, help="the JSON to record into")
    parser.add_argument("--markdown", type=pathlib.Path, help="a page with the table's markers")
    parser.add_argument("--timed", type=int, default=10, help="timed steps per side (after 2 warm-up)")
    args = parser.parse_args()
    plan = eqxpar.Plan(eqxpar.make_mesh(**MESH), **PLAN)
    model, batches = _workload.make_model(CFG), _workload.make_batches(4, CFG)
    adapted = eqxpar.models.add_lora(model, rank=RANK, alpha=ALPHA, targets=TARGETS, key=jax.random.key(2))
    sides = {"full": _side(model, None, plan, batches)}
    sides["lora"] = _side(adapted, eqxpar.models.lora_trainable(adapted), plan, batches)
    times = _measure.timed_steps({k: run for k, (run, _) in sides.items()}, warm=2, timed=args.timed)
    record = {
        "command": "python -m " + " ".join(["benchmarks.lora", *sys.argv[1:]]),
        "mesh": MESH,
        "plan": "TENSOR_FSDP_RULES, manual, sequence parallel",
    }
    record |= {"workload": _workload.describe(CFG), "rank": RANK, "alpha": ALPHA, "targets": list(TARGETS)}
    for k, (_, figures) in sides.items():
        record[k] = {**figures, "step_time_s": times[k]["step_time_s"]}
    record["ratios"] = {f: record["lora"][f] / record["full"][f] for f in FIELDS}
    print(json.dumps(record, indent=1))
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    _measure.write_json(args.json, {**data, "lora": record})
    if args.markdown:
        report.splice(args.markdown, table(record), begin=BEGIN, end=END)


def table(record: dict) -> str:
    """The Markdown table of a `lora` record (BENCHMARKS.md, "LoRA")."""
    kib = lambda x: f"{x / 2**10:,.0f} KiB"  # noqa: E731
    units = (kib, kib, kib, lambda x: f"{x / 1e9:.2f} G", kib, lambda x: f"{x * 1e3:,.0f} ms")
    rows = [[k, *(u(record[k][f]) for u, f in zip(units, FIELDS, strict=True))] for k in SIDES]
    rows.append(["lora / full", *(f"{record['ratios'][f]:.3f}" for f in FIELDS)])
    columns = ["", "optimizer state", "its share per device", "step temporaries per device"]
    columns += ["matmul FLOPs per device", "collective wire bytes per device", "step time"]
    return report.markdown_table(columns, rows)


if __name__ == "__main__":
    main()
