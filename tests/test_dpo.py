"""Preference tuning (eqxpar.models.dpo_loss): the loss, rewards and adapter
gradients equal TRL's DPOTrainer on a tiny Llama with a PEFT adapter (references
made by tests/data/dpo/make_reference.py), the reference costs no second copy
(LoRA: the same weights with adapters off; otherwise a frozen model with no
gradient and no optimizer state), pairs stay whole under every split, a DPO step
equals one device under every plan family, and misuse raises eqxpar errors."""

import dataclasses
import functools
import json
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import (
    GPT,
    GPTConfig,
    PolicyWithReference,
    add_lora,
    dpo_loss,
    lora_trainable,
    preference_losses,
    save_lora,
    sequence_logprobs,
    without_lora,
)

from ._helpers import (
    assert_params_close,
    assert_trees_close,
    lora_reference_model,
    record_gradients,
    recorded_gradients,
    with_drawn_b,
)

safetensors_numpy = pytest.importorskip("safetensors.numpy")

REFERENCE = np.load(pathlib.Path(__file__).parent / "data" / "dpo" / "reference.npz")
BETA = 0.1  # what make_reference.py ran TRL with
LOSS_TYPES = ("sigmoid", "ipo", "hinge")


def _trl_batch() -> dict:
    r = REFERENCE
    # The weights are TRL's completion masks as they are (aligned with the tokens).
    return {
        "chosen": jnp.asarray(r["chosen"], jnp.int32),
        "rejected": jnp.asarray(r["rejected"], jnp.int32),
        "chosen_weights": jnp.asarray(r["chosen_mask"], jnp.float32),
        "rejected_weights": jnp.asarray(r["rejected_mask"], jnp.float32),
    }


