"""Segment ids (packed sequences, padding): blockwise attention equals dense,
forward and gradients (causal or not, grouped-query, padded key blocks, with a
mask too); context attention, ring and all-gather, equals dense single-device
attention over the whole sequence in both layouts; `nn.Attention` and stacked
`nn.TransformerBlock`s given the whole sequence's ids under context plans (with
tensor and sequence parallelism) equal one device; bad ids raise eqxpar errors."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxpar
from eqxpar import nn
from eqxpar.nn._attention import _attend

from ._helpers import RTOL, assert_trees_close, assert_trees_close_to_scale
from .test_context_attention import SPEC, _mesh, _value_and_grads
from .test_context_parallel import _single_device, mesh

ATOL = 2e-6


def _qkv(seed, s, hq, hkv, d=8, batch=2):
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, s, hq, d))
    k = jax.random.normal(kk, (batch, s, hkv, d))
    v = jax.random.normal(kv, (batch, s, hkv, d))
    return (q, k, v), jax.random.normal(kc, q.shape)


def segments(seed, batch, s, pad=3):
    """Packed documents of random lengths per row, the last `pad` tokens padding
    (their own id, 99)."""
    starts = jax.random.bernoulli(jax.random.key(seed), 0.2, (batch, s))
    ids = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    return ids.at[:, s - pad :].set(99)


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        assert_trees_close(x, y, rtol=RTOL, atol=ATOL)


def test_dense_segment_ids_are_the_per_row_mask():
    (q, k, v), _ = _qkv(0, 16, 2, 2, batch=1)
    seg = segments(0, 1, 16)
    mask = seg[0][:, None] == seg[0][None, :]
    by_ids = _attend(q, k, v, causal=True, mask=None, segment_ids=seg)
    _close(by_ids, _attend(q, k, v, causal=True, mask=mask))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("seq", "heads", "kv_heads", "block"), [(40, 4, 2, 16), (24, 2, 2, 8)])
def test_blockwise_equals_dense(causal, seq, heads, kv_heads, block):
    args, cot = _qkv(1, seq, heads, kv_heads)
    seg = segments(1, 2, seq)
    blockwise = functools.partial(nn.blockwise_attention, causal=causal, segment_ids=seg, block_size=block)
    dense = functools.partial(_attend, causal=causal, mask=None, segment_ids=seg)
    _close(_value_and_grads(blockwise, args, cot), _value_and_grads(dense, args, cot))


def test_blockwise_segments_and_mask_combine():
    args, cot = _qkv(2, 20, 2, 1)
    seg = segments(2, 2, 20)
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (20, 20)) | jnp.eye(20, dtype=bool)
    blockwise = functools.partial(
        nn.blockwise_attention, causal=False, mask=mask, segment_ids=seg, block_size=8
    )
    dense = functools.partial(_attend, causal=False, mask=mask, segment_ids=seg)
    _close(_value_and_grads(blockwise, args, cot), _value_and_grads(dense, args, cot))


def _context(n, causal, load_balanced, impl, seg):
    """Global q, k, v -> global output, context-parallel over n devices with the
    segment ids in the same layout as q, k, v."""
    lay = functools.partial(nn.context_layout, n=n, load_balanced=load_balanced)

    def attend(q, k, v, seg):
        return nn.context_attention(
            q, k, v, causal=causal, impl=impl, load_balanced=load_balanced, segment_ids=seg, block_size=4
        )

    sharded = jax.shard_map(attend, mesh=_mesh(n), in_specs=(SPEC,) * 4, out_specs=SPEC)

    def f(q, k, v):
        out = sharded(lay(q), lay(k), lay(v), lay(seg))
        return nn.context_unlayout(out, n, load_balanced=load_balanced)

    return f


@pytest.mark.parametrize("impl", ["ring", "allgather"])
@pytest.mark.parametrize(("causal", "load_balanced"), [(True, True), (True, False), (False, True)])
def test_context_attention_equals_dense(impl, causal, load_balanced):
    n, seq = 4, 48
    args, cot = _qkv(4, seq, 4, 2)
    seg = segments(4, 2, seq, pad=5)
    out, grads = _value_and_grads(_context(n, causal, load_balanced, impl, seg), args, cot)
    ref = _value_and_grads(functools.partial(_attend, causal=causal, mask=None, segment_ids=seg), args, cot)
    _close((out, grads), ref)


class Packed(eqx.Module):
    """Token embedding and two stacked blocks reading the rows' segment ids."""

    embed: nn.Embedding
    blocks: nn.Stacked

    def __init__(self, causal, key):
        k1, k2 = jax.random.split(key)
        self.embed = nn.Embedding(32, 32, key=k1)
        self.blocks = nn.Stacked(
            lambda k: nn.TransformerBlock(32, 4, 64, num_kv_heads=2, rotary=True, causal=causal, key=k),
            depth=2,
            key=k2,
        )

    def __call__(self, ids, seg):
        return self.blocks(self.embed(ids), segment_ids=seg)


def packed_loss(model, batch):
    ids, seg = batch
    return nn.sequence_mean(jnp.sum(jnp.square(model(ids, seg)), axis=-1))


@pytest.mark.parametrize(
    "causal,make_plan",
    [
        (True, lambda: eqxpar.Plan(mesh(data=2, context=4), mode="manual")),
        (
            False,
            lambda: eqxpar.Plan(
                mesh(data=2, context=2, tensor=2),
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
    model = Packed(causal, jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (4, 32), 0, 32)
    batch = (ids, segments(5, 4, 32, pad=6))
    loss, grads = eqxpar.train.make_value_and_grad(packed_loss, make_plan())(model, batch)
    ref_loss, ref_grads = _single_device(model, packed_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)
    # The ids matter: without them the loss differs.
    plain, _ = _single_device(model, packed_loss, (ids, jnp.zeros_like(ids)))
    assert abs(float(plain) - float(ref_loss)) > 1e-4


def test_bad_segment_ids_raise():
    (q, k, v), _ = _qkv(0, 16, 2, 2)
    with pytest.raises(eqxpar.SpecError, match=r"segment_ids of shape \(2, 8\).*expected.*\(2, 16\)"):
        nn.blockwise_attention(q, k, v, causal=True, segment_ids=jnp.zeros((2, 8), jnp.int32))
    attn = nn.Attention(16, 4, key=jax.random.key(0))
    x = jnp.ones((2, 16, 16))
    with pytest.raises(eqxpar.SpecError, match=r"shape \(2, 8\).*expected.*\(2, 16\)"):
        attn(x, segment_ids=jnp.zeros((2, 8), jnp.int32))
    # Under context parallelism the ids are still the whole sequence's.
    plan = eqxpar.Plan(mesh(data=2, context=4), mode="manual")

    def loss(m, batch):
        x, seg = batch
        return jnp.mean(m(nn.split_sequence(x), segment_ids=nn.split_sequence(seg)))

    batch = (jnp.ones((4, 16, 16)), jnp.zeros((4, 16), jnp.int32))
    with pytest.raises(eqxpar.SpecError, match=r"shape \(2, 4\).*expected.*\(2, 16\).*whole"):
        eqxpar.train.make_value_and_grad(loss, plan)(attn, batch)
