"""Expert parallelism: `eqxpar.nn.MoE` with its experts split over the mesh's
`expert` axis, tokens sent to their experts' devices and back by all-to-all.

Parity with one device (loss with the auxiliary losses, gradients, parameters
after AdamW) for top-1 / top-2, with and without shared experts, expert 2 / 4 / 8
x data, in automatic and manual plans, with tensor and pipeline axes; dropless
under adversarial routing; the layout (experts and their optimizer state 1/n per
device); the collectives of the compiled step; errors.
"""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar import nn

from ._helpers import (
    MOE_D,
    MOE_EXPERTS,
    MOE_HIDDEN,
    MOE_SEQ,
    MoEModel,
    assert_trees_close,
    assert_trees_close_to_scale,
    moe_batches,
    moe_regression_loss,
    reference_run,
    run_steps,
    token_batches,
    train_checked,
)

D, H, E, SEQ = MOE_D, MOE_HIDDEN, MOE_EXPERTS, MOE_SEQ


batches = moe_batches


CASES = {
    "expert2_data4_top2_shared": (dict(expert=2, data=4), "auto", dict(top_k=2, num_shared=1)),
    "expert4_data2_top1": (dict(expert=4, data=2), "auto", dict(top_k=1, activation="gelu")),
    "expert8_top2_sigmoid": (dict(expert=8), "auto", dict(top_k=2, score="sigmoid")),
    "expert4_data2_manual_top2": (dict(expert=4, data=2), "manual", dict(top_k=2, num_shared=1)),
    "expert4_fsdp2_manual_top1": (dict(expert=4, fsdp=2), "manual", dict(top_k=1)),
    "expert2_data4_capacity_roomy": (dict(expert=2, data=4), "manual", dict(top_k=2, capacity_factor=8.0)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_matches_one_device(name):
    mesh_kw, mode, moe_kw = CASES[name]
    rules = eqxpar.rules.EXPERT if "fsdp" not in mesh_kw else eqxpar.rules.MEGATRON_FSDP
    plan = eqxpar.Plan(eqxpar.make_mesh(**mesh_kw), rules=rules, mode=mode)
    model = MoEModel(**moe_kw)
    losses, state = train_checked(plan, model, optax.adamw(1e-2), moe_regression_loss, batches(3))
    assert all(np.isfinite(losses))
    # Each device holds its experts and their Adam moments: 1/n of them.
    n = mesh_kw["expert"]
    expert_leaves = [
        leaf
        for leaf in jax.tree.leaves((state.model, state.opt_state))
        if leaf.shape in ((E, D, H), (E, H, D))
    ]
    # The weights, their Adam moments (and the recorded gradients).
    assert len(expert_leaves) >= 3 * (2 + (moe_kw.get("activation") != "gelu"))
    for leaf in expert_leaves:
        assert leaf.sharding.shard_shape(leaf.shape)[0] == E // n
    assert state.model.moe.router.sharding.shard_shape(state.model.moe.router.shape)[0] in (D, D // 2)


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_expert_fsdp_splits_every_weight_over_expert_too(mode):
    """`rules.EXPERT_FSDP`: the weights outside the experts (here the input
    projection and the router) and their Adam moments split over fsdp x expert,
    1/8 per device, gathered over both where used (one axis at a time); the
    experts' model dimension over fsdp. Parity with one device over three steps,
    and the gathers and reduce-scatters in the compiled step moving what
    `minimum_comm` counts."""
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=4, fsdp=2), rules=eqxpar.rules.EXPERT_FSDP, mode=mode)
    model = MoEModel(top_k=2, num_shared=1)
    _, state = train_checked(plan, model, optax.adamw(1e-2), moe_regression_loss, batches(3))
    router = state.model.moe.router
    assert router.sharding.spec[0] == ("fsdp", "expert"), router.sharding.spec
    assert router.sharding.shard_shape(router.shape)[0] == D // 8
    w_in = state.model.moe.w_in
    assert tuple(w_in.sharding.spec)[:2] == ("expert", "fsdp"), w_in.sharding.spec
    moments = [leaf for leaf in jax.tree.leaves(state.opt_state) if leaf.shape == router.shape]
    assert moments and all(m.sharding.spec == router.sharding.spec for m in moments)
    compiled = _compiled_step(plan, model)
    stats = eqxpar.inspect.collective_stats(compiled, mesh=plan.mesh)
    data = batches(1)[0]
    minimum = eqxpar.inspect.minimum_comm(plan, model, loss=moe_regression_loss, batch=data)
    for kind in ("all-gather", "reduce-scatter"):
        # One axis at a time (expert, then fsdp), never over both at once: the
        # TPU compiler writes that as an all-reduce (`_fsdp.gather_weights`).
        assert stats.by_axes[kind].get(("expert",), 0) > 0, stats.by_axes
        assert ("fsdp", "expert") not in stats.by_axes[kind], stats.by_axes
        assert stats.wire_bytes[kind] == minimum.wire_bytes[kind], (kind, stats.as_dict(), minimum)


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_expert_fsdp_without_an_fsdp_axis_splits_over_expert(mode):
    """`rules.EXPERT_FSDP` on a mesh whose `fsdp` axis has size 1: the weights
    outside the experts split over `expert` alone and are gathered over it where
    used (the size-1 `fsdp` in their spec splits nothing), where a step used to
    refuse them as mixing axes. Parity with one device over two steps."""
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT_FSDP, mode=mode)
    assert plan.mesh.shape["fsdp"] == 1
    _, state = train_checked(
        plan, MoEModel(top_k=2, num_shared=1), optax.adamw(1e-2), moe_regression_loss, batches(2)
    )
    router = state.model.moe.router
    assert router.sharding.shard_shape(router.shape)[0] == D // 4


