"""`eqxpar.nn.Embedding` in automatic mode with its table split over batch axes
only (FSDP rules): it looks rows up as the table lies (each device its columns of
every token's row, then one all-to-all to the batch split), never gathering the
table nor all-reducing a whole-table gradient, with the values of a plain lookup."""

import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig
from tests._helpers import (
    assert_trees_close_to_scale,
    token_batches,
    train_checked,
    value_and_grad_on_one_device,
)

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to compile for',
)

CONFIG = GPTConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=64)
KEY = jax.random.key(0)


def _plans():
    mesh, rules = eqxpar.make_mesh, eqxpar.rules
    # name: (plan, whether the embedding takes the sharded lookup)
    return {
        # MEGATRON_FSDP over a size-1 tensor axis: the model dimension over fsdp.
        "megatron-fsdp": (lambda: eqxpar.Plan(mesh(data=2, fsdp=4), rules=rules.MEGATRON_FSDP), True),
        # FSDP() splits the larger dimension: the vocabulary, over fsdp.
        "fsdp": (lambda: eqxpar.Plan(mesh(data=2, fsdp=4), rules=rules.FSDP(min_size=0)), True),
        "fsdp-only": (lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP(min_size=0)), True),
        # The tensor axis splits no weight here, so it is one more batch axis.
        "fsdp-tensor": (
            lambda: eqxpar.Plan(mesh(data=2, fsdp=2, tensor=2), rules=rules.FSDP(min_size=0)),
            True,
        ),
        # The vocabulary over tensor: vocabulary parallelism, the existing path.
        "megatron-fsdp-tensor": (
            lambda: eqxpar.Plan(mesh(data=2, fsdp=2, tensor=2), rules=rules.MEGATRON_FSDP),
            False,
        ),
    }


PLANS = _plans()


def _all_to_alls(fn, *args) -> int:
    """How many all-to-alls `fn(*args)` traces: the sharded lookup's are the only ones
    these models have (its forward one; the backward's is its transpose)."""
    return str(eqx.filter_make_jaxpr(fn)(*args)[0]).count("all_to_all")


@pytest.mark.parametrize("name", list(PLANS))
def test_gpt_loss_and_gradients_match_one_device(name):
    make_plan, sharded = PLANS[name]
    plan = make_plan()
    model = GPT(CONFIG, key=KEY)
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, CONFIG.vocab_size)
    value_and_grad = eqxpar.train.make_value_and_grad(eqxpar.models.lm_loss, plan)
    assert (_all_to_alls(value_and_grad, model, tokens) > 0) == sharded
    got = value_and_grad(model, tokens)
    assert_trees_close_to_scale(got, value_and_grad_on_one_device(model, eqxpar.models.lm_loss, tokens))


@pytest.mark.parametrize("name", ["megatron-fsdp", "fsdp"])
def test_the_lookup_is_a_copy_and_its_gradient_the_plain_one(name):
    plan = PLANS[name][0]()
    embed = eqxpar.nn.Embedding(64, 32, key=KEY)
    ids = jax.random.randint(jax.random.key(1), (8, 5), 0, 64)
    cotangent = jax.random.normal(jax.random.key(2), (8, 5, 32))

    def loss(embed, ids):
        return jnp.sum(embed(ids) * cotangent)

    @eqx.filter_jit
    def run(embed, ids):
        with plan:
            return embed(ids), eqx.filter_grad(loss)(embed, ids)

    sharded = eqxpar.shard(embed, plan)
    ids_sharded = jax.device_put(ids, jax.NamedSharding(plan.mesh, plan.batch_spec))
    assert _all_to_alls(run, sharded, ids_sharded) >= 2
    out, grad = run(sharded, ids_sharded)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.take(embed.weight, ids, axis=0)))
    want = jnp.zeros_like(embed.weight).at[ids].add(cotangent)
    np.testing.assert_allclose(np.asarray(grad.weight), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_several_fsdp_steps_match_one_device():
    plan = PLANS["fsdp"][0]()
    model = GPT(CONFIG, key=KEY)
    batches = token_batches(3, batch=8, seq=9, vocab=CONFIG.vocab_size)
    value_and_grad = eqxpar.train.make_value_and_grad(eqxpar.models.lm_loss, plan)
    assert _all_to_alls(value_and_grad, model, batches[0]) > 0
    train_checked(plan, model, optax.adamw(1e-2), eqxpar.models.lm_loss, batches)


def _bfloat16_losses(plan):
    optimizer = optax.adamw(1e-2)
    state = eqxpar.train.init(GPT(CONFIG, key=KEY), optimizer, plan, key=KEY)
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan)
    batches = token_batches(3, batch=8, seq=9, vocab=CONFIG.vocab_size)
    text = step.lower(state, batches[0]).as_text()
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, "all_to_all" in text


