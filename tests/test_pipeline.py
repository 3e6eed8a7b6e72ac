"""Pipeline-parallel steps: every schedule gives the loss and gradients of the
sequential single-device model; the 3D hybrid (pipe x data x tensor) trains like
one device over several steps; 1F1B's compiled temp memory does not grow with
the micro-batches while GPipe's does; bad input raises eqxpar errors."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar import nn
from eqxpar.pipeline import PipelineLoss, from_pipeline_order, stage_rules, to_pipeline_order

from ._helpers import (
    PIPELINE_ROWS,
    TINY_D,
    TINY_IN,
    RecordedGradients,
    Tiny,
    assert_steps_match_one_device,
    assert_trees_close,
    assert_trees_close_to_scale,
    pipeline_plan,
    record_gradients,
    recorded_gradients,
    reference_run,
    regression_batch,
    run_steps,
    tiny_loss,
)

# (schedule, chunks, stages, micro-batches per stage): a Latin square, so every
# schedule meets every stage count and every micro-batch multiple, and every stage
# count every multiple, in 15 cases rather than the 45 of the whole product.
VARIANTS = [("gpipe", 1), ("1f1b", 1), ("interleaved", 1), ("interleaved", 2), ("zero_bubble", 1)]
CASES = [
    (name, chunks, stages, (1, 2, 4)[(i + j) % 3])
    for i, (name, chunks) in enumerate(VARIANTS)
    for j, stages in enumerate((1, 2, 4))
]


# The V placement (two chunks per device, device d holding stages d and 2p-1-d):
# at pipe 1 every hand-over is local; at pipe 2 and 4 a device gets two
# activations (cotangents) in one tick, one from each side. DualPipeV needs
# m >= 2p. (Both at pipe 2 in make test; ZB-V at pipe 1 and 4 and DualPipeV at
# pipe 4 in make test-slow, and on the newest JAX: tests/_slow_cases.py.)
V_CASES = [
    pytest.param("zb_v", 2, 1, 2, id="zb_v-p1-m2"),
    pytest.param("zb_v", 2, 2, 2, id="zb_v-p2-m4"),
    pytest.param("zb_v", 2, 4, 1, id="zb_v-p4-m4"),
    pytest.param("dualpipe_v", 2, 2, 2, id="dualpipe_v-p2-m4"),
    pytest.param("dualpipe_v", 2, 4, 2, id="dualpipe_v-p4-m8"),
]


@pytest.mark.parametrize(
    "name,chunks,stages,per_stage",
    [
        *(pytest.param(*case, id=f"{case[0]}-v{case[1]}-p{case[2]}-m{case[3] * case[2]}") for case in CASES),
        *V_CASES,
    ],
)
def test_pipeline_matches_sequential(name, chunks, stages, per_stage):
    microbatches = per_stage * stages
    loss = tiny_loss()
    model = Tiny(stages * chunks, key=jax.random.key(stages + 10 * chunks))
    batch = regression_batch(PIPELINE_ROWS * microbatches)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, batch)

    plan = pipeline_plan(name, pipe=stages, microbatches=microbatches, chunks=chunks)
    stored = eqxpar.shard(model, plan)
    value, grads = eqxpar.train.make_value_and_grad(loss, plan)(stored, batch)
    # The stack's gradients come out split over pipe like the layers.
    assert stages == 1 or grads.blocks.blocks.w.sharding.spec[0] == "pipe"
    grads = eqxpar.nn.in_natural_order(grads)
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close(grads, ref_grads)


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)])
def test_pipeline_runs_an_unrolled_stack(name, chunks):
    # Each chunk's two layers run with no loop (`Stacked(unroll=True)`: the jaxpr's
    # scan says `unroll`); zero-bubble's split scans keep that setting.
    stages, microbatches, loss = 2, 4, tiny_loss()
    model = Tiny(2 * stages * chunks, key=jax.random.key(3), unroll=True)
    batch = regression_batch(PIPELINE_ROWS * microbatches)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, batch)
    plan = pipeline_plan(name, pipe=stages, microbatches=microbatches, chunks=chunks)
    step = eqxpar.train.make_value_and_grad(loss, plan)
    stored = eqxpar.shard(model, plan)
    value, grads = step(stored, batch)
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close(eqxpar.nn.in_natural_order(grads), ref_grads)
    assert stored.blocks.unroll == model.blocks.depth  # reordering keeps the setting


def test_pipeline_order_round_trip_and_layout():
    model = Tiny(8, key=jax.random.key(0))
    stored = to_pipeline_order(model.blocks, stages=2, chunks=2)
    # Device 0 stores chunks 0 and 1 = virtual stages 0 and 2 = layers 0, 1, 4, 5.
    np.testing.assert_array_equal(stored.blocks.w[2], model.blocks.blocks.w[4])
    np.testing.assert_array_equal(stored.blocks.w[4], model.blocks.blocks.w[2])
    back = from_pipeline_order(stored, stages=2, chunks=2)
    assert_trees_close(back, model.blocks, rtol=0, atol=0)
    assert_trees_close(to_pipeline_order(model.blocks, stages=4, chunks=1), model.blocks, rtol=0, atol=0)


# --- Uneven stages: Plan(stage_layers=...) ---------------------------------------

# (schedule, chunks, layers per virtual stage at pipe 4 unless said): fewer layers on the
# first and last stages, as for a costly embedding and head; interleaved's eight
# virtual stages differ among the middle ones too (its chunks' branches are keyed
# by their own counts).
UNEVEN = [
    ("gpipe", 1, (1, 3, 3, 1)),
    ("1f1b", 1, (2, 3, 2, 1)),
    ("interleaved", 2, (1, 2, 3, 2, 2, 1, 2, 1)),
    ("zero_bubble", 1, (1, 2, 3, 2)),
    # V: device 0 runs stages 0 and 7 (embedding and head), device 3 the turn (3, 4).
    ("zb_v", 2, (1, 2, 3, 2, 2, 1, 2, 1)),
    ("dualpipe_v", 2, (2, 1, 1, 2, 3, 1, 2, 1)),
    # At pipe 2 (the length gives the stages): device 0 runs stages 0 and 3, device 1 the turn.
    ("zb_v", 2, (2, 1, 1, 2)),
    ("dualpipe_v", 2, (1, 2, 2, 1)),
]


# DualPipeV at pipe 2 in make test (its full and split backwards in a V); the
# others in make test-slow (7-40 s each on 2 cores), each beside a case of its
# engine in make test (tests/_slow_cases.py).
UNEVEN_CASES = [pytest.param(*case, id=f"{case[0]}-v{case[1]}-p{len(case[2]) // case[1]}") for case in UNEVEN]


@pytest.mark.parametrize("name,chunks,layers", UNEVEN_CASES)
def test_uneven_stages_train_like_one_device(name, chunks, layers):
    # Three Adam steps: each step's loss and gradients equal one device's at the
    # same parameters (rtol 1e-5), the update is applied once; the stored stack's
    # padding slots get zero gradients, so they stay zero.
    microbatches, optimizer, loss = 8, optax.adam(1e-2), tiny_loss()
    pipe = len(layers) // chunks
    model = Tiny(sum(layers), key=jax.random.key(len(layers)))
    plan = pipeline_plan(name, pipe=pipe, microbatches=microbatches, chunks=chunks, stage_layers=layers)
    recording = record_gradients(optimizer)
    state = eqxpar.train.init(model, recording, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss, recording, plan)
    assert state.model.blocks.depth == pipe * chunks * max(layers)
    assert state.model.blocks.order == plan.stack_order(sum(layers))

    def advance(batch):
        nonlocal state
        state, metrics = step(state, batch)
        grads = recorded_gradients(state.opt_state)
        plain = eqxpar.nn.in_natural_order(grads)
        return (
            eqxpar.nn.in_natural_order(state.model),
            (RecordedGradients(plain),),
            metrics["loss"],
        )

    batches = [regression_batch(PIPELINE_ROWS * microbatches, seed=i) for i in range(3)]
    assert_steps_match_one_device(advance, model, optimizer, loss, batches)
    padding = np.asarray(
        eqxpar.nn.in_plan_order(Tiny(sum(layers), key=jax.random.key(0)), plan).blocks.blocks.b
    )
    padding = np.all(padding == 0, axis=1)
    assert padding.sum() == pipe * chunks * max(layers) - sum(layers)
    assert np.all(np.asarray(state.model.blocks.blocks.w)[padding] == 0)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_uneven_stages_under_remat_and_data_parallel(remat):
    # Under "full" each backward recomputes its stage from the sliced layers.
    layers, loss = (1, 2), tiny_loss()
    model = Tiny(3, key=jax.random.key(5))
    batch = regression_batch(PIPELINE_ROWS * 2 * 4)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, batch)
    plan = pipeline_plan("1f1b", pipe=2, data=2, microbatches=4, stage_layers=layers, remat=remat)
    stored = eqx.tree_at(
        lambda m: m.blocks, model, to_pipeline_order(model.blocks, stages=2, chunks=1, stage_layers=layers)
    )
    value, grads = eqxpar.train.make_value_and_grad(loss, plan)(stored, batch)
    grads = eqx.tree_at(
        lambda m: m.blocks, grads, from_pipeline_order(grads.blocks, stages=2, chunks=1, stage_layers=layers)
    )
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close(grads, ref_grads)


def test_uneven_pipeline_order_layout_and_round_trip():
    model = Tiny(5, key=jax.random.key(0))
    layers = (1, 2, 1, 1)  # pipe 2 x chunks 2: device 0 runs stages 0 and 2, device 1 stages 1 and 3
    stored = to_pipeline_order(model.blocks, stages=2, chunks=2, stage_layers=layers)
    assert stored.depth == stored.blocks.w.shape[0] == 2 * 2 * 2
    w, ref = np.asarray(stored.blocks.w), np.asarray(model.blocks.blocks.w)
    # Rows: device 0 = [stage 0: layer 0, pad][stage 2: layer 3, pad], device 1 =
    # [stage 1: layers 1, 2][stage 3: layer 4, pad].
    for row, layer in {0: 0, 2: 3, 4: 1, 5: 2, 6: 4}.items():
        np.testing.assert_array_equal(w[row], ref[layer])
    assert not np.any(w[[1, 3, 7]])
    back = from_pipeline_order(stored, stages=2, chunks=2, stage_layers=layers)
    assert back.depth == 5
    assert_trees_close(back, model.blocks, rtol=0, atol=0)
    # Equal counts store as the even order does.
    even = to_pipeline_order(Tiny(4, key=jax.random.key(0)).blocks, stages=2, chunks=2, stage_layers=(1,) * 4)
    assert_trees_close(
        even, to_pipeline_order(Tiny(4, key=jax.random.key(0)).blocks, stages=2, chunks=2), rtol=0, atol=0
    )


def test_uneven_stage_errors():
    mesh = eqxpar.make_mesh(pipe=2)
    cases = [
        (
            dict(schedule="1f1b", stage_layers=(1, 2, 1)),
            r"3 numbers, but the pipeline has 2 stages x 1 chunks = 2",
        ),
        (dict(schedule="1f1b", stage_layers=(0, 3)), r"positive integer number of layers, got 0"),
        (dict(schedule="1f1b", stage_layers=(1.5, 2)), r"got 1\.5"),
        (dict(schedule="1f1b", stage_layers=3), r"expected a sequence of layers per virtual stage"),
        (dict(stage_layers=(1, 2)), r"needs a pipeline schedule"),
        (dict(schedule="interleaved", chunks=2, stage_layers=(1, 2)), r"2 stages x 2 chunks = 4"),
    ]
    for kwargs, match in cases:
        with pytest.raises(eqxpar.PlanError, match=match):
            eqxpar.Plan(mesh, rules=stage_rules(), microbatches=4, **kwargs)
    plan = pipeline_plan("1f1b", pipe=2, microbatches=4, stage_layers=[1, 3])
    assert plan.stage_layers == (1, 3)
    model, batch = Tiny(4, key=jax.random.key(0)), regression_batch(8)
    # A stack not in the plan's order is refused, naming both orders and the fix.
    with pytest.raises(
        eqxpar.PlanError,
        match=r"stored in natural order, but this plan runs it in pipeline order \(2 stages x 1 chunks, "
        r"stage_layers=\(1, 3\).*eqxpar.shard\(model, plan\)",
    ):
        eqxpar.train.make_value_and_grad(tiny_loss(), plan)(model, batch)
    other = pipeline_plan("1f1b", pipe=2, microbatches=4, stage_layers=[3, 1])
    with pytest.raises(eqxpar.PlanError, match=r"stage_layers=\(3, 1\).*runs it in .*stage_layers=\(1, 3\)"):
        eqxpar.train.make_value_and_grad(tiny_loss(), plan)(eqxpar.shard(model, other), batch)
    with pytest.raises(eqxpar.PlanError, match="sum to 5, but the stack has 4 layers"):
        to_pipeline_order(model.blocks, stages=2, chunks=1, stage_layers=(2, 3))
    stored = to_pipeline_order(model.blocks, stages=2, chunks=1, stage_layers=(1, 3))
    with pytest.raises(eqxpar.PlanError, match=r"stored in pipeline order .*\(1, 3\).*not in natural order"):
        from_pipeline_order(stored, stages=2, chunks=1, stage_layers=(2, 2))
    # Reordering is never applied twice: the stack records its order.
    again = to_pipeline_order(stored, stages=2, chunks=1, stage_layers=(1, 3))
    assert_trees_close(again, stored, rtol=0, atol=0)


# --- 3D hybrid: pipe 2 x data 2 x tensor 2, eqxpar.nn layers ------------------

VOCAB, DM, HEADS, HIDDEN, SEQ = 16, 8, 2, 16, 4


class MLPBlock(eqx.Module):
    """A pre-norm residual MLP block of eqxpar.nn layers (tensor parallel: hidden
    features split over `tensor`, one all-reduce per direction)."""

    norm: nn.LayerNorm
    mlp: nn.MLP

    def __init__(self, key):
        self.norm = nn.LayerNorm(DM)
        self.mlp = nn.MLP(DM, HIDDEN, key=key)

    def __call__(self, x):
        return x + self.mlp(self.norm(x))


class TinyLM(eqx.Module):
    """Vocabulary-parallel embedding and head around a stack of MLP blocks. (The
    examples test runs transformer blocks, attention included, the same way.)"""

    embed: nn.Embedding
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head: nn.Unembed

    def __init__(self, depth, *, key):
        k = jax.random.split(key, 3)
        self.embed = nn.Embedding(VOCAB, DM, key=k[0])
        self.blocks = nn.Stacked(MLPBlock, depth=depth, key=k[1])
        self.norm = nn.LayerNorm(DM)
        self.head = nn.Unembed(DM, VOCAB, key=k[2])


LM_LOSS = PipelineLoss(
    first=lambda m, tokens: m.embed(tokens[:, :-1]),
    stack=lambda m: m.blocks,
    last=lambda m, h, tokens: jnp.mean(nn.cross_entropy(m.head(m.norm(h)), tokens[:, 1:], head=m.head)),
)


def test_3d_hybrid_trains_like_one_device():
    model = TinyLM(4, key=jax.random.key(0))
    optim = optax.sgd(0.5)  # (Adam would blow float32 noise in exactly-zero gradients up to lr)
    keys = jax.random.split(jax.random.key(3), 5)
    batches = [jax.random.randint(k, (8, SEQ + 1), 0, VOCAB) for k in keys]
    ref_losses, ref_model = reference_run(model, optim, LM_LOSS, batches)

    plan = pipeline_plan("1f1b", pipe=2, data=2, tensor=2, microbatches=2, rules=eqxpar.rules.MEGATRON)
    step = eqxpar.train.make_step(LM_LOSS, optim, plan)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    # The layers are split over pipe, the heads over tensor.
    spec = state.model.blocks.blocks.mlp.w_in.sharding.spec
    assert spec[0] == "pipe" and spec[-1] == "tensor", spec
    losses, state = run_steps(step, state, batches)
    assert_trees_close(losses, ref_losses)
    assert_trees_close_to_scale(state.model, ref_model)


# Rules that keep "vocab" whole: every tensor device holds the whole head, and its
# logits the whole vocabulary (read as a shard they once lost log(tensor) a token).
WHOLE_VOCAB = eqxpar.rules.Logical({"mlp": "tensor"})


# 1F1B runs LM_LOSS with the vocabulary split in the 3D hybrid test above, and
# without head= and with bfloat16 logits below; interleaved in make test-slow (its
# last stage is 1F1B's).
@pytest.mark.parametrize(
    "name,chunks",
    [("gpipe", 1), pytest.param("interleaved", 2, marks=pytest.mark.slow), ("zero_bubble", 1)],
)
def test_head_aware_loss_under_every_schedule(name, chunks):
    # `cross_entropy(..., head=m.head)` in the last stage, pipe 2 x data 2 x tensor 2,
    # with the head's vocabulary whole on every tensor device: its vocab_split()
    # gives the loss the layout a default once got wrong.
    rules = WHOLE_VOCAB
    model = TinyLM(2 * chunks, key=jax.random.key(5))
    tokens = jax.random.randint(jax.random.key(6), (8, SEQ + 1), 0, VOCAB)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(LM_LOSS))(model, tokens)
    plan = pipeline_plan(name, pipe=2, data=2, tensor=2, microbatches=2, chunks=chunks, rules=rules)
    value, grads = eqxpar.train.make_value_and_grad(LM_LOSS, plan)(eqxpar.shard(model, plan), tokens)
    assert_trees_close(float(value), float(ref_loss))
    assert_trees_close_to_scale(eqxpar.nn.in_natural_order(grads), ref_grads)


def test_loss_without_its_head_in_a_tensor_pipeline_names_the_fix():
    def last(m, h, tokens):
        return jnp.mean(nn.cross_entropy(m.head(m.norm(h)), tokens[:, 1:]))

    plan = pipeline_plan("1f1b", pipe=2, data=2, tensor=2, microbatches=2, rules=WHOLE_VOCAB)
    step = eqxpar.train.make_value_and_grad(PipelineLoss(LM_LOSS.first, LM_LOSS.stack, last), plan)
    with pytest.raises(eqxpar.SpecError, match=r"'tensor' is manual here with 2 devices.*head=model.head"):
        step(TinyLM(2, key=jax.random.key(0)), jnp.zeros((8, SEQ + 1), jnp.int32))


def test_bfloat16_logits_give_the_float32_loss_in_a_last_stage():
    # Given bfloat16 logits (in the batch, so the same on both sides), the last
    # stage's loss, vocabulary-split over tensor or whole, is their float32
    # cross-entropy to float32 rounding, under Plan(compute_dtype=bfloat16).
    keys = jax.random.split(jax.random.key(7), 3)
    logits = (4 * jax.random.normal(keys[0], (8, SEQ, VOCAB))).astype(jnp.bfloat16)
    labels = jax.random.randint(keys[1], (8, SEQ), 0, VOCAB)
    x = jax.random.normal(keys[2], (8, TINY_IN))
    expected = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels))

    def last(m, h, batch):
        _, z, y = batch
        columns = VOCAB // 2
        mine = jax.lax.dynamic_slice_in_dim(z, jax.lax.axis_index("tensor") * columns, columns, axis=-1)
        split = jnp.mean(nn.cross_entropy(mine, y, vocab_split=True))
        whole = jnp.mean(nn.cross_entropy(z, y, vocab_split=False))
        assert split.dtype == whole.dtype == jnp.float32
        return (split + whole) / 2 + 0 * jnp.mean(h).astype(jnp.float32)

    loss = PipelineLoss(lambda m, batch: batch[0] @ m.w_in, lambda m: m.blocks, last)
    plan = pipeline_plan("1f1b", pipe=2, data=2, tensor=2, microbatches=2, compute_dtype=jnp.bfloat16)
    model = eqxpar.shard(Tiny(2, key=jax.random.key(8)), plan)
    value, _ = eqxpar.train.make_value_and_grad(loss, plan)(model, (x, logits, labels))
    assert value.dtype == jnp.float32
    np.testing.assert_allclose(float(value), float(expected), rtol=1e-6)


# --- Memory: compiled temp bytes ------------------------------------------------


def compiled_step(name, microbatches, *, stages=2, chunks=1, rows=16, width=128):
    model = Tiny(stages * chunks, key=jax.random.key(0), d=width)
    plan = pipeline_plan(name, pipe=stages, microbatches=microbatches, chunks=chunks)
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(tiny_loss(), optim, plan)
    return step.compile(state, regression_batch(rows * microbatches))


def temp_bytes(name, microbatches, **kwargs):
    return compiled_step(name, microbatches, **kwargs).memory_analysis().temp_size_in_bytes


# interleaved in make test-slow (25 s): the benchmarks' pp_interleaved record holds it too.
_INTERLEAVED_SLOW = pytest.param("interleaved", 2, marks=pytest.mark.slow)


@pytest.mark.parametrize("name,chunks", [("1f1b", 1), _INTERLEAVED_SLOW, ("zero_bubble", 1)])
def test_memory_flat_from_4p_to_16p_microbatches(name, chunks):
    # The contract: temp bytes at m = 4p and 16p (same micro-batch size)
    # differ by < 10% for 1F1B and interleaved (zero-bubble too); p = 4 here.
    small, large = (temp_bytes(name, m, stages=4, chunks=chunks, width=256) for m in (16, 64))
    assert large < 1.10 * small, (name, small, large)


def test_1f1b_memory_does_not_grow_with_microbatches_gpipe_does():
    act = 16 * 128 * 4  # one micro-batch's activation, bytes
    ofob = [temp_bytes("1f1b", m) for m in (4, 16)]
    gpipe = [temp_bytes("gpipe", m) for m in (4, 16)]
    # GPipe keeps every micro-batch's stage input (and residuals): twelve more.
    assert gpipe[1] - gpipe[0] >= 12 * act, gpipe
    # 1F1B keeps at most 2 stages - 1 of them (its fused ticks run a forward
    # 2 (p - 1) micro-batches ahead of the backward beside it), whatever the
    # micro-batch count. What does grow: the batch itself (16 x 5 floats a
    # micro-batch) and the program's rows (15 int32 a tick and device, 2 ticks a
    # micro-batch).
    assert eqxpar.pipeline.schedule("1f1b", stages=2, microbatches=16).in_flight <= 3
    grown = 12 * (16 * 5 * 4 + 2 * 2 * 15 * 4)
    assert ofob[1] - ofob[0] <= act + grown, ofob
    assert ofob[1] < gpipe[1]


@pytest.mark.parametrize(
    "name,bound,lockstep", [("gpipe", 0.8, 0.7), ("1f1b", 0.8, 0.7), ("zero_bubble", 0.65, None)]
)
def test_backward_reuses_the_forward_unless_remat_full(name, bound, lockstep):
    """With residuals kept (every remat policy but "full") a backward action runs
    no stage forward: per micro-batch a stage costs F + B (~3F) against
    F + (F + B) (~4F) recomputing, and zero-bubble's input and weight halves
    share one forward, F + I + W (~3F) against F + (F + I) + (F + W) (~5F).
    cost_analysis counts each branch of the tick once: the ratio of the two
    programs is the ratio of their actions' costs. The results are equal.

    In lockstep (`matmul_flops`: every tick at its costliest action) kept
    residuals save as much (0.54 GPipe, 0.60 1F1B here) because the last stage's
    forward runs in its own tick: inside its backward, it made each of GPipe's
    backward ticks F + B rather than B, as costly as recomputing (a ratio of 1)."""

    def flops(remat):
        model = Tiny(4, key=jax.random.key(0), d=256)
        plan = pipeline_plan(name, pipe=2, microbatches=4, remat=remat)
        optim = optax.sgd(0.1)
        state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
        step = eqxpar.train.make_step(tiny_loss(), optim, plan)
        batch = regression_batch(64)
        _, metrics = step(state, batch)
        compiled = step.compile(state, batch)
        return (
            compiled.cost_analysis()["flops"],
            eqxpar.inspect.matmul_flops(compiled),
            float(metrics["loss"]),
        )

    (kept, ticks_kept, loss_kept), (full, ticks_full, loss_full) = flops("none"), flops("full")
    assert kept <= bound * full, (kept, full)
    if lockstep is not None:
        assert ticks_kept <= lockstep * ticks_full, (ticks_kept, ticks_full)
    assert_trees_close(loss_kept, loss_full)


@pytest.mark.parametrize(
    ("name", "stages", "microbatches", "chunks"),
    [
        ("interleaved", 2, 4, 2),
        ("interleaved", 4, 8, 2),
        ("zero_bubble", 2, 4, 1),
        ("1f1b", 2, 8, 1),
        ("zb_v", 2, 4, 2),
        # The V at pipe 4 (two inputs to a device in a tick) in make test-slow: 20-35 s.
        pytest.param("zb_v", 4, 8, 2, marks=pytest.mark.slow),
        pytest.param("dualpipe_v", 4, 8, 2, marks=pytest.mark.slow),
    ],
)
def test_lockstep_flops_are_the_tables(name, stages, microbatches, chunks):
    """The program's lockstep FLOPs (`matmul_flops`: each loop position's switch
    at its costliest branch, times its trip count) are what the table's lockstep
    bubble says: a device's useful work, F + B = 3F per chunk and micro-batch,
    over 1 - the bubble. Each device runs one branch at a loop position on every
    iteration (`tick_loops`), so no tick is counted at another's action (interleaved
    here: 4-6 % more when positions mixed forwards and backwards). The rest is
    the tiny model's input layer and head."""
    rows, width = 16, 256
    compiled = compiled_step(name, microbatches, stages=stages, chunks=chunks, rows=rows, width=width)
    sched = eqxpar.pipeline.schedule(name, stages=stages, microbatches=microbatches, chunks=chunks)
    forward = 2 * rows * width * width  # one block, one micro-batch
    table = 3 * forward * microbatches * chunks / (1 - sched.lockstep_bubble_fraction)
    ratio = eqxpar.inspect.matmul_flops(compiled) / table
    assert 1.0 <= ratio < 1.015, ratio


