"""Every builder compiles from shapes: a state from `train.init(..., abstract=True)`
(or built under `eqx.filter_eval_shape`) and `jax.ShapeDtypeStruct` batches lower
to the very program the arrays run, under every kind of plan, and nothing is
allocated."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig
from tests._helpers import pipeline_plan

CONFIG = GPTConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=64)
MOE = GPTConfig(
    vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=32, moe_every=1, experts=4, top_k=2
)
KEY = jax.random.key(0)
TOKENS = jax.ShapeDtypeStruct((8, 17), jnp.int32)
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(
    eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last
)


def _plans():
    mesh = eqxpar.make_mesh
    return {
        "data-fsdp-auto": (
            CONFIG,
            lambda: eqxpar.Plan(mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0)),
        ),
        "fsdp-manual": (
            CONFIG,
            lambda: eqxpar.Plan(mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0), mode="manual"),
        ),
        "tensor-manual": (
            CONFIG,
            lambda: eqxpar.Plan(mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual"),
        ),
        "zero1-bf16": (
            CONFIG,
            lambda: eqxpar.Plan(mesh(data=8), zero1=True, compute_dtype=jnp.bfloat16),
        ),
        "expert": (MOE, lambda: eqxpar.Plan(mesh(data=4, expert=2), rules=eqxpar.rules.MEGATRON)),
        "gpipe": (CONFIG, lambda: pipeline_plan("gpipe", pipe=2, data=4, microbatches=2)),
    }


PLANS = _plans()


def _loss(plan):
    return PIPELINE_LOSS if plan.schedule is not None else eqxpar.models.lm_loss


def _texts(lower, concrete, abstract):
    return lower(*concrete).as_text(), lower(*abstract).as_text()


@pytest.mark.parametrize("name", list(PLANS))
def test_step_lowers_the_same_program_from_shapes_as_from_arrays(name):
    config, make_plan = PLANS[name]
    plan = make_plan()
    optimizer = optax.adamw(1e-3)
    model = GPT(config, key=KEY)
    outline = eqx.filter_eval_shape(GPT, config, key=KEY)
    state = eqxpar.train.init(model, optimizer, plan, key=KEY)
    abstract = eqxpar.train.init(outline, optimizer, plan, key=KEY, abstract=True)
    step = eqxpar.train.make_step(_loss(plan), optimizer, plan, skip_nonfinite=name == "fsdp-manual")
    tokens = jnp.zeros(TOKENS.shape, TOKENS.dtype)
    concrete_text, abstract_text = _texts(step.lower, (state, tokens), (abstract, TOKENS))
    assert concrete_text == abstract_text
    # Every array of the outline carries the sharding the step keeps it in.
    for leaf, real in zip(jax.tree.leaves(abstract), jax.tree.leaves(state), strict=True):
        assert isinstance(leaf, jax.ShapeDtypeStruct)
        assert (leaf.shape, leaf.dtype) == (real.shape, real.dtype)
        assert leaf.sharding.is_equivalent_to(real.sharding, len(real.shape))


def test_init_under_filter_eval_shape_gives_a_state_the_step_compiles():
    # The form a new user tries first: init traced for shapes, batches as outlines.
    plan = PLANS["data-fsdp-auto"][1]()
    optimizer = optax.adamw(1e-3)
    model = GPT(CONFIG, key=KEY)
    state = eqx.filter_eval_shape(lambda m: eqxpar.train.init(m, optimizer, plan, key=KEY), model)
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan)
    real = eqxpar.train.init(model, optimizer, plan, key=KEY)
    assert (
        step.lower(state, TOKENS).as_text() == step.lower(real, jnp.zeros(TOKENS.shape, jnp.int32)).as_text()
    )
    memory = step.compile(state, TOKENS).memory_analysis()
    assert memory.argument_size_in_bytes > 0


def test_trainable_filter_and_accumulation_lower_the_same_from_shapes():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0))
    optimizer = optax.adamw(1e-3)
    lora = eqxpar.models.add_lora(GPT(CONFIG, key=KEY), rank=2, key=KEY)
    outline = eqx.filter_eval_shape(lambda: lora)
    trainable = eqxpar.models.lora_trainable(lora)
    state = eqxpar.train.init(lora, optimizer, plan, key=KEY, trainable=trainable)
    abstract = eqxpar.train.init(outline, optimizer, plan, key=KEY, trainable=trainable, abstract=True)
    assert len(jax.tree.leaves(abstract.opt_state)) == len(jax.tree.leaves(state.opt_state))
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan, trainable=trainable, accumulate=2)
    # 16 rows: 2 micro-batches of 8, one row per data-parallel device.
    tokens = jax.ShapeDtypeStruct((16, 17), jnp.int32)
    concrete_text, abstract_text = _texts(
        step.lower, (state, jnp.zeros(tokens.shape, jnp.int32)), (abstract, tokens)
    )
    assert concrete_text == abstract_text


@pytest.mark.parametrize("name", ["data-fsdp-auto", "tensor-manual", "gpipe"])
def test_value_and_grad_and_eval_step_lower_the_same_from_shapes(name):
    config, make_plan = PLANS[name]
    plan = make_plan()
    model, outline = GPT(config, key=KEY), eqx.filter_eval_shape(GPT, config, key=KEY)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, TOKENS.shape), jnp.int32)
    value_and_grad = eqxpar.train.make_value_and_grad(_loss(plan), plan)
    concrete_text, abstract_text = _texts(value_and_grad.lower, (model, tokens), (outline, TOKENS))
    assert concrete_text == abstract_text
    evaluate = eqxpar.train.make_eval_step(_loss(plan), plan)
    concrete_text, abstract_text = _texts(evaluate.lower, (model, tokens), (outline, TOKENS))
    assert concrete_text == abstract_text
    # The call runs the program it lowered: its loss is the one value_and_grad gives.
    loss, _ = value_and_grad(model, tokens)
    np.testing.assert_allclose(evaluate(model, tokens)["loss"], loss, rtol=1e-6)


def test_generate_lowers_the_same_program_from_shapes():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON)
    model, outline = GPT(CONFIG, key=KEY), eqx.filter_eval_shape(GPT, CONFIG, key=KEY)
    prompt = jax.ShapeDtypeStruct((4, 5), jnp.int32)
    lower = lambda m, p: eqxpar.models.lower_generate(m, p, steps=3, stop_tokens=(1,), plan=plan)  # noqa: E731
    assert lower(model, jnp.zeros(prompt.shape, prompt.dtype)).as_text() == lower(outline, prompt).as_text()
    out = eqxpar.models.generate(model, jnp.zeros(prompt.shape, jnp.int32), steps=3, key=KEY, plan=plan)
    assert out.tokens.shape == (4, 8)
    with pytest.raises(eqxpar.PlanError, match="steps >= 1"):
        eqxpar.models.lower_generate(outline, prompt, steps=0, plan=plan)


def test_outlines_compile_but_do_not_run_and_say_so():
    plan = PLANS["data-fsdp-auto"][1]()
    optimizer = optax.adamw(1e-3)
    outline = eqx.filter_eval_shape(GPT, CONFIG, key=KEY)
    state = eqxpar.train.init(outline, optimizer, plan, key=KEY)
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan)
    with pytest.raises(eqxpar.PlanError, match=r"compile but cannot run.*\.lower"):
        step(state, TOKENS)
    with pytest.raises(eqxpar.PlanError, match="compile but cannot run"):
        eqxpar.train.make_value_and_grad(eqxpar.models.lm_loss, plan)(outline, TOKENS)
    with pytest.raises(eqxpar.PlanError, match="abstract=1"):
        eqxpar.train.init(outline, optimizer, plan, key=KEY, abstract=1)
    with pytest.raises(eqxpar.PlanError, match="typed PRNG key"):
        eqxpar.train.init(outline, optimizer, plan, key=jax.ShapeDtypeStruct((2,), jnp.uint32))
    with pytest.raises(eqxpar.BatchError, match="rows_per_call"):
        eqxpar.train.make_eval_step(eqxpar.models.lm_loss, plan).lower(
            outline, jax.ShapeDtypeStruct((6, 17), jnp.int32)
        )


def test_a_model_too_large_for_this_host_compiles_from_shapes():
    # 64 layers of d_model 4096 in float32 are 64 GiB of weights and 128 GiB of
    # Adam moments, far beyond this machine: only outlines can compile it.
    config = GPTConfig(
        vocab_size=32000, d_model=4096, num_heads=32, num_layers=64, d_hidden=16384, tied=False
    )
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), remat="full")
    outline = eqx.filter_eval_shape(GPT, config, key=KEY)
    state = eqxpar.train.init(outline, optax.adamw(1e-3), plan, key=KEY, abstract=True)
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state.model))
    assert weights > 60 * 2**30
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optax.adamw(1e-3), plan)
    lowered = step.lower(state, jax.ShapeDtypeStruct((8, 129), jnp.int32))
    assert "while" in lowered.as_text()
