"""The benchmark harness on small models: its model layouts are the workload's
function, the contracts `benchmarks.run` checks hold on small records, and the
Markdown tables render. Nothing here reads committed numbers or is timed."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxpar
from benchmarks import (
    _action_flops,
    _handwritten_sp,
    _measure,
    _workload,
    compiled_figures,
    contracts,
    report,
    run,
)
from benchmarks._strategies import MEMORY_ONLY, STANDARD, STRATEGIES

from ._helpers import RTOL, assert_trees_close, assert_trees_close_to_scale

# The workload's structure at a size that compiles in seconds; 4 heads and a
# sequence of 8 divide over tensor 4, and 32 rows give every pipeline one row per
# micro-batch.
SMALL = _workload.Config(vocab=64, d_model=32, layers=2, heads=4, mlp=64, seq_len=8, batch=32)


def test_workload_has_the_published_parameter_count():
    model = eqx.filter_eval_shape(_workload.make_model)
    per_layer = 2 * 512 + (256 * 768 + 768) + (256 * 256 + 256) + (256 * 1024 + 1024) + (1024 * 256 + 256)
    expected = 512 * 256 + 128 * 256 + 4 * per_layer + 512 + 256 * 512
    assert _workload.param_count(model) == expected == _workload.PARAM_COUNT == 3_454_464


def test_pipeline_loss_is_the_workloads():
    # The three pipeline pieces make the workload's loss, and reordering the blocks
    # for a pipeline only moves arrays (so it maps gradients too): every stacked
    # leaf holds the same blocks, in another order.
    model = _workload.make_model(SMALL)
    batch = _workload.make_batches(1, SMALL)[0]
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(_workload.loss_fn))(model, batch)
    got_loss, got_grads = eqx.filter_jit(eqx.filter_value_and_grad(_workload.PIPELINE_LOSS))(model, batch)
    assert_trees_close(got_loss, loss)
    assert_trees_close_to_scale(got_grads, grads)
    model = _workload.make_model(dataclasses.replace(SMALL, layers=4))
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2), rules=eqxpar.pipeline.stage_rules(), schedule="interleaved", chunks=2
    )
    reordered = eqxpar.nn.in_plan_order(model, plan)
    blocks = lambda m: jax.tree.leaves(eqx.filter(m.blocks, eqx.is_array))  # noqa: E731
    for got, want in zip(blocks(reordered), blocks(model), strict=True):
        assert sorted(map(bytes, np.asarray(got))) == sorted(map(bytes, np.asarray(want)))
    assert not all(np.array_equal(a, b) for a, b in zip(blocks(reordered), blocks(model), strict=True))


def test_handwritten_sp_step_is_the_workload():
    # The step tp_sp is timed against computes the workload's loss and gradients
    # (read back from AdamW's first moment after its first step).
    model = _workload.make_model(SMALL)
    batch = _workload.make_batches(1, SMALL)[0]
    step = _handwritten_sp.HandwrittenSP(
        model, _workload.make_optimizer(SMALL), eqxpar.make_mesh(data=2, tensor=4)
    )
    loss, grads = step(step.put_batch(batch)), _measure.adam_gradients(step.opt_state)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(_workload.loss_fn))(model, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, _handwritten_sp.params_of(ref_grads), rtol=1e-5)


def test_minimum_is_the_librarys_count():
    # DP: one ring all-reduce of the gradients. TP (Megatron): per layer, the
    # attention and MLP outputs forward and their inputs' cotangents backward,
    # plus the data-axis all-reduce of the local parameters.
    optim = _workload.make_optimizer(SMALL)
    model = _workload.make_model(SMALL)
    dp = STRATEGIES["dp"](model, optim, SMALL).minimum(model, SMALL)
    param_bytes = 4 * _workload.param_count(model)
    assert (dp.total_bytes, dp.total_wire_bytes) == (param_bytes, 2 * 7 * param_bytes // 8)
    setup = STRATEGIES["tp"](model, optim, SMALL)
    tp = setup.minimum(model, SMALL)
    # One device's share of the parameters: Megatron splits the blocks' QKV, output
    # and MLP weights (and the QKV and MLP-up biases) over tensor 4.
    d, mlp, layers = SMALL.d_model, SMALL.mlp, SMALL.layers
    split = layers * (3 * d * d + 3 * d + d * d + d * mlp + mlp + mlp * d)
    local = 4 * (_workload.param_count(model) - split + split // 4)
    activation = SMALL.batch // 2 * SMALL.seq_len * SMALL.d_model * 4
    assert tp.total_bytes == 4 * SMALL.layers * activation + local
    assert tp.total_wire_bytes == 4 * SMALL.layers * (2 * 3 * activation // 4) + local


# cp (ring) in make test-slow: 25 s on 2 cores; test_context_parallel holds the ring's
# bytes to the minimum and its parity in make test.
@pytest.mark.parametrize("name", ["fsdp_manual", pytest.param("cp", marks=pytest.mark.slow)])
def test_small_record_meets_its_contract(name):
    # What `benchmarks.run` checks, on a small model: wire bytes within 1.05 x the
    # library's minimum (the ring: of the minimum plus its second K/V pass) and no
    # more than the baseline's where there is one, parity with one device; the ring's
    # memory flat as sequence and context grow together.
    references = run.References(_workload.make_optimizer(SMALL), 2)
    record = run.measure(name, references, warm=0, timed=1, cfg=SMALL)
    assert contracts.broken(record, {name: record}, timing=False) == []
    # The loss to the suite's float32 contract (RTOL: a sum reordered by the split
    # and by the CPU's vector width), as assert_trees_close holds every loss.
    assert record["parity_loss_rel_err"] <= RTOL and record["comm_wire_bytes_total"] > 0
    json.dumps(record)  # JSON-ready


# zero_bubble, interleaved and the V schedules in make test-slow (a minute of
# compiles between the first two on 2 cores): 1f1b with remat runs the same
# table-against-FLOPs comparison.
_SCHEDULES_SLOW = [
    ("zero_bubble", 1, "none"),
    ("interleaved", 2, "none"),
    ("zb_v", 2, "none"),
    ("dualpipe_v", 2, "none"),
]


@pytest.mark.parametrize(
    ("name", "chunks", "remat"),
    [*(pytest.param(*case, marks=pytest.mark.slow) for case in _SCHEDULES_SLOW), ("1f1b", 1, "full")],
)
def test_pipeline_program_runs_its_table_at_each_actions_flops(name, chunks, remat):
    # `_action_flops` compiles each action on one device: the split backward's
    # halves run the backward once (I + W = B), the input half more than the weight
    # half (the attention's activation gradients), and the head adds to each of the
    # last stage's actions. Priced at those FLOPs, the table is what the pipeline
    # step compiled on pipe 2 runs in lockstep (the pp records hold it to 1 %);
    # recomputing each forward in its backward (remat "full") runs a third more.
    cfg, p, m, data = dataclasses.replace(SMALL, layers=4), 2, 4, 4
    flops = _action_flops.action_flops(cfg, layers=cfg.layers // (p * chunks), rows=cfg.batch // (m * data))
    stage, head = flops["stage"], flops["head"]
    assert stage["I"] + stage["W"] == stage["B"] and stage["I"] > stage["F"] > stage["W"] > 0
    assert head["F"] > 0 and head["I"] + head["W"] == head["B"]
    ratio = _program_over_table(cfg, flops, name, chunks, remat=remat, p=p, m=m, data=data)
    assert ratio == pytest.approx(1.0, abs=0.01) if remat == "none" else ratio > 1.25, ratio


@pytest.mark.parametrize(
    ("name", "chunks", "layers"),
    # All three slow (20-150 s each on 2 cores): `make test-slow`. Uneven stages'
    # parity runs in `make test` (tests/test_pipeline.py: DualPipeV at pipe 2, and
    # 1F1B under remat).
    [
        pytest.param("zero_bubble", 1, (2, 1), marks=pytest.mark.slow),
        pytest.param("interleaved", 2, (1, 2, 2, 1), marks=pytest.mark.slow),
        pytest.param("zb_v", 2, (2, 1, 1, 2), marks=pytest.mark.slow),
    ],
)
def test_uneven_stages_run_their_table_at_each_layers_flops(name, chunks, layers):
    # Plan(stage_layers=...): each stage's branch runs its own layers, none of its
    # chunk's padding slots, so the step runs the table priced at one layer's
    # per-action FLOPs times each virtual stage's count (the pp_*_uneven records).
    cfg, p, m, data = dataclasses.replace(SMALL, layers=sum(layers)), 2, 4, 4
    flops = _action_flops.action_flops(cfg, layers=1, rows=cfg.batch // (m * data))
    ratio = _program_over_table(cfg, flops, name, chunks, layers=layers, p=p, m=m, data=data)
    assert ratio == pytest.approx(1.0, abs=0.01)


def _program_over_table(cfg, flops, name, chunks, *, p, m, data, remat="none", layers=None):
    """The compiled pipeline step's lockstep matmul FLOPs over its table priced at
    `flops` (pipe `p` x data `data`, `m` micro-batches; `layers`: Plan(stage_layers=))."""
    options = {"schedule": name, "microbatches": m, "chunks": chunks, "remat": remat, "stage_layers": layers}
    plan = eqxpar.Plan(eqxpar.make_mesh(pipe=p, data=data), rules=eqxpar.pipeline.stage_rules(), **options)
    optim = _workload.make_optimizer(cfg)
    step = eqxpar.train.make_step(_workload.PIPELINE_LOSS, optim, plan)
    model = eqxpar.nn.in_plan_order(_workload.make_model(cfg), plan)  # the runner places it as given
    compiled = _measure.EqxparRunner(step, plan, model, optim, _workload.make_batches(1, cfg)).compile()
    sched = eqxpar.pipeline.schedule(name, stages=p, microbatches=m, chunks=chunks)
    table = _action_flops.pipeline_table_flops(sched, flops, layers)
    return eqxpar.inspect.matmul_flops(compiled) / table.lockstep_s


def test_first_step_gradients_read_back_from_adam():
    # The harness reads a step's gradients from AdamW's first moment after its first
    # call (the small records above check them against one device); only one step old.
    optim = _workload.make_optimizer()
    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)}
    grads = {"w": jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), "b": jnp.full(3, 1e-3)}
    _, state = optim.update(grads, optim.init(params), params)
    for a, b in zip(jax.tree.leaves(_measure.adam_gradients(state)), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    _, state = optim.update(grads, state, params)
    with pytest.raises(ValueError, match="2 steps old"):
        _measure.adam_gradients(state)
    with pytest.raises(ValueError, match="one AdamW state"):
        _measure.adam_gradients(())


def test_memory_only_compile_measures_the_same_bytes():
    # The pipeline memory sweep compiles without LLVM optimisation: buffer
    # assignment, hence memory_analysis, must not change.
    def f(x, w):
        return jax.lax.scan(lambda h, _: (jax.nn.gelu(h @ w), h), x, None, length=4)

    grad = jax.jit(jax.grad(lambda x, w: jnp.sum(f(x, w)[1]), argnums=1))
    lowered = grad.lower(jnp.ones((64, 128)), jnp.ones((128, 128)))
    assert _measure.memory(lowered.compile(compiler_options=MEMORY_ONLY)) == _measure.memory(
        lowered.compile()
    )


def _record(name: str, **fields) -> dict:
    record = {
        "strategy": name,
        "mesh": {"data": 8},
        "step_time_s": 1.1,
        "baseline_step_time_s": 1.0,
        "comm_bytes": {"all-reduce": 13_817_860},
        "comm_counts": {"all-reduce": 1},
        "comm_bytes_total": 13_817_860,
        "comm_bytes_min": 13_817_856,
        "comm_wire_bytes_total": 24_181_255,
        "comm_wire_bytes_min": 24_181_248,
        "comm_wire_bytes_baseline": 24_181_255,
        "mem_argument_bytes": 41_457_680,
        "mem_temp_bytes": 64_119_344,
        "parity_max_rel_err": 6e-7,
        "trajectory_params_rel_err": 1.8e-4,
        "contract": dict(STANDARD),
    }
    return {**record, **fields}


def test_contracts_name_the_clauses_a_record_breaks():
    good = _record("dp")
    assert contracts.broken(good, {"dp": good}) == []
    bad = _record("dp", comm_wire_bytes_total=30_000_000, parity_max_rel_err=1e-3)
    assert contracts.broken(bad, {"dp": bad}) == [
        "dp: not wire ≤ 1.05 × minimum",
        "dp: not wire ≤ baseline",
        "dp: not parity ≤ 1e-05",
    ]
    slow = _record("tp", contract={"step_ratio_max": 1.05})
    assert contracts.broken(slow, {}) == ["tp: not step ≤ 1.05 × baseline"]
    assert contracts.broken(slow, {}, timing=False) == []


def test_run_exits_non_zero_when_a_contract_fails(tmp_path, monkeypatch):
    bad = _record("dp", parity_max_rel_err=1.0)
    monkeypatch.setattr(run, "measure", lambda *args, **kwargs: bad)
    with pytest.raises(SystemExit) as exit_:
        run.main(["--only", "dp", "--quick", "--json", str(tmp_path / "r.json")])
    assert exit_.value.code == 1
    assert json.loads((tmp_path / "r.json").read_text())["records"] == [bad]


def test_compiled_figures_lists_each_figure_that_moved(tmp_path, monkeypatch, capsys):
    now = {"dp": {"comm_bytes": {"all-reduce": 8}, "mem_temp_bytes": 4}, "tp": {"mem_temp_bytes": 5}}
    monkeypatch.setattr(compiled_figures, "compiled_fields", lambda name: now[name])
    results = tmp_path / "r.json"
    records = [{"strategy": "dp", **now["dp"], "step_time_s": 1.0}, {"strategy": "tp", "mem_temp_bytes": 6}]
    results.write_text(json.dumps({"jax": jax.__version__, "records": records}))
    assert compiled_figures.main(["--against", str(results), "--only", "dp"]) == 0
    assert compiled_figures.main(["--against", str(results)]) == 1
    out = capsys.readouterr().out
    assert "tp: MOVED\n  mem_temp_bytes: 6 -> 5" in out and "1 of 2 records" in out
    # Figures of another JAX say nothing about this one's programs.
    results.write_text(json.dumps({"jax": "0.0.1", "records": records}))
    assert compiled_figures.main(["--against", str(results)]) == 2


def test_run_releases_each_records_executables(tmp_path, monkeypatch):
    # XLA:CPU maps each executable's code in regions of its own: with every record's
    # executables kept in jit's caches, the whole registry in one process passed
    # Linux's 65,530 maps and crashed. Each record starts with the last one's released.
    traces = []

    @jax.jit
    def step(x):
        traces.append(x)  # runs when jit traces, that is when its cache misses
        return x + 1

    def measure(name, *args, **kwargs):
        step(jnp.float32(1))
        return _record(name)

    monkeypatch.setattr(run, "measure", measure)
    run.main(["--only", "dp,dp_manual", "--quick", "--json", str(tmp_path / "r.json")])
    assert len(traces) == 2  # 1 if the first record's executable were still cached


def _small_registry(monkeypatch, *names: str) -> None:
    # A registry of `names` whose records are made up: the run's bookkeeping (which
    # records a run writes, in what order, beside what) without measuring, and
    # without a garbage collection per record of the whole registry (3 s).
    monkeypatch.setattr(run, "STRATEGIES", {name: STRATEGIES[name] for name in names})
    monkeypatch.setattr(run, "measure", lambda name, *args, **kwargs: _record(name))


def test_a_full_run_keeps_the_entries_other_scripts_wrote(tmp_path, monkeypatch):
    # benchmarks.long_runs and benchmarks/pretrained_load.py write their own entries
    # into the same JSON; a run of the whole registry replaces only its own.
    _small_registry(monkeypatch, "dp", "dp_manual", "tp")
    path = tmp_path / "r.json"
    foreign = {"long_runs": {"tokens_per_s": 9.21e6}, "pretrained_load": {"model_bytes": 1}}
    path.write_text(json.dumps({"records": [], "updates": [{"records": ["dp"]}], **foreign}))
    run.main(["--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert {k: data[k] for k in foreign} == foreign
    assert "updates" not in data and [r["strategy"] for r in data["records"]] == ["dp", "dp_manual", "tp"]


def test_an_only_run_merges_its_records_into_the_existing_json(tmp_path, monkeypatch):
    # `--only` measures some records again: the file keeps the others (and what other
    # scripts wrote, and the whole run's header), its records stay in the registry's
    # order, and `updates` says which records this run measured, dropping an earlier
    # update whose records were all measured again.
    _small_registry(monkeypatch, "dp", "dp_manual", "tp")
    path = tmp_path / "quick.json"
    old = {
        "command": "python -m benchmarks.run --quick",
        "records": [_record(name, run="before") for name in ("dp", "dp_manual", "tp")],
        "updates": [{"command": "first", "records": ["tp"]}, {"command": "second", "records": ["dp_manual"]}],
        "long_runs": {"tokens_per_s": 9.21e6},
    }
    path.write_text(json.dumps(old))
    run.main(["--only", "tp,dp", "--quick", "--json", str(path)])
    data = json.loads(path.read_text())
    assert [(r["strategy"], r.get("run")) for r in data["records"]] == [
        ("dp", None),
        ("dp_manual", "before"),
        ("tp", None),
    ]
    assert data["command"] == old["command"] and data["long_runs"] == old["long_runs"]
    assert data["updates"] == [
        {"command": "second", "records": ["dp_manual"]},
        {
            "command": "python -m benchmarks.run --only tp,dp --quick --json " + str(path),
            "records": ["tp", "dp"],
        },
    ]


def test_report_splices_tables_into_hand_written_prose(tmp_path):
    pipe = _record(
        "pp_1f1b",
        schedule="1f1b",
        microbatches=16,
        chunks=1,
        ticks=38,
        bubble_fraction=0.158,
        lockstep_bubble_fraction=0.333,
        comm_bytes={"collective-permute": 9_961_472},
        memory_sweep=[{"microbatches": m, "mem_temp_bytes": 2**25} for m in (16, 32, 64)],
        predicted_speedup_over_gpipe={"H200": {"wide_unrolled": {"free": 1.004, "lockstep": 0.996}}},
        contract={"wire_over_min_max": 1.55, "temp_growth_max": 0.1},
    )
    data = {"command": "c", "jax": jax.__version__, "devices": 8, "records": [_record("dp"), pipe]}
    page = tmp_path / "B.md"
    page.write_text(f"# Prose before\n\n{report.BEGIN}\nold\n{report.END}\n\nProse after.\n")
    report.splice(page, report.render(data))
    text = page.read_text()
    assert text.startswith("# Prose before") and text.endswith("Prose after.\n") and "\nold\n" not in text
    main = next(line for line in text.splitlines() if line.startswith("| dp |")).split(" | ")
    assert len(main) == len(report.COLUMNS)
    assert main[2] == "1.100" and main[4] == "13.82 (AR 1)" and main[9] == "1.0000"
    row = next(line for line in text.splitlines() if line.startswith("| pp_1f1b | 1f1b |"))
    assert "| 9.96 |" in row and "32.0 / 32.0 / 32.0" in row and "16 × 1" in row
    assert row.endswith("| 1.00 / 1.00 |")
    assert "| pp_1f1b | wire ≤ 1.55 × minimum; temp growth 4p→16p < 10% |" in text
    report.splice(page, "again")  # idempotent around the prose
    assert page.read_text().count("Prose after.") == 1 and "again" in page.read_text()


def test_strategy_configs():
    assert STRATEGIES["pp_1f1b"].config() == dataclasses.replace(_workload.CONFIG, layers=8)
    assert STRATEGIES["3d"].config() == STRATEGIES["dp"].config() == _workload.CONFIG
    assert STRATEGIES["pp_interleaved_uneven"].config() == dataclasses.replace(
        _workload.CONFIG, vocab=3328, layers=15
    )


def test_timed_steps_counts_the_page_faults_of_each_side():
    import contextlib
    import mmap

    size = 32 * 2**20

    def touches_fresh_pages():
        # Anonymous memory, one write per 4 KiB page: a fault each, whatever malloc does
        # (and whatever the machine's transparent huge pages would do, told no).
        with mmap.mmap(-1, size) as memory:
            if hasattr(mmap, "MADV_NOHUGEPAGE"):
                with contextlib.suppress(OSError):  # a kernel without huge pages
                    memory.madvise(mmap.MADV_NOHUGEPAGE)
            for offset in range(0, size, 4096):
                memory[offset] = 1

    steps = _measure.timed_steps({"fresh": touches_fresh_pages, "idle": lambda: None}, warm=1, timed=3)
    assert set(steps["idle"]) == {"step_time_s", "step_minor_faults", "step_system_cpu_s"}
    assert steps["fresh"]["step_minor_faults"] >= 0.9 * size / 4096 > 10 * steps["idle"]["step_minor_faults"]
    assert steps["fresh"]["step_time_s"] > 0 and steps["fresh"]["step_system_cpu_s"] >= 0