def _scaled(a, b, rel=1e-4):
    """`a` close to `b` within `rel` of `b`'s largest entry (float32 sums of other
    orders, torch's and XLA's)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_allclose(a, b, rtol=rel, atol=rel * max(float(np.max(np.abs(b))), 1e-3))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_rewards_and_adapter_gradients_equal_trl(loss_type, tmp_path):
    model = lora_reference_model("llama")
    batch = _trl_batch()
    loss_fn = functools.partial(dpo_loss, beta=BETA, loss_type=loss_type, metrics=True)
    adapters, frozen = eqx.partition(model, lora_trainable(model))
    (loss, metrics), grads = eqx.filter_jit(
        eqx.filter_value_and_grad(lambda a: loss_fn(eqx.combine(a, frozen), batch), has_aux=True)
    )(adapters)
    _scaled(loss, REFERENCE[f"{loss_type}/loss"], rel=2e-5)
    for ours, trl in (
        ("rewards_chosen", "rewards_chosen_mean"),
        ("rewards_rejected", "rewards_rejected_mean"),
        ("reward_margin", "reward_margin"),
        ("reward_accuracy", "reward_accuracy"),
    ):
        _scaled(metrics[ours], REFERENCE[f"{loss_type}/{trl}"])
    # The gradients in PEFT's names and layout: save_lora writes a model whose
    # adapters are the gradients (the mapping is reshapes and transposes, linear).
    save_lora(eqx.combine(grads, frozen), tmp_path)
    ours = safetensors_numpy.load_file(str(tmp_path / "adapter_model.safetensors"))
    prefix = f"{loss_type}/grad/"
    theirs = {k[len(prefix) :]: REFERENCE[k] for k in REFERENCE.files if k.startswith(prefix)}
    assert sorted(ours) == sorted(theirs)
    for name, g in theirs.items():
        _scaled(ours[name], g, rel=2e-4)


def test_sequence_logprobs_and_preference_losses_equal_trl():
    model = lora_reference_model("llama")
    batch = _trl_batch()
    seq = eqx.filter_jit(sequence_logprobs)
    r = REFERENCE
    for which in ("chosen", "rejected"):
        _scaled(seq(model, batch[which], batch[f"{which}_weights"]), r[f"logps/policy_{which}"], rel=1e-5)
        base = without_lora(model)
        _scaled(seq(base, batch[which], batch[f"{which}_weights"]), r[f"logps/reference_{which}"], rel=1e-5)
    logps = [jnp.asarray(r[f"logps/{k}"]) for k in ("policy_chosen", "policy_rejected")]
    refs = [jnp.asarray(r[f"logps/{k}"]) for k in ("reference_chosen", "reference_rejected")]
    for loss_type in ("sigmoid", "hinge"):  # IPO takes per-token means: through dpo_loss above
        losses = preference_losses(*logps, *refs, beta=BETA, loss_type=loss_type)
        _scaled(jnp.mean(losses), r[f"{loss_type}/loss"], rel=1e-5)


def test_without_lora_is_the_base_model_and_copies_no_weight():
    model = lora_reference_model("llama")
    base = eqxpar.models.from_pretrained(pathlib.Path(__file__).parent / "data" / "pretrained" / "llama")
    tokens = jnp.asarray(REFERENCE["chosen"], jnp.int32)
    off = without_lora(model)
    assert_trees_close(off(tokens), base(tokens))
    # The same arrays: every weight of the reference is the adapted model's object.
    ids = {id(x) for x in jax.tree.leaves(model)}
    assert all(id(x) in ids for x in jax.tree.leaves(off))
    with pytest.raises(eqxpar.PlanError, match="no adapters to switch off"):
        without_lora(off)


# --- Under plans --------------------------------------------------------------------

CONFIG = GPTConfig(
    vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=128, max_seq_len=16
)
ALL = ("q", "k", "v", "o", "gate", "up", "down")
PAIRS, SEQ = 8, 8
OPTIM = optax.adam(1e-2, eps=1e-3)  # eps well above float32 noise in the adapters' updates


def pair_batch(seed: int, *, pairs: int = PAIRS, seq: int = SEQ, vocab: int = CONFIG.vocab_size) -> dict:
    """Pairs with a shared prompt of 1-3 tokens and completions of different lengths,
    right-padded: `dpo_loss`'s batch format."""
    rng = np.random.default_rng(seed)
    out = {}
    prompt = rng.integers(1, 4, pairs)
    for name in ("chosen", "rejected"):
        tokens = rng.integers(0, vocab, (pairs, seq + 1))
        tokens[:, :3] = np.arange(3)[None] + seed  # the prompt (its first 1-3 tokens count)
        ends = rng.integers(prompt + 2, seq + 2)
        positions = np.arange(seq + 1)[None]
        weights = (positions >= prompt[:, None]) & (positions < ends[:, None])
        out[name] = jnp.asarray(tokens, jnp.int32)
        out[f"{name}_weights"] = jnp.asarray(weights, jnp.float32)
    return out


def _lora_model(config=CONFIG, targets=ALL):
    base = GPT(config, key=jax.random.key(0))
    return with_drawn_b(
        add_lora(base, rank=2, alpha=4, targets=targets, key=jax.random.key(1)),
        key=jax.random.key(2),
        scale=0.2,
    )


LOSS = functools.partial(dpo_loss, beta=0.5)


@eqx.filter_jit
def _one_device_step(adapters, frozen, opt_state, batch):
    loss, grads = eqx.filter_value_and_grad(lambda a: LOSS(eqx.combine(a, frozen), batch))(adapters)
    updates, opt_state = OPTIM.update(grads, opt_state, adapters)
    return eqx.apply_updates(adapters, updates), opt_state, loss


PLANS = {
    "data": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)),
    "fsdp": lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0)),
    "fsdp-manual": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0), mode="manual"
    ),
    "tp-auto": lambda: eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON),
    "tp-manual-sp": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    ),
    # The vocabulary whole: each device scores its own sequence block, summed over tensor.
    "tp-manual-sp-whole-vocab": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2),
        rules=eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"}),
        mode="manual",
        sequence_parallel=True,
    ),
    "context": lambda: eqxpar.Plan(
        eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="allgather"
    ),
    "context-tp": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=2, context=2, tensor=2), rules=eqxpar.rules.MEGATRON
    ),
    "expert": lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
    "zero1-accumulate": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, zero1=True
    ),
}
ACCUMULATE = {"zero1-accumulate": 2}


