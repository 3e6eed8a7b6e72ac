"""The engine's program: a schedule's table as the numbers each device's loop
reads, planned in numpy before anything is traced. Shared with
`eqxpar._advise` (which predicts a pipeline step's memory from the program's
loops) and the tests: internal names, not public API.

`build_program` gives every (tick, device) its `lax.switch` branch, the buffer
slots it reads and writes, and the branch list; `senders` the devices that send
at each tick; `tick_loops` the ticks grouped into loops over repeating
patterns (`Loop`), each run as one `lax.scan` by the engine (`_engine`).
"""

import dataclasses

import numpy as np

from .._errors import PipelineScheduleError
from ._actions import BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD, IDLE
from ._placement import DOWN, LANES, UP
from ._schedule import Schedule


def stores_residuals(kind: int, folded: bool) -> bool:
    """Whether an action stores residuals: a forward, unless folded into its
    backward (`Buffers.folded`), then the input half of a split backward."""
    return (kind == FORWARD and not folded) or (kind == BACKWARD_INPUT and folded)


#: Program columns: the branch; per lane (`_placement.DOWN`, `UP`, `LOCAL`) the
#: slots an activation and a cotangent arriving along it at the end of the tick
#: are written to (`recv_column`); per sending lane (`DOWN`, `UP`) what the
#: device sends along it (`send_column`: `SEND_ACTIVATION`, `SEND_COTANGENT`, -1
#: nothing); then per action of the tick (the table's, the fused table's) `FIELDS`
#: values: micro-batch, chunk, input slot, cotangent slot, residual write and read
#: slots, stash write and read slots (`_split_backward`: from a split backward's
#: `I` to its `W`).
HEAD = 1 + 2 * len(LANES) + 2
FIELDS = 8
RES_WRITE, RES_READ, STASH_WRITE, STASH_READ = 4, 5, 6, 7
SLOTS = (RES_WRITE, RES_READ, STASH_WRITE, STASH_READ)
SEND_ACTIVATION, SEND_COTANGENT = 0, 1


def recv_column(at: int, cotangent: bool) -> int:
    """The program column of the slot an activation (a cotangent) arriving along
    lane `at` is written to."""
    return 1 + 2 * at + int(cotangent)


def send_column(at: int) -> int:
    """The program column of what a device sends along lane `at` (`DOWN`, `UP`)."""
    return 1 + 2 * len(LANES) + at


def slot_used(rows: np.ndarray, field: int) -> bool:
    """Whether any action of the program rows `rows` (any leading shape) has a
    slot in column `field` (one of `SLOTS`)."""
    return bool((rows[..., [HEAD + field, HEAD + FIELDS + field]] >= 0).any())


#: (action, is first virtual stage, is last virtual stage, folded: the last
#: stage's forward runs inside its backward, layers the stage runs: None for
#: all of its chunk's slots, a count where `Plan(stage_layers=...)` gives one)
Key = tuple[int, bool, bool, bool, int | None]


