"""The parity helpers the training tests rely on still catch parity bugs: a
parameter leaf off by 1e-4 of its scale, a gradient scaled by 2, a gradient with
one device's shard zeroed or its share missing, an optimizer state not carried;
and accept what sharding really changes (summation order: rounding)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

from ._helpers import (
    assert_params_close,
    assert_steps_match_one_device,
    assert_trees_close,
    mse_loss,
    record_gradients,
    regression_batches,
)


def _params():
    # Leaves of very different scales: each is judged against its own.
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    return {
        "w": jax.random.normal(k1, (64, 32)),
        "b": 1e-3 * jax.random.normal(k2, (32,)),
        "big": 300.0 * jax.random.normal(k3, (8, 8)),
    }


@pytest.mark.parametrize("leaf", ["w", "b", "big"])
def test_params_close_rejects_one_leaf_off_by_1e4_of_its_scale(leaf):
    params = _params()
    scale = float(jnp.max(jnp.abs(params[leaf])))
    off = dict(params)
    off[leaf] = params[leaf].reshape(-1).at[7].add(1e-4 * scale).reshape(params[leaf].shape)
    with pytest.raises(AssertionError, match="leaf's scale"):
        assert_params_close(off, params)
    # And one element off by 2e-5 of its leaf's scale (the bound is 1e-5).
    near = dict(params)
    near[leaf] = params[leaf].reshape(-1).at[7].add(2e-5 * scale).reshape(params[leaf].shape)
    with pytest.raises(AssertionError):
        assert_params_close(near, params)


def test_params_close_accepts_rounding_level_noise():
    params = _params()
    key = jax.random.key(1)
    noisy = {}
    for name, x in params.items():
        key, k = jax.random.split(key)
        # Every element moved by up to 1e-6 of its leaf's scale: tens of float32
        # ulps of the leaf's largest entries, and far more than that, relative to
        # themselves, for entries near zero, which elementwise rtol would reject.
        noisy[name] = x + 1e-6 * jnp.max(jnp.abs(x)) * jax.random.uniform(k, x.shape, minval=-1, maxval=1)
    assert_params_close(noisy, params)
    with pytest.raises(AssertionError):
        assert_trees_close(noisy, params, atol=0)
    assert_params_close(params, params)


def test_params_close_zero_leaf_must_stay_zero():
    params = {"w": jnp.ones((4, 4)), "zero": jnp.zeros((4,))}
    assert_params_close(params, params)
    with pytest.raises(AssertionError):
        assert_params_close({"w": params["w"], "zero": params["zero"].at[0].set(1e-12)}, params)


def _sharded_gradients():
    """Gradients of an MLP on a batch: on one device, and as the mean of 8
    per-shard gradients (what data parallelism computes, summed in another order)."""
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(1))
    x, y = regression_batches(1, batch=64)[0]
    grad = eqx.filter_jit(eqx.filter_grad(mse_loss))
    full = grad(model, (x, y))
    shards = [grad(model, (x[i::8], y[i::8])) for i in range(8)]
    return full, shards


def test_gradient_comparison_accepts_sharded_rounding_and_rejects_bugs():
    full, shards = _sharded_gradients()
    mean = jax.tree.map(lambda *g: sum(g) / 8, *shards)
    assert_trees_close(mean, full)  # the reduction order differs: rounding only

    # A gradient off by a factor of 2 (e.g. a psum where a pmean belongs).
    with pytest.raises(AssertionError):
        assert_trees_close(jax.tree.map(lambda g: 2 * g, mean), full)
    # One device's share missing from the all-reduce.
    missing = jax.tree.map(lambda *g: sum(g[1:]) / 8, *shards)
    with pytest.raises(AssertionError):
        assert_trees_close(missing, full)
    # No all-reduce at all: one device's own gradient.
    with pytest.raises(AssertionError):
        assert_trees_close(shards[0], full)

    # One shard (an eighth of a sharded weight's columns) zeroed, for each weight.
    for i in range(len(full.layers)):
        w = mean.layers[i].weight
        zeroed = eqx.tree_at(lambda m: m.layers[i].weight, mean, w.at[:, : w.shape[1] // 8].set(0.0))  # noqa: B023
        with pytest.raises(AssertionError):
            assert_trees_close(zeroed, full)


def _single_device_run(optimizer, *, grad_factor=1.0, reset_state=False):
    """A hand-written one-device training loop to check (the `advance` of
    `assert_steps_match_one_device`), with an optional bug."""
    recording = record_gradients(optimizer)
    model = eqx.nn.MLP(16, 4, 32, 1, key=jax.random.key(1))

    @eqx.filter_jit
    def step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(mse_loss)(model, batch)
        grads = jax.tree.map(lambda g: grad_factor * g, grads)
        params = eqx.filter(model, eqx.is_inexact_array)
        if reset_state:
            opt_state = recording.init(params)
        updates, opt_state = recording.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    state = [model, recording.init(eqx.filter(model, eqx.is_inexact_array))]

    def advance(batch):
        state[0], state[1], loss = step(state[0], state[1], batch)
        return state[0], state[1], loss

    return advance, model


def test_step_check_accepts_a_correct_run():
    advance, model = _single_device_run(optax.adamw(1e-2))
    losses = assert_steps_match_one_device(advance, model, optax.adamw(1e-2), mse_loss, regression_batches(3))
    assert len(losses) == 3


def test_step_check_rejects_doubled_gradients_under_adam():
    # Adam's update is nearly invariant to the gradient's scale, so the parameters
    # alone can hardly show this bug; the step's own gradients do.
    advance, model = _single_device_run(optax.adamw(1e-2), grad_factor=2.0)
    with pytest.raises(AssertionError, match="gradients at step 0"):
        assert_steps_match_one_device(advance, model, optax.adamw(1e-2), mse_loss, regression_batches(3))


def test_step_check_rejects_an_optimizer_state_not_carried():
    # Right gradients every step, but Adam restarted each step: the parameters show it.
    advance, model = _single_device_run(optax.adamw(1e-2), reset_state=True)
    with pytest.raises(AssertionError, match="parameters after step 1"):
        assert_steps_match_one_device(advance, model, optax.adamw(1e-2), mse_loss, regression_batches(3))
