"""`eqxpar.aot`: a model's train step compiled from shapes (for this machine's
devices, or a TPU topology where libtpu is installed), its report, its command."""

import importlib.util
import json
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import eqxpar
from eqxpar import aot

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to compile for',
)
SMALL = dict(num_layers=2, max_seq_len=128)


def _small_gpt2():
    return eqxpar.models.preset("gpt2", **SMALL)


def test_report_on_this_machine_counts_collectives_per_axis_against_the_minimum():
    plan = aot.plan_of({"data": 2, "fsdp": 4}, topology=None)
    report = aot.compile_train_step(_small_gpt2(), plan, batch=(1, 64), name="gpt2-2")
    assert report.chips == 8 and report.tokens_per_step == 8 * 64
    assert (
        report.peak_bytes
        == report.argument_bytes + report.output_bytes - report.alias_bytes + report.temp_bytes
    )
    # The weights are gathered over fsdp: nearly all the all-gathers' bytes move in
    # groups that span that axis only (the token ids of the embedding lookup are
    # gathered over the other batch axis too, a few bytes).
    gathers = report.collectives.by_axes["all-gather"]
    assert gathers[("fsdp",)] > 0.99 * sum(gathers.values())
    by_axes = sum(n for by in report.collectives.by_axes.values() for n in by.values())
    assert by_axes == sum(report.collectives.wire_bytes.values()) - report.collectives.wire_bytes[
        "collective-permute"
    ] + sum(report.collectives.by_axes.get("collective-permute", {}).values())
    assert report.minimum is not None and report.wire_ratio_to_minimum >= 1.0
    assert report.fits is None  # a CPU device has no memory figure
    text = str(report)
    assert "gpt2-2" in text and re.search(r"all-gather +fsdp +[\d,]+ +[\d,]+", text)
    record = report.as_dict()
    assert json.loads(json.dumps(record))["peak_bytes"] == report.peak_bytes


@needs_libtpu
def test_report_for_a_tpu_topology_compares_with_the_chip_and_the_minimum():
    plan = aot.plan_of({"fsdp": 4}, topology="v5p:2x2x1")
    report = aot.compile_train_step(_small_gpt2(), plan, batch=(1, 64))
    assert report.memory_per_chip == aot.DEVICE_MEMORY["TPU v5"] and report.fits is True
    assert report.refused is None
    assert report.topology.startswith("TPU v5")
    # The overlap reader counts the same collectives collective_stats does.
    assert report.overlap.wire_bytes == report.collectives.total_wire_bytes
    # One gather per layer per pass (forward, recomputed forward, backward), not
    # once per program: the scanned stack's trip count is read from the loop.
    assert 0.95 <= report.wire_ratio_to_minimum <= 1.5
    # The buffer assignment's own temporaries, where the jaxlib gives them (JAX
    # 0.11 and later): never more than memory_analysis()'s (libtpu 0.0.50.1
    # reports an excess over them for a looped program).
    if report.heap_temp_bytes is not None:
        assert 0 < report.heap_temp_bytes <= report.temp_bytes
        assert report.as_dict()["heap_temp_bytes"] == report.heap_temp_bytes
    if report.compiler_peak_bytes is not None:
        # The busiest point holds the arguments and at most every temporary.
        assert report.argument_bytes <= report.compiler_peak_bytes <= report.peak_bytes
        assert report.as_dict()["compiler_peak_bytes"] == report.compiler_peak_bytes


