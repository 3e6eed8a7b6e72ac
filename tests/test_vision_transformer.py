"""The Vision Transformer of examples/vision_transformer.py under its plans (data 4 x
tensor 2, automatic and manual sequence parallel; `vit/*` in examples/_plans.py):
loss and gradients equal one device's without dropout, with mean pooling and with a
class token; with dropout the step trains, the loss differs from the dropout-free
one and is the same for the same key; a token count that sequence parallelism
cannot split raises eqxpar's error naming the padding."""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqxpar

from ._helpers import assert_trees_close, assert_trees_close_to_scale, example

PLANS = example("_plans").PLANS

vit = example("vision_transformer")

MODES = ["auto", "sp"]
# Token counts that tensor 2 divides: 16 patches (mean pooling), 9 patches + the
# class token (first-token pooling).
IMAGE = {"mean": (8, 2), "first": (12, 4)}  # pool -> (image size, patch)
BATCH, CLASSES = 8, 4


def model(pool: str = "mean", dropout: float = 0.0, image: tuple[int, int] | None = None):
    size, patch = image or IMAGE[pool]
    return eqx.filter_jit(
        lambda key: vit.ViT(
            image_size=size,
            patch=patch,
            d_model=16,
            layers=2,
            heads=2,
            classes=CLASSES,
            dropout=dropout,
            pool=pool,
            key=key,
        )
    )(jax.random.key(0))


def batch(pool: str = "mean", size: int | None = None):
    images, labels = vit.make_images(np.random.default_rng(0), BATCH, size or IMAGE[pool][0], CLASSES)
    return jax.numpy.asarray(images), jax.numpy.asarray(labels)


def plan(mode: str) -> eqxpar.Plan:
    return PLANS[f"vit/{mode}"].plan()


_single_device = eqx.filter_jit(eqx.filter_value_and_grad(vit.loss_fn))


def single_device(model, data, key=None):
    """Loss and gradients on one device; dropout only with a `key`."""
    model, data = jax.device_put((model, data), jax.devices()[0])
    return _single_device(model, data, key=key)


@pytest.mark.parametrize("pool", ["mean", "first"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_single_device_without_dropout(mode, pool):
    m, data = model(pool), batch(pool)
    loss, grads = eqxpar.train.make_value_and_grad(vit.loss_fn, plan(mode))(m, data)
    ref_loss, ref_grads = single_device(m, data)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


@pytest.mark.parametrize("mode", MODES)
def test_dropout(mode):
    m, data, key = model(dropout=0.3), batch(), jax.random.key(7)
    value_and_grad = eqxpar.train.make_value_and_grad(vit.loss_fn, plan(mode))
    loss, grads = value_and_grad(m, data, key=key)
    again, grads_again = value_and_grad(m, data, key=key)
    other, _ = value_and_grad(m, data, key=jax.random.key(8))
    no_dropout, _ = single_device(m, data)  # no key: no dropout
    assert float(loss) == float(again)  # the same key, the same masks
    assert_trees_close_to_scale(grads_again, grads, rtol=0, atol=0)
    assert abs(float(loss) - float(no_dropout)) > 1e-4
    assert abs(float(loss) - float(other)) > 1e-4
    if mode == "auto":
        # The compiler partitions the random bits (threefry is partitionable): the
        # masks, hence the loss and gradients, are one device's for the same key.
        ref_loss, ref_grads = single_device(m, data, key)
        assert_trees_close(float(loss), float(ref_loss))
        assert_trees_close_to_scale(grads, ref_grads)

    # The train step hands the loss a fresh key each step, and trains.
    optimizer = optax.adam(3e-3)
    state = eqxpar.train.init(m, optimizer, plan(mode), key=jax.random.key(1))
    step = eqxpar.train.make_step(vit.loss_fn, optimizer, plan(mode))
    losses = []
    for _ in range(2):
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
    assert np.all(np.isfinite(losses)) and int(state.step) == 2


def test_token_count_that_does_not_split_raises():
    # 16 patches + the class token = 17 tokens over tensor 2.
    m, data = model("first", image=(8, 2)), batch(size=8)
    with pytest.raises(eqxpar.DivisibilityError, match=r"\(17 tokens\).*Pad every sequence by 1 to 18"):
        eqxpar.train.make_value_and_grad(vit.loss_fn, plan("sp"))(m, data)
    # The script stops with that message.
    flags = ["--mode", "sp", "--pool", "first", "--steps", "1", "--d-model", "16", "--layers", "1"]
    with pytest.raises(SystemExit, match=r"^error: .*17 tokens.*Pad every sequence by 1 to 18 tokens"):
        vit.main(flags)
