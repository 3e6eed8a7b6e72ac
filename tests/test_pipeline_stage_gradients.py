"""Pipelines under FSDP with `Plan(stage_gradients="sharded")`: weights gathered
at their uses (the stack a layer at a time), each micro-batch's gradients
reduce-scattered into sums split like the weights. Every schedule kind gives the
loss and gradients of one device; the compiled step moves what `minimum_comm`
says for the mode, a reduce-scatter per micro-batch, and holds less than the
whole stage's sums; bad options raise eqxpar errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar.pipeline import stage_rules

from ._helpers import (
    PIPELINE_ROWS,
    Tiny,
    assert_trees_close,
    assert_trees_close_to_scale,
    reference_run,
    regression_batch,
    run_steps,
    tiny_loss,
)

#: Every weight split over fsdp, the stack's and the rest's (`w_in`, `w_out`).
ALL_SPLIT = eqxpar.rules.FSDP(min_size=0)
#: Only the stack's matrices split (`w` has 64 elements a layer; the biases 8,
#: `w_in` 24, `w_out` 16 stay replicated): the bytes tests count the stack alone.
STACK_SPLIT = eqxpar.rules.FSDP(min_size=32)


def _plan(schedule, *, chunks=1, microbatches=4, remat="full", rules=ALL_SPLIT, mode="sharded", **kwargs):
    mesh = eqxpar.make_mesh(pipe=2, fsdp=2)
    return eqxpar.Plan(
        mesh,
        rules=stage_rules(rules),
        schedule=schedule,
        microbatches=microbatches,
        chunks=chunks,
        remat=remat,
        stage_gradients=mode,
        **kwargs,
    )


@pytest.mark.parametrize(
    "schedule,chunks,remat",
    [
        ("gpipe", 1, "dots"),
        ("1f1b", 1, "full"),
        ("interleaved", 2, "inputs"),
        ("zb_v", 2, "dots"),
    ],
)
def test_sharded_stage_gradients_match_one_device(schedule, chunks, remat):
    loss = tiny_loss()
    model = Tiny(4 * chunks, key=jax.random.key(chunks))
    batch = regression_batch(2 * PIPELINE_ROWS * 4)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, batch)

    plan = _plan(schedule, chunks=chunks, remat=remat)
    stored = eqxpar.shard(model, plan)
    assert stored.blocks.blocks.w.sharding.spec[:2] == ("pipe", "fsdp")
    assert stored.w_in.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    value, grads = eqxpar.train.make_value_and_grad(loss, plan)(stored, batch)
    # Gradients leave split like the weights.
    assert grads.blocks.blocks.w.sharding.spec[:2] == ("pipe", "fsdp")
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close_to_scale(
        eqxpar.nn.in_natural_order(grads), eqx.filter(ref_grads, eqx.is_inexact_array)
    )


def test_sharded_stage_gradients_train_like_one_device():
    # Three AdamW steps under 1F1B with bfloat16-free float32 weights: the
    # trained model and the losses of one device.
    model = Tiny(4, key=jax.random.key(7))
    optim = optax.adamw(1e-2)
    batches = [regression_batch(2 * PIPELINE_ROWS * 4, seed=s) for s in range(3)]
    ref_losses, ref_model = reference_run(model, optim, tiny_loss(), batches)
    plan = _plan("1f1b")
    step = eqxpar.train.make_step(tiny_loss(), optim, plan)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    losses, state = run_steps(step, state, batches)
    assert_trees_close(losses, ref_losses)
    assert_trees_close_to_scale(eqxpar.nn.in_natural_order(state.model), ref_model)
    assert state.model.blocks.blocks.w.sharding.spec[:2] == ("pipe", "fsdp")


def _stage_fsdp_bytes(model, plan):
    """Bytes of this device's stack weights split over fsdp, whole (float32)."""
    specs = eqxpar.partition_specs(eqx.filter(model, eqx.is_inexact_array), plan)
    total = 0
    for leaf, spec in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        strict=True,
    ):
        if "fsdp" in jax.tree.leaves(tuple(spec)):
            total += leaf.nbytes // plan.mesh.shape["pipe"]
    return total