def test_a_bfloat16_step_runs_the_sharded_lookup_on_cpu():
    # The region is partial-manual (data stays automatic) and moves bfloat16
    # activations: XLA:CPU compiles and runs it (there is no all-reduce in it to widen).
    rules, mesh = eqxpar.rules.FSDP(min_size=0), eqxpar.make_mesh
    losses, sharded = _bfloat16_losses(
        eqxpar.Plan(mesh(data=2, fsdp=4), rules=rules, compute_dtype=jnp.bfloat16)
    )
    assert sharded
    # Against data parallelism, whose table is whole on every device.
    want, whole = _bfloat16_losses(eqxpar.Plan(mesh(data=8), compute_dtype=jnp.bfloat16))
    assert not whole
    np.testing.assert_allclose(losses, want, rtol=1e-2)


def _table_collectives(text: str, rows: int, cols: int) -> list[str]:
    """The lines of HLO `text` whose collective produces a whole (rows, cols) table."""
    return [
        line
        for line in text.splitlines()
        if any(f"{op}(" in line or f"{op}-start(" in line for op in ("all-reduce", "all-gather"))
        and f"[{rows},{cols}]" in line.split("=", 1)[-1].split("(", 1)[0]
    ]


@pytest.mark.parametrize("name", ["megatron-fsdp", "fsdp"])
def test_the_step_neither_gathers_the_table_nor_all_reduces_its_gradient(name):
    plan = PLANS[name][0]()
    # A table of a shape no other weight has (untied: the head's is its transpose).
    config = GPTConfig(vocab_size=128, d_model=32, num_heads=4, num_layers=2, d_hidden=64, tied=False)
    optimizer = optax.adamw(1e-3)
    state = eqxpar.train.init(GPT(config, key=KEY), optimizer, plan, key=KEY)
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan)
    text = step.lower(state, jax.ShapeDtypeStruct((8, 17), jnp.int32)).compile().as_text()
    assert "all-to-all" in text
    # The head's own gradient, [d_model, vocab] computed transposed, may be reduced
    # whole on CPU: that is the head's matmul, not the lookup.
    assert [line for line in _table_collectives(text, 128, 32) if "dot_general" not in line] == []


def _compile_on_tpu(rules):
    # A table large beside the rest, and the logits chunked, as a large model's.
    config = GPTConfig(
        vocab_size=65536,
        d_model=512,
        num_heads=4,
        num_layers=2,
        d_hidden=1024,
        tied=False,
        max_seq_len=256,
        loss_chunk=64,
    )
    plan = eqxpar.Plan(
        eqxpar.make_mesh(fsdp=4, topology="v5p:2x2x1"), rules=rules, remat="full", compute_dtype=jnp.bfloat16
    )
    optimizer = optax.adamw(1e-3)
    outline = eqx.filter_eval_shape(GPT, config, key=KEY)
    state = eqxpar.train.init(outline, optimizer, plan, key=KEY, abstract=True)
    step = eqxpar.train.make_step(eqxpar.models.lm_loss, optimizer, plan)
    compiled = step.compile(state, jax.ShapeDtypeStruct((16, 256), jnp.int32))
    return plan, compiled, config.vocab_size * config.d_model


@needs_libtpu
@pytest.mark.parametrize("rules", ["FSDP", "MEGATRON_FSDP"])
def test_on_tpu_the_step_neither_gathers_the_table_nor_all_reduces_its_gradient(rules):
    rules = eqxpar.rules.FSDP() if rules == "FSDP" else eqxpar.rules.MEGATRON_FSDP
    plan, compiled, elements = _compile_on_tpu(rules)
    stats = eqxpar.inspect.collective_stats(compiled, mesh=plan.mesh)
    assert stats.bytes.get("all-reduce", 0) < elements // 4
    assert stats.count.get("all-to-all", 0) >= 2
    text = compiled.as_text()
    assert _table_collectives(text, 65536, 512) == []
    # No whole table (its value, its gradient, in any dtype) is held by the step:
    # the lookup gathering whole rows held both (1 GiB of bf16 table and a 2 GiB
    # float32 gradient per chip for Llama-3-8B over 32 chips).
    assert "[65536,512]" not in text