@pytest.mark.parametrize("name", list(PLANS))
def test_dpo_step_with_the_lora_reference_equals_one_device(name):
    plan = PLANS[name]()
    if plan.expert_size > 1:  # an MoE GPT: adapters on the attention
        config, targets = (
            dataclasses.replace(CONFIG, moe_every=2, experts=4, num_shared_experts=1),
            ("q", "v"),
        )
    else:
        config, targets = CONFIG, ALL
    model = _lora_model(config, targets)
    trainable = lora_trainable(model)
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(LOSS, OPTIM, plan, trainable=trainable, accumulate=ACCUMULATE.get(name, 1))
    adapters, frozen = eqx.partition(model, trainable)
    ref, ref_state = adapters, OPTIM.init(adapters)
    for i in range(2):
        batch = pair_batch(i)
        state, metrics = step(state, batch)
        ref, ref_state, ref_loss = _one_device_step(ref, frozen, ref_state, batch)
        assert_trees_close(float(metrics["loss"]), float(ref_loss), err_msg=f"loss at step {i}")
    got_adapters, got_frozen = eqx.partition(state.model, trainable)
    assert_params_close(got_adapters, ref)
    for a, b in zip(jax.tree.leaves(got_frozen), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_frozen_reference_model_gets_no_gradient_no_optimizer_state_and_equals_one_device():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0))
    policy = GPT(CONFIG, key=jax.random.key(0))
    reference = GPT(CONFIG, key=jax.random.key(3))  # another model, so the reference matters
    pair = PolicyWithReference(policy=policy, reference=reference)
    trainable = PolicyWithReference.frozen_reference()
    optim = optax.adam(1e-3)
    state = eqxpar.train.init(pair, optim, plan, key=jax.random.key(0), trainable=trainable)
    # Optimizer state for the policy alone: Adam's two moments of each policy leaf.
    n_policy = len(jax.tree.leaves(eqx.filter(policy, eqx.is_inexact_array)))
    n_state = len([x for x in jax.tree.leaves(state.opt_state) if eqx.is_array(x) and x.ndim > 0])
    assert n_state == 2 * n_policy, (n_state, n_policy)
    # The reference sharded as the policy is.
    pol = jax.tree.leaves(state.model.policy)
    ref_leaves = jax.tree.leaves(state.model.reference)
    assert [x.sharding for x in pol] == [x.sharding for x in ref_leaves]
    # Gradients recorded: compared elementwise (Adam amplifies their rounding).
    recording = record_gradients(optim)
    state = eqxpar.train.init(pair, recording, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(LOSS, recording, plan, trainable=trainable)

    @eqx.filter_jit
    def one_device(p, batch):
        return eqx.filter_value_and_grad(lambda p: LOSS(PolicyWithReference(p, reference), batch))(p)

    for i in range(2):
        batch = pair_batch(10 + i)
        start = jax.tree.map(lambda x: np.asarray(x) if eqx.is_array(x) else x, state.model.policy)
        state, metrics = step(state, batch)
        ref_loss, ref_grads = one_device(start, batch)
        assert_trees_close(float(metrics["loss"]), float(ref_loss), err_msg=f"loss at step {i}")
        grads = recorded_gradients(state.opt_state)
        assert jax.tree.leaves(grads.reference) == []  # no gradient for the reference
        assert_trees_close(grads.policy, ref_grads, err_msg=f"gradients at step {i}")
    for a, b in zip(jax.tree.leaves(state.model.reference), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_precomputed_reference_logprobs_give_the_same_loss():
    model = _lora_model()
    batch = pair_batch(0)
    base = without_lora(model)
    seq, loss = eqx.filter_jit(sequence_logprobs), eqx.filter_jit(LOSS)
    with_ref = dict(
        batch,
        reference_chosen=seq(base, batch["chosen"], batch["chosen_weights"]),
        reference_rejected=seq(base, batch["rejected"], batch["rejected_weights"]),
    )
    assert_trees_close(loss(model, with_ref), loss(model, batch))
    # Without them, a model without adapters has no reference.
    with pytest.raises(eqxpar.PlanError, match="no reference"):
        LOSS(base, batch)


# --- Pairs stay whole; misuse -----------------------------------------------------


def test_every_split_keeps_pairs_whole():
    """The step's splits (data-parallel shards, accumulate= micro-batches) cut the
    leading dimension of every leaf alike: each micro-batch of each shard holds
    whole pairs, the chosen and rejected rows of the same pair indices."""
    from eqxpar._train._grad_common import split_microbatches

    batch = pair_batch(0)
    # Tag each row with its pair index in the first token of both completions.
    tags = jnp.arange(PAIRS, dtype=jnp.int32)
    batch = dict(
        batch, chosen=batch["chosen"].at[:, 0].set(tags), rejected=batch["rejected"].at[:, 0].set(tags)
    )
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON)
    sharded = eqxpar.shard_batch(batch, plan)
    for micro in (1, 2):
        parts = split_microbatches(sharded, micro)
        for j in range(micro):
            c, r = parts["chosen"][j], parts["rejected"][j]
            for shard_c, shard_r in zip(c.addressable_shards, r.addressable_shards, strict=True):
                assert shard_c.index == shard_r.index
                np.testing.assert_array_equal(np.asarray(shard_c.data)[:, 0], np.asarray(shard_r.data)[:, 0])


def test_a_batch_that_would_split_pairs_is_refused():
    model = _lora_model()
    batch = pair_batch(0)
    stacked = jnp.concatenate([batch["chosen"], batch["rejected"]])
    with pytest.raises(eqxpar.BatchError, match="cut apart"):
        dpo_loss(model, stacked)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=lora_trainable(model))
    step = eqxpar.train.make_step(LOSS, OPTIM, plan, trainable=lora_trainable(model))
    with pytest.raises(eqxpar.BatchError, match="cut apart"):
        step(state, stacked)
    # Chosen and rejected of different pair counts (or lengths) are not pairs.
    with pytest.raises(eqxpar.BatchError, match="expected one shape"):
        dpo_loss(model, dict(batch, rejected=batch["rejected"][:4]))
    with pytest.raises(eqxpar.BatchError, match="expected one shape"):
        dpo_loss(model, dict(batch, rejected=batch["rejected"][:, :-1]))


