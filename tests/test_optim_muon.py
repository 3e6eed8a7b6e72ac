"""`eqxpar.optim.muon`: optax.contrib.muon's updates under every plan family, with
each matrix orthogonalised whole on one owner device (bytes from compiled HLO)."""

import dataclasses
import importlib.metadata

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, gpt_first, gpt_last, lm_loss

from ._helpers import GPT2_STYLE, lm_tokens, record_gradients, recorded_gradients

D = optax.contrib.MuonDimensionNumbers
LR = 0.02
#: The usual recipe on eqxpar's GPT: each block matrix of the stack on Muon, one
#: matrix per layer (and per q/k/v, per expert); embeddings, norms, biases, the
#: router and the head on AdamW (None). Negative dimensions: the stack's leading
#: layer axis (and an MoE's expert axis) index matrices.
DENSE = {
    "wqkv": D(-4, (-2, -1)),
    "wq": D(-3, (-2, -1)),
    "wo": D((-3, -2), -1),
    "w_in": D(-3, -1),
    "w_out": D(-2, -1),
}
MOE = {**DENSE, "w_in": D(-2, -1)}


def muon_dims(params):
    def dims(path, leaf):
        table = MOE if any(getattr(k, "name", None) == "moe" for k in path) else DENSE
        return table.get(getattr(path[-1], "name", None))

    return jax.tree_util.tree_map_with_path(dims, params)


MOE_GPT = dataclasses.replace(GPT2_STYLE, moe_every=1, experts=4, fused_qkv=False)
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)
mesh, rules = eqxpar.make_mesh, eqxpar.rules
PLANS = {
    "data": (lambda: eqxpar.Plan(mesh(data=8)), GPT2_STYLE, lm_loss),
    "fsdp_manual": (
        lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP(), mode="manual"),
        GPT2_STYLE,
        lm_loss,
    ),
    "fsdp_auto": (lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP()), GPT2_STYLE, lm_loss),
    "zero1": (lambda: eqxpar.Plan(mesh(data=8), zero1=True), GPT2_STYLE, lm_loss),
    "tensor_sp": (
        lambda: eqxpar.Plan(
            mesh(data=2, tensor=4), rules=rules.MEGATRON, mode="manual", sequence_parallel=True
        ),
        GPT2_STYLE,
        lm_loss,
    ),
    "expert": (lambda: eqxpar.Plan(mesh(expert=4, data=2), rules=rules.EXPERT), MOE_GPT, lm_loss),
    "pipeline": (
        lambda: eqxpar.Plan(
            mesh(pipe=2, data=2, tensor=2),
            rules=eqxpar.pipeline.stage_rules(rules.MEGATRON),
            schedule="1f1b",
            microbatches=2,
        ),
        GPT2_STYLE,
        PIPELINE_LOSS,
    ),
    "hybrid": (
        lambda: eqxpar.Plan(
            mesh(data=2, fsdp=2, tensor=2), rules=rules.MEGATRON_FSDP, mode="manual", sequence_parallel=True
        ),
        GPT2_STYLE,
        lm_loss,
    ),
}


def _host(tree):
    return jax.tree.map(
        lambda x: jax.device_put(np.asarray(x), jax.devices()[0]) if eqx.is_array(x) else x, tree
    )


def _assert_updated_alike(got, before, updates, *, rtol, where):
    """`got` (parameters after the step) against `before + updates`, per leaf: within
    `rtol` of that leaf's largest update, plus the float32 rounding of adding an
    update to a parameter (a unit in the last place of the leaf's largest value: an update
    a rounding apart may round the sum the other way)."""
    want = eqx.apply_updates(before, updates)
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(got, eqx.is_array))[0]
    for (path, x), y, u in zip(
        flat, jax.tree.leaves(eqx.filter(want, eqx.is_array)), jax.tree.leaves(updates), strict=True
    ):
        x, y, u = (np.asarray(a, np.float64) for a in (x, y, u))
        err = float(np.max(np.abs(x - y)))
        bound = rtol * float(np.max(np.abs(u))) + float(np.max(np.abs(y))) * np.finfo(np.float32).eps
        assert err <= bound, f"{where} {jax.tree_util.keystr(path)}: {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", list(PLANS))