def test_permutes_run_where_due_outside_the_branches():
    """A tick sends an activation forward only where one arrives at its end, a
    cotangent backward likewise: GPipe's forward phase sends nothing back and its
    backward phase nothing forward, and no tick sends what nothing receives."""
    for name in ("gpipe", "1f1b"):
        compiled = compiled_step(name, 4)
        stats = eqxpar.inspect.collective_stats(compiled)
        bufs = eqxpar.pipeline.schedule(name, stages=2, microbatches=4).buffers
        due = int((bufs.recv_input >= 0).any(axis=1).sum() + (bufs.recv_cotangent >= 0).any(axis=1).sum())
        # Two stages: each of the 4 micro-batches crosses once each way, a tick each.
        assert due == 8, due
        # Outside the branches, each send once per tick it runs (XLA unrolls the
        # loops of one tick, so not every send is in a loop).
        assert stats.count["collective-permute"] == due, stats.count
        assert stats.in_loops.get("collective-permute", 0) >= due // 2, stats.in_loops


@pytest.mark.parametrize(
    ("name", "chunks"),
    [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved", 2),
        ("zero_bubble", 1),
        ("zb_v", 2),
        # In make test-slow (22 s on 2 cores): zb_v's V sends the same.
        pytest.param("dualpipe_v", 2, marks=pytest.mark.slow),
    ],
)
def test_each_device_sends_only_what_it_must(name, chunks):
    """A tick sends from the devices with something due only (the engine's loops
    run repeating patterns of sends): the busiest device's permute bytes are
    what the schedule moves, one activation on from each virtual stage but the
    last and one cotangent back from each but the first, per micro-batch,
    except where the stage it goes to runs on the same device (the V's turn:
    stage p - 1 hands stage p its activation on device p - 1, which gets the
    cotangent back there)."""
    p, m, rows, width = 4, 8, 16, 128
    compiled = compiled_step(name, m, stages=p, chunks=chunks, rows=rows, width=width)
    sched = eqxpar.pipeline.schedule(name, stages=p, microbatches=m, chunks=chunks)
    stages = p * chunks
    device = {sched.stage_of(d, c): d for d in range(p) for c in range(chunks)}
    sends = [0] * p
    for k in range(stages):
        for other in (k - 1, k + 1):
            sends[device[k]] += m * (0 <= other < stages and device[other] != device[k])
    assert max(sends) == (4 * m if chunks == 2 else 2 * m)
    if sched.placement == "v":  # the end devices: 2 m (interleaved's send 3 m)
        assert sends[0] == sends[p - 1] == 2 * m
    stats = eqxpar.inspect.collective_stats(compiled)
    assert stats.wire_bytes["collective-permute"] == max(sends) * rows * width * 4, (stats.wire_bytes, sends)


