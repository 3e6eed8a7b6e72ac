"""Frozen weights: `make_step(..., trainable=)` and `train.init(..., trainable=)`.

Under every kind of plan the trainable weights follow one device's training of
those weights alone, the frozen ones stay bit for bit, the optimizer state holds
nothing for them, their gradients move no bytes and (outside pipelines) are not
computed at all.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar

# Embedding and blocks frozen, final norm and head trained: the filter whose
# figures benchmarks/fine_tuning.py records, so the tests hold the measured one.
from benchmarks.fine_tuning import head_only
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss

from ._helpers import assert_params_close, journey_optimizer

CONFIG = dict(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=64, max_seq_len=16, tied=False)
OPTIM = journey_optimizer()  # AdamW with an eps well above float32 noise (see there)
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)


def _gpt(**kw) -> GPT:
    return GPT(GPTConfig(**{**CONFIG, **kw}), key=jax.random.key(0))


def _tokens(seed: int, batch: int = 16) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (batch, 9), 0, CONFIG["vocab_size"])


def blocks_and_head(model: GPT):
    """The stack and the head train, the embedding and final norm stay: a filter
    reaching into the stack's fields, built on the model in natural order."""
    mask = jax.tree.map(lambda _: False, model)
    return eqx.tree_at(lambda m: (m.blocks, m.head), mask, replace=(True, True))


def _one_device(model, mask, loss_fn, batches):
    """Plain JAX on one device: only the masked leaves differentiated and updated."""
    device = jax.devices()[0]
    params, rest = eqx.partition(jax.device_put(model, device), mask)
    opt_state = OPTIM.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        grads = jax.grad(lambda p: loss_fn(eqx.combine(p, rest), batch))(params)
        updates, opt_state = OPTIM.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    for batch in batches:
        params, opt_state = step(params, opt_state, jax.device_put(batch, device))
    return eqx.combine(params, rest)


PLANS = {
    "data-auto": (lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)), {}, head_only),
    "fsdp-manual-accumulate": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual"),
        {"accumulate": 2},
        blocks_and_head,
    ),
    "zero1-skip-nonfinite": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=4, fsdp=2), zero1=True),
        {"skip_nonfinite": True},
        blocks_and_head,
    ),
    "tensor-sp-manual": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
        ),
        {},
        blocks_and_head,
    ),
    "context-allgather": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="allgather"
        ),
        {},
        blocks_and_head,
    ),
    "expert-data": (
        lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
        {},
        blocks_and_head,
    ),
    # 1F1B: the engine drops the frozen gradients a stage's backward computes.
    "pipeline-1f1b": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(pipe=2, data=4),
            rules=eqxpar.pipeline.stage_rules(None),
            schedule="1f1b",
            microbatches=2,
        ),
        {},
        blocks_and_head,
    ),
    # Interleaved: the stack is stored in the plan's order, the filter built on
    # the natural one.
    "pipeline-interleaved": (
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(pipe=2, data=4),
            rules=eqxpar.pipeline.stage_rules(None),
            schedule="interleaved",
            microbatches=2,
            chunks=2,
        ),
        {},
        blocks_and_head,
    ),
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_frozen_weights_stay_and_the_rest_trains_like_one_device(name):
    make_plan, step_kw, filter_of = PLANS[name]
    plan = make_plan()
    # Interleaved over pipe 2: two chunks of one layer on each device.
    moe = dict(moe_every=2, experts=4) if plan.expert_size > 1 else {}
    model = _gpt(num_layers=4 if plan.schedule is not None else 2, **moe)
    mask = filter_of(model)
    loss_fn = PIPELINE_LOSS if plan.schedule is not None else lm_loss
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=mask)
    step = eqxpar.train.make_step(loss_fn, OPTIM, plan, trainable=mask, **step_kw)
    # The optimizer state mirrors the trainable weights only.
    want = OPTIM.init(eqx.filter(model, mask))
    assert [x.shape for x in jax.tree.leaves(state.opt_state)] == [x.shape for x in jax.tree.leaves(want)], (
        "the optimizer state holds entries for frozen weights"
    )
    batches = [_tokens(1), _tokens(2)]
    for batch in batches:
        state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    trained = eqxpar.nn.in_natural_order(state.model)
    # Frozen: bit for bit. Trained: as one device trains them.
    frozen_before = jax.tree.leaves(eqx.filter(model, mask, inverse=True))
    frozen_after = jax.tree.leaves(eqx.filter(trained, mask, inverse=True))
    for before, after in zip(frozen_before, frozen_after, strict=True):
        np.testing.assert_array_equal(np.asarray(after), np.asarray(before))
    assert_params_close(trained, _one_device(model, mask, lm_loss, batches))


def _compiled(plan, model, mask):
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=mask)
    step = eqxpar.train.make_step(lm_loss, OPTIM, plan, trainable=mask)
    return step, state, step.compile(state, _tokens(1))


def _bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


