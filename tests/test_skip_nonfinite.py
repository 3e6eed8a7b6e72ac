"""`make_step(..., skip_nonfinite=True)`: a step whose loss or gradient is not
finite leaves the parameters and optimizer state bit for bit as they were, under
data parallelism (with and without accumulation), manual FSDP, tensor + sequence
parallelism and a 1F1B pipeline; the metrics flag it and the state counts it; the
next good step trains as if the bad batch had never come; `skip_nonfinite=False`
keeps the old behaviour. Also `SkipMonitor` and the option's validation, and
automatic FSDP over a scanned stack: refused on XLA:CPU before jaxlib 0.12 (where
it hung), skipping from 0.12."""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
from jax import lax

import eqxpar
from eqxpar import nn
from eqxpar.pipeline import PipelineLoss, stage_rules

from ._helpers import (
    FSDP_ONLY,
    StackedLM,
    Tiny,
    TinyGPT,
    assert_trees_close,
    cross_entropy_loss,
    mse_loss,
)
from ._helpers import TINY_GPT_BATCH as TP_ROWS
from ._helpers import TINY_GPT_SEQ as TP_SEQ
from ._helpers import TINY_GPT_VOCAB as TP_VOCAB
from ._helpers import stacked_lm_batches as fsdp_batches

KINDS = ("nan_row", "inf_loss", "nan_grad")


def probe(leaf: jax.Array, flag: jax.Array) -> jax.Array:
    """0 in value; its gradient for `leaf` is 0 where the batch's `flag` rows are
    0, and NaN (0 x the infinite slope of sqrt at 0) where they are 1: a finite
    loss whose gradient is NaN in one leaf only."""
    zero = leaf - lax.stop_gradient(leaf)
    return 0.0 * jnp.sum(jnp.sqrt(zero + 1.0 - jnp.mean(flag)))


def with_probes(base: Callable, leaf: Callable) -> Callable:
    """`base(model, core)` plus the mean of `extra` (0, or inf: an infinite loss
    with a finite gradient) and `probe(leaf(model), flag)`; batch `(core, extra, flag)`."""

    def loss(model, batch):
        core, extra, flag = batch
        return base(model, core) + jnp.mean(extra) + probe(leaf(model), flag)

    return loss


def weighted_cross_entropy(model, core):
    """Cross-entropy with a per-row weight (the float input row a NaN can spoil:
    token ids cannot hold one)."""
    ids, labels, weight = core
    return jnp.mean(nn.cross_entropy(model(ids), labels, head=model.head) * weight[:, None])


def pipeline_loss() -> PipelineLoss:
    def last(m, h, batch):
        (_, y), extra, flag = batch
        return jnp.mean((h @ m.w_out - y) ** 2) + jnp.mean(extra) + probe(m.w_out, flag)

    return PipelineLoss(first=lambda m, batch: batch[0][0] @ m.w_in, stack=lambda m: m.blocks, last=last)


@dataclasses.dataclass(frozen=True)
class Case:
    plan: eqxpar.Plan
    model: Any
    loss: Any
    core: Callable[[int], Any]  # seed -> the mode's own batch
    spoil_row: Callable[[Any], Any]  # core -> the same with a NaN in one row
    leaf: Callable[[Any], jax.Array]  # the leaf whose gradient the probe makes NaN
    accumulate: int = 1


def _regression(seed, rows=16, d_in=16, d_out=4):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, d_in)).astype(np.float32), rng.normal(size=(rows, d_out)).astype(np.float32)


def _nan_in_row(core, row=3):
    x = np.array(core[0])
    x[row, 1] = np.nan
    return (x, *core[1:])


def _tokens(seed):
    tokens = np.asarray(jax.random.randint(jax.random.key(seed), (TP_ROWS, TP_SEQ + 1), 0, TP_VOCAB))
    return tokens[:, :-1], tokens[:, 1:], np.ones(TP_ROWS, np.float32)


def _nan_weight(core, row=5):
    weight = np.array(core[2])
    weight[row] = np.nan
    return (*core[:2], weight)


