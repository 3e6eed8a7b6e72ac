"""eqxpar.models.generate (prefill, then one token at a time against a key/value
cache): greedy decoding equals transformers' `generate(do_sample=False)` token for
token on the tiny reference checkpoints (tests/data/pretrained/<name>/generation.npz,
made by make_generation_references.py there), on one device and under data x
tensor in automatic, manual and partial-manual mode; sampling keeps to top-k /
top-p, its log-probabilities are the full forward pass's, and it does not depend
on the plan; stop tokens, left-padded rows and the refusals."""

import dataclasses
import pathlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar.models import GPT, GPTConfig, from_pretrained, generate

from ._helpers import assert_trees_close

DATA = pathlib.Path(__file__).parent / "data" / "pretrained"


def reference(name):
    ref = np.load(DATA / name / "generation.npz")
    return {k: ref[k] for k in ref.files}


def check_against_transformers(name, plan=None):
    ref = reference(name)
    # Near-ties would make a token-for-token comparison depend on float noise: the
    # smallest top-2 logit margin along each row is far above it (recorded, printed).
    print(name, "smallest top-2 margins per row", ref["margins"])
    assert ref["margins"].min() > 5e-4
    model = from_pretrained(DATA / name, plan)
    steps = ref["tokens"].shape[1]
    out = generate(
        model,
        jnp.asarray(ref["prompt"]),
        steps=steps,
        key=jax.random.key(0),
        temperature=0.0,
        prompt_lengths=ref["lengths"],
        plan=plan,
    )
    width = ref["prompt"].shape[1]
    np.testing.assert_array_equal(np.asarray(out.tokens[:, :width]), ref["prompt"])
    np.testing.assert_array_equal(np.asarray(out.tokens[:, width:]), ref["tokens"])
    assert_trees_close(np.asarray(out.logprobs), ref["logprobs"])
    np.testing.assert_array_equal(np.asarray(out.lengths), [steps] * len(ref["lengths"]))


@pytest.mark.parametrize("name", ["llama3_rope", "qwen2", "mixtral", "gpt2"])
def test_greedy_matches_transformers_on_one_device(name):
    check_against_transformers(name)


PLANS = {
    "llama3_rope": dict(mode="auto"),
    "qwen2": dict(mode="manual", sequence_parallel=True),  # generation turns SP off
    "mixtral": dict(mode="manual"),
    "gpt2": dict(mode="manual", manual_axes=("tensor",)),
}


@pytest.mark.parametrize("name", list(PLANS))
def test_greedy_matches_transformers_under_data_and_tensor(name):
    mesh = eqxpar.make_mesh(data=4, tensor=2)
    check_against_transformers(name, eqxpar.Plan(mesh, rules=eqxpar.rules.MEGATRON, **PLANS[name]))


def test_decode_layout_shards_the_cache_like_the_attention():
    # Under the manual plans above each device's cache must hold its own key heads:
    # a whole-heads cache would not take the keys its shard of the weights computes.
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    )
    layout = eqxpar.internal.DecodeLayout.resolve(eqxpar.internal.ResolvedPlan.of(plan), batch=8)
    assert layout.manual and layout.manual_axes is None and layout.batch_axes == ("data", "fsdp")
    assert not layout.plan.sequence_parallel and layout.plan.rules == plan.rules
    # (layers, blocks per layer, batch, slots, kv_heads, head_dim)
    assert layout.cache_spec("tensor") == P(None, None, ("data", "fsdp"), None, "tensor", None)


def tiny_model(**overrides):
    config = GPTConfig(
        vocab_size=32, d_model=16, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=32, max_seq_len=32
    )
    return eqx.filter_jit(GPT)(dataclasses.replace(config, **overrides), key=jax.random.key(1))


def full_logprobs(model, tokens, width):
    """Log-softmax of the whole-sequence forward pass at each generated token."""
    logits = eqx.filter_jit(lambda m, t: m(t))(model, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits[:, width - 1 :], axis=-1)
    return logp, jnp.take_along_axis(logp, tokens[:, width:, None], axis=2)[..., 0]


def test_sampling_keeps_to_top_k_and_top_p_with_the_models_logprobs():
    model = tiny_model()
    prompt = jax.random.randint(jax.random.key(2), (4, 5), 0, 32)
    kw = dict(steps=6, key=jax.random.key(3))
    greedy = generate(model, prompt, temperature=0.0, **kw)
    # One compilation serves every setting (all traced).
    top1 = generate(model, prompt, temperature=1.5, top_k=1, **kw)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    top3 = generate(model, prompt, temperature=1.5, top_k=3, **kw)
    logp, chosen = full_logprobs(model, top3.tokens, 5)
    # The cache gives the full forward pass's distribution at every step.
    assert_trees_close(top3.logprobs, chosen)
    rank = jnp.sum(logp > chosen[..., None], axis=-1)
    assert int(rank.max()) < 3 and int(rank.max()) > 0  # sampled, within the top 3
    nucleus = generate(model, prompt, temperature=1.0, top_p=0.5, **kw)
    logp, chosen = full_logprobs(model, nucleus.tokens, 5)
    # Kept: the tokens whose more likely ones hold less than 0.5 of the probability.
    before = jnp.sum(jnp.where(logp > chosen[..., None], jnp.exp(logp), 0.0), axis=-1)
    assert float(before.max()) < 0.5
    assert not np.array_equal(nucleus.tokens, greedy.tokens)


