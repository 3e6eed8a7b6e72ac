"""eqxpar.nn.MoE: dropless routing equals a dense reference that runs every expert
on every token (forward and gradients); adversarial routing drops nothing while
capacity mode drops the expected share; the auxiliary losses match their
formulas; the router bias steers selection only; automatic (and manual tensor)
plans match one device; bad arguments raise eqxpar errors."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import nn

from ._helpers import (
    assert_trees_close,
    assert_trees_close_to_scale,
    moe_regression_loss,
    sequence_regression_batches,
    train_checked,
)

D, H, E, BATCH, SEQ = 16, 32, 4, 2, 8
T = BATCH * SEQ


def make_x(seed=1, batch=BATCH, seq=SEQ):
    return jax.random.normal(jax.random.key(seed), (batch, seq, D))


def with_biases(moe, seed=5):
    """Non-zero expert biases, so their gradients are exercised."""
    names = [n for n in ("b_in", "b_gate", "b_out") if getattr(moe, n) is not None]
    keys = jax.random.split(jax.random.key(seed), len(names))
    for name, k in zip(names, keys, strict=True):
        old = getattr(moe, name)
        moe = eqx.tree_at(lambda m, n=name: getattr(m, n), moe, 0.1 * jax.random.normal(k, old.shape))
    return moe


def dense_reference(moe, x):
    """Every expert on every token, combined with the top-k weights; routing
    written out independently of the layer."""
    xf = x.reshape(-1, D)
    logits = xf @ moe.router
    scores = jax.nn.softmax(logits, -1) if moe.score == "softmax" else jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(jax.lax.stop_gradient(scores + moe.router_bias[None, :]), moe.top_k)
    w = jnp.take_along_axis(scores, idx, -1)
    if moe.normalize_top_k:
        w = w / jnp.sum(w, -1, keepdims=True)
    w = w * moe.route_scale
    h = jnp.einsum("td,edh->teh", xf, moe.w_in)
    if moe.b_in is not None:
        h = h + moe.b_in[None]
    if moe.w_gate is None:
        a = jax.nn.gelu(h)
    else:
        g = jnp.einsum("td,edh->teh", xf, moe.w_gate)
        if moe.b_gate is not None:
            g = g + moe.b_gate[None]
        a = jax.nn.silu(g) * h
    y_all = jnp.einsum("teh,ehd->ted", a, moe.w_out)
    if moe.b_out is not None:
        y_all = y_all + moe.b_out[None]
    chosen = jnp.take_along_axis(y_all, idx[:, :, None], axis=1)  # (T, k, D)
    y = jnp.sum(chosen * w[:, :, None], axis=1).reshape(x.shape)
    if moe.shared is not None:
        y = y + moe.shared(x)
    return y


# Each: the routing (an nn.MoEConfig) and the layer's own options.
CONFIGS = {
    "top1_softmax_gelu": (
        nn.MoEConfig(E, top_k=1, score="softmax", normalize_top_k=False),
        dict(activation="gelu"),
    ),
    "top2_softmax_swiglu_shared_bias": (
        nn.MoEConfig(E, top_k=2, score="softmax", num_shared=1),
        dict(activation="swiglu", use_bias=True),
    ),
    "top2_sigmoid_norm_scaled": (
        nn.MoEConfig(E, top_k=2, score="sigmoid", route_scale=2.5),
        dict(activation="swiglu"),
    ),
    "top2_sigmoid_raw_gelu_shared2": (
        nn.MoEConfig(E, top_k=2, score="sigmoid", normalize_top_k=False, num_shared=2, shared_hidden=8),
        dict(activation="gelu"),
    ),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_dropless_matches_dense_reference(name):
    config, layer = CONFIGS[name]
    moe = with_biases(nn.MoE(D, H, config, **layer, key=jax.random.key(0)))
    x = make_x()
    cot = jax.random.normal(jax.random.key(2), x.shape)

    @eqx.filter_jit
    def run(m, x, layer):
        def f(m, x):
            y = m(x)[0] if layer else dense_reference(m, x)
            return jnp.sum(y * cot), y

        (_, y), grads = eqx.filter_value_and_grad(lambda mx: f(*mx), has_aux=True)((m, x))
        return y, grads

    y, grads = run(moe, x, True)
    y_ref, grads_ref = run(moe, x, False)
    assert_trees_close(y, y_ref)
    assert_trees_close_to_scale(grads, grads_ref)
    assert float(jnp.max(jnp.abs(grads[0].router_bias))) == 0.0
    _, aux = moe(x)
    assert float(aux.dropped_fraction) == 0.0
    assert float(jnp.sum(aux.expert_load)) == T * moe.top_k


def _forced(top_k, capacity_factor=None):
    """Every token's first choice is expert 0 (its second expert 1): a zero router
    (uniform scores) and a bias that only steers selection."""
    moe = nn.MoE(
        D,
        H,
        nn.MoEConfig(E, top_k=top_k, capacity_factor=capacity_factor),
        use_bias=True,
        key=jax.random.key(3),
    )
    moe = with_biases(moe)
    moe = eqx.tree_at(lambda m: m.router, moe, jnp.zeros((D, E)))
    return eqx.tree_at(lambda m: m.router_bias, moe, jnp.array([1.0, 0.5, 0.0, 0.0]))


@pytest.mark.parametrize("top_k", [1, 2])
def test_adversarial_routing_dropless_and_capacity(top_k):
    x = make_x()
    moe = _forced(top_k)
    y, aux = eqx.filter_jit(lambda m, x: m(x))(moe, x)
    assert_trees_close(y, dense_reference(moe, x))
    assert float(aux.dropped_fraction) == 0.0
    want_load = np.zeros(E)
    want_load[:top_k] = T
    np.testing.assert_array_equal(aux.expert_load, want_load)

    # capacity 1.0: each expert keeps ceil(T * k / E) assignments, by token order
    # (every chosen expert here sees one choice rank only).
    capped = _forced(top_k, 1.0)
    cap = math.ceil(T * top_k / E)
    y_cap, aux_cap = eqx.filter_jit(lambda m, x: m(x))(capped, x)
    np.testing.assert_allclose(float(aux_cap.dropped_fraction), (T * top_k - top_k * cap) / (T * top_k))
    yf, yf_cap = np.asarray(y).reshape(T, D), np.asarray(y_cap).reshape(T, D)
    assert_trees_close(yf_cap[:cap], yf[:cap])
    np.testing.assert_array_equal(yf_cap[cap:], 0.0)

    # A capacity large enough for every assignment equals dropless, gradients too.
    roomy = _forced(top_k, float(E))
    y_roomy, aux_roomy = eqx.filter_jit(lambda m, x: m(x))(roomy, x)
    assert_trees_close(y_roomy, y)
    assert float(aux_roomy.dropped_fraction) == 0.0
    cot = jax.random.normal(jax.random.key(2), x.shape)
    grad = eqx.filter_jit(eqx.filter_grad(lambda m: jnp.sum(m(x)[0] * cot)))
    assert_trees_close_to_scale(grad(roomy), grad(moe))


def test_capacity_priority_is_choice_rank_then_token():
    """Token 0 picks experts (0, 1), every other token (1, 0); capacity 2 per
    expert. First choices go first: expert 1 keeps tokens 1 and 2's first choices
    and drops token 0's second; expert 0 keeps token 0's first choice, then token
    1's second (the earliest token among second choices)."""
    moe = nn.MoE(
        D, H, nn.MoEConfig(E, top_k=2, normalize_top_k=False, capacity_factor=0.25), key=jax.random.key(4)
    )
    # Router reading feature 0 only: positive -> expert 0 first, negative -> expert 1 first.
    router = jnp.zeros((D, E)).at[0, 0].set(1.0).at[0, 1].set(-1.0).at[1, :2].set(0.5)
    moe = eqx.tree_at(lambda m: m.router, moe, router)
    x = jnp.zeros((1, T, D)).at[:, :, 1].set(4.0).at[:, :, 0].set(-1.0).at[0, 0, 0].set(1.0)
    y, aux = moe(x)
    cap = math.ceil(0.25 * T * 2 / E)
    assert cap == 2
    xf = x.reshape(T, D)
    idx, w, _, _ = moe.route(xf)
    np.testing.assert_array_equal(idx[0], [0, 1])
    np.testing.assert_array_equal(idx[1:], np.tile([1, 0], (T - 1, 1)))
    per_expert = jnp.einsum("td,edh->teh", xf, moe.w_in)
    a = jax.nn.silu(jnp.einsum("td,edh->teh", xf, moe.w_gate)) * per_expert
    y_all = jnp.einsum("teh,ehd->ted", a, moe.w_out)
    # expert 0 keeps token 0 (rank 0) and token 1 (rank 1); expert 1 keeps tokens 1
    # and 2 (rank 0), so token 0's second choice is dropped.
    want = np.zeros((T, D))
    want[0] = w[0, 0] * y_all[0, 0]
    want[1] = w[1, 0] * y_all[1, 1] + w[1, 1] * y_all[1, 0]
    want[2] = w[2, 0] * y_all[2, 1]
    assert_trees_close(np.asarray(y).reshape(T, D), want)
    np.testing.assert_allclose(float(aux.dropped_fraction), (2 * T - 4) / (2 * T))


