"""`eqxpar.models.token_logprobs`: each position's log-probability of the next
token. Values and gradients (through a loss that mixes every entry of a row
non-linearly, as a preference loss does) equal one device's `log_softmax` of the
whole logits, gathered at the next tokens, under data x FSDP (automatic), FSDP
(manual), tensor parallel (automatic; manual with sequence parallelism, the
vocabulary split or whole), context parallel (ring, all-gather, Ulysses; with
tensor x sequence parallelism), expert parallel and bfloat16 compute, for chunks
that divide each device's sequence and not; the chunked program never holds the
whole float32 logits; segment ids reach the attention; bad arguments raise."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig, token_logprobs

from ._helpers import (
    CONTEXT_BATCH,
    CONTEXT_CONFIGS,
    CONTEXT_SEQ,
    FSDP_ONLY,
    assert_trees_close,
    assert_trees_close_to_scale,
    context_tokens,
    value_and_grad_on_one_device,
)

tokens = context_tokens
WHOLE_VOCAB = eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"})
MOE = dataclasses.replace(CONTEXT_CONFIGS["rotary-gqa"], moe_every=2, experts=4, capacity_factor=4.0)


def reference_logprobs(model: GPT, batch: jax.Array) -> jax.Array:
    """One device's log-softmax of the whole logits, at the next tokens."""
    logits = model(batch[:, :-1]).astype(jnp.float32)
    return jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], axis=-1)[..., 0]


def token_weights(batch: jax.Array) -> jax.Array:
    # A different weight per token (from its id), some negative.
    return ((batch[:, 1:] % 5).astype(jnp.float32) - 2.0) / 2.0


def row_scores(logp: jax.Array, batch: jax.Array) -> jax.Array:
    """One number per row from all its entries: wrong unless the row is whole."""
    return jnp.sum(logp * token_weights(batch), axis=1) / logp.shape[1]


def preference_loss(logprobs, model, batch):
    # Non-linear in each row's sum, as DPO's loss is.
    return jnp.mean(jax.nn.softplus(row_scores(logprobs(model, batch), batch)))


REFERENCE_LOSS = functools.partial(preference_loss, reference_logprobs)


def loss_of(chunk):
    return functools.partial(preference_loss, functools.partial(token_logprobs, chunk=chunk))


@pytest.fixture(scope="module")
def gpts():
    models = {name: eqx.filter_jit(GPT)(c, key=jax.random.key(0)) for name, c in CONTEXT_CONFIGS.items()}
    models["moe"] = eqx.filter_jit(GPT)(MOE, key=jax.random.key(1))
    return models


# (id, config, plan factory). Each device's sequence: 32 positions, 16 under
# context 2 (or sequence parallel 2), 8 under context 4 (or sequence parallel 4).
PLANS = [
    (
        "data-fsdp-auto",
        "learned-positions",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=FSDP_ONLY),
    ),
    (
        "fsdp-manual",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=FSDP_ONLY, mode="manual"),
    ),
    (
        "tensor-auto-tied",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON),
    ),
    (
        "tensor-sp-manual",
        "learned-positions",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
        ),
    ),
    (
        "whole-vocab-sp-tied",
        "rotary-gqa",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=4, tensor=2), rules=WHOLE_VOCAB, mode="manual", sequence_parallel=True
        ),
    ),
    ("context-ring", "rotary-gqa", lambda: eqxpar.Plan(eqxpar.make_mesh(context=4, data=2), mode="manual")),
    (
        "context-allgather",
        "learned-positions",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="allgather"
        ),
    ),
    (
        "context-ulysses",
        "rotary-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="ulysses"),
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
    ),
    (
        "expert-data",
        "moe",
        lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
    ),
]


# 3 divides no device's sequence (the last chunk padded), 4 divides every one.
@pytest.mark.parametrize(
    "config,make_plan,chunk",
    [
        pytest.param(config, make_plan, chunk, id=f"{name}-chunk{chunk}")
        for name, config, make_plan in PLANS
        for chunk in (3, 4)
    ],
)
def test_logprobs_under_a_plan_match_one_device_log_softmax(gpts, config, make_plan, chunk):
    model, batch = gpts[config], tokens(1)
    plan = make_plan()
    loss, grads = eqxpar.train.make_value_and_grad(loss_of(chunk), plan)(model, batch)
    ref_loss, ref_grads = value_and_grad_on_one_device(model, REFERENCE_LOSS, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)
    # The values themselves, one row at a time.
    per_row = eqxpar.train.make_eval_step(
        lambda m, t: row_scores(token_logprobs(m, t, chunk=chunk), t), plan, per_row=True
    )
    rows = jax.jit(lambda m, t: row_scores(reference_logprobs(m, t), t))(model, batch)
    assert_trees_close(per_row(model, batch)["loss"], jnp.mean(rows))


@pytest.mark.parametrize("config", ["rotary-gqa", "learned-positions", "moe"])
@pytest.mark.parametrize("chunk", [None, 1, 5, 31, 64])
def test_values_on_one_device(gpts, config, chunk):
    # 31 positions: chunks of 1, 5 (the last one 1), 31 (one chunk) and 64 (more
    # than the sequence: the unchunked program), and None (the config's: none).
    model, batch = gpts[config], tokens(2)[:, :32]
    got = jax.jit(functools.partial(token_logprobs, chunk=chunk))(model, batch)
    want = jax.jit(reference_logprobs)(model, batch)
    assert got.shape == (CONTEXT_BATCH, 31) and got.dtype == jnp.float32
    assert bool(jnp.all(got <= 0))
    assert_trees_close(got, want)


