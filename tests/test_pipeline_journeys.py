"""A pretrained model through every pipeline plan, the way a user takes it: read
into the plan with `from_pretrained(path, plan)`, trained, checkpointed, restored
under another plan and exported with `save_pretrained`. The plan owns the layer
order (interleaved chunks, uneven stages): no step here reorders a layer by hand,
and every way out must give the natural order back.

The reference for the export is transformers itself: `trained.npz` holds the
logits `AutoModelForCausalLM` computed from the checkpoints eqxpar wrote after the
same training (tests/data/pipeline_journey/make_references.py).
"""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.checkpoint import CheckpointManager
from eqxpar.models import from_pretrained, lm_loss, save_pretrained
from eqxpar.nn import in_natural_order

from ._helpers import (
    JOURNEY_DATA,
    PIPELINE_JOURNEYS,
    Tiny,
    assert_trees_close,
    assert_trees_close_to_scale,
    journey_optimizer,
    journey_plan,
    journey_tokens,
    journey_train,
    pipeline_plan,
    regression_batch,
    tiny_loss,
)

pytest.importorskip("orbax.checkpoint")
pytest.importorskip("safetensors")

# make test runs the case whose order both permutes (interleaved) and pads (uneven
# stages); the other schedules and variants (30 s each on 2 cores) are in make test-slow.
FAST = {"interleaved-uneven"}
CASES = [pytest.param(name, marks=() if name in FAST else pytest.mark.slow) for name in PIPELINE_JOURNEYS]


@functools.cache
def one_device_step():
    """The same AdamW step on one device, from the natural-order model."""
    model = from_pretrained(JOURNEY_DATA / "base")
    optim, tokens = journey_optimizer(), journey_tokens()
    loss, grads = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss))(model, tokens)
    params = eqx.filter(model, eqx.is_inexact_array)
    updates, _ = optim.update(grads, optim.init(params), params)
    return float(loss), jax.device_get(eqx.apply_updates(model, updates))


def bits(tree):
    """Every array leaf of `tree` as host bytes (PRNG keys as their key data)."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    out = []
    for x in leaves:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        out.append(np.asarray(jax.device_get(x)))
    return out


def assert_bit_identical(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(bits(a), bits(b), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", CASES)
def test_pretrained_model_trains_checkpoints_and_exports_under_a_pipeline(name, tmp_path):
    plan = journey_plan(name)
    state, loss = journey_train(plan)
    # The plan stored the stack in its order, and the stack records it.
    assert state.model.blocks.order == plan.stack_order(8)
    trained = in_natural_order(state.model)

    # Trains like one device.
    ref_loss, ref_model = one_device_step()
    assert_trees_close(loss, ref_loss)
    assert_trees_close_to_scale(
        eqx.filter(trained, eqx.is_inexact_array), eqx.filter(ref_model, eqx.is_inexact_array)
    )
    # The model taken out of the state evaluates as the natural-order model does.
    tokens = journey_tokens()
    assert_trees_close(float(eqx.filter_jit(lm_loss)(state.model, tokens)), float(lm_loss(trained, tokens)))

    # Saved under the plan, restored under another pipeline order and under data=8:
    # bit-identical parameters and optimizer state, in natural order.
    other = "interleaved-uneven" if name != "interleaved-uneven" else "gpipe-uneven"
    with CheckpointManager(tmp_path / "checkpoints") as manager:
        manager.save(1, state)
        manager.wait()
        for target in (journey_plan(other), eqxpar.Plan(eqxpar.make_mesh(data=8))):
            like = eqx.filter_eval_shape(
                eqxpar.train.init, trained, journey_optimizer(), target, key=jax.random.key(0)
            )
            restored, _ = manager.restore(like=like, plan=target)
            assert restored.model.blocks.order == target.stack_order(8)
            assert_bit_identical(in_natural_order(restored), in_natural_order(state))

    # Exported in natural order: transformers reads the file with eqxpar's logits.
    save_pretrained(state.model, tmp_path / "exported")
    logits = np.asarray(eqx.filter_jit(lambda m, t: m(t))(from_pretrained(tmp_path / "exported"), tokens))
    reference = np.load(JOURNEY_DATA / "trained.npz")
    np.testing.assert_array_equal(reference["tokens"], tokens)
    assert_trees_close_to_scale(logits, reference[name])
    assert_trees_close_to_scale(logits, np.asarray(trained(tokens)))


def test_shard_and_gradients_keep_the_plans_order():
    # eqxpar.shard stores a natural-order model in the plan's order, once (a second
    # call moves nothing); make_value_and_grad's gradients come in the order of the
    # parameters they update, and refuse a model stored for another plan.
    plan = pipeline_plan("interleaved", pipe=2, microbatches=4, chunks=2, stage_layers=(1, 2, 1, 1))
    model, loss_fn, batch = Tiny(5, key=jax.random.key(0)), tiny_loss(), regression_batch(8)
    stored = eqxpar.shard(model, plan)
    assert stored.blocks.order == plan.stack_order(5) and stored.blocks.depth == 2 * 2 * 2
    assert_bit_identical(eqxpar.shard(stored, plan), stored)
    assert_bit_identical(in_natural_order(stored), model)
    # train.init stores it so too (5 layers: the natural stack's depth is not a
    # multiple of pipe=2; its stored rows are, and only they are split).
    assert_bit_identical(eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(1)).model, stored)
    value, grads = eqxpar.train.make_value_and_grad(loss_fn, plan)(stored, batch)
    assert grads.blocks.order == stored.blocks.order
    ref_value, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))(model, batch)
    assert_trees_close(float(value), float(ref_value))
    assert_trees_close_to_scale(in_natural_order(grads), ref_grads)
    # An update with those gradients, applied as they come, is the one-device update.
    optim = optax.sgd(0.1)
    updated = eqx.apply_updates(stored, optim.update(grads, optim.init(eqx.filter(stored, eqx.is_array)))[0])
    reference = eqx.apply_updates(
        model, optim.update(ref_grads, optim.init(eqx.filter(model, eqx.is_array)))[0]
    )
    assert_trees_close_to_scale(in_natural_order(updated), reference)
    other = pipeline_plan("interleaved", pipe=2, microbatches=4, chunks=2, stage_layers=(2, 1, 1, 1))
    with pytest.raises(eqxpar.PlanError, match=r"stored in pipeline order .* but this plan runs it in"):
        eqxpar.train.make_value_and_grad(loss_fn, other)(stored, batch)