def test_aux_losses():
    x = make_x()
    moe = nn.MoE(D, H, nn.MoEConfig(E, top_k=2), key=jax.random.key(6))
    _, aux = moe(x)
    xf = np.asarray(x, np.float64).reshape(T, D)
    logits = xf @ np.asarray(moe.router, np.float64)
    lse = np.log(np.sum(np.exp(logits), -1))
    assert_trees_close(float(aux.router_z_loss), np.mean(lse**2))
    probs = np.exp(logits - lse[:, None])
    top = np.argsort(-probs, -1)[:, :2]
    f = np.bincount(top.reshape(-1), minlength=E) / (2 * T)
    np.testing.assert_allclose(aux.expert_load, f * 2 * T)
    assert_trees_close(float(aux.load_balance_loss), E * np.sum(f * probs.mean(0)))

    # Perfectly uniform routing: token t strongly prefers expert t % E, so the
    # assignment fractions are uniform: the loss is exactly 1 (whatever P is).
    for k in (1, 2):
        uniform = nn.MoE(E, H, nn.MoEConfig(E, top_k=k), key=jax.random.key(7))
        router = 5.0 * jnp.eye(E) + 2.0 * jnp.roll(jnp.eye(E), 1, 1)
        uniform = eqx.tree_at(lambda m: m.router, uniform, router)
        xu = jax.nn.one_hot(jnp.arange(T) % E, E).reshape(BATCH, SEQ, E)
        _, aux_u = uniform(xu)
        np.testing.assert_array_equal(aux_u.expert_load, np.full(E, T * k / E))
        # 1 up to the rounding of E means over T tokens (their order: the CPU's).
        assert_trees_close(float(aux_u.load_balance_loss), 1.0)
    # Uniform probabilities (zero router) also give 1, and all tokens on one
    # expert with probability ~1 give ~E (the top-1 worst case).
    _, aux_z = _forced(1)(x)
    assert_trees_close(float(aux_z.load_balance_loss), 1.0)
    skewed = nn.MoE(D, H, nn.MoEConfig(E, top_k=1), key=jax.random.key(6))
    skewed = eqx.tree_at(lambda m: m.router, skewed, jnp.zeros((D, E)).at[:, 0].set(100.0))
    _, aux_s = skewed(jnp.abs(x))
    assert_trees_close(float(aux_s.load_balance_loss), E)


