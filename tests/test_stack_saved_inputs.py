"""Automatic tensor parallelism with recomputation: the scanned stack keeps the
layer inputs it saves for the backward pass split over the tensor axis along
their features (a 1/tensor share, not a whole copy per device), trains like one
device over several steps, and the split is left off where it does not apply."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar.internal import ResolvedPlan
from eqxpar.models import GPT, GPTConfig, lm_loss

from ._helpers import lm_tokens, train_checked

CONFIG = GPTConfig(
    vocab_size=32, d_model=32, num_heads=8, num_kv_heads=4, num_layers=3, d_hidden=64, max_seq_len=16
)


def _plan(**options):
    sizes = options.pop("sizes", dict(fsdp=2, tensor=4))
    rules = options.pop("rules", eqxpar.rules.MEGATRON_FSDP)
    return eqxpar.Plan(eqxpar.make_mesh(**sizes), rules=rules, **options)


def test_split_saved_inputs_trains_like_one_device():
    plan = _plan(sizes=dict(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, remat="full")
    assert ResolvedPlan.of(plan).dims.split_saved_inputs
    model = eqx.filter_jit(GPT)(CONFIG, key=jax.random.key(0))
    batches = [lm_tokens(i, batch=8, seq=8) for i in range(3)]
    losses, _ = train_checked(plan, model, optax.adam(1e-2), lm_loss, batches)
    assert losses[-1] < losses[0]


def _compiled_text(plan, config):
    model = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(lm_loss, optim, plan)
    return step.lower(state, jax.ShapeDtypeStruct((8, 65), jnp.int32)).compile().as_text()


def test_saved_inputs_are_held_split_over_tensor():
    # 4 layers, 8 rows over fsdp=2 (4 per device), 64 tokens, d_model 64 over
    # tensor=4: the stack's saved inputs are f32[4, 4, 64, 16], never the whole
    # f32[4, 4, 64, 64] that every tensor device would otherwise hold.
    config = GPTConfig(vocab_size=64, d_model=64, num_heads=4, num_layers=4, d_hidden=128, max_seq_len=64)
    text = _compiled_text(_plan(remat="full"), config)
    assert re.search(r"f32\[4,4,64,16\]", text)
    assert not re.search(r"f32\[4,4,64,64\]", text)


@pytest.mark.parametrize(
    "options",
    [
        dict(remat="none"),
        dict(remat="dots"),
        dict(mode="manual", remat="full"),
        dict(sequence_parallel=True, remat="full"),
        dict(sizes=dict(fsdp=8), rules=eqxpar.rules.FSDP(), remat="full"),
        dict(sizes=dict(fsdp=2, tensor=4), rules=eqxpar.rules.FSDP(axis="fsdp"), remat="full"),
        dict(sizes=dict(data=8, tensor=1), rules=eqxpar.rules.MEGATRON, remat="full"),
        dict(sizes=dict(context=2, tensor=4), rules=eqxpar.rules.MEGATRON, remat="full"),
    ],
    ids=[
        "remat-none",
        "remat-dots",
        "manual",
        "sequence-parallel",
        "no-tensor-axis",
        "no-tensor-rule",
        "tensor-1",
        "context",
    ],
)
def test_split_saved_inputs_only_under_automatic_tensor_parallelism(options):
    assert not ResolvedPlan.of(_plan(**options)).dims.split_saved_inputs


def test_minimum_counts_one_gather_of_each_split_saved_input():
    # Held split over tensor, each layer's saved input is all-gathered whole again
    # by its backward before the layer is recomputed: a collective no sum stands
    # in for (the forward's sums land split, an all-reduce's bytes either way).
    # minimum_comm counts one all-gather per layer of the layer's input, 8 rows
    # over fsdp=2 (4 per device) x 64 tokens x d_model 64 in float32, over
    # tensor=4; the compiled step (XLA:CPU) runs at least that over tensor.
    config = GPTConfig(vocab_size=64, d_model=64, num_heads=4, num_layers=4, d_hidden=128, max_seq_len=64)
    plan = _plan(remat="full")
    model = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    batch = jax.ShapeDtypeStruct((8, 65), jnp.int32)
    least = eqxpar.inspect.minimum_comm(plan, state.model, loss=lm_loss, batch=batch)
    layer_input = 4 * 64 * 64 * 4
    (cost,) = [c for c in least.costs if c.label == "split saved layer inputs gathered for the backward"]
    assert (cost.kind, cost.axes, cost.bytes) == ("all-gather", ("tensor",), 4 * layer_input)
    assert cost.wire_bytes == 4 * layer_input * 3 // 4
    compiled = eqxpar.train.make_step(lm_loss, optim, plan).lower(state, batch).compile()
    stats = eqxpar.inspect.collective_stats(compiled, mesh=plan.mesh)
    assert stats.by_axes["all-gather"][("tensor",)] >= cost.wire_bytes
    # Kept whole (remat "dots" saves the summed outputs instead), nothing to gather.
    whole = eqxpar.inspect.minimum_comm(_plan(remat="dots"), state.model, loss=lm_loss, batch=batch)
    assert "split saved layer inputs gathered for the backward" not in whole.parts
