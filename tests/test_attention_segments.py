"""Segment ids (packed sequences, padding): blockwise attention equals dense,
forward and gradients (causal or not, grouped-query, padded key blocks, with a
mask too); context attention, ring, all-gather and Ulysses, equals dense single-device
attention over the whole sequence in both layouts; `nn.Attention` and stacked
`nn.TransformerBlock`s given the whole sequence's ids under context plans (with
tensor and sequence parallelism) equal one device; bad ids raise eqxpar errors."""

import functools

import jax
import jax.numpy as jnp
import pytest

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
    value_and_grad_on_one_device,
)


def test_dense_segment_ids_are_the_per_row_mask():
    (q, k, v), _ = random_qkv(0, 16, 2, 2, batch=1)
    seg = packed_segment_ids(0, 1, 16)
    mask = seg[0][:, None] == seg[0][None, :]
    by_ids = dense_attention(q, k, v, causal=True, mask=None, segment_ids=seg)
    assert_trees_close(by_ids, dense_attention(q, k, v, causal=True, mask=mask), atol=ATTENTION_ATOL)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("seq", "heads", "kv_heads", "block"), [(40, 4, 2, 16), (24, 2, 2, 8)])
def test_blockwise_equals_dense(causal, seq, heads, kv_heads, block):
    args, cot = random_qkv(1, seq, heads, kv_heads)
    seg = packed_segment_ids(1, 2, seq)
    blockwise = functools.partial(nn.blockwise_attention, causal=causal, segment_ids=seg, block_size=block)
    dense = functools.partial(dense_attention, causal=causal, mask=None, segment_ids=seg)
    assert_trees_close(
        output_and_grads(blockwise, args, cot), output_and_grads(dense, args, cot), atol=ATTENTION_ATOL
    )


def test_blockwise_segments_and_mask_combine():
    args, cot = random_qkv(2, 20, 2, 1)
    seg = packed_segment_ids(2, 2, 20)
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (20, 20)) | jnp.eye(20, dtype=bool)
    blockwise = functools.partial(
        nn.blockwise_attention, causal=False, mask=mask, segment_ids=seg, block_size=8
    )
    dense = functools.partial(dense_attention, causal=False, mask=mask, segment_ids=seg)
    assert_trees_close(
        output_and_grads(blockwise, args, cot), output_and_grads(dense, args, cot), atol=ATTENTION_ATOL
    )


@pytest.mark.parametrize("impl", ["ring", "allgather", "ulysses"])
@pytest.mark.parametrize(("causal", "load_balanced"), [(True, True), (True, False), (False, True)])
def test_context_attention_equals_dense(impl, causal, load_balanced):
    n, seq = 4, 48
    args, cot = random_qkv(4, seq, 4, 2)
    seg = packed_segment_ids(4, 2, seq, pad=5)
    out, grads = output_and_grads(
        context_attention_fn(n, causal=causal, load_balanced=load_balanced, impl=impl, segment_ids=seg),
        args,
        cot,
    )
    ref = output_and_grads(
        functools.partial(dense_attention, causal=causal, mask=None, segment_ids=seg), args, cot
    )
    assert_trees_close((out, grads), ref, atol=ATTENTION_ATOL)


@pytest.mark.parametrize(
    "causal,make_plan",
    [
        (True, lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, context=4), mode="manual")),
        (
            False,
            lambda: eqxpar.Plan(
                eqxpar.make_mesh(data=2, context=2, tensor=2),
                rules=eqxpar.rules.MEGATRON,
                mode="manual",
                sequence_parallel=True,
                context_attention="allgather",
            ),
        ),
    ],
    ids=["ring-data", "allgather-tensor-sp"],
)
def test_packed_blocks_under_context_match_single_device(causal, make_plan):
    model = PackedSequenceModel(causal, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, 32)
    batch = (ids, packed_segment_ids(5, 4, 32, pad=6))
    loss, grads = eqxpar.train.make_value_and_grad(packed_sequence_loss, make_plan())(model, batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, packed_sequence_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)
    # The ids matter: without them the loss differs.
    plain, _ = value_and_grad_on_one_device(model, packed_sequence_loss, (ids, jnp.zeros_like(ids)))
    assert abs(float(plain) - float(ref_loss)) > 1e-4


def test_bad_segment_ids_raise():
    (q, k, v), _ = random_qkv(0, 16, 2, 2)
    with pytest.raises(eqxpar.SpecError, match=r"segment_ids of shape \(2, 8\).*expected.*\(2, 16\)"):
        nn.blockwise_attention(q, k, v, causal=True, segment_ids=jnp.zeros((2, 8), jnp.int32))
    attn = nn.Attention(16, nn.AttentionConfig(4), key=jax.random.key(0))
    x = jnp.ones((2, 16, 16))
    with pytest.raises(eqxpar.SpecError, match=r"shape \(2, 8\).*expected.*\(2, 16\)"):
        attn(x, segment_ids=jnp.zeros((2, 8), jnp.int32))
    # Under context parallelism the ids are still the whole sequence's.
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, context=4), mode="manual")

    def loss(m, batch):
        x, seg = batch
        return jnp.mean(m(nn.split_sequence(x), segment_ids=nn.split_sequence(seg)))

    batch = (jnp.ones((4, 16, 16)), jnp.zeros((4, 16), jnp.int32))
    with pytest.raises(eqxpar.SpecError, match=r"shape \(2, 4\).*expected.*\(2, 16\).*whole"):
        eqxpar.train.make_value_and_grad(loss, plan)(attn, batch)