def _mlp():
    return eqx.nn.MLP(16, 4, 64, 1, key=jax.random.key(0))


@functools.cache
def case(mode: str) -> Case:
    mlp_leaf = lambda m: m.layers[1].weight  # noqa: E731
    if mode in ("dp", "dp_acc2"):
        plan = eqxpar.Plan(eqxpar.make_mesh(data=8))
        return Case(
            plan, _mlp(), with_probes(mse_loss, mlp_leaf), _regression, _nan_in_row, mlp_leaf,
            accumulate=2 if mode == "dp_acc2" else 1,
        )  # fmt: skip
    if mode == "fsdp_manual":
        plan = eqxpar.Plan(
            eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(axis="fsdp", min_size=64), mode="manual"
        )
        return Case(plan, _mlp(), with_probes(mse_loss, mlp_leaf), _regression, _nan_in_row, mlp_leaf)
    if mode == "tp_sp":
        plan = eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
        )
        leaf = lambda m: m.norm.weight  # noqa: E731  (replicated over tensor)
        model = TinyGPT(key=jax.random.key(0))
        return Case(plan, model, with_probes(weighted_cross_entropy, leaf), _tokens, _nan_weight, leaf)
    assert mode == "pipeline_1f1b"
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=2), rules=stage_rules(None), schedule="1f1b", microbatches=4
    )
    model = Tiny(4, key=jax.random.key(2))
    core = lambda seed: _regression(seed, rows=16, d_in=3, d_out=2)  # noqa: E731
    return Case(plan, model, pipeline_loss(), core, _nan_in_row, lambda m: m.w_out)


def batch(c: Case, seed: int, kind: str | None = None):
    core = c.core(seed)
    rows = len(core[0])
    extra, flag = np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    if kind == "nan_row":
        core = c.spoil_row(core)
    elif kind == "inf_loss":
        extra[rows - 1] = np.inf
    elif kind == "nan_grad":
        flag[:] = 1.0
    return core, extra, flag


OPTIMIZER = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)


@functools.cache
def steps(mode: str) -> tuple:
    """The mode's skipping and non-skipping steps, built once so that every kind
    reuses their compiled programs, and its initial state."""
    c = case(mode)
    make = functools.partial(eqxpar.train.make_step, c.loss, OPTIMIZER, c.plan, accumulate=c.accumulate)
    initial = eqxpar.train.init(c.model, OPTIMIZER, c.plan, key=jax.random.key(1))
    return make(skip_nonfinite=True), make(), initial


def copy(state):
    """A copy of `state` in new buffers (a step donates the ones it is given)."""
    return jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, state)


def trained(state):
    """The model and optimizer state as host bytes, in flattening order."""
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter((state.model, state.opt_state), eqx.is_array))]


def assert_bit_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert x.tobytes() == y.tobytes()


