"""User-supplied schedules: `Schedule.from_table` / `from_orders`, validated before
anything compiles (every error names the tick and device, or the blocked devices
of a deadlock), and run by `Plan(schedule=Schedule)` with the gradients of one
device."""

import re

import equinox as eqx
import jax
import numpy as np
import pytest

import eqxpar
from eqxpar.pipeline import Schedule, check_table, schedule, validate

from ._helpers import Tiny, assert_trees_close, regression_batch, tiny_loss

FWD, BWD, INP, WGT = 1, 2, 3, 4
IDLE = (-1, -1, 0)  # an idle cell
# 1F1B on 2 stages, 2 micro-batches, written by hand: [tick][device] = (mb, chunk, action).
TABLE = [
    [(0, 0, FWD), IDLE],
    [(1, 0, FWD), (0, 0, FWD)],
    [IDLE, (0, 0, BWD)],
    [(0, 0, BWD), (1, 0, FWD)],
    [IDLE, (1, 0, BWD)],
    [(1, 0, BWD), IDLE],
]
ERR = eqxpar.PipelineScheduleError


def test_from_table_and_from_orders_give_the_builtin_table():
    # The classic (unfused) 1F1B table: the built-in "1f1b" fuses each backward
    # into a forward's tick, which from_orders (one action a tick) does not.
    ofob = Schedule("1f1b", 2, 2, 1, np.array(TABLE, np.int32))
    a = Schedule.from_table(TABLE, stages=2, microbatches=2)
    b = Schedule.from_orders([["F0", "F1", "B0", "B1"], ["F0", "B0", "F1", "B1"]], microbatches=2)
    c = Schedule.from_orders(
        [[(FWD, 0), ("F", 1), ("b", 0, 0), (BWD, 1)], ["F0:0", "B0", "F1", "B1"]], microbatches=2
    )
    for s in (a, b, c):
        np.testing.assert_array_equal(s.table, ofob.table)
        assert s.name == "custom" and s.bubble_fraction == ofob.bubble_fraction
        assert not s.table.flags.writeable
    # Idle cells' micro-batch and chunk are ignored and stored as -1.
    loose = np.array(TABLE)
    loose[0, 1] = (0, 0, 0)
    np.testing.assert_array_equal(Schedule.from_table(loose, stages=2, microbatches=2).table, ofob.table)


def _table_error(edit, match):
    table = np.array(TABLE)
    edit(table)
    with pytest.raises(ERR, match=match):
        Schedule.from_table(table, stages=2, microbatches=2, name="mine")


def test_table_errors_name_the_tick_and_device():
    def set_(tick, device, value):
        return lambda t: t.__setitem__((tick, device), value)

    _table_error(set_(3, 0, (0, 0, 7)), r"'mine'.*tick 3, device 0: action code 7; expected 0 \(idle\)")
    _table_error(set_(3, 0, (2, 0, BWD)), r"tick 3, device 0: backward of micro-batch 2; expected 0 to 1")
    _table_error(set_(3, 0, (0, 1, BWD)), r"tick 3, device 0: backward of chunk 1")
    # The same action twice: both places named.
    _table_error(
        set_(5, 0, (0, 0, BWD)),
        r"tick 5, device 0: the backward of micro-batch 0 at virtual stage 0 "
        r"runs twice \(first at tick 3, device 0\)",
    )
    # Missing: no tick to name, the device that should run it.
    _table_error(
        set_(5, 0, IDLE),
        r"micro-batch 1 at virtual stage 0 \(device 0, chunk 0\) has \['forward'\]; "
        "it needs a backward",
    )
    # An I without its W; a B and an I for one unit.
    _table_error(set_(5, 0, (1, 0, INP)), r"micro-batch 1 at virtual stage 0 .* it needs its backward-weight")
    _table_error(
        set_(4, 0, (1, 0, INP)), r"micro-batch 1 at virtual stage 0 .* it needs one backward: either"
    )

    # A forward in the tick its input is sent: usable only from the next tick.
    def same_tick(t):
        t[0, 1] = (0, 0, FWD)
        t[1, 1] = IDLE

    _table_error(
        same_tick,
        r"tick 0, device 1: the forward of micro-batch 0 at virtual stage 1 runs before what it depends "
        r"on: the forward of micro-batch 0 at virtual stage 0, at tick 0 on device 0 \(its output is "
        r"usable from the next tick\). Move it to tick 1 or later",
    )

    # A backward before the next stage's: the cotangent is not there yet.
    def early_backward(t):
        t[3, 0] = IDLE
        t[2, 0] = (0, 0, BWD)

    _table_error(
        early_backward,
        r"tick 2, device 0: the backward of micro-batch 0 at virtual stage 0 runs before "
        r"what it depends on: the backward \(or backward-input\) of micro-batch 0 at virtual stage 1, "
        r"at tick 2 on device 1",
    )
    with pytest.raises(ERR, match=r"shape \(6, 2, 2\); expected \(ticks, 2, 3\)"):
        Schedule.from_table(np.array(TABLE)[..., :2], stages=2, microbatches=2)
    with pytest.raises(ERR, match="dtype float64; expected integers"):
        Schedule.from_table(np.array(TABLE) + 0.5, stages=2, microbatches=2)
    with pytest.raises(ERR, match=r"microbatches=0\): expected a positive integer"):
        Schedule.from_table(TABLE, stages=2, microbatches=0)
    with pytest.raises(ERR, match="placement='w'"):
        Schedule.from_table(TABLE, stages=2, microbatches=2, placement="w")


