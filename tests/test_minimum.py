"""eqxpar.inspect.minimum_comm, the theoretical minimum communication of a plan:
checked against the wire bytes of compiled steps where eqxpar moves exactly that
(data parallel, manual FSDP under each remat policy, ZeRO-1, HSDP, tensor and
sequence parallel), against hand counts (tensor-parallel activations, pipeline
boundaries), through comm_report for tensor-parallel and pipeline plans, and on
model/plan combinations it cannot describe."""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

import eqxpar
from eqxpar import inspect as ei
from eqxpar import nn

from ._helpers import LogicalMLP, mse_loss

F32 = 4
#: What a compiled step moves beyond the minimum at most, in wire bytes: its scalar
#: reductions (the loss and the gradient-norm partial sums, 4 bytes each, all-reduced
#: over up to 8 devices), which the minimum does not count.
SCALARS = 256


def _ring_all_reduce(nbytes: int, n: int) -> int:
    return 2 * (n - 1) * nbytes // n


class TinyLM(eqx.Module):
    """A 2-layer `eqxpar.nn` transformer (fused QKV), embedding and head replicated,
    as the benchmarks' tensor-parallel workload is written."""

    embed: Float[Array, "vocab d"] = eqxpar.param(axes=(None, "embed"))
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head: Float[Array, "d vocab"] = eqxpar.param(axes=("embed", None))

    def __init__(self, *, vocab: int = 32, d: int = 32, layers: int = 2, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = 0.02 * jax.random.normal(k1, (vocab, d))
        self.blocks = nn.Stacked(
            lambda k: nn.TransformerBlock(
                d, 2 * d, nn.BlockConfig(nn.AttentionConfig(4, fused_qkv=True)), key=k
            ),
            depth=layers,
            key=k2,
        )
        self.norm = nn.LayerNorm(d)
        self.head = jax.random.normal(k3, (d, vocab)) / d**0.5


def _first(model: TinyLM, batch):
    return jnp.take(model.embed, nn.split_sequence(batch[0]), axis=0)


def _last(model: TinyLM, h, batch):
    logits = jnp.tensordot(model.norm(h), model.head, axes=1)
    per_token = optax.softmax_cross_entropy_with_integer_labels(logits, nn.split_sequence(batch[1]))
    return nn.sequence_mean(per_token)


#: TinyLM's loss, usable by pipeline plans and (called whole) by any other.
LM_LOSS = eqxpar.pipeline.PipelineLoss(_first, lambda m: m.blocks, _last)
BATCH, SEQ, D, LAYERS = 8, 8, 32, 2


def _tokens():
    t = jax.random.randint(jax.random.key(3), (BATCH, SEQ + 1), 0, 32)
    return t[:, :-1], t[:, 1:]


def _compiled(plan, model, loss, batch):
    optim = optax.adam(1e-3)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(loss, optim, plan)
    return step, state, ei.collective_stats(step.compile(state, batch))


def _mlp_case():
    batch = (jnp.ones((64, 16)), jnp.zeros((64, 8)))
    return LogicalMLP(16, 64, 8, key=jax.random.key(0)), mse_loss, batch


PARAM_PLANS = {
    "dp": lambda m: eqxpar.Plan(m(data=8)),
    "fsdp_manual": lambda m: eqxpar.Plan(m(fsdp=8), rules=eqxpar.rules.FSDP(min_size=256), mode="manual"),
    "zero1": lambda m: eqxpar.Plan(m(data=8), zero1=True),
    "hsdp": lambda m: eqxpar.Plan(m(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=256), mode="manual"),
}


@pytest.mark.parametrize("name", list(PARAM_PLANS))
def test_parameter_plans_move_the_minimum(name):
    plan = PARAM_PLANS[name](eqxpar.make_mesh)
    model, loss, batch = _mlp_case()
    _, state, stats = _compiled(plan, model, loss, batch)
    low = ei.minimum_comm(plan, state.model)
    # Gathers and reduce-scatters exactly; all-reduces plus the step's scalars.
    for kind in ("all-gather", "reduce-scatter"):
        assert stats.wire_bytes[kind] == low.wire_bytes.get(kind, 0), kind
    assert 0 <= stats.total_wire_bytes - low.total_wire_bytes <= SCALARS
    # By hand: w1, w2 split (FSDP) or not; b1 replicated; ring over 8 devices.
    split, replicated = (16 * 64 + 64 * 8) * F32, 64 * F32
    if name == "dp":
        assert low.wire_bytes == {"all-reduce": _ring_all_reduce(split + replicated, 8)}
    elif name == "fsdp_manual":
        assert low.bytes == {"all-gather": split, "reduce-scatter": split // 8, "all-reduce": replicated}


@pytest.mark.parametrize(("remat", "gathers"), [("none", 1), ("inputs", 2), ("full", 3)])
def test_fsdp_gathers_once_when_kept_and_again_under_remat(remat, gathers):
    # A scanned stack keeps its gathered weights for the backward pass only under
    # remat "none"; "inputs" gathers again for the backward, "full" once more for
    # the recomputed forward. The compiled manual step gathers exactly that often.
    plan = eqxpar.Plan(
        eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=256), mode="manual", remat=remat
    )
    _, state, stats = _compiled(plan, TinyLM(key=jax.random.key(0)), LM_LOSS, _tokens())
    low = ei.minimum_comm(plan, state.model)
    once = ei.minimum_comm(plan, state.model, gathers=1)
    assert stats.wire_bytes["all-gather"] == low.wire_bytes["all-gather"]
    assert stats.wire_bytes["reduce-scatter"] == low.wire_bytes["reduce-scatter"]
    assert 0 <= stats.total_wire_bytes - low.total_wire_bytes <= SCALARS
    # The stack's weights `gathers` times, the embedding and head (outside it) once.
    stack = low.parts[f"FSDP all-gather over fsdp=8 ({gathers} per step)"]
    assert low.wire_bytes["all-gather"] - once.wire_bytes["all-gather"] == (gathers - 1) * stack[1] // gathers
    assert gathers == 1 or "FSDP all-gather over fsdp=8 (1 per step)" in low.parts


@pytest.fixture(scope="module")
def tensor_parallel():
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON)
    batch = _tokens()
    step, state, stats = _compiled(plan, TinyLM(key=jax.random.key(0)), LM_LOSS, batch)
    return plan, step, state, batch, stats