@pytest.mark.parametrize(
    "plan",
    [
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)),
        lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual"),
    ],
    ids=["data8", "fsdp8-manual"],
)
def test_frozen_gradients_move_no_bytes_and_are_not_computed(plan):
    plan, model = plan(), _gpt()
    mask = head_only(model)
    step, state, frozen = _compiled(plan, model, mask)
    _, full_state, full = _compiled(plan, model, None)
    report = eqxpar.inspect.comm_report(step, state, _tokens(1))
    trained_bytes = _bytes(eqx.filter(model, mask))
    # The gradients reduced are the head's and the final norm's: at the minimum,
    # which counts no gradient for a frozen weight (FSDP still gathers them all).
    assert report.wire_ratio_to_minimum == pytest.approx(1.0, abs=0.01), report
    reduced = [c for c in report.minimum.costs if c.kind in ("all-reduce", "reduce-scatter")]
    shards = plan.mesh.shape["fsdp"]
    assert sum(c.bytes * (shards if c.kind == "reduce-scatter" else 1) for c in reduced) == trained_bytes
    # No optimizer state for the frozen weights: AdamW keeps two moments of each
    # trainable one.
    assert _bytes(state.opt_state) < 2 * trained_bytes + 64
    assert _bytes(full_state.opt_state) >= 2 * _bytes(model)
    # Embedding and stack frozen: the backward pass stops at the final norm, so the
    # step costs about a forward pass, not three.
    frozen_flops, full_flops = eqxpar.inspect.matmul_flops(frozen), eqxpar.inspect.matmul_flops(full)
    assert frozen_flops < 0.5 * full_flops, (frozen_flops, full_flops)


def test_a_checkpoint_of_a_frozen_run_restores_under_another_plan(tmp_path):
    model = _gpt()
    mask = blocks_and_head(model)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    state = eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=mask)
    state, _ = eqxpar.train.make_step(lm_loss, OPTIM, plan, trainable=mask)(state, _tokens(1))
    with eqxpar.checkpoint.CheckpointManager(tmp_path / "run") as manager:
        manager.save(1, state)
        manager.wait()
        other = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp"), mode="manual")
        like = eqxpar.train.init(model, OPTIM, other, key=jax.random.key(0), trainable=mask)
        restored, _ = manager.restore(1, like=like, plan=other)
    # The frozen weights are stored once (in the model; no optimizer moments).
    assert len(jax.tree.leaves(restored.opt_state)) == len(jax.tree.leaves(state.opt_state))
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        if eqx.is_array(a) and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # And it trains on under the other plan with the same filter.
    step = eqxpar.train.make_step(lm_loss, OPTIM, other, trainable=mask)
    _, metrics = step(restored, _tokens(2))
    assert np.isfinite(float(metrics["loss"]))


def test_value_and_grad_gives_gradients_of_the_trainable_weights_only():
    model, plan = _gpt(), eqxpar.Plan(eqxpar.make_mesh(data=8))
    mask = head_only(model)
    loss, grads = eqxpar.train.make_value_and_grad(lm_loss, plan, trainable=mask)(model, _tokens(1))
    assert jax.tree.structure(grads) == jax.tree.structure(eqx.filter(model, mask))
    want = jax.grad(lambda p: lm_loss(eqx.combine(p, eqx.filter(model, mask, inverse=True)), _tokens(1)))(
        eqx.filter(model, mask)
    )
    assert_params_close(grads, want)


def test_a_callable_filter_and_bad_filters():
    model, plan = _gpt(), eqxpar.Plan(eqxpar.make_mesh(data=8))
    # A callable: every matrix trains, vectors (norm scales) stay.
    state = eqxpar.train.init(
        model, OPTIM, plan, key=jax.random.key(0), trainable=lambda x: eqx.is_array(x) and x.ndim >= 2
    )
    vectors = [x for x in jax.tree.leaves(model) if eqx.is_array(x) and x.ndim < 2]
    assert len(jax.tree.leaves(state.opt_state)) < len(
        jax.tree.leaves(OPTIM.init(eqx.filter(model, eqx.is_array)))
    )
    assert vectors  # the test would not test the callable otherwise
    # A step with another filter than the state's is refused, naming the fix.
    step = eqxpar.train.make_step(lm_loss, OPTIM, plan)
    with pytest.raises(eqxpar.PlanError, match="same filter"):
        step(state, _tokens(1))
    # A row mask (an array in the filter) is refused with the alternatives.
    rows = eqx.tree_at(
        lambda m: m.blocks, jax.tree.map(lambda _: True, model), replace=jnp.array([True, False])
    )  # noqa: E501
    with pytest.raises(eqxpar.PlanError, match="Stacked of their own"):
        eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=rows)
    with pytest.raises(eqxpar.PlanError, match="train nothing"):
        eqxpar.train.make_step(lm_loss, OPTIM, plan, trainable=False)(
            eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0)), _tokens(1)
        )
    with pytest.raises(eqxpar.PlanError, match="not a prefix"):
        eqxpar.train.init(model, OPTIM, plan, key=jax.random.key(0), trainable=(True, False))
