"""Packed batches under every plan: two train steps on documents packed into
rows give, at each step, the loss and gradients of the same documents run one per
row, padded (padding weight 0), on one device (rtol 1e-5, scaled to each leaf).
The mean is over the weighted tokens of the whole batch, however the plan splits
it: data-parallel shards, FSDP (manual and automatic), accumulation
micro-batches, tensor + sequence parallelism, context parallelism (ring,
all-gather, Ulysses), experts and every pipeline schedule; and evaluation too."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, gpt_first, gpt_last, gpt_stack_kwargs, lm_loss
from eqxpar.pipeline import PipelineLoss, stage_rules

from ._helpers import (
    PACKED_CONFIGS,
    RecordedGradients,
    assert_steps_match_one_device,
    assert_trees_close,
    packed_batch,
    packed_documents,
    padded_batch,
    record_gradients,
    recorded_gradients,
)

#: Packed rows per step (two documents each): 32 padded rows on one device.
ROWS = 16

MOE = dataclasses.replace(
    PACKED_CONFIGS["rotary"], moe_every=2, experts=4, top_k=2, load_balance_coef=0, router_z_coef=0
)
# Four layers: two stages of two chunks (interleaved, V).
DEEP = dataclasses.replace(PACKED_CONFIGS["rotary"], num_layers=4)

PIPELINE_LOSS = PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last, stack_kwargs=gpt_stack_kwargs)


def _pipeline(schedule: str, **kwargs) -> eqxpar.Plan:
    mesh = eqxpar.make_mesh(pipe=2, data=2)
    return eqxpar.Plan(mesh, rules=stage_rules(None), schedule=schedule, microbatches=4, **kwargs)


#: name -> (plan, model config, accumulate).
PLANS = {
    "data8-manual": (lambda: eqxpar.Plan(eqxpar.make_mesh(data=8), mode="manual"), "rotary", 1),
    "fsdp8-manual-accumulate2": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), mode="manual"),
        "rotary",
        2,
    ),
    "fsdp8-auto-accumulate2": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), mode="auto"),
        "learned-positions",
        2,
    ),
    "data4-tensor2-sp-manual": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=4, tensor=2),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
        ),
        "rotary-blockwise",
        1,
    ),
    "data4-tensor2-sp-auto-accumulate2": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=4, tensor=2),
            rules=eqxpar.rules.MEGATRON,
            mode="auto",
            sequence_parallel=True,
        ),
        "rotary",
        2,
    ),
    "context4-ring-manual": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(context=4, data=2), mode="manual"),
        "rotary",
        1,
    ),
    "context4-ring-auto-learned-positions": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(context=4, data=2)),
        "learned-positions",
        2,
    ),
    "context4-allgather": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(context=4, data=2), mode="manual", context_attention="allgather"
        ),
        "rotary-blockwise",
        1,
    ),
    "context2-ulysses": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="ulysses"),
        "rotary",
        2,
    ),
    "expert4-data2-moe": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
        "moe",
        2,
    ),
    "gpipe": (lambda: _pipeline("gpipe"), "rotary", 1),
    "1f1b": (lambda: _pipeline("1f1b"), "learned-positions", 1),
    "interleaved": (lambda: _pipeline("interleaved", chunks=2), "deep", 1),
    "zero_bubble": (lambda: _pipeline("zero_bubble"), "rotary", 1),
    "zb_v": (lambda: _pipeline("zb_v"), "deep", 1),
}
MODELS = {**PACKED_CONFIGS, "moe": MOE, "deep": DEEP}


def packed_loss(model, batch):
    return lm_loss(model, batch)


def padded_reference(model, batches):
    # One device, the documents one per row: the batch's second half.
    return lm_loss(model, batches[1]).value()


def steps(seed: int) -> list[tuple[dict, dict]]:
    out = []
    for i in range(2):
        docs = packed_documents(seed + i, ROWS)
        out.append((packed_batch(docs), padded_batch(docs)))
    return out


@pytest.mark.parametrize("name", PLANS)
def test_packed_steps_equal_padded_one_device(name):
    make_plan, config, accumulate = PLANS[name]
    plan = make_plan()
    model = GPT(MODELS[config], key=jax.random.key(0))
    loss = PIPELINE_LOSS if plan.schedule is not None else packed_loss
    optimizer = optax.sgd(0.5)
    recording = record_gradients(optimizer)
    state = eqxpar.train.init(model, recording, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss, recording, plan, accumulate=accumulate)

    def advance(batches):
        nonlocal state
        state, metrics = step(state, batches[0])
        grads = eqxpar.nn.in_natural_order(recorded_gradients(state.opt_state))
        return eqxpar.nn.in_natural_order(state.model), (RecordedGradients(grads),), metrics["loss"]

    losses = assert_steps_match_one_device(advance, model, optimizer, padded_reference, steps(len(name)))
    assert all(np.isfinite(losses))


@pytest.mark.parametrize("name", ["data8-manual", "context4-ring-manual", "gpipe", "data4-tensor2-sp-manual"])
def test_packed_evaluation_equals_padded(name):
    # A batch of 11 packed rows: the plan's part runs whole, the rest repeated,
    # and the sums (not the parts' means) make the loss.
    make_plan, config, _ = PLANS[name]
    plan = make_plan()
    model = GPT(MODELS[config], key=jax.random.key(0))
    docs = packed_documents(7, 11)
    loss = PIPELINE_LOSS if plan.schedule is not None else packed_loss
    got = eqxpar.train.make_eval_step(loss, plan)(model, packed_batch(docs))
    want = lm_loss(model, padded_batch(docs))
    assert_trees_close((got["loss"], got["weight"]), (want.value(), want.weight))
    # evaluate() weighs the batches by their weight, not their rows.
    halves = [packed_batch(docs[:3]), packed_batch(docs[3:])]
    mean = eqxpar.train.evaluate(
        eqxpar.train.make_eval_step(packed_loss, eqxpar.Plan(eqxpar.make_mesh(data=1))), model, halves
    )
    assert_trees_close(mean["loss"], want.value())


def test_unweighted_step_is_unchanged_bit_for_bit():
    # Tokens alone take the scalar-mean path: the lowered step is the same
    # program as a loss that cannot return a weighted mean.
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), mode="manual")
    model = GPT(PACKED_CONFIGS["rotary"], key=jax.random.key(0))
    tokens = jnp.asarray(packed_batch(packed_documents(0, 8))["tokens"])
    plain = eqxpar.train.make_value_and_grad(lambda m, t: lm_loss(m, t), plan)
    mapped = eqxpar.train.make_value_and_grad(lambda m, t: lm_loss(m, {"tokens": t}), plan)
    a, b = plain(model, tokens), mapped(model, tokens)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    weighted = eqxpar.train.make_value_and_grad(lambda m, t: lm_loss(m, t, weights=jnp.ones(t.shape)), plan)
    c = weighted(model, tokens)
    assert_trees_close(c, a)


def test_all_zero_weights_in_a_step_give_nan_not_a_silent_number():
    # Under jit the weights are traced, so a batch that counts no token cannot be
    # refused eagerly: its loss is 0 / 0, which the step reports (and
    # skip_nonfinite skips) rather than a made-up number.
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), mode="manual")
    model = GPT(PACKED_CONFIGS["rotary"], key=jax.random.key(0))
    batch = packed_batch(packed_documents(0, 8))
    batch["weights"] = jnp.zeros_like(batch["weights"])
    state = eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(packed_loss, optax.sgd(0.1), plan, skip_nonfinite=True)
    new, metrics = step(state, batch)
    assert bool(metrics["skipped"]) and np.isnan(float(metrics["loss"]))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_weighted_mean_adds_only_scalars_to_the_communication(accumulate):
    # Manual FSDP: the packed step reduce-scatters the same gradient bytes as
    # the unpacked one, once (not per micro-batch); the weighted mean adds the
    # sums of two scalars (total, weight) over the batch axes, nothing per token.
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), mode="manual")
    model = GPT(PACKED_CONFIGS["rotary"], key=jax.random.key(0))
    batch = packed_batch(packed_documents(0, 16))
    stats = {}
    for name, data in (("plain", batch["tokens"]), ("packed", batch)):
        vg = eqxpar.train.make_value_and_grad(packed_loss, plan, accumulate=accumulate)
        stats[name] = eqxpar.inspect.collective_stats(vg.lower(model, data).compile())
    plain, packed = stats["plain"], stats["packed"]
    for kind in ("all-gather", "reduce-scatter"):
        assert packed.bytes.get(kind, 0) == plain.bytes.get(kind, 0), kind
        assert packed.in_loops.get(kind, 0) == plain.in_loops.get(kind, 0), kind
    extra = packed.bytes.get("all-reduce", 0) - plain.bytes.get("all-reduce", 0)
    assert 0 <= extra <= 2 * 4, (packed.bytes, plain.bytes)
