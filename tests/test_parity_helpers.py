"""The parity helpers the training tests rely on still catch parity bugs: a
parameter leaf off by 1e-4 of its scale, a gradient scaled by 2, a gradient with
one device's shard zeroed or its share missing, an optimizer state not carried;
and accept what sharding really changes (summation order: rounding)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
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
    # The elementwise comparison allows the same leaf-scale noise (its absolute term
    # is rtol x the leaf's scale) ...
    assert_trees_close(noisy, params)
    # ... which a purely elementwise bound would reject, on the entries near zero.
    with pytest.raises(AssertionError):
        for name in params:
            np.testing.assert_allclose(noisy[name], params[name], rtol=1e-5, atol=0)
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


def test_trees_close_accepts_the_avx2_pipeline_rounding():
    # The case that failed a purely elementwise atol of 1e-6 on an AVX2 CPU: one
    # gradient element, 0.05 in a leaf whose elements reach 4, 2.1e-6 off (2 float32
    # ulps of the leaf's largest element; 9.7e-5 of the element itself).
    leaf = jnp.linspace(-4.0, 4.0, 512).at[7].set(0.05)
    moved = leaf.at[7].add(2.1e-6)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(moved, leaf, rtol=1e-5, atol=1e-6)
    assert_trees_close({"w": moved}, {"w": leaf})
    # But the same element off by 1e-4 (2.5e-5 of the leaf's scale) is not rounding.
    with pytest.raises(AssertionError):
        assert_trees_close({"w": leaf.at[7].add(1e-4)}, {"w": leaf})


@pytest.mark.parametrize("chunks", [2, 8, 64])
def test_trees_close_accepts_a_float32_sum_in_another_order(chunks):
    # x.T @ g over a batch of 4096 (a weight's gradient): in float32 with the batch
    # split into `chunks` partial sums added one after another (what a data-parallel
    # psum or another vector width does to the order), against the exact sum rounded
    # to float32. The elements span zero, so many sit near it after cancellation.
    kx, kg = jax.random.split(jax.random.key(3))
    x = np.asarray(jax.random.normal(kx, (4096, 32)))
    g = np.asarray(jax.random.normal(kg, (4096, 16)))
    exact = (x.astype(np.float64).T @ g.astype(np.float64)).astype(np.float32)
    parts = [x[i::chunks].T @ g[i::chunks] for i in range(chunks)]  # float32 throughout
    reordered = parts[0]
    for p in parts[1:]:
        reordered = reordered + p
    assert reordered.dtype == np.float32
    # Measured: up to 1e-4 off on elements of up to 214, several elements past an
    # elementwise rtol 1e-5 / atol 1e-6, and within 4% of this helper's bound.
    assert_trees_close(reordered, exact)


def _bugs(full, shards):
    """The gradients a buggy all-reduce would give, by name."""
    mean = jax.tree.map(lambda *g: sum(g) / 8, *shards)
    return {
        "factor_2": jax.tree.map(lambda g: 2 * g, mean),  # a psum where a pmean belongs
        "factor_1.01": jax.tree.map(lambda g: 1.01 * g, mean),  # e.g. a mean over 99 of 100 tokens
        "half": jax.tree.map(lambda g: g / 2, mean),  # a mean taken twice over a 2-way axis
        "missing_share": jax.tree.map(lambda *g: sum(g[1:]) / 8, *shards),  # one of 8 devices left out
        "wrong_sign": jax.tree.map(lambda g: -g, mean),
    }


@pytest.mark.parametrize("bug", ["factor_2", "factor_1.01", "half", "missing_share", "wrong_sign"])
def test_trees_close_rejects_each_bug_in_each_leaf(bug):
    # The bug in one leaf alone (a weight or a bias, each judged at its own scale)
    # fails the comparison; the correctly reduced gradients pass.
    full, shards = _sharded_gradients()
    mean = jax.tree.map(lambda *g: sum(g) / 8, *shards)
    wrong = _bugs(full, shards)[bug]
    leaves, treedef = jax.tree.flatten(eqx.filter(mean, eqx.is_array))
    wrong_leaves = jax.tree.leaves(eqx.filter(wrong, eqx.is_array))
    assert len(leaves) == 6  # 3 weights, 3 biases
    assert_trees_close(mean, full)
    for i in range(len(leaves)):
        mixed = [w if j == i else g for j, (g, w) in enumerate(zip(leaves, wrong_leaves, strict=True))]
        one_wrong = jax.tree.unflatten(treedef, mixed)
        with pytest.raises(AssertionError):
            assert_trees_close(one_wrong, eqx.filter(full, eqx.is_array))
