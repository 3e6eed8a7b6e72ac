"""The communication report: a compiled step's collectives beside the plan's
theoretical minimum and a baseline."""

import dataclasses
from collections.abc import Callable
from typing import Any

from .._errors import EqxparError, PlanError
from .._text import fmt_int, fmt_ratio, ratio, render, short
from ._compiled import as_compiled, compiled_stage
from ._hlo import KINDS, CollectiveStats, collective_stats
from ._minimum import Minimum, minimum_comm

__all__ = ["CommReport", "Minimum", "comm_report", "minimum_comm"]


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
      bytes. Default for a step: `minimum_comm(plan, state.model, loss=<the step's
      loss function>, batch=batch)`, which covers every plan eqxpar runs (data
      parallel, FSDP, ZeRO-1, HSDP, tensor parallel, pipelines and their
      combinations); "n/a" for a bare compiled computation (no plan), or with the
      reason where `minimum_comm` cannot describe the model.
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
    try:
        low = minimum_comm(
            step._resolved.plan, args[0].model, loss=_loss_of(step), batch=args[1], trainable=step._trainable
        )
    except PlanError as e:
        # A model whose layout minimum_comm cannot describe: say why, not a number.
        note = f"n/a: {e} (or pass minimum=)"
        return CommReport(measured=measured, minimum=None, minimum_note=note, baseline=stats)
    return CommReport(measured=measured, minimum=low, minimum_note=low.note, baseline=stats)


def _loss_of(step: Any) -> Callable | None:
    """The loss function `step` differentiates (`Step.loss_fn`), or None for a
    compiled program that is not an eqxpar step."""
    return getattr(step, "loss_fn", None)
