"""Tensor-parallel training steps: `make_step` under every tensor-parallel plan
equals single-device training over several steps; partial-manual plans keep the
batch split over the automatic data axis and every non-ring collective out of the
ring loops (read from the compiled HLO); misuse raises eqxpar errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar import nn

from ._helpers import (
    TINY_GPT_BATCH,
    TINY_GPT_SEQ,
    TINY_GPT_VOCAB,
    TinyGPT,
    assert_trees_close,
    assert_trees_close_to_scale,
    cross_entropy_loss,
    reference_run,
    run_steps,
)

VOCAB, SEQ, BATCH = TINY_GPT_VOCAB, TINY_GPT_SEQ, TINY_GPT_BATCH


def batches(n):
    key = jax.random.key(7)
    out = []
    for i in range(n):
        tokens = jax.random.randint(jax.random.fold_in(key, i), (BATCH, SEQ + 1), 0, VOCAB)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


PLANS = {
    "auto": dict(mode="auto"),
    "sync": dict(mode="manual"),
    "sp": dict(mode="manual", sequence_parallel=True),
    "overlap": dict(mode="manual", sequence_parallel=True, tp_overlap=True),
    "partial_sync": dict(mode="manual", manual_axes=("tensor",)),
    "partial_sp": dict(mode="manual", manual_axes=("tensor",), sequence_parallel=True),
    "partial_overlap": dict(mode="manual", manual_axes=("tensor",), sequence_parallel=True, tp_overlap=True),
}


def make_plan(name, *, data=2, tensor=4):
    return eqxpar.Plan(eqxpar.make_mesh(data=data, tensor=tensor), rules=eqxpar.rules.MEGATRON, **PLANS[name])


@pytest.fixture(scope="module")
def reference():
    model = TinyGPT(key=jax.random.key(0))
    optim = optax.sgd(0.5)
    losses, trained = reference_run(model, optim, cross_entropy_loss, batches(3))
    return model, optim, losses, trained


def run_plan(plan, model, optim, *, accumulate=1):
    step = eqxpar.train.make_step(cross_entropy_loss, optim, plan, accumulate=accumulate)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    losses, state = run_steps(step, state, batches(3))
    return losses, state.model


CASES = [(name, 2, 4, 1) for name in PLANS] + [
    ("sync", 1, 8, 1),
    ("overlap", 4, 2, 1),
    ("sp", 2, 4, 2),
    ("partial_overlap", 2, 4, 2),
]


@pytest.mark.parametrize(
    "name,data,tensor,accumulate", CASES, ids=[f"{n}-d{d}t{t}-acc{a}" for n, d, t, a in CASES]
)
def test_tp_step_matches_single_device(reference, name, data, tensor, accumulate):
    model, optim, ref_losses, ref_model = reference
    losses, trained = run_plan(make_plan(name, data=data, tensor=tensor), model, optim, accumulate=accumulate)
    assert_trees_close(losses, ref_losses)
    assert_trees_close_to_scale(trained, ref_model)


def compiled_step(name):
    plan = make_plan(name)
    optim = optax.sgd(0.1)
    model = TinyGPT(key=jax.random.key(0))
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    return eqxpar.train.make_step(cross_entropy_loss, optim, plan).compile(state, batches(1)[0])


@pytest.mark.parametrize("mode", ["sync", "sp", "overlap"])
def test_partial_manual_keeps_the_batch_split_and_reductions_out_of_loops(mode):
    full = compiled_step(mode)
    partial = compiled_step(f"partial_{mode}")
    # Per-device FLOPs: had the partial-manual region gathered the batch over the
    # automatic data axis, every device would compute on the whole batch (~2x).
    ratio = partial.cost_analysis()["flops"] / full.cost_analysis()["flops"]
    assert 0.97 < ratio < 1.03, ratio
    for compiled in (full, partial):
        stats = eqxpar.inspect.collective_stats(compiled)
        # Only the rings' permutes run inside loops; the gradient reductions (over
        # data, and over tensor for replicated weights) come once, after them.
        assert set(stats.in_loops) <= {"collective-permute"}, stats.in_loops
        if mode == "overlap":
            assert stats.in_loops["collective-permute"] > 0
    stats = eqxpar.inspect.collective_stats(partial)
    if mode != "sync":
        # Sequence parallel in a partial-manual region: the gathers and scatters run
        # as permute rings (XLA would gather the data-split batch for a plain
        # all-gather there), and move the same wire bytes as the full region's
        # all-gathers and reduce-scatters (or rings). (The gradient all-reduces differ: the full
        # region sums replicated weights over data and tensor at once.)
        full_stats = eqxpar.inspect.collective_stats(full)
        activations = sum(
            full_stats.wire_bytes[k] for k in ("all-gather", "reduce-scatter", "collective-permute")
        )
        assert stats.wire_bytes["collective-permute"] == activations


def test_manual_axes_validation():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    with pytest.raises(eqxpar.PlanError, match="needs mode='manual'"):
        eqxpar.Plan(mesh, manual_axes=("tensor",))
    with pytest.raises(eqxpar.AxisNameError, match="'model'"):
        eqxpar.Plan(mesh, mode="manual", manual_axes=("model",))
    with pytest.raises(eqxpar.PlanError, match="at least one axis"):
        eqxpar.Plan(mesh, mode="manual", manual_axes=())
    partial = eqxpar.Plan(mesh, mode="manual", manual_axes="tensor")
    assert partial.manual_axes == ("tensor",)
    # The plan keeps what was asked (None: the default, every axis); the step's
    # layout says which axes it runs by hand.
    manual = eqxpar.Plan(mesh, mode="manual")
    assert manual.manual_axes is None
    outline = {"w": jnp.zeros(8)}
    assert eqxpar.internal.StepLayout.of(eqxpar.internal.ResolvedPlan.of(manual), outline).manual_axes == set(
        mesh.axis_names
    )
    assert eqxpar.internal.StepLayout.of(eqxpar.internal.ResolvedPlan.of(partial), outline).manual_axes == {
        "tensor"
    }
    assert (
        eqxpar.internal.StepLayout.of(eqxpar.internal.ResolvedPlan.of(eqxpar.Plan(mesh)), outline).kind
        == "automatic"
    )


def _group_axes(groups: str) -> frozenset[str]:
    """The mesh axes (of size > 1) an all-reduce's `replica_groups` reduces over, in
    either of XLA's spellings: device lists (`{{0,1,2,3},{4,5,6,7}}`, JAX 0.10) or
    the named mesh (`mesh['data'=2,...,'tensor'=4] {'tensor'}`, JAX 0.12)."""
    import re

    named = re.fullmatch(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", groups)
    if named:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
        return frozenset(a for a in re.findall(r"'(\w+)'", named.group(2)) if int(sizes[a]) > 1)
    # data 2 x tensor 4, devices in mesh order: tensor is the fastest-moving axis.
    lists = {"{{0,1,2,3},{4,5,6,7}}": {"tensor"}, "{{0,1,2,3,4,5,6,7}}": {"data", "tensor"}}
    return frozenset(lists.get(groups, {groups}))


def _all_reduces(compiled):
    """(mesh axes reduced over, result bytes, op_name) of each all-reduce of a compiled step."""
    import re

    from eqxpar.inspect import shape_bytes

    out = []
    for line in compiled.as_text().splitlines():
        m = re.search(
            r"= (.+?) all-reduce(?:-start)?\(.*replica_groups=(\{[^ ]*\}|\[[^ ]*\]|mesh\[[^\]]*\] \{[^}]*\})",
            line,
        )
        if m:
            name = re.search(r'op_name="([^"]*)"', line)
            out.append((_group_axes(m.group(2)), shape_bytes(m.group(1)), name.group(1) if name else ""))
    return out


def test_sequence_parallel_sums_replicated_gradients_in_one_all_reduce():
    # Under sequence parallelism each device holds partial gradients of the
    # weights replicated over `tensor` (norms, row biases): they are summed over
    # data and tensor in one all-reduce, not over tensor (autodiff, in the
    # backward pass) and then over data (the step). Over tensor alone only the
    # forward pass reduces (the vocabulary-parallel cross-entropy's max and sums).
    reductions = _all_reduces(compiled_step("sp"))
    assert reductions and all(g for g, _, _ in reductions), reductions
    backward_over_tensor = [r for r in reductions if r[0] == {"tensor"} and "transpose(" in r[2]]
    assert not backward_over_tensor, backward_over_tensor
    assert sum(b for g, b, _ in reductions if g == {"data", "tensor"}) > 0, reductions


class ScaledGPT(eqx.Module):
    gpt: TinyGPT
    scale: jax.Array


def scaled_loss(model, batch):
    ids, labels = batch
    return jnp.mean(nn.cross_entropy(model.gpt(ids), labels, head=model.gpt.head)) * model.scale


def test_sequence_parallel_weight_used_off_the_sequence_blocks():
    # A replicated weight that meets the loss after the sequence reduction (a
    # scale) has no per-device partials: the step falls back to autodiff's sum
    # over tensor for the whole model and still trains like one device.
    model = ScaledGPT(TinyGPT(key=jax.random.key(0)), jnp.asarray(1.5))
    optim = optax.sgd(0.5)
    ref_losses, ref_model = reference_run(model, optim, scaled_loss, batches(3))
    plan = make_plan("sp")
    step = eqxpar.train.make_step(scaled_loss, optim, plan)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    losses, state = run_steps(step, state, batches(3))
    assert_trees_close(losses, ref_losses)
    assert_trees_close_to_scale(state.model, ref_model)
