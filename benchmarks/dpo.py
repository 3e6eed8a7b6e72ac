"""A DPO step whose reference is the model with its adapters off, beside a LoRA
fine-tuning step on the same rows (BENCHMARKS.md, "Preference tuning"): the
compiled steps' memory per device (`memory_analysis`), under the LoRA record's
plan and under data 8.

    python -m benchmarks.dpo --json benchmarks/results/quick.json --markdown BENCHMARKS.md

The LoRA step trains `lm_loss` on `2 x pairs` rows of `seq + 1` tokens; the DPO
step (`eqxpar.models.dpo_loss`) trains on `pairs` pairs of the same rows, so both
run the policy forward and backward over the same tokens and the DPO step adds
the reference forward (no gradient) and the per-pair loss. Contract: the DPO
step's memory (arguments + temporaries) at most 1.05x the LoRA step's.
"""

import argparse
import functools
import json
import pathlib
import sys

import jax
import jax.numpy as jnp

import eqxpar

from . import _measure, _workload, report
from .lora import ALPHA, CFG, RANK, TARGETS

#: The LoRA record's plan and a data-parallel one.
PLANS = {
    "fsdp_tp": (
        dict(data=2, fsdp=2, tensor=2),
        dict(rules=_workload.TENSOR_FSDP_RULES, mode="manual", sequence_parallel=True),
    ),
    "data8": (dict(data=8), {}),
}
#: The contract: a DPO step's memory at most this times the LoRA step's.
LIMIT = 1.05
BEGIN = "<!-- dpo table (python -m benchmarks.dpo --markdown): edit the prose outside it -->"
END = "<!-- end of dpo table -->"


def pairs_of(rows: jax.Array) -> dict[str, jax.Array]:
    """The workload's rows as preference pairs: rows 2i and 2i + 1 the chosen and
    rejected completions of pair i, the first quarter of each row its prompt."""
    prompt = rows.shape[1] // 4
    weights = (jnp.arange(rows.shape[1]) >= prompt).astype(jnp.float32)
    weights = jnp.broadcast_to(weights, (rows.shape[0] // 2, rows.shape[1]))
    return {
        "chosen": rows[0::2],
        "rejected": rows[1::2],
        "chosen_weights": weights,
        "rejected_weights": weights,
    }


def _figures(loss_fn, model, plan, batch) -> dict[str, int]:
    optim = _workload.make_optimizer(CFG)
    trainable = eqxpar.models.lora_trainable(model)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(loss_fn, optim, plan, trainable=trainable)
    figures = _measure.memory(step.compile(state, batch))
    figures["mem_total_bytes"] = figures["mem_argument_bytes"] + figures["mem_temp_bytes"]
    return figures


def measure(name: str) -> dict:
    mesh, options = PLANS[name]
    plan = eqxpar.Plan(eqxpar.make_mesh(**mesh), **options)
    model = _workload.make_model(CFG)
    adapted = eqxpar.models.add_lora(model, rank=RANK, alpha=ALPHA, targets=TARGETS, key=jax.random.key(2))
    rows = _workload.make_batches(1, CFG)[0]
    lora = _figures(eqxpar.models.lm_loss, adapted, plan, rows)
    dpo = _figures(functools.partial(eqxpar.models.dpo_loss, beta=0.1), adapted, plan, pairs_of(rows))
    ratios = {k: dpo[k] / lora[k] for k in lora}
    return {
        "mesh": mesh,
        "lora": lora,
        "dpo": dpo,
        "ratios": ratios,
        "within": ratios["mem_total_bytes"] <= LIMIT,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=pathlib.Path, required=True, help="the JSON to record into")
    parser.add_argument("--markdown", type=pathlib.Path, help="a page with the table's markers")
    args = parser.parse_args()
    record = {
        "command": "python -m " + " ".join(["benchmarks.dpo", *sys.argv[1:]]),
        "workload": _workload.describe(CFG),
        "rank": RANK,
        "alpha": ALPHA,
        "targets": list(TARGETS),
        "rows": CFG.batch,
        "limit": LIMIT,
        "plans": {name: measure(name) for name in PLANS},
    }
    print(json.dumps(record, indent=1))
    data = json.loads(args.json.read_text()) if args.json.exists() else {}
    _measure.write_json(args.json, {**data, "dpo": record})
    if args.markdown:
        report.splice(args.markdown, table(record), begin=BEGIN, end=END)
    broken = [name for name, r in record["plans"].items() if not r["within"]]
    if broken:
        sys.exit(f"DPO step memory above {LIMIT}x the LoRA step's under {broken}")


def table(record: dict) -> str:
    """The Markdown table of a `dpo` record (BENCHMARKS.md, "Preference tuning")."""
    kib = lambda x: f"{x / 2**10:,.0f} KiB"  # noqa: E731
    rows = []
    for name, r in record["plans"].items():
        for side in ("lora", "dpo"):
            rows.append(
                [
                    name,
                    side,
                    *(kib(r[side][f]) for f in ("mem_argument_bytes", "mem_temp_bytes", "mem_total_bytes")),
                ]
            )
        rows.append(
            [
                name,
                "dpo / lora",
                *(
                    f"{r['ratios'][f]:.3f}"
                    for f in ("mem_argument_bytes", "mem_temp_bytes", "mem_total_bytes")
                ),
            ]
        )
    columns = ["plan", "step", "arguments per device", "temporaries per device", "total per device"]
    return report.markdown_table(columns, rows)


if __name__ == "__main__":
    main()
