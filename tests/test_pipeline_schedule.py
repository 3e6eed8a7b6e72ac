"""Pipeline schedule tables: valid, with the bubble fractions of their formulas,
buffers sized by stages (1F1B, zero-bubble) or micro-batches (GPipe), and the text
and PNG renderings."""

import itertools
import sys

import numpy as np
import pytest

import eqxpar
from eqxpar.internal import ACTION_NAMES
from eqxpar.pipeline import schedule

# The action codes of a schedule's table (`Schedule.table[..., 2]`, the last field of
# `Schedule.entries()`): each action's index in ACTION_NAMES.
FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = (
    ACTION_NAMES.index(name) for name in ("forward", "backward", "backward-input", "backward-weight")
)
GRID = [(p, k * p) for p in (1, 2, 4, 8) for k in (1, 2, 4)]
VARIANTS = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 1),
    ("interleaved", 2),
    ("interleaved", 3),
    ("zero_bubble", 1),
]


@pytest.mark.parametrize("name,chunks", VARIANTS)
@pytest.mark.parametrize("stages,microbatches", GRID)
def test_tables_are_valid_and_match_their_bubble_formula(name, chunks, stages, microbatches):
    s = schedule(name, stages=stages, microbatches=microbatches, chunks=chunks)
    eqxpar.pipeline.check_table(s)
    table = s.table
    assert table.shape[1:] == (stages, 3)
    # Each (micro-batch, virtual stage, action) exactly once.
    entries = s.entries()
    keys = [(mb, k, a) for _, _, mb, k, a in entries]
    assert len(keys) == len(set(keys))
    per_unit = 2 if name != "zero_bubble" else 3
    p, m, v = stages, microbatches, chunks
    # Interleaved splits the last virtual stage's last p - 1 backwards into input
    # and weight halves, the weight halves in the last device's closing idle ticks.
    split = min(p - 1, m) if name == "interleaved" else 0
    assert len(keys) == per_unit * microbatches * stages * chunks + split
    if name == "interleaved":
        halves = [(t, d, mb, k, a) for t, d, mb, k, a in entries if a in (BACKWARD_INPUT, BACKWARD_WEIGHT)]
        assert len(halves) == 2 * split
        assert all(d == p - 1 and k == p * v - 1 for _, d, _, k, _ in halves)
        # The weight halves come after the device's last backward.
        last_backward = max(t for t, d, _, _, a in entries if d == p - 1 and a == BACKWARD)
        assert all(t > last_backward for t, _, _, _, a in halves if a == BACKWARD_WEIGHT)
        # What it buys: the formula's bubble (Megatron's), or less.
        assert s.bubble_fraction <= (p - 1) / (v * m + p - 1) + 1e-12
    if name == "zero_bubble":
        # ZB-H1 under unit costs: a third of 1F1B's bubble when m >= p.
        assert s.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
        # Every action costs 1, so running in lockstep loses nothing.
        assert s.lockstep_bubble_fraction == pytest.approx(s.bubble_fraction)
    elif name != "interleaved":
        assert s.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    assert s.lockstep_bubble_fraction >= s.bubble_fraction - 1e-12
    if name == "gpipe":
        # Forward ticks and backward ticks never mix: lockstep costs what the table does.
        assert s.lockstep_bubble_fraction == pytest.approx(s.bubble_fraction)


@pytest.mark.parametrize("stages,microbatches", [(2, 2), (2, 8), (4, 4), (4, 8), (4, 16), (8, 16)])
def test_zero_bubble_beats_1f1b(stages, microbatches):
    zb = schedule("zero_bubble", stages=stages, microbatches=microbatches)
    ofob = schedule("1f1b", stages=stages, microbatches=microbatches)
    assert zb.bubble_fraction < ofob.bubble_fraction
    assert zb.lockstep_bubble_fraction < ofob.lockstep_bubble_fraction


def test_dependencies_hold_in_the_table():
    # Spelled out once for 1F1B: F of stage s after F of stage s - 1, B of stage s
    # after B of stage s + 1 (and after its own F; on the last stage in the same
    # fused tick, where the forward is folded into the backward).
    s = schedule("1f1b", stages=4, microbatches=8)
    tick = {(mb, k, a): t for t, _, mb, k, a in s.entries()}
    for mb in range(8):
        for k in range(4):
            if k:
                assert tick[(mb, k, 1)] > tick[(mb, k - 1, 1)]
            if k < 3:
                assert tick[(mb, k, 2)] > tick[(mb, k + 1, 2)]
            assert tick[(mb, k, 2)] > tick[(mb, k, 1)] or (k == 3 and tick[(mb, k, 2)] == tick[(mb, k, 1)])
    # A broken table is caught.
    g = schedule("gpipe", stages=4, microbatches=8)
    broken = eqxpar.pipeline.Schedule("gpipe", 4, 8, 1, g.table[::-1].copy())
    with pytest.raises(eqxpar.PlanError, match="before what it depends on"):
        eqxpar.pipeline.check_table(broken)