def _emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """`jax.lax.ragged_all_to_all` as its docstring specifies it, from dense
    all-to-alls (XLA:CPU runs no ragged one): slice `i` of the operand goes to
    device `i`, written at `output_offsets[i]` of its output."""
    m, n = operand.shape[0], input_offsets.shape[0]
    r = jnp.arange(m)
    blocks = jnp.where(
        (r[None, :] < send_sizes[:, None])[..., None],
        operand[jnp.minimum(input_offsets[:, None] + r[None, :], m - 1)],
        0,
    )
    received = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    rows = jnp.where(r[None, :] < recv_sizes[:, None], at[:, None] + r[None, :], output.shape[0])
    return output.at[rows.reshape(-1)].set(received.reshape(n * m, -1), mode="drop")


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_ragged_exchange_matches_one_device(monkeypatch, mode):
    """The ragged exchange (`MoEConfig(exchange="ragged")`, TPU's default: only
    the routed rows sent) gives one device's numbers: run here with
    `ragged_all_to_all` emulated as its docstring specifies (XLA:CPU has none),
    which checks the offsets and sizes the layer passes."""
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT, mode=mode)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    monkeypatch.setattr("eqxpar.nn._moe_dispatch.NO_RAGGED_PLATFORMS", ())
    model = MoEModel(top_k=2, num_shared=1, exchange="ragged")
    train_checked(plan, model, optax.adamw(1e-2), moe_regression_loss, batches(3))
    # Adversarial routing: every token of every device to one device's experts.
    train_checked(plan, _forced(2, exchange="ragged"), optax.sgd(1e-2), moe_regression_loss, batches(2))
    # Left to choose, the layer pads on CPU: the emulation is never called.
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", None)
    train_checked(plan, MoEModel(top_k=2), optax.sgd(1e-2), moe_regression_loss, batches(1))


def test_a_ragged_exchange_on_cpu_is_refused_naming_the_fix():
    # XLA:CPU cannot compile a ragged all-to-all: refused when traced, not left
    # to the compiler's UNIMPLEMENTED.
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT)
    with pytest.raises(eqxpar.PlanError, match=r"exchange='ragged'.*exchange='auto'"):
        train_checked(
            plan, MoEModel(top_k=2, exchange="ragged"), optax.sgd(1e-2), moe_regression_loss, batches(1)
        )


def test_tensor_and_expert_axes_match_one_device():
    for mode in ("auto", "manual"):
        plan = eqxpar.Plan(
            eqxpar.make_mesh(expert=2, data=2, tensor=2), rules=eqxpar.rules.MEGATRON, mode=mode
        )
        train_checked(
            plan, MoEModel(top_k=2, num_shared=1), optax.adamw(1e-2), moe_regression_loss, batches(2)
        )