def test_command_prints_the_report_and_writes_json(tmp_path, capsys):
    out = tmp_path / "report.json"
    status = aot.main(
        [
            "--model",
            "gpt2",
            "--plan",
            "data=2,fsdp=4",
            "--batch",
            "1x64",
            "--set",
            "num_layers=2",
            "--set",
            "max_seq_len=128",
            "--json",
            str(out),
        ]
    )
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "memory per device" in printed and "measured / minimum" in printed
    record = json.loads(out.read_text())
    assert record["topology_name"] == "this machine" and record["mesh"]["fsdp"] == 4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama9", "--plan", "fsdp=8"], "unknown model"),
        (["--model", "gpt2", "--plan", "fsdp"], "AXIS=SIZE"),
        (["--model", "gpt2", "--plan", "width=8"], "AXIS=SIZE"),
        (["--model", "gpt2", "--plan", "fsdp=8", "--batch", "2048"], "ROWSxLENGTH"),
        (["--model", "gpt2", "--plan", "fsdp=8", "--set", "depth=2"], "no field 'depth'"),
        (["--model", "gpt2", "--plan", "fsdp=8", "--schedule", "1f1b"], "needs a pipe axis"),
        (["--model", "gpt2", "--plan", "fsdp=8", "--stage-gradients", "sharded"], "needs a pipe axis"),
        (["--model", "gpt2", "--plan", "fsdp=64"], "needs 64 devices"),
        (
            ["--model", "gpt2", "--plan", "data=2,fsdp=4", "--dcn", "data"],
            "--dcn 'data': 'data' is not AXIS=SIZE",
        ),
        # One process is one slice on CPU.
        (
            ["--model", "gpt2", "--plan", "data=2,fsdp=4", "--dcn", "data=2"],
            "which does not divide the 1 slices",
        ),
        (["--model", "gpt2", "--plan", "data=2", "--slices", "2"], "slices=2) without a topology"),
    ],
)
def test_command_refuses_bad_arguments_naming_them(argv, message, capsys):
    assert aot.main(argv) == 2
    assert message in capsys.readouterr().out


def test_plan_of_splits_weights_along_their_first_dimension_when_asked():
    # --fsdp-dim leading: the fused MLP input weight (layers, d_model, 2, hidden)
    # splits along d_model, not hidden (the 70B pipeline record's plan).
    config = eqxpar.models.GPTConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=64)
    outline = jax.eval_shape(lambda: eqxpar.models.GPT(config, key=jax.random.key(0)))
    specs = {}
    for dim in ("largest", "leading"):
        plan = aot.plan_of({"pipe": 2, "fsdp": 4}, topology=None, stage_gradients="sharded", fsdp_dim=dim)
        specs[dim] = tuple(eqxpar.partition_specs(outline, plan).blocks.blocks.mlp.w_in)
    assert specs == {"largest": ("pipe", None, None, "fsdp"), "leading": ("pipe", "fsdp", None, None)}


def test_compile_train_step_refuses_bad_values():
    plan = aot.plan_of({"data": 8}, topology=None)
    with pytest.raises(eqxpar.PlanError, match="rows per chip, sequence length"):
        aot.compile_train_step("gpt2", plan, batch=(1, 0))
    with pytest.raises(eqxpar.PlanError, match="only a GPT has a default loss"):
        aot.compile_train_step(
            eqxpar.models.MLPClassifier(4, 8, 2, key=jax.random.key(0)), plan, batch=(1, 4)
        )
    with pytest.raises(eqxpar.PlanError, match="expected an eqxpar.Plan"):
        aot.compile_train_step("gpt2", "fsdp=8", batch=(1, 4))


def test_a_pipelined_plan_compiles_with_the_gpt_pipeline_loss():
    plan = aot.plan_of({"pipe": 2, "data": 4}, topology=None, compute_dtype=jnp.float32)
    report = aot.compile_train_step(_small_gpt2(), plan, batch=(1, 32))
    # One row per chip, 8 chips over 4 data-parallel devices: 2 micro-batches of one row.
    assert "schedule=1f1b x2" in report.plan
    assert ("pipe",) in report.collectives.by_axes["collective-permute"]


@needs_libtpu
def test_a_plan_the_tpu_compiler_cannot_fit_is_reported_not_raised(capsys):
    # 512 sequences of 1,024 tokens per chip: the logits alone outgrow the HBM.
    status = aot.main(
        ["--model", "gpt2", "--topology", "v5p:2x2x1", "--plan", "fsdp=4", "--batch", "512x1024"]
        + ["--set", "num_layers=1", "--set", "max_seq_len=1024"]
    )
    printed = capsys.readouterr().out
    assert status == 1, printed
    assert "DOES NOT FIT" in printed and "Ran out of memory on HBM" in printed


