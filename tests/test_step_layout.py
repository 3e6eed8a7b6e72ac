"""The step layout (`eqxpar.internal.StepLayout`) is the one place a step's strategy is
decided; plans are rebuilt by `dataclasses.replace`; options a plan would ignore
are refused."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.pipeline import PipelineLoss, stage_rules

from ._helpers import LogicalMLP as MLP
from ._helpers import mse_loss, regression_batches

PLANS = {
    "dp": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)),
    "dp-manual": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8), mode="manual"),
    "fsdp": lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=1)),
    "zero1": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8), zero1=True),
    "tp-partial": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual", manual_axes="tensor"
    ),
    "tp-overlap": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4),
        rules=eqxpar.rules.MEGATRON,
        mode="manual",
        sequence_parallel=True,
        tp_overlap=True,
        annotations={"x": P("data")},
    ),
    "pipeline": lambda: eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=4),
        rules=stage_rules(eqxpar.rules.MEGATRON),
        schedule="1f1b",
        microbatches=4,
        compute_dtype=jnp.bfloat16,
        reduce_dtype=jnp.float32,
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_replace_rebuilds_every_valid_plan(name):
    plan = PLANS[name]()
    assert dataclasses.replace(plan) == plan
    # Changing the batch axes moves the default annotations with them (they are
    # not stored), and keeps the given ones.
    if "data" in plan.batch_axes and plan.schedule is None:
        moved = dataclasses.replace(plan, batch_axes=("data",))
        assert moved.annotation("batch") == P(("data",)) == moved.annotation("activations")
        assert moved.annotations == plan.annotations


def test_replace_between_modes():
    auto = PLANS["dp"]()
    manual = dataclasses.replace(auto, mode="manual")
    assert manual == eqxpar.Plan(auto.mesh, mode="manual")
    assert dataclasses.replace(manual, mode="auto") == auto
    pipe = PLANS["pipeline"]()
    assert dataclasses.replace(pipe, schedule=None, microbatches=1).mode == "auto"
    with pytest.raises(eqxpar.PlanError, match="Drop mode"):
        dataclasses.replace(auto, schedule="gpipe", mesh=pipe.mesh)


def test_options_a_plan_would_ignore_are_refused():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    with pytest.raises(eqxpar.PlanError, match="Drop mode"):
        eqxpar.Plan(eqxpar.make_mesh(pipe=2), schedule="gpipe", mode="auto")
    with pytest.raises(eqxpar.PlanError, match="tp_overlap=True\\) needs mode='manual'"):
        eqxpar.Plan(mesh, rules=eqxpar.rules.MEGATRON, sequence_parallel=True, tp_overlap=True)
    optim = optax.sgd(0.1)
    for plan in (
        eqxpar.Plan(mesh, reduce_dtype=jnp.bfloat16),
        eqxpar.Plan(mesh, mode="manual", manual_axes="tensor", reduce_dtype=jnp.bfloat16),
    ):
        with pytest.raises(eqxpar.PlanError, match="reduces none by hand"):
            eqxpar.train.make_step(mse_loss, optim, plan)
    # Where the step does reduce by hand, the option applies.
    eqxpar.train.make_step(mse_loss, optim, eqxpar.Plan(mesh, reduce_dtype=jnp.bfloat16), accumulate=2)
    eqxpar.train.make_step(mse_loss, optim, eqxpar.Plan(mesh, reduce_dtype=jnp.bfloat16, zero1=True))
    eqxpar.train.make_step(mse_loss, optim, eqxpar.Plan(mesh, mode="manual", reduce_dtype=jnp.bfloat16))
    # On XLA:CPU a partial-manual region over the tensor axis cannot compile the
    # layers' bfloat16 all-reduces: refused before XLA sees them, naming the ways out.
    partial = eqxpar.Plan(mesh, mode="manual", manual_axes="tensor", compute_dtype=jnp.bfloat16)
    with pytest.raises(eqxpar.PlanError, match=r"partial-manual region .* drop Plan\(manual_axes=\.\.\.\)"):
        eqxpar.train.make_step(mse_loss, optim, partial)
    eqxpar.train.make_step(mse_loss, optim, dataclasses.replace(partial, compute_dtype=jnp.float16))


@pytest.mark.parametrize(
    "name, kind, manual, reduced",
    [
        ("dp", "automatic", set(), ()),
        ("dp-manual", "manual", {"data", "pipe", "fsdp", "expert", "context", "tensor"}, ("data", "fsdp")),
        # A partial-manual region leaves size-1 axes (fsdp here) automatic.
        ("zero1", "manual", {"data"}, ("data",)),
        ("tp-partial", "manual", {"tensor"}, ()),
        ("pipeline", "pipeline", {"data", "pipe", "fsdp", "expert", "context", "tensor"}, ("data", "fsdp")),
    ],
)
def test_layout_decides_the_strategy(name, kind, manual, reduced):
    plan = PLANS[name]()
    model = MLP(16, 32, 4, key=jax.random.key(0))
    layout = eqxpar.internal.StepLayout.of(eqxpar.internal.ResolvedPlan.of(plan), model)
    assert layout.kind == kind
    assert set(layout.manual_axes) == manual
    assert layout.reduced_axes == reduced
    assert layout.data_parallel_size == (8 // plan.mesh.shape["pipe"] if reduced else 1)
    assert layout.partial == (kind == "manual" and manual != set(plan.mesh.axis_names))


def test_zero1_layout_splits_the_optimizer_state_not_the_parameters():
    plan = PLANS["zero1"]()
    model = MLP(16, 32, 8, key=jax.random.key(0))
    optim = optax.adam(1e-3)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(mse_loss, optim, plan)
    layout = step.layout(state)
    assert layout.sliced_update
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    assert all(s == P() for s in jax.tree.leaves(layout.params, is_leaf=is_spec))
    assert any(s != P() for s in jax.tree.leaves(layout.opt_state, is_leaf=is_spec))
    # The state lives where the layout says, and the step keeps it there.
    specs = jax.tree.leaves(layout.state_specs(state), is_leaf=is_spec)
    specs = [s for s in specs if s is not None]

    def placed_as_specs(state):
        arrays = jax.tree.leaves(eqx.filter(state, eqx.is_array))
        return len(arrays) == len(specs) and all(
            x.sharding.is_equivalent_to(plan.sharding(s), x.ndim) for x, s in zip(arrays, specs, strict=True)
        )

    assert placed_as_specs(state)
    state, _ = step(state, regression_batches(1, d_out=8)[0])
    assert placed_as_specs(state)
    # The rules alone (partition_specs) know nothing of ZeRO-1.
    assert all(
        s == P() for s in jax.tree.leaves(eqxpar.partition_specs(state.opt_state, plan), is_leaf=is_spec)
    )


def test_pipeline_loss_checks_happen_when_the_step_is_built():
    plan = PLANS["pipeline"]()
    with pytest.raises(eqxpar.PlanError, match="PipelineLoss"):
        eqxpar.train.make_step(mse_loss, optax.sgd(0.1), plan)
    loss = PipelineLoss(first=lambda m, b: b, stack=lambda m: m.blocks, last=lambda m, h, b: jnp.mean(h))
    with pytest.raises(eqxpar.PlanError, match="microbatches=8"):
        eqxpar.train.make_step(loss, optax.sgd(0.1), plan, accumulate=2)


def test_each_builder_resolves_its_plan_once(monkeypatch):
    # A builder resolves the plan once and passes the ResolvedPlan down: calling
    # the step, lowering it, or the gradients again resolves nothing more.
    from eqxpar._train._resolved_plan import ResolvedPlan

    resolved = []
    of = ResolvedPlan.of.__func__

    def counted(cls, plan, accumulate=1, **kwargs):
        resolved.append(plan)
        return of(cls, plan, accumulate, **kwargs)

    monkeypatch.setattr(ResolvedPlan, "of", classmethod(counted))
    plan, optim = PLANS["dp-manual"](), optax.sgd(0.1)
    model = MLP(16, 32, 4, key=jax.random.key(0))
    batches = regression_batches(2)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    assert len(resolved) == 1
    step = eqxpar.train.make_step(mse_loss, optim, plan, accumulate=2)
    for batch in batches:
        state, _ = step(state, batch)
    step.lower(state, batches[0])
    assert len(resolved) == 2
    value_and_grad = eqxpar.train.make_value_and_grad(mse_loss, plan)
    for batch in batches:
        value_and_grad(state.model, batch)
    assert len(resolved) == 3
    layout = step.layout(state)
    assert layout.resolved.accumulate == 2 and layout.resolved.microbatches == 2
    assert layout.resolved.batch is layout.resolved.batch  # held, not rebuilt on each access
