"""Data parallelism, automatic and manual: parity with one device, communication,
sharding stability, no recompilation, gradient accumulation."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar

from ._helpers import (
    TinyTransformer,
    assert_trees_close,
    lm_loss,
    mse_loss,
    param_bytes,
    reference_run,
    regression_batches,
    run_steps,
    token_batches,
    train_checked,
)

MODES = ["auto", "manual"]
STEPS = 5


def run(plan, model, optimizer, loss_fn, batches, **step_kwargs):
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss_fn, optimizer, plan, **step_kwargs)
    return run_steps(step, state, batches)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("data", [2, 8])
def test_dp_matches_single_device_mlp(mode, data):
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(1))
    optimizer = optax.adamw(1e-2, weight_decay=0.01)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=data), mode=mode)
    # Loss and gradients elementwise each step, parameters per leaf (AdamW).
    _, state = train_checked(plan, model, optimizer, mse_loss, regression_batches(STEPS))
    assert int(state.step) == STEPS


@pytest.mark.parametrize("mode", MODES)
def test_dp_matches_single_device_transformer(mode):
    model = TinyTransformer(key=jax.random.key(2))
    optimizer = optax.adamw(3e-3)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), mode=mode)
    # Loss and gradients elementwise each step, parameters per leaf (AdamW).
    train_checked(plan, model, optimizer, lm_loss, token_batches(STEPS))


@pytest.mark.parametrize("mode", MODES)
def test_batch_over_data_and_fsdp_axes(mode):
    # With no rules, an fsdp axis still splits the batch: 2 x 4 devices of DP.
    model = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(1))
    optimizer = optax.sgd(1e-1)
    batches = regression_batches(STEPS)
    ref_losses, ref_model = reference_run(model, optimizer, mse_loss, batches)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), mode=mode)
    losses, state = run(plan, model, optimizer, mse_loss, batches)
    assert_trees_close(losses, ref_losses)
    assert_trees_close(state.model, ref_model)


@pytest.mark.parametrize("mode", MODES)
def test_accumulated_gradients_equal_full_batch(mode):
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(1))
    optimizer = optax.adamw(1e-2)
    batches = regression_batches(3)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4), mode=mode)
    full_losses, _ = run(plan, model, optimizer, mse_loss, batches)
    # The accumulated step's own gradients equal the full batch's on one device,
    # elementwise, at its parameters each step; its parameters per leaf (AdamW).
    acc_losses, _ = train_checked(plan, model, optimizer, mse_loss, batches, accumulate=4)
    assert_trees_close(acc_losses, full_losses)


@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_moves_the_gradient_bytes_once(mode):
    model = TinyTransformer(key=jax.random.key(2))
    optimizer = optax.adamw(1e-3)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), mode=mode)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(lm_loss, optimizer, plan)
    stats = eqxpar.inspect.collective_stats(step.compile(state, token_batches(1)[0]))
    assert set(stats.count) == {"all-reduce"}
    # Gradient bytes once, plus the scalar loss (4 bytes).
    assert stats.bytes["all-reduce"] == param_bytes(model) + 4


def test_manual_step_has_no_second_gradient_reduction():
    # A pmean after check_vma's implicit psum would double the gradient traffic.
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(1))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), mode="manual")
    state = eqxpar.train.init(model, optax.sgd(1e-2), plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(mse_loss, optax.sgd(1e-2), plan)
    stats = eqxpar.inspect.collective_stats(step.compile(state, regression_batches(1)[0]))
    assert stats.bytes["all-reduce"] < 1.01 * param_bytes(model) + 64


@pytest.mark.parametrize("mode", MODES)
def test_state_sharding_is_stable_and_step_compiles_once(mode):
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(1))
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(1e-2, 0.0, 10))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, fsdp=2), mode=mode)
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(mse_loss, optimizer, plan)

    def shardings(state):
        return jax.tree.map(lambda x: x.sharding, eqx.filter(state, eqx.is_array))

    after_init = shardings(state)
    assert all(s.spec == P() for s in jax.tree.leaves(after_init))
    batches = regression_batches(10)
    state, metrics = step(state, batches[0])
    assert shardings(state) == after_init
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2)

    compiles = []
    listener = lambda event, *a, **k: compiles.append(event) if "backend_compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for batch in batches[1:]:
            state, metrics = step(state, batch)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    assert shardings(state) == after_init
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2 * (1 - 9 / 10))
    assert set(metrics) == {"loss", "grad_norm", "learning_rate"}


def test_has_aux_and_loss_with_key():
    model = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(1))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    keys_seen = []

    def loss_fn(model, batch, *, key):
        keys_seen.append(key)
        x, y = batch
        noise = 0.0 * jax.random.normal(key, ())
        err = jax.vmap(model)(x) - y + noise
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    state = eqxpar.train.init(model, optax.sgd(1e-2), plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss_fn, optax.sgd(1e-2), plan, has_aux=True)
    batch = regression_batches(1)[0]
    _, metrics = step(state, batch)
    expected = jnp.mean(jnp.abs(jax.vmap(model)(batch[0]) - batch[1]))
    assert_trees_close(metrics["aux"]["mae"], expected)
    assert keys_seen, "the loss function was given a key"


def test_caller_model_survives_donation():
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(1))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    state = eqxpar.train.init(model, optax.sgd(1e-2), plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(mse_loss, optax.sgd(1e-2), plan)
    step(state, regression_batches(1, d_in=4)[0])
    assert np.isfinite(np.asarray(model.layers[0].weight)).all()  # not deleted


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("accumulate", [1, 4])
def test_loss_and_gradients_equal_single_device(mode, accumulate):
    model = TinyTransformer(key=jax.random.key(2))
    batch = token_batches(1, batch=32)[0]
    ref_loss, ref_grads = eqx.filter_value_and_grad(lm_loss)(model, batch)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, fsdp=2), mode=mode)
    loss, grads = eqxpar.train.make_value_and_grad(lm_loss, plan, accumulate=accumulate)(model, batch)
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grads, ref_grads)
    assert all(g.sharding.spec == P() for g in jax.tree.leaves(grads))