@needs_libtpu
def test_axes_that_cut_a_side_of_the_chip_grid_need_split_physical_axes():
    # v5p-128 is 4x4x4: axes of 8 and 8 cannot each be whole sides.
    with pytest.raises(eqxpar.MeshError, match="split_physical_axes=True"):
        eqxpar.make_mesh(expert=8, fsdp=8, topology="v5p-128")
    mesh = eqxpar.make_mesh(expert=8, fsdp=8, topology="v5p-128", split_physical_axes=True)
    assert dict(mesh.shape)["expert"] == 8 and mesh.devices.size == 64
    with pytest.raises(eqxpar.MeshError, match="expected True or False"):
        eqxpar.make_mesh(fsdp=4, topology="v5p:2x2x1", split_physical_axes="yes")


@needs_libtpu
@pytest.mark.slow  # a whole Llama-3-8B step: about a minute of compile on two cores
def test_llama3_8b_compiles_for_v5p_64_from_shapes_in_under_4_gb_of_host_memory(tmp_path):
    # In a process of its own, so that its peak RSS is this compile's alone.
    out = tmp_path / "report.json"
    argv = ["--model", "llama3-8b", "--topology", "v5p-64", "--plan", "fsdp=32", "--batch", "1x2048"]
    code = "import sys; from eqxpar.aot import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, *argv, "--json", str(out)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    record = json.loads(out.read_text())
    # 8.03e9 parameters: 32 GB of float32 weights and 64 GB of AdamW moments, none allocated.
    assert record["peak_rss_bytes"] < 4 * 2**30
    assert record["argument_bytes"] < 3 * 2**30 and record["fits"] is True


@needs_libtpu
def test_expert_gradients_are_reduce_scattered_in_compute_dtype_on_tpu():
    # A step compiled here for a TPU topology keeps the bfloat16 reduce-scatters of
    # the expert weights' gradients (gathered by eqxpar itself, manual over fsdp
    # and expert): only XLA:CPU runs them in float32, and the platform is the
    # plan's mesh's, not this machine's default backend (float32 doubled them).
    small = dict(num_layers=2, d_model=256, d_hidden=512, num_heads=4, num_kv_heads=2, vocab_size=512)
    config = eqxpar.models.preset("mixtral-8x7b", max_seq_len=128, **small)
    plan = aot.plan_of({"expert": 2, "fsdp": 2}, topology="v5p:2x2x1")
    report = aot.compile_train_step(config, plan, batch=(1, 64))
    # Over fsdp alone: the experts' (the other weights split over fsdp x expert).
    scattered = report.collectives.by_axes["reduce-scatter"][("fsdp",)]
    least = sum(
        c.wire_bytes for c in report.minimum.costs if c.kind == "reduce-scatter" and c.axes == ("fsdp",)
    )
    # The compiler may write one of them as an all-reduce (fewer scattered
    # bytes); in float32 they were twice the minimum's bfloat16 bytes.
    assert least > 0 and 0 < scattered <= least, (report.collectives.by_axes, report.minimum)


def test_benchmark_predict_only_compiles_nothing(tmp_path, monkeypatch):
    """`python -m benchmarks.tpu_compile --predict-only --json F` refreshes the
    records' predictions and stops: without `--markdown` it fell through to
    compiling every case and rewrote their compiled figures."""
    from benchmarks import tpu_compile

    path = tmp_path / "quick.json"
    path.write_text(json.dumps({"tpu_compile": {"a": {"predicted": {}}, "b": {"refused": "over HBM"}}}))

    def compile_refused(*args, **kwargs):
        raise AssertionError(f"--predict-only started a compile: {args}")

    monkeypatch.setattr(tpu_compile, "predict_case", lambda name: {"wire_bytes": len(name)})
    monkeypatch.setattr(tpu_compile.subprocess, "run", compile_refused)
    tpu_compile.main(["--predict-only", "--json", str(path)])
    records = json.loads(path.read_text())["tpu_compile"]
    assert records == {"a": {"predicted": {"wire_bytes": 1}}, "b": {"refused": "over HBM"}}
