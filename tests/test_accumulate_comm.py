"""Gradient accumulation moves the bytes of one batch: `make_step(accumulate=k)`
reduces the gradients once per step under every plan (no reduction per
micro-batch), and still equals the single-device gradients."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar

from ._helpers import LogicalMLP, assert_trees_close, mse_loss

K = 3
ROWS = 48  # divides every data-parallel size below times K


def _mlp():
    return (
        LogicalMLP(32, 32, 32, key=jax.random.key(0)),
        mse_loss,
        (
            jax.random.normal(jax.random.key(1), (ROWS, 32)),
            jax.random.normal(jax.random.key(2), (ROWS, 32)),
        ),
    )


def _classifier():
    model = eqxpar.models.MLPClassifier(32, 64, 8, depth=1, key=jax.random.key(0))
    batch = (
        jax.random.normal(jax.random.key(1), (ROWS, 32)),
        jax.random.randint(jax.random.key(2), (ROWS,), 0, 8),
    )
    return model, eqxpar.models.MLPClassifier.loss, batch


def _plan(name):
    mesh, rules = eqxpar.make_mesh, eqxpar.rules
    return {
        "dp_auto": lambda: eqxpar.Plan(mesh(data=8)),
        "dp_manual": lambda: eqxpar.Plan(mesh(data=8), mode="manual"),
        "fsdp_auto": lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP()),
        "fsdp_manual": lambda: eqxpar.Plan(mesh(fsdp=8), rules=rules.FSDP(), mode="manual"),
        "hsdp": lambda: eqxpar.Plan(mesh(data=2, fsdp=4), rules=rules.FSDP(), mode="manual"),
        "zero1": lambda: eqxpar.Plan(mesh(data=8), zero1=True),
        "tp_auto": lambda: eqxpar.Plan(mesh(data=2, tensor=4), rules=rules.MEGATRON),
        "tp_partial": lambda: eqxpar.Plan(
            mesh(data=2, tensor=4), rules=rules.MEGATRON, mode="manual", manual_axes=("tensor",)
        ),
        "fsdp_tp": lambda: eqxpar.Plan(
            mesh(data=2, fsdp=2, tensor=2), rules=rules.MEGATRON_FSDP, mode="manual"
        ),
    }[name]()


CASES = {
    "dp_auto": _mlp,
    "dp_manual": _mlp,
    "fsdp_auto": _mlp,
    "fsdp_manual": _mlp,
    "hsdp": _mlp,
    "zero1": _mlp,
    "tp_auto": _classifier,
    "tp_partial": _classifier,
    "fsdp_tp": _classifier,
}


def _stats(plan, model, loss_fn, batch, k):
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    compiled = eqxpar.train.make_step(loss_fn, optim, plan, accumulate=k).compile(state, batch)
    return eqxpar.inspect.collective_stats(compiled)


@pytest.mark.parametrize("name", list(CASES))
def test_accumulation_reduces_once_per_step(name):
    model, loss_fn, batch = CASES[name]()
    plan = _plan(name)
    one, many = _stats(plan, model, loss_fn, batch, 1), _stats(plan, model, loss_fn, batch, K)
    # Per micro-batch reductions would multiply the gradient bytes by K. (A few
    # bytes of slack: the loss's scalar mean may ride in another all-reduce.)
    assert many.total_wire_bytes <= one.total_wire_bytes + 8, (name, one.as_dict(), many.as_dict())
    # The gradient reductions (and FSDP's gathers) run once, outside the
    # micro-batch loop; only tensor-parallel activations' collectives may be inside.
    looped = {k for k, n in many.in_loops.items() if n}
    if name.startswith(("dp", "fsdp_auto", "fsdp_manual", "hsdp", "zero1")):
        assert not looped, (name, many.in_loops)
    else:
        assert "all-gather" not in looped and "reduce-scatter" not in looped, (name, many.in_loops)


@pytest.mark.parametrize("name", ["dp_auto", "fsdp_auto", "fsdp_manual", "hsdp", "tp_auto", "fsdp_tp"])
def test_accumulated_gradients_equal_one_device(name):
    model, loss_fn, batch = CASES[name]()
    ref_loss, ref_grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
    loss, grads = eqxpar.train.make_value_and_grad(loss_fn, _plan(name), accumulate=K)(model, batch)
    assert_trees_close(loss, ref_loss)
    assert_trees_close(grads, eqx.filter(ref_grads, eqx.is_inexact_array))


def test_accumulated_fsdp_gathers_once_in_the_compute_dtype():
    # Under compute_dtype=bfloat16 the one-batch FSDP step gathers bfloat16
    # weights; the accumulating step gathers once, before its loop, in the same
    # dtype, and still returns float32 gradients.
    model, loss_fn, batch = _mlp()
    plan = eqxpar.Plan(
        eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), mode="manual", compute_dtype=jnp.bfloat16
    )
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss_fn, optim, plan, accumulate=K)
    # Read from the lowered program: XLA:CPU itself moves bfloat16 collectives as
    # float32 after optimisation, in both steps alike.
    gathers = re.findall(
        r'"stablehlo.all_gather".*?-> tensor<[0-9x]*x(\w+)>', step.lower(state, batch).as_text()
    )
    assert gathers == ["bf16", "bf16"], gathers
    new_state, metrics = step(state, batch)
    assert new_state.model.w1.dtype == jnp.float32
    cast = lambda t: jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, t)  # noqa: E731
    ref_loss = float(loss_fn(cast(model), cast(batch)))
    assert abs(float(metrics["loss"]) - ref_loss) <= 2e-2 * abs(ref_loss)
