"""Layers for any model: dropout, encoder (non-causal) blocks with residual
dropout, per-layer keys in a `Stacked`, and sequence pooling in every mode."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxpar
from eqxpar import nn

from ._helpers import Encoder, assert_trees_close, assert_trees_close_to_scale, encoder_loss

D, HEADS, HIDDEN, BATCH, SEQ, VOCAB = 16, 4, 32, 4, 8, 32


def test_dropout_statistics():
    x = jnp.ones((400, 400))
    y = nn.Dropout(0.3)(x, key=jax.random.key(0))
    kept = np.asarray(y != 0)
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.7, rtol=1e-6)
    assert abs(float(y.mean()) - 1.0) < 0.02
    other = nn.Dropout(0.3)(x, key=jax.random.key(1))
    assert not bool(jnp.all((other != 0) == (y != 0)))


def test_dropout_identity_cases():
    x = jax.random.normal(jax.random.key(0), (8, 8))
    key = jax.random.key(1)
    assert nn.Dropout(0.0)(x, key=key) is x
    assert nn.Dropout(0.5)(x) is x
    assert nn.Dropout(0.5, inference=True)(x, key=key) is x
    assert nn.Dropout(0.5)(x, key=key, inference=True) is x
    assert not bool(jnp.all(nn.Dropout(0.5, inference=True)(x, key=key, inference=False) == x))


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5])
def test_dropout_bad_rate(rate):
    with pytest.raises(eqxpar.PlanError, match=str(rate)):
        nn.Dropout(rate)


def _reference_block(block, x):
    """The block's computation written out with non-causal dense attention."""
    a = block.attn
    h = block.norm1(x)
    q = jnp.einsum("bsd,dhk->bshk", h, a.wq) + a.bq[None, None]
    k = jnp.einsum("bsd,dhk->bshk", h, a.wk) + a.bk[None, None]
    v = jnp.einsum("bsd,dhk->bshk", h, a.wv) + a.bv[None, None]
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(a.head_dim)
    heads = jnp.einsum("bhqs,bshk->bqhk", jax.nn.softmax(scores, axis=-1), v)
    x = x + jnp.einsum("bshk,hkd->bsd", heads, a.wo) + a.bo[None, None]
    return x + block.mlp(block.norm2(x))


def test_encoder_block_is_not_causal():
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D))
    causal = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=key)
    encoder = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS, causal=False)), key=key)
    assert encoder.attn.causal is False and causal.attn.causal is True
    y = encoder(x)
    assert not np.allclose(y, causal(x), rtol=1e-3)
    assert_trees_close(y, _reference_block(encoder, x), atol=1e-5)


def test_block_residual_dropout():
    key = jax.random.key(0)
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D))
    plain = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=key)
    dropped = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS), dropout=0.5), key=key)
    # Without a key: no dropout, the same program as dropout=0.
    np.testing.assert_array_equal(dropped(x), plain(x))
    assert jax.jit(lambda b, x: b(x)).lower(dropped, x).as_text() == (
        jax.jit(lambda b, x: b(x)).lower(plain, x).as_text()
    )
    # A key with dropout=0 changes nothing either.
    np.testing.assert_array_equal(plain(x, key=jax.random.key(2)), plain(x))
    y = dropped(x, key=jax.random.key(2))
    assert not np.allclose(y, plain(x))
    assert not np.allclose(y, dropped(x, key=jax.random.key(3)))


class DropoutOnly(eqx.Module):
    """A block that only applies dropout (and carries one weight to stack)."""

    scale: jax.Array
    drop: nn.Dropout

    def __init__(self, key):
        self.scale = jnp.ones(())
        self.drop = nn.Dropout(0.5)

    def __call__(self, x, *, key=None):
        return self.drop(x * self.scale, key=key)


class Recorder(DropoutOnly):
    """Records its layer's mask by writing it into a fresh slot of the output."""

    def __call__(self, x, *, key=None):
        mask = self.drop(self.scale * jnp.ones(x.shape[1:]), key=key)
        return jnp.concatenate([x[1:], mask[None]])


def test_stacked_gives_each_layer_its_own_key():
    depth = 4
    stack = nn.Stacked(Recorder, depth=depth, key=jax.random.key(0))
    masks = stack(jnp.zeros((depth, 64)), key=jax.random.key(1))
    # Row i holds layer i's mask; every layer dropped something, and no two agree.
    assert bool(jnp.all(jnp.any(masks == 0, axis=1)))
    for i in range(depth):
        for j in range(i):
            assert not bool(jnp.all(masks[i] == masks[j]))
    # The keys are split from the call's key: another key, other masks.
    assert not bool(jnp.all(masks == stack(jnp.zeros((depth, 64)), key=jax.random.key(2))))
    # Without a key the blocks get none: no dropout.
    np.testing.assert_array_equal(stack(jnp.zeros((depth, 64))), jnp.ones((depth, 64)))

    ones = nn.Stacked(DropoutOnly, depth=depth, key=jax.random.key(0))
    y = ones(jnp.ones((64,)), key=jax.random.key(1))
    kept = np.asarray(y != 0)
    assert 0 < kept.sum() < 64 and np.allclose(np.asarray(y)[kept], 2.0**depth)
    assert kept.sum() < 64 * 0.5**2  # independent masks: about 64 / 2**depth kept


