"""Evaluation: `make_eval_step` and `evaluate` under every kind of plan give the
one-device loss of exactly the batch's rows, pipelines running forwards only."""

import functools

import equinox as eqx
import jax
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss

from ._helpers import assert_trees_close

CONFIG = dict(vocab_size=64, d_model=32, num_heads=4, num_layers=4, d_hidden=64, max_seq_len=16)
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)


def _tokens(seed: int, batch: int) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, 9), 0, CONFIG["vocab_size"])


def _pipeline(schedule: str, chunks: int = 1, microbatches: int = 2) -> eqxpar.Plan:
    return eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=4),
        rules=eqxpar.pipeline.stage_rules(None),
        schedule=schedule,
        microbatches=microbatches,
        chunks=chunks,
    )


PLANS = {
    "data-auto": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)),
    "fsdp-manual": lambda: eqxpar.Plan(
        eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual"
    ),
    "tensor-sp-manual": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    ),
    "context-allgather": lambda: eqxpar.Plan(
        eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="allgather"
    ),
    "expert": lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
    "pipeline-1f1b": lambda: _pipeline("1f1b"),
    "pipeline-interleaved": lambda: _pipeline("interleaved", chunks=2),
    "pipeline-zb_v": lambda: _pipeline("zb_v"),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_eval_loss_is_the_one_device_loss_of_every_row(name):
    plan = PLANS[name]()
    moe = (
        dict(moe_every=2, experts=4, load_balance_coef=0.0, router_z_coef=0.0) if plan.expert_size > 1 else {}
    )
    model = GPT(GPTConfig(**CONFIG, **moe), key=jax.random.key(0))
    loss_fn = PIPELINE_LOSS if plan.schedule is not None else lm_loss
    eval_step = eqxpar.train.make_eval_step(loss_fn, plan)
    one_device = jax.jit(lm_loss)
    # A batch the plan does not divide (13 rows: the rows left over run repeated
    # over the devices; none is cut).
    tokens = _tokens(13, 13)
    metrics = eval_step(model, tokens)
    assert metrics["rows"] == 13
    assert_trees_close(float(metrics["loss"]), float(one_device(model, tokens)))


def test_a_pipeline_evaluates_with_its_forward_actions_only():
    base = eqxpar.pipeline.schedule("zb_v", stages=2, microbatches=4)
    forward = eqxpar.pipeline.forward_only(base)
    kinds = forward.table[..., 2]
    assert set(np.unique(kinds)) <= {0, 1}
    assert int((kinds == 1).sum()) == 2 * 4 * 2  # every (stage, micro-batch) once
    assert forward.placement == "v" and forward.ticks < base.ticks
    # The compiled evaluation runs about a third of the training step's matmuls.
    plan = _pipeline("1f1b")
    model = GPT(GPTConfig(**CONFIG), key=jax.random.key(0))
    tokens = _tokens(0, 16)
    optim = optax.sgd(1e-2)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(PIPELINE_LOSS, optim, plan, donate=False)
    eval_step = eqxpar.train.make_eval_step(PIPELINE_LOSS, plan)
    evaluated = eval_step._compiled.lower(state.model, tokens, jax.random.key(0)).compile()
    ratio = eqxpar.inspect.matmul_flops(evaluated) / eqxpar.inspect.matmul_flops(step.compile(state, tokens))
    assert ratio < 0.45, ratio
    # The one-device loss of the batch; no donation: the state is intact after it.
    metrics = eval_step(state, tokens)
    assert metrics["rows"] == 16
    assert_trees_close(float(metrics["loss"]), float(jax.jit(lm_loss)(model, tokens)))
    assert all(not x.is_deleted() for x in jax.tree.leaves(eqx.filter(state.model, eqx.is_array)))


def test_evaluate_means_over_a_dataset_and_refuses_what_it_cannot_run():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    model = GPT(GPTConfig(**CONFIG), key=jax.random.key(0))
    data = _tokens(3, 37)
    batches = [data[i : i + 16] for i in range(0, 37, 16)]  # 16, 16, 5 rows
    eval_step = eqxpar.train.make_eval_step(lm_loss, plan)
    out = eqxpar.train.evaluate(eval_step, model, batches)
    assert (out["rows"], out["batches"]) == (37, 3)
    # Every row counted once: the one-device loss of all 37.
    assert_trees_close(float(out["loss"]), float(jax.jit(lm_loss)(model, data)))
    with pytest.raises(eqxpar.BatchError, match="no batch"):
        eqxpar.train.evaluate(eval_step, model, [])
    with pytest.raises(eqxpar.PlanError, match="PipelineLoss"):
        eqxpar.train.make_eval_step(lm_loss, _pipeline("1f1b"))


