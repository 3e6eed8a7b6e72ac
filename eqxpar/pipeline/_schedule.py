"""Pipeline schedules as data: a table (tick, device) -> (micro-batch, chunk, action).

A schedule is built from one *order* per device (the sequence of actions that
device runs). The ticks follow from the orders: an action runs one tick after the
later of the device's previous action and the actions it depends on (an activation
or cotangent sent at the end of tick `t` is there at tick `t + 1`). From the table
come the bubble fractions, the buffer sizes the engine allocates, a text rendering
and (in `_picture.py`) a picture.

Layout of virtual stages: with `p` devices and `v` chunks per device there are
`S = p * v` virtual stages. Placement `"interleaved"` (the engine's): virtual
stage `k` runs on device `k % p` as its chunk `k // p` (Megatron's layout: an
activation always moves to the next device, wrapping from the last device to the
first for the next chunk). Placement `"v"` (ZB-V, DualPipeV): chunk `c` of
device `d` is virtual stage `c * p + d` for even `c` and `c * p + p - 1 - d` for
odd `c`, so with two chunks device `d` holds stages `d` and `2p - 1 - d` and the
activations go down the devices and back up. V tables are for prediction
(`simulate`, bubble fractions); the engine runs the interleaved placement only.
"""

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._errors import PipelineScheduleError, PlanError
from .._plan import PIPELINE_SCHEDULES, PREDICTION_SCHEDULES

#: Action codes in `Schedule.table[..., 2]`.
IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = 0, 1, 2, 3, 4
ACTION_NAMES = ("idle", "forward", "backward", "backward-input", "backward-weight")
#: One-letter names used by the text rendering and the picture.
ACTION_LETTERS = (".", "F", "B", "I", "W")
#: The cost model of the bubble fractions: a backward pass costs two forwards; its
#: halves (input gradient, weight gradient) one each.
COSTS = (0, 1, 2, 1, 1)

Action = tuple[int, int, int]  # (action, micro-batch, chunk)

#: Where virtual stages live (see the module docstring).
PLACEMENTS = ("interleaved", "v")


def _stage_of(device: int, chunk: int, p: int, placement: str) -> int:
    """Virtual stage of `chunk` on `device`."""
    if placement == "v" and chunk % 2:
        return chunk * p + p - 1 - device
    return chunk * p + device


def _device_of(k: int, p: int, placement: str) -> int:
    """Device that runs virtual stage `k`."""
    chunk, r = divmod(k, p)
    return p - 1 - r if placement == "v" and chunk % 2 else r


def _orders_gpipe(p: int, m: int) -> list[list[Action]]:
    return [[(FORWARD, j, 0) for j in range(m)] + [(BACKWARD, j, 0) for j in range(m)] for _ in range(p)]


def _orders_1f1b_fused(p: int, m: int) -> list[list[Action]]:
    # 1F1B for fused ticks: device s warms up with 2 (p - 1 - s) forwards, then
    # alternates, each forward sharing a tick with a backward. A tick's backward
    # on device s then meets the next device's from the tick before, so in the
    # steady state every device runs one forward and one backward per tick.
    orders = []
    for s in range(p):
        warmup = min(2 * (p - 1 - s), m)
        order = [(FORWARD, j, 0) for j in range(warmup)]
        for i in range(m - warmup):
            order += [(FORWARD, warmup + i, 0), (BACKWARD, i, 0)]
        order += [(BACKWARD, j, 0) for j in range(m - warmup, m)]
        orders.append(order)
    return orders


def _orders_interleaved(p: int, m: int, v: int) -> list[list[Action]]:
    # Megatron-LM's interleaved 1F1B: forwards go p micro-batches at a time through
    # chunk 0, then the same p through chunk 1, ...; backwards in the same groups
    # from the last chunk down. Device s warms up with enough forwards to fill the
    # pipeline ahead of it, then alternates one forward and one backward.
    total = m * v

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return mb, (v - 1 - chunk if backward else chunk)

    orders = []
    for s in range(p):
        warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
        order: list[Action] = [(FORWARD, *unit(k, False)) for k in range(warmup)]
        for i in range(total - warmup):
            order += [(FORWARD, *unit(warmup + i, False)), (BACKWARD, *unit(i, True))]
        order += [(BACKWARD, *unit(k, True)) for k in range(total - warmup, total)]
        orders.append(order)
    # The last device runs the last virtual stage (and the model's head, in the
    # engine) fused with its forward in ticks where every other device runs a
    # forward and a backward: that tick lasts a head longer. Its last p - 1 such
    # backwards are split instead: the input half beside the forward (cheaper than
    # the others' pair), the weight half in the p - 1 ticks the device idles at
    # the end while the cotangents reach device 0 (cheaper than their backwards).
    # The weight halves keep their residuals and cotangent that long: p - 1 slots.
    last, split = orders[p - 1], set()
    for i in range(len(last) - 1, -1, -1):
        kind, mb, chunk = last[i]
        if kind == BACKWARD and chunk == v - 1 and len(split) < p - 1:
            last[i] = (BACKWARD_INPUT, mb, chunk)
            split.add(mb)
    last += [(BACKWARD_WEIGHT, mb, v - 1) for mb in sorted(split)]
    return orders