def test_weight_pass_before_its_input_pass():
    # Zero-bubble on 2 stages: device 0 runs W0 one tick before its I0.
    zb = schedule("zero_bubble", stages=2, microbatches=2)
    table = np.array(zb.table)
    (t_i,) = [t for t in range(zb.ticks) if tuple(table[t, 0]) == (0, 0, INP)]
    (t_w,) = [t for t in range(zb.ticks) if tuple(table[t, 0]) == (0, 0, WGT)]
    table[t_i, 0], table[t_w, 0] = table[t_w, 0].copy(), table[t_i, 0].copy()
    with pytest.raises(
        ERR,
        match=rf"tick {t_i}, device 0: the backward-weight of micro-batch 0 .* runs before "
        rf"what it depends on: the backward \(or backward-input\) of micro-batch 0 at virtual "
        rf"stage 0, at tick {t_w} on device 0",
    ):
        Schedule.from_table(table, stages=2, microbatches=2)


def test_order_errors_and_deadlock():
    with pytest.raises(ERR, match=r"device 1, position 2 of its order: action 'X1' has kind 'X'"):
        Schedule.from_orders([["F0", "F1", "B0", "B1"], ["F0", "B0", "X1", "B1"]], microbatches=2)
    with pytest.raises(ERR, match=r"device 0, position 3 of its order: action 'B5' has micro-batch 5"):
        Schedule.from_orders([["F0", "F1", "B0", "B5"], ["F0", "B0", "F1", "B1"]], microbatches=2)
    with pytest.raises(
        ERR, match=r"device 0, position 4 of its order: the forward of micro-batch 1 .* runs twice"
    ):
        Schedule.from_orders([["F0", "F1", "B0", "B1", "F1"], ["F0", "B0", "F1", "B1"]], microbatches=2)
    with pytest.raises(
        ERR, match=r"micro-batch 1 at virtual stage 1 \(device 1, chunk 0\) has \['forward'\]"
    ):
        Schedule.from_orders([["F0", "F1", "B0", "B1"], ["F0", "B0", "F1"]], microbatches=2)
    # Device 0 waits for device 1's B0, device 1 runs B1 before its F1: stuck.
    with pytest.raises(ERR, match="deadlock") as info:
        Schedule.from_orders([["F0", "B0", "F1", "B1"], ["F0", "B1", "B0", "F1"]], microbatches=2)
    text = str(info.value)
    assert re.search(
        r"device 0 at position 1 of its order, B0:0 .* waits for the backward \(or "
        r"backward-input\) of micro-batch 0 at virtual stage 1 \(device 1\)",
        text,
    ), text
    assert re.search(
        r"device 1 at position 1 of its order, B1:0 .* waits for the forward of micro-batch 1 "
        r"at virtual stage 1 \(device 1\)",
        text,
    ), text
    with pytest.raises(ERR, match="one sequence of actions per device"):
        Schedule.from_orders("F0 B0", microbatches=1)


