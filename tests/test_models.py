"""eqxpar.models: one GPT definition gives the single-device loss and gradients
under every plan (data parallel, FSDP, tensor parallel automatic and manual with the
vocabulary split or whole, sequence parallelism, ring overlap, partial-manual, remat),
tied and untied, SwiGLU and GELU, grouped-query attention; over three optimizer steps
for two of them. Tied heads, the pipeline pieces, generation and the MLP classifier."""

import dataclasses
import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar import models, nn
from eqxpar.models import GPT, GPTConfig, MLPClassifier, generate, gpt_first, gpt_last, lm_loss

from ._helpers import (
    GPT2_STYLE,
    GPT_CONFIGS,
    assert_trees_close,
    assert_trees_close_to_scale,
    lm_tokens,
    reference_run,
    run_steps,
    value_and_grad_on_one_device,
)

CONFIGS = GPT_CONFIGS
BATCH, SEQ = 8, 8  # tokens are (BATCH, SEQ + 1): SEQ predicted positions


tokens = functools.partial(lm_tokens, batch=BATCH, seq=SEQ)


# (id, config, plan factory). Factories: the mesh is built when the test runs.
PLANS = [
    ("dp-auto", "gelu-untied", lambda: eqxpar.Plan(eqxpar.make_mesh(data=8))),
    (
        "fsdp-tp-auto-remat-full",
        "swiglu-tied-gqa",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, fsdp=2, tensor=2), rules=eqxpar.rules.MEGATRON_FSDP, remat="full"
        ),
    ),
    (
        "tp-auto",
        "gelu-untied",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON),
    ),
    (
        "tp-sync",
        "swiglu-tied-gqa",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual"),
    ),
    (
        "tp-sp-remat-full",
        "gelu-untied",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=4, tensor=2),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
            remat="full",
        ),
    ),
]

# Megatron with the vocabulary whole on every device (a small vocabulary).
WHOLE_VOCAB = eqxpar.rules.Logical({"mlp": "tensor", "heads": "tensor", "kv_heads": "tensor"})
PLANS += [
    (
        f"whole-vocab-{name}",
        config,
        lambda options=options: eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=WHOLE_VOCAB, **options),
    )
    for name, config, options in [
        ("auto", "gelu-untied", {}),
        ("sync", "swiglu-tied-gqa", {"mode": "manual"}),
        ("sp", "gelu-untied", {"mode": "manual", "sequence_parallel": True}),
        ("sp-tied", "swiglu-tied-gqa", {"mode": "manual", "sequence_parallel": True}),
        ("auto-sp", "swiglu-tied-gqa", {"sequence_parallel": True}),
    ]
]

# Trained for three SGD steps against single-device training.
STEP_PLANS = [
    (
        "tp-overlap",
        "swiglu-tied-gqa",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
            tp_overlap=True,
        ),
    ),
    (
        "partial-manual-sp",
        "gelu-untied",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            manual_axes=("tensor",),
            sequence_parallel=True,
        ),
    ),
]


