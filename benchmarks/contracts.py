"""What a record is held to: each record's `contract` names clauses of `CLAUSES` with
their bounds; `benchmarks.run` checks them and exits non-zero when one fails."""

from collections.abc import Callable
from typing import Any


def _wire(r: dict) -> int:
    return r["comm_wire_bytes_total"]


def _temp_growth(r: dict) -> float:
    # From the first to the last point of the memory sweep (4p to 16p micro-batches).
    sweep = r["memory_sweep"]
    return sweep[-1]["mem_temp_bytes"] / sweep[0]["mem_temp_bytes"] - 1


#: clause -> (what it says, `holds(record, bound, records by name)`).
CLAUSES: dict[str, tuple[str, Callable[[dict, Any, dict], bool]]] = {
    "wire_over_min_max": ("wire ≤ {} × minimum", lambda r, c, _: _wire(r) <= c * r["comm_wire_bytes_min"]),
    "wire_over_moved_min_max": (
        "wire ≤ {} × minimum in the dtype the collectives move",
        lambda r, c, _: _wire(r) <= c * r["comm_wire_bytes_min_moved_dtype"],
    ),
    "wire_le_baseline": ("wire ≤ baseline", lambda r, c, _: _wire(r) <= r["comm_wire_bytes_baseline"]),
    "wire_le_baseline_plus_bytes": (
        "wire ≤ baseline + {} B (scalar reductions)",
        lambda r, c, _: _wire(r) <= r["comm_wire_bytes_baseline"] + c,
    ),
    "parity_max_rel_err": ("parity ≤ {}", lambda r, c, _: r["parity_max_rel_err"] <= c),
    "parity_loss_max_rel_err": ("loss parity ≤ {}", lambda r, c, _: r["parity_loss_rel_err"] <= c),
    "parity_grads_norm_max_rel_err": (
        "gradient parity in 2-norm ≤ {}",
        lambda r, c, _: r["parity_grads_norm_rel_err"] <= c,
    ),
    "step_ratio_max": (
        "step ≤ {} × baseline",
        lambda r, c, _: r["step_time_s"] <= c * r["baseline_step_time_s"],
    ),
    "step_ratio_vs_handwritten_sp_max": (
        "step ≤ {} × the hand-written sequence-parallel step",
        lambda r, c, _: r["references"]["handwritten_sp"]["eqxpar_over_reference"] <= c,
    ),
    "step_ratio_vs_data_parallel_max": (
        "step ≤ {} × the data-parallel step of the same model",
        lambda r, c, _: r["references"]["data_parallel"]["eqxpar_over_reference"] <= c,
    ),
    "flops_over_reference_max": (
        "lockstep matmul FLOPs ≤ {} × (data-parallel step's / (1 - lockstep bubble))",
        lambda r, c, _: r["flops_over_reference"] <= c,
    ),
    "flops_over_table_max": (
        "lockstep matmul FLOPs ≤ {} × the table's, each action at its own FLOPs on one device",
        lambda r, c, _: r["flops_over_table"] <= c,
    ),
    "wire_over_ring_bound_max": (
        "wire ≤ {} × (minimum + one more K/V all-gather)",
        lambda r, c, _: _wire(r) <= c * r["comm_wire_bytes_ring_bound"],
    ),
    "wire_over_dropless_bound_max": (
        "wire ≤ {} × (minimum with the routed all-to-alls n times over, plus expert ids)",
        lambda r, c, _: _wire(r) <= c * r["comm_wire_bytes_dropless_bound"],
    ),
    "context_temp_growth_max": (
        "temp growth from context 1 to the largest, the sequence growing alike, < {:.0%}",
        lambda r, c, _: (
            r["context_memory"][-1]["mem_temp_bytes"] / r["context_memory"][0]["mem_temp_bytes"] - 1 < c
        ),
    ),
    "temp_growth_max": ("temp growth 4p→16p < {:.0%}", lambda r, c, _: _temp_growth(r) < c),
    "temp_growth_min": ("temp growth 4p→16p ≥ {:.0%}", lambda r, c, _: _temp_growth(r) >= c),
    "bubble_below": (
        "bubble < {}'s",
        lambda r, c, rs: c not in rs or r["bubble_fraction"] < rs[c]["bubble_fraction"],
    ),
}
#: Clauses on step times: noisy on shared cores, left out where timing means nothing.
TIMED = {"step_ratio_max", "step_ratio_vs_handwritten_sp_max", "step_ratio_vs_data_parallel_max"}


def describe(contract: dict) -> str:
    return "; ".join(CLAUSES[k][0].format(v) for k, v in contract.items())


def broken(record: dict, records: dict[str, dict], *, timing: bool = True) -> list[str]:
    """The clauses of `record`'s contract it breaks, as text (`records`: every record by name)."""
    return [
        f"{record['strategy']}: not {CLAUSES[key][0].format(bound)}"
        for key, bound in record.get("contract", {}).items()
        if (timing or key not in TIMED) and not CLAUSES[key][1](record, bound, records)
    ]