def test_sampling_under_a_plan_equals_one_device():
    model = tiny_model()
    prompt = jax.random.randint(jax.random.key(4), (8, 4), 0, 32)
    kw = dict(steps=5, key=jax.random.key(5), temperature=1.0, top_p=0.9)
    one = generate(model, prompt, **kw)
    plan = eqxpar.Plan(eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual")
    with plan:  # the current plan is used
        sharded = generate(eqxpar.shard(model, plan), prompt, **kw)
    np.testing.assert_array_equal(sharded.tokens, one.tokens)
    assert_trees_close(sharded.logprobs, one.logprobs)


def test_stop_tokens_and_left_padded_rows():
    model = tiny_model(rotary=False, learned_positions=True)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, 32, (3, 6)), jnp.int32)
    lengths = jnp.asarray([6, 2, 4])
    kw = dict(steps=8, key=jax.random.key(0), temperature=0.0, prompt_lengths=lengths)
    free = generate(model, prompt, **kw)
    # A row decodes as it would alone: its padding is never read, positions count
    # from its first token (the learned table) ...
    for row, n in enumerate([6, 2, 4]):
        # max_length: one compilation for the three rows.
        alone = generate(
            model, prompt[row, 6 - n :], steps=8, key=jax.random.key(0), temperature=0.0, max_length=14
        )
        np.testing.assert_array_equal(alone.tokens[n:], free.tokens[row, 6:])
        assert_trees_close(alone.logprobs, free.logprobs[row])
    # ... and the padding's values do not matter.
    repadded = generate(model, prompt.at[1, :4].set(7), **kw)
    np.testing.assert_array_equal(repadded.tokens[1, 6:], free.tokens[1, 6:])
    stop = int(free.tokens[0, 8])  # row 0's third new token
    out = generate(model, prompt, stop_tokens=(stop,), **kw)
    for row in range(3):
        new = np.asarray(free.tokens[row, 6:])
        hits = np.nonzero(new == stop)[0]
        n = int(hits[0]) + 1 if len(hits) else 8
        assert int(out.lengths[row]) == n
        np.testing.assert_array_equal(out.tokens[row, 6 : 6 + n], new[:n])
        assert (np.asarray(out.tokens[row, 6 + n :]) == stop).all()
        assert (np.asarray(out.logprobs[row, n:]) == 0).all()
    assert int(out.lengths[0]) <= 3


def test_generate_refuses_what_it_cannot_serve():
    model = tiny_model()
    prompt = jnp.zeros((4, 3), jnp.int32)
    key = jax.random.key(0)
    pipeline = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=4),
        rules=eqxpar.pipeline.stage_rules(),
        schedule="gpipe",
        microbatches=2,
    )
    with pytest.raises(eqxpar.PlanError, match="without pipe"):
        generate(model, prompt, steps=2, key=key, plan=pipeline)
    with pytest.raises(eqxpar.PlanError, match="no context axis"):
        generate(model, prompt, steps=2, key=key, plan=eqxpar.Plan(eqxpar.make_mesh(context=2, data=4)))
    with pytest.raises(eqxpar.PlanError, match="without an expert axis"):
        generate(model, prompt, steps=2, key=key, plan=eqxpar.Plan(eqxpar.make_mesh(expert=2, data=4)))
    with pytest.raises(eqxpar.BatchError, match="multiple of 8"):
        generate(model, prompt, steps=2, key=key, plan=eqxpar.Plan(eqxpar.make_mesh(data=8)))
    fsdp = eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(min_size=1), mode="manual")
    with pytest.raises(eqxpar.PlanError, match="mode='auto'"):
        generate(model, jnp.zeros((8, 3), jnp.int32), steps=2, key=key, plan=fsdp)
    for bad, match in [
        (dict(top_p=0.0), "top_p=0.0"),
        (dict(top_k=-1), "top_k=-1"),
        (dict(temperature=-1.0), "temperature=-1"),
        (dict(max_length=4), "max_length >= 5"),
        (dict(stop_tokens=(32,)), "from 0 to 31"),
    ]:
        with pytest.raises(eqxpar.PlanError, match=match):
            generate(model, prompt, steps=2, key=key, **bad)
    with pytest.raises(eqxpar.SpecError, match="from 1 to 3"):
        generate(model, prompt, steps=2, key=key, prompt_lengths=[3, 0, 1, 2])
    with pytest.raises(eqxpar.SpecError, match=r"\(4,\) integers"):
        generate(model, prompt, steps=2, key=key, prompt_lengths=[3, 3])
    learned = tiny_model(rotary=False, learned_positions=True, max_seq_len=8)
    with pytest.raises(eqxpar.PlanError, match="max_seq_len=8"):
        generate(learned, prompt, steps=6, key=key)
