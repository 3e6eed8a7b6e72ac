"""The examples, run from the command line for a couple of steps on a tiny model:
once per entry of their plan table (examples/_plans.py), each printing what it
should. Their flags build exactly the table's plans, and the FSDP and hybrid plans
split the parameters and optimizer state as they say (checked on shapes only,
nothing compiled). examples/token_file.py trains from a token file, resumes, and
measures reading one."""

import itertools
import json
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar

from ._helpers import example, run_example

PLANS = example("_plans").PLANS

# A tiny model and a couple of steps per script: these check that every plan builds,
# shards, trains and reports, not that it learns (the default runs show that).
_GPT = ["--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--layers", "1"]
_PIPELINE = ["--steps", "2", "--batch-size", "16", "--seq-len", "8", "--d-model", "16", "--heads", "2"]
TINY = {
    "data_parallel.py": ["--steps", "3", "--batch-size", "64"],
    "tensor_parallel.py": ["--steps", "3", "--eval-every", "3", *_GPT],
    "fsdp.py": ["--steps", "2", "--eval-every", "2", *_GPT],
    "hybrid.py": ["--steps", "2", "--eval-every", "2", *_GPT],
    "pipeline_parallel.py": [*_PIPELINE, "--layers", "4", "--microbatches", "4"],
    "hybrid_3d.py": [*_PIPELINE, "--layers", "2", "--microbatches", "2"],
    "long_context.py": ["--steps", "2", "--eval-every", "2", *_GPT],
    "demo.py": [
        *("--steps", "2", "--eval-every", "1", "--batch-size", "8", "--seq-len", "16", "--d-model", "32"),
        *("--heads", "4", "--kv-heads", "2", "--layers", "2", "--d-hidden", "64", "--sample-len", "20"),
    ],
    "vision_transformer.py": [
        *("--steps", "2", "--eval-every", "1", "--batch-size", "8", "--image-size", "8", "--d-model", "16"),
        *("--layers", "1", "--heads", "2", "--eval-size", "16"),
    ],
}

# Flags orthogonal to the plan, so that each mode and option is run somewhere:
# manual FSDP with remat, bfloat16 compute, accumulation, other schedules.
EXTRA = {
    "data/manual": ["--accumulate", "2"],
    "fsdp/hsdp": ["--mode", "manual", "--remat", "inputs"],
    "hybrid/partial": ["--sequence-parallel"],
    "hybrid/manual": ["--bf16", "--remat", "dots"],
    "pipeline/fsdp": ["--schedule", "gpipe", "--microbatches", "2"],
    "pipeline/hybrid": ["--schedule", "interleaved", "--chunks", "2", "--layers", "4", "--microbatches", "4"],
    "pipeline/hybrid-fsdp": ["--schedule", "zero_bubble"],
    # A class token under sequence parallelism: 9 patches + 1 = 10 tokens over tensor 2.
    "vit/sp": ["--pool", "first", "--image-size", "12"],
}

# What each script prints besides the final evaluation loss.
PRINTS = {
    "tensor_parallel.py": ["collectives per step"],
    "fsdp.py": ["per device of", "collectives per step"],
    "hybrid.py": ["per device of", "collectives per step"],
    "pipeline_parallel.py": ["bubble"],
    "hybrid_3d.py": ["bubble"],
    "long_context.py": ["over context=", "collectives per step"],
    "demo.py": ["step 2: loss", "sample:\nPython ", "tokens/s, ", "MFU", "measured matmul rate"],
    "vision_transformer.py": ["step 2: loss", "held-out accuracy", "mesh data 4 x tensor 2; plan mode"],
}

# The demo's first line names its plan.
DEMO_MESH = {
    "demo/3d": "mesh data 2 x pipe 2 x tensor 2; mode manual (pipeline), pipeline 1f1b x 4 micro-batches\n",
    "demo/no-pipeline": "mesh data 2 x fsdp 2 x tensor 2; mode auto\n",
}