# --- Errors ---------------------------------------------------------------------


def test_plan_validation():
    mesh = eqxpar.make_mesh(pipe=2)
    with pytest.raises(eqxpar.PlanError, match="'pipedream'"):
        eqxpar.Plan(mesh, schedule="pipedream")
    with pytest.raises(eqxpar.PlanError, match="only schedule='interleaved'"):
        eqxpar.Plan(mesh, schedule="1f1b", chunks=2)
    with pytest.raises(eqxpar.PlanError, match="needs a pipeline schedule"):
        eqxpar.Plan(mesh, microbatches=4)
    with pytest.raises(eqxpar.PlanError, match="microbatches=0"):
        eqxpar.Plan(mesh, schedule="gpipe", microbatches=0)
    with pytest.raises(eqxpar.PlanError, match="Drop manual_axes"):
        eqxpar.Plan(mesh, schedule="gpipe", mode="manual", manual_axes=("tensor",))
    # A pipeline always runs manual over every axis: a mode would be ignored.
    with pytest.raises(eqxpar.PlanError, match="Drop mode"):
        eqxpar.Plan(mesh, schedule="gpipe", mode="manual")


def test_bad_input_errors():
    model = Tiny(4, key=jax.random.key(0))
    batch = regression_batch(8)
    plan = pipeline_plan("1f1b", pipe=2, microbatches=4)
    loss = tiny_loss()
    with pytest.raises(eqxpar.PlanError, match="must be an eqxpar.pipeline.PipelineLoss"):
        eqxpar.train.make_value_and_grad(loss.__call__, plan)(model, batch)
    with pytest.raises(eqxpar.BatchError, match="batch size 6"):
        eqxpar.train.make_value_and_grad(loss, plan)(model, regression_batch(6))
    # The user's 12 rows and the plan's 4 micro-batches, not only the 3-row
    # micro-batch that the 2 data-parallel devices cannot split.
    data2 = pipeline_plan("1f1b", pipe=2, data=2, microbatches=4)
    with pytest.raises(
        eqxpar.BatchError,
        match=r"batch size 12, cut into the 4 micro-batches of Plan\(microbatches=4\), gives micro-batches of "
        r"3 rows, which are not divisible by the 2 data-parallel devices .* the nearest are 8 and 16",
    ):
        eqxpar.train.make_value_and_grad(loss, data2)(model, regression_batch(12))
    with pytest.raises(eqxpar.DivisibilityError, match=r"size 3, which is not divisible by the 2 devices"):
        eqxpar.train.make_value_and_grad(loss, plan)(Tiny(3, key=jax.random.key(0)), batch)
    interleaved = pipeline_plan("interleaved", pipe=2, microbatches=4, chunks=4)
    with pytest.raises(eqxpar.DivisibilityError, match="2 stages x 4 chunks"):
        eqxpar.train.make_value_and_grad(loss, interleaved)(model, batch)
    odd = pipeline_plan("interleaved", pipe=2, microbatches=3, chunks=2)
    with pytest.raises(eqxpar.PlanError, match="multiple of 2"):
        eqxpar.train.make_value_and_grad(loss, odd)(eqxpar.shard(model, odd), regression_batch(6))
    with pytest.raises(eqxpar.PlanError, match="accumulate"):
        eqxpar.train.make_value_and_grad(loss, plan, accumulate=2)(model, batch)
    not_stacked = PipelineLoss(loss.first, lambda m: m.w_in, loss.last)
    with pytest.raises(eqxpar.PlanError, match="expected an eqxpar.nn.Stacked"):
        eqxpar.train.make_value_and_grad(not_stacked, plan)(model, batch)
    # The stack's layers must be split over pipe by the rules.
    unsplit = eqxpar.Plan(eqxpar.make_mesh(pipe=2), schedule="1f1b", microbatches=4)
    with pytest.raises(eqxpar.PlanError, match="stage_rules"):
        eqxpar.train.make_value_and_grad(loss, unsplit)(model, batch)