def test_check_table_is_validate():
    s = schedule("1f1b", stages=4, microbatches=8)
    broken = Schedule("1f1b", 4, 8, 1, s.table[::-1].copy(), fused=s.fused[::-1].copy())
    for check in (check_table, validate, Schedule.validate):
        with pytest.raises(ERR, match="before what it depends on"):
            check(broken)
    # A fused tick must pair a forward with a backward-direction action.
    table, fused = np.array(s.table), np.array(s.fused)
    tick, device = np.argwhere(fused[..., 2] == 2)[0]
    table[tick, device, 2] = 2
    with pytest.raises(ERR, match="must pair with a first one going the other way"):
        validate(Schedule("1f1b", 4, 8, 1, table, fused=fused))


def test_plan_takes_a_schedule_object():
    mesh = eqxpar.make_mesh(pipe=2)
    s = Schedule.from_table(TABLE, stages=2, microbatches=2)
    plan = eqxpar.Plan(mesh, schedule=s)
    assert plan.schedule is s and (plan.microbatches, plan.chunks) == (2, 1)
    assert eqxpar.Plan(mesh, schedule=s, microbatches=2).microbatches == 2
    with pytest.raises(eqxpar.PlanError, match=r"microbatches=4\): the table has microbatches=2"):
        eqxpar.Plan(mesh, schedule=s, microbatches=4)
    with pytest.raises(eqxpar.PlanError, match="the table has 2 stages but the mesh's 'pipe' axis has 4"):
        eqxpar.Plan(eqxpar.make_mesh(pipe=4), schedule=s)
    flat = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(2, 1), ("data", "tensor"))
    with pytest.raises(eqxpar.PlanError, match=r"mesh has axes \('data', 'tensor'\)"):
        eqxpar.Plan(flat, schedule=s)
    # A broken table is caught by the plan, before any compile.
    broken = Schedule("mine", 2, 2, 1, np.array(TABLE, np.int32)[::-1].copy())
    with pytest.raises(ERR, match="before what it depends on"):
        eqxpar.Plan(mesh, schedule=broken)


def _parity(sched, *, chunks=1):
    stages, microbatches = sched.stages, sched.microbatches
    loss = tiny_loss()
    model = Tiny(stages * chunks, key=jax.random.key(3))
    batch = regression_batch(2 * microbatches)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, batch)
    mesh = eqxpar.make_mesh(pipe=stages)
    plan = eqxpar.Plan(mesh, rules=eqxpar.pipeline.stage_rules(), schedule=sched)
    stored = eqxpar.shard(model, plan)
    value, grads = eqxpar.train.make_value_and_grad(loss, plan)(stored, batch)
    grads = eqxpar.nn.in_natural_order(grads)
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close(grads, ref_grads)


def test_custom_1f1b_variant_matches_one_device():
    # 1F1B with one extra warm-up forward on the first stage, and the last stage
    # splitting micro-batch 1's backward into I and W (a mix the engine runs).
    orders = [
        ["F0", "F1", "F2", "B0", "F3", "B1", "B2", "B3"],
        ["F0", "B0", "F1", "I1", "F2", "W1", "B2", "F3", "B3"],
    ]
    s = Schedule.from_orders(orders, microbatches=4, name="eager_1f1b")
    assert s.in_flight == 3
    _parity(s)


def test_custom_interleaved_table_matches_one_device():
    # A hand-ordered interleaved table (2 stages x 2 chunks): all forwards in
    # chunk order, then all backwards; the engine's layout (stage chunk * p + d).
    orders = [
        ["F0:0", "F1:0", "F0:1", "F1:1", "B0:1", "B1:1", "B0:0", "B1:0"],
        ["F0:0", "F1:0", "F0:1", "B0:1", "F1:1", "B1:1", "B0:0", "B1:0"],
    ]
    s = Schedule.from_orders(orders, microbatches=2, chunks=2)
    _parity(s, chunks=2)