def adam_count(state) -> int:
    (count,) = {int(s.count) for s in jax.tree.leaves(state.opt_state, is_leaf=lambda s: hasattr(s, "count"))}
    return count


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["dp", "dp_acc2", "fsdp_manual", "tp_sp", "pipeline_1f1b"])
def test_a_nonfinite_step_is_skipped(mode, kind):
    c = case(mode)
    step, no_skip, initial = steps(mode)
    state, metrics = step(copy(initial), batch(c, 0))
    assert not bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 0
    before = trained(state)
    good_state = copy(state)

    state, metrics = step(state, batch(c, 1, kind))
    assert bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 1
    assert int(state.skipped_steps) == 1 and int(state.step) == 2  # the step counts the batch
    loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
    if kind == "inf_loss":
        assert loss == np.inf and np.isfinite(grad_norm)
    elif kind == "nan_grad":
        assert np.isfinite(loss) and np.isnan(grad_norm)
    else:
        assert np.isnan(loss) and np.isnan(grad_norm)
    # Parameters and optimizer state (optax's step count too) as they were.
    assert_bit_identical(trained(state), before)
    assert adam_count(state) == 1
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2)

    # The next good step trains as a run that never saw the bad batch.
    state, metrics = step(state, batch(c, 2))
    reference, ref_metrics = step(copy(good_state), batch(c, 2))
    assert not bool(metrics["skipped"]) and int(metrics["skipped_steps"]) == 1
    assert int(state.skipped_steps) == 1 and int(reference.skipped_steps) == 0
    assert adam_count(state) == adam_count(reference) == 2
    assert_trees_close(float(metrics["loss"]), float(ref_metrics["loss"]))
    assert_trees_close(trained(state), trained(reference))

    # Without the guard the update goes through, as before.
    state, metrics = no_skip(copy(good_state), batch(c, 1, kind))
    assert "skipped" not in metrics and int(state.skipped_steps) == 0 and adam_count(state) == 2
    params = eqx.filter(state.model, eqx.is_inexact_array)
    if kind == "inf_loss":  # a finite gradient: a normal update, reported with an infinite loss
        assert float(metrics["loss"]) == np.inf
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))
        assert not np.array_equal(trained(state)[0], before[0])
    elif kind == "nan_grad":  # only the probed leaf
        assert np.isnan(np.asarray(c.leaf(state.model))).all()
        assert sum(bool(np.isnan(x).any()) for x in jax.tree.leaves(params)) == 1
    else:  # the NaN row reaches the parameters (and Adam's moments, for good)
        assert any(np.isnan(x).any() for x in jax.tree.leaves(params))
        assert any(np.isnan(x).any() for x in trained(state)[len(jax.tree.leaves(params)) :])


def test_skipped_metrics_and_validation():
    c = case("dp")
    step, no_skip, initial = steps("dp")
    _, metrics = step(copy(initial), batch(c, 0))
    assert set(metrics) == {"loss", "grad_norm", "learning_rate", "skipped", "skipped_steps"}
    assert metrics["skipped"].dtype == jnp.bool_ and metrics["skipped_steps"].dtype == jnp.int32
    _, metrics = no_skip(copy(initial), batch(c, 0))
    assert set(metrics) == {"loss", "grad_norm", "learning_rate"}
    assert "skipped" not in metrics  # the default: no check
    with pytest.raises(eqxpar.PlanError, match=r"skip_nonfinite=1\b.*True or False"):
        eqxpar.train.make_step(mse_loss, OPTIMIZER, c.plan, skip_nonfinite=1)


def test_skip_monitor_stops_a_run_that_keeps_skipping():
    def metrics(skipped, total):
        return {
            "loss": jnp.asarray(np.nan if skipped else 1.0),
            "grad_norm": jnp.asarray(np.nan if skipped else 2.0),
            "skipped": jnp.asarray(skipped),
            "skipped_steps": jnp.asarray(total, jnp.int32),
        }

    monitor = eqxpar.train.SkipMonitor(max_consecutive=3)
    # Two bad steps, a good one, two more bad: never three in a row.
    for skipped, total in [(True, 1), (True, 2), (False, 2), (True, 3), (True, 4)]:
        monitor(metrics(skipped, total))
    assert monitor.consecutive == 2
    with pytest.raises(eqxpar.NonFiniteError, match=r"3 consecutive .*\(last loss nan.*5 skipped in all"):
        monitor(metrics(True, 5))
    with pytest.raises(eqxpar.PlanError, match=r"skip_nonfinite=True.*\['grad_norm', 'loss'\]"):
        monitor({"loss": jnp.asarray(1.0), "grad_norm": jnp.asarray(1.0)})
    with pytest.raises(eqxpar.PlanError, match=r"max_consecutive=0\b"):
        eqxpar.train.SkipMonitor(max_consecutive=0)


def test_train_state_built_by_hand_counts_from_zero():
    model = _mlp()
    state = eqxpar.train.TrainState(
        model=model,
        opt_state=OPTIMIZER.init(eqx.filter(model, eqx.is_array)),
        step=jnp.zeros((), jnp.int32),
        key=jax.random.key(0),
    )
    assert state.skipped_steps.dtype == jnp.int32 and int(state.skipped_steps) == 0
    c = case("dp")
    state, metrics = steps("dp")[0](state, batch(c, 0, "nan_row"))
    assert int(state.skipped_steps) == 1 and bool(metrics["skipped"])