def test_pipeline_fsdp_tensor_trains_like_one_device_and_gathers_once():
    # pipe 2 x fsdp 2 x tensor 2: the model dimension split over fsdp, the
    # hidden features and vocabulary over tensor, the layers over pipe.
    model = TinyLM(4, key=jax.random.key(0))
    optim = optax.sgd(0.5)
    keys = jax.random.split(jax.random.key(4), 5)
    batches = [jax.random.randint(k, (8, SEQ + 1), 0, VOCAB) for k in keys]
    ref_losses, ref_model = reference_run(model, optim, LM_LOSS, batches)

    mesh = eqxpar.make_mesh(pipe=2, fsdp=2, tensor=2)
    plan = eqxpar.Plan(mesh, rules=stage_rules(eqxpar.rules.MEGATRON_FSDP), schedule="1f1b", microbatches=2)
    step = eqxpar.train.make_step(LM_LOSS, optim, plan)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(1))
    spec = state.model.blocks.blocks.mlp.w_in.sharding.spec
    assert spec[0] == "pipe" and spec[1] == "fsdp" and spec[-1] == "tensor", spec
    stats = eqxpar.inspect.collective_stats(step.compile(state, batches[0]))
    losses, state = run_steps(step, state, batches)
    assert_trees_close(losses, ref_losses)
    assert_trees_close_to_scale(state.model, ref_model)

    # Every fsdp-split weight is gathered once per step (outside the tick loop)
    # and its gradient reduce-scattered once: the bytes of this device's
    # gathered weights, and half of them.
    specs = eqxpar.partition_specs(eqx.filter(model, eqx.is_inexact_array), plan)
    gathered = 0
    for leaf, s in zip(
        jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)),
        jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)),
        strict=True,
    ):
        axes = [
            a for entry in s if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)
        ]
        if "fsdp" in axes:
            gathered += leaf.nbytes // np.prod([mesh.shape[a] for a in axes if a != "fsdp"])
    assert stats.bytes["all-gather"] == gathered, (stats.bytes, gathered)
    assert stats.bytes["reduce-scatter"] == gathered // 2, (stats.bytes, gathered)
    assert "all-gather" not in stats.in_loops and "reduce-scatter" not in stats.in_loops, stats.in_loops


