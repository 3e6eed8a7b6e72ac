"""Tick placement: the table of a schedule from its per-device orders.

An action runs one tick after the later of the device's previous action and
the actions it depends on (an activation or cotangent sent at the end of tick
`t` is there at tick `t + 1`); with `fuse`, an action may join the tick of its
device's previous action when the two go opposite ways.
"""

import numpy as np

from .._errors import PipelineScheduleError
from ._actions import (
    ACTION_LETTERS,
    BACKWARD,
    BACKWARD_INPUT,
    FORWARD,
    IDLE,
    Action,
    dependencies,
    describe,
    done_key,
)
from ._placement import device_of, virtual_stage_of


def place_ticks(
    orders: list[list[Action]], p: int, stages: int, placement: str = "interleaved", *, fuse: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Tick of every action: one after the later of the device's previous action
    and its dependencies. Returns the (ticks, p, 3) table and, with `fuse`, the
    table of each tick's second action (or None): an action whose dependencies
    are met by the end of the tick before its device's previous action (or by
    that action itself) joins that tick when the two go opposite ways (a forward
    and a backward-direction action), so that one send each way still does.
    Raises `PipelineScheduleError` naming every blocked device if the orders
    deadlock."""
    done: dict[tuple[int, int, int], int] = {}
    pos = [0] * p
    free = [0] * p
    placed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    shared = [set() for _ in range(p)]  # ticks already holding two actions
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                act = orders[s][pos[s]]
                k = virtual_stage_of(s, act[2], p, placement)
                deps = dependencies(act, k, stages)
                if any(done_key(*d) not in done for d in deps):
                    break
                tick = max([free[s]] + [done[done_key(*d)] + 1 for d in deps])
                if fuse and placed[s] and tick == free[s] and tick - 1 not in shared[s]:
                    before, prev = tick - 1, placed[s][-1][1]
                    opposite = (prev[0] == FORWARD) != (act[0] == FORWARD)
                    # The last stage's backward may join its own (folded) forward;
                    # anything else must have been made before that tick.
                    own = (prev[0], prev[1], virtual_stage_of(s, prev[2], p, placement))
                    folded = k == stages - 1 and own[0] == FORWARD
                    met = all(
                        done[done_key(*d)] < before or (folded and done_key(*d) == done_key(*own))
                        for d in deps
                    )
                    if opposite and met:
                        tick = before
                        shared[s].add(tick)
                done[(act[0], act[1], k)] = tick
                if act[0] in (BACKWARD, BACKWARD_INPUT):
                    done[done_key(act[0], act[1], k)] = tick
                placed[s].append((tick, act))
                free[s] = tick + 1
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            blocked = []
            for s in range(p):
                if pos[s] == len(orders[s]):
                    continue
                kind, mb, chunk = orders[s][pos[s]]
                k = virtual_stage_of(s, chunk, p, placement)
                waits = [
                    f"{describe(*done_key(*d))} (device {device_of(d[2], p, placement)})"
                    for d in dependencies((kind, mb, chunk), k, stages)
                    if done_key(*d) not in done
                ]
                blocked.append(
                    f"device {s} at position {pos[s]} of its order, {ACTION_LETTERS[kind]}{mb}:{chunk} "
                    f"({describe(kind, mb, k)}), waits for " + " and ".join(waits)
                )
            raise PipelineScheduleError(
                "the per-device orders deadlock: no device can run its next action. "
                + "; ".join(blocked)
                + ". Reorder those devices' actions so that each runs after what it depends on "
                "(a forward after the previous stage's forward, a backward after the next stage's)."
            )
    ticks = max((t for row in placed for t, _ in row), default=-1) + 1
    table = np.full((ticks, p, 3), -1, dtype=np.int32)
    table[..., 2] = IDLE
    second = table.copy()
    for s in range(p):
        for tick, (kind, mb, chunk) in placed[s]:
            target = second if table[tick, s, 2] != IDLE else table
            target[tick, s] = (mb, chunk, kind)
    return table, (second if fuse and (second[..., 2] != IDLE).any() else None)