def test_tensor_parallel_minimum_counts_four_activation_sums_per_layer(tensor_parallel):
    plan, _, state, batch, stats = tensor_parallel
    low = ei.minimum_comm(plan, state.model, loss=LM_LOSS, batch=batch)
    # Per layer: the attention and MLP outputs summed forward, their inputs'
    # cotangents backward, each an activation (batch / data, seq, d) over tensor=4.
    activation = (BATCH // 2) * SEQ * D * F32
    for where in ("forward", "backward"):
        assert low.parts[f"tensor-parallel activation sums ({where})"] == (
            2 * LAYERS * activation,
            2 * LAYERS * _ring_all_reduce(activation, 4),
        )
    sums = [c for c in low.costs if c.source == "tensor sums"]
    assert [(c.kind, c.axes) for c in sums] == [("all-reduce", ("tensor",))] * 2
    assert sum(c.wire_bytes for c in sums) == 4 * LAYERS * _ring_all_reduce(activation, 4)
    # A loss taking key= (as make_step allows) is traced with one.
    keyed = ei.minimum_comm(plan, state.model, loss=lambda m, b, key: LM_LOSS(m, b), batch=batch)
    assert keyed == low
    # Automatic (GSPMD) tensor parallelism moves exactly that, plus the scalars.
    assert 0 <= stats.total_wire_bytes - low.total_wire_bytes <= SCALARS


def test_sequence_parallel_moves_the_minimum_plus_replicated_gradients_over_tensor():
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    )
    batch = _tokens()
    _, state, stats = _compiled(plan, TinyLM(key=jax.random.key(0)), LM_LOSS, batch)
    low = ei.minimum_comm(plan, state.model, loss=LM_LOSS, batch=batch)
    # The same activation wire bytes as all-gathers + reduce-scatters...
    activations = sum(w for part, (_, w) in low.parts.items() if part.startswith("tensor-parallel"))
    assert stats.wire_bytes["all-gather"] + stats.wire_bytes["reduce-scatter"] == activations
    # ...and the documented overhead the minimum leaves out: weights replicated over
    # tensor (embedding, head, norms, row biases) get gradients from sequence blocks,
    # summed over data x tensor (8 devices) rather than data (2).
    specs = jax.tree.leaves(eqxpar.partition_specs(state.model, plan), is_leaf=lambda s: isinstance(s, P))
    weights = jax.tree.leaves(eqx.filter(state.model, eqx.is_inexact_array))
    replicated = sum(x.nbytes for x, s in zip(weights, specs, strict=True) if "tensor" not in str(s))
    overhead = _ring_all_reduce(replicated, 8) - _ring_all_reduce(replicated, 2)
    assert 0 <= stats.total_wire_bytes - (low.total_wire_bytes + overhead) <= SCALARS


