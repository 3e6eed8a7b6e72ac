"""Packed sequences through the GPT and its loss: segment ids reach every
block's attention, positions restart per document (rotary and learned), weights
mask targets, and a packed batch gives the loss and gradients of the same
documents one per row, padded. Bad packing inputs raise errors that name them."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqxpar
from eqxpar.models import GPT, GPTConfig, gpt_first, gpt_last, gpt_stack_kwargs, lm_loss

from ._helpers import GPT2_STYLE, assert_trees_close

#: Tokens per row: 16 model inputs (a multiple of 2 x 4 context chunks) plus one.
ROW = 17
PAD = 0

CONFIGS = {
    "rotary": GPTConfig(
        vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=64, max_seq_len=16
    ),
    # Blockwise attention in blocks of 4 tokens: segments across tile boundaries.
    "rotary-blockwise": GPTConfig(
        vocab_size=32,
        d_model=32,
        num_heads=4,
        num_layers=2,
        d_hidden=64,
        max_seq_len=16,
        attention="blockwise",
        attention_block=4,
    ),
    "learned-positions": GPT2_STYLE,
}


def documents(seed: int, rows: int) -> list[list[np.ndarray]]:
    """`rows` rows of two random documents each that fit in `ROW` tokens together
    (the rest of the row padding); ids 1..31 (0 is padding)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        a = int(rng.integers(3, 10))
        b = int(rng.integers(3, ROW - a + 1))
        out.append([rng.integers(1, 32, size=n).astype(np.int32) for n in (a, b)])
    return out


def packed_batch(docs: list[list[np.ndarray]]) -> dict[str, jax.Array]:
    """Each row's documents packed into one row of `ROW` tokens: segment ids 0, 1,
    ... per document and the padding's own (9), positions restarting at 0, weight
    0 on the padding."""
    cols = {k: [] for k in ("tokens", "segment_ids", "positions", "weights")}
    for row in docs:
        tokens, seg, pos, w = [], [], [], []
        for i, d in enumerate(row):
            tokens += list(d)
            seg += [i] * len(d)
            pos += list(range(len(d)))
            w += [1.0] * len(d)
        pad = ROW - len(tokens)
        tokens += [PAD] * pad
        seg += [9] * pad
        pos += [0] * pad
        w += [0.0] * pad
        for k, v in zip(cols, (tokens, seg, pos, w), strict=True):
            cols[k].append(v)
    dtypes = {"tokens": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32, "weights": jnp.float32}
    return {k: jnp.asarray(np.array(v), dtypes[k]) for k, v in cols.items()}


def padded_batch(docs: list[list[np.ndarray]]) -> dict[str, jax.Array]:
    """The same documents one per row, padded to `ROW` tokens (weight 0)."""
    return packed_batch([[d] for row in docs for d in row])


def loss_value(out):
    return out.value() if isinstance(out, eqxpar.train.WeightedMean) else out


@pytest.mark.parametrize("name", CONFIGS)
def test_packed_equals_padded_on_one_device(name):
    model = GPT(CONFIGS[name], key=jax.random.key(0))
    docs = documents(0, 4)
    loss = lambda m, b: loss_value(lm_loss(m, b))  # noqa: E731
    packed = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, packed_batch(docs))
    padded = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, padded_batch(docs))
    assert_trees_close(packed, padded)


def test_segments_isolate_documents():
    # Changing the second document changes nothing of the first's logits; without
    # segment ids it would (causal attention reads the earlier tokens only, so
    # change the *first* document and look at the second).
    model = GPT(CONFIGS["rotary"], key=jax.random.key(0))
    batch = packed_batch(documents(1, 2))
    seg, pos = batch["segment_ids"][:, :-1], batch["positions"][:, :-1]
    tokens = batch["tokens"][:, :-1]
    first = seg == 0
    changed = jnp.where(first, (tokens + 7) % 31 + 1, tokens)
    out = model(tokens, segment_ids=seg, positions=pos)
    out2 = model(changed, segment_ids=seg, positions=pos)
    later = ~first & (seg != 9)
    np.testing.assert_allclose(np.asarray(out)[np.asarray(later)], np.asarray(out2)[np.asarray(later)], atol=1e-6)
    plain = model(tokens, positions=pos)
    assert not np.allclose(np.asarray(plain)[np.asarray(later)], np.asarray(out)[np.asarray(later)], atol=1e-3)


@pytest.mark.parametrize("name", ["rotary", "learned-positions"])
def test_positions_restart_each_document(name):
    # A document at the start of a row and the same document later in a row (its
    # positions restarting at 0) give the same logits.
    model = GPT(CONFIGS[name], key=jax.random.key(0))
    doc = jnp.arange(1, 7, dtype=jnp.int32)[None]
    alone = model(doc)
    later = jnp.concatenate([jnp.full((1, 5), 3, jnp.int32), doc], axis=1)
    seg = jnp.asarray([[0] * 5 + [1] * 6], jnp.int32)
    pos = jnp.asarray([list(range(5)) + list(range(6))], jnp.int32)
    out = model(later, segment_ids=seg, positions=pos)
    np.testing.assert_allclose(np.asarray(out[:, 5:]), np.asarray(alone), rtol=1e-5, atol=1e-5)
    # The positions reach the layers: other positions (not a shift, which rotary
    # angles cannot tell from these), other logits.
    spread = pos.at[:, 5:].multiply(2)
    other = model(later, segment_ids=seg, positions=spread)
    assert not np.allclose(np.asarray(other[:, 5:]), np.asarray(alone), atol=1e-3)
    if name == "learned-positions":
        # The table's rows: without positions the later document reads rows 5.. .
        shifted = model(later, segment_ids=seg)
        assert not np.allclose(np.asarray(shifted[:, 5:]), np.asarray(alone), atol=1e-3)


