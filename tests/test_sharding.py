"""shard / shard_batch / annotate, in and out of jit, and filter_shard_map."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.rules import Logical

from ._helpers import LogicalMLP, assert_trees_close


def test_shard_places_arrays_and_keeps_non_array_leaves():
    mesh = eqxpar.make_mesh(fsdp=4, tensor=2)
    plan = eqxpar.Plan(mesh, rules=Logical({"mlp": "tensor", "embed": "fsdp"}))
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))
    placed = eqxpar.shard(model, plan)
    assert placed.activation is model.activation
    assert placed.w1.sharding.spec == P("fsdp", "tensor")
    assert placed.w1.addressable_shards[0].data.shape == (2, 8)
    np.testing.assert_array_equal(placed.w1, model.w1)


def test_shard_inside_jit_constrains():
    mesh = eqxpar.make_mesh(fsdp=4, tensor=2)
    plan = eqxpar.Plan(mesh, rules=Logical({"mlp": "tensor", "embed": "fsdp"}))
    model = LogicalMLP(8, 16, 8, key=jax.random.key(0))

    @eqx.filter_jit
    def double(model):
        return eqxpar.shard(jax.tree.map(lambda x: 2 * x if eqx.is_array(x) else x, model), plan)

    out = double(model)
    assert out.w1.sharding.spec == P("fsdp", "tensor")
    assert out.activation is model.activation


def test_shard_batch_splits_leading_dimension():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=2, tensor=2))
    x, y = eqxpar.shard_batch((jnp.ones((8, 3)), jnp.ones((8,))), plan)
    assert x.sharding.spec == P(("data", "fsdp"))
    assert x.addressable_shards[0].data.shape == (2, 3)
    assert y.sharding.spec == P(("data", "fsdp"))


def test_annotate_is_a_no_op_without_a_plan():
    x = jnp.ones((8, 4))
    assert eqxpar.annotate(x, "activations") is x
    assert jax.jit(lambda x: eqxpar.annotate(x, "activations"))(x).shape == (8, 4)


def test_annotate_resolves_through_the_plan():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    plan = eqxpar.Plan(mesh, annotations={"hidden": P("data", "tensor")})

    def f(x):
        return eqxpar.annotate(jnp.sin(x), "hidden") * 2

    with plan:
        out = jax.jit(f)(jnp.ones((8, 8)))
        lowered = jax.jit(f).lower(jnp.ones((8, 8))).as_text()
    assert "sharding_constraint" in lowered or "mhlo.sharding" in lowered
    assert out.sharding.spec == P("data", "tensor")
    # An unknown annotation name is a no-op, so models can annotate freely.
    with plan:
        y = jnp.ones(4)
        assert eqxpar.annotate(y, "not-registered") is y


def test_annotate_inside_shard_map_drops_manual_axes():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    plan = eqxpar.Plan(mesh, annotations={"hidden": P("data", "tensor")})

    def local(x):
        return eqxpar.annotate(x * 2, "hidden")

    with plan:
        f = eqxpar.filter_shard_map(
            local, plan, in_specs=(P("data"),), out_specs=P("data"), axis_names=("data",)
        )
        out = jax.jit(f)(jnp.ones((8, 8)))
    np.testing.assert_array_equal(out, 2 * jnp.ones((8, 8)))


def test_filter_shard_map_takes_and_returns_modules():
    mesh = eqxpar.make_mesh(data=8)
    plan = eqxpar.Plan(mesh)
    model = LogicalMLP(4, 8, 4, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 4))

    def local(model, x):
        loss = jnp.mean(jax.vmap(model)(x) ** 2)
        grads = eqx.filter_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
        # check_vma: the gradient of the replicated model is already summed over
        # the batch axes; divide for the mean of per-device means.
        grads = jax.tree.map(lambda g: g / 8, grads)
        return jax.lax.pmean(loss, plan.batch_axes), grads, model

    specs = eqxpar.partition_specs(model, plan)
    loss, grads, same = eqxpar.filter_shard_map(
        local, plan, in_specs=(None, plan.batch_spec), out_specs=(P(), specs, specs)
    )(model, x)
    assert same.activation is model.activation  # the non-array leaf came back
    np.testing.assert_array_equal(same.w1, model.w1)
    ref_loss, ref_grads = eqx.filter_value_and_grad(lambda m: jnp.mean(jax.vmap(m)(x) ** 2))(model)
    assert_trees_close((loss, grads), (ref_loss, ref_grads))


def test_filter_shard_map_specs_from_rules_split_weights():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    plan = eqxpar.Plan(mesh, rules=Logical({"mlp": "tensor"}))
    model = LogicalMLP(4, 8, 4, key=jax.random.key(0))
    shapes = eqxpar.filter_shard_map(
        lambda m: (jnp.array(m.w1.shape), jnp.array(m.b1.shape)), plan, out_specs=P()
    )
    # The function sees each device's shard of the weights.
    w1, b1 = shapes(model)
    assert tuple(np.asarray(w1)) == (4, 2)
    assert tuple(np.asarray(b1)) == (2,)


def _buffers(x):
    return {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}


def _leaves(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def test_shard_gives_new_buffers_a_donating_step_cannot_delete():
    # Every kind of leaf: one-device arrays placed replicated (where JAX's
    # device_put reuses the buffer as device 0's copy) and split, and arrays
    # already on their target sharding (replicated and split).
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    single = {"replicated": jnp.arange(16.0).reshape(8, 2), "split": jnp.arange(16.0).reshape(8, 2) + 1}
    specs = {"replicated": P(), "split": P("data")}
    placed = eqxpar.shard(single, plan, specs)
    originals = {**single, "placed_replicated": placed["replicated"], "placed_split": placed["split"]}
    specs = {**specs, "placed_replicated": P(), "placed_split": P("data")}
    saved = jax.tree.map(np.array, originals)
    given = eqxpar.shard(originals, plan, specs)
    for key, spec in specs.items():
        assert given[key].sharding.is_equivalent_to(plan.sharding(spec), 2), key
    for key in specs:
        assert not _buffers(originals[key]) & _buffers(given[key]), (
            f"{key}: shard returned the caller's buffer"
        )
    eqx.filter_jit(lambda t: jax.tree.map(lambda x: 2 * x, t), donate="all")(given)
    for key, x in originals.items():
        assert not x.is_deleted(), key
        np.testing.assert_array_equal(np.asarray(x), saved[key], err_msg=key)
    # `copy=False` may hand an already placed array back as it is (batches).
    assert eqxpar.shard(placed["split"], plan, P("data"), copy=False) is placed["split"]


def test_shard_of_a_plain_model_survives_a_donating_step():
    model = eqx.nn.MLP(4, 4, 8, 1, key=jax.random.key(1))
    weight = np.array(model.layers[0].weight)
    placed = eqxpar.shard(model, eqxpar.Plan(eqxpar.make_mesh(data=8)))
    assert not any(_buffers(a) & _buffers(b) for a, b in zip(_leaves(model), _leaves(placed), strict=True))
    eqx.filter_jit(lambda m: jax.tree.map(lambda x: x + 1, eqx.filter(m, eqx.is_array)), donate="all")(placed)
    assert not any(x.is_deleted() for x in _leaves(model))
    np.testing.assert_array_equal(np.asarray(model.layers[0].weight), weight)
    # eqxpar.train.init builds its state inside jit: fresh buffers from an already
    # placed model too, which its steps then donate.
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    placed = eqxpar.shard(model, plan)
    state = eqxpar.train.init(placed, optax.sgd(0.1), plan, key=jax.random.key(0))
    assert not any(
        _buffers(a) & _buffers(b) for a, b in zip(_leaves(placed), _leaves(state.model), strict=True)
    )