def _orders_zero_bubble(p: int, m: int) -> list[list[Action]]:
    # ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): the backward pass is
    # split into an input-gradient pass (I), which the previous stage waits for,
    # and a weight-gradient pass (W), which nobody waits for. A greedy list
    # schedule in unit ticks: each device runs, by priority, an I that is ready;
    # the oldest pending W once p - 1 of them wait; a forward while fewer than
    # 1F1B's p - s micro-batches wait for their I; else a pending W. Deferred W's
    # fill what would be 1F1B's bubble: with unit costs the bubble is
    # (p - 1) / (3m + p - 1), a third of 1F1B's, and a device holds at most
    # 2p - 1 stage inputs (a number set by the stages, not the micro-batches).
    next_f = [0] * p
    f_done: list[dict[int, int]] = [{} for _ in range(p)]  # mb -> tick
    i_done: list[dict[int, int]] = [{} for _ in range(p)]
    w_done = [0] * p
    pending_w: list[list[int]] = [[] for _ in range(p)]
    orders: list[list[Action]] = [[] for _ in range(p)]
    tick = 0
    while any(w < m for w in w_done):
        chosen: list[Action | None] = []
        for s in range(p):
            ready_i = [
                j
                for j in f_done[s]
                if j not in i_done[s]
                and f_done[s][j] < tick
                and (s == p - 1 or i_done[s + 1].get(j, tick) < tick)
            ]
            j = next_f[s]
            can_forward = (
                j < m
                and len(f_done[s]) - len(i_done[s]) < p - s
                and (s == 0 or f_done[s - 1].get(j, tick) < tick)
            )
            if ready_i:
                chosen.append((BACKWARD_INPUT, min(ready_i), 0))
            elif len(pending_w[s]) > p - 1:
                chosen.append((BACKWARD_WEIGHT, pending_w[s][0], 0))
            elif can_forward:
                chosen.append((FORWARD, j, 0))
            elif pending_w[s]:
                chosen.append((BACKWARD_WEIGHT, pending_w[s][0], 0))
            else:
                chosen.append(None)
        for s, act in enumerate(chosen):
            if act is None:
                continue
            kind, j, _ = act
            if kind == FORWARD:
                f_done[s][j] = tick
                next_f[s] += 1
            elif kind == BACKWARD_INPUT:
                i_done[s][j] = tick
                pending_w[s].append(j)
            else:
                pending_w[s].pop(0)
                w_done[s] += 1
            orders[s].append(act)
        tick += 1
    return orders


def _orders_zb_v(p: int, m: int) -> list[list[Action]]:
    # ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", sec. 6): two chunks per
    # device in a V (device d runs virtual stages d and 2p-1-d), the backward split
    # into I and W. A greedy list schedule in unit ticks over the 2p virtual
    # stages: each device runs, by priority, a ready I (oldest micro-batch, later
    # stage first, so cotangents flow back at once); a W once 2p - 1 of them wait;
    # a ready forward (later stage first) while fewer than 2p chunk activations
    # (1F1B's peak of p whole stages) wait for their W; else the oldest pending W.
    # The first and last stage share device 0, so backward passes start early on
    # every device and memory evens out across them. Under unit costs the table
    # reaches the floor (p - 1) / (6m + p - 1): the last device's wait for its
    # first input, p - 1 chunk forwards, is the only idle time no table can fill.
    return _greedy_split(p, m, chunks=2, placement="v", memory=2 * p)


