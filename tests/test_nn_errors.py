"""Misusing a tensor-parallel layer raises an eqxpar error naming the value and the fix."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn

from ._helpers import assert_trees_close


def manual_plan(tp=4, **options):
    return eqxpar.Plan(
        eqxpar.make_mesh(data=8 // tp, tensor=tp), rules=eqxpar.rules.MEGATRON, mode="manual", **options
    )


def test_heads_not_divisible_by_tensor_size():
    attn = nn.Attention(24, nn.AttentionConfig(6), key=jax.random.key(0))
    with pytest.raises(eqxpar.DivisibilityError, match=r"leaf \.wq: dimension 1 .* size 6.* 4 devices"):
        eqxpar.shard(attn, manual_plan())


def test_hidden_features_not_divisible_inside_manual_region():
    mlp = nn.MLP(8, 6, key=jax.random.key(0))
    plan = manual_plan()
    f = eqxpar.filter_shard_map(
        lambda m, x: m(x), plan, in_specs=(P(), P()), out_specs=P(), axis_names={"tensor"}
    )
    with (
        plan,
        pytest.raises(eqxpar.DivisibilityError, match=r"MLP.w_in \(d_hidden\) has 6 entries.*4 devices"),
    ):
        f(mlp, jnp.ones((2, 4, 8)))


def test_whole_weights_inside_a_manual_region():
    mlp = nn.MLP(8, 16, key=jax.random.key(0))
    plan = manual_plan()
    # in_specs replicate the weights instead of splitting them per the rules.
    f = eqxpar.filter_shard_map(
        lambda m, x: m(x), plan, in_specs=(P(), P()), out_specs=P(), axis_names={"tensor"}
    )
    with (
        plan,
        pytest.raises(eqxpar.PlanError, match=r"inside a shard_map over 'tensor' but its weight is whole"),
    ):
        f(mlp, jnp.ones((2, 4, 8)))


def test_bias_not_split_like_its_weight_inside_a_manual_region():
    # Rules that split MLP.w_in over tensor but leave b_in whole: the bias must be
    # split like the dimension it adds to (found by the plan fuzz, under a pipeline).
    mlp = nn.MLP(8, 16, key=jax.random.key(0))
    plan = manual_plan()
    specs = eqx.tree_at(
        lambda m: (m.w_in, m.w_out),
        jax.tree.map(lambda _: P(), mlp),
        (P(None, None, "tensor"), P("tensor", None)),
    )
    f = eqxpar.filter_shard_map(
        lambda m, x: m(x), plan, in_specs=(specs, P()), out_specs=P(), axis_names={"tensor"}
    )
    with (
        plan,
        pytest.raises(eqxpar.PlanError, match=r"MLP.b_in \(shape \(1, 16\)\): MLP.w_in is split.*MEGATRON"),
    ):
        f(mlp, jnp.ones((2, 4, 8)))


def test_weight_shards_outside_a_manual_region():
    mlp = nn.MLP(8, 16, key=jax.random.key(0))
    local = jax.tree.map(lambda w: w[..., :4] if w.shape[-1] == 16 else w, mlp)  # one device's w_in shard
    with (
        manual_plan(),
        pytest.raises(
            eqxpar.PlanError,
            match=r"one device's shard \(4 of 16 entries\) but mesh axis 'tensor' is not manual",
        ),
    ):
        local(jnp.ones((2, 4, 8)))


def test_sequence_split_activations_given_to_cross_entropy():
    plan = manual_plan(sequence_parallel=True)
    f = eqxpar.filter_shard_map(
        lambda z, y: nn.cross_entropy(z, y, vocab_split=True),
        plan,
        in_specs=(P(None, "tensor", None), P()),
        out_specs=P(),
        axis_names={"tensor"},
    )
    with (
        plan,
        pytest.raises(
            eqxpar.SpecError, match=r"logits of shape \(2, 2, 8\) do not match labels of shape \(2, 8\)"
        ),
    ):
        f(jnp.ones((2, 8, 8)), jnp.zeros((2, 8), jnp.int32))


def test_cross_entropy_refuses_whole_vocabulary_logits_read_as_a_shard():
    # vocab_split=True (once the default) on logits every tensor device holds whole
    # (rules that keep "vocab" whole) added log(tensor) to the loss (found by the
    # plan fuzz); without head= or vocab_split= a manual tensor axis now refuses.
    plan = manual_plan(tp=2)
    labels = jnp.zeros((4, 8), jnp.int32)

    def per_token(logits_spec, **kwargs):
        return eqxpar.filter_shard_map(
            lambda z, y: nn.cross_entropy(z, y, **kwargs),
            plan,
            in_specs=(logits_spec, P("data")),
            out_specs=P("data"),
            axis_names={"data", "tensor"},
        )

    logits = jax.random.normal(jax.random.key(0), (4, 8, 8))
    with plan, pytest.raises(eqxpar.SpecError, match=r"same on every device of the manual axis 'tensor'"):
        per_token(P("data"), vocab_split=True)(logits, labels)
    with (
        plan,
        pytest.raises(eqxpar.SpecError, match=r"'tensor' is manual here with 2 devices.*head=model.head"),
    ):
        per_token(P("data", None, "tensor"))(logits, labels)
    with plan:
        whole = per_token(P("data"), vocab_split=False)(logits, labels)
        split = per_token(P("data", None, "tensor"), vocab_split=True)(logits, labels)
    assert_trees_close(whole, split)


def test_overlap_needs_sequence_parallel():
    with pytest.raises(eqxpar.PlanError, match="tp_overlap=True\\) needs sequence_parallel=True"):
        manual_plan(tp_overlap=True)


@pytest.mark.parametrize(
    "fields, error, match",
    [
        (dict(num_heads=0), eqxpar.PlanError, r"AttentionConfig\(num_heads=0\): expected a positive integer"),
        (
            dict(num_heads=4, num_kv_heads=3),
            eqxpar.DivisibilityError,
            r"\(num_heads=4, num_kv_heads=3\): .*must divide num_heads\. Use one of \[1, 2, 4\]",
        ),
        (
            dict(num_heads=4, num_kv_heads=2, fused_qkv=True),
            eqxpar.PlanError,
            r"\(fused_qkv=True, num_kv_heads=2\): .*Use fused_qkv=False for grouped-query",
        ),
        (
            dict(num_heads=4, head_dim=5, rotary=True),
            eqxpar.DivisibilityError,
            r"head_dim=5\): .*must be even",
        ),
        (dict(num_heads=4, rotary_base=0.0), eqxpar.PlanError, r"rotary_base=0\.0\): expected a positive"),
        (
            dict(num_heads=4, kernel="flash"),
            eqxpar.PlanError,
            r"kernel='flash'\): expected 'auto', 'blockwise'",
        ),
        (dict(num_heads=4, block_size=0), eqxpar.PlanError, r"block_size=0\): expected a positive integer"),
        (dict(num_heads=4, dropout=-0.1), eqxpar.PlanError, r"dropout=-0\.1\): expected a rate in \[0, 1\)"),
    ],
)
def test_attention_config_names_the_bad_field(fields, error, match):
    with pytest.raises(error, match=match):
        nn.AttentionConfig(**fields)


def test_attention_derived_head_dim_must_be_even_for_rotary():
    # head_dim = 12 / 4 = 3: only the layer knows d_model, so it checks there.
    with pytest.raises(eqxpar.DivisibilityError, match=r"head_dim = d_model / num_heads = 12 / 4 is odd"):
        nn.Attention(12, nn.AttentionConfig(4, rotary=True), key=jax.random.key(0))
