"""Ulysses context parallelism, `Plan(context_attention="ulysses")`: the sequence-split
q, k, v become head-split by all-to-all, attention runs on the whole sequence for
heads / n heads, and the output goes back by all-to-all. The GPT's loss and
gradients equal one device's over training steps and through a pipeline (the
single-step cases, grouped-query heads repeated when fewer than the context size,
with and without tensor parallelism and in automatic mode, are in
tests/test_context_parallel.py's `PLANS`); the step's collectives are all-to-alls
moving `minimum_comm`'s bytes; temp memory stays flat as sequence and context grow
together; `eqxpar.collectives.all_to_all` itself; head counts the axis cannot split
raise."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.inspect import collective_stats
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss

from ._helpers import (
    CONTEXT_CONFIGS as CONFIGS,
)
from ._helpers import (
    assert_trees_close,
    assert_trees_close_to_scale,
    context_attention_fn,
    random_qkv,
    train_checked,
    value_and_grad_on_one_device,
)
from ._helpers import context_tokens as tokens


def _plan(mode="manual", **sizes_and_options):
    sizes = {
        a: sizes_and_options.pop(a) for a in ("data", "context", "tensor", "pipe") if a in sizes_and_options
    }
    return eqxpar.Plan(eqxpar.make_mesh(**sizes), mode=mode, context_attention="ulysses", **sizes_and_options)


@pytest.fixture(scope="module")
def gpts():
    return {name: eqx.filter_jit(GPT)(c, key=jax.random.key(0)) for name, c in CONFIGS.items()}


def test_training_steps_match_single_device(gpts):
    # AdamW, three steps: each step's loss, gradients and parameters checked.
    batches = [tokens(i) for i in range(3)]
    losses, _ = train_checked(
        _plan(data=2, context=4), gpts["rotary-gqa"], optax.adamw(1e-2), lm_loss, batches
    )
    assert len(losses) == 3 and losses[0] != losses[2]


def test_pipeline_matches_single_device(gpts):
    # A pipeline runs each stage in a branch; the all-to-alls run inside it.
    model, batch = gpts["rotary-gqa"], tokens(2)
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, context=2, data=2),
        schedule="1f1b",
        microbatches=4,
        rules=eqxpar.pipeline.stage_rules(None),
        context_attention="ulysses",
    )
    loss_fn = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)
    loss, grads = eqxpar.train.make_value_and_grad(loss_fn, plan)(eqxpar.shard(model, plan), batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, lm_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


@pytest.mark.parametrize(
    "sizes, options",
    [({"data": 2, "context": 4}, {}), ({"data": 2, "context": 2, "tensor": 2}, {"sequence_parallel": True})],
    ids=["data", "tensor-sp"],
)
def test_step_moves_the_minimum_by_all_to_all(gpts, sizes, options):
    # Per layer: q, k, v and the output by all-to-all forward, their four
    # transposes backward; no K/V all-gather or ring permute over context.
    config = "rotary-gqa" if "tensor" not in sizes else "learned-positions"
    model, batch = gpts[config], tokens(1)
    rules = eqxpar.rules.MEGATRON if "tensor" in sizes else None
    plan = _plan(**sizes, rules=rules, **options)
    step = eqxpar.train.make_value_and_grad(lm_loss, plan)
    stats = collective_stats(jax.jit(step).lower(model, batch).compile())
    least = eqxpar.inspect.minimum_comm(plan, model, loss=lm_loss, batch=batch)
    assert stats.count["all-to-all"] == 8 * CONFIGS[config].num_layers
    assert stats.count["collective-permute"] == 0
    assert stats.wire_bytes["all-to-all"] == least.wire_bytes["all-to-all"] > 0
    if "tensor" not in sizes:
        assert stats.count["all-gather"] == 0
    # Sequence parallelism also sums the replicated weights' gradients over
    # `tensor`, which the minimum leaves out (as for the ring: within 5 %).
    assert least.total_wire_bytes <= sum(stats.wire_bytes.values()) <= 1.05 * least.total_wire_bytes
    assert any("queries, keys, values and outputs over context=" in part for part in least.parts)


def test_minimum_counts_repeated_key_value_heads(gpts):
    # rotary-gqa: 4 query heads, 2 key/value heads; over context 4 each key/value
    # head goes twice (lcm(2, 4) = 4 heads moved), so q, out, k, v move alike.
    model, batch, config = gpts["rotary-gqa"], tokens(1), CONFIGS["rotary-gqa"]
    n = 4
    least = eqxpar.inspect.minimum_comm(_plan(data=2, context=n), model, loss=lm_loss, batch=batch)
    local_tokens = batch.shape[0] // 2 * (batch.shape[1] - 1) // n
    one = local_tokens * config.num_heads * config.head_dim * 4  # q (or out, k, v) bytes
    assert least.wire_bytes["all-to-all"] == config.num_layers * 8 * (n - 1) * one // n


def _temp_bytes(c: int, seq: int) -> int:
    # Compile only: loss and gradients at sequence `seq` on context `c` (no
    # context axis at c = 1), memory-efficient attention everywhere.
    cfg = GPTConfig(vocab_size=32, d_model=32, num_heads=4, num_layers=2, d_hidden=64, max_seq_len=seq)
    model = eqx.filter_jit(GPT)(dataclasses.replace(cfg, attention="auto"), key=jax.random.key(0))
    options = {"context_attention": "ulysses"} if c > 1 else {}
    plan = eqxpar.Plan(eqxpar.make_mesh(context=c), mode="manual", **options)
    step = jax.jit(eqxpar.train.make_value_and_grad(lm_loss, plan))
    batch = jax.ShapeDtypeStruct((2, seq + 1), jnp.int32)
    return step.lower(model, batch).compile().memory_analysis().temp_size_in_bytes


def test_temp_memory_is_flat_as_sequence_and_context_grow():
    # The same tokens per device at every point: each device attends over the
    # whole sequence for heads / n heads, tile by tile.
    one, two, four = (_temp_bytes(c, 64 * c) for c in (1, 2, 4))
    assert four <= 1.1 * two and two <= 1.1 * one, (one, two, four)


def test_all_to_all_native_and_as_permutes():
    # Sequence-split to head-split: device j receives heads block j of every
    # device's sequence block, in device order, i.e. x[:, :, j]; read back as
    # heads split over `context` that is x itself, and so is the gradient (the
    # exchange back). Full manual: one all-to-all; partial manual with `data`
    # automatic (splitting the batch): ppermutes.
    x = jax.random.normal(jax.random.key(0), (2, 8, 4, 3))
    cot = jax.random.normal(jax.random.key(1), x.shape)

    def exchange(x):
        return eqxpar.collectives.all_to_all(x, axis_name="context", split_axis=2, concat_axis=1)

    for sizes, kind in [({"context": 4}, "all-to-all"), ({"data": 2, "context": 4}, "collective-permute")]:
        mesh = eqxpar.make_mesh(**sizes)
        # `data` (when there) automatic: the batch stays split over it.
        split = jax.device_put(x, NamedSharding(mesh, P("data" if "data" in sizes else None, "context")))
        f = jax.jit(
            jax.shard_map(
                exchange,
                mesh=mesh,
                in_specs=P(None, "context"),
                out_specs=P(None, None, "context"),
                axis_names={"context"},
            )
        )
        np.testing.assert_array_equal(f(split), x)
        np.testing.assert_array_equal(jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x) * cot)))(split), cot)
        stats = collective_stats(f.lower(split).compile())
        assert stats.count[kind] > 0 and stats.count["all-gather"] == 0, stats.count


def test_head_counts_the_axis_cannot_split_raise(gpts):
    model, batch = gpts["rotary-gqa"], tokens(1)  # 4 query heads
    fix = r"num_heads=4 .*multiple of 8.*'context' axis whose size divides 4.*'ring' / 'allgather'"
    plan = _plan(context=8)
    with pytest.raises(eqxpar.PlanError, match=fix):
        jax.jit(eqxpar.train.make_value_and_grad(lm_loss, plan)).lower(model, batch)
    with pytest.raises(eqxpar.PlanError, match=fix):
        eqxpar.inspect.minimum_comm(plan, model, loss=lm_loss, batch=batch)
    tensor = r"num_heads=4 .*2 devices of the tensor axis leave 2 query heads.*multiple of 8"
    with pytest.raises(eqxpar.PlanError, match=tensor):
        plan = _plan(context=4, tensor=2, rules=eqxpar.rules.MEGATRON)
        jax.jit(eqxpar.train.make_value_and_grad(lm_loss, plan)).lower(model, batch)
    # The function itself, on 6 local heads over 4 devices.
    args, _ = random_qkv(0, 16, 6, 6)
    attend = context_attention_fn(4, causal=True, load_balanced=True, impl="ulysses")
    with pytest.raises(eqxpar.DivisibilityError, match=r"6 query heads do not split over the 4 devices"):
        jax.eval_shape(attend, *args)


def test_automatic_tensor_axis_is_refused_at_plan_time():
    match = r"context_attention='ulysses', mode='auto'.*automatic tensor axis 'tensor'.*mode='manual'"
    with pytest.raises(eqxpar.PlanError, match=match):
        eqxpar.Plan(
            eqxpar.make_mesh(context=2, tensor=2), rules=eqxpar.rules.MEGATRON, context_attention="ulysses"
        )
    with pytest.raises(eqxpar.PlanError, match=r"manual_axes=\('context',\)"):
        _plan(context=2, tensor=2, manual_axes=("context",))