def _greedy_split(p: int, m: int, *, chunks: int, placement: str, memory: int) -> list[list[Action]]:
    stages = p * chunks
    f_tick: dict[tuple[int, int], int] = {}  # (mb, k) -> tick of its forward
    i_tick: dict[tuple[int, int], int] = {}  # (mb, k) -> tick of its backward-input
    # A stage's forwards (and input passes) become ready in micro-batch order, as
    # the previous (next) stage's run in that order: only the oldest is a candidate.
    next_f, next_i = [0] * stages, [0] * stages
    held = [0] * p  # chunk activations forwarded and not yet weight-gradient'ed
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]  # (mb, chunk)
    orders: list[list[Action]] = [[] for _ in range(p)]
    left = 3 * m * stages
    tick = 0
    while left:
        chosen: list[Action | None] = []
        for d in range(p):
            inputs, forwards = [], []
            for c in range(chunks):
                k = _stage_of(d, c, p, placement)
                j = next_i[k]
                if (
                    j < m
                    and f_tick.get((j, k), tick) < tick
                    and (k == stages - 1 or i_tick.get((j, k + 1), tick) < tick)
                ):
                    inputs.append((j, -k, c))
                j = next_f[k]
                if j < m and (k == 0 or f_tick.get((j, k - 1), tick) < tick):
                    forwards.append((j, -k, c))
            if inputs:
                j, _, c = min(inputs)
                chosen.append((BACKWARD_INPUT, j, c))
            elif len(pending_w[d]) > stages - 2 and pending_w[d]:
                chosen.append((BACKWARD_WEIGHT, *pending_w[d][0]))
            elif forwards and held[d] < memory:
                j, _, c = min(forwards)
                chosen.append((FORWARD, j, c))
            elif pending_w[d]:
                chosen.append((BACKWARD_WEIGHT, *pending_w[d][0]))
            else:
                chosen.append(None)
        for d, act in enumerate(chosen):
            if act is None:
                continue
            kind, j, c = act
            k = _stage_of(d, c, p, placement)
            if kind == FORWARD:
                f_tick[(j, k)] = tick
                next_f[k] += 1
                held[d] += 1
            elif kind == BACKWARD_INPUT:
                i_tick[(j, k)] = tick
                next_i[k] += 1
                pending_w[d].append((j, c))
            else:
                pending_w[d].pop(0)
                held[d] -= 1
            orders[d].append(act)
            left -= 1
        tick += 1
    return orders


def _orders_dualpipe_v(p: int, m: int) -> list[list[Action]]:
    # DualPipeV (DeepSeek's DualPipe cut in half: deepseek-ai/DualPipe, dualpipev.py),
    # its eight steps per rank d, with chunk 0 = virtual stage d and chunk 1 =
    # stage 2p-1-d. Forwards and backwards of each chunk take micro-batches in
    # order; a zero-bubble backward (I) queues its W, which a later "weight"
    # step pops (FIFO). Where DualPipe overlaps a forward of one chunk with a
    # backward of the other (computation of one hiding the other's
    # communication), a table runs them in successive ticks.
    return [_dualpipe_v_order(p, m, d) for d in range(p)]


def _dualpipe_v_order(p: int, m: int, d: int) -> list[Action]:
    # Rank d's order (see _orders_dualpipe_v).
    order: list[Action] = []
    next_f, next_b = [0, 0], [0, 0]
    queue: list[tuple[int, int]] = []

    def f(c: int) -> None:
        order.append((FORWARD, next_f[c], c))
        next_f[c] += 1

    def b(c: int, zero_bubble: bool = False) -> None:
        if zero_bubble:
            order.append((BACKWARD_INPUT, next_b[c], c))
            queue.append((next_b[c], c))
        else:
            order.append((BACKWARD, next_b[c], c))
        next_b[c] += 1

    def w() -> None:
        order.append((BACKWARD_WEIGHT, *queue.pop(0)))

    for _ in range(2 * (p - d - 1)):  # 1: forwards of chunk 0
        f(0)
    for _ in range(d + 1):  # 2: both chunks' forwards
        f(0)
        f(1)
    for _ in range(p - d - 1):  # 3: zero-bubble backward of chunk 1, its W, a forward
        b(1, True)
        w()
        f(1)
    for _ in range(m - 2 * p + d + 1):  # 4: the steady state, F0 B1 F1 B0
        f(0)
        b(1)
        f(1)
        b(0)
    for _ in range(p - d - 1):  # 5: B1 F1 B0
        b(1)
        f(1)
        b(0)
    zero_bubble = False
    for i in range(d + 1):  # 6: both backwards; the second half zero-bubble
        if i == (d + 1) // 2 and d % 2 == 1:
            zero_bubble = True
        b(1, zero_bubble)
        if i == (d + 1) // 2 and d % 2 == 0:
            zero_bubble = True
        b(0, zero_bubble)
    for _ in range(p - d - 1):  # 7: a W, a zero-bubble backward of chunk 0
        w()
        b(0, True)
    while queue:  # 8: the remaining W's
        w()
    return order


def _dependencies(action: Action, k: int, stages: int) -> list[tuple[int, int, int]]:
    """(action kinds, micro-batch, virtual stage) an action waits for, as
    (kind, mb, stage) with kind -1 meaning "B or I"."""
    kind, mb, _ = action
    if kind == FORWARD:
        return [(FORWARD, mb, k - 1)] if k > 0 else []
    if kind in (BACKWARD, BACKWARD_INPUT):
        deps = [(FORWARD, mb, k)]
        if k < stages - 1:
            deps.append((-1, mb, k + 1))
        return deps
    if kind == BACKWARD_WEIGHT:
        return [(BACKWARD_INPUT, mb, k)]
    return []


def _key(kind: int, mb: int, k: int) -> tuple[int, int, int]:
    # B and I both produce the cotangent the previous stage waits for.
    return (-1 if kind in (BACKWARD, BACKWARD_INPUT) else kind, mb, k)


