"""`GPTConfig(loss_chunk=k)`: the output head and cross-entropy run over the
sequence k positions at a time. The loss and gradients equal the unchunked ones
on one device and under data x FSDP (automatic), FSDP (manual), tensor parallel
with the vocabulary split (manual, with and without sequence parallelism and its
ring overlap), a whole vocabulary under sequence parallelism, context
parallelism (alone and with tensor x sequence parallelism), a pipeline, micro-
batches and bfloat16 compute, for k dividing each device's sequence and not;
training steps match; per-row losses and MoE auxiliary losses are unchanged; bad
values raise PlanError; save_pretrained does not write it; and the compiled
step's temporaries shrink by more than the logits' size."""

import dataclasses
import functools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, lm_loss

from ._helpers import (
    CONTEXT_BATCH,
    CONTEXT_CONFIGS,
    CONTEXT_SEQ,
    FSDP_ONLY,
    assert_trees_close,
    assert_trees_close_to_scale,
    context_tokens,
    pipeline_plan,
    reference_run,
    run_steps,
    value_and_grad_on_one_device,
)

BATCH, SEQ, tokens = CONTEXT_BATCH, CONTEXT_SEQ, context_tokens
# Megatron with the vocabulary whole on every device.
WHOLE_VOCAB = eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"})
# FSDP with the vocabulary (not the model dimension) of the embedding and head split.
FSDP_VOCAB = eqxpar.rules.Logical({"vocab": ("data", "fsdp"), "embed": "fsdp"})
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)


def chunked(model: GPT, chunk: int | None) -> GPT:
    """`model` with the same weights and `loss_chunk=chunk` (the config is static:
    a new treedef, the same leaves)."""
    config = dataclasses.replace(model.config, loss_chunk=chunk)
    like = jax.eval_shape(lambda: GPT(config, key=jax.random.key(0)))
    return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(model))


@pytest.fixture(scope="module")
def gpts():
    return {name: eqx.filter_jit(GPT)(c, key=jax.random.key(0)) for name, c in CONTEXT_CONFIGS.items()}


# (id, config, plan factory, loss, make_value_and_grad options). Each device's
# sequence: 32 positions, 16 under context 2 (or sequence parallel 2), 8 under
# context 4 (or sequence parallel 4).
PLANS = [
    (
        "data-fsdp-auto",
        "learned-positions",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=FSDP_ONLY),
        {},
    ),
    (
        # The head's vocabulary split over the batch axes: tiles of every shard.
        "data-fsdp-vocab-auto-tied",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=FSDP_VOCAB),
        {},
    ),
    (
        "fsdp-manual",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=FSDP_ONLY, mode="manual"),
        {},
    ),
    (
        "tensor-manual-tied",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual"),
        {},
    ),
    (
        "tensor-sp-overlap",
        "learned-positions",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
            tp_overlap=True,
        ),
        {},
    ),
    (
        "whole-vocab-sp-tied",
        "rotary-gqa",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=4, tensor=2), rules=WHOLE_VOCAB, mode="manual", sequence_parallel=True
        ),
        {},
    ),
    (
        "context-data",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(context=4, data=2), mode="manual"),
        {},
    ),
    (
        "context-tensor-sp",
        "learned-positions",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, context=2, tensor=2),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
        ),
        {},
    ),
    (
        "data-accumulate",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON),
        {"accumulate": 2},
    ),
]
# 3 divides no device's sequence (the last chunk padded), 4 divides every one.
CHUNKS = [3, 4]


