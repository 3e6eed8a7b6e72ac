"""Pipeline schedules as data: a table (tick, device) -> (micro-batch, chunk, action).

A schedule is built from one *order* per device (the sequence of actions that
device runs). The ticks follow from the orders: an action runs one tick after the
later of the device's previous action and the actions it depends on (an activation
or cotangent sent at the end of tick `t` is there at tick `t + 1`). From the table
come the bubble fractions, the buffer sizes the engine allocates, a text rendering
and (in `_picture.py`) a picture.

Layout of virtual stages: with `p` devices and `v` chunks per device there are
`S = p * v` virtual stages; virtual stage `k` runs on device `k % p` as its chunk
`k // p` (Megatron's interleaved layout: an activation always moves to the next
device, wrapping from the last device to the first for the next chunk).
"""

import dataclasses
import functools
from collections.abc import Sequence

import numpy as np

from .._errors import PlanError
from .._plan import PIPELINE_SCHEDULES

#: Action codes in `Schedule.table[..., 2]`.
IDLE, FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = 0, 1, 2, 3, 4
ACTION_NAMES = ("idle", "forward", "backward", "backward-input", "backward-weight")
#: One-letter names used by the text rendering and the picture.
ACTION_LETTERS = (".", "F", "B", "I", "W")
#: The cost model of the bubble fractions: a backward pass costs two forwards; its
#: halves (input gradient, weight gradient) one each.
COSTS = (0, 1, 2, 1, 1)

Action = tuple[int, int, int]  # (action, micro-batch, chunk)


def _orders_gpipe(p: int, m: int) -> list[list[Action]]:
    return [[(FORWARD, j, 0) for j in range(m)] + [(BACKWARD, j, 0) for j in range(m)] for _ in range(p)]


def _orders_1f1b(p: int, m: int) -> list[list[Action]]:
    orders = []
    for s in range(p):
        warmup = min(p - 1 - s, m)
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


def _place(orders: list[list[Action]], p: int, stages: int) -> np.ndarray:
    """Tick of every action: one after the later of the device's previous action
    and its dependencies. Returns the (ticks, p, 3) table."""
    done: dict[tuple[int, int, int], int] = {}
    pos = [0] * p
    free = [0] * p
    placed: list[list[tuple[int, Action]]] = [[] for _ in range(p)]
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(orders[s]):
                act = orders[s][pos[s]]
                k = act[2] * p + s
                deps = _dependencies(act, k, stages)
                if any(_key(*d) not in done for d in deps):
                    break
                tick = max([free[s]] + [done[_key(*d)] + 1 for d in deps])
                done[(act[0], act[1], k)] = tick
                if act[0] in (BACKWARD, BACKWARD_INPUT):
                    done[_key(act[0], act[1], k)] = tick
                placed[s].append((tick, act))
                free[s] = tick + 1
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise PlanError("the per-device orders of this schedule deadlock; this is a bug in eqxpar.")
    ticks = max(t for row in placed for t, _ in row) + 1
    table = np.full((ticks, p, 3), -1, dtype=np.int32)
    table[..., 2] = IDLE
    for s in range(p):
        for tick, (kind, mb, chunk) in placed[s]:
            table[tick, s] = (mb, chunk, kind)
    return table


