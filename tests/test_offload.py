"""Host offload (`Plan(offload=...)`): optimizer state, parameters and named
activations in host memory, under every plan family, bit for bit the plain step."""

import dataclasses
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar import nn
from eqxpar.pipeline import PipelineLoss, stage_rules

from ._helpers import StackedLM, stacked_lm_batches

QKV = ("query_proj", "key_proj", "value_proj")


def _lm_loss(model, batch):
    # Right in every layout, sequence parallelism included.
    ids, targets = batch
    return nn.sequence_mean(nn.cross_entropy(model(ids), targets, head=model.head))


PIPELINE_LOSS = PipelineLoss(
    first=lambda m, batch: m.embed(batch[0]),
    stack=lambda m: m.blocks,
    last=lambda m, h, batch: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(m.head(m.norm(h)), batch[1])),
)


def _plan(family: str, **options) -> eqxpar.Plan:
    if family == "data":
        return eqxpar.Plan(eqxpar.make_mesh(data=8), **options)
    if family == "fsdp-auto":
        return eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), **options)
    if family == "fsdp-manual":
        return eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), mode="manual", **options)
    if family == "tensor-sp":
        mesh = eqxpar.make_mesh(data=2, tensor=4)
        return eqxpar.Plan(mesh, rules=eqxpar.rules.MEGATRON, sequence_parallel=True, mode="manual", **options)
    if family == "pipeline":
        mesh = eqxpar.make_mesh(pipe=2, data=4)
        return eqxpar.Plan(mesh, rules=stage_rules(), schedule="1f1b", microbatches=2, **options)
    raise AssertionError(family)


FAMILIES = ("data", "fsdp-auto", "fsdp-manual", "tensor-sp", "pipeline")


def _train(plan: eqxpar.Plan, steps: int = 3):
    model = StackedLM(key=jax.random.key(0), depth=2)
    optimizer = optax.adamw(1e-2)
    loss = PIPELINE_LOSS if plan.schedule is not None else _lm_loss
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(loss, optimizer, plan)
    losses = []
    for batch in stacked_lm_batches(steps):
        state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return losses, state


def _memory_kinds(tree) -> set:
    return {x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_offloaded_step_is_the_plain_one_bit_for_bit(family):
    # The optimizer state and the parameters live in host memory between steps;
    # the step moves them to the device and back inside the program. Nothing
    # else changes, so every loss and every array is the plain step's exactly.
    plain_losses, plain = _train(_plan(family))
    losses, state = _train(_plan(family, offload=("optimizer", "params")))
    assert _memory_kinds(state.opt_state) == {"pinned_host"}
    assert _memory_kinds(state.model) == {"pinned_host"}
    assert _memory_kinds(plain.opt_state) == {"device"}
    np.testing.assert_array_equal(np.stack(losses), np.stack(plain_losses))
    for a, b in zip(jax.tree.leaves((state.model, state.opt_state)), jax.tree.leaves((plain.model, plain.opt_state)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