# (tests/_slow_cases.py keeps the dividing chunk of most plans out of make test.)
@pytest.mark.parametrize(
    "config,make_plan,kw,chunk",
    [
        pytest.param(config, make_plan, kw, chunk, id=f"{name}-chunk{chunk}")
        for name, config, make_plan, kw in PLANS
        for chunk in CHUNKS
    ],
)
def test_chunked_loss_under_a_plan_matches_the_unchunked_one_device_loss(gpts, config, make_plan, kw, chunk):
    model, batch = gpts[config], tokens(1)
    loss, grads = eqxpar.train.make_value_and_grad(lm_loss, make_plan(), **kw)(chunked(model, chunk), batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, lm_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


@pytest.mark.parametrize(
    "config,chunk",
    [("rotary-gqa", 1), ("rotary-gqa", 8), ("learned-positions", 3), ("learned-positions", 31)],
)
def test_chunked_loss_on_one_device_matches(gpts, config, chunk):
    # 31 positions: chunks of 1 (dividing), 8 (the last one 7), 3 (the last one 1)
    # and 31 (one chunk: the unchunked program). Per-row losses too.
    model, batch = gpts[config], tokens(2)[:, :32]
    loss, grads = value_and_grad_on_one_device(chunked(model, chunk), lm_loss, batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, lm_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)
    per_row = jax.jit(functools.partial(lm_loss, per_row=True))
    assert_trees_close(per_row(chunked(model, chunk), batch), per_row(model, batch))


def test_a_chunk_as_long_as_the_sequence_is_the_unchunked_program(gpts):
    model, batch = gpts["rotary-gqa"], tokens(0)
    plain = jax.make_jaxpr(lm_loss)(model, batch)
    assert str(jax.make_jaxpr(lm_loss)(chunked(model, SEQ), batch)) == str(plain)
    assert "scan" in str(jax.make_jaxpr(lm_loss)(chunked(model, SEQ - 1), batch))


def test_moe_auxiliary_losses_are_unchanged():
    config = dataclasses.replace(CONTEXT_CONFIGS["rotary-gqa"], moe_every=2, experts=4)
    model, batch = eqx.filter_jit(GPT)(config, key=jax.random.key(0)), tokens(3)
    loss, grads = value_and_grad_on_one_device(chunked(model, 5), lm_loss, batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, lm_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


@pytest.mark.parametrize("chunk", [3, 4])
def test_pipeline_last_stage_loss_matches(gpts, chunk):
    model, batch = gpts["rotary-gqa"], tokens(4)
    plan = pipeline_plan("gpipe", pipe=2, microbatches=2, data=2, tensor=2, rules=eqxpar.rules.MEGATRON)
    sharded = eqxpar.shard(chunked(model, chunk), plan)
    loss, grads = eqxpar.train.make_value_and_grad(PIPELINE_LOSS, plan)(sharded, batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, lm_loss, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


def test_bfloat16_compute_matches_the_unchunked_step():
    # The head's matmul in bfloat16 in both; the log-softmax in float32. Against
    # the unchunked step of the same plan: the chunks change only the order in
    # which the head's weight gradient is summed (bfloat16 products).
    model, batch = GPT(CONTEXT_CONFIGS["learned-positions"], key=jax.random.key(0)), tokens(5)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), compute_dtype=jnp.bfloat16)
    loss, grads = eqxpar.train.make_value_and_grad(lm_loss, plan)(chunked(model, 3), batch)
    ref_loss, ref_grads = eqxpar.train.make_value_and_grad(lm_loss, plan)(model, batch)
    assert_trees_close(float(loss), float(ref_loss), rtol=1e-3)
    assert_trees_close_to_scale(grads, ref_grads, rtol=1e-2)


def test_training_steps_match_unchunked_one_device_training(gpts):
    model, optimizer = gpts["learned-positions"], optax.sgd(0.1, momentum=0.9)
    batches = [tokens(i) for i in range(3)]
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    )
    state = eqxpar.train.init(chunked(model, 3), optimizer, plan, key=jax.random.key(0))
    losses, state = run_steps(eqxpar.train.make_step(lm_loss, optimizer, plan), state, batches)
    ref_losses, ref_model = reference_run(model, optimizer, lm_loss, batches)
    assert_trees_close(losses, ref_losses)
    # Plain SGD with momentum does not amplify rounding: elementwise.
    assert_trees_close(state.model, ref_model)


# (A float or a string fails the type check in tests before GPTConfig's own check,
# which names them as it names these.)
@pytest.mark.parametrize("bad", [0, -4, True])
def test_bad_chunks_raise_naming_the_value(bad):
    with pytest.raises(eqxpar.PlanError, match=f"loss_chunk={bad!r}.*positive integer"):
        dataclasses.replace(CONTEXT_CONFIGS["rotary-gqa"], loss_chunk=bad)