def test_pipeline_rejects_weights_split_over_pipe_outside_the_stack():
    rules = eqxpar.rules.ByPath([(r"w_out$", jax.sharding.PartitionSpec("pipe"))], strict=False)
    plan = pipeline_plan("gpipe", pipe=2, microbatches=2, rules=rules)
    with pytest.raises(eqxpar.PlanError, match="only the layer axis"):
        eqxpar.train.make_value_and_grad(tiny_loss(), plan)(
            Tiny(2, key=jax.random.key(0), d=TINY_D), regression_batch(8)
        )


@pytest.mark.parametrize("name,chunks", [v for v in VARIANTS if v != ("interleaved", 1)])
def test_mixed_precision_under_every_schedule(name, chunks):
    # Plan(compute_dtype=bfloat16) in a pipeline computes what one device computes
    # with the same casts (weights cast inside the differentiated function, the loss
    # back to float32): bf16 keeps 8 significant bits, and the two sides round
    # different intermediates, so they agree to a few roundings; gradients come back
    # in the float32 master dtype. The float32 loss differs: the casts are applied.
    stages, microbatches = 2, 4
    loss = tiny_loss()
    model = Tiny(stages * chunks, key=jax.random.key(3))
    batch = regression_batch(2 * PIPELINE_ROWS * microbatches)

    def cast_loss(m, b):
        m = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, m)
        return loss(m, b).astype(jnp.float32)

    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(cast_loss))(model, batch)
    f32_loss = eqx.filter_jit(loss)(model, batch)
    plan = pipeline_plan(
        name, pipe=stages, data=2, microbatches=microbatches, chunks=chunks, compute_dtype=jnp.bfloat16
    )
    value, grads = eqxpar.train.make_value_and_grad(loss, plan)(eqxpar.shard(model, plan), batch)
    grads = eqxpar.nn.in_natural_order(grads)
    assert value.dtype == jnp.float32
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(eqx.filter(grads, eqx.is_inexact_array)))
    np.testing.assert_allclose(float(value), float(ref_loss), rtol=1e-2)
    assert float(value) != float(f32_loss)
    pairs = list(
        zip(jax.tree.leaves(grads), jax.tree.leaves(eqx.filter(ref_grads, eqx.is_inexact_array)), strict=True)
    )
    diff = np.sqrt(sum(float(jnp.sum((a - b.astype(jnp.float32)) ** 2)) for a, b in pairs))
    scale = np.sqrt(sum(float(jnp.sum(b.astype(jnp.float32) ** 2)) for _, b in pairs))
    assert diff <= 2e-2 * scale