def test_in_flight_grows_with_stages_for_1f1b_and_with_microbatches_for_gpipe():
    for p in (2, 4, 8):
        # Fused 1F1B runs a forward 2 (p - 1) micro-batches ahead of the backward
        # beside it: fewer than 2p stage inputs held, the same for any m >= 2p.
        counts = [schedule("1f1b", stages=p, microbatches=k * p).in_flight for k in (1, 2, 4, 8)]
        assert max(counts) < 2 * p and counts[1:] == [counts[1]] * 3
        zb = [schedule("zero_bubble", stages=p, microbatches=k * p).in_flight for k in (2, 4, 8)]
        assert len(set(zb)) == 1 and zb[0] <= 2 * p - 1
        gpipe = [schedule("gpipe", stages=p, microbatches=k * p).in_flight for k in (1, 2, 4, 8)]
        assert gpipe == [k * p for k in (1, 2, 4, 8)]


def test_text_rendering():
    s = schedule("interleaved", stages=2, microbatches=2, chunks=2)
    text = str(s)
    lines = text.splitlines()
    assert lines[0].startswith("interleaved: 2 stages x 2 chunk(s), 2 micro-batches")
    assert "bubble 20.0%" in lines[0]
    assert (
        len(lines) == 3
        and lines[1].startswith("dev0")
        and "F0:0" in lines[1]
        and "I1:1" in lines[2]
        and "W1:1" in lines[2]
    )
    assert "I0" in str(schedule("zero_bubble", stages=2, microbatches=2))


