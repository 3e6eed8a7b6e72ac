"""Blockwise (online-softmax) attention: equals dense attention, forward and
gradients (causal or not, grouped-query, given masks, key lengths that do and do
not divide the block), inside `nn.Attention` on one device and in every tensor
mode with the same collectives as dense; and its temp memory, forward + backward
of one attention layer at seq 1k / 4k / 16k, grows linearly and at 16k is under
1/8 of the dense layer's (compiled only: `memory_analysis` needs no run).

`python -m tests.test_attention_memory` prints the temp-bytes table."""

import dataclasses
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn
from eqxpar.nn._attention import dense_attention

from ._helpers import assert_trees_close, assert_trees_close_to_scale, random_qkv


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("seq", "heads", "kv_heads", "block"),
    [(64, 4, 4, 16), (70, 4, 2, 16), (37, 6, 2, 8), (20, 2, 1, 64)],
    ids=["divides", "gqa-pads", "gqa3-pads", "one-block"],
)
def test_blockwise_equals_dense(causal, seq, heads, kv_heads, block):
    (q, k, v), ct = random_qkv(0, seq, heads, kv_heads)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), (0, 1, 2)))

    def blockwise(q, k, v):
        return nn.blockwise_attention(q, k, v, causal=causal, block_size=block)

    def dense(q, k, v):
        return dense_attention(q, k, v, causal=causal, mask=None)

    assert_trees_close(jax.jit(blockwise)(q, k, v), jax.jit(dense)(q, k, v))
    assert_trees_close(loss(blockwise)(q, k, v), loss(dense)(q, k, v))


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_mask_and_fully_masked_rows(causal):
    """A given mask; row 3 fully masked averages every key, as the dense softmax does."""
    (q, k, v), ct = random_qkv(1, 45, 4, 2)
    mask = jax.random.bernoulli(jax.random.key(5), 0.6, (45, 45)).at[3].set(False)

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v) * ct), (0, 1, 2)))

    def blockwise(q, k, v):
        return nn.blockwise_attention(q, k, v, causal=causal, mask=mask, block_size=16)

    def dense(q, k, v):
        return dense_attention(q, k, v, causal=causal, mask=mask)

    assert_trees_close(loss(blockwise)(q, k, v), loss(dense)(q, k, v))


def test_blockwise_bfloat16_accumulates_in_float32():
    (q, k, v), _ = random_qkv(2, 48, 4, 4)
    out = nn.blockwise_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), causal=True, block_size=16)
    assert out.dtype == jnp.bfloat16
    ref = dense_attention(q, k, v, causal=True, mask=None)
    np.testing.assert_allclose(out.astype(jnp.float32), ref, atol=5e-2)


def test_blockwise_errors():
    (q, k, v), _ = random_qkv(0, 16, 4, 4)
    with pytest.raises(ValueError, match="query heads"):
        nn.blockwise_attention(q, k[:, :, :3], v[:, :, :3], causal=True)
    with pytest.raises(ValueError, match="block_size"):
        nn.blockwise_attention(q, k, v, causal=True, block_size=0)
    with pytest.raises(
        eqxpar.PlanError, match=r"AttentionConfig\(kernel='flash'\): expected 'auto', 'blockwise'"
    ):
        nn.AttentionConfig(4, kernel="flash")


def _layers(**kw):
    def make(mode):
        config = nn.AttentionConfig(4, num_kv_heads=2, kernel=mode, block_size=8, **kw)
        return nn.Attention(32, config, key=jax.random.key(3))

    return make("dense"), make("blockwise"), make("auto")


@pytest.mark.parametrize("rotary", [False, True])
def test_attention_layer_blockwise_equals_dense(rotary):
    dense, blockwise, auto = _layers(rotary=rotary)
    x = jax.random.normal(jax.random.key(4), (2, 20, 32))  # 20 tokens: 3 blocks of 8, padded

    def value_and_grad(m):
        return eqx.filter_jit(eqx.filter_value_and_grad(lambda m, x: jnp.mean(m(x) ** 2)))(m, x)

    # Weight gradients sum over every token and head: their float32 error follows the
    # leaf's scale, not each element's (as in the tensor-parallel tests); the key bias
    # gets zero up to rounding (softmax ignores it), hence a mean loss (atol floor).
    ref = value_and_grad(dense)
    assert_trees_close_to_scale(value_and_grad(blockwise), ref)
    assert_trees_close_to_scale(value_and_grad(auto), ref)  # longer than a block: auto is blockwise on CPU
    text = eqx.filter_jit(lambda m, x: m(x)).lower(auto, x).as_text()
    assert "while" in text  # the key-block scan


def test_auto_keeps_dense_for_one_block():
    dense, _, auto = _layers()
    x = jax.random.normal(jax.random.key(4), (2, 8, 32))

    def lower(m):
        return eqx.filter_jit(lambda m, x: m(x)).lower(m, x).as_text()

    assert lower(auto) == lower(dense)