def test_save_pretrained_does_not_write_it_and_from_pretrained_sets_it(gpts, tmp_path):
    pytest.importorskip("safetensors")
    model = chunked(gpts["rotary-gqa"], 8)
    eqxpar.models.save_pretrained(model, tmp_path)
    assert not any("chunk" in key for key in json.loads((tmp_path / "config.json").read_text()))
    loaded = eqxpar.models.from_pretrained(tmp_path)
    assert loaded.config.loss_chunk is None
    again = eqxpar.models.from_pretrained(tmp_path, loss_chunk=8)
    assert again.config == dataclasses.replace(loaded.config, loss_chunk=8)
    assert_trees_close(again, model, rtol=0, atol=0)
    with pytest.raises(eqxpar.PlanError, match="loss_chunk=0"):
        eqxpar.models.from_pretrained(tmp_path, loss_chunk=0)


def test_chunks_shrink_the_step_temporaries_by_more_than_the_logits():
    # A vocabulary large beside the model: the float32 logits (batch, seq, vocab)
    # are L = 2 x 512 x 32768 x 4 B = 128 MiB, the biggest temporary. Unchunked,
    # the step holds at least two such arrays at once (the logits, or their
    # exponentials, and their gradient): >= 2 L. Chunked by 64, each is L / 8 and
    # everything else (activations 2 x 512 x 64, weights 8 MiB) is alike, so even
    # with a few chunk-sized buffers more the temporaries shrink by well over L
    # (measured on CPU, JAX 0.10.2: 408.7 MB unchunked, 43.3 MB chunked).
    config = GPTConfig(vocab_size=32768, d_model=64, num_heads=2, num_layers=1, d_hidden=128, max_seq_len=512)
    model = GPT(config, key=jax.random.key(0))
    batch = jnp.zeros((2, 513), jnp.int32)
    step = jax.jit(jax.value_and_grad(lm_loss))

    def temp_bytes(m):
        return step.lower(m, batch).compile().memory_analysis().temp_size_in_bytes

    logits = 2 * 512 * 32768 * 4
    whole, chunks = temp_bytes(model), temp_bytes(chunked(model, 64))
    assert whole - chunks >= logits, (whole, chunks)


def test_chunks_move_no_more_bytes_under_automatic_fsdp():
    # The loop runs per batch shard over tiles of the head's vocabulary: each tile
    # is gathered once per pass and its gradient reduce-scattered once, as the
    # unchunked step does the whole weight. Left to the compiler, each of the 8
    # chunks would gather the weight and all-reduce its gradient again (about
    # twice the step's bytes here, with a vocabulary of 256).
    config = dataclasses.replace(CONTEXT_CONFIGS["learned-positions"], vocab_size=256)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=FSDP_ONLY)
    batch, optimizer = tokens(0, vocab=256), optax.sgd(0.1)

    def wire_bytes(chunk):
        model = GPT(dataclasses.replace(config, loss_chunk=chunk), key=jax.random.key(0))
        state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(0))
        compiled = eqxpar.train.make_step(lm_loss, optimizer, plan).compile(state, batch)
        return eqxpar.inspect.collective_stats(compiled).total_wire_bytes

    assert wire_bytes(4) <= 1.01 * wire_bytes(None)


@pytest.mark.parametrize("rules", [FSDP_ONLY, FSDP_VOCAB], ids=["model-split", "vocab-split"])
def test_chunks_under_automatic_fsdp_never_hold_the_head_whole(rules):
    # A head of 128 x 32768 float32 weights, H = 16 MiB (2 MiB per device under
    # fsdp=8). Sequence chunks per batch shard held it gathered whole and its
    # gradient whole, >= 2 H; in tiles of the vocabulary each device holds one
    # tile of both at a time, and one tile's logits (256 positions x 4096
    # columns), so the temporaries stay under 2 H (measured on CPU, JAX 0.10.2,
    # model-split: 103.3 MB unchunked, 61.4 MB in sequence chunks, 17.6 MB in
    # tiles).
    config = GPTConfig(
        vocab_size=32768, d_model=128, num_heads=2, num_layers=1, d_hidden=128, max_seq_len=256, tied=False
    )
    plan = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=rules)
    batch = jax.ShapeDtypeStruct((8, 257), jnp.int32)
    optimizer = optax.sgd(0.1)
    outline = eqx.filter_eval_shape(GPT, dataclasses.replace(config, loss_chunk=32), key=jax.random.key(0))
    state = eqxpar.train.init(outline, optimizer, plan, key=jax.random.key(0), abstract=True)
    compiled = eqxpar.train.make_step(lm_loss, optimizer, plan).lower(state, batch).compile()
    head = 128 * 32768 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * head
