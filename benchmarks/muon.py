"""Muon's traffic on the benchmark GPT (benchmarks/README.md): optax.contrib.muon against
eqxpar.optim.muon, in compiled HLO wire bytes per device per step.

    python -m benchmarks.muon --json benchmarks/results/quick.json --markdown BENCHMARKS.md

Both with the usual recipe (`MUON_DIMS`: the stack's matrices on Muon, one per layer and
per q/k/v; embeddings, positions, norms, biases and the head on AdamW). The optimizer's
traffic is the step's wire bytes beyond the same step's with AdamW (elementwise: it moves
nothing), held to at most twice the parameter bytes.
"""

import argparse
import json
import pathlib

import equinox as eqx
import jax
import optax

import eqxpar

from . import _workload

D = optax.contrib.MuonDimensionNumbers
#: The workload GPT's block matrices (fused QKV, GELU MLP), by leaf name; negative
#: dimensions, so the stack's leading layer axis indexes matrices.
MUON_DIMS = {"wqkv": D(-4, (-2, -1)), "wo": D((-3, -2), -1), "w_in": D(-3, -1), "w_out": D(-2, -1)}


def muon_dims(params):
    """The recipe: a `MuonDimensionNumbers` for each block matrix, None (AdamW) elsewhere."""
    return jax.tree_util.tree_map_with_path(lambda p, _: MUON_DIMS.get(getattr(p[-1], "name", None)), params)


PLANS = {
    "fsdp8": lambda: eqxpar.Plan(
        eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual"
    ),
    "fsdp8_auto": lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp")),
    "fsdp4_tensor2": lambda: eqxpar.Plan(
        eqxpar.make_mesh(fsdp=4, tensor=2), rules=_workload.TENSOR_FSDP_RULES, mode="manual"
    ),
}
OPTIMIZERS = {
    "adamw": lambda lr: optax.adamw(lr),
    "optax_muon": lambda lr: optax.contrib.muon(lr, muon_weight_dimension_numbers=muon_dims),
    "eqxpar_muon": lambda lr: eqxpar.optim.muon(lr, muon_weight_dimension_numbers=muon_dims),
}


def _wire(plan: eqxpar.Plan, model, optim) -> dict:
    batch = _workload.make_batches(1)[0]
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    compiled = eqxpar.train.make_step(_workload.loss_fn, optim, plan).compile(state, batch)
    return {k: int(v) for k, v in eqxpar.inspect.collective_stats(compiled).wire_bytes.items() if v}


def measure() -> dict:
    model = _workload.make_model()
    leaves = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    params = int(sum(x.nbytes for x in leaves))
    out = {"command": "python -m benchmarks.muon --json PATH", "param_bytes": params}
    for name, make_plan in PLANS.items():
        wire = {k: _wire(make_plan(), model, make(1e-3)) for k, make in OPTIMIZERS.items()}
        base = sum(wire["adamw"].values())
        record = {"wire_bytes": wire}
        for k in ("optax_muon", "eqxpar_muon"):
            record[f"{k}_optimizer_bytes"] = sum(wire[k].values()) - base
            record[f"{k}_ratio_to_params"] = round(record[f"{k}_optimizer_bytes"] / params, 3)
        out[name] = record
    return out


def markdown(record: dict) -> str:
    rows = [
        "| plan | optimizer | step wire bytes / device | optimizer's bytes | / parameter bytes |",
        "|---|---|---:|---:|---:|",
    ]
    for name in PLANS:
        r = record[name]
        for k in OPTIMIZERS:
            total = sum(r["wire_bytes"][k].values())
            extra = r.get(f"{k}_optimizer_bytes", 0)
            ratio = r.get(f"{k}_ratio_to_params", 0.0)
            rows.append(f"| {name} | {k} | {total:,} | {extra:,} | {ratio} |")
    return "\n".join(rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=pathlib.Path, help="merge the record into this JSON (key 'muon')")
    parser.add_argument("--markdown", type=pathlib.Path, help="write the table into this file's muon markers")
    args = parser.parse_args()
    record = measure()
    table = markdown(record)
    print(table)
    if args.json is not None:
        data = json.loads(args.json.read_text()) if args.json.exists() else {}
        data["muon"] = record
        args.json.write_text(json.dumps(data, indent=1) + "\n")  # the record's own layout
    if args.markdown is not None:
        text = args.markdown.read_text()
        start, end = (
            "<!-- muon table (python -m benchmarks.muon --markdown): edit the prose outside it -->",
            "<!-- end of muon table -->",
        )
        head, rest = text.split(start)
        _, tail = rest.split(end)
        args.markdown.write_text(f"{head}{start}\n\n{table}\n\n{end}{tail}")
