"""Dropout on the attention probabilities: for one key the dense, blockwise
(several tilings) and context-parallel (ring, all-gather and Ulysses, both layouts) paths
drop the same probabilities, forward and gradients, causal or not, grouped-query;
the kept fraction is 1 - rate; no key or rate 0 is exactly no dropout; a
TransformerBlock with heads split over a manual tensor axis equals one device."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.nn._attention import dense_attention

from ._helpers import (
    ATTENTION_ATOL,
    PackedSequenceModel,
    assert_trees_close,
    assert_trees_close_to_scale,
    context_attention_fn,
    output_and_grads,
    packed_segment_ids,
    packed_sequence_loss,
    random_qkv,
)

RATE = 0.3
KEY = jax.random.key(7)


# Non-causal in make test-slow (16 s on 2 cores): the causal case runs every path.
@pytest.mark.parametrize("causal", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_every_path_drops_the_same_probabilities(causal):
    args, cot = random_qkv(0, 32, 4, 2)
    dense = functools.partial(dense_attention, causal=causal, mask=None, dropout=RATE, key=KEY)
    ref = output_and_grads(dense, args, cot)
    # The dropout changes the result (it is not silently off).
    plain = output_and_grads(functools.partial(dense_attention, causal=causal, mask=None), args, cot)
    assert np.abs(np.asarray(ref[0] - plain[0])).max() > 1e-2
    for block in (8, 12):  # 12: the last block padded
        blockwise = functools.partial(
            nn.blockwise_attention, causal=causal, block_size=block, dropout=RATE, key=KEY
        )
        assert_trees_close(output_and_grads(blockwise, args, cot), ref, atol=ATTENTION_ATOL)
    for impl, load_balanced in (("ring", True), ("allgather", True), ("ring", False), ("ulysses", True)):
        assert_trees_close(
            output_and_grads(
                context_attention_fn(
                    4, causal=causal, load_balanced=load_balanced, impl=impl, dropout=RATE, key=KEY
                ),
                args,
                cot,
            ),
            ref,
            atol=ATTENTION_ATOL,
        )


def test_dropout_with_segment_ids_on_blockwise_and_ring():
    args, cot = random_qkv(1, 32, 2, 2)
    seg = packed_segment_ids(1, 2, 32)
    ref = output_and_grads(
        functools.partial(dense_attention, causal=True, mask=None, segment_ids=seg, dropout=RATE, key=KEY),
        args,
        cot,
    )
    blockwise = functools.partial(
        nn.blockwise_attention, causal=True, segment_ids=seg, block_size=8, dropout=RATE, key=KEY
    )
    assert_trees_close(output_and_grads(blockwise, args, cot), ref, atol=ATTENTION_ATOL)
    assert_trees_close(
        output_and_grads(
            context_attention_fn(
                2, causal=True, load_balanced=True, impl="ring", segment_ids=seg, dropout=RATE, key=KEY
            ),
            args,
            cot,
        ),
        ref,
        atol=ATTENTION_ATOL,
    )


def test_kept_fraction_is_one_minus_rate():
    # Zero queries: every probability is 1/s; v the identity over keys, so the
    # output's entry (i, j) is Z_ij / s, nonzero exactly where kept.
    b, s, h = 2, 64, 4
    zeros = jnp.zeros((b, s, h, s))
    v = jnp.broadcast_to(jnp.eye(s)[None, :, None, :], (b, s, h, s))
    out = nn.blockwise_attention(zeros, zeros, v, causal=False, block_size=16, dropout=RATE, key=KEY)
    kept = np.asarray(out > 0)
    assert abs(kept.mean() - (1 - RATE)) < 0.01
    got = np.asarray(out)[kept]
    assert_trees_close(got, np.full(got.shape, 1 / (s * (1 - RATE))))
    # Heads and batch rows draw different masks.
    assert (kept[0, :, 0] != kept[0, :, 1]).any() and (kept[0] != kept[1]).any()


def test_no_key_or_rate_zero_is_exactly_no_dropout():
    x = jax.random.normal(jax.random.key(1), (2, 24, 32))
    for attention in ("dense", "blockwise"):
        kw = dict(num_kv_heads=2, kernel=attention, block_size=8)
        with_rate = nn.Attention(32, nn.AttentionConfig(4, dropout=RATE, **kw), key=jax.random.key(2))
        without = nn.Attention(32, nn.AttentionConfig(4, **kw), key=jax.random.key(2))
        base = without(x)
        np.testing.assert_array_equal(with_rate(x), base)
        np.testing.assert_array_equal(without(x, key=KEY), base)
        assert not np.allclose(with_rate(x, key=KEY), base)
    with pytest.raises(eqxpar.PlanError, match=r"dropout=1.0.*\[0, 1\)"):
        nn.AttentionConfig(4, dropout=1.0)


@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_block_with_heads_split_over_tensor_equals_one_device(attention):
    attn = nn.AttentionConfig(4, num_kv_heads=2, kernel=attention, block_size=8, dropout=RATE)
    block = nn.TransformerBlock(32, 64, nn.BlockConfig(attn, dropout=0.1), key=jax.random.key(3))
    x = jax.random.normal(jax.random.key(4), (4, 24, 32))
    ref = jax.jit(lambda m, x: m(x, key=KEY))(block, x)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual")

    def apply(m, x):
        return m(x, key=KEY)

    sharded = eqxpar.filter_shard_map(
        apply, plan, in_specs=(eqxpar.partition_specs(block, plan), P()), out_specs=P(), axis_names={"tensor"}
    )
    with plan:
        out = eqx.filter_jit(sharded)(eqxpar.shard(block, plan), x)
    assert_trees_close_to_scale(out, ref)
    assert not np.allclose(out, jax.jit(lambda m, x: m(x))(block, x))


@pytest.mark.parametrize(
    "make_plan",
    [
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, context=4), mode="manual"),
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, context=2, tensor=2),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
            context_attention="allgather",
        ),
    ],
    ids=["ring-data", "allgather-tensor-sp"],
)
def test_attention_dropout_in_a_context_step(make_plan):
    # The step folds each device's index into the key (independent masks per
    # device), so this checks that dropout runs in the step and takes effect.
    model = eqx.tree_at(
        lambda m: m.blocks,
        PackedSequenceModel(True, jax.random.key(0)),
        nn.Stacked(
            lambda k: nn.TransformerBlock(
                32, 64, nn.BlockConfig(nn.AttentionConfig(4, num_kv_heads=2, dropout=RATE)), key=k
            ),
            depth=2,
            key=jax.random.key(1),
        ),
    )
    ids = jax.random.randint(jax.random.key(2), (4, 32), 0, 32)
    batch = (ids, packed_segment_ids(3, 4, 32))

    def loss(m, batch, *, key=None):
        ids, seg = batch
        return nn.sequence_mean(jnp.sum(jnp.square(m.blocks(m.embed(ids), segment_ids=seg, key=key)), -1))

    plain = eqx.filter_jit(packed_sequence_loss)(model, batch)  # no key: no dropout
    dropped, grads = eqxpar.train.make_value_and_grad(loss, make_plan())(model, batch, key=KEY)
    assert np.isfinite(float(dropped)) and abs(float(dropped) - float(plain)) > 1e-4
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