def build_program(
    sched: Schedule, keep: bool, stage_layers: tuple[int, ...] | None = None
) -> tuple[np.ndarray, list[tuple[Key, Key]]]:
    """Per (tick, device): branch index, the receive slots of each lane, what
    the device sends down and up (see `HEAD`), then for each of the tick's two actions (the second idle unless the
    schedule fuses them) micro-batch, chunk, input slot, cotangent slot, residual
    write and read slots, stash write and read slots; and the branch list, a pair
    of `Key`s per branch.

    The last virtual stage's forward runs in its own tick and keeps its
    residuals, as every stage's, where the schedule puts it in a tick before its
    backward: folded into the backward, it would make every tick with that
    backward cost a forward more than the table says (GPipe's backward phase).
    It is folded where the schedule puts the two in one tick (`Buffers.folded`),
    and, when residuals are not kept (`keep=False`, remat "full"), always: every
    backward then recomputes its forward anyway. With `stage_layers` (layers per
    virtual stage) a key holds its stage's count, so that a branch runs its
    stage's layers only; else None (the whole chunk)."""
    p, stages = sched.stages, sched.virtual_stages
    bufs = sched.buffers
    idle: Key = (IDLE, False, False, False, None)
    branches: list[tuple[Key, Key]] = [(idle, idle)]
    index: dict[tuple[Key, Key], int] = {branches[0]: 0}
    tables = (sched.table, sched.fused if sched.fused is not None else np.zeros_like(sched.table))
    prog = np.zeros(sched.table.shape[:2] + (HEAD + 2 * FIELDS,), np.int32)
    sends = _send_kinds(sched)
    # A forward-only table (evaluation) has no backward to fold the last forward into.
    backward = bool(np.isin(sched.table[..., 2], (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)).any())
    for tick in range(sched.ticks):
        for device in range(p):
            keys, fields, writes, reads = [], [], [], []
            for i, table in enumerate(tables):
                mb, chunk, kind = (int(x) for x in table[tick, device])
                key, write, read, stash_write, stash_read = idle, -1, -1, -1, -1
                k = sched.stage_of(device, chunk) if kind != IDLE else -1
                last = k == stages - 1
                folded = last and backward and (not keep or bool(bufs.folded[tick, device, i]))
                if kind != IDLE and not (kind == FORWARD and folded):
                    key = (kind, k == 0, last, folded, None if stage_layers is None else stage_layers[k])
                    slot = int(bufs.residual_slot[tick, device, i])
                    write, read = _residual_slots(kind, folded, slot)
                    if keep:
                        stash = int(bufs.stash_slot[tick, device, i])
                        stash_write = stash if kind == BACKWARD_INPUT else -1
                        stash_read = stash if kind == BACKWARD_WEIGHT else -1
                keys.append(key)
                writes.append(write)
                reads.append(read)
                fields += [
                    max(mb, 0),
                    max(chunk, 0),
                    bufs.input_slot[tick, device, i],
                    bufs.cotangent_slot[tick, device, i],
                    write,
                    read,
                    stash_write,
                    stash_read,
                ]
            if min(writes) >= 0 or min(reads) >= 0:
                # A tick's branch returns one slot of residuals to write after it.
                raise PipelineScheduleError(
                    f"{sched!r}: tick {tick}, device {device}: both of the tick's actions "
                    f"{'store' if min(writes) >= 0 else 'read'} a stage's residuals; a fused tick pairs "
                    "a forward with a backward of another stage or micro-batch. Put them in ticks of "
                    "their own."
                )
            pair = (keys[0], keys[1])
            if pair not in index:
                index[pair] = len(branches)
                branches.append(pair)
            received = np.stack([bufs.recv_input[tick, device], bufs.recv_cotangent[tick, device]], axis=1)
            prog[tick, device] = (index[pair], *received.reshape(-1), *sends[tick, device], *fields)
    return prog, branches