def _fsdp_stack_step(mode: str):
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=FSDP_ONLY, mode=mode)
    loss = with_probes(cross_entropy_loss, lambda m: m.norm.weight)
    state = eqxpar.train.init(StackedLM(key=jax.random.key(0)), OPTIMIZER, plan, key=jax.random.key(1))
    return eqxpar.train.make_step(loss, OPTIMIZER, plan, skip_nonfinite=True), state


def _fsdp_stack_batch(seed: int, kind: str | None = None):
    core = fsdp_batches(seed + 1)[seed]
    rows = len(core[0])
    flag = np.full(rows, 1.0 if kind == "nan_grad" else 0.0, np.float32)
    return core, np.zeros(rows, np.float32), flag


CPU_OVERLAP_FIXED = tuple(int(p) for p in jaxlib.__version__.split(".")[:2]) >= (0, 12)


@pytest.mark.skipif(CPU_OVERLAP_FIXED, reason="the refusal applies to jaxlib < 0.12")
def test_automatic_fsdp_on_xla_cpu_before_jaxlib_0_12_is_refused():
    # An automatic FSDP step over a scanned stack hung on XLA:CPU with the check
    # (see eqxpar/_step.py _check_cpu_skip_nonfinite): refused before it compiles.
    step, state = _fsdp_stack_step("auto")
    with pytest.raises(
        eqxpar.PlanError, match=r"XLA:CPU with jaxlib .*\['fsdp'\].*mode='auto'.*apply_if_finite"
    ):
        step(state, _fsdp_stack_batch(0))
    # The same plan with the gathers by hand skips a bad batch.
    step, state = _fsdp_stack_step("manual")
    state, _ = step(state, _fsdp_stack_batch(0))
    before = trained(state)
    state, metrics = step(state, _fsdp_stack_batch(1, "nan_grad"))
    assert bool(metrics["skipped"]) and np.isnan(float(metrics["grad_norm"]))
    assert_bit_identical(trained(state), before)
    # So does automatic FSDP over a model without a loop (the hang needs one).
    c = dataclasses.replace(
        case("fsdp_manual"), plan=eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=64))
    )
    fresh = eqxpar.train.init(c.model, OPTIMIZER, c.plan, key=jax.random.key(1))
    layout = eqxpar.internal.StepLayout.of(
        eqxpar.internal.ResolvedPlan.of(c.plan), fresh.model, fresh.opt_state
    )
    assert any(
        s is not None and "fsdp" in s
        for s in jax.tree.leaves(layout.params, is_leaf=lambda s: isinstance(s, jax.P))
    )
    step = eqxpar.train.make_step(c.loss, OPTIMIZER, c.plan, skip_nonfinite=True)
    state = eqxpar.train.init(c.model, OPTIMIZER, c.plan, key=jax.random.key(1))
    state, _ = step(state, batch(c, 0))
    before = trained(state)
    state, metrics = step(state, batch(c, 1, "nan_row"))
    assert bool(metrics["skipped"])
    assert_bit_identical(trained(state), before)


@pytest.mark.skipif(not CPU_OVERLAP_FIXED, reason="jaxlib < 0.12 refuses this step on XLA:CPU")
def test_automatic_fsdp_over_a_scanned_stack_skips():
    step, state = _fsdp_stack_step("auto")
    state, metrics = step(state, _fsdp_stack_batch(0))
    assert not bool(metrics["skipped"])
    before = trained(state)
    state, metrics = step(state, _fsdp_stack_batch(1, "nan_grad"))
    assert bool(metrics["skipped"]) and np.isnan(float(metrics["grad_norm"]))
    assert_bit_identical(trained(state), before)
    state, metrics = step(state, _fsdp_stack_batch(2))
    assert not bool(metrics["skipped"]) and int(state.skipped_steps) == 1