class NoKey(eqx.Module):
    block: nn.TransformerBlock

    def __init__(self, key):
        self.block = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=key)

    def __call__(self, x):
        return self.block(x)


def test_stacked_without_key_lowers_as_before():
    x = jnp.ones((BATCH, SEQ, D))
    with_key = nn.Stacked(
        lambda k: nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=k),
        depth=3,
        key=jax.random.key(0),
    )
    no_key = nn.Stacked(NoKey, depth=3, key=jax.random.key(0))

    def text(stack):
        return jax.jit(lambda s, x: s(x)).lower(stack, x).as_text()

    assert text(with_key) == text(no_key)
    # A block that takes no key just runs without one.
    np.testing.assert_array_equal(no_key(x, key=jax.random.key(1)), no_key(x))


@pytest.mark.parametrize("unroll", [2, True])
def test_stacked_unrolled_computes_the_same_without_a_loop(unroll):
    make = lambda k: nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=k)  # noqa: E731
    scanned = nn.Stacked(make, depth=4, key=jax.random.key(0))
    unrolled = nn.Stacked(make, depth=4, unroll=unroll, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D))

    def loss(stack, x):
        return jnp.mean(stack(x) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    (want, want_g), (got, got_g) = grad(scanned, x), grad(unrolled, x)
    assert_trees_close(got, want)
    assert_trees_close_to_scale(got_g, want_g)
    # Four layers, `unroll` per iteration: a loop of two trips, or none.
    text = grad.lower(unrolled, x).compile().as_text()
    assert ("while(" in text) == (unroll is not True)
    # Stored as a number of layers: True is not the static field 1 of a scanned
    # stack (equal in Python), whose compiled program jit would reuse.
    assert unrolled.unroll == (4 if unroll is True else unroll)
    blocks = [unrolled[i] for i in range(4)]
    assert nn.Stacked.from_blocks(blocks, unroll=unroll).unroll == unrolled.unroll


@pytest.mark.parametrize("unroll", [0, -1])
def test_stacked_bad_unroll(unroll):
    make = lambda k: nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=k)  # noqa: E731
    with pytest.raises(eqxpar.PlanError, match=r"unroll=.*positive number of layers"):
        nn.Stacked(make, depth=2, unroll=unroll, key=jax.random.key(0))


def test_pooling_on_one_device():
    h = jax.random.normal(jax.random.key(0), (BATCH, SEQ, D))
    assert_trees_close(nn.mean_pool(h), jnp.mean(h, axis=1))
    np.testing.assert_array_equal(nn.first_token(h), h[:, 0])


def test_pooling_under_sequence_parallelism_matches_one_device():
    model = Encoder(jax.random.key(0))
    k1, k2 = jax.random.split(jax.random.key(1))
    batch = (
        jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB),
        jax.random.normal(k2, (BATCH, 3)),
    )
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(encoder_loss))(model, batch)
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4),
        rules=eqxpar.rules.MEGATRON,
        mode="manual",
        sequence_parallel=True,
    )
    loss, grads = eqxpar.train.make_value_and_grad(encoder_loss, plan)(model, batch)
    assert_trees_close(loss, ref_loss)
    assert_trees_close_to_scale(grads, ref_grads)


@pytest.mark.parametrize("vocab_rules", ["split", "whole"])
def test_sequence_that_does_not_split_names_the_padding(vocab_rules):
    # 10 tokens over tensor 4: the error says to pad by 2 to 12, whichever layer
    # meets the sequence first (the vocabulary-parallel embedding, or split_sequence
    # in front of a replicated one).
    from eqxpar.models import GPT, GPTConfig, lm_loss

    config = GPTConfig(vocab_size=32, d_model=32, num_heads=4, num_layers=1, d_hidden=64, max_seq_len=16)
    model = eqx.filter_jit(GPT)(config, key=jax.random.key(0))
    rules = {
        "split": eqxpar.rules.MEGATRON,
        "whole": eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"}),
    }[vocab_rules]
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=rules, mode="manual", sequence_parallel=True)
    tokens = jnp.zeros((8, 11), jnp.int32)
    match = r"sequence \(10 tokens\).*4 devices of mesh axis 'tensor'.*Pad every sequence by 2 to 12 tokens"
    with pytest.raises(eqxpar.DivisibilityError, match=match):
        eqxpar.train.make_value_and_grad(lm_loss, plan)(model, tokens)