def test_aux_statistics_are_the_whole_batchs():
    """Each device routes its own tokens; the aux it reports (load per expert, the
    balance and z losses) is the whole batch's, as one device computes it."""
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT, mode="manual")
    model = MoEModel(top_k=2)
    x, _ = batches(1)[0]
    _, want = eqx.filter_jit(lambda m, x: m(x))(model, x)

    def loss(m, batch):
        y, aux = m(batch)
        return jnp.mean(y), aux

    step = eqxpar.train.make_step(loss, optax.sgd(0.0), plan, has_aux=True)
    state = eqxpar.train.init(model, optax.sgd(0.0), plan, key=jax.random.key(0))
    _, metrics = step(state, x)
    got = metrics["aux"]
    np.testing.assert_allclose(got.expert_load, want.expert_load)
    assert float(jnp.sum(got.expert_load)) == x.shape[0] * SEQ * 2
    for field in ("load_balance_loss", "router_z_loss"):
        assert_trees_close(float(getattr(got, field)), float(getattr(want, field)))


def _forced(top_k, **kw):
    """Every token's first choice is expert 0 (second: expert 1): a zero router
    and a bias that only steers selection. Dropless, expert 0's device receives
    every token of every device."""
    model = MoEModel(top_k=top_k, **kw)
    moe = eqx.tree_at(lambda m: m.router, model.moe, jnp.zeros((D, E)))
    bias = jnp.zeros(E).at[0].set(1.0).at[1].set(0.5)
    return eqx.tree_at(lambda m: m.moe, model, eqx.tree_at(lambda m: m.router_bias, moe, bias))


@pytest.mark.parametrize("top_k", [1, 2])
def test_dropless_under_adversarial_routing(top_k):
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=8), rules=eqxpar.rules.EXPERT, mode="manual")
    model = _forced(top_k)
    # Not one assignment dropped: loss and gradients are one device's.
    train_checked(plan, model, optax.sgd(0.1), moe_regression_loss, batches(1))

    def loss(m, batch):
        y, aux = m(batch[0])
        return jnp.mean(y**2), aux

    step = eqxpar.train.make_step(loss, optax.sgd(0.0), plan, has_aux=True)
    state = eqxpar.train.init(model, optax.sgd(0.0), plan, key=jax.random.key(0))
    x = batches(1)[0][0]
    _, metrics = step(state, (x,))
    aux = metrics["aux"]
    assert float(aux.dropped_fraction) == 0.0
    load = np.zeros(E)
    load[:top_k] = x.shape[0] * SEQ
    np.testing.assert_array_equal(aux.expert_load, load)


def test_capacity_applies_per_device_group():
    """With a capacity factor each device's tokens form a group (GShard): expert
    e takes at most ceil(c * group tokens * k / E) of each device's assignments.
    Parity with one device running the layer on each device's rows."""
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT, mode="manual")
    model = _forced(2, capacity_factor=1.0)
    x, target = batches(1)[0]

    def loss(m, batch):
        y, aux = m(batch[0])
        return jnp.mean((y - batch[1]) ** 2), aux.dropped_fraction

    step = eqxpar.train.make_step(loss, optax.sgd(0.0), plan, has_aux=True)
    state = eqxpar.train.init(model, optax.sgd(0.0), plan, key=jax.random.key(0))
    _, metrics = step(state, (x, target))
    call = eqx.filter_jit(lambda m, x: m(x))
    outs = [call(model, g) for g in x.reshape(8, -1, SEQ, D)]
    want = jnp.mean((jnp.concatenate([o[0] for o in outs]) - target) ** 2)
    assert_trees_close(float(metrics["loss"]), float(want))
    dropped = np.mean([float(o[1].dropped_fraction) for o in outs])
    assert_trees_close(float(metrics["aux"]), dropped)
    assert dropped > 0.5


