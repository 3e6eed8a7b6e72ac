"""The communication report: a compiled step's collectives beside the plan's
theoretical minimum and a baseline."""

import dataclasses
import math
from collections import Counter
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jax.tree_util import keystr

from ._compiled import as_compiled, compiled_stage
from ._errors import EqxparError, PlanError
from ._hlo import KINDS, CollectiveStats, _ring_bytes, collective_stats
from ._plan import Plan
from ._rules import mesh_axis_names
from ._specs import is_array_like, partition_specs
from ._text import fmt_int, fmt_ratio, ratio, render, short


@dataclasses.dataclass(frozen=True)
class Minimum:
    """Collective bytes per device per step that a plan cannot do without.

    Counted as `eqxpar.inspect.collective_stats` counts them: `bytes` (result
    bytes) and `wire_bytes` (what one device sends with bandwidth-optimal rings),
    by collective kind. `by_kind=False` when only totals are known (a number the
    user gave); `note` says what was counted.

    ```python
    m = eqxpar.inspect.Minimum.total(1_000_000, wire_bytes=1_750_000, note="my count")
    m.total_bytes   # 1_000_000
    ```
    """

    bytes: dict[str, int]
    wire_bytes: dict[str, int] | None
    note: str
    by_kind: bool = True

    @classmethod
    def total(cls, result_bytes: int, *, wire_bytes: int | None = None, note: str = "given") -> "Minimum":
        """A minimum known only as totals (result bytes, optionally wire bytes)."""
        wire = None if wire_bytes is None else {"total": int(wire_bytes)}
        return cls(bytes={"total": int(result_bytes)}, wire_bytes=wire, note=note, by_kind=False)

    @property
    def total_bytes(self) -> int:
        """Result bytes of all kinds."""
        return sum(self.bytes.values())

    @property
    def total_wire_bytes(self) -> int | None:
        """Wire bytes of all kinds, or None when unknown."""
        return None if self.wire_bytes is None else sum(self.wire_bytes.values())


def _split(spec: PartitionSpec, axes: set[str], mesh_shape: dict[str, int]) -> tuple[str, ...]:
    # The axes of size > 1 in `spec` that belong to `axes`.
    return tuple(a for e in spec for a in mesh_axis_names(e) if a in axes and mesh_shape[a] > 1)