class Lazy(dict):
    """A dict that computes a missing entry with `make(name)`: each xdist worker
    builds (compiles) only what its tests use."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, name):
        self[name] = self.make(name)
        return self[name]


@pytest.fixture(scope="module")
def gpts():
    # Built under jit: one compilation, not one per random array.
    return Lazy(lambda name: eqx.filter_jit(GPT)(CONFIGS[name], key=jax.random.key(0)))


@pytest.fixture(scope="module")
def single_device(gpts):
    """Loss and gradients of `lm_loss` on one device, per config."""

    def run(name):
        return value_and_grad_on_one_device(gpts[name], lm_loss, tokens(1))

    return Lazy(run)


@pytest.mark.parametrize("config,make_plan", [p[1:] for p in PLANS], ids=[p[0] for p in PLANS])
def test_gpt_loss_and_gradients_match_single_device(gpts, single_device, config, make_plan):
    loss, grads = eqxpar.train.make_value_and_grad(lm_loss, make_plan())(gpts[config], tokens(1))
    ref_loss, ref_grads = single_device[config]
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


@pytest.mark.parametrize("config,make_plan", [p[1:] for p in STEP_PLANS], ids=[p[0] for p in STEP_PLANS])
def test_gpt_training_steps_match_single_device(gpts, config, make_plan):
    # One batch three times: the loss must fall, so the steps demonstrably update.
    model, optim, batches = gpts[config], optax.sgd(0.5), [tokens(1)] * 3
    ref_losses, ref_model = reference_run(model, optim, lm_loss, batches)
    plan = make_plan()
    step = eqxpar.train.make_step(lm_loss, optim, plan)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    losses, state = run_steps(step, state, batches)
    assert_trees_close(losses, ref_losses)
    assert ref_losses[-1] < ref_losses[0]  # the steps did train
    assert_trees_close_to_scale(state.model, ref_model)


def test_gpt_structure_and_pipeline_pieces(gpts):
    tied, untied = gpts["swiglu-tied-gqa"], gpts["gelu-untied"]
    assert tied.head is None and isinstance(untied.head, nn.Unembed)
    assert isinstance(tied.blocks, nn.Stacked) and tied.blocks.depth == 2
    assert tied.blocks.blocks.attn.wq.shape == (2, 32, 8, 4)  # one leading layer axis
    batch = tokens(2)

    def pieces(model):
        h = model.blocks(model.embed_tokens(batch[:, :-1]))
        normed = model.final_norm(h)
        # The loss written out independently: optax on the model's logits, shifted labels.
        direct = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(batch[:, :-1]), batch[:, 1:]))
        split = gpt_last(model, model.blocks(gpt_first(model, batch)), batch)
        return model.logits(h), normed, direct, split, lm_loss(model, batch)

    @eqx.filter_jit
    def pieces_and_causality(tied, untied):
        return pieces(tied), (untied(batch), untied(changed))

    changed = batch.at[:, 5].set((batch[:, 5] + 1) % 32)
    (logits, normed, direct, split, loss), (out, out_changed) = pieces_and_causality(tied, untied)
    # A tied head scores the activations against the embedding's own rows.
    assert_trees_close(logits, normed @ tied.embed.weight.T)
    assert_trees_close(float(loss), float(direct))
    assert_trees_close(float(split), float(direct))
    # Logits do not depend on later tokens (causal) but do on earlier ones.
    assert_trees_close(out[:, :5], out_changed[:, :5])
    assert float(jnp.max(jnp.abs(out[:, 5:] - out_changed[:, 5:]))) > 1e-4


def test_generate_greedy_matches_rerunning_the_model():
    config = GPTConfig(vocab_size=16, d_model=16, num_heads=2, num_layers=1, d_hidden=32, max_seq_len=12)
    model = eqx.filter_jit(GPT)(config, key=jax.random.key(3))
    prompt = jax.random.randint(jax.random.key(4), (2, 7), 0, 16)
    out = generate(model, prompt, steps=5, key=jax.random.key(0), temperature=0.0)
    assert out.tokens.shape == (2, 12) and out.logprobs.shape == (2, 5)
    np.testing.assert_array_equal(out.tokens[:, :7], prompt)
    forward = eqx.filter_jit(lambda m, ids: m(ids))
    ids = prompt
    for _ in range(5):  # the key/value cache gives what re-reading the whole sequence gives
        ids = jnp.concatenate([ids, jnp.argmax(forward(model, ids)[:, -1], axis=-1)[:, None]], axis=1)
    np.testing.assert_array_equal(out.tokens, ids)
    # Sampling (the same compilation: the temperature is traced) stays in the
    # vocabulary and differs from the greedy choice.
    sampled = [generate(model, prompt, steps=5, key=jax.random.key(i), temperature=2.0) for i in range(3)]
    assert all(
        s.tokens.shape == (2, 12) and int(s.tokens.min()) >= 0 and int(s.tokens.max()) < 16 for s in sampled
    )
    assert any(not np.array_equal(s.tokens, out.tokens) for s in sampled)


def test_gpt_errors():
    with pytest.raises(eqxpar.PlanError, match="activation='relu'"):
        GPTConfig(vocab_size=8, d_model=8, num_heads=2, num_layers=1, d_hidden=8, activation="relu")
    with pytest.raises(eqxpar.DivisibilityError, match="num_heads=3"):
        GPTConfig(vocab_size=8, d_model=8, num_heads=3, num_layers=1, d_hidden=8)
    with pytest.raises(eqxpar.DivisibilityError, match="is odd"):
        GPTConfig(vocab_size=8, d_model=12, num_heads=4, num_layers=1, d_hidden=8)
    with pytest.raises(eqxpar.PlanError, match="unroll=0"):
        GPTConfig(vocab_size=8, d_model=8, num_heads=2, num_layers=1, d_hidden=8, unroll=0)
    config = GPTConfig(vocab_size=8, d_model=8, num_heads=2, num_layers=1, d_hidden=8, max_seq_len=4)
    model = eqx.filter_jit(GPT)(config, key=jax.random.key(0))
    with pytest.raises(eqxpar.SpecError, match="max_seq_len=4"):
        model(jnp.zeros((1, 5), jnp.int32))
    with pytest.raises(eqxpar.SpecError, match="at least one token"):
        generate(model, jnp.zeros((1, 0), jnp.int32), steps=2, key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match="temperature=-1"):
        generate(model, jnp.zeros((1, 2), jnp.int32), steps=2, key=jax.random.key(0), temperature=-1.0)


def test_gpt_unrolled_stack_gives_the_same_logits():
    config = GPTConfig(vocab_size=16, d_model=8, num_heads=2, num_layers=2, d_hidden=16)
    unrolled = dataclasses.replace(config, unroll=2)
    scanned_model = GPT(config, key=jax.random.key(0))
    unrolled_model = GPT(unrolled, key=jax.random.key(0))
    assert (scanned_model.blocks.unroll, unrolled_model.blocks.unroll) == (1, 2)
    x = jax.random.randint(jax.random.key(1), (2, 6), 0, 16)
    assert_trees_close(eqx.filter_jit(unrolled_model)(x), eqx.filter_jit(scanned_model)(x))


def classifier_batch():
    kx, ky = jax.random.split(jax.random.key(5))
    return jax.random.normal(kx, (8, 12)), jax.random.randint(ky, (8,), 0, 5)


@pytest.fixture(scope="module")
def classifier():
    model = eqx.filter_jit(MLPClassifier)(12, 16, 5, depth=2, key=jax.random.key(0))
    batch = classifier_batch()
    return model, batch, eqx.filter_jit(eqx.filter_value_and_grad(MLPClassifier.loss))(model, batch)


@pytest.mark.parametrize("mode", ["auto", "manual"])
def test_mlp_classifier_matches_single_device(classifier, mode):
    model, batch, (ref_loss, ref_grads) = classifier
    assert len(model.ups) == len(model.downs) == 2
    plan = eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode=mode)
    loss, grads = eqxpar.train.make_value_and_grad(MLPClassifier.loss, plan)(model, batch)
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


def test_mlp_classifier_rejects_sequence_parallel_plans(classifier):
    model = classifier[0]
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, sequence_parallel=True
    )
    with pytest.raises(eqxpar.PlanError, match="sequence_parallel=True"):
        eqxpar.train.make_value_and_grad(MLPClassifier.loss, plan)(model, classifier_batch())
    with pytest.raises(eqxpar.PlanError, match="depth=0"):
        MLPClassifier(12, 16, 5, depth=0, key=jax.random.key(0))


def test_models_namespace():
    assert eqxpar.models is models
    for name in ("GPT", "GPTConfig", "MLPClassifier", "lm_loss", "generate", "gpt_first", "gpt_last"):
        assert getattr(models, name).__doc__


GPT2_PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)

# (id, plan factory, loss): sequence parallelism splits the position table with the
# sequence (manual) or leaves it to GSPMD (automatic); the pipeline adds it on stage 0.
GPT2_PLANS = [
    (
        "tp-sync",
        lambda: eqxpar.Plan(eqxpar.make_mesh(data=2, tensor=4), rules=eqxpar.rules.MEGATRON, mode="manual"),
        lm_loss,
    ),
    (
        "tp-sp",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=4, tensor=2),
            rules=eqxpar.rules.MEGATRON,
            mode="manual",
            sequence_parallel=True,
        ),
        lm_loss,
    ),
    (
        "fsdp-tp-auto-sp",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(data=2, fsdp=2, tensor=2),
            rules=eqxpar.rules.MEGATRON_FSDP,
            sequence_parallel=True,
        ),
        lm_loss,
    ),
    (
        "pipe-data-tensor-1f1b",
        lambda: eqxpar.Plan(
            eqxpar.make_mesh(pipe=2, data=2, tensor=2),
            rules=eqxpar.pipeline.stage_rules(eqxpar.rules.MEGATRON),
            schedule="1f1b",
            microbatches=2,
        ),
        GPT2_PIPELINE_LOSS,
    ),
]


@pytest.fixture(scope="module")
def gpt2_style():
    """The GPT-2 style model and its single-device loss and gradients."""
    model = eqx.filter_jit(GPT)(GPT2_STYLE, key=jax.random.key(0))
    return model, value_and_grad_on_one_device(model, lm_loss, tokens(1))


@pytest.mark.parametrize("make_plan,loss_fn", [p[1:] for p in GPT2_PLANS], ids=[p[0] for p in GPT2_PLANS])
def test_gpt2_style_config_matches_single_device(gpt2_style, make_plan, loss_fn):
    model, (ref_loss, ref_grads) = gpt2_style
    assert model.positions.shape == (16, 32) and model.blocks.blocks.attn.wqkv.shape == (2, 32, 3, 4, 8)
    assert model.blocks.blocks.attn.wq is None
    loss, grads = eqxpar.train.make_value_and_grad(loss_fn, make_plan())(model, tokens(1))
    assert_trees_close(float(loss), float(ref_loss))
    assert_trees_close_to_scale(grads, ref_grads)


def test_gpt2_style_positions_tell_tokens_apart():
    # Without rotary attention the position table is the only source of order: a
    # model built without it gives the same logits to a token wherever it stands.
    def logits_and_first(config):
        # The logits of one token repeated, and the first position's repeated.
        model = eqx.filter_jit(GPT)(config, key=jax.random.key(0))
        same = jnp.full((1, 6), 3, jnp.int32)
        logits = np.asarray(eqx.filter_jit(lambda m, t: m(t))(model, same)[0])
        return logits, np.broadcast_to(logits[:1], logits.shape)

    # Equal to float32 rounding (attention averages equal values in another order
    # at each position), relative to the logits' scale; with positions, not.
    assert_trees_close(*logits_and_first(dataclasses.replace(GPT2_STYLE, learned_positions=False)))
    with pytest.raises(AssertionError):
        assert_trees_close(*logits_and_first(GPT2_STYLE))


def test_the_benchmark_workload_is_the_gpt2_style_config():
    # The benchmarks run this GPT: the GPT-2 style options at the workload's sizes.
    from benchmarks import _workload

    workload = dataclasses.replace(
        GPT2_STYLE, vocab_size=512, d_model=256, num_heads=4, num_layers=4, d_hidden=1024, max_seq_len=128
    )
    assert dataclasses.replace(_workload.gpt_config(), attention="auto") == workload
    shapes = eqx.filter_eval_shape(_workload.make_model)
    assert isinstance(shapes, GPT) and _workload.param_count(shapes) == _workload.PARAM_COUNT == 3_454_464


def test_gpt_config_rejects_a_fused_qkv_with_grouped_query_heads():
    match = r"GPTConfig\(fused_qkv=True, num_kv_heads=2\).*Use fused_qkv=False"
    with pytest.raises(eqxpar.PlanError, match=match):
        GPTConfig(
            vocab_size=8, d_model=8, num_heads=4, num_kv_heads=2, num_layers=1, d_hidden=8, fused_qkv=True
        )


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_whole_vocab_embedding_and_head_move_no_activations(gpts, sequence_parallel):
    # With "vocab" unsplit the lookup, the head and the loss run on each device's own
    # tokens: no embedding all-reduce (or reduce-scatter), no cross-entropy
    # reductions, no gather of the sequence before the head. What stays over tensor
    # is the blocks' traffic (per block: the attention and MLP outputs forward and
    # their inputs' cotangents backward) plus the gradient reductions.
    model = gpts["gelu-untied"]

    def counts(rules):
        plan = eqxpar.Plan(
            eqxpar.make_mesh(data=2, tensor=4),
            rules=rules,
            mode="manual",
            sequence_parallel=sequence_parallel,
        )
        step = eqxpar.train.make_step(lm_loss, optax.sgd(0.1), plan)
        state = eqxpar.train.init(model, optax.sgd(0.1), plan, key=jax.random.key(0))
        return eqxpar.inspect.collective_stats(step.compile(state, eqxpar.shard_batch(tokens(1), plan))).count

    whole, split = counts(WHOLE_VOCAB), counts(eqxpar.rules.MEGATRON)
    layers = CONFIGS["gelu-untied"].num_layers
    if sequence_parallel:
        assert whole["all-gather"] == whole["reduce-scatter"] == 4 * layers
        assert split["all-gather"] == split["reduce-scatter"] == 4 * layers + 2
    else:
        # 4 activation all-reduces a block, then the gradients' (fused by XLA).
        assert 4 * layers < whole["all-reduce"] <= 4 * layers + 2 < split["all-reduce"]


ROUND_TRIP_CONFIGS = {
    "default": GPTConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=64),
    "gpt2": GPT2_STYLE,
    "llama3": GPTConfig(
        vocab_size=64,
        d_model=32,
        num_heads=4,
        num_layers=2,
        d_hidden=64,
        num_kv_heads=2,
        norm_eps=1e-5,
        rotary_base=500000.0,
        rotary_scaling=nn.RotaryScaling(8.0, 1.0, 4.0, 16),
        attention="blockwise",
        attention_block=8,
        unroll=2,
    ),
    "qwen2_moe": GPTConfig(
        vocab_size=64,
        d_model=32,
        num_heads=4,
        num_layers=4,
        d_hidden=64,
        qkv_bias=True,
        moe_every=2,
        experts=4,
        top_k=1,
        moe_score="sigmoid",
        num_shared_experts=1,
        capacity_factor=2,
        load_balance_coef=0.0,
        router_z_coef=0.0,
    ),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIP_CONFIGS))
def test_gpt_config_from_its_block_config_is_itself(name):
    # The grouped form (a block's config + the model-only fields) and the flat one
    # are the same config: block_config and from_block are inverses.
    config = ROUND_TRIP_CONFIGS[name]
    model_only = {f: getattr(config, f) for f in ("tied", "max_seq_len", "learned_positions", "unroll")}
    model_only |= {f: getattr(config, f) for f in ("moe_every", "load_balance_coef", "router_z_coef")}
    sizes = {f: getattr(config, f) for f in ("vocab_size", "d_model", "num_layers", "d_hidden")}
    block = config.block_config(moe=bool(config.experts))
    assert GPTConfig.from_block(block, **sizes, **model_only) == config


def test_gpt_config_from_block_refuses_what_a_gpt_cannot_honour():
    sizes = dict(vocab_size=64, d_model=32, num_layers=2, d_hidden=64)
    attention = nn.AttentionConfig(4)
    for block, match in (
        (nn.BlockConfig(nn.AttentionConfig(4, causal=False)), r"block.attention.causal=False.*causal=True"),
        (nn.BlockConfig(nn.AttentionConfig(4, head_dim=4)), r"block.attention.head_dim=4"),
        (nn.BlockConfig(attention, dropout=0.1), r"block.dropout=0.1"),
        (nn.BlockConfig(nn.AttentionConfig(4, use_bias=False)), r"block.attention.use_bias=False"),
        (nn.BlockConfig(attention, moe=nn.MoEConfig(4, route_scale=2.0)), r"block.moe.route_scale=2.0"),
    ):
        with pytest.raises(eqxpar.PlanError, match=match):
            GPTConfig.from_block(block, **sizes)
    with pytest.raises(eqxpar.PlanError, match=r"from_block\(\.\.\., num_heads=\.\.\.\): the block gives"):
        GPTConfig.from_block(nn.BlockConfig(attention), **sizes, num_heads=4)
    with pytest.raises(eqxpar.PlanError, match="expected an eqxpar.nn.BlockConfig"):
        GPTConfig.from_block(attention, **sizes)
    # A head_dim that is d_model // num_heads is what a GPT has anyway.
    assert GPTConfig.from_block(nn.BlockConfig(nn.AttentionConfig(4, head_dim=8)), **sizes).num_heads == 4


@pytest.mark.parametrize(
    "fields,match",
    [
        (dict(moe_score="bogus"), r"GPTConfig\(moe_score='bogus'\)"),
        (dict(top_k=0), r"GPTConfig\(top_k=0\)"),
        (dict(capacity_factor=-1.0), r"GPTConfig\(capacity_factor=-1.0\)"),
        (dict(num_shared_experts=-1), r"GPTConfig\(num_shared_experts=-1\)"),
    ],
)
def test_a_dense_config_still_checks_its_routing_fields(fields, match):
    # A dense model routes nothing, but a bad value is refused, not ignored.
    with pytest.raises(eqxpar.PlanError, match=match):
        GPTConfig(vocab_size=64, d_model=32, num_heads=4, num_layers=2, d_hidden=64, **fields)