def test_chunk_none_is_the_configs_loss_chunk(gpts):
    model = gpts["rotary-gqa"]
    config = dataclasses.replace(model.config, loss_chunk=4)
    chunked = jax.tree.unflatten(
        jax.tree.structure(jax.eval_shape(lambda: GPT(config, key=jax.random.key(0)))), jax.tree.leaves(model)
    )
    batch = tokens(3)
    assert str(jax.make_jaxpr(token_logprobs)(chunked, batch)) == str(
        jax.make_jaxpr(functools.partial(token_logprobs, chunk=4))(model, batch)
    )
    # Without a chunk anywhere: the unchunked program, as a chunk of the whole sequence.
    assert str(jax.make_jaxpr(token_logprobs)(model, batch)) == str(
        jax.make_jaxpr(functools.partial(token_logprobs, chunk=CONTEXT_SEQ))(model, batch)
    )


def test_bfloat16_compute_matches_the_unchunked_logprobs():
    # The head's matmul in bfloat16 in both; the log-softmax in float32.
    model, batch = GPT(CONTEXT_CONFIGS["learned-positions"], key=jax.random.key(0)), tokens(5)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), compute_dtype=jnp.bfloat16)
    loss, grads = eqxpar.train.make_value_and_grad(loss_of(3), plan)(model, batch)
    ref_loss, ref_grads = eqxpar.train.make_value_and_grad(loss_of(None), plan)(model, batch)
    assert_trees_close(float(loss), float(ref_loss), rtol=1e-3)
    assert_trees_close_to_scale(grads, ref_grads, rtol=1e-2)


def test_segment_ids_reach_the_attention(gpts):
    # Two packed sequences per row: the second's log-probabilities equal those of
    # the same tokens run alone (rotary attention sees relative positions only).
    model, batch = gpts["rotary-gqa"], tokens(6)[:, :17]
    segments = jnp.broadcast_to((jnp.arange(17) >= 9).astype(jnp.int32), batch.shape)
    packed = jax.jit(token_logprobs)(model, batch, segment_ids=segments)
    alone = jax.jit(token_logprobs)(model, batch[:, 9:])
    assert_trees_close(packed[:, 9:], alone)
    assert_trees_close(packed[:, :8], jax.jit(token_logprobs)(model, batch[:, :9]))
    # With each document's positions restarting at 0, learned positions too.
    learned = gpts["learned-positions"]
    positions = jnp.broadcast_to(jnp.concatenate([jnp.arange(9), jnp.arange(8)]), batch.shape)
    packed = jax.jit(token_logprobs)(learned, batch, segment_ids=segments, positions=positions)
    assert_trees_close(packed[:, 9:], jax.jit(token_logprobs)(learned, batch[:, 9:]))


def test_chunks_keep_the_float32_logits_out_of_memory():
    # A vocabulary large beside the model: the float32 logits (2, 512, 32768) are
    # L = 128 MiB. The gradient of the unchunked log-probs holds at least two such
    # arrays (the logits, or their exponentials, and their gradient); chunked by 64
    # every one is L / 8, and the temporaries stay under L (they are about 3 L / 8
    # on CPU: a chunk's logits, exponentials and gradient).
    config = GPTConfig(vocab_size=32768, d_model=64, num_heads=2, num_layers=1, d_hidden=128, max_seq_len=512)
    model = GPT(config, key=jax.random.key(0))
    batch = jnp.zeros((2, 513), jnp.int32)

    def temp_bytes(chunk):
        loss = lambda m, t: jnp.sum(token_logprobs(m, t, chunk=chunk))  # noqa: E731
        compiled = jax.jit(jax.grad(loss)).lower(model, batch).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    logits = 2 * 512 * 32768 * 4
    whole, chunks = temp_bytes(None), temp_bytes(64)
    assert whole >= 2 * logits, whole
    assert chunks < logits, chunks


@pytest.mark.parametrize("bad", [0, -2, True, 2.0])
def test_bad_chunks_raise_naming_the_value(gpts, bad):
    with pytest.raises(eqxpar.PlanError, match=rf"chunk={bad!r}.*positive integer"):
        token_logprobs(gpts["rotary-gqa"], tokens(0), chunk=bad)


def test_bad_inputs_raise(gpts):
    model, batch = gpts["rotary-gqa"], tokens(0)
    with pytest.raises(eqxpar.BatchError, match="at least 2 tokens"):
        token_logprobs(model, batch[:, :1])
    with pytest.raises(eqxpar.BatchError, match=r"segment_ids=.*expected an array of the tokens' shape"):
        token_logprobs(model, batch, segment_ids=batch[:, :-1])
    with pytest.raises(eqxpar.BatchError, match=r"positions=.*expected an array of the tokens' shape"):
        token_logprobs(model, batch, positions=batch[:1])
    with pytest.raises(eqxpar.PlanError, match="expected an eqxpar.models.GPT"):
        token_logprobs(eqxpar.models.MLPClassifier(4, 8, 2, key=jax.random.key(0)), batch)
