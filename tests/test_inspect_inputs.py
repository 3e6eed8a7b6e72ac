"""The inspection reports read what `eqx.filter_jit(f).lower(...)` and its
`.compile()` return (Equinox's wrappers around jax's Lowered and Compiled), and a
jax Lowered, as they read a jax Compiled."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar import inspect as ei


def _loss(model, x):
    return jnp.mean(jax.vmap(model)(x) ** 2)


@pytest.fixture(scope="module")
def dp():
    """A tiny MLP's gradient under `filter_jit` on a data-parallel mesh: GSPMD
    all-reduces the gradient over `data`."""
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
    model = eqxpar.shard(eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0)), plan)
    x = eqxpar.shard_batch(jnp.ones((16, 4)), plan)
    grad = eqx.filter_jit(eqx.filter_grad(_loss))
    lowered = grad.lower(model, x)
    return plan, model, x, lowered, lowered.compile()


def test_collective_stats_of_filter_jit(dp):
    *_, lowered, compiled = dp
    stats = ei.collective_stats(compiled)
    assert stats.count["all-reduce"] >= 1
    # The same numbers as the compiled HLO text itself, and from the Lowered.
    assert stats == ei.collective_stats(compiled.compiled.as_text())
    assert ei.collective_stats(lowered) == stats


def test_collective_stats_of_jax_lowered(dp):
    _, model, x, *_ = dp
    params, static = eqx.partition(model, eqx.is_array)
    lowered = jax.jit(jax.grad(lambda p: _loss(eqx.combine(p, static), x))).lower(params)
    assert ei.collective_stats(lowered) == ei.collective_stats(lowered.compile())


def test_comm_and_memory_reports_of_filter_jit(dp):
    plan, model, x, lowered, compiled = dp
    report = ei.comm_report(compiled)
    assert report.measured == ei.collective_stats(compiled)
    assert ei.comm_report(lowered).measured == report.measured
    memory = ei.memory_report(compiled)
    assert memory == ei.memory_report(lowered)
    assert memory.argument_bytes > 0
    # A filter_jit computation as the baseline of an eqxpar step's report.
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(_loss, optim, plan)
    assert ei.comm_report(step, state, x, baseline=compiled).baseline == report.measured


def test_unreadable_inputs_name_themselves(dp):
    *_, lowered, _ = dp
    with pytest.raises(eqxpar.EqxparError, match=r"collective_stats\(int 42\): expected a compiled"):
        ei.collective_stats(42)
    # StableHLO is the program before XLA places the collectives: not countable.
    with pytest.raises(eqxpar.EqxparError, match=r"no ENTRY computation.*compiled\.as_text\(\)"):
        ei.collective_stats(lowered.as_text())
    with pytest.raises(eqxpar.EqxparError, match=r"memory_report\(Lowered, \.\.\.\).*got 1"):
        ei.memory_report(lowered, 1)