@pytest.mark.parametrize(
    "change, kwargs, error, match",
    [
        (lambda b: {k: v for k, v in b.items() if k != "rejected_weights"}, {}, eqxpar.BatchError, "missing"),
        (lambda b: dict(b, extra=b["chosen"]), {}, eqxpar.BatchError, "unknown"),
        (lambda b: dict(b, chosen_weights=b["chosen_weights"][:, :-1]), {}, eqxpar.BatchError, "the tokens'"),
        (lambda b: dict(b, reference_chosen=jnp.zeros(PAIRS)), {}, eqxpar.BatchError, "without its partner"),
        (lambda b: dict(b, chosen=b["chosen"].astype(jnp.float32)), {}, eqxpar.BatchError, "integer"),
        (lambda b: b, {"beta": 0.0}, eqxpar.PlanError, "positive"),
        (lambda b: b, {"loss_type": "kto"}, eqxpar.PlanError, "expected one of"),
    ],
    ids=["missing", "unknown", "weights", "half-reference", "float-tokens", "beta", "loss-type"],
)
def test_bad_batches_and_options_name_the_fix(change, kwargs, error, match):
    with pytest.raises(error, match=match):
        dpo_loss(_lora_model(), change(pair_batch(0)), **kwargs)


def test_a_model_without_a_reference_is_refused():
    with pytest.raises(eqxpar.PlanError, match="no reference"):
        dpo_loss(GPT(CONFIG, key=jax.random.key(0)), pair_batch(0))