def test_router_bias_steers_selection_not_weights():
    x = make_x()
    moe = nn.MoE(
        D, H, nn.MoEConfig(E, top_k=1, normalize_top_k=False), activation="gelu", key=jax.random.key(8)
    )
    forced = eqx.tree_at(lambda m: m.router_bias, moe, jnp.array([0.0, 0.0, 0.0, 10.0]))
    xf = x.reshape(T, D)
    idx0, w0, scores0, _ = moe.route(xf)
    idx1, w1, scores1, _ = forced.route(xf)
    assert not np.array_equal(idx0, idx1)
    np.testing.assert_array_equal(idx1, 3)
    np.testing.assert_array_equal(scores0, scores1)
    np.testing.assert_allclose(w1[:, 0], scores0[:, 3], rtol=1e-6)  # the score, no bias

    # No gradient reaches the bias, through the output or the aux losses.
    def loss(m):
        y, aux = m(x)
        return jnp.sum(y**2) + aux.load_balance_loss + aux.router_z_loss

    g = eqx.filter_jit(eqx.filter_grad(loss))(forced)
    assert float(jnp.max(jnp.abs(g.router_bias))) == 0.0
    assert float(jnp.max(jnp.abs(g.router))) > 0.0


def test_update_router_bias_moves_towards_balance():
    moe = nn.MoE(D, H, nn.MoEConfig(E, top_k=1), key=jax.random.key(9))
    new = nn.update_router_bias(moe, jnp.array([10.0, 0.0, 2.0, 4.0]), rate=0.1)
    np.testing.assert_allclose(new.router_bias, [-0.1, 0.1, 0.1, 0.0], rtol=1e-6)
    assert new.router is moe.router

    # From all tokens on expert 0, repeated updates spread the load.
    moe = eqx.tree_at(lambda m: m.router_bias, moe, jnp.array([2.0, 0.0, 0.0, 0.0]))
    x = make_x(batch=4, seq=16)
    call = eqx.filter_jit(lambda m, x: m(x)[1].expert_load)
    first = np.asarray(call(moe, x))
    assert first.max() == x.shape[0] * x.shape[1]
    for _ in range(30):
        moe = nn.update_router_bias(moe, call(moe, x), rate=0.1)
    last = np.asarray(call(moe, x))
    assert last.max() < 0.6 * first.max(), last

    with pytest.raises(eqxpar.SpecError, match="expert_load has shape"):
        nn.update_router_bias(moe, jnp.ones(E + 1), rate=0.1)