def _describe(kind: int, mb: int, k: int) -> str:
    if kind == -1:
        return f"the backward (or backward-input) of micro-batch {mb} at virtual stage {k}"
    return f"the {ACTION_NAMES[kind]} of micro-batch {mb} at virtual stage {k}"


def _place(
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
                k = _stage_of(s, act[2], p, placement)
                deps = _dependencies(act, k, stages)
                if any(_key(*d) not in done for d in deps):
                    break
                tick = max([free[s]] + [done[_key(*d)] + 1 for d in deps])
                if fuse and placed[s] and tick == free[s] and tick - 1 not in shared[s]:
                    before, prev = tick - 1, placed[s][-1][1]
                    opposite = (prev[0] == FORWARD) != (act[0] == FORWARD)
                    # The last stage's backward may join its own (folded) forward;
                    # anything else must have been made before that tick.
                    own = (prev[0], prev[1], _stage_of(s, prev[2], p, placement))
                    folded = k == stages - 1 and own[0] == FORWARD
                    met = all(done[_key(*d)] < before or (folded and _key(*d) == _key(*own)) for d in deps)
                    if opposite and met:
                        tick = before
                        shared[s].add(tick)
                done[(act[0], act[1], k)] = tick
                if act[0] in (BACKWARD, BACKWARD_INPUT):
                    done[_key(act[0], act[1], k)] = tick
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
                k = _stage_of(s, chunk, p, placement)
                waits = [
                    f"{_describe(*_key(*d))} (device {_device_of(d[2], p, placement)})"
                    for d in _dependencies((kind, mb, chunk), k, stages)
                    if _key(*d) not in done
                ]
                blocked.append(
                    f"device {s} at position {pos[s]} of its order, {ACTION_LETTERS[kind]}{mb}:{chunk} "
                    f"({_describe(kind, mb, k)}), waits for " + " and ".join(waits)
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


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: what every device does at every tick.

    Built by `eqxpar.pipeline.schedule`, or from a user's table or per-device
    orders by `Schedule.from_table` / `Schedule.from_orders` (validated there).
    The engine (`Plan(schedule=...)`, a name or a `Schedule` object) runs one
    tick per step of a `lax.scan`, every device following its column.

    **Attributes:**

    - `name`, `stages` (devices along `pipe`), `microbatches`, `chunks` (virtual
      stages per device).
    - `table`: int32 numpy array `(ticks, stages, 3)`: `[tick, device] = (micro-batch,
      chunk, action)`, action codes `0` idle, `1` forward, `2` backward, `3`
      backward-input, `4` backward-weight (`ACTION_NAMES`); micro-batch and chunk
      are -1 where idle.
    - `placement`: `"interleaved"` (virtual stage `chunk * stages + device`: the
      engine's) or `"v"` (with two chunks, device `d` holds stages `d` and
      `2 * stages - 1 - d`: ZB-V, DualPipeV; for prediction only). See
      `stage_of`.
    - `fused`: None, or a second table of the same shape: the action each device
      runs in a tick after `table`'s (idle where none). A fused tick pairs a
      forward with a backward-direction action (one send each way per tick
      still does), so that in one SPMD program the devices of a tick run work of
      the same cost: `"1f1b"` and `"interleaved"` are built so (in their steady
      state every device runs one forward and one backward per tick).
    - `bubble_fraction`: the idle share of the devices' time when each runs its
      actions in table order as soon as their inputs are there, under the cost
      model forward = 1, backward = 2, backward-input = 1, backward-weight = 1
      (`COSTS`; `eqxpar.pipeline.simulate` takes measured times instead).
    - `lockstep_bubble_fraction`: the same in one SPMD program, where all devices
      run each tick together, so a tick takes as long as the costliest action any
      device runs in it.
    - `in_flight`: the most stage inputs (activations received from the previous
      stage and kept until their backward pass) any device holds at once: the
      length of the engine's activation buffer. `cotangent_slots`: the same for
      received cotangents.

    `str(schedule)` renders the table as text, one row per device (`F3` forward of
    micro-batch 3, `B` backward, `I` backward-input, `W` backward-weight, `.` idle;
    with chunks, `F3:1` is chunk 1).

    ```python
    s = eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=8)
    print(s)                         # the table
    s.bubble_fraction                # 3 / 11
    ```
    """

    name: str
    stages: int
    microbatches: int
    chunks: int
    table: np.ndarray
    placement: str = "interleaved"
    fused: np.ndarray | None = None

    @classmethod
    def from_table(
        cls,
        # `Any` for the arguments validated below (PipelineScheduleError names them).
        table: Any,
        *,
        stages: Any,
        microbatches: Any,
        chunks: Any = 1,
        name: str = "custom",
        placement: Any = "interleaved",
    ) -> "Schedule":
        """A schedule from a hand-written table, validated (see `validate`).

        **Arguments:**

        - `table`: integers of shape `(ticks, stages, 3)`: `[tick, device] =
          (micro-batch, chunk, action)` with action codes `0` idle, `1` forward,
          `2` backward, `3` backward-input, `4` backward-weight. Micro-batch and
          chunk of idle cells are ignored (stored as -1). An activation or
          cotangent sent at the end of tick `t` is usable from tick `t + 1`.
        - `stages`, `microbatches`, `chunks`: the counts the table is for.
        - `name`: shown by `str()` and in errors.
        - `placement`: `"interleaved"` (the engine's) or `"v"` (prediction only).

        **Returns:** a read-only `Schedule`, accepted by `Plan(schedule=...)` when
        its placement is `"interleaved"` and its stages equal the `pipe` size.

        **Raises:** `PipelineScheduleError` naming the tick and device of the first
        problem.

        ```python
        F, B = 1, 2
        t = [[(0, 0, F), (-1, -1, 0)],      # tick 0: device 0 forwards mb 0
             [(1, 0, F), (0, 0, F)],        # tick 1
             [(-1, -1, 0), (0, 0, B)],      # tick 2: the last stage's backward
             [(0, 0, B), (1, 0, F)],
             [(-1, -1, 0), (1, 0, B)],
             [(1, 0, B), (-1, -1, 0)]]
        s = eqxpar.pipeline.Schedule.from_table(t, stages=2, microbatches=2)
        ```
        """
        _check_counts("Schedule.from_table", stages, microbatches, chunks, placement)
        stages, microbatches, chunks = int(stages), int(microbatches), int(chunks)
        where = f"Schedule.from_table(name={name!r})"
        try:
            array = np.asarray(table)
        except (TypeError, ValueError) as err:
            raise PipelineScheduleError(
                f"{where}: the table is not a rectangular array of integers ({err}). Give an int "
                f"array of shape (ticks, {stages}, 3)."
            ) from None
        if not np.issubdtype(array.dtype, np.integer):
            raise PipelineScheduleError(
                f"{where}: the table has dtype {array.dtype}; expected integers (micro-batch, chunk, "
                "action code). Build it with np.asarray(..., dtype=np.int32)."
            )
        if array.ndim != 3 or array.shape[1:] != (stages, 3) or array.shape[0] == 0:
            raise PipelineScheduleError(
                f"{where}: the table has shape {array.shape}; expected (ticks, {stages}, 3) with at "
                "least one tick: [tick, device] = (micro-batch, chunk, action)."
            )
        array = array.astype(np.int32)
        idle = array[..., 2] == IDLE
        array[idle, 0] = -1
        array[idle, 1] = -1
        array.setflags(write=False)
        out = cls(name, stages, microbatches, chunks, array, placement)
        validate(out)
        return out

    @classmethod
    def from_orders(
        cls,
        # `Any` for the arguments validated below (PipelineScheduleError names them).
        orders: Any,
        *,
        microbatches: Any,
        chunks: Any = 1,
        name: str = "custom",
        placement: Any = "interleaved",
    ) -> "Schedule":
        """A schedule from the order in which each device runs its actions.

        Each action is placed one tick after the later of the device's previous
        action and the actions it depends on (as the built-in schedules are).

        **Arguments:**

        - `orders`: one sequence per device (so `stages = len(orders)`) of actions,
          each a string `"F3"` (forward of micro-batch 3), `"B3"`, `"I3"`, `"W3"`,
          with `":1"` for chunk 1 (`"F3:1"`), or a tuple `(letter or action code,
          micro-batch)` or `(letter or code, micro-batch, chunk)`.
        - `microbatches`, `chunks`, `name`, `placement`: as for `from_table`.

        **Returns:** a validated `Schedule`.

        **Raises:** `PipelineScheduleError` for a malformed action (naming device
        and position), an action twice or missing, or orders that deadlock
        (naming each device and the action it is blocked on).

        ```python
        s = eqxpar.pipeline.Schedule.from_orders(
            [["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], microbatches=2)
        ```
        """
        where = f"Schedule.from_orders(name={name!r})"
        if isinstance(orders, (str, bytes)) or not isinstance(orders, Sequence) or not orders:
            raise PipelineScheduleError(
                f"{where}: orders={orders!r}; expected a non-empty sequence with one sequence of "
                'actions per device, e.g. [["F0", "B0"], ["F0", "B0"]].'
            )
        p = len(orders)
        _check_counts("Schedule.from_orders", p, microbatches, chunks, placement)
        microbatches, chunks = int(microbatches), int(chunks)
        parsed = [
            [_parse_action(a, device, i, microbatches, chunks, where) for i, a in enumerate(order)]
            for device, order in enumerate(_as_orders(orders, where))
        ]
        units = [
            (f"device {d}, position {i} of its order", mb, _stage_of(d, chunk, p, placement), kind)
            for d, order in enumerate(parsed)
            for i, (kind, mb, chunk) in enumerate(order)
        ]
        _check_units(units, p, microbatches, chunks, placement, where)
        table, _ = _place(parsed, p, p * chunks, placement)
        table.setflags(write=False)
        out = cls(name, p, microbatches, chunks, table, placement)
        validate(out)
        return out

    def validate(self) -> None:
        """Raise `PipelineScheduleError` unless the table is runnable (see `validate`)."""
        validate(self)

    @property
    def virtual_stages(self) -> int:
        """Number of virtual stages: `stages * chunks`."""
        return self.stages * self.chunks

    @property
    def ticks(self) -> int:
        """Number of ticks (rows of the table)."""
        return int(self.table.shape[0])

    def stage_of(self, device: int, chunk: int) -> int:
        """The virtual stage that `chunk` of `device` runs (see `placement`)."""
        return _stage_of(device, chunk, self.stages, self.placement)

    def entries(self) -> list[tuple[int, int, int, int, int]]:
        """Every non-idle entry as `(tick, device, micro-batch, virtual stage, action)`,
        in the order the devices run them (by tick; in a fused tick, `table`'s
        action before `fused`'s)."""
        out = []
        tables = (self.table,) if self.fused is None else (self.table, self.fused)
        for tick in range(self.ticks):
            for device in range(self.stages):
                for table in tables:
                    mb, chunk, kind = (int(x) for x in table[tick, device])
                    if kind != IDLE:
                        out.append((tick, device, mb, self.stage_of(device, chunk), kind))
        return out

    @functools.cached_property
    def _unit_simulation(self) -> "Any":
        # Imported here: _simulate imports this module.
        from ._simulate import simulate

        return simulate(self, dict(zip(("F", "B", "I", "W"), COSTS[1:], strict=True)))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of device time, devices running independently (see class doc)."""
        return self._unit_simulation.bubble_fraction

    @property
    def lockstep_bubble_fraction(self) -> float:
        """Idle share of device time when every tick lasts as long as its costliest action."""
        return self._unit_simulation.lockstep_bubble_fraction

    @functools.cached_property
    def buffers(self) -> "Buffers":
        """The engine's buffer slots (see `Buffers`)."""
        return _buffers(self)

    @property
    def in_flight(self) -> int:
        """Length of the activation buffer: most stage inputs held at once by a device."""
        return self.buffers.inputs

    @property
    def cotangent_slots(self) -> int:
        """Length of the cotangent buffer: most received cotangents held at once."""
        return self.buffers.cotangents

    def __str__(self) -> str:
        cells = []
        second = self.fused if self.fused is not None else np.full_like(self.table, IDLE)
        for device in range(self.stages):
            row = []
            for (mb, chunk, kind), (mb2, chunk2, kind2) in zip(
                self.table[:, device], second[:, device], strict=True
            ):
                names = [
                    f"{ACTION_LETTERS[k]}{b}" + (f":{c}" if self.chunks > 1 else "")
                    for b, c, k in ((mb, chunk, kind), (mb2, chunk2, kind2))
                    if k != IDLE
                ]
                row.append("+".join(names) or ".")
            cells.append(row)
        width = max(len(c) for row in cells for c in row)
        where = ", V placement" if self.placement == "v" else ""
        head = (
            f"{self.name}: {self.stages} stages x {self.chunks} chunk(s){where}, {self.microbatches} "
            f"micro-batches, {self.ticks} ticks; bubble {self.bubble_fraction:.1%} "
            f"(lockstep {self.lockstep_bubble_fraction:.1%}); in flight {self.in_flight}"
        )
        lines = [head]
        for device, row in enumerate(cells):
            lines.append(f"dev{device:<3d}" + " ".join(c.rjust(width) for c in row))
        return "\n".join(lines)

    def __repr__(self) -> str:
        where = f", placement={self.placement!r}" if self.placement != "interleaved" else ""
        return (
            f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"chunks={self.chunks}, ticks={self.ticks}{where})"
        )


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Slot assignment of the engine's buffers, derived from a schedule's table.

    `inputs`/`cotangents`: number of slots. `input_slot[tick, device, i]`: the
    slot of the stage input the tick's action `i` reads (0: the table's, 1: the
    fused table's second action; -1: none); `cotangent_slot`: the same for the
    cotangent; `recv_input[tick, device]`: the
    slot the activation arriving at the end of that tick is written to (-1: none);
    `recv_cotangent`: the same for an arriving cotangent. `residuals`: slots for
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


def _buffers(schedule: Schedule) -> Buffers:
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
        return max(tick_of.get((kind, mb, k), -1) for kind in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))

    def cot_sent(mb: int, k: int) -> int:
        return max(tick_of.get((kind, mb, k), -1) for kind in backward_kinds)

    def folds(mb: int, k: int) -> bool:
        # The last virtual stage's forward and backward (or input half) in one tick.
        return k == stages - 1 and tick_of[(FORWARD, mb, k)] == cot_sent(mb, k)

    shape = schedule.table.shape[:2]
    input_slot = np.full((*shape, 2), -1, np.int32)
    cot_slot = np.full((*shape, 2), -1, np.int32)
    recv_input = np.full(shape, -1, np.int32)
    recv_cot = np.full(shape, -1, np.int32)
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
            # The activation sent at that tick by the previous device lands here.
            recv_input[tick_of[(FORWARD, mb, k - 1)], device] = slot
        count, cot_where = assign(cot_slot, device, cots, (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))
        n_cot = max(n_cot, count)
        for (mb, k), slot in cot_where.items():
            recv_cot[cot_sent(mb, k + 1), device] = slot
    return Buffers(
        n_in, n_cot, input_slot, cot_slot, recv_input, recv_cot, n_res, res_slot, folded, n_stash, stash_slot
    )


def schedule(name: str, *, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build a pipeline schedule table.

    **Arguments:**

    - `name`: `"gpipe"` (all forwards, then all backwards: `microbatches`
      activations per stage in flight), `"1f1b"` (after a warm-up, one forward then
      one backward: at most `stages` in flight), `"interleaved"` (1F1B over
      `chunks` virtual stages per device: the bubble shrinks by `chunks`; the
      last virtual stage's last `stages - 1` backwards are split, their weight
      halves run while the last device would idle at the end),
      `"zero_bubble"` (ZB-H1: backward split into input- and weight-gradient
      passes, the weight passes filling 1F1B's bubble at 1F1B's memory). For
      prediction only (V placement, which the engine does not run): `"zb_v"`
      (ZB-V: two chunks per device in a V, backward split, 1F1B's memory) and
      `"dualpipe_v"` (DeepSeek's DualPipeV as a table; `microbatches >= 2 *
      stages`).
    - `stages`: devices along the `pipe` axis.
    - `microbatches`: micro-batches per step (for `"interleaved"` with
      `chunks > 1`, a multiple of `stages`).
    - `chunks`: virtual stages per device; only `"interleaved"` takes more than 1
      (`"zb_v"` and `"dualpipe_v"` always have 2: leave it out or pass 2).

    **Returns:** a `Schedule`.

    **Raises:** `PlanError` for an unknown name, non-positive counts, chunks with a
    non-interleaved schedule, or interleaved micro-batches not a multiple of stages.

    ```python
    s = eqxpar.pipeline.schedule("interleaved", stages=4, microbatches=8, chunks=2)
    s.bubble_fraction      # 0.127, under Megatron's (4 - 1) / (2 * 8 + 4 - 1)
    eqxpar.pipeline.schedule("zb_v", stages=4, microbatches=16).bubble_fraction
    ```
    """
    names = PIPELINE_SCHEDULES + PREDICTION_SCHEDULES
    if name not in names:
        raise PlanError(f"schedule(name={name!r}): unknown schedule; expected one of {names}.")
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"schedule({what}={value!r}): expected a positive integer.")
    if name in PREDICTION_SCHEDULES:
        if chunks not in (1, 2):
            raise PlanError(
                f"schedule({name!r}, chunks={chunks}): {name!r} always runs two chunks per device "
                "(a V: device d holds virtual stages d and 2p-1-d). Leave chunks out or pass chunks=2."
            )
        if name == "dualpipe_v" and microbatches < 2 * stages:
            raise PlanError(
                f"schedule('dualpipe_v', stages={stages}, microbatches={microbatches}): DualPipeV "
                f"needs at least 2 * stages = {2 * stages} micro-batches. Use microbatches >= "
                f"{2 * stages}."
            )
        return _build(name, stages, microbatches, 2)
    if chunks > 1 and name != "interleaved":
        raise PlanError(
            f"schedule({name!r}, chunks={chunks}): only the 'interleaved' schedule runs several "
            "chunks (virtual stages) per device. Use name='interleaved' or chunks=1."
        )
    if name == "interleaved" and chunks > 1 and microbatches % stages:
        raise PlanError(
            f"schedule('interleaved', stages={stages}, microbatches={microbatches}, chunks={chunks}): "
            f"the interleaved schedule sends micro-batches through each chunk in groups of {stages}; "
            f"use a number of micro-batches that is a multiple of {stages}."
        )
    return _build(name, stages, microbatches, chunks)


@functools.lru_cache(maxsize=256)
def _build(name: str, p: int, m: int, v: int) -> Schedule:
    placement = "interleaved"
    if name == "gpipe":
        orders = _orders_gpipe(p, m)
    elif name == "1f1b":
        orders = _orders_1f1b_fused(p, m)
    elif name == "interleaved":
        orders = _orders_interleaved(p, m, v)
    elif name == "zero_bubble":
        orders = _orders_zero_bubble(p, m)
    elif name == "zb_v":
        orders, placement = _orders_zb_v(p, m), "v"
    else:
        orders, placement = _orders_dualpipe_v(p, m), "v"
    # 1F1B and interleaved fuse a forward and a backward into one tick, so that a
    # tick's devices run work of one cost in one SPMD program (see `Schedule`).
    fuse = name in ("1f1b", "interleaved")
    table, fused = _place(orders, p, p * v, placement, fuse=fuse)
    table.setflags(write=False)
    if fused is not None:
        fused.setflags(write=False)
    return Schedule(
        name=name, stages=p, microbatches=m, chunks=v, table=table, placement=placement, fused=fused
    )


def _check_counts(where: str, stages: Any, microbatches: Any, chunks: Any, placement: Any) -> None:
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise PipelineScheduleError(f"{where}({what}={value!r}): expected a positive integer.")
    if placement not in PLACEMENTS:
        raise PipelineScheduleError(
            f"{where}(placement={placement!r}): expected one of {PLACEMENTS} ('interleaved': virtual "
            "stage chunk * stages + device, the engine's; 'v': device d holds stages d and 2p-1-d)."
        )


_LETTER_CODES = {"F": FORWARD, "B": BACKWARD, "I": BACKWARD_INPUT, "W": BACKWARD_WEIGHT}


def _as_orders(orders: Sequence, where: str) -> list[Sequence]:
    out = []
    for device, order in enumerate(orders):
        if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
            raise PipelineScheduleError(
                f"{where}: the order of device {device} is {order!r}; expected a sequence of actions "
                'such as ["F0", "F1", "B0", "B1"].'
            )
        out.append(order)
    return out


def _parse_action(action: Any, device: int, i: int, m: int, v: int, where: str) -> Action:
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


def _check_units(
    units: list[tuple[str, int, int, int]], p: int, m: int, v: int, placement: str, where: str
) -> None:
    """Every (micro-batch, virtual stage) has one forward and either one backward or
    one backward-input and one backward-weight. `units`: (location, mb, k, kind)."""
    seen: dict[tuple[int, int, int], str] = {}
    for at, mb, k, kind in units:
        if (kind, mb, k) in seen:
            raise PipelineScheduleError(
                f"{where}: {at}: {_describe(kind, mb, k)} runs twice (first at {seen[(kind, mb, k)]}). "
                "Remove one of them."
            )
        seen[(kind, mb, k)] = at
    for mb in range(m):
        for k in range(p * v):
            kinds = {kind for kind in range(1, 5) if (kind, mb, k) in seen}
            if kinds in ({FORWARD, BACKWARD}, {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}):
                continue
            device = _device_of(k, p, placement)
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


def validate(schedule: Any) -> None:
    """Check that a schedule's table is runnable, before anything compiles.

    Checks, in order: the counts and placement; the table's shape `(ticks,
    stages, 3)` and values (action codes 0-4, micro-batch and chunk in range
    where not idle; one cell per device and tick, so two actions of a device in
    one tick cannot be written); each action once, and every (micro-batch,
    virtual stage) with a forward and either a backward or a backward-input and
    a backward-weight; each action at a later tick than what it depends on (the
    previous stage's forward; the same stage's forward and the next stage's
    backward or backward-input; for backward-weight, its backward-input): an
    activation or cotangent sent at the end of tick `t` is usable from `t + 1`.

    **Arguments:** `schedule`.

    **Raises:** `PipelineScheduleError` (a `PlanError`) naming the tick and device
    of the first problem and the fix.

    ```python
    eqxpar.pipeline.validate(eqxpar.pipeline.schedule("1f1b", stages=4, microbatches=8))
    ```
    """
    where = repr(schedule) if isinstance(getattr(schedule, "table", None), np.ndarray) else "schedule"
    if not isinstance(schedule, Schedule):
        raise PipelineScheduleError(
            f"validate({schedule!r}): expected an eqxpar.pipeline.Schedule; build one with "
            "eqxpar.pipeline.schedule(...) or Schedule.from_table / from_orders."
        )
    p, m, v = schedule.stages, schedule.microbatches, schedule.chunks
    _check_counts("Schedule", p, m, v, schedule.placement)
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
    _check_units(
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
            at[_key(kind, mb, k)] = (tick, device, order)
    for order, (tick, device, mb, k, kind) in enumerate(entries):
        for dep in _dependencies((kind, mb, 0), k, p * v):
            dep_tick, dep_device, dep_order = at[_key(*dep)]
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
                    f"{where}: tick {tick}, device {device}: {_describe(kind, mb, k)} runs before what "
                    f"it depends on: {_describe(*_key(*dep))}, at tick {dep_tick} on device "
                    f"{dep_device}{same}. Move it to tick {dep_tick + 1} or later, or that one earlier."
                )


def check_table(schedule: Any) -> None:
    """Raise `PipelineScheduleError` (a `PlanError`) unless the table is runnable:
    the same checks as `validate` (used by the tests on every built table)."""
    validate(schedule)
