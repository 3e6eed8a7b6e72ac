"""Frozen weights on the benchmark GPT (benchmarks/README.md): the embedding, positions and the
stack frozen, the final norm and the head trained, against the full model under the same plan.

    python -m benchmarks.fine_tuning --json benchmarks/results/quick.json

Per plan (data 8, FSDP 8): the compiled step's gradient wire bytes (all-reduce and
reduce-scatter, per device), the optimizer-state bytes and the step's matmul FLOPs per device.
"""

import argparse
import json
import pathlib

import equinox as eqx
import jax

import eqxpar

from . import _workload

PLANS = {
    "data8": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)),
    "fsdp8": lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp")),
}


def head_only(model: eqxpar.models.GPT):
    """The filter: the final norm and the head train, nothing else."""
    mask = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: (m.final_norm, m.head), mask, replace=(True, True))


def _figures(plan: eqxpar.Plan, model, trainable) -> dict:
    optim, batch = _workload.make_optimizer(), _workload.make_batches(1)[0]
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(_workload.loss_fn, optim, plan, trainable=trainable)
    compiled = step.compile(state, batch)
    wire = eqxpar.inspect.collective_stats(compiled).wire_bytes
    leaves = jax.tree.leaves(eqx.filter(state.opt_state, eqx.is_array))
    return {
        "gradient_wire_bytes": int(wire.get("all-reduce", 0) + wire.get("reduce-scatter", 0)),
        "all_gather_wire_bytes": int(wire.get("all-gather", 0)),
        "opt_state_bytes": int(sum(x.size * x.dtype.itemsize for x in leaves)),
        "matmul_flops": int(eqxpar.inspect.matmul_flops(compiled)),
    }


def measure() -> dict:
    model = _workload.make_model()
    out = {"command": "python -m benchmarks.fine_tuning --json PATH", "trained": "final_norm, head"}
    for name, make_plan in PLANS.items():
        full, frozen = _figures(make_plan(), model, None), _figures(make_plan(), model, head_only(model))
        ratios = {f"{k}_ratio": round(frozen[k] / full[k], 4) for k in full if full[k]}
        out[name] = {"full": full, "frozen": frozen, **ratios}
    return out


def markdown(record: dict) -> str:
    rows = ["| plan | figure | full model | head + norm trained | ratio |", "|---|---|---:|---:|---:|"]
    for name in PLANS:
        r = record[name]
        for k in r["full"]:
            ratio = r.get(f"{k}_ratio", "n/a")
            rows.append(f"| {name} | {k} | {r['full'][k]:,} | {r['frozen'][k]:,} | {ratio} |")
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=pathlib.Path, help="merge the record into this JSON (key 'frozen')")
    args = parser.parse_args()
    record = measure()
    print(markdown(record))
    if args.json is not None:
        data = json.loads(args.json.read_text()) if args.json.exists() else {}
        data["frozen"] = record
        args.json.write_text(json.dumps(data, indent=2) + "\n")
