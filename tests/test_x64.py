"""Every strategy under `jax_enable_x64` (float64 is common in scientific JAX):
data parallel, manual FSDP, ring context parallelism (its attention accumulates
in float64 for float64 inputs), expert parallelism, tensor parallel with sequence parallelism and
each pipeline schedule give the loss and gradients of a float64 one-device run, to
float64 precision. x64 is switched on only inside these tests (the `x64` fixture
restores the flag), so the rest of the suite runs as before."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig, lm_loss

from ._helpers import (
    MoEModel,
    Tiny,
    assert_trees_close_to_scale,
    moe_batches,
    moe_regression_loss,
    pipeline_plan,
    regression_batch,
    tiny_loss,
)

# float64 sums in a different order differ in the last bits (measured: 2e-15 of
# each leaf's scale); 1e-10 is far below any float32 step in the computation.
RTOL64 = 1e-10


@pytest.fixture
def x64():
    before = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", before)


def float64(tree):
    return jax.tree.map(lambda x: x.astype(jnp.float64) if eqx.is_inexact_array(x) else x, tree)


def one_device(loss_fn, model, batch):
    model, batch = jax.device_put((model, batch), jax.devices()[0])
    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, batch)


def assert_float64_close(value, grads, ref_value, ref_grads):
    assert jnp.result_type(value) == jnp.float64
    assert all(g.dtype == jnp.float64 for g in jax.tree.leaves(grads))
    np.testing.assert_allclose(float(value), float(ref_value), rtol=RTOL64)
    assert_trees_close_to_scale(grads, ref_grads, rtol=RTOL64, atol=0.0)


GPT_CONFIG = GPTConfig(vocab_size=32, d_model=32, num_heads=4, num_layers=2, d_hidden=64, max_seq_len=16)
M, R = eqxpar.make_mesh, eqxpar.rules
PLANS = {
    "dp_auto_accumulate2": (lambda: eqxpar.Plan(M(data=8)), 2),
    "dp_manual": (lambda: eqxpar.Plan(M(data=8), mode="manual"), 1),
    "fsdp_manual": (lambda: eqxpar.Plan(M(fsdp=8), rules=R.FSDP(axis="fsdp", min_size=1), mode="manual"), 1),
    "context_ring_manual": (lambda: eqxpar.Plan(M(context=4, data=2), mode="manual"), 1),
    "tp_sp_manual": (
        lambda: eqxpar.Plan(M(data=2, tensor=4), rules=R.MEGATRON, mode="manual", sequence_parallel=True),
        1,
    ),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_strategies_under_x64_match_one_device(x64, name):
    make_plan, accumulate = PLANS[name]
    model = float64(eqx.filter_jit(GPT)(GPT_CONFIG, key=jax.random.key(0)))
    tokens = jax.random.randint(jax.random.key(1), (16, 9), 0, 32)  # int64 under x64
    value, grads = eqxpar.train.make_value_and_grad(lm_loss, make_plan(), accumulate=accumulate)(
        model, tokens
    )
    assert_float64_close(value, grads, *one_device(lm_loss, model, tokens))


def test_expert_parallel_under_x64_matches_one_device(x64):
    # The router computes in float64 too (float32 at least), so the whole MoE
    # layer, routing, all-to-alls and auxiliary losses, keeps float64 precision.
    model = float64(MoEModel(top_k=2, num_shared=1))
    batch = moe_batches(1)[0]
    plan = eqxpar.Plan(M(expert=4, data=2), rules=R.EXPERT, mode="manual")
    value, grads = eqxpar.train.make_value_and_grad(moe_regression_loss, plan)(model, batch)
    assert_float64_close(value, grads, *one_device(moe_regression_loss, model, batch))


# Each schedule on pipe 2 with data 2 (interleaved: 2 chunks), and 1F1B on pipe 4.
SCHEDULES = [
    ("gpipe", 1, 2, 2),
    ("1f1b", 1, 2, 2),
    ("1f1b", 1, 4, 1),
    ("interleaved", 2, 2, 2),
    ("zero_bubble", 1, 2, 2),
]


@pytest.mark.parametrize(
    "name,chunks,pipe,data", SCHEDULES, ids=[f"{n}-v{v}-p{p}-d{d}" for n, v, p, d in SCHEDULES]
)
def test_pipeline_schedules_under_x64_match_one_device(x64, name, chunks, pipe, data):
    microbatches = 2 * pipe
    model = float64(Tiny(pipe * chunks, key=jax.random.key(pipe + 10 * chunks)))
    batch = regression_batch(2 * microbatches * data)
    assert batch[0].dtype == jnp.float64
    plan = pipeline_plan(name, pipe=pipe, data=data, microbatches=microbatches, chunks=chunks)
    stored = eqxpar.shard(model, plan)
    value, grads = eqxpar.train.make_value_and_grad(tiny_loss(), plan)(stored, batch)
    grads = eqxpar.nn.in_natural_order(grads)
    assert_float64_close(value, grads, *one_device(tiny_loss(), model, batch))


def test_make_step_under_x64_keeps_float64_state(x64):
    plan = pipeline_plan("1f1b", pipe=2, data=2, microbatches=4)
    model = float64(Tiny(2, key=jax.random.key(0)))
    optim = optax.adamw(1e-3)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    state, metrics = eqxpar.train.make_step(tiny_loss(), optim, plan)(state, regression_batch(16))
    assert metrics["loss"].dtype == jnp.float64
    assert all(x.dtype == jnp.float64 for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array)))


def test_x64_fixture_restored_the_flag():
    assert not jax.config.read("jax_enable_x64")
    assert jnp.zeros(()).dtype == jnp.float32