def test_png(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    path = tmp_path / "zb.png"
    eqxpar.pipeline.save_schedule_png(schedule("zero_bubble", stages=4, microbatches=8), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(eqxpar.EqxparError, match=r"pip install eqxpar\[examples\]"):
        eqxpar.pipeline.save_schedule_png(schedule("1f1b", stages=2, microbatches=2), tmp_path / "x.png")


def test_bad_schedule_arguments():
    with pytest.raises(eqxpar.PlanError, match="'pipedream'"):
        schedule("pipedream", stages=2, microbatches=2)
    with pytest.raises(eqxpar.PlanError, match="only the 'interleaved' schedule"):
        schedule("1f1b", stages=2, microbatches=2, chunks=2)
    with pytest.raises(eqxpar.PlanError, match="multiple of 4"):
        schedule("interleaved", stages=4, microbatches=6, chunks=2)
    with pytest.raises(eqxpar.PlanError, match="microbatches=0"):
        schedule("gpipe", stages=2, microbatches=0)


def test_table_is_read_only():
    s = schedule("gpipe", stages=2, microbatches=2)
    assert isinstance(s.table, np.ndarray)
    with pytest.raises(ValueError):
        s.table[0, 0, 0] = 5


def _direction(sched, k, forward):
    """Which way virtual stage `k` sends its activation (`forward`) or cotangent:
    0 down (to the next device), 1 up, None nothing (none due, or the stage it
    goes to runs on the same device: the V's turn, stages p - 1 and p)."""
    p, last = sched.stages, sched.virtual_stages - 1
    if (forward and k == last) or (not forward and k == 0):
        return None
    if sched.placement != "v":  # activations always go down, cotangents up
        return 0 if forward else 1
    if (forward and k == p - 1) or (not forward and k == p):
        return None
    chunk = k // p if forward else (k - 1) // p  # the chunk the value travels in
    return 0 if forward == (chunk == 0) else 1


# DualPipeV needs 2 * stages micro-batches: its smaller sizes are no cases.
_LOOP_CASES = [
    (name, stages, microbatches)
    for name in ["gpipe", "1f1b", "interleaved", "zero_bubble", "zb_v", "dualpipe_v"]
    for stages, microbatches in [(2, 2), (2, 8), (4, 4), (4, 16), (8, 16)]
    if name != "dualpipe_v" or microbatches >= 2 * stages
]


@pytest.mark.parametrize(("name", "stages", "microbatches"), _LOOP_CASES)
@pytest.mark.parametrize("keep", [True, False])
def test_engine_loops_cover_the_ticks_with_their_sends(name, stages, microbatches, keep):
    """The engine runs the ticks in loops over repeating patterns of sends and
    branches: each tick once, in order, in a loop position whose sends are the
    tick's (a device sends an activation on at the end of a forward of any
    virtual stage but the last, and a cotangent back at the end of a backward or
    input half of any but the first: down and up along pipe, or under a V down
    in chunk 0 and up in chunk 1 for activations, the other way for cotangents,
    and nothing at the V's turn) and where each device runs the tick's branch:
    a position's switch is counted at what its ticks run, so the program's
    lockstep cost is the table's."""
    from eqxpar.pipeline._program import build_program, senders, tick_loops

    chunks = 2 if name == "interleaved" else 1
    sched = schedule(name, stages=stages, microbatches=microbatches, chunks=chunks)
    sends = senders(sched)
    due = [(set(), set()) for _ in range(sched.ticks)]
    for tick, device, _, k, kind in sched.entries():
        if kind == FORWARD or kind in (BACKWARD, BACKWARD_INPUT):
            way = _direction(sched, k, kind == FORWARD)
            if way is not None:
                assert device not in due[tick][way]  # one value each way per tick
                due[tick][way].add(device)
    assert [(set(f), set(b)) for f, b in sends] == due
    program = build_program(sched, keep)[0]
    covered = []
    loops = tick_loops(sched, program)
    for loop in loops:
        assert loop.count >= 1 and loop.period >= 1
        for position in range(loop.period):
            ticks = list(loop.ticks(position))
            for tick in ticks:
                assert sends[tick] == loop.sends[position], (tick, loop)
            assert (program[ticks, :, 0] == program[ticks[0], :, 0]).all(), (ticks, loop)
        covered += range(loop.start, loop.stop)
    assert covered == list(range(sched.ticks))
    # Steady states repeat: far fewer loops than ticks once m is several times p.
    if microbatches >= 4 * stages:
        assert len(loops) < sched.ticks // 2


@pytest.mark.parametrize(
    "name,chunks", [("interleaved", 2), ("zero_bubble", 1), ("1f1b", 1), ("zb_v", 2), ("dualpipe_v", 2)]
)
@pytest.mark.parametrize("stages,microbatches", [(2, 4), (4, 8), (4, 16), (8, 16)])
def test_residual_and_stash_slots_never_overlap(name, chunks, stages, microbatches):
    """Each kept residual set lives in its slot from the forward (a folded input
    half) that writes it to its last backward action, each stash from its `I` to
    its `W`; two that share a slot on a device never live at once (a write lands
    at the end of its tick, after that tick's reads). Stashes take slots of their
    own, as many as live at once: interleaved splits p - 1 backwards."""
    s = schedule(name, stages=stages, microbatches=microbatches, chunks=chunks)
    bufs = s.buffers
    # Each entry with its place in its tick (0: the table's action, 1: the fused one's).
    placed, seen = [], set()
    for tick, device, mb, k, kind in s.entries():
        placed.append((tick, device, mb, k, kind, int((tick, device) in seen)))
        seen.add((tick, device))
    for slots, count, kinds in (
        (bufs.residual_slot, bufs.residuals, None),
        (bufs.stash_slot, bufs.stashes, (BACKWARD_INPUT, BACKWARD_WEIGHT)),
    ):
        held: dict[tuple[int, int, int, int], list[int]] = {}  # (device, slot, mb, k): ticks
        for tick, device, mb, k, kind, i in placed:
            slot = int(slots[tick, device, i])
            assert -1 <= slot < max(count, 1)
            if slot >= 0 and (kinds is None or kind in kinds):
                held.setdefault((device, slot, mb, k), []).append(tick)
        lives: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for (device, slot, _, _), ticks in held.items():
            lives.setdefault((device, slot), []).append((min(ticks), max(ticks)))
        for intervals in lives.values():
            intervals.sort()
            for (_, end), (start, _) in itertools.pairwise(intervals):
                assert end <= start, intervals
    assert bufs.stashes <= max(bufs.residuals, 1)
    if name == "interleaved":
        assert bufs.stashes == min(stages - 1, microbatches)
    if name == "1f1b":
        assert bufs.stashes == 0


@pytest.mark.parametrize("name", ["zb_v", "dualpipe_v"])
def test_v_tables_deliver_along_lanes(name):
    """A V placement delivers two activations (or two cotangents) to one device in
    one tick, from the device before and the one after it: the buffers file them
    along two lanes into different slots. At the V's turn (device p - 1) stage
    p - 1 hands stage p its activation, and stage p hands p - 1 its cotangent, on
    the device (the local lane), which no device sends."""
    from eqxpar.pipeline._placement import DOWN, LOCAL, UP

    p, m = 4, 8
    s = schedule(name, stages=p, microbatches=m)
    bufs = s.buffers
    assert bufs.recv_input.shape == bufs.recv_cotangent.shape == (s.ticks, p, 3)
    twice = 0
    for received, count in ((bufs.recv_input, bufs.inputs), (bufs.recv_cotangent, bufs.cotangents)):
        both = (received[..., DOWN] >= 0) & (received[..., UP] >= 0)
        twice += int(both.sum())
        assert (received[both][:, DOWN] != received[both][:, UP]).all()
        assert received.max() < count
        # Only device p - 1 hands over locally, once per micro-batch each way.
        local = received[..., LOCAL] >= 0
        assert local[:, : p - 1].sum() == 0 and local[:, p - 1].sum() == m
        # Device 0's down lane brings nothing: nothing is before it (no wrap-around).
        assert (received[:, 0, DOWN] < 0).all() and (received[:, p - 1, UP] < 0).all()
    assert twice > 0