def _compiled_step(plan, model, *, batch=16):
    step = eqxpar.train.make_step(moe_regression_loss, optax.adamw(1e-2), plan)
    state = eqxpar.train.init(model, optax.adamw(1e-2), plan, key=jax.random.key(0))
    return step.compile(state, batches(1, batch)[0])


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_collectives_are_the_all_to_alls(mode):
    """Per MoE layer: the dispatch and combine all-to-alls forward and their
    transposes backward, of `(devices * tokens * top_k, d_model)` rows each
    (dropless, padded on CPU: room for every assignment of a device going to
    one other), plus the counts per expert forward; no all-gather of expert
    weights."""
    n, top_k, batch = 4, 2, 16
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=n, data=2), rules=eqxpar.rules.EXPERT, mode=mode)
    compiled = _compiled_step(plan, MoEModel(top_k=top_k), batch=batch)
    rows = n * (batch // (2 * n) * SEQ) * top_k
    # One all-to-all may come as a tuple of its n chunks: (dtype, rows) per instruction.
    found = []
    for line in compiled.as_text().splitlines():
        if " all-to-all(" in line:
            result = line.split("=", 1)[1].split(" all-to-all(")[0]
            shapes = re.findall(r"([a-z]+\d+)\[(\d+)(?:,(\d+))?\]", result)
            assert len({(t, c) for t, _, c in shapes}) == 1, result
            found.append((shapes[0][0], sum(int(r) for _, r, _ in shapes), shapes[0][2]))
    assert sorted(found) == [("f32", rows, str(D))] * 4 + [("s32", n, str(E // n))], found
    stats = eqxpar.inspect.collective_stats(compiled)
    assert stats.count["all-gather"] == 0, stats.as_dict()
    # All-to-all over 4 devices: 3/4 of each operand leaves the device.
    assert stats.wire_bytes["all-to-all"] == 3 * (4 * rows * D * 4 + E * 4) // 4


class MoEBlock(eqx.Module):
    """A residual MoE block for a pipelined stack (aux not carried: the loss is
    the task's alone)."""

    moe: nn.MoE

    def __init__(self, key):
        self.moe = nn.MoE(D, H, nn.MoEConfig(E, top_k=2), use_bias=True, key=key)

    def __call__(self, h):
        # tanh keeps four blocks' activations (and so the loss) of order one.
        return h + jnp.tanh(self.moe(h)[0])


class PipelinedMoE(eqx.Module):
    proj: jax.Array
    blocks: nn.Stacked

    def __init__(self):
        self.proj = jnp.eye(D) + 0.1 * jax.random.normal(jax.random.key(7), (D, D))
        self.blocks = nn.Stacked(MoEBlock, depth=4, key=jax.random.key(8))


def _pipeline(schedule):
    """The loss of `PipelinedMoE` in a pipeline's three parts, and a pipe 2 x
    expert 2 x data 2 plan running it with `schedule`."""
    loss = eqxpar.pipeline.PipelineLoss(
        first=lambda m, batch: batch[0] @ m.proj,
        stack=lambda m: m.blocks,
        last=lambda m, h, batch: jnp.mean((h - batch[1]) ** 2),
    )
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, expert=2, data=2),
        rules=eqxpar.pipeline.stage_rules(eqxpar.rules.EXPERT),
        schedule=schedule,
        microbatches=2,
    )
    return loss, plan


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_expert_and_pipeline_axes_match_one_device(schedule):
    """The dispatch all-to-alls run inside the pipeline's stage branches: every
    device of an expert group is on the same stage, so all of them take it."""
    loss, plan = _pipeline(schedule)
    # Micro-batches sum gradients in another order than one device: compared to
    # each leaf's scale (a few of 16k elements cancel to near zero).
    model, optim = PipelinedMoE(), optax.sgd(1e-2)
    ref_losses, ref_model = reference_run(model, optim, loss, batches(3))
    step = eqxpar.train.make_step(loss, optim, plan)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    losses, state = run_steps(step, state, batches(3))
    assert np.all(np.isfinite(ref_losses)) and ref_losses[-1] < ref_losses[0]
    assert_trees_close(losses, ref_losses)
    assert_trees_close_to_scale(state.model, ref_model)
    w_in = state.model.blocks.blocks.moe.w_in
    assert w_in.sharding.spec[:2] == ("pipe", "expert"), w_in.sharding.spec
    assert w_in.sharding.shard_shape(w_in.shape)[:2] == (2, E // 2)


def test_pipelined_blocks_returning_aux_are_refused():
    class AuxBlock(MoEBlock):
        def __call__(self, h):
            y, aux = self.moe(h)
            return h + y, aux

    model = eqx.tree_at(
        lambda m: m.blocks, PipelinedMoE(), nn.Stacked(AuxBlock, depth=4, key=jax.random.key(8))
    )
    loss, plan = _pipeline("gpipe")
    step = eqxpar.train.make_step(loss, optax.sgd(0.1), plan)
    state = eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match="returning \\(h, aux\\)\\) cannot be pipelined"):
        step(state, batches(1)[0])


def test_errors_name_the_fix():
    mesh = eqxpar.make_mesh(expert=4, data=2)
    with pytest.raises(eqxpar.PlanError, match="leaves out 'expert'"):
        eqxpar.Plan(mesh, batch_axes=("data",))
    with pytest.raises(eqxpar.PlanError, match="manual_axes"):
        eqxpar.Plan(mesh, mode="manual", manual_axes=("data",))
    with pytest.raises(eqxpar.PlanError, match="tensor-parallel layers need their own axis"):
        eqxpar.Plan(mesh, tensor_axis="expert")
    model = MoEModel(top_k=2)
    # A weight dimension other than `experts` over the expert axis would be used as a fragment.
    wrong = eqxpar.Plan(mesh, rules=eqxpar.rules.Logical({"embed": "expert"}))
    with pytest.raises(eqxpar.PlanError, match="splits the stacked experts of eqxpar.nn.MoE layers only"):
        eqxpar.train.init(model, optax.sgd(0.1), wrong, key=jax.random.key(0))
    # Experts the axis does not divide.
    odd = eqxpar.Plan(eqxpar.make_mesh(expert=8), rules=eqxpar.rules.EXPERT)
    six = eqx.tree_at(lambda m: m.moe, model, nn.MoE(D, H, nn.MoEConfig(6), key=jax.random.key(1)))
    with pytest.raises(eqxpar.DivisibilityError, match="not divisible by the 8 devices"):
        eqxpar.train.init(six, optax.sgd(0.1), odd, key=jax.random.key(0))
    # Experts split, but called outside a region manual over `expert`.
    split = eqx.tree_at(lambda m: m.moe.w_in, model, model.moe.w_in[:2])
    with pytest.raises(eqxpar.PlanError, match="not over a manual 'expert' mesh axis"):
        split(batches(1)[0][0])


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_minimum_comm_counts_the_routed_activations(capacity_factor):
    """The minimum: four all-to-alls of this device's routed activations per
    layer, experts neither gathered nor reduced over `expert`. A dropless step
    moves `n` times that (static buffers with room for the worst case) plus the
    counts per expert; at capacity factor 1 (with every expert's capacity a whole
    number of rows) exactly the minimum."""
    n, batch = 4, 16
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=n, data=2), rules=eqxpar.rules.EXPERT, mode="manual")
    model = MoEModel(top_k=2, capacity_factor=capacity_factor)
    data = batches(1, batch)[0]
    minimum = eqxpar.inspect.minimum_comm(plan, model, loss=moe_regression_loss, batch=data)
    rows = batch // (2 * n) * SEQ * 2
    assert minimum.wire_bytes["all-to-all"] == 4 * (n - 1) * (rows * D * 4) // n
    stats = eqxpar.inspect.collective_stats(_compiled_step(plan, model, batch=batch))
    counts = 0 if capacity_factor else (n - 1) * E * 4 // n
    factor = n if capacity_factor is None else 1
    assert stats.wire_bytes["all-to-all"] == factor * minimum.wire_bytes["all-to-all"] + counts
    # The gradient all-reduce: every weight over the 8 batch devices, the experts over data only.
    assert stats.wire_bytes["all-reduce"] <= 1.05 * minimum.wire_bytes["all-reduce"], (
        stats.as_dict(),
        minimum,
    )
    assert stats.wire_bytes["all-reduce"] >= minimum.wire_bytes["all-reduce"]


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_zero1_slices_dense_updates_over_the_expert_axis_too(mode):
    # ZeRO-1 splits the update of a weight replicated over `expert` (here a GPT's
    # dense MLP, 1024 elements per layer) over every batch axis, `expert` among
    # them: its gradient must be reduce-scattered over `expert` as well (it was
    # psummed whole and then read as a slice, 8x too large, before the fix).
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, expert=2), rules=eqxpar.rules.MEGATRON, mode=mode, zero1=True)
    config = eqxpar.models.GPTConfig(
        vocab_size=16, d_model=16, num_heads=4, num_layers=2, d_hidden=32, activation="swiglu"
    )
    model = eqxpar.models.GPT(config, key=jax.random.key(0))
    state = eqxpar.train.init(model, optax.sgd(1e-1), plan, key=jax.random.key(1))
    spec = eqxpar.internal.StepLayout.of(
        eqxpar.internal.ResolvedPlan.of(plan), state.model, state.opt_state
    ).updates
    assert "expert" in str(spec.blocks.blocks.mlp.w_in)
    train_checked(plan, model, optax.adamw(1e-2), eqxpar.models.lm_loss, token_batches(2, batch=8, vocab=16))
