"""eqxpar.models.from_pretrained / save_pretrained against tiny checkpoints that
transformers wrote (tests/data/pretrained, made by make_references.py there):
logits equal transformers' on one device; the loss and gradients under data x
tensor, TP + SP, FSDP, a pipeline and (Mixtral) expert x data equal one device's;
a load under a plan reads only each device's block; save then load is
bit-identical and writes the tensors transformers wrote; bad directories raise
PretrainedError naming the file or field."""

import json
import pathlib
import shutil
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import eqxpar
from eqxpar.models import from_pretrained, lm_loss, save_pretrained
from eqxpar.models._hf_files import TensorFiles
from eqxpar.pipeline import PipelineLoss, stage_rules

from ._helpers import assert_trees_close, assert_trees_close_to_scale

safetensors = pytest.importorskip("safetensors")

DATA = pathlib.Path(__file__).parent / "data" / "pretrained"
ARCHES = ["llama", "llama3_rope", "mistral", "qwen2", "mixtral", "gpt2"]


def reference(name):
    ref = np.load(DATA / name / "reference.npz")
    return jnp.asarray(ref["tokens"]), ref["logits"]


def batch(name):
    # 8 rows of 9 tokens: splits over every plan's batch axes below.
    tokens, _ = reference(name)
    return jnp.concatenate([tokens, tokens[::-1]])


def same_arrays(a, b):
    leaves_a, leaves_b = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("name", ARCHES)
def test_logits_match_transformers(name):
    tokens, logits = reference(name)
    model = from_pretrained(DATA / name)
    assert_trees_close(eqx.filter_jit(lambda m, t: m(t))(model, tokens), logits)
    if name == "llama3_rope":
        # The scaling is read and used: without it the logits are far off.
        config = model.config
        assert config.rotary_scaling == eqxpar.nn.RotaryScaling(8.0, 1.0, 4.0, 16)
        unscaled = eqxpar.models.GPT(
            type(config)(**{**config.__dict__, "rotary_scaling": None}), key=jax.random.key(0)
        )
        unscaled = jax.tree.unflatten(jax.tree.structure(unscaled), jax.tree.leaves(model))
        assert np.max(np.abs(np.asarray(unscaled(tokens)) - logits)) > 1e-2


def mesh(**sizes):
    return eqxpar.make_mesh(**sizes)


GPT_PIPELINE = PipelineLoss(eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last)
PLANS = {
    "data-tensor-auto": ("llama", lambda: eqxpar.Plan(mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON)),
    "tp-sp-manual": (
        "qwen2",
        lambda: eqxpar.Plan(
            mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
        ),
    ),
    "fsdp": ("gpt2", lambda: eqxpar.Plan(mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=1))),
    "pipeline": (
        "llama3_rope",
        lambda: eqxpar.Plan(mesh(pipe=2, data=4), rules=stage_rules(), schedule="1f1b", microbatches=2),
    ),
    "expert-data": ("mixtral", lambda: eqxpar.Plan(mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT)),
}


@pytest.mark.parametrize("plan_name", list(PLANS))
def test_loss_and_gradients_under_a_plan_match_one_device(plan_name):
    name, make_plan = PLANS[plan_name]
    tokens = batch(name)
    one = jax.device_put(from_pretrained(DATA / name), jax.devices()[0])
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss))(one, tokens)
    plan = make_plan()
    model = from_pretrained(DATA / name, plan)
    same_arrays(model, one)
    loss_fn = GPT_PIPELINE if plan.schedule is not None else lm_loss
    loss, grads = eqxpar.train.make_value_and_grad(loss_fn, plan)(model, tokens)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


