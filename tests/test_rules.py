"""Rules resolve to the expected PartitionSpecs on real Equinox models and on the
optax states built from them."""

import equinox as eqx
import jax
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P
from jax.tree_util import keystr

import eqxpar
from eqxpar.rules import FSDP, ByPath, Logical, Policy

from ._helpers import LogicalMLP, TinyTransformer


def specs_by_path(tree, rules_or_plan):
    specs = eqxpar.partition_specs(tree, rules_or_plan)
    flat = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda s: isinstance(s, P))[0]
    return {keystr(path): spec for path, spec in flat}


@pytest.fixture
def mesh():
    return eqxpar.make_mesh(data=2, fsdp=2, tensor=2)


def test_logical_rule_on_param_metadata(mesh):
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    plan = eqxpar.Plan(mesh, rules=Logical({"mlp": "tensor", "embed": "fsdp"}))
    specs = specs_by_path(model, plan)
    assert specs == {".w1": P("fsdp", "tensor"), ".b1": P("tensor"), ".w2": P("tensor", "fsdp")}


def test_logical_rule_drops_a_mesh_axis_used_twice(mesh):
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    plan = eqxpar.Plan(mesh, rules=Logical({"mlp": "tensor", "embed": "tensor"}))
    assert specs_by_path(model, plan)[".w1"] == P("tensor", None)


def test_optimizer_state_mirrors_parameters(mesh):
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    plan = eqxpar.Plan(mesh, rules=Logical({"mlp": "tensor", "embed": "fsdp"}))
    opt_state = optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array))
    specs = specs_by_path(opt_state, plan)
    assert specs["[0].count"] == P()
    for moment in ("mu", "nu"):
        assert specs[f"[0].{moment}.w1"] == P("fsdp", "tensor")
        assert specs[f"[0].{moment}.b1"] == P("tensor")


def test_fsdp_rule_on_plain_mlp_and_its_optax_state(mesh):
    model = eqx.nn.MLP(16, 4, 64, 2, key=jax.random.key(0))
    plan = eqxpar.Plan(mesh, rules=FSDP(axis="fsdp", min_size=256))
    specs = specs_by_path(model, plan)
    assert specs[".layers[0].weight"] == P("fsdp", None)  # (64, 16): largest dim 64
    assert specs[".layers[1].weight"] == P("fsdp", None)  # (64, 64): tie -> first
    assert specs[".layers[0].bias"] == P()  # 64 elements < min_size
    assert specs[".layers[2].weight"] == P(None, "fsdp")  # (4, 64)
    opt_specs = specs_by_path(optax.adam(1e-3).init(eqx.filter(model, eqx.is_array)), plan)
    for path, spec in specs.items():
        assert opt_specs[f"[0].mu{path}"] == spec
        assert opt_specs[f"[0].nu{path}"] == spec


def test_fsdp_rule_splits_the_first_divisible_dimension_when_asked():
    # (16, 2, 64): the largest divisible dimension is the last; dim="leading"
    # takes the first that divides, skipping the 2 (not divisible by fsdp=4).
    mesh = eqxpar.make_mesh(fsdp=4, data=2)
    leaf = jax.ShapeDtypeStruct((16, 2, 64), jax.numpy.float32)
    odd = jax.ShapeDtypeStruct((6, 2, 64), jax.numpy.float32)
    assert eqxpar.partition_specs(leaf, eqxpar.Plan(mesh, rules=FSDP(min_size=1))) == P(None, None, "fsdp")
    leading = eqxpar.Plan(mesh, rules=FSDP(min_size=1, dim="leading"))
    assert eqxpar.partition_specs(leaf, leading) == P("fsdp", None, None)
    assert eqxpar.partition_specs(odd, leading) == P(None, None, "fsdp")
    with pytest.raises(eqxpar.PlanError, match=r"dim='first'.*'largest', 'leading'"):
        FSDP(dim="first")


def test_fsdp_rule_skips_indivisible_dimensions():
    mesh = eqxpar.make_mesh(fsdp=8)
    model = eqx.nn.Linear(12, 20, key=jax.random.key(0))  # weight (20, 12): neither divisible by 8
    plan = eqxpar.Plan(mesh, rules=FSDP(min_size=1))
    assert specs_by_path(model, plan)[".weight"] == P()


def test_rules_on_a_small_eqx_nn_transformer(mesh):
    model = TinyTransformer(key=jax.random.key(0))
    rules = [
        ByPath(
            [
                (r"attn\[\d+\]\.(query|key|value)_proj\.weight$", P("tensor", None)),
                (r"attn\[\d+\]\.output_proj\.weight$", P(None, "tensor")),
            ],
            strict=False,
        ),
        FSDP(axis="fsdp", min_size=512),
    ]
    plan = eqxpar.Plan(mesh, rules=rules)
    specs = specs_by_path(model, plan)
    assert specs[".attn[0].query_proj.weight"] == P("tensor", None)
    assert specs[".attn[1].output_proj.weight"] == P(None, "tensor")
    assert specs[".embed.weight"] == P("fsdp", None)  # (32, 32) tie -> first
    assert specs[".norms[0].weight"] == P()
    assert specs[".mlps[0].layers[0].weight"] == P("fsdp", None)  # (128, 32)
    opt_specs = specs_by_path(optax.adamw(1e-3).init(eqx.filter(model, eqx.is_array)), plan)
    assert opt_specs["[0].mu.attn[0].query_proj.weight"] == P("tensor", None)
    assert opt_specs["[0].nu.mlps[0].layers[0].weight"] == P("fsdp", None)


def test_first_match_wins_and_unclaimed_is_replicated(mesh):
    model = eqx.nn.MLP(16, 4, 64, 1, key=jax.random.key(0))
    only_first = Policy(lambda leaf: P("tensor") if leaf.path == ".layers[0].weight" else None)
    everything = ByPath([(r"weight$", P(None, "fsdp"))], strict=False)
    specs = specs_by_path(model, eqxpar.Plan(mesh, rules=[only_first, everything]))
    assert specs[".layers[0].weight"] == P("tensor")
    assert specs[".layers[1].weight"] == P(None, "fsdp")
    assert specs[".layers[0].bias"] == P()


def test_policy_sees_logical_axes_and_mesh(mesh):
    seen = []
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    eqxpar.partition_specs(model, eqxpar.Plan(mesh, rules=Policy(lambda leaf: seen.append(leaf))))
    assert {leaf.path: leaf.axes for leaf in seen} == {
        ".w1": ("embed", "mlp"),
        ".b1": ("mlp",),
        ".w2": ("mlp", "embed"),
    }
    assert all(leaf.mesh is mesh for leaf in seen)


def test_non_array_leaves_get_none(mesh):
    model = eqx.nn.MLP(4, 4, 8, 1, activation=jax.nn.relu, key=jax.random.key(0))
    specs = eqxpar.partition_specs(model, eqxpar.Plan(mesh))
    assert specs.activation is None
    assert specs.layers[0].weight == P()


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24]), min_size=1, max_size=3),
    st.sampled_from([1, 2, 4, 8]),
)
def test_fsdp_specs_always_divide(shape, n):
    mesh = eqxpar.make_mesh(fsdp=n, data=-1)
    leaf = jax.ShapeDtypeStruct(tuple(shape), jax.numpy.float32)
    spec = eqxpar.partition_specs(leaf, eqxpar.Plan(mesh, rules=FSDP(min_size=1)))
    for dim, entry in zip(shape, spec, strict=False):
        if entry is not None:
            assert dim % n == 0
    if any(d % n == 0 for d in shape):
        assert "fsdp" in tuple(spec)
