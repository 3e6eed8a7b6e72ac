"""`eqxpar.pipeline.simulate`: step times of schedule tables from per-action times,
checked against cases worked by hand, against the tables' bubble fractions, and
over every built-in schedule; the V-placement tables (ZB-V, DualPipeV)."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eqxpar
from eqxpar.internal import COSTS
from eqxpar.pipeline import schedule, simulate

UNIT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
assert tuple(UNIT.values()) == COSTS[1:]


# --- Hand-computed small cases ------------------------------------------------------


def test_gpipe_p2_m2_by_hand():
    # dev0: F0 [0,1] F1 [1,2]; dev1: F0 [1,2] F1 [2,3] B0 [3,5] B1 [5,7];
    # dev0: B0 waits for dev1's B0: [5,7], B1 [7,9]. Work 2 x 2 x (1 + 2) = 12.
    sim = simulate(schedule("gpipe", stages=2, microbatches=2), UNIT)
    assert (sim.free_s, sim.lockstep_s, sim.work_s) == (9.0, 9.0, 12.0)
    assert sim.bubble_fraction == pytest.approx(1 / 3)
    # With a send time s every hop between devices costs s: the forward reaches
    # dev1 at 1 + s, dev1's B0 ends at 5 + s, dev0's B0 starts at 5 + 2s. In
    # lockstep, each of the 6 ticks pays s.
    sim = simulate(schedule("gpipe", stages=2, microbatches=2), UNIT, send=0.5)
    assert sim.free_s == pytest.approx(9 + 2 * 0.5)
    assert sim.lockstep_s == pytest.approx(9 + 6 * 0.5)


def test_1f1b_p2_m2_by_hand():
    # dev0: F0 F1 B0 B1; dev1: F0 B0 F1 B1, each backward fused into its
    # forward's tick. Free-running: dev1 F0 [1,2] B0 [2,4] F1 [4,5] B1 [5,7]; dev0
    # B0 [4,6] B1 [7,9]: 9, as GPipe. Lockstep ticks (F0 | F1, F0+B0 | B0, F1+B1 |
    # B1) cost 1 + 3 + 3 + 2 = 9: as GPipe (unfused, F0 | F1,F0 | B0 | B0,F1 | B1 |
    # B1 cost 10).
    s = schedule("1f1b", stages=2, microbatches=2)
    assert s.ticks == 4
    sim = simulate(s, UNIT)
    assert (sim.free_s, sim.lockstep_s, sim.work_s) == (9.0, 9.0, 12.0)
    assert sim.lockstep_bubble_fraction == pytest.approx(1 / 3)
    gpipe = simulate(schedule("gpipe", stages=2, microbatches=2), UNIT)
    assert sim.speedup_over(gpipe) == pytest.approx(1.0)
    assert sim.speedup_over(gpipe, lockstep=True) == pytest.approx(1.0)


def test_measured_costs_scale_and_zero_costs():
    s = schedule("zero_bubble", stages=4, microbatches=8)
    one = simulate(s, UNIT)
    # Times scale linearly; the fractions do not move.
    scaled = simulate(s, {k: 1e-3 * v for k, v in UNIT.items()})
    assert scaled.free_s == pytest.approx(1e-3 * one.free_s)
    assert scaled.bubble_fraction == pytest.approx(one.bubble_fraction)
    # Free weight passes: only F and I count.
    free_w = simulate(s, {"F": 1.0, "I": 1.0, "W": 0.0})
    assert free_w.work_s == pytest.approx(4 * 8 * 2)
    assert free_w.free_s <= one.free_s


def test_last_stage_time_by_hand():
    # The head on the last stage: dev1's F [1,3] [3,5], B [5,8] [8,11]; dev0's B0
    # waits for dev1's: [8,10], B1 [11,13]. Lockstep ticks 1, 2, 2, 3, 3, 2.
    s = schedule("gpipe", stages=2, microbatches=2)
    sim = simulate(s, {"F": 1.0, "B": 2.0}, last_stage={"F": 1.0, "B": 1.0})
    assert (sim.free_s, sim.lockstep_s, sim.work_s) == (13.0, 13.0, 16.0)
    assert simulate(s, {"F": 1.0, "B": 2.0}, last_stage={}).free_s == 9.0


@pytest.mark.parametrize("name,chunks", [("interleaved", 2), ("zero_bubble", 1), ("zb_v", 2)])
def test_last_stage_time_lands_on_the_last_virtual_stage(name, chunks):
    p, m, head = 4, 8, {"F": 0.5, "B": 1.0, "I": 0.5, "W": 0.5}
    s = schedule(name, stages=p, microbatches=m, chunks=chunks)
    plain, with_head = simulate(s, UNIT), simulate(s, UNIT, last_stage=head)
    # Each micro-batch's last-stage F and backward halves (or B) pay the head once.
    assert with_head.work_s == pytest.approx(plain.work_s + m * 1.5)
    # Lockstep pays the head where the last stage's device is the tick's costliest,
    # at most once per action it runs.
    assert plain.lockstep_s < with_head.lockstep_s <= plain.lockstep_s + m * 1.5 + 1e-9
    assert with_head.free_s > plain.free_s


def test_stage_layers_scale_each_virtual_stage():
    # GPipe p=2 m=2, stage 0 two layers, stage 1 one layer plus a head worth one:
    # dev0's F [0,2] [2,4]; dev1's F [2,4] [4,6], B [6,10] [10,14]; dev0's B0
    # [10,14], B1 [14,18]. Lockstep ticks 2, 2, 2, 4, 4, 4.
    s = schedule("gpipe", stages=2, microbatches=2)
    layer = {"F": 1.0, "B": 2.0}
    sim = simulate(s, layer, last_stage=layer, stage_layers=(2, 1))
    assert (sim.free_s, sim.lockstep_s, sim.work_s) == (18.0, 18.0, 24.0)
    # Equal counts of 1 are the plain costs; a head worth a layer, balanced by a
    # layer less on the last stage, brings lockstep back to the head-free bubble.
    assert simulate(s, layer, stage_layers=(1, 1)) == simulate(s, layer)
    s = schedule("1f1b", stages=4, microbatches=16)
    balanced = simulate(s, layer, last_stage=layer, stage_layers=(4, 4, 4, 3))
    assert balanced.lockstep_bubble_fraction == pytest.approx(s.lockstep_bubble_fraction)
    even = simulate(s, layer, last_stage=layer, stage_layers=(4, 4, 4, 4))
    assert even.lockstep_bubble_fraction > s.lockstep_bubble_fraction + 0.05
    with pytest.raises(eqxpar.PlanError, match=r"3 numbers, but the pipeline has 4 stages x 1 chunks"):
        simulate(s, layer, stage_layers=(1, 2, 1))
    with pytest.raises(eqxpar.PlanError, match=r"positive integer number of layers, got 0"):
        simulate(s, layer, stage_layers=(1, 2, 0, 1))


# --- Agreement with the tables' bubble fractions ----------------------------------------


@pytest.mark.parametrize(
    "name,chunks",
    [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("zb_v", 2), ("dualpipe_v", 2)],
)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_unit_costs_give_the_tables_bubble_fractions(name, chunks, p):
    s = schedule(name, stages=p, microbatches=4 * p, chunks=chunks)
    sim = simulate(s, UNIT)
    assert sim.bubble_fraction == pytest.approx(s.bubble_fraction)
    assert sim.lockstep_bubble_fraction == pytest.approx(s.lockstep_bubble_fraction)
    # F + B = F + I + W = 3 units for every (micro-batch, virtual stage).
    assert sim.work_s == pytest.approx(3 * 4 * p * p * chunks)
    # Lockstep never beats free-running; a send time only adds.
    assert sim.lockstep_s >= sim.free_s - 1e-9
    slow = simulate(s, UNIT, send=0.25)
    assert slow.free_s >= sim.free_s and slow.lockstep_s == pytest.approx(sim.lockstep_s + 0.25 * s.ticks)


def test_speedups_order_as_the_bubbles():
    p, m = 4, 16
    sims = {
        name: simulate(
            schedule(name, stages=p, microbatches=m, chunks=v), {k: c / v for k, c in UNIT.items()}
        )
        for name, v in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1), ("zb_v", 2)]
    }
    base = sims["gpipe"]
    free = {n: s.speedup_over(base) for n, s in sims.items()}
    # Free-running: 1F1B = GPipe (same bubble), then interleaved, ZB-H1, ZB-V.
    assert free["1f1b"] == pytest.approx(1.0)
    assert free["1f1b"] < free["interleaved"] < free["zero_bubble"] < free["zb_v"]
    # Lockstep: 1F1B's and interleaved's fused ticks (a forward and a backward on
    # every device of a steady tick) cost them nothing; nor do zero-bubble's unit
    # actions. The bounds at p = 4, m = 16: 1F1B <= GPipe's 0.158,
    # interleaved <= 0.09, zero-bubble <= 0.06.
    lock = {n: s.speedup_over(base, lockstep=True) for n, s in sims.items()}
    assert lock["1f1b"] == pytest.approx(1.0)
    assert 1.0 < lock["interleaved"] < lock["zero_bubble"] < lock["zb_v"]
    assert sims["1f1b"].lockstep_bubble_fraction <= 0.16
    assert sims["interleaved"].lockstep_bubble_fraction <= 0.09
    assert sims["zero_bubble"].lockstep_bubble_fraction <= 0.06


def test_lockstep_bubbles_order_for_every_size():
    """For p in {2, 4, 8} and m in {p, 2p, 4p}: in one SPMD program 1F1B is no
    worse than GPipe and interleaved (2 chunks) better than 1F1B."""
    for p in (2, 4, 8):
        for m in (p, 2 * p, 4 * p):
            bubble = {
                name: schedule(name, stages=p, microbatches=m, chunks=v).lockstep_bubble_fraction
                for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))
            }
            assert bubble["1f1b"] <= bubble["gpipe"] + 1e-12, (p, m, bubble)
            assert bubble["interleaved"] < bubble["1f1b"], (p, m, bubble)


# --- Costs validation ---------------------------------------------------------------------


def test_bad_costs_raise_naming_the_value():
    s = schedule("zero_bubble", stages=2, microbatches=2)
    err = eqxpar.PipelineScheduleError
    with pytest.raises(err, match=r"no time for \['I', 'W'\].*Add"):
        simulate(s, {"F": 1.0, "B": 2.0})
    with pytest.raises(err, match=r"costs\['F'\]=-1.0.*finite time >= 0"):
        simulate(s, {"F": -1.0, "I": 1.0, "W": 1.0})
    with pytest.raises(err, match=r"costs\['W'\]=inf"):
        simulate(s, {"F": 1.0, "I": 1.0, "W": math.inf})
    with pytest.raises(err, match=r"costs\['I'\]='1'.*number of seconds"):
        simulate(s, {"F": 1.0, "I": "1", "W": 1.0})
    with pytest.raises(err, match=r"unknown key\(s\) \['X'\]"):
        simulate(s, {"F": 1.0, "I": 1.0, "W": 1.0, "X": 1.0})
    with pytest.raises(err, match=r"send=nan"):
        simulate(s, {"F": 1.0, "I": 1.0, "W": 1.0}, send=math.nan)
    with pytest.raises(err, match="expected a mapping"):
        simulate(s, [1.0, 2.0])
    with pytest.raises(err, match=r"last_stage\['F'\]=-0.5.*finite time >= 0"):
        simulate(s, UNIT, last_stage={"F": -0.5})
    with pytest.raises(err, match=r"simulate\(last_stage=.*unknown key\(s\) \['head'\]"):
        simulate(s, UNIT, last_stage={"head": 1.0})
    with pytest.raises(err, match="expected an eqxpar.pipeline.Schedule"):
        simulate("1f1b", UNIT)
    assert issubclass(err, eqxpar.PlanError)
    # GPipe runs no I or W: F and B are enough.
    assert simulate(schedule("gpipe", stages=2, microbatches=2), {"F": 1.0, "B": 2.0}).free_s == 9.0


# --- V placement: ZB-V and DualPipeV -----------------------------------------------------


def test_v_tables_validate_and_beat_1f1b():
    p, m = 4, 16
    ofob = schedule("1f1b", stages=p, microbatches=m)
    zb_h1 = schedule("zero_bubble", stages=p, microbatches=m)
    zbv = schedule("zb_v", stages=p, microbatches=m)
    dpv = schedule("dualpipe_v", stages=p, microbatches=m)
    for s in (zbv, dpv):
        eqxpar.pipeline.validate(s)
        assert s.placement == "v" and s.chunks == 2
        # Device d holds virtual stages d and 2p - 1 - d: the first and last on device 0.
        assert [s.stage_of(d, c) for d in range(p) for c in (0, 1)] == [0, 7, 1, 6, 2, 5, 3, 4]
        assert s.bubble_fraction < zb_h1.bubble_fraction < ofob.bubble_fraction
    # ZB-V (I, W split everywhere, all unit costs) reaches the floor of any table
    # under this cost model: the last device cannot start before p - 1 chunk
    # forwards, and every device has 6m unit actions: (p - 1) / (6m + p - 1), half
    # of ZB-H1's (p - 1) / (3m + p - 1). The ZB paper's "zero bubble" for ZB-V
    # leaves out this warm-up, which no schedule fills.
    assert zbv.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
    assert zbv.lockstep_bubble_fraction == pytest.approx(zbv.bubble_fraction)
    # DualPipeV reaches the same free-running floor; in lockstep its full backwards
    # (cost 2) share ticks with forwards (cost 1), which costs it.
    assert dpv.bubble_fraction == pytest.approx((p - 1) / (6 * m + p - 1))
    assert zbv.lockstep_bubble_fraction < dpv.lockstep_bubble_fraction < ofob.lockstep_bubble_fraction
    # Memory: stage inputs held, in chunks (half a stage each): 10 at p = 4, i.e.
    # 5 stages' worth, as fused 1F1B's 2p - 3 (the V holds 2p + 2 chunk inputs).
    assert zbv.in_flight == dpv.in_flight == 2 * p + 2
    assert ofob.in_flight == 2 * p - 3


def test_v_tables_render_and_plans_take_them():
    s = schedule("zb_v", stages=2, microbatches=4)
    assert "V placement" in str(s).splitlines()[0] and "placement='v'" in repr(s)
    mesh = eqxpar.make_mesh(pipe=2)
    # Two chunks implied (or given as 2), stored in the V's order.
    for name in ("zb_v", "dualpipe_v"):
        for chunks in (1, 2):
            plan = eqxpar.Plan(mesh, schedule=name, microbatches=4, chunks=chunks)
            assert plan.chunks == 2 and plan.placement == "v"
            assert plan.stack_order(8).placement == "v"
    assert eqxpar.Plan(mesh, schedule="zero_bubble", microbatches=4).placement == "loop"
    # A V table of the user's runs too, with its two chunks.
    assert eqxpar.Plan(mesh, schedule=s).chunks == 2
    with pytest.raises(eqxpar.PlanError, match=r"chunks=3\): 'zb_v' runs two chunks.*chunks=2"):
        eqxpar.Plan(mesh, schedule="zb_v", microbatches=4, chunks=3)
    with pytest.raises(eqxpar.PlanError, match=r"microbatches=3\): DualPipeV needs at least 2 \* pipe = 4"):
        eqxpar.Plan(mesh, schedule="dualpipe_v", microbatches=3)
    with pytest.raises(eqxpar.PlanError, match="at least 2 \\* stages = 8"):
        schedule("dualpipe_v", stages=4, microbatches=6)
    with pytest.raises(eqxpar.PlanError, match="always runs two chunks"):
        schedule("zb_v", stages=4, microbatches=8, chunks=3)
    assert eqxpar.internal.PREDICTION_SCHEDULES == ()
    assert {"zb_v", "dualpipe_v"} <= set(eqxpar.pipeline.SCHEDULES)


# --- Every built-in schedule, many sizes ---------------------------------------------------

NAMES = [
    ("gpipe", 1),
    ("1f1b", 1),
    ("interleaved", 1),
    ("interleaved", 2),
    ("zero_bubble", 1),
    ("zb_v", 2),
    ("dualpipe_v", 2),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(NAMES), st.integers(2, 8), st.integers(0, 100))
def test_every_builtin_schedule_validates_and_simulates(name_chunks, p, pick):
    name, chunks = name_chunks
    low = 2 * p if name == "dualpipe_v" else p
    m = low + pick % (4 * p - low + 1)
    if name == "interleaved" and chunks > 1:
        m = p * max(1, m // p)
    s = schedule(name, stages=p, microbatches=m, chunks=chunks)
    eqxpar.pipeline.check_table(s)
    sim = simulate(s, UNIT, send=0.1)
    assert 0 <= sim.bubble_fraction < 1 and 0 <= sim.lockstep_bubble_fraction < 1
    assert sim.work_s == pytest.approx(p * chunks * m * 3)
    assert sim.free_s >= sim.work_s / p


def test_prediction_benchmark_runs(tmp_path):
    from benchmarks import pipeline_prediction

    out = tmp_path / "prediction.json"
    rows = pipeline_prediction.main(["--json", str(out)])
    sources = {
        label: json.loads((pipeline_prediction.RESULTS / name).read_text())["stage_actions"]
        for name, label in pipeline_prediction.SOURCES
    }
    # Per source, its stages (a chunk is not one) x 2 engine models x 2 pipeline sizes x 6 schedules.
    stages = sum(not name.endswith("_chunk") for measured in sources.values() for name in measured)
    assert len(rows) == stages * 2 * 2 * 6
    assert all(r["speedup_free"] == 1.0 for r in rows if r["schedule"] == "gpipe")
    assert '"send_s": 0.0' in out.read_text()
    # A two-chunk schedule runs the chunk's measured actions where the source has
    # them: interleaved runs each of its p * 2 chunks' m forwards and backwards.
    checked = 0
    for r in rows:
        chunk = sources[r["device"]].get(r["stage"].removesuffix("_unrolled") + "_chunk")
        if r["schedule"] == "interleaved" and r["model"] == "residuals kept" and chunk:
            t = chunk["seconds"]
            want = r["stages"] * 2 * r["microbatches"] * (t["F_keep"] + t["B"])
            # The last virtual stage's last p - 1 backwards run as split halves.
            halves = ("I_split", "W_split") if "I_split" in t else ("I", "W")
            want += (r["stages"] - 1) * (t[halves[0]] + t[halves[1]] - t["B"])
            assert r["work_s"] == pytest.approx(want)
            checked += 1
    assert checked >= 4  # the H200's stages, each at p = 4 and 8


def test_a_pipeline_record_states_the_prediction_table_row():
    from benchmarks import pipeline_prediction

    rows = pipeline_prediction.predict(
        [
            (label, json.loads((pipeline_prediction.RESULTS / name).read_text()))
            for name, label in pipeline_prediction.SOURCES
        ]
    )
    for name, chunks in (("gpipe", 1), ("interleaved", 2), ("zero_bubble", 1)):
        record = pipeline_prediction.speedup_over_gpipe(name, stages=4, microbatches=16, chunks=chunks)
        stated = 0
        for row in rows:
            got = record[row["device"]].get(row["stage"])
            if row["schedule"] == name and row["stages"] == 4 and row["model"] == "residuals kept" and got:
                assert got == {"free": row["speedup_free"], "lockstep": row["speedup_lockstep"]}
                assert name != "gpipe" or got == {"free": 1.0, "lockstep": 1.0}
                stated += 1
        # Each source's two record stages (the workload's, the wide one unrolled).
        assert stated == 2 * len(pipeline_prediction.SOURCES)
