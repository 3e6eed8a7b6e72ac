"""What a record is held to: each record's `contract` names clauses of `SAYS` with
their bounds; `benchmarks.run` checks them and exits non-zero when one fails."""

from collections.abc import Callable


def _at_most(field: str) -> Callable:
    return lambda r, c, _: r[field] <= c


def _within(field: str, of: str = "comm_wire_bytes_total") -> Callable:
    """`record[of]` within `bound` times `record[field]`."""
    return lambda r, c, _: r[of] <= c * r[field]


def _over(reference: str) -> Callable:
    return lambda r, c, _: r["references"][reference]["eqxpar_over_reference"] <= c


def _growth(r: dict, sweep: str) -> float:
    # From the first to the last point of a sweep (memory_sweep: 4p to 16p micro-batches).
    return r[sweep][-1]["mem_temp_bytes"] / r[sweep][0]["mem_temp_bytes"] - 1


#: clause -> what it says of its bound (`{}`).
SAYS = {
    "wire_over_min_max": "wire ≤ {} × minimum",
    "wire_over_moved_min_max": "wire ≤ {} × minimum in the dtype the collectives move",
    "wire_le_baseline": "wire ≤ baseline",
    "wire_le_baseline_plus_bytes": "wire ≤ baseline + {} B (scalar reductions)",
    "parity_max_rel_err": "parity ≤ {}",
    "parity_loss_max_rel_err": "loss parity ≤ {}",
    "parity_grads_norm_max_rel_err": "gradient parity in 2-norm ≤ {}",
    "step_ratio_max": "step ≤ {} × baseline",
    "step_ratio_vs_handwritten_sp_max": "step ≤ {} × the hand-written sequence-parallel step",
    "step_ratio_vs_data_parallel_max": "step ≤ {} × the data-parallel step of the same model",
    "flops_over_reference_max": "lockstep matmul FLOPs ≤ {} × (data-parallel step's / (1 - lockstep bubble))",
    "flops_over_table_max": "lockstep matmul FLOPs ≤ {} × the table's, each action at its own FLOPs on one device",
    "wire_over_dropless_bound_max": "wire ≤ {} × (minimum with the routed all-to-alls n times over, plus expert ids)",
    "context_temp_growth_max": "temp growth from context 1 to the largest, the sequence growing alike, < {:.0%}",
    "temp_growth_max": "temp growth 4p→16p < {:.0%}",
    "temp_growth_min": "temp growth 4p→16p ≥ {:.0%}",
    "bubble_below": "bubble < {}'s",
}
#: clause -> `holds(record, bound, records by name)`.
HOLDS: dict[str, Callable[[dict, object, dict], bool]] = {
    "wire_over_min_max": _within("comm_wire_bytes_min"),
    "wire_over_moved_min_max": _within("comm_wire_bytes_min_moved_dtype"),
    "wire_le_baseline": lambda r, c, _: r["comm_wire_bytes_total"] <= r["comm_wire_bytes_baseline"],
    "wire_le_baseline_plus_bytes": lambda r, c, _: (
        r["comm_wire_bytes_total"] <= r["comm_wire_bytes_baseline"] + c
    ),
    "parity_max_rel_err": _at_most("parity_max_rel_err"),
    "parity_loss_max_rel_err": _at_most("parity_loss_rel_err"),
    "parity_grads_norm_max_rel_err": _at_most("parity_grads_norm_rel_err"),
    "step_ratio_max": _within("baseline_step_time_s", of="step_time_s"),
    "step_ratio_vs_handwritten_sp_max": _over("handwritten_sp"),
    "step_ratio_vs_data_parallel_max": _over("data_parallel"),
    "flops_over_reference_max": _at_most("flops_over_reference"),
    "flops_over_table_max": _at_most("flops_over_table"),
    "wire_over_dropless_bound_max": _within("comm_wire_bytes_dropless_bound"),
    "context_temp_growth_max": lambda r, c, _: _growth(r, "context_memory") < c,
    "temp_growth_max": lambda r, c, _: _growth(r, "memory_sweep") < c,
    "temp_growth_min": lambda r, c, _: _growth(r, "memory_sweep") >= c,
    "bubble_below": lambda r, c, rs: c not in rs or r["bubble_fraction"] < rs[c]["bubble_fraction"],
}
#: Clauses on step times: noisy on shared cores, left out where timing means nothing.
TIMED = {"step_ratio_max", "step_ratio_vs_handwritten_sp_max", "step_ratio_vs_data_parallel_max"}


def describe(contract: dict) -> str:
    return "; ".join(SAYS[k].format(v) for k, v in contract.items())


def broken(record: dict, records: dict[str, dict], *, timing: bool = True) -> list[str]:
    """The clauses of `record`'s contract it breaks, as text (`records`: every record by name)."""
    return [
        f"{record['strategy']}: not {SAYS[key].format(bound)}"
        for key, bound in record.get("contract", {}).items()
        if (timing or key not in TIMED) and not HOLDS[key](record, bound, records)
    ]