# In make test-slow (25 s each on 2 cores): the interleaved pipeline example (the
# engine's interleaved tables run in make test through tests/test_pipeline.py) and
# the 1F1B one (pipeline/fsdp and pipeline/hybrid-fsdp run the same script).
SLOW_PLANS = {"pipeline/hybrid", "pipeline/data"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_PLANS else n for n in PLANS]
)
def test_example_runs(name, tmp_path):
    entry = PLANS[name]
    args = [*entry.flags, *TINY[entry.script], *EXTRA.get(name, [])]
    if entry.script == "demo.py":
        args += ["--out", str(tmp_path)]
    # Two steps of a tiny model: compilation dominates, and run_example compiles
    # cheaply (the example adds the device count to its flags).
    result = run_example(entry.script, args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    if entry.script == "vision_transformer.py":  # a classifier: it reports its accuracy
        final = re.search(r"final held-out accuracy ([0-9.]+) \(chance ([0-9.]+)\)", out)
        assert final, out[-2000:]
        assert 0 <= float(final.group(1)) <= 1
    else:
        final = re.search(r"final eval loss ([0-9.]+) nats/char \(unigram entropy ([0-9.]+)\)", out)
        assert final, out[-2000:]
        assert 0 < float(final.group(1)) < 10
    for text in PRINTS.get(entry.script, []):
        assert text in out, (text, out[-2000:])
    if name in DEMO_MESH:
        assert DEMO_MESH[name] in out
    if name == "demo/3d":
        assert (tmp_path / "loss.png").stat().st_size > 0
        assert (tmp_path / "sample.txt").read_text().startswith("Python ")
        # The loop's tracker: a line per step, the held-out losses beside them.
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        train_steps = [r["step"] for r in records if "loss" in r]
        assert train_steps == list(range(1, len(train_steps) + 1)) and train_steps
        assert any("eval_loss" in r for r in records)
        assert any((tmp_path / "tensorboard").iterdir())


def test_filter_jit_loop_runs():
    # The user-written loop of filter_jit_loop.py takes no plan from the table.
    result = run_example("filter_jit_loop.py", ["--steps", "3"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss" in result.stdout


def test_finetune_lora_runs(tmp_path):
    # From a pre-trained checkpoint (made by the script) through BPE text, LoRA under
    # a hybrid plan, periodic evaluation and cached generation, to the merged
    # checkpoint and the PEFT adapter.
    args = ["--pretrain-steps", "2", "--steps", "2", "--eval-every", "1", "--sample-len", "4"]
    args += ["--batch-size", "8", "--seq-len", "16", "--out", str(tmp_path)]
    result = run_example("finetune_lora.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "LoRA rank 8" in out and "after  | 'The assert statement" in out, out[-2000:]
    trained = float(re.search(r"final eval loss ([0-9.]+)", out).group(1))
    reread = float(re.search(r"eval loss read back ([0-9.]+)", out).group(1))
    assert trained == pytest.approx(reread, abs=2e-3)  # the merged checkpoint is the adapted model
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    assert (tmp_path / "merged" / "tokenizer.json").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) >= 2


def test_preference_lora_runs(tmp_path):
    # A checkpoint made and read back, preference pairs from the shipped text, DPO
    # with the adapters' base as reference, the trackers' lines, the PEFT adapter.
    args = ["--pretrain-steps", "2", "--steps", "2", "--eval-every", "1", "--pairs", "8"]
    args += ["--prompt-len", "8", "--completion-len", "8", "--out", str(tmp_path)]
    result = run_example("preference_lora.py", args)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # Before any step the policy is the reference: the loss is log 2.
    before = float(re.search(r"held-out DPO loss before ([0-9.]+)", out).group(1))
    assert before == pytest.approx(0.6931, abs=1e-4), out[-2000:]
    assert re.search(r"held-out DPO loss after [0-9.]+; reward accuracy [0-9.]+", out), out[-2000:]
    assert (tmp_path / "adapter" / "adapter_config.json").exists()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2], lines
    assert all({"aux/reward_accuracy", "aux/reward_margin", "grad_norm"} <= set(line) for line in steps)


def test_finetune_pretrained_runs(tmp_path):
    # No --path: the script writes a tiny random checkpoint, fine-tunes it under a
    # plan of the table, saves it in Hugging Face format and reads it back.
    result = run_example(
        "finetune_pretrained.py",
        ["--steps", "2", "--batch-size", "8", "--seq-len", "16", "--d-model", "32", "--out", str(tmp_path)],
    )
    assert result.returncode == 0, result.stderr[-3000:]
    held_out = re.search(r"held-out loss: trained ([0-9.]+), reloaded ([0-9.]+)", result.stdout)
    assert held_out and held_out.group(1) == held_out.group(2), result.stdout[-2000:]
    assert (tmp_path / "config.json").is_file() and (tmp_path / "model.safetensors").is_file()


def test_flags_build_the_table_plans():
    plans = {}
    for name, entry in PLANS.items():
        module = example(entry.script)
        plans[name] = module.make_plan(module.parse_args(list(entry.flags)))
        assert plans[name] == entry.plan(), name
    # Equality tells plans apart: names build different plans, except the demo
    # without a pipeline, which trains under the hybrid example's plan.
    same = {frozenset(pair) for pair in itertools.combinations(plans, 2) if plans[pair[0]] == plans[pair[1]]}
    assert same == {frozenset({"hybrid/auto", "demo/no-pipeline"})}


def _per_device_fraction(plan):
    """Bytes each device holds over the total, for the default model and AdamW."""
    model_module = example("_model")
    config = model_module.char_config(example("fsdp").parse_args([]), 96)

    def build():
        model = model_module.GPT(config, key=jax.random.key(0))
        return eqxpar.train.TrainState(
            model=model,
            opt_state=optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array)),
            step=jnp.zeros((), jnp.int32),
            key=jax.random.key(1),
        )

    state = eqx.filter_eval_shape(build)  # shapes only
    table = eqxpar.inspect.sharding_table(state, plan)
    model_rows = [r for r in table.rows if r.path.startswith(".model")]
    return (
        sum(r.bytes_per_device for r in model_rows) / sum(r.bytes for r in model_rows),
        table.bytes_per_device / table.bytes,
    )