def _is_inexact(x: Any) -> bool:
    # Floating-point arrays and their eval_shape outlines: the leaves with gradients.
    return is_array_like(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def minimum_comm(plan: Any, params: Any) -> Minimum:
    """The parameter traffic a data-parallel or FSDP step must move, per device.

    Derived from the plan and the parameter shapes, not from any compiled code:

    - A parameter replicated over the data-parallel devices (the plan's
      `batch_axes`, n devices in all): its gradient is all-reduced once per step.
      Result bytes: the gradient's bytes; wire bytes `2 (n-1)/n` of them.
    - A parameter sharded over batch axes G (automatic FSDP, g devices; the other
      batch axes R, r devices): all-gathered over G for the forward and again for
      the backward (result: the full parameter, twice; wire `(g-1)/g` of it each),
      its gradient reduce-scattered once over G (result: the shard, full / g; wire
      `(g-1)` shards) and, when r > 1, the shard all-reduced over R.

    The wire bytes of each kind and group size are computed on the summed bytes,
    as for one combined collective (XLA combines them), with the rounding of
    `collective_stats`. Not counted: the step's scalar reductions (the loss and
    gradient-norm partial sums, 4 bytes each). The FSDP figure is the ZeRO-3
    schedule's, which frees the gathered weights between forward and backward; a
    compiler that keeps them alive gathers once and may move fewer gather bytes.

    **Arguments:**

    - `plan`: the `eqxpar.Plan`.
    - `params`: the model (or its `jax.eval_shape` outline); its floating-point
      arrays are the parameters (the leaves that get gradients).

    **Returns:** a `Minimum` by kind (`all-reduce`, `all-gather`, `reduce-scatter`).

    **Raises:** `PlanError` when a parameter is split over a mesh axis that is not a
    batch axis (tensor parallelism, whose activation traffic depends on the model's
    layers): pass your own count as `comm_report(..., minimum=...)` instead.

    ```python
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    m = eqxpar.inspect.minimum_comm(plan, model)
    m.bytes["all-reduce"]     # the gradient bytes
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"minimum_comm(plan={short(plan)}, ...): expected an eqxpar.Plan.")
    mesh_shape = {str(k): int(v) for k, v in plan.mesh.shape.items()}
    batch = set(plan.batch_axes)
    other = set(mesh_shape) - batch
    leaves = jax.tree_util.tree_flatten_with_path(eqx.filter(params, _is_inexact))[0]
    if not leaves:
        raise EqxparError(
            f"minimum_comm(plan, params={type(params).__name__}): params has no floating-point "
            "arrays, so nothing gets a gradient. Pass the model (or its jax.eval_shape outline)."
        )
    specs = partition_specs(params, plan)
    spec_leaves = jax.tree.structure(params).flatten_up_to(specs)
    array_specs = [s for s, x in zip(spec_leaves, jax.tree.leaves(params), strict=True) if _is_inexact(x)]
    # (kind, group size) -> summed result bytes.
    groups: Counter = Counter()
    for (path, leaf), spec in zip(leaves, array_specs, strict=True):
        beyond = _split(spec, other, mesh_shape)
        if beyond:
            raise PlanError(
                f"minimum_comm: parameter {keystr(path)} has spec {spec}, split over mesh axis "
                f"{beyond[0]!r}, which is not a batch axis {plan.batch_axes}: that is tensor "
                "(or pipeline) parallelism, whose activation traffic depends on the model's "
                "layers. eqxpar derives minima for data-parallel and FSDP layouts only; pass "
                "your own count as comm_report(..., minimum=...)."
            )
        full = math.prod(leaf.shape) * leaf.dtype.itemsize
        gathered = _split(spec, batch, mesh_shape)
        g = math.prod(mesh_shape[a] for a in gathered)
        r = math.prod(mesh_shape[a] for a in batch if a not in gathered)
        if g > 1:
            groups[("all-gather", g)] += 2 * full
            groups[("reduce-scatter", g)] += full // g
        if r > 1:
            groups[("all-reduce", r)] += full // g
    result: dict[str, int] = {}
    wire: dict[str, int] = {}
    for (kind, n), nbytes in sorted(groups.items()):
        result[kind] = result.get(kind, 0) + nbytes
        if kind == "all-gather":
            # Two gathers (forward, backward), each rounded like one instruction.
            w = 2 * _ring_bytes(kind, nbytes // 2, n)
        else:
            w = _ring_bytes(kind, nbytes, n)
        wire[kind] = wire.get(kind, 0) + w
    devices = " x ".join(f"{a}={mesh_shape[a]}" for a in plan.batch_axes if mesh_shape[a] > 1) or "1 device"
    if "all-gather" in result:
        note = f"minimum: FSDP over {devices}, params gathered fwd + bwd, grads reduce-scattered"
    else:
        note = f"minimum: data parallel over {devices}, one gradient all-reduce"
    return Minimum(bytes=result, wire_bytes=wire, note=note)


@dataclasses.dataclass(frozen=True)
class CommReport:
    """A compiled step's collectives per device, beside the plan's theoretical
    minimum and (optionally) a baseline.

    Built by `eqxpar.inspect.comm_report`. `measured` and `baseline` are
    `CollectiveStats`; `minimum` is a `Minimum` or None ("n/a", with the reason in
    `minimum_note`). Ratios are measured / reference (None where there is no
    reference); `str(report)` is a plain-text table.

    ```python
    report = eqxpar.inspect.comm_report(step, state, batch)
    report.measured.bytes["all-reduce"], report.minimum.bytes["all-reduce"]
    ```
    """

    measured: CollectiveStats
    minimum: Minimum | None
    minimum_note: str
    baseline: CollectiveStats | None = None

    @property
    def ratio_to_minimum(self) -> float | None:
        """Measured / minimum result bytes."""
        return ratio(self.measured.total_bytes, None if self.minimum is None else self.minimum.total_bytes)

    @property
    def wire_ratio_to_minimum(self) -> float | None:
        """Measured / minimum wire bytes."""
        return ratio(
            self.measured.total_wire_bytes, None if self.minimum is None else self.minimum.total_wire_bytes
        )

    @property
    def ratio_to_baseline(self) -> float | None:
        """Measured / baseline result bytes."""
        return ratio(self.measured.total_bytes, None if self.baseline is None else self.baseline.total_bytes)

    @property
    def wire_ratio_to_baseline(self) -> float | None:
        """Measured / baseline wire bytes."""
        return ratio(
            self.measured.total_wire_bytes, None if self.baseline is None else self.baseline.total_wire_bytes
        )

    def __str__(self) -> str:
        m, base, low = self.measured, self.baseline, self.minimum
        kinds = [k for k in KINDS if m.count[k] or (base is not None and base.count[k])]
        if low is not None and low.by_kind:
            kinds += [k for k in KINDS if low.bytes.get(k) and k not in kinds]
        kinds = [k for k in KINDS if k in kinds]
        header = ["kind", "count", "bytes", "wire bytes", "in loops", "min bytes", "min wire"]
        if base is not None:
            header += ["baseline count", "baseline bytes", "baseline wire"]

        def minimum_cells(kind: str | None) -> list[str]:
            if low is None:
                return ["n/a", "n/a"]
            if kind is None:
                wire = low.total_wire_bytes
                return [fmt_int(low.total_bytes), "n/a" if wire is None else fmt_int(wire)]
            if not low.by_kind:
                return ["", ""]
            assert low.wire_bytes is not None  # by-kind minima always carry both
            return [fmt_int(low.bytes.get(kind, 0)), fmt_int(low.wire_bytes.get(kind, 0))]

        rows = []
        for kind in kinds:
            row = [kind, fmt_int(m.count[kind]), fmt_int(m.bytes[kind]), fmt_int(m.wire_bytes[kind])]
            row += [fmt_int(m.in_loops[kind]), *minimum_cells(kind)]
            if base is not None:
                row += [fmt_int(base.count[kind]), fmt_int(base.bytes[kind]), fmt_int(base.wire_bytes[kind])]
            rows.append(row)
        total = ["total", fmt_int(sum(m.count.values())), fmt_int(m.total_bytes), fmt_int(m.total_wire_bytes)]
        total += [fmt_int(sum(m.in_loops.values())), *minimum_cells(None)]
        if base is not None:
            total += [
                fmt_int(sum(base.count.values())),
                fmt_int(base.total_bytes),
                fmt_int(base.total_wire_bytes),
            ]
        rows.append(total)
        lines = [
            "collectives per device per step",
            render(header, rows, right=[False] + [True] * (len(header) - 1)),
            f"measured / minimum: {fmt_ratio(self.ratio_to_minimum)} bytes, "
            f"{fmt_ratio(self.wire_ratio_to_minimum)} wire bytes ({self.minimum_note})",
        ]
        if base is not None:
            lines.append(
                f"measured / baseline: {fmt_ratio(self.ratio_to_baseline)} bytes, "
                f"{fmt_ratio(self.wire_ratio_to_baseline)} wire bytes"
            )
        return "\n".join(lines)


def _as_minimum(minimum: Any) -> Minimum:
    if isinstance(minimum, Minimum):
        return minimum
    if isinstance(minimum, int) and not isinstance(minimum, bool) and minimum >= 0:
        return Minimum.total(minimum, note="given: result bytes")
    raise EqxparError(
        f"comm_report(..., minimum={short(minimum)}): expected a Minimum (from "
        "eqxpar.inspect.minimum_comm or Minimum.total(...)) or a non-negative int of "
        "result bytes. Pass one of those, or None to derive it from the plan."
    )


def _as_stats(baseline: Any) -> CollectiveStats:
    if isinstance(baseline, CollectiveStats):
        return baseline
    compiled = compiled_stage(baseline)
    if compiled is not None:
        return collective_stats(compiled)
    raise EqxparError(
        f"comm_report(..., baseline={short(baseline)}): expected a jax.stages.Compiled "
        "(e.g. the plain jax.jit step's .lower(...).compile(), or an eqx.filter_jit "
        "one's), its Lowered, or a CollectiveStats. Pass one of those, or None for no baseline."
    )


def comm_report(step_or_compiled: Any, *args: Any, minimum: Any = None, baseline: Any = None) -> CommReport:
    """Count a compiled step's collectives and compare them with the minimum.

    Reads the compiled HLO with `collective_stats` (count, result bytes, wire
    bytes and in-loop count, by kind, per device per step).

    **Arguments:**

    - `step_or_compiled`: an eqxpar `Step` followed by its `(state, batch)` (it is
      compiled for them; nothing runs), or a compiled or lowered computation with
      no further arguments: `jax.jit(f).lower(...)` or `eqx.filter_jit(f).lower(...)`,
      with or without `.compile()`.
    - `minimum`: the reference to compare with: a `Minimum`, or an int of result
      bytes. Default: `minimum_comm(plan, state.model)` for a step whose plan it
      covers (data parallel, FSDP), else "n/a".
    - `baseline`: another implementation to compare with (e.g. GSPMD on the same
      workload): a compiled or lowered computation (as above) or a `CollectiveStats`.

    **Returns:** a `CommReport`; `str(report)` is a table with ratios.

    **Raises:** `EqxparError` for an argument of the wrong kind or number.

    ```python
    report = eqxpar.inspect.comm_report(step, state, batch)
    print(report)
    report.ratio_to_minimum      # 1.0 for an ideal data-parallel step
    ```
    """
    compiled, step = as_compiled(step_or_compiled, args, where="comm_report")
    measured = collective_stats(compiled)
    stats = None if baseline is None else _as_stats(baseline)
    if minimum is not None:
        low = _as_minimum(minimum)
        return CommReport(measured=measured, minimum=low, minimum_note=low.note, baseline=stats)
    if step is None:
        note = "n/a: no plan for a bare Compiled; pass minimum="
        return CommReport(measured=measured, minimum=None, minimum_note=note, baseline=stats)
    # The step's own plan (a Step does not expose it publicly; same package).
    plan = step._plan
    try:
        low = minimum_comm(plan, args[0].model)
    except PlanError:
        # The only plans minimum_comm rejects split parameters over non-batch axes.
        note = "n/a: parameters split over a non-batch axis (tensor/pipeline parallel); pass minimum="
        return CommReport(measured=measured, minimum=None, minimum_note=note, baseline=stats)
    return CommReport(measured=measured, minimum=low, minimum_note=low.note, baseline=stats)