def test_sharded_load_reads_only_each_devices_block(monkeypatch):
    reads = []
    original = TensorFiles.read

    def record(self, name, index):
        out = original(self, name, index)
        reads.append((name, out.shape))
        return out

    monkeypatch.setattr(TensorFiles, "read", record)
    plan = eqxpar.Plan(mesh(pipe=2, fsdp=2, tensor=2), rules=stage_rules(eqxpar.rules.MEGATRON_FSDP))
    model = from_pretrained(DATA / "llama", plan)
    # Every leaf has the sharding eqxpar.shard gives it under this plan.
    expected = eqxpar.named_shardings(model, plan)
    for leaf, sharding in zip(jax.tree.leaves(model), jax.tree.leaves(expected), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    q = [shape for name, shape in reads if name.endswith("q_proj.weight")]
    # q_proj (heads * head_dim, d_model) = (32, 32): heads split over tensor (rows),
    # d_model over fsdp (columns); each layer's tensor read only by its stage.
    assert q and all(shape == (16, 16) for shape in q)
    assert {name for name, _ in reads if "layers." in name} == {
        name for name in TensorFiles(DATA / "llama").names() if "layers." in name
    }
    same_arrays(model, from_pretrained(DATA / "llama"))


def stored_tensors(directory):
    files = TensorFiles(pathlib.Path(directory))
    return {name: files.read(name, ()) for name in sorted(files.names())}


@pytest.mark.parametrize("name", ARCHES)
def test_save_then_load_is_bit_identical(name, tmp_path):
    plan = eqxpar.Plan(mesh(data=2, fsdp=2, tensor=2), rules=eqxpar.rules.MEGATRON_FSDP)
    # Saved from a sharded model; GPT-2 into several files with an index.
    model = from_pretrained(DATA / name, plan if name != "llama" else None)
    limit = 20_000 if name == "gpt2" else 2**30
    save_pretrained(model, tmp_path, max_shard_bytes=limit)
    files = sorted(p.name for p in tmp_path.iterdir())
    if name == "gpt2":
        assert "model.safetensors.index.json" in files and len(files) > 3
    else:
        assert files == ["config.json", "model.safetensors"]
    again = from_pretrained(tmp_path)
    assert again.config == model.config
    same_arrays(again, model)
    # The very tensors transformers wrote: names, shapes, dtypes and bits.
    original, written = stored_tensors(DATA / name), stored_tensors(tmp_path)
    assert original.keys() == written.keys()
    for key, value in original.items():
        assert written[key].dtype == value.dtype
        np.testing.assert_array_equal(written[key], value)


def checkpoint_copy(tmp_path, name="llama"):
    target = tmp_path / name
    shutil.copytree(DATA / name, target)
    return target


def edit_config(directory, **fields):
    config = json.loads((directory / "config.json").read_text())
    config.update(fields)
    (directory / "config.json").write_text(json.dumps(config))


def test_bad_checkpoints_name_the_file_or_field(tmp_path):
    error = eqxpar.models.PretrainedError
    assert issubclass(error, eqxpar.EqxparError)
    with pytest.raises(error, match="not a directory"):
        from_pretrained(tmp_path / "nowhere")
    # Missing config.json.
    d = checkpoint_copy(tmp_path, "llama")
    (d / "config.json").unlink()
    with pytest.raises(error, match="config.json"):
        from_pretrained(d)
    # Only a pickle: refused, naming the conversion to safetensors.
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(DATA / "llama" / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(error, match="pytorch_model.bin.*safetensors"):
        from_pretrained(d)
    # A truncated weights file.
    d = checkpoint_copy(tmp_path / "t", "qwen2")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(error, match="model.safetensors"):
        from_pretrained(d)
    # A shard the index names is missing.
    d = tmp_path / "sharded"
    save_pretrained(from_pretrained(DATA / "gpt2"), d, max_shard_bytes=20_000)
    (d / "model-00002-of-00006.safetensors").unlink()
    with pytest.raises(error, match="model-00002-of-00006.safetensors"):
        from_pretrained(d)
    # A shape that disagrees with config.json.
    d = checkpoint_copy(tmp_path / "s", "llama")
    edit_config(d, intermediate_size=64)
    with pytest.raises(error, match=r"mlp.gate_proj.weight.*\(48, 32\).*\(64, 32\)"):
        from_pretrained(d)
    # Fields eqxpar cannot honour: named, never loaded into a different model.
    cases = [
        ({"model_type": "bert"}, "model_type='bert'"),
        ({"model_type": "mistral", "sliding_window": 16}, "sliding_window=16"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope_type.*yarn"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ]
    for i, (fields, match) in enumerate(cases):
        d = checkpoint_copy(tmp_path / f"c{i}", "llama")
        edit_config(d, **fields)
        with pytest.raises(error, match=match):
            from_pretrained(d)
    # A config no Hugging Face architecture has cannot be saved.
    odd = eqxpar.models.GPT(
        eqxpar.models.GPTConfig(
            vocab_size=8, d_model=8, num_heads=2, num_layers=2, d_hidden=8, moe_every=2, experts=2
        ),
        key=jax.random.key(0),
    )
    with pytest.raises(error, match="moe_every=2"):
        save_pretrained(odd, tmp_path / "odd")


def test_import_eqxpar_does_not_import_safetensors():
    code = "import sys, eqxpar, eqxpar.models; assert 'safetensors' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env={**__import__("os").environ})


def test_a_model_loaded_onto_one_device_is_refused_by_init_with_the_fix():
    # from_pretrained(path) without a plan commits the arrays to one device; jit
    # would refuse them with an opaque device-set error inside init.
    model = from_pretrained(DATA / "llama")
    plan = eqxpar.Plan(mesh(data=8))
    with pytest.raises(
        eqxpar.PlanError, match=r"committed to devices outside the plan's mesh.*from_pretrained\(path, plan\)"
    ):
        eqxpar.train.init(model, optax.adam(1e-3), plan, key=jax.random.key(0))
    # The fix it names works.
    placed = jax.device_put(model, plan.sharding(PartitionSpec()))
    state = eqxpar.train.init(placed, optax.adam(1e-3), plan, key=jax.random.key(0))
    same_arrays(state.model, model)