@dataclasses.dataclass(frozen=True, eq=False)
class Schedule:
    """A pipeline schedule: what every device does at every tick.

    Built by `eqxpar.pipeline.schedule`. The engine (`Plan(schedule=...)`) runs
    one tick per step of a `lax.scan`, every device following its column.

    **Attributes:**

    - `name`, `stages` (devices along `pipe`), `microbatches`, `chunks` (virtual
      stages per device).
    - `table`: int32 numpy array `(ticks, stages, 3)`: `[tick, device] = (micro-batch,
      chunk, action)`, action codes `0` idle, `1` forward, `2` backward, `3`
      backward-input, `4` backward-weight (`ACTION_NAMES`); micro-batch and chunk
      are -1 where idle. Virtual stage `chunk * stages + device`.
    - `bubble_fraction`: the idle share of the devices' time when each runs its
      actions in table order as soon as their inputs are there, under the cost
      model forward = 1, backward = 2, backward-input = 1, backward-weight = 1.
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

    @property
    def virtual_stages(self) -> int:
        """Number of virtual stages: `stages * chunks`."""
        return self.stages * self.chunks

    @property
    def ticks(self) -> int:
        """Number of ticks (rows of the table)."""
        return int(self.table.shape[0])

    def entries(self) -> list[tuple[int, int, int, int, int]]:
        """Every non-idle entry as `(tick, device, micro-batch, virtual stage, action)`."""
        out = []
        for tick, device in zip(*np.nonzero(self.table[..., 2] != IDLE), strict=True):
            mb, chunk, kind = (int(x) for x in self.table[tick, device])
            out.append((int(tick), int(device), mb, chunk * self.stages + int(device), kind))
        return out

    @functools.cached_property
    def _timing(self) -> tuple[float, float, float]:
        work = 0.0
        free = [0.0] * self.stages
        finish: dict[tuple[int, int, int], float] = {}
        entries = sorted(self.entries())
        for _, device, mb, k, kind in entries:
            deps = _dependencies((kind, mb, 0), k, self.virtual_stages)
            start = max([free[device]] + [finish[_key(*d)] for d in deps])
            end = start + COSTS[kind]
            finish[(kind, mb, k)] = end
            if kind in (BACKWARD, BACKWARD_INPUT):
                finish[_key(kind, mb, k)] = end
            free[device] = end
            work += COSTS[kind]
        makespan = max(free)
        lockstep = float(sum(max(COSTS[int(a)] for a in row) for row in self.table[..., 2]))
        return work, makespan, lockstep

    @property
    def bubble_fraction(self) -> float:
        """Idle share of device time, devices running independently (see class doc)."""
        work, makespan, _ = self._timing
        return 1.0 - work / (self.stages * makespan)

    @property
    def lockstep_bubble_fraction(self) -> float:
        """Idle share of device time when every tick lasts as long as its costliest action."""
        work, _, lockstep = self._timing
        return 1.0 - work / (self.stages * lockstep)

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
        for device in range(self.stages):
            row = []
            for mb, chunk, kind in self.table[:, device]:
                if kind == IDLE:
                    row.append(".")
                else:
                    suffix = f":{chunk}" if self.chunks > 1 else ""
                    row.append(f"{ACTION_LETTERS[kind]}{mb}{suffix}")
            cells.append(row)
        width = max(len(c) for row in cells for c in row)
        head = (
            f"{self.name}: {self.stages} stages x {self.chunks} chunk(s), {self.microbatches} micro-batches, "
            f"{self.ticks} ticks; bubble {self.bubble_fraction:.1%} "
            f"(lockstep {self.lockstep_bubble_fraction:.1%}); in flight {self.in_flight}"
        )
        lines = [head]
        for device, row in enumerate(cells):
            lines.append(f"dev{device:<3d}" + " ".join(c.rjust(width) for c in row))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (
            f"Schedule({self.name!r}, stages={self.stages}, microbatches={self.microbatches}, "
            f"chunks={self.chunks}, ticks={self.ticks})"
        )


@dataclasses.dataclass(frozen=True)
class Buffers:
    """Slot assignment of the engine's buffers, derived from a schedule's table.

    `inputs`/`cotangents`: number of slots. `input_slot[tick, device]`: the slot
    of the stage input the action at that tick reads (-1: none);
    `cotangent_slot`: the same for the cotangent; `recv_input[tick, device]`: the
    slot the activation arriving at the end of that tick is written to (-1: none);
    `recv_cotangent`: the same for an arriving cotangent.
    """

    inputs: int
    cotangents: int
    input_slot: np.ndarray
    cotangent_slot: np.ndarray
    recv_input: np.ndarray
    recv_cotangent: np.ndarray


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
    for tick, _, mb, k, kind in schedule.entries():
        tick_of[(kind, mb, k)] = tick
    backward_kinds = (BACKWARD, BACKWARD_INPUT)

    def last_use(mb: int, k: int) -> int:
        return max(tick_of.get((kind, mb, k), -1) for kind in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT))

    def cot_sent(mb: int, k: int) -> int:
        return max(tick_of.get((kind, mb, k), -1) for kind in backward_kinds)

    shape = schedule.table.shape[:2]
    input_slot = np.full(shape, -1, np.int32)
    cot_slot = np.full(shape, -1, np.int32)
    recv_input = np.full(shape, -1, np.int32)
    recv_cot = np.full(shape, -1, np.int32)
    n_in = n_cot = 0
    for device in range(p):
        ins, cots = [], []
        for mb in range(schedule.microbatches):
            for chunk in range(schedule.chunks):
                k = chunk * p + device
                if k > 0:  # virtual stage 0 computes its input from the batch
                    ins.append((tick_of[(FORWARD, mb, k - 1)], last_use(mb, k), (mb, k)))
                if k < stages - 1:  # the last stage seeds its own cotangent
                    cots.append((cot_sent(mb, k + 1), last_use(mb, k), (mb, k)))
        count, in_where = _allocate(ins)
        n_in = max(n_in, count)
        count, cot_where = _allocate(cots)
        n_cot = max(n_cot, count)
        for (mb, k), slot in in_where.items():
            for kind in (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                if (kind, mb, k) in tick_of:
                    input_slot[tick_of[(kind, mb, k)], device] = slot
            # The activation sent at that tick by the previous device lands here.
            recv_input[tick_of[(FORWARD, mb, k - 1)], device] = slot
        for (mb, k), slot in cot_where.items():
            for kind in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT):
                if (kind, mb, k) in tick_of:
                    cot_slot[tick_of[(kind, mb, k)], device] = slot
            recv_cot[cot_sent(mb, k + 1), device] = slot
    return Buffers(n_in, n_cot, input_slot, cot_slot, recv_input, recv_cot)


def schedule(name: str, *, stages: int, microbatches: int, chunks: int = 1) -> Schedule:
    """Build a pipeline schedule table.

    **Arguments:**

    - `name`: `"gpipe"` (all forwards, then all backwards: `microbatches`
      activations per stage in flight), `"1f1b"` (after a warm-up, one forward then
      one backward: at most `stages` in flight), `"interleaved"` (1F1B over
      `chunks` virtual stages per device: the bubble shrinks by `chunks`),
      `"zero_bubble"` (ZB-H1: backward split into input- and weight-gradient
      passes, the weight passes filling 1F1B's bubble at 1F1B's memory).
    - `stages`: devices along the `pipe` axis.
    - `microbatches`: micro-batches per step (for `"interleaved"` with
      `chunks > 1`, a multiple of `stages`).
    - `chunks`: virtual stages per device; only `"interleaved"` takes more than 1.

    **Returns:** a `Schedule`.

    **Raises:** `PlanError` for an unknown name, non-positive counts, chunks with a
    non-interleaved schedule, or interleaved micro-batches not a multiple of stages.

    ```python
    s = eqxpar.pipeline.schedule("interleaved", stages=4, microbatches=8, chunks=2)
    s.bubble_fraction      # (4 - 1) / (2 * 8 + 4 - 1)
    ```
    """
    if name not in PIPELINE_SCHEDULES:
        raise PlanError(f"schedule(name={name!r}): unknown schedule; expected one of {PIPELINE_SCHEDULES}.")
    for what, value in (("stages", stages), ("microbatches", microbatches), ("chunks", chunks)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PlanError(f"schedule({what}={value!r}): expected a positive integer.")
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
    if name == "gpipe":
        orders = _orders_gpipe(p, m)
    elif name == "1f1b":
        orders = _orders_1f1b(p, m)
    elif name == "interleaved":
        orders = _orders_interleaved(p, m, v)
    else:
        orders = _orders_zero_bubble(p, m)
    table = _place(orders, p, p * v)
    table.setflags(write=False)
    return Schedule(name=name, stages=p, microbatches=m, chunks=v, table=table)


def check_table(schedule: Schedule) -> None:
    """Raise `PlanError` unless every (micro-batch, virtual stage) has exactly one
    forward and either one backward or one backward-input and one backward-weight,
    each after what it depends on (used by the tests on every built table)."""
    seen: dict[tuple[int, int, int], int] = {}
    for tick, _, mb, k, kind in schedule.entries():
        if (kind, mb, k) in seen:
            raise PlanError(
                f"{schedule!r}: action {ACTION_NAMES[kind]} of micro-batch {mb}, stage {k} twice."
            )
        seen[(kind, mb, k)] = tick
    stages = schedule.virtual_stages
    for mb in range(schedule.microbatches):
        for k in range(stages):
            kinds = {kind for kind in range(1, 5) if (kind, mb, k) in seen}
            if kinds not in ({FORWARD, BACKWARD}, {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT}):
                raise PlanError(
                    f"{schedule!r}: micro-batch {mb}, stage {k} has actions "
                    f"{sorted(ACTION_NAMES[x] for x in kinds)}."
                )
            for kind in kinds:
                for dep in _dependencies((kind, mb, 0), k, stages):
                    options: Sequence[int] = (BACKWARD, BACKWARD_INPUT) if dep[0] == -1 else (dep[0],)
                    ticks = [seen[(o, dep[1], dep[2])] for o in options if (o, dep[1], dep[2]) in seen]
                    if not ticks or ticks[0] >= seen[(kind, mb, k)]:
                        raise PlanError(
                            f"{schedule!r}: {ACTION_NAMES[kind]} of micro-batch {mb} at stage {k} "
                            "runs before what it depends on."
                        )