def test_gpt_and_transformer_block_pass_the_attention_choice_on():
    # A GPT whose sequence spans several blocks: the blockwise model equals the dense
    # one (same weights: the choice is a static field), and every layer got it.
    config = eqxpar.models.GPTConfig(
        vocab_size=32, d_model=32, num_heads=4, num_layers=2, d_hidden=64, max_seq_len=24, attention_block=8
    )
    blockwise = eqxpar.models.GPT(config, key=jax.random.key(0))
    dense = eqxpar.models.GPT(dataclasses.replace(config, attention="dense"), key=jax.random.key(0))
    assert (
        blockwise.blocks.blocks.attn.attention == "auto" and blockwise.blocks.blocks.attn.attention_block == 8
    )
    assert dense.blocks.blocks.attn.attention == "dense"
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, 32)

    def value_and_grad(m):
        return eqx.filter_jit(eqx.filter_value_and_grad(eqxpar.models.lm_loss))(m, tokens)

    (loss, grads), (ref_loss, ref_grads) = value_and_grad(blockwise), value_and_grad(dense)
    assert_trees_close(loss, ref_loss)
    assert_trees_close_to_scale(grads, ref_grads)
    block = nn.TransformerBlock(
        32, 64, nn.BlockConfig(nn.AttentionConfig(4, kernel="blockwise", block_size=4)), key=jax.random.key(2)
    )
    assert (block.attn.attention, block.attn.attention_block) == ("blockwise", 4)
    with pytest.raises(eqxpar.PlanError, match="attention='flash'"):
        dataclasses.replace(config, attention="flash")
    with pytest.raises(eqxpar.PlanError, match="attention_block"):
        dataclasses.replace(config, attention_block=0)


@pytest.mark.parametrize("mode", ["auto", "sync", "sp"])
def test_blockwise_under_tensor_parallel_same_collectives(mode):
    """Sharded over tensor=2 (heads) x data=4: blockwise equals the one-device dense
    layer, and issues exactly the collectives the dense layer does."""
    dense, blockwise, _ = _layers(rotary=True)
    x = jax.random.normal(jax.random.key(6), (4, 24, 32))
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2),
        rules=eqxpar.rules.MEGATRON,
        mode="auto" if mode == "auto" else "manual",
        sequence_parallel=mode == "sp",
    )
    ref = jax.jit(lambda m, x: m(x))(dense, x)

    def compiled(model):
        placed = eqxpar.shard(model, plan)

        def apply(m, x):
            return m(x)

        seq = P(None, "tensor") if mode == "sp" else P()  # sequence blocks in and out
        if plan.mode == "manual":
            apply = eqxpar.filter_shard_map(
                apply,
                plan,
                in_specs=(eqxpar.partition_specs(model, plan), seq),
                out_specs=seq,
                axis_names={"tensor"},
            )
        fn = eqx.filter_jit(lambda m, x: eqx.filter_grad(lambda m: jnp.mean(apply(m, x) ** 2))(m))
        with plan:
            return eqx.filter_jit(apply)(placed, x), fn.lower(placed, x).compile()

    out_b, comp_b = compiled(blockwise)
    _, comp_d = compiled(dense)
    assert_trees_close_to_scale(out_b, ref)
    stats_b, stats_d = (eqxpar.inspect.collective_stats(c).as_dict() for c in (comp_b, comp_d))
    assert stats_b == stats_d


def attention_temp_bytes(mode: str, seq: int) -> tuple[int, float]:
    """Temp bytes of one `nn.Attention(512, AttentionConfig(8))` layer's forward + backward (batch 1,
    8 heads, head dim 64) at `seq`, compiled only; and the compile time."""
    attn = nn.Attention(512, nn.AttentionConfig(8, kernel=mode, use_bias=False), key=jax.random.key(0))
    x = jax.ShapeDtypeStruct((1, seq, 512), jnp.float32)
    start = time.perf_counter()
    grad = jax.jit(lambda a, x: jax.grad(lambda a: jnp.sum(a(x)))(a))
    compiled = grad.lower(attn, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - start


def test_temp_memory_linear_in_sequence():
    blockwise = {s: attention_temp_bytes("blockwise", s)[0] for s in (1024, 4096, 16384)}
    assert blockwise[16384] / blockwise[4096] < 5  # linear: 4x the tokens, ~4x the bytes
    assert blockwise[4096] / blockwise[1024] < 5
    dense_16k, seconds = attention_temp_bytes("dense", 16384)
    assert blockwise[16384] < dense_16k / 8
    assert seconds < 30


if __name__ == "__main__":
    print("| seq | blockwise temp MiB | dense temp MiB | dense / blockwise |")
    print("|---:|---:|---:|---:|")
    for s in (1024, 4096, 16384):
        b, d = attention_temp_bytes("blockwise", s)[0], attention_temp_bytes("dense", s)[0]
        print(f"| {s} | {b / 2**20:.1f} | {d / 2**20:.1f} | {d / b:.1f} |")
