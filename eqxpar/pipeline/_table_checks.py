"""The checks of a schedule's table, and the parsing of per-device orders into
actions: what `validate` and `Schedule.from_table` / `Schedule.from_orders`
raise `PipelineScheduleError` for, naming the tick and device and the fix.
"""

from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import PipelineScheduleError
from ._actions import (
    ACTION_NAMES,
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    IDLE,
    Action,
    dependencies,
    describe,
    done_key,
)
from ._placement import PLACEMENTS, device_of


def check_counts(where: str, stages: Any, microbatches: Any, chunks: Any, placement: Any) -> None:
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise PipelineScheduleError(f"{where}({what}={value!r}): expected a positive integer.")
    if placement not in PLACEMENTS:
        raise PipelineScheduleError(
            f"{where}(placement={placement!r}): expected one of {PLACEMENTS} ('interleaved': virtual "
            "stage chunk * stages + device; 'v': device d holds stages d and 2p-1-d)."
        )


_LETTER_CODES = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}


def as_orders(orders: Sequence, where: str) -> list[Sequence]:
    out = []
    for device, order in enumerate(orders):
        if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
            raise PipelineScheduleError(
                f"{where}: the order of device {device} is {order!r}; expected a sequence of actions "
                'such as ["F0", "F1", "B0", "B1"].'
            )
        out.append(order)
    return out