class MoEBlock(eqx.Module):
    """A residual MoE block for `nn.Stacked`: the carry is `(h, summed aux loss)`."""

    moe: nn.MoE

    def __init__(self, key):
        self.moe = nn.MoE(D, H, nn.MoEConfig(E, top_k=2), key=key)

    def __call__(self, carry):
        h, loss = carry
        y, aux = self.moe(h)
        return h + y, loss + aux.load_balance_loss + aux.router_z_loss


def test_stacked_moe_blocks_with_a_carry():
    stack = nn.Stacked(MoEBlock, depth=2, key=jax.random.key(13))
    x = make_x()

    def scanned(s):
        h, aux = s((x, jnp.zeros(())))
        return jnp.sum(h**2) + aux

    def looped(s):
        carry = (x, jnp.zeros(()))
        for i in range(s.depth):
            carry = s[i](carry)
        return jnp.sum(carry[0] ** 2) + carry[1]

    got, got_g = eqx.filter_jit(eqx.filter_value_and_grad(scanned))(stack)
    want, want_g = eqx.filter_jit(eqx.filter_value_and_grad(looped))(stack)
    assert_trees_close(float(got), float(want))
    assert_trees_close_to_scale(got_g, want_g)
    # The router bias of a stack: one row per layer.
    load = jnp.array([[8.0, 0.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    moe = nn.update_router_bias(stack.blocks.moe, load, rate=0.5)
    blocks = eqx.tree_at(lambda b: b.moe, stack.blocks, moe)
    np.testing.assert_allclose(blocks.moe.router_bias, [[-0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])


# -- plans ---------------------------------------------------------------------


class MoEModel(eqx.Module):
    moe: nn.MoE

    def __init__(self, *, activation="swiglu", use_bias=False, **routing):
        config = nn.MoEConfig(E, **routing)
        self.moe = with_biases(
            nn.MoE(D, H, config, activation=activation, use_bias=use_bias, key=jax.random.key(11))
        )

    def __call__(self, x):
        return self.moe(x)


def plan_batches(n, batch=8):
    return sequence_regression_batches(n, batch, seq=SEQ, dim=D)


PLAN_CASES = {
    "data8_dropless": (dict(data=8), None, dict(top_k=2, use_bias=True, num_shared=1)),
    "data2_tensor4_dropless": (
        dict(data=2, tensor=4),
        eqxpar.rules.MEGATRON,
        dict(top_k=2, use_bias=True, num_shared=1, score="sigmoid"),
    ),
    "data2_tensor4_capacity": (
        dict(data=2, tensor=4),
        eqxpar.rules.MEGATRON,
        dict(top_k=2, activation="gelu", capacity_factor=1.0),
    ),
}


@pytest.mark.parametrize("name", list(PLAN_CASES))
def test_automatic_plans_match_one_device(name):
    mesh_kw, rules, moe_kw = PLAN_CASES[name]
    plan = eqxpar.Plan(eqxpar.make_mesh(**mesh_kw), rules=rules)
    model = MoEModel(**moe_kw)
    losses, _ = train_checked(plan, model, optax.sgd(0.1), moe_regression_loss, plan_batches(2))
    assert all(np.isfinite(losses))


def test_manual_tensor_plan_matches_dense():
    """Inside a shard_map over `tensor` each device runs its shard of every
    expert's hidden features and the outputs are summed over the axis."""
    moe = with_biases(
        nn.MoE(D, H, nn.MoEConfig(E, top_k=2, num_shared=1), use_bias=True, key=jax.random.key(12))
    )
    x = make_x(batch=4)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual")
    specs = eqxpar.partition_specs(moe, plan)

    def loss(m, x):
        y, aux = m(x)
        return jnp.sum(y**2) + aux.load_balance_loss + aux.router_z_loss

    apply = eqxpar.filter_shard_map(loss, plan, in_specs=(specs, P()), out_specs=P(), axis_names={"tensor"})
    want, want_g = eqx.filter_jit(eqx.filter_value_and_grad(loss))(moe, x)
    with plan:
        got, got_g = eqx.filter_jit(eqx.filter_value_and_grad(apply))(eqxpar.shard(moe, plan), x)
    assert_trees_close(float(got), float(want))
    assert_trees_close_to_scale(got_g, want_g)

    sp = eqxpar.Plan(plan.mesh, rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True)
    apply_sp = eqxpar.filter_shard_map(loss, sp, in_specs=(specs, P()), out_specs=P(), axis_names={"tensor"})
    with sp, pytest.raises(eqxpar.PlanError, match="sequence_parallel"):
        eqx.filter_jit(apply_sp)(eqxpar.shard(moe, sp), x)


# -- errors --------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(experts=0), r"MoEConfig\(experts=0\): expected a positive integer"),
        (dict(top_k=0), r"MoEConfig\(top_k=0\): expected an integer from 1 to experts=4"),
        (dict(top_k=5), r"top_k=5\): expected an integer from 1 to experts=4.*e\.g\. top_k=2"),
        (dict(score="relu"), r"score='relu'\): expected 'softmax' or 'sigmoid'"),
        (dict(capacity_factor=0.0), r"capacity_factor=0.0\): expected a number > 0.*None for dropless"),
        (dict(capacity_factor=-1), r"capacity_factor=-1"),
        (dict(num_shared=-1), r"num_shared=-1\): expected an integer >= 0"),
        (dict(shared_hidden=0), r"shared_hidden=0\): expected a positive integer, or None"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(eqxpar.PlanError, match=match):
        nn.MoEConfig(**{"experts": E, **kwargs})


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((0, H), {}, r"MoE\(d_model=0\): expected a positive integer"),
        ((D, H), dict(activation="relu"), r"activation='relu'.*swiglu"),
    ],
)
def test_bad_layer_arguments_raise(args, kwargs, match):
    with pytest.raises(eqxpar.PlanError, match=match):
        nn.MoE(*args, nn.MoEConfig(E), **kwargs, key=jax.random.key(0))


def test_wrong_input_rank_raises():
    moe = nn.MoE(D, H, nn.MoEConfig(E), key=jax.random.key(0))
    with pytest.raises(eqxpar.SpecError, match=r"shape \(16, 16\).*\(batch, seq, d_model=16\)"):
        moe(jnp.ones((16, D)))
    with pytest.raises(eqxpar.SpecError, match=r"d_model=16"):
        moe(jnp.ones((2, 8, D + 1)))