def _with_reference(model, batch):
    base = without_lora(model)
    seq = eqx.filter_jit(sequence_logprobs)
    return dict(
        batch,
        reference_chosen=seq(base, batch["chosen"], batch["chosen_weights"]),
        reference_rejected=seq(base, batch["rejected"], batch["rejected_weights"]),
    )


@pytest.mark.parametrize("schedule, chunks", [("1f1b", 1), ("interleaved", 2)])
def test_dpo_pipeline_step_with_precomputed_reference_equals_one_device(schedule, chunks):
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=4),
        rules=eqxpar.pipeline.stage_rules(None),
        schedule=schedule,
        microbatches=2,
        chunks=chunks,
    )
    model = _lora_model(dataclasses.replace(CONFIG, num_layers=4))
    trainable = lora_trainable(model)
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=trainable)
    loss_fn = eqxpar.models.dpo_pipeline_loss(beta=0.5)
    step = eqxpar.train.make_step(loss_fn, OPTIM, plan, trainable=trainable)
    adapters, frozen = eqx.partition(model, trainable)
    ref, ref_state = adapters, OPTIM.init(adapters)
    for i in range(2):
        batch = _with_reference(model, pair_batch(20 + i))
        state, metrics = step(state, batch)
        ref, ref_state, ref_loss = _one_device_step(ref, frozen, ref_state, batch)
        assert_trees_close(float(metrics["loss"]), float(ref_loss), err_msg=f"loss at step {i}")
    got_adapters, _ = eqx.partition(eqxpar.nn.in_natural_order(state.model), trainable)
    assert_params_close(got_adapters, ref)
    # Without reference log-probs in the batch the pipeline loss names the fix.
    with pytest.raises(eqxpar.PlanError, match="compute the reference log-probs beforehand"):
        step(state, pair_batch(0))


def test_dpo_step_memory_and_collectives_are_the_lora_steps_on_the_same_rows():
    """The contract benchmarks/dpo.py records at the workload's size (`dpo` in
    benchmarks/results/quick.json), here on a small model: the compiled DPO step
    with the LoRA reference against the LoRA `lm_loss` step on the same rows, at
    most 1.05x the memory; and, under data parallelism, no collective the LoRA step
    has not (the pairs' rows are laid out without moving data; the reference's
    forward needs none), of at most its bytes."""
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    model = _lora_model()
    trainable = lora_trainable(model)
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=trainable)
    batch = pair_batch(0, pairs=16, seq=CONFIG.max_seq_len - 1)
    rows = _pairs_as_rows_for_test(batch)

    def compiled(loss_fn, data):
        step = eqxpar.train.make_step(loss_fn, OPTIM, plan, trainable=trainable, donate=False)
        return step.compile(state, data)

    lora, dpo = compiled(eqxpar.models.lm_loss, rows), compiled(LOSS, batch)
    total = lambda c: c.memory_analysis().argument_size_in_bytes + c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert total(dpo) <= 1.05 * total(lora), (total(dpo), total(lora))
    stats = [eqxpar.inspect.collective_stats(c) for c in (lora, dpo)]
    new = {kind for kind, n in stats[1].count.items() if n and not stats[0].count[kind]}
    assert not new, stats
    # The same gradient all-reduce; the DPO step's metrics add a few scalars.
    assert stats[1].total_wire_bytes <= stats[0].total_wire_bytes + 64, stats
    quick = pathlib.Path(__file__).parents[1] / "benchmarks" / "results" / "quick.json"
    record = json.loads(quick.read_text())
    for name, r in record["dpo"]["plans"].items():
        assert r["ratios"]["mem_total_bytes"] <= record["dpo"]["limit"] == 1.05, name


def _pairs_as_rows_for_test(batch):
    return jnp.stack([batch["chosen"], batch["rejected"]], axis=1).reshape(-1, batch["chosen"].shape[1])