def test_weights_mask_targets():
    model = GPT(CONFIGS["rotary"], key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, ROW), 1, 32)
    w = jnp.ones(tokens.shape).at[:, :6].set(0.0)  # a prompt of 6 tokens per row
    out = lm_loss(model, tokens, weights=w)
    assert isinstance(out, eqxpar.train.WeightedMean)
    per_token = eqxpar.nn.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], head=model.embed)
    expected = jnp.sum(per_token[:, 5:]) / per_token[:, 5:].size
    np.testing.assert_allclose(float(out.value()), float(expected), rtol=1e-6)
    assert float(out.weight) == per_token[:, 5:].size
    # Fractional weights: the weighted mean.
    w2 = jnp.linspace(0.1, 1.0, ROW)[None].repeat(2, 0)
    out2 = lm_loss(model, tokens, weights=w2)
    expected2 = jnp.sum(w2[:, 1:] * per_token) / jnp.sum(w2[:, 1:])
    np.testing.assert_allclose(float(out2.value()), float(expected2), rtol=1e-6)
    # Per row: each row's weighted mean.
    rows = lm_loss(model, tokens, weights=w2, per_row=True)
    np.testing.assert_allclose(
        np.asarray(rows),
        np.asarray(jnp.sum(w2[:, 1:] * per_token, 1) / jnp.sum(w2[:, 1:], 1)),
        rtol=1e-6,
    )


def test_unpacked_loss_is_unchanged():
    # No packing input: the plain mean, a scalar, as before.
    model = GPT(CONFIGS["rotary"], key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(2), (2, ROW), 1, 32)
    out = lm_loss(model, tokens)
    assert isinstance(out, jax.Array) and out.shape == ()
    per_token = eqxpar.nn.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:], head=model.embed)
    assert float(out) == float(jnp.mean(per_token))
    assert float(lm_loss(model, {"tokens": tokens})) == float(out)
    # Positions alone (0 .. seq - 1 given explicitly) weigh nothing differently.
    pos = jnp.broadcast_to(jnp.arange(ROW), tokens.shape)
    np.testing.assert_allclose(float(lm_loss(model, tokens, positions=pos)), float(out), rtol=1e-6)


def test_pipeline_pieces_compose():
    model = GPT(CONFIGS["rotary"], key=jax.random.key(0))
    batch = packed_batch(documents(3, 2))
    pieces = gpt_last(model, model.blocks(gpt_first(model, batch), **gpt_stack_kwargs(batch)), batch)
    whole = lm_loss(model, batch)
    assert_trees_close((pieces.total, pieces.weight), (whole.total, whole.weight))
    loss = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last, stack_kwargs=gpt_stack_kwargs)
    out = loss(model, batch)
    assert_trees_close((out.total, out.weight), (whole.total, whole.weight))


def test_moe_gpt_takes_packing():
    config = dataclasses.replace(CONFIGS["rotary"], moe_every=2, experts=4, top_k=2)
    model = GPT(config, key=jax.random.key(0))
    docs = documents(4, 2)
    packed, padded = lm_loss(model, packed_batch(docs)), lm_loss(model, padded_batch(docs))
    # The routing's statistics (load balance) see other rows, so only the
    # cross-entropy part is compared, through a model without the auxiliary terms.
    plain = GPT(dataclasses.replace(config, load_balance_coef=0, router_z_coef=0), key=jax.random.key(0))
    np.testing.assert_allclose(
        float(lm_loss(plain, packed_batch(docs)).value()), float(lm_loss(plain, padded_batch(docs)).value()), rtol=1e-5
    )
    assert float(packed.weight) == float(padded.weight)


BAD = {
    "segment ids of another shape": (dict(segment_ids=jnp.zeros((2, ROW - 1), jnp.int32)), "segment_ids"),
    "float segment ids": (dict(segment_ids=jnp.zeros((2, ROW), jnp.float32)), "segment_ids=...): dtype"),
    "float positions": (dict(positions=jnp.zeros((2, ROW), jnp.float32)), "positions=...): dtype"),
    "positions past max_seq_len": (
        dict(positions=jnp.broadcast_to(jnp.arange(ROW) + 1, (2, ROW))),
        "positions from 1 to 16",
    ),
    "negative positions": (dict(positions=jnp.full((2, ROW), -1, jnp.int32)), "positions from -1"),
    "weights all zero": (dict(weights=jnp.zeros((2, ROW)).at[:, 0].set(1.0)), "every target's weight is 0"),
    "weights of another shape": (dict(weights=jnp.ones((2, 3))), "weights=...): shape (2, 3)"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_packing_inputs_are_named(case):
    model = GPT(CONFIGS["rotary"], key=jax.random.key(0))
    tokens = jnp.ones((2, ROW), jnp.int32)
    kwargs, match = BAD[case]
    with pytest.raises(eqxpar.BatchError, match=match.replace("(", r"\(").replace(")", r"\)")):
        lm_loss(model, tokens, **kwargs)


def test_bad_batch_mappings_are_named():
    model = GPT(CONFIGS["rotary"], key=jax.random.key(0))
    tokens = jnp.ones((2, ROW), jnp.int32)
    with pytest.raises(eqxpar.BatchError, match="unknown: \\['mask'\\]"):
        lm_loss(model, {"tokens": tokens, "mask": tokens})
    with pytest.raises(eqxpar.BatchError, match="given both"):
        lm_loss(model, {"tokens": tokens, "weights": jnp.ones((2, ROW))}, weights=jnp.ones((2, ROW)))
    with pytest.raises(eqxpar.BatchError, match="GPT\\(segment_ids=...\\): shape \\(2, 3\\)"):
        model(tokens, segment_ids=jnp.zeros((2, 3), jnp.int32))
