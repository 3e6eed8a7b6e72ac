"""Tensor-parallel layers equal their dense single-device computation in every
mode (automatic; manual sync; manual sync + sequence parallel; manual ring overlap
+ sequence parallel), forward and gradients, for tensor sizes 1, 2, 4, 8."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn

from ._helpers import assert_trees_close, assert_trees_close_to_scale

VOCAB, D, HEADS, HIDDEN, BATCH, SEQ = 64, 32, 8, 64, 8, 16
MODES = ["auto", "sync", "sp", "overlap"]


class Zoo(eqx.Module):
    """Every eqxpar.nn layer in one model, so one compilation covers them all."""

    embed: nn.Embedding
    norm: nn.LayerNorm
    up: nn.ColumnLinear
    down: nn.RowLinear
    rms: nn.RMSNorm
    mlp_gelu: nn.MLP
    mlp_swiglu: nn.MLP
    attn: nn.Attention
    attn_fused: nn.Attention
    attn_gqa: nn.Attention
    block: nn.TransformerBlock
    head: nn.Unembed

    def __init__(self, key):
        k = iter(jax.random.split(key, 12))
        self.embed = nn.Embedding(VOCAB, D, key=next(k))
        self.norm = nn.LayerNorm(D)
        self.up = nn.ColumnLinear(D, HIDDEN, key=next(k))
        self.down = nn.RowLinear(HIDDEN, D, key=next(k))
        self.rms = nn.RMSNorm(D)
        self.mlp_gelu = nn.MLP(D, HIDDEN, key=next(k))
        self.mlp_swiglu = nn.MLP(D, HIDDEN, activation="swiglu", use_bias=False, key=next(k))
        self.attn = nn.Attention(D, nn.AttentionConfig(HEADS), key=next(k))
        fused = nn.AttentionConfig(HEADS, fused_qkv=True, use_bias=False)
        self.attn_fused = nn.Attention(D, fused, key=next(k))
        gqa = nn.AttentionConfig(2 * HEADS, num_kv_heads=HEADS, head_dim=4)
        self.attn_gqa = nn.Attention(D, gqa, key=next(k))
        self.block = nn.TransformerBlock(
            D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS), activation="swiglu", norm="rms"), key=next(k)
        )
        self.head = nn.Unembed(D, VOCAB, key=next(k))
        # Non-zero biases, so their gradients and sharding are exercised too.
        self.down = eqx.tree_at(lambda m: m.bias, self.down, 0.1 * jnp.ones(D))
        self.up = eqx.tree_at(lambda m: m.bias, self.up, 0.1 * jnp.ones(HIDDEN))

    def __call__(self, ids, labels):
        h = self.embed(ids)
        h = h + self.down(jax.nn.gelu(self.up(self.norm(h))))
        h = h + self.mlp_gelu(self.rms(h))
        h = h + self.mlp_swiglu(h)
        h = h + self.attn(h) + self.attn_fused(h) + self.attn_gqa(h)
        h = self.block(h)
        return nn.cross_entropy(self.head(h), labels, head=self.head)


def make_plan(mode: str, tp: int) -> eqxpar.Plan:
    return eqxpar.Plan(
        eqxpar.make_mesh(data=8 // tp, tensor=tp),
        rules=eqxpar.rules.MEGATRON,
        mode="auto" if mode == "auto" else "manual",
        sequence_parallel=mode in ("sp", "overlap"),
        tp_overlap=mode == "overlap",
    )


def parallel_apply(model, plan: eqxpar.Plan):
    """`(model, ids, labels) -> per-token loss` under `plan`: jit for auto, a
    partial-manual shard_map over `tensor` (data stays automatic) for manual."""
    if plan.mode == "auto":
        return lambda m, ids, labels: m(ids, labels)
    specs = eqxpar.partition_specs(model, plan)
    return eqxpar.filter_shard_map(
        lambda m, ids, labels: m(ids, labels),
        plan,
        in_specs=(specs, P(), P()),
        out_specs=P(),
        axis_names={"tensor"},
    )


def tokens(seed):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.randint(k1, (BATCH, SEQ), 0, VOCAB), jax.random.randint(k2, (BATCH, SEQ), 0, VOCAB)


@pytest.fixture(scope="module")
def reference():
    model = Zoo(jax.random.key(0))
    ids, labels = tokens(1)
    per_token = jax.jit(lambda m, i, y: m(i, y))(model, ids, labels)
    grads = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.mean(m(ids, labels))))(model)
    return model, ids, labels, per_token, grads


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", MODES)
def test_every_layer_matches_dense(reference, mode, tp):
    model, ids, labels, ref_per_token, ref_grads = reference
    plan = make_plan(mode, tp)
    apply = parallel_apply(model, plan)
    placed = eqxpar.shard(model, plan)
    ids_s, labels_s = eqxpar.shard_batch((ids, labels), plan)

    @eqx.filter_jit
    def forward_and_grad(m, i, y):
        per_token = apply(m, i, y)
        grads = eqx.filter_grad(lambda m: jnp.mean(apply(m, i, y)))(m)
        return per_token, grads

    with plan:
        per_token, grads = forward_and_grad(placed, ids_s, labels_s)
    assert_trees_close(per_token, ref_per_token)
    assert_trees_close_to_scale(grads, ref_grads)