def parse_action(action: Any, device: int, i: int, m: int, v: int, where: str) -> Action:
    """(kind, micro-batch, chunk) of one action of an order, checked."""
    at = f"{where}: device {device}, position {i} of its order"
    fix = 'expected "F3", "B3", "I3", "W3" (":1" for chunk 1) or a tuple (letter or code 1-4, micro-batch[, chunk])'
    if isinstance(action, str):
        letter, rest = action.strip()[:1], action.strip()[1:]
        mb_text, _, chunk_text = rest.partition(":")
        try:
            parts: tuple = (letter, int(mb_text), int(chunk_text) if chunk_text else 0)
        except ValueError:
            raise PipelineScheduleError(f"{at}: action {action!r}; {fix}.") from None
    elif isinstance(action, (tuple, list)) and len(action) in (2, 3):
        parts = (action[0], action[1], action[2] if len(action) == 3 else 0)
    else:
        raise PipelineScheduleError(f"{at}: action {action!r}; {fix}.")
    kind, mb, chunk = parts
    if isinstance(kind, str):
        if kind.upper() not in _LETTER_CODES:
            raise PipelineScheduleError(f"{at}: action {action!r} has kind {kind!r}; {fix}.")
        kind = _LETTER_CODES[kind.upper()]
    if (
        not isinstance(kind, (int, np.integer))
        or isinstance(kind, bool)
        or not FORWARD <= kind <= BACKWARD_WEIGHT
    ):
        raise PipelineScheduleError(f"{at}: action {action!r} has kind {kind!r}; {fix}.")
    for what, value, count in (("micro-batch", mb, m), ("chunk", chunk, v)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or not 0 <= value < count:
            raise PipelineScheduleError(
                f"{at}: action {action!r} has {what} {value!r}; expected 0 to {count - 1} "
                f"(the schedule has {count} {what}{'es' if what == 'micro-batch' else 's'})."
            )
    return int(kind), int(mb), int(chunk)


def check_units(
    units: list[tuple[str, int, int, int]], p: int, m: int, v: int, placement: str, where: str
) -> None:
    """Every (micro-batch, virtual stage) has one forward and either one backward or
    one backward-input and one backward-weight. `units`: (location, mb, k, kind)."""
    seen: dict[tuple[int, int, int], str] = {}
    for at, mb, k, kind in units:
        if (kind, mb, k) in seen:
            raise PipelineScheduleError(
                f"{where}: {at}: {describe(kind, mb, k)} runs twice (first at {seen[(kind, mb, k)]}). "
                "Remove one of them."
            )
        seen[(kind, mb, k)] = at
    for mb in range(m):
        for k in range(p * v):
            kinds = {kind for kind in range(1, 5) if (kind, mb, k) in seen}
            if kinds in ({FORWARD, BACKWARD}, {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}):
                continue
            device = device_of(k, p, placement)
            have = sorted(ACTION_NAMES[x] for x in kinds) or "nothing"
            if FORWARD not in kinds:
                missing = "its forward"
            elif BACKWARD in kinds and kinds & {BACKWARD_INPUT, BACKWARD_WEIGHT}:
                missing = "one backward: either backward or backward-input + backward-weight, not both"
            elif BACKWARD_INPUT in kinds:
                missing = "its backward-weight"
            elif BACKWARD_WEIGHT in kinds:
                missing = "its backward-input"
            else:
                missing = "a backward (or backward-input and backward-weight)"
            raise PipelineScheduleError(
                f"{where}: micro-batch {mb} at virtual stage {k} (device {device}, chunk "
                f"{k // p}) has {have}; it needs {missing}. Every "
                "(micro-batch, virtual stage) needs a forward and either a backward or a "
                f"backward-input and a backward-weight, on device {device}."
            )


def _check_cells(table: np.ndarray, m: int, v: int, where: str) -> None:
    """Action codes 0-4, and micro-batch and chunk in range where not idle."""
    for tick, device in zip(
        *np.nonzero((table[..., 2] < IDLE) | (table[..., 2] > BACKWARD_WEIGHT)), strict=True
    ):
        raise PipelineScheduleError(
            f"{where}: tick {tick}, device {device}: action code {table[tick, device, 2]}; expected 0 "
            "(idle), 1 (forward), 2 (backward), 3 (backward-input) or 4 (backward-weight)."
        )
    busy = table[..., 2] != IDLE
    for column, count, what in ((0, m, "micro-batch"), (1, v, "chunk")):
        bad = busy & ((table[..., column] < 0) | (table[..., column] >= count))
        for tick, device in zip(*np.nonzero(bad), strict=True):
            raise PipelineScheduleError(
                f"{where}: tick {tick}, device {device}: {ACTION_NAMES[table[tick, device, 2]]} of "
                f"{what} {table[tick, device, column]}; expected 0 to {count - 1} (the schedule "
                f"has {count})."
            )


def check_schedule(schedule: Any) -> None:
    """Raise `PipelineScheduleError` unless the table of `schedule` (a `Schedule`,
    which imports this module) is runnable: every check of `validate`, which
    first checks the type."""
    where = repr(schedule) if isinstance(getattr(schedule, "table", None), np.ndarray) else "schedule"
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    check_counts("Schedule", p, m, v, schedule.placement)
    table = schedule.table
    if (
        not isinstance(table, np.ndarray)
        or not np.issubdtype(table.dtype, np.integer)
        or table.ndim != 3
        or table.shape[1:] != (p, 3)
    ):
        shape = getattr(table, "shape", None)
        raise PipelineScheduleError(
            f"{where}: the table has shape {shape} and dtype {getattr(table, 'dtype', type(table))}; "
            f"expected an integer array of shape (ticks, {p}, 3)."
        )
    fused = schedule.fused
    if fused is not None and (
        not isinstance(fused, np.ndarray)
        or not np.issubdtype(fused.dtype, np.integer)
        or fused.shape != table.shape
    ):
        raise PipelineScheduleError(
            f"{where}: the fused table has shape {getattr(fused, 'shape', None)}; expected an integer "
            f"array of the table's shape {table.shape} (each tick's second action), or None."
        )
    for name, cells in (("table", table), ("fused table", fused)):
        if cells is None:
            continue
        _check_cells(cells, m, v, where if name == "table" else f"{where} ({name})")
    if fused is not None:
        for tick, device in zip(*np.nonzero(fused[..., 2] != IDLE), strict=True):
            first, second = int(table[tick, device, 2]), int(fused[tick, device, 2])
            if first == IDLE or (first == FORWARD) == (second == FORWARD):
                raise PipelineScheduleError(
                    f"{where}: tick {tick}, device {device}: the fused table holds "
                    f"{ACTION_NAMES[second]} beside {ACTION_NAMES[first]}; a tick's second action "
                    "must pair with a first one going the other way (a forward with a backward, "
                    "backward-input or backward-weight), so that one send each way carries both. "
                    "Put it in a tick of its own."
                )
    entries = schedule.entries()
    check_units(
        [(f"tick {tick}, device {device}", mb, k, kind) for tick, device, mb, k, kind in entries],
        p,
        m,
        v,
        schedule.placement,
        where,
    )
    at: dict[tuple[int, int, int], tuple[int, int, int]] = {}
    for order, (tick, device, mb, k, kind) in enumerate(entries):
        at[(kind, mb, k)] = (tick, device, order)
        if kind in (BACKWARD, BACKWARD_INPUT):
            at[done_key(kind, mb, k)] = (tick, device, order)
    for order, (tick, device, mb, k, kind) in enumerate(entries):
        for dep in dependencies((kind, mb, 0), k, p * v):
            dep_tick, dep_device, dep_order = at[done_key(*dep)]
            # In a fused tick the last stage's backward may follow its own forward
            # (folded into it): nothing else made in a tick is usable before the next.
            own = (
                dep_tick == tick
                and dep_device == device
                and dep_order < order
                and dep[0] == FORWARD
                and k == p * v - 1
            )
            if dep_tick >= tick and not own:
                same = " (its output is usable from the next tick)" if dep_tick == tick else ""
                raise PipelineScheduleError(
                    f"{where}: tick {tick}, device {device}: {describe(kind, mb, k)} runs before what "
                    f"it depends on: {describe(*done_key(*dep))}, at tick {dep_tick} on device "
                    f"{dep_device}{same}. Move it to tick {dep_tick + 1} or later, or that one earlier."
                )
