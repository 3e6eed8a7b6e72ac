"""The Equinox-documented filter_jit loop over a model placed by eqxpar.shard
gives the single-device result (examples/filter_jit_loop.py)."""

import importlib.util
import pathlib

import equinox as eqx
import jax
import optax

import eqxpar

from ._helpers import assert_steps_match_one_device, assert_trees_close, param_bytes, record_gradients

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "filter_jit_loop.py"


def load_example():
    spec = importlib.util.spec_from_file_location("filter_jit_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_user_loop_is_data_parallel_and_matches_one_device():
    example = load_example()
    model = eqx.nn.MLP(1, 1, 32, 2, activation=jax.nn.tanh, key=jax.random.key(1))
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    # The loop donates its model: give each run its own copy.
    fresh = lambda: jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, model)  # noqa: E731
    _, ref_losses = example.train(fresh(), optax.adam(3e-3), example.batches(6))
    par_model, par_losses = example.train(fresh(), optax.adam(3e-3), example.batches(6), plan)
    assert_trees_close(par_losses, ref_losses)
    assert par_model.layers[0].weight.sharding.spec == jax.sharding.PartitionSpec()

    # The same loop's step, each step's own loss and gradients against one device's
    # elementwise, its parameters per leaf (Adam: see assert_params_close).
    placed = eqxpar.shard(fresh(), plan)
    recording = record_gradients(optax.adam(3e-3))
    opt_state = recording.init(eqx.filter(placed, eqx.is_array))
    step = example.make_step(recording)

    def advance(batch):
        nonlocal placed, opt_state
        placed, opt_state, loss = step(*eqxpar.shard_batch(batch, plan), placed, opt_state)
        return placed, opt_state, loss

    def loss_fn(model, batch):
        return example.loss_fn(model, *batch)

    assert_steps_match_one_device(advance, model, optax.adam(3e-3), loss_fn, example.batches(6))

    # The compiled step splits the batch and all-reduces the gradients once.
    x, y = eqxpar.shard_batch(next(example.batches(1)), plan)
    placed = eqxpar.shard(model, plan)
    opt_state = optax.adam(3e-3).init(eqx.filter(placed, eqx.is_array))
    compiled = example.make_step(optax.adam(3e-3)).lower(x, y, placed, opt_state).lowered.compile()
    stats = eqxpar.inspect.collective_stats(compiled)
    assert stats.bytes["all-reduce"] == param_bytes(model) + 4