PER_ROW_LOSS = functools.partial(lm_loss, per_row=True)


@pytest.mark.parametrize("name", [n for n in sorted(PLANS) if not n.startswith("pipeline")])
def test_per_row_evaluation_pads_with_a_mask_to_the_one_device_loss(name):
    # 13 rows on 8 (or 4, 2) data-parallel devices: padded to 16 with copies of the
    # first row, which the mask leaves out. Exact for any per-row loss; here the
    # rows are weighted unequally too (a per-row loss need not be a mean over rows).
    plan = PLANS[name]()
    # MoE's auxiliary losses are batch statistics, which padding rows take part in
    # (as repeated rows do): left out, as in the test above.
    moe = (
        dict(moe_every=2, experts=4, load_balance_coef=0.0, router_z_coef=0.0) if plan.expert_size > 1 else {}
    )
    model = GPT(GPTConfig(**CONFIG, **moe), key=jax.random.key(0))
    tokens = _tokens(5, 13)
    one_device = jax.jit(PER_ROW_LOSS)(model, tokens)
    assert one_device.shape == (13,)
    eval_step = eqxpar.train.make_eval_step(PER_ROW_LOSS, plan, per_row=True)
    metrics = eval_step(model, tokens)
    assert metrics["rows"] == 13
    assert_trees_close(float(metrics["loss"]), float(np.mean(np.asarray(one_device))))
    # A dense model's per-row mean is lm_loss's mean over the batch's tokens.
    if not moe:
        assert_trees_close(float(metrics["loss"]), float(jax.jit(lm_loss)(model, tokens)))

    def weighted(model, tokens):  # rows weighted by their first token: no mean over rows
        return PER_ROW_LOSS(model, tokens) * (1.0 + tokens[:, 0] % 3)

    got = eqxpar.train.make_eval_step(weighted, plan, per_row=True)(model, tokens)["loss"]
    assert_trees_close(float(got), float(np.mean(np.asarray(jax.jit(weighted)(model, tokens)))))


def test_per_row_evaluation_refuses_what_it_cannot_mask():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    model = GPT(GPTConfig(**CONFIG), key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match=r"expected one loss per row, shape \(16,\)"):
        eqxpar.train.make_eval_step(lm_loss, plan, per_row=True)(model, _tokens(0, 16))
    with pytest.raises(eqxpar.PlanError, match="per_row=True, has_aux=True"):
        eqxpar.train.make_eval_step(PER_ROW_LOSS, plan, per_row=True, has_aux=True)
    with pytest.raises(eqxpar.PlanError, match="per_row=True\\) under a pipeline plan.*per_row=False"):
        eqxpar.train.make_eval_step(PIPELINE_LOSS, _pipeline("1f1b"), per_row=True)
    with pytest.raises(eqxpar.PlanError, match="per_row='yes'"):
        eqxpar.train.make_eval_step(PER_ROW_LOSS, plan, per_row="yes")
    with pytest.raises(eqxpar.PlanError, match="lm_loss\\(per_row=1\\)"):
        lm_loss(model, _tokens(0, 2), per_row=1)


def test_evaluation_drops_nothing_unless_given_a_key():
    # A LoRA model with adapter dropout: evaluated without a key it is the model
    # with no dropout (the loss gets key=None), under one device and a manual plan.
    model = GPT(GPTConfig(**CONFIG), key=jax.random.key(0))
    adapted = eqxpar.models.add_lora(model, rank=2, dropout=0.5, key=jax.random.key(1))
    # Nonzero B, so that the adapters (and their dropout) change the output.
    adapted = jax.tree_util.tree_map_with_path(
        lambda path, x: x + 0.05 if jax.tree_util.keystr(path).endswith("_b") else x, adapted
    )
    tokens = _tokens(2, 16)
    deterministic = float(jax.jit(lm_loss)(adapted, tokens))
    dropped = float(jax.jit(lm_loss)(adapted, tokens, key=jax.random.key(3)))
    assert dropped != deterministic
    for plan in (
        eqxpar.Plan(eqxpar.make_mesh(data=8)),
        eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual"),
    ):
        eval_step = eqxpar.train.make_eval_step(lm_loss, plan)
        assert_trees_close(float(eval_step(adapted, tokens)["loss"]), deterministic)
        assert float(eval_step(adapted, tokens, key=jax.random.key(3))["loss"]) != deterministic