def test_comm_report_shows_the_minimum_of_tensor_and_pipeline_plans(tensor_parallel):
    _, step, state, batch, _ = tensor_parallel
    report = ei.comm_report(step, state, batch)
    assert report.minimum is not None and "n/a" not in str(report)
    assert "tensor parallel over tensor=4" in str(report)
    # 3D: pipe 2 x data 2 x tensor 2, 1F1B, 4 micro-batches.
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=2, tensor=2),
        rules=eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON),
        schedule="1f1b",
        microbatches=4,
    )
    step, state, _ = _compiled(plan, TinyLM(key=jax.random.key(0)), LM_LOSS, batch)
    report = ei.comm_report(step, state, batch)
    text = str(report)
    assert report.minimum is not None and "n/a" not in text and "pipeline over pipe=2" in text
    # Each stage sends every micro-batch's activation one way: (8 / 2 / 4, seq, d).
    micro = (BATCH // 2 // 4) * SEQ * D * F32
    assert report.minimum.bytes["collective-permute"] == 4 * micro
    # Its stage's layer (of 2) for every micro-batch, 4 sums each over tensor=2.
    assert report.minimum.parts["tensor-parallel activation sums (forward)"] == (2 * 4 * micro, 2 * 4 * micro)
    # Each device counts its own branch of each tick (a stage idling in a fill or
    # drain tick sums nothing there): the engine moves its minimum, give or take the
    # scalars the step adds. Counted at each tick's costliest branch it was 1.10x.
    assert 1.0 <= report.wire_ratio_to_minimum <= 1.01, text


@pytest.mark.parametrize(
    "name,tensor",
    # In make test-slow (50 s each on 2 cores); tests/test_pipeline.py holds the V's
    # permutes to what the schedule moves in make test.
    [
        pytest.param("zb_v", 1, marks=pytest.mark.slow),
        pytest.param("zb_v", 2, marks=pytest.mark.slow),
        pytest.param("dualpipe_v", 2, marks=pytest.mark.slow),
    ],
)
def test_v_pipeline_moves_its_minimum(name, tensor):
    # pipe 2 x data 2 (x tensor 2) in a V: device 0 runs stages 0 and 3 (the
    # embedding and the head), device 1 stages 1 and 2, handing stage 1's
    # activation and stage 2's cotangent over on the device. So each device sends
    # 2 m micro-batch buffers (interleaved's end devices send 3 m), and the
    # engine's permutes are that minimum (one lane each way, from the devices
    # with something due), with the tensor sums of each device's own branches.
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=2, tensor=tensor),
        rules=eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON if tensor > 1 else None),
        schedule=name,
        microbatches=4,
    )
    batch = _tokens()
    step, state, _ = _compiled(plan, TinyLM(layers=4, key=jax.random.key(0)), LM_LOSS, batch)
    report = ei.comm_report(step, state, batch)
    text = str(report)
    micro = (BATCH // 2 // 4) * SEQ * D * F32
    assert report.minimum.parts["pipeline stage boundaries"] == (2 * 4 * micro,) * 2, text
    interleaved = dataclasses.replace(plan, schedule="interleaved")
    low = ei.minimum_comm(interleaved, state.model, loss=LM_LOSS, batch=batch)
    assert low.parts["pipeline stage boundaries"] == (3 * 4 * micro,) * 2
    assert 1.0 <= report.wire_ratio_to_minimum <= 1.01, text


def test_pipeline_minimum_by_hand():
    # pipe 4 x data 2, interleaved (2 chunks), 8 micro-batches: a middle device sends
    # 2 m v activations; stack gradients over data, the rest over pipe x data.
    plan = eqxpar.Plan(
        eqxpar.make_mesh(pipe=4, data=2),
        rules=eqxpar.pipeline.stage_rules(),
        schedule="interleaved",
        microbatches=8,
        chunks=2,
    )
    model = eqx.filter_eval_shape(lambda: TinyLM(layers=8, key=jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((16, SEQ), jnp.int32), jax.ShapeDtypeStruct((16, SEQ), jnp.int32)
    low = ei.minimum_comm(plan, model, loss=LM_LOSS, batch=batch)
    micro = (16 // 2 // 8) * SEQ * D * F32
    assert low.parts["pipeline stage boundaries"] == (2 * 8 * 2 * micro,) * 2
    outside = eqx.tree_at(lambda m: m.blocks, model, None)
    stack = sum(math.prod(x.shape) * F32 for x in jax.tree.leaves(model.blocks)) // 4
    rest = sum(math.prod(x.shape) * F32 for x in jax.tree.leaves(outside))
    assert low.parts["gradient all-reduce over data=2"] == (stack, stack)
    assert low.parts["gradient all-reduce over data=2 x pipe=4"] == (rest, _ring_all_reduce(rest, 8))
    # The same parts as data: what the advisor reads (never the labels).
    costs = {c.label: c for c in low.costs}
    assert {label: (c.bytes, c.wire_bytes) for label, c in costs.items()} == low.parts
    boundary = costs["pipeline stage boundaries"]
    assert (boundary.kind, boundary.axes, boundary.source) == (
        "collective-permute",
        ("pipe",),
        "pipeline boundaries",
    )
    outer = costs["gradient all-reduce over data=2 x pipe=4"]
    assert (outer.kind, outer.axes, outer.source) == ("all-reduce", ("data", "pipe"), "gradient reduction")


def test_v_pipeline_minimum_by_hand():
    # pipe 4 x data 2 in a V, 8 micro-batches: device 0 runs stages 0 and 7 (an
    # activation on, a cotangent back: 2 m), device 3 the turn (stages 3 and 4: a
    # cotangent back and an activation on, the hand-over between them local: 2 m),
    # the middle devices 4 m = 2 m v, as interleaved's; at pipe 2 every device 2 m.
    model = eqx.filter_eval_shape(lambda: TinyLM(layers=8, key=jax.random.key(0)))
    batch = jax.ShapeDtypeStruct((16, SEQ), jnp.int32), jax.ShapeDtypeStruct((16, SEQ), jnp.int32)
    micro = (16 // 2 // 8) * SEQ * D * F32
    for pipe, sends in ((4, 2 * 8 * 2), (2, 2 * 8)):
        for name in ("zb_v", "dualpipe_v"):
            plan = eqxpar.Plan(
                eqxpar.make_mesh(pipe=pipe, data=2),
                rules=eqxpar.pipeline.stage_rules(),
                schedule=name,
                microbatches=8,
            )
            low = ei.minimum_comm(plan, model, loss=LM_LOSS, batch=batch)
            assert low.parts["pipeline stage boundaries"] == (sends * micro,) * 2, (pipe, name)
    from eqxpar.inspect._minimum import boundary_sends

    assert boundary_sends(4, 2, 8, "v") == [16, 32, 32, 16]
    assert boundary_sends(4, 2, 8, "interleaved") == [24, 32, 32, 24]
    assert boundary_sends(1, 2, 8, "v") == [0]


class _ScaledMLP(eqx.Module):
    """A weight split over tensor that no matmul uses: only multiplied elementwise."""

    scale: Float[Array, " d"] = eqxpar.param(axes=("mlp",))

    def __call__(self, x):
        return x * self.scale[None, :]


def test_what_minimum_comm_cannot_describe_raises_eqxpar_errors():
    model, loss, batch = _mlp_case()
    mesh = eqxpar.make_mesh(data=2, fsdp=4)
    # FSDP over an axis that does not split the batch: no layout eqxpar knows.
    plan = eqxpar.Plan(mesh, batch_axes="data", rules=eqxpar.rules.FSDP(axis="fsdp", min_size=256))
    with pytest.raises(eqxpar.PlanError, match=r"\.w1 has spec .*'fsdp', which is neither a batch axis"):
        ei.minimum_comm(plan, model)
    tp = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON)
    scaled = _ScaledMLP(jnp.ones(8))
    x = (jnp.ones((8, 8)), jnp.ones((8, 8)))
    with pytest.raises(eqxpar.PlanError, match=r"no matmul or lookup of the loss uses a split dimension"):
        ei.minimum_comm(tp, scaled, loss=lambda m, b: jnp.mean(m(b[0]) - b[1]), batch=x)
    with pytest.raises(eqxpar.PlanError, match=r"tracing loss\(model, batch\).*failed \(AttributeError"):
        ei.minimum_comm(tp, TinyLM(key=jax.random.key(0)), loss=lambda m, b: m.missing(b), batch=x)
    pipe = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=4), rules=eqxpar.pipeline.stage_rules(), schedule="gpipe"
    )
    with pytest.raises(eqxpar.PlanError, match=r"needs the eqxpar.pipeline.PipelineLoss"):
        ei.minimum_comm(pipe, TinyLM(key=jax.random.key(0)), loss=mse_loss, batch=_tokens())
    with pytest.raises(eqxpar.PlanError, match=r"pipelines a stack.*Pass loss="):
        ei.minimum_comm(pipe, TinyLM(key=jax.random.key(0)))
    with pytest.raises(eqxpar.PlanError, match=r"gathers=0\): expected a positive int"):
        ei.minimum_comm(PARAM_PLANS["dp"](eqxpar.make_mesh), model, gathers=0)
    with pytest.raises(eqxpar.PlanError, match=r"moved_dtype='nope'\): not a dtype"):
        ei.minimum_comm(PARAM_PLANS["dp"](eqxpar.make_mesh), model, moved_dtype="nope")
    with pytest.raises(eqxpar.PlanError, match=r"minimum_comm\(plan=.*expected an eqxpar.Plan"):
        ei.minimum_comm("data parallel", model)
    with pytest.raises(eqxpar.EqxparError, match=r"no floating-point arrays"):
        ei.minimum_comm(PARAM_PLANS["dp"](eqxpar.make_mesh), {"steps": jnp.zeros(3, jnp.int32)})