def _residual_slots(kind: int, folded: bool, slot: int) -> tuple[int, int]:
    """`(write, read)` residual slots of an action: a forward writes its stage's
    residuals and the backward actions read them; where the last virtual stage's
    forward runs inside its backward (`folded`), only a split backward keeps
    residuals, from its input half (`I` writes) to its weight half (`W` reads)."""
    if stores_residuals(kind, folded):
        return slot, -1
    reads = kind == BACKWARD_WEIGHT if folded else kind in (BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
    return -1, (slot if reads else -1)


def senders(sched: Schedule) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per tick, the devices that send down (to the next device along `pipe`)
    and those that send up (to the previous one) at its end: the senders of what
    some device receives then along lane `DOWN` or `UP` (an activation or a
    cotangent: under interleaved placement activations go down and cotangents
    up; under a V each goes either way, by chunk). A hand-over on the device
    itself (`LOCAL`, a V's turn) sends nothing."""
    kinds = _send_kinds(sched)
    return [
        tuple(tuple(int(d) for d in np.nonzero(kinds[tick, :, at] >= 0)[0]) for at in (DOWN, UP))
        for tick in range(sched.ticks)
    ]


def _send_kinds(sched: Schedule) -> np.ndarray:
    """`(ticks, devices, 2)`: what each device sends down and up at the end of a
    tick (`SEND_ACTIVATION`, `SEND_COTANGENT`, -1 nothing), from what the
    neighbour it sends to receives along that lane."""
    bufs, p = sched.buffers, sched.stages
    kinds = np.full((sched.ticks, p, 2), -1, np.int32)
    for at, step in ((DOWN, 1), (UP, -1)):
        for d in range(p):
            to = (d + step) % p
            kinds[bufs.recv_input[:, to, at] >= 0, d, at] = SEND_ACTIVATION
            kinds[bufs.recv_cotangent[:, to, at] >= 0, d, at] = SEND_COTANGENT
    both = (bufs.recv_input[..., :2] >= 0) & (bufs.recv_cotangent[..., :2] >= 0)
    if both.any():
        tick, device, at = (int(x) for x in np.argwhere(both)[0])
        raise PipelineScheduleError(
            f"{sched!r}: tick {tick}, device {device} receives an activation and a cotangent along "
            f"one lane ({LANES[at]}) at the end of the tick: its neighbour would send both the same "
            "way at once (a fused tick of a V placement). Put the two actions in ticks of their own."
        )
    return kinds


@dataclasses.dataclass(frozen=True)
class Loop:
    """Ticks `start` to `stop` of a schedule, run as `count` iterations of a loop
    whose body runs `period` ticks, each tick of the body sending along the
    pairs its position's senders name (`sends[j]`: forward, backward senders).
    With `count == 1` the body runs once, not in a loop."""

    start: int
    period: int
    count: int
    sends: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    def ticks(self, position: int) -> range:
        """The schedule's ticks body position `position` runs."""
        return range(self.start + position, self.stop, self.period)


def tick_loops(sched: Schedule, program: np.ndarray, longest: int = 16) -> list[Loop]:
    """The schedule's ticks as loops (`Loop`) over repeating patterns: a tick
    sends only from the devices with something due, so that what the program
    sends is what the schedule moves (a loop's tick sends what its body's
    position sends on every iteration); and each device runs one branch of
    `program` (`build_program`'s, column 0) at a position on every iteration, so that
    a position's `lax.switch` holds one branch per device and each tick is
    counted (FLOPs, a stage's tensor-parallel sums) at what it runs, not at the
    costliest action of another iteration. From each tick on, the pattern of
    `period <= longest` ticks that repeats over the most ticks is one loop;
    consecutive ticks that start no repeat form one body, run once."""
    sends = senders(sched)
    # What must repeat: the tick's sends and every device's branch.
    pattern_of = [(sent, tuple(int(b) for b in program[t, :, 0])) for t, sent in enumerate(sends)]
    n = len(sends)
    loops: list[Loop] = []
    single: list[int] = []

    def flush() -> None:
        if single:
            loops.append(Loop(single[0], len(single), 1, tuple(sends[t] for t in single)))
            single.clear()

    tick = 0
    while tick < n:
        best = (1, 1)
        for period in range(1, longest + 1):
            count = 1
            pattern = pattern_of[tick : tick + period]
            while (
                tick + (count + 1) * period <= n
                and pattern_of[tick + count * period : tick + (count + 1) * period] == pattern
            ):
                count += 1
            if count >= 2 and period * count > best[0] * best[1]:
                best = (period, count)
        period, count = best
        if count == 1:
            single.append(tick)
            tick += 1
            continue
        flush()
        loops.append(Loop(tick, period, count, tuple(sends[tick : tick + period])))
        tick += period * count
    flush()
    return loops
