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
DENSE = {"wqkv": D(-4, (-2, -1)), "wq": D(-3, (-2, -1)), "wo": D((-3, -2), -1), "w_in": D(-3, -1), "w_out": D(-2, -1)}
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
    "fsdp_manual": (lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP(), mode="manual"), GPT2_STYLE, lm_loss),
    "fsdp_auto": (lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP()), GPT2_STYLE, lm_loss),
    "zero1": (lambda: eqxpar.Plan(mesh(data=8), zero1=True), GPT2_STYLE, lm_loss),
    "tensor_sp": (
        lambda: eqxpar.Plan(mesh(data=2, tensor=4), rules=rules.MEGATRON, mode="manual", sequence_parallel=True),
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
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]) if eqx.is_array(x) else x, tree)


def _assert_updated_alike(got, before, updates, *, rtol, where):
    """`got` (parameters after the step) against `before + updates`, per leaf: within
    `rtol` of that leaf's largest update, plus the float32 rounding of adding an
    update to a parameter (a unit in the last place of the leaf's largest value: an update
    a rounding apart may round the sum the other way)."""
    want = eqx.apply_updates(before, updates)
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(got, eqx.is_array))[0]
    for (path, x), y, u in zip(flat, jax.tree.leaves(eqx.filter(want, eqx.is_array)), jax.tree.leaves(updates), strict=True):
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