@pytest.mark.parametrize(
    "flags,mesh,params_split,split",
    [
        ([], {"fsdp": 8}, 8, 8),
        (["--hsdp", "--mode", "manual"], {"data": 2, "fsdp": 4}, 4, 4),
        (["--zero1"], {"data": 8}, 1, None),  # parameters whole, moments (2/3 of it) split
    ],
    ids=["fsdp", "hsdp", "zero1"],
)
def test_fsdp_plans_split_what_they_say(flags, mesh, params_split, split):
    fsdp = example("fsdp")
    plan = fsdp.make_plan(fsdp.parse_args(flags))
    assert {k: v for k, v in plan.mesh.shape.items() if v > 1} == mesh
    params, together = _per_device_fraction(plan)
    # Small leaves (biases without a model dimension) stay whole: allow 25% over 1/n.
    assert 1 / params_split <= params <= 1.25 / params_split
    if split is not None:
        assert 1 / split <= together <= 1.25 / split
    else:
        assert 1 / 3 + 2 / 3 / 8 <= together <= 1.1 * (1 / 3 + 2 / 3 / 8)


@pytest.mark.parametrize(
    "flags,expected",
    [
        ([], dict(mode="auto", manual_axes=None)),
        (["--mode", "manual"], dict(mode="manual", manual_axes=None)),  # None: every axis
        (["--mode", "partial", "--sequence-parallel"], dict(manual_axes=("tensor",), sequence_parallel=True)),
        (["--bf16", "--remat", "dots"], dict(compute_dtype=jnp.dtype(jnp.bfloat16), remat="dots")),
    ],
    ids=["auto", "manual", "partial-sp", "bf16-dots"],
)
def test_hybrid_plans(flags, expected):
    hybrid = example("hybrid")
    plan = hybrid.make_plan(hybrid.parse_args(flags))
    assert dict(plan.mesh.shape) == {"data": 2, "pipe": 1, "fsdp": 2, "expert": 1, "context": 1, "tensor": 2}
    assert plan.rules == (eqxpar.rules.MEGATRON_FSDP,)
    for name, value in expected.items():
        assert getattr(plan, name) == value, name
    params, together = _per_device_fraction(plan)
    assert 1 / 4 <= params <= 1.25 / 4 and 1 / 4 <= together <= 1.25 / 4


@pytest.mark.slow  # three runs of the script; tests/test_token_file.py covers the reading
def test_token_file_trains_resumes_and_measures(tmp_path):
    # No --data: the script writes Python's docs as a uint16 token file. Two steps
    # then a resume to four print the loss an uninterrupted run to four prints.
    small = ["--batch-size", "8", "--seq-len", "16", "--d-model", "32"]
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2"]
    first = run_example("token_file.py", ["--steps", "2", *small, *ckpt])
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = run_example("token_file.py", ["--steps", "4", "--resume", *small, *ckpt])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed at step 2" in resumed.stdout
    straight = run_example("token_file.py", ["--steps", "4", *small])
    assert straight.returncode == 0, straight.stderr[-3000:]
    loss = re.search(r"step 4: loss ([0-9.]+)", straight.stdout)
    assert loss and f"step 4: loss {loss.group(1)}" in resumed.stdout, (straight.stdout, resumed.stdout)
    measured = run_example("token_file.py", ["--steps", "3", "--measure", *small])
    assert measured.returncode == 0, measured.stderr[-3000:]
    # Per-process lines are logged (stderr); the hashes are printed once (stdout).
    assert re.search(r"tokens/s read.*the token file's pages 0\.0 MiB", measured.stderr), measured.stderr
    assert "global batch hashes" in measured.stdout