def test_updates_equal_optax_muon_on_one_device(name):
    # The run's own gradients (recorded in its optimizer state) fed to optax's Muon
    # on one device: only the optimizer's arithmetic separates the two updates.
    make_plan, config, loss_fn = PLANS[name]
    plan, model = make_plan(), eqx.filter_jit(GPT)(config, key=jax.random.key(0))
    run = record_gradients(eqxpar.optim.muon(LR, muon_weight_dimension_numbers=muon_dims))
    reference = optax.contrib.muon(LR, muon_weight_dimension_numbers=muon_dims)
    state = eqxpar.train.init(model, run, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss_fn, run, plan)
    before = _host(state.model)  # in the plan's stack order, as its gradients come
    ref_state = reference.init(eqx.filter(before, eqx.is_inexact_array))
    update = jax.jit(reference.update)
    for i in range(3):
        state, _ = step(state, lm_tokens(i, batch=16, seq=16))
        after = _host(state.model)
        params = eqx.filter(before, eqx.is_inexact_array)
        updates, ref_state = update(_host(recorded_gradients(state.opt_state)), ref_state, params)
        _assert_updated_alike(after, before, updates, rtol=1e-6, where=f"{name} step {i}")
        before = after


def _optimizer_wire_bytes(plan, model, optim) -> int:
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    compiled = eqxpar.train.make_step(lm_loss, optim, plan).compile(state, lm_tokens(0, batch=16, seq=16))
    return eqxpar.inspect.collective_stats(compiled).total_wire_bytes


def _optimizer_bytes(name, make_optimizer) -> tuple[int, int]:
    """The optimizer's traffic under plan `name`: the step's wire bytes beyond the
    same step's with AdamW (elementwise: it moves nothing); and the parameter bytes."""
    make_plan, config, _ = PLANS[name]
    plan, model = make_plan(), eqx.filter_jit(GPT)(config, key=jax.random.key(0))
    adamw = _optimizer_wire_bytes(plan, model, optax.adamw(LR))
    extra = (
        _optimizer_wire_bytes(plan, model, make_optimizer(LR, muon_weight_dimension_numbers=muon_dims))
        - adamw
    )
    return extra, sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))


@pytest.mark.parametrize("name", ["fsdp_manual", "hybrid"])
def test_the_update_moves_at_most_twice_the_parameter_bytes(name):
    ours, param_bytes = _optimizer_bytes(name, eqxpar.optim.muon)
    assert 0 < ours <= 2 * param_bytes, (ours, param_bytes)


@pytest.mark.slow  # three more steps to compile; benchmarks/muon.py records the same at scale
def test_optax_muon_moves_several_times_more():
    # optax's Muon, left to the compiler, gathers every matrix on every device and
    # all-reduces the Newton-Schulz products of blocks.
    ours, _ = _optimizer_bytes("fsdp_manual", eqxpar.optim.muon)
    theirs, _ = _optimizer_bytes("fsdp_manual", optax.contrib.muon)
    assert ours < theirs / 4, (ours, theirs)


def test_outside_a_step_it_is_optax_muon():
    # No step publishes a layout: optax's arithmetic, leaf by leaf (the default
    # rule: 2-D leaves on Muon, the rest on AdamW).
    params = {
        "w": jax.random.normal(jax.random.key(0), (8, 12)),
        "b": jax.random.normal(jax.random.key(1), (12,)),
    }
    ours, theirs = (
        eqxpar.optim.muon(LR, ns_coeffs="dion", ns_steps=5),
        optax.contrib.muon(LR, ns_coeffs="dion", ns_steps=5),
    )
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_theirs)
    for key in jax.random.split(jax.random.key(10), 3):
        grads = jax.tree.map(lambda p, k=key: jax.random.normal(k, p.shape), params)
        u_ours, s_ours = jax.jit(ours.update)(grads, s_ours, params)
        u_theirs, s_theirs = jax.jit(theirs.update)(grads, s_theirs, params)
        for a, b in zip(jax.tree.leaves(u_ours), jax.tree.leaves(u_theirs), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_unknown_preset_is_refused():
    with pytest.raises(eqxpar.EqxparError, match="'polar'"):
        eqxpar.optim.muon(LR, ns_coeffs="polar")


def test_an_old_optax_is_refused(monkeypatch):
    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata, "version", lambda name: "0.2.5" if name == "optax" else real(name)
    )
    with pytest.raises(eqxpar.EqxparError, match=r"optax >= 0\.2\.8.*0\.2\.5"):
        eqxpar.optim.muon(LR)


def test_a_matrix_leaf_without_dimension_numbers_is_refused_under_a_plan():
    # optax's own rule puts 3-D leaves on AdamW; scale_by_muon alone must be told
    # how to cut one into matrices.
    plan = eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP(), mode="manual")
    model = eqx.filter_jit(GPT)(GPT2_STYLE, key=jax.random.key(0))
    optim = optax.chain(eqxpar.optim.scale_by_muon(), optax.scale(-LR))
    trainable = jax.tree_util.tree_map_with_path(lambda p, x: getattr(p[-1], "name", None) == "w_out", model)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(lm_loss, optim, plan, trainable=trainable)
    with pytest.raises(eqxpar.EqxparError, match=r"shape \(2, 64, 32\) without dimension numbers"):
        step.lower(state, lm_tokens(0, batch=16, seq=16))