@pytest.mark.parametrize("remat,gathers", [("full", 3), ("dots", 2)])
def test_sharded_stage_gradients_move_the_minimum(remat, gathers):
    # 1F1B over pipe 2 x fsdp 2, m = 4, the stack's matrices split: each
    # micro-batch gathers a stage's weights `gathers` times (its forward, and
    # the backward's re-gathers under the stack's remat) and reduce-scatters
    # their gradient once, inside the tick loops: what minimum_comm says for
    # the mode. The whole mode gathers once a step, outside the loops (where
    # minimum_comm counts a stack's re-gathers as for a stack outside a pipeline).
    m = 4
    model = Tiny(4, key=jax.random.key(0))
    batch = regression_batch(2 * PIPELINE_ROWS * m)
    loss = tiny_loss()
    whole_bytes = _stage_fsdp_bytes(model, _plan("1f1b", rules=STACK_SPLIT))
    for mode in ("sharded", "whole"):
        plan = _plan("1f1b", microbatches=m, remat=remat, rules=STACK_SPLIT, mode=mode)
        compiled = (
            eqxpar.train.make_value_and_grad(loss, plan).lower(eqxpar.shard(model, plan), batch).compile()
        )
        stats = eqxpar.inspect.collective_stats(compiled)
        if mode == "sharded":
            least = eqxpar.inspect.minimum_comm(plan, model, loss=loss, batch=batch)
            for kind in ("all-gather", "reduce-scatter"):
                assert stats.wire_bytes[kind] == least.wire_bytes[kind], (kind, stats, least.parts)
            # (n-1)/n of the whole weights per gather, n-1 shards per reduce-scatter (n = 2).
            assert stats.wire_bytes["all-gather"] == m * gathers * whole_bytes // 2
            assert stats.wire_bytes["reduce-scatter"] == m * whole_bytes // 2
            assert stats.in_loops["reduce-scatter"] == stats.count["reduce-scatter"] > 0
        else:
            assert stats.wire_bytes["all-gather"] == whole_bytes // 2
            assert "reduce-scatter" not in stats.in_loops


def test_sharded_stage_gradients_hold_less():
    # A stage of wide layers: whole, its weights and float32 gradient sums are
    # gathered for the step; sharded, one layer is whole at a time.
    model = Tiny(8, key=jax.random.key(0), d=256)
    batch = (jnp.zeros((16, 3)), jnp.zeros((16, 2)))
    temp = {}
    for mode in ("whole", "sharded"):
        plan = _plan("1f1b", rules=STACK_SPLIT, mode=mode)
        lowered = eqxpar.train.make_value_and_grad(tiny_loss(), plan).lower(eqxpar.shard(model, plan), batch)
        temp[mode] = lowered.compile().memory_analysis().temp_size_in_bytes
    stage = 4 * 256 * 256 * 4  # a device's 4 layers' matrices, float32
    assert temp["whole"] - temp["sharded"] >= stage, temp


def test_stage_gradients_bad_options():
    mesh = eqxpar.make_mesh(pipe=2, fsdp=2)
    rules = stage_rules(ALL_SPLIT)
    with pytest.raises(eqxpar.PlanError, match="expected one of"):
        eqxpar.Plan(mesh, rules=rules, schedule="1f1b", microbatches=2, stage_gradients="split")
    with pytest.raises(eqxpar.PlanError, match="has no schedule"):
        eqxpar.Plan(mesh, rules=ALL_SPLIT, remat="full", stage_gradients="sharded")
    with pytest.raises(eqxpar.PlanError, match="remat='full'"):
        eqxpar.Plan(mesh, rules=rules, schedule="1f1b", microbatches=2, stage_gradients="sharded")


def test_sharded_stage_gradients_split_along_leading_dimensions_match_one_device():
    # rules.FSDP(dim="leading") splits each weight along its first divisible
    # dimension: the fused MLP input weight (layers, d_model, 2, hidden) along
    # d_model rather than hidden (a gradient the TPU compiler then
    # reduce-scatters rather than all-reduces). The layout changes; the loss and
    # gradients are one device's.
    config = eqxpar.models.GPTConfig(
        vocab_size=32, d_model=16, num_heads=4, num_kv_heads=2, num_layers=4, d_hidden=32, max_seq_len=8
    )
    model = eqx.filter_jit(eqxpar.models.GPT)(config, key=jax.random.key(3))
    loss = eqxpar.pipeline.PipelineLoss(eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last)
    tokens = jax.random.randint(jax.random.key(4), (8, 9), 0, config.vocab_size)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(eqxpar.models.lm_loss))(model, tokens)
    plan = _plan("1f1b", rules=eqxpar.rules.FSDP(min_size=0, dim="leading"))
    stored = eqxpar.shard(model, plan)
    assert tuple(stored.blocks.blocks.mlp.w_in.sharding.spec) == ("pipe", "fsdp", None, None)
    assert tuple(eqxpar.shard(model, _plan("1f1b")).blocks.blocks.mlp.w_in.sharding.spec) == (
        "pipe",
        None,
        None,
        "fsdp",
    )
    value, grads = eqxpar.train.make_value_and_grad(loss, plan)(stored, tokens)
    assert tuple(grads.blocks.blocks.mlp.w_in.sharding.spec)[:2] == ("pipe", "fsdp")
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close_to_scale(
        eqxpar.nn.in_natural_order(grads), eqx.filter(ref_grads, eqx.is_inexact_array)
    )
