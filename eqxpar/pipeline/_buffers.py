"""The engine's buffer slots: which slot of its activation, cotangent, residual
and stash buffers each action of a schedule reads and writes (`Buffers`),
allocated by interval colouring over the schedule's table.
"""

import dataclasses
from typing import Any

import numpy as np

from .._errors import PipelineScheduleError
from ._actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD
from ._placement import LANES, lane


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Slot assignment of the engine's buffers, derived from a schedule's table.

    `inputs`/`cotangents`: number of slots. `input_slot[tick, device, i]`: the
    slot of the stage input the tick's action `i` reads (0: the table's, 1: the
    fused table's second action; -1: none); `cotangent_slot`: the same for the
    cotangent; `recv_input[tick, device, lane]`: the
    slot the activation arriving along `lane` (`_placement.DOWN`: from the
    previous device, `UP`: from the next one, `LOCAL`: handed over by the
    device's own stage, as at a V's turn) at the end of that tick is written to
    (-1: none); `recv_cotangent`: the same for an arriving cotangent. A V
    placement can deliver two activations (or two cotangents) to one device in
    one tick, one along each lane. `residuals`: slots for
    the residuals a stage's forward keeps for its backward actions;
    `residual_slot[tick, device, i]`: the slot action `i` at that tick writes them
    to (`F`; a folded `I`) or reads them from (`B`, `I`, `W`), -1 for none.
    `folded[tick, device, i]`: the action is the last virtual stage's forward, or
    its backward or input half, in one tick with each other: the forward then
    runs inside the backward (nothing made in a tick is read in it), and only a
    split backward keeps residuals, from its `I` (which writes them) to its `W`.
    `stashes`: slots for what a split backward's `I` hands its `W`;
    `stash_slot[tick, device, i]`: the slot an `I` writes that to or a `W`
    reads it from, -1 for none (allocated apart from the residuals': a stash
    lives from `I` to `W` only, and a schedule may split few of its backwards).
    """

    inputs: int
    cotangents: int
    input_slot: np.ndarray
    cotangent_slot: np.ndarray
    recv_input: np.ndarray
    recv_cotangent: np.ndarray
    residuals: int = 0
    residual_slot: np.ndarray | None = None
    folded: np.ndarray | None = None
    stashes: int = 0
    stash_slot: np.ndarray | None = None


def _allocate(intervals: list[tuple[int, int, object]]) -> tuple[int, dict]:
    # Interval colouring in order of arrival: a slot is free again once its last
    # reader has run (a write lands at the end of a tick, after that tick's reads).
    slots: list[int] = []  # last-use tick per slot
    where: dict = {}
    for start, end, item in sorted(intervals, key=lambda x: (x[0], x[1])):
        for i, last in enumerate(slots):
            if last <= start:
                slots[i] = end
                where[item] = i
                break
        else:
            slots.append(end)
            where[item] = len(slots) - 1
    return len(slots), where


def allocate_buffers(schedule: Any) -> Buffers:
    """The slots of `schedule`'s buffers (a `Schedule`, which imports this module
    for its `buffers`)."""
    p, stages = schedule.stages, schedule.virtual_stages
    tick_of: dict[tuple[int, int, int], int] = {}
    # Which of its tick's actions (0: the table's, 1: the fused table's) each is.
    order_of: dict[tuple[int, int, int], int] = {}
    previous = None
    for tick, device, mb, k, kind in schedule.entries():
        tick_of[(kind, mb, k)] = tick
        order_of[(kind, mb, k)] = 1 if previous == (tick, device) else 0
        previous = (tick, device)
    backward_kinds = (BACKWARD, BACKWARD_INPUT)

    def last_use(mb: int, k: int) -> int:
        # In a forward-only table (evaluation) the forward is the input's only use.
        return max(tick_of.get((kind, mb, k), -1) for kind in (FORWARD, *backward_kinds, BACKWARD_WEIGHT))

    def cot_sent(mb: int, k: int) -> int:
        return max(tick_of.get((kind, mb, k), -1) for kind in backward_kinds)

    def folds(mb: int, k: int) -> bool:
        # The last virtual stage's forward and backward (or input half) in one tick.
        return k == stages - 1 and tick_of[(FORWARD, mb, k)] == cot_sent(mb, k)

    shape = schedule.table.shape[:2]
    input_slot, cot_slot = (np.full((*shape, 2), -1, np.int32) for _ in range(2))
    recv_input = np.full((*shape, len(LANES)), -1, np.int32)
    recv_cot = np.full((*shape, len(LANES)), -1, np.int32)
    res_slot = np.full((*shape, 2), -1, np.int32)
    stash_slot = np.full((*shape, 2), -1, np.int32)
    folded = np.zeros((*shape, 2), bool)
    n_in = n_cot = n_res = n_stash = 0

    def assign(target: np.ndarray, device: int, intervals: list, kinds: tuple[int, ...]) -> tuple[int, dict]:
        # Slots for `device`'s `intervals`, written into `target` at each of `kinds`' actions.
        count, where = _allocate(intervals)
        for (mb, k), slot in where.items():
            for kind in kinds:
                if (kind, mb, k) in tick_of:
                    target[tick_of[(kind, mb, k)], device, order_of[(kind, mb, k)]] = slot
        return count, where

    for device in range(p):
        ins, cots, res, stashes = [], [], [], []
        for mb in range(schedule.microbatches):
            for chunk in range(schedule.chunks):
                k = schedule.stage_of(device, chunk)
                if (BACKWARD_INPUT, mb, k) in tick_of:
                    stashes.append(
                        (tick_of[(BACKWARD_INPUT, mb, k)], tick_of[(BACKWARD_WEIGHT, mb, k)], (mb, k))
                    )
                if k > 0:  # virtual stage 0 computes its input from the batch
                    ins.append((tick_of[(FORWARD, mb, k - 1)], last_use(mb, k), (mb, k)))
                if cot_sent(mb, k) < 0:  # forward only: no cotangent, nothing kept
                    continue
                if k < stages - 1:  # the last stage seeds its own cotangent
                    cots.append((cot_sent(mb, k + 1), last_use(mb, k), (mb, k)))
                if not folds(mb, k):
                    res.append((tick_of[(FORWARD, mb, k)], last_use(mb, k), (mb, k)))
                    continue
                for kind in (FORWARD, BACKWARD, BACKWARD_INPUT):
                    if (kind, mb, k) in tick_of:
                        folded[tick_of[(kind, mb, k)], device, order_of[(kind, mb, k)]] = True
                if (BACKWARD_INPUT, mb, k) in tick_of:
                    res.append((tick_of[(BACKWARD_INPUT, mb, k)], last_use(mb, k), (mb, k)))

        every = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
        n_res = max(n_res, assign(res_slot, device, res, every)[0])
        n_stash = max(n_stash, assign(stash_slot, device, stashes, (BACKWARD_INPUT, BACKWARD_WEIGHT))[0])
        count, in_where = assign(input_slot, device, ins, every)
        n_in = max(n_in, count)
        for (mb, k), slot in in_where.items():
            # The activation sent at that tick by the previous stage lands here.
            _receive(recv_input, tick_of[(FORWARD, mb, k - 1)], device, k - 1, k, slot, schedule)
        count, cot_where = assign(cot_slot, device, cots, (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
        n_cot = max(n_cot, count)
        for (mb, k), slot in cot_where.items():
            _receive(recv_cot, cot_sent(mb, k + 1), device, k + 1, k, slot, schedule)
    return Buffers(
        n_in, n_cot, input_slot, cot_slot, recv_input, recv_cot, n_res, res_slot, folded, n_stash, stash_slot
    )


def _receive(
    target: np.ndarray, tick: int, device: int, source: int, k: int, slot: int, schedule: Any
) -> None:
    """Record that what virtual stage `source` sends virtual stage `k` (on
    `device`) at the end of `tick` lands in `slot`, on the lane it travels."""
    at = lane(source, k, schedule.stages, schedule.placement)
    if target[tick, device, at] >= 0:
        what = "activations" if source < k else "cotangents"
        raise PipelineScheduleError(
            f"{schedule!r}: tick {tick}, device {device}: two {what} arrive along one lane "
            f"({LANES[at]}) at the end of the tick; a device sends one value each way per tick. "
            "Put the actions that send them in different ticks."
        )
    target[tick, device, at] = slot
