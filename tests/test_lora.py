"""LoRA (eqxpar.models.add_lora / merge_lora / lora_trainable / save_lora): the
adapters PEFT and transformers read back compute eqxpar's logits (references
made by tests/data/lora/make_references.py); the adapters shard with their base
weights under every plan and add no collective beyond their own; training the
adapters alone equals one device under every kind of plan (tensor, automatic and
manual FSDP, context, expert, each pipeline placement); bad inputs raise eqxpar
errors."""

import dataclasses
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec

import eqxpar
from eqxpar.models import GPT, GPTConfig, add_lora, lm_loss, lora_trainable, merge_lora, save_lora

from ._helpers import (
    LORA_DATA,
    LORA_TARGETS,
    assert_params_close,
    assert_trees_close,
    lm_tokens,
    lora_reference_model,
    train_checked,
    with_drawn_b,
)

safetensors_numpy = pytest.importorskip("safetensors.numpy")

CONFIG = GPTConfig(
    vocab_size=64, d_model=64, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=128, max_seq_len=16
)
FUSED = GPTConfig(
    vocab_size=64,
    d_model=64,
    num_heads=4,
    num_layers=2,
    d_hidden=128,
    max_seq_len=16,
    activation="gelu",
    norm="layer",
    tied=False,
    rotary=False,
    learned_positions=True,
    use_bias=True,
    fused_qkv=True,
)
ALL = ("q", "k", "v", "o", "gate", "up", "down")
MOE = dataclasses.replace(CONFIG, moe_every=2, experts=4, num_shared_experts=1)


def _logits(model, tokens):
    return eqx.filter_jit(lambda m, t: m(t))(model, tokens)


def _read(path):
    return dict(safetensors_numpy.load_file(str(path)))


@pytest.mark.parametrize("name", list(LORA_TARGETS))
def test_peft_and_transformers_read_what_eqxpar_writes(name, tmp_path):
    ref = np.load(LORA_DATA / name / "reference.npz")
    tokens = jnp.asarray(ref["tokens"])
    model = lora_reference_model(name)
    # The adapter eqxpar writes is the committed one PEFT read ...
    save_lora(model, tmp_path / "adapter")
    committed = json.loads((LORA_DATA / name / "adapter_config.json").read_text())
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text()) == committed
    assert_trees_close(
        _read(tmp_path / "adapter" / "adapter_model.safetensors"),
        _read(LORA_DATA / name / "adapter_model.safetensors"),
    )
    # ... and eqxpar's logits are PEFT's (the adapter moves them by O(1)).
    assert_trees_close(_logits(model, tokens), ref["peft_logits"])
    assert (
        np.abs(
            ref["peft_logits"] - np.load(LORA_DATA.parent / "pretrained" / name / "reference.npz")["logits"]
        ).max()
        > 0.5
    )
    # Merged: the checkpoint save_pretrained writes is the one transformers read.
    merged = merge_lora(model)
    assert_trees_close(_logits(merged, tokens), ref["merged_logits"])
    eqxpar.models.save_pretrained(merged, tmp_path / "merged")
    assert_trees_close(
        _read(tmp_path / "merged" / "model.safetensors"),
        _read(LORA_DATA / name / "merged" / "model.safetensors"),
    )


def _projection_dims(path: str) -> tuple[str, int]:
    """The base weight of an adapter leaf's path and its number of input dims."""
    proj = path.rsplit(".", 1)[1][:-2]
    layer = path.split(".lora.")[0]
    base = {"q": "wq", "k": "wk", "v": "wv", "qkv": "wqkv", "o": "wo"}.get(proj)
    if base is not None:
        return f"{layer}.{base}", 2 if proj == "o" else 1
    return f"{layer}.{'w_out' if proj == 'down' else 'w_in'}", 1


def _trim(spec) -> PartitionSpec:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def _expected_spec(base_spec, base_ndim, adapter_path, leaf) -> PartitionSpec:
    """The spec an adapter leaf must have: its base weight's entries for the
    dimensions it shares with it (layers; `A`'s inputs; `B`'s outputs), None
    for the rank."""
    entries = list(base_spec) + [None] * (base_ndim - len(base_spec))
    proj = adapter_path.rsplit(".", 1)[1]
    _, in_dims = _projection_dims(adapter_path)
    lead = entries[:1]  # the stack's layer dimension
    ins, outs = entries[1 : 1 + in_dims], entries[1 + in_dims :]
    if proj[:-2] in ("gate", "up"):
        outs = outs[1:]  # w_in's (n_in) dimension, which the adapters do not have
    return _trim(lead + ins + [None] if proj.endswith("_a") else lead + [None] + outs)


def _plans():
    M, MF = eqxpar.rules.MEGATRON, eqxpar.rules.MEGATRON_FSDP
    dp_tp = dict(data=4, tensor=2)
    return {
        "data": eqxpar.Plan(eqxpar.make_mesh(data=8)),
        "fsdp": eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0)),
        "tp-auto": eqxpar.Plan(eqxpar.make_mesh(**dp_tp), rules=M),
        "tp-manual-sp": eqxpar.Plan(
            eqxpar.make_mesh(**dp_tp), rules=M, mode="manual", sequence_parallel=True
        ),
        "fsdp-tp": eqxpar.Plan(eqxpar.make_mesh(data=2, fsdp=2, tensor=2), rules=MF),
        "zero1-tp": eqxpar.Plan(eqxpar.make_mesh(**dp_tp), rules=M, zero1=True),
        "pipeline-tp": eqxpar.Plan(
            eqxpar.make_mesh(pipe=2, data=2, tensor=2),
            rules=eqxpar.pipeline.stage_rules(M),
            schedule="1f1b",
            microbatches=2,
        ),
        "context-tp": eqxpar.Plan(eqxpar.make_mesh(data=2, context=2, tensor=2), rules=M),
    }


@pytest.mark.parametrize("config", [CONFIG, FUSED], ids=["llama", "gpt2"])
def test_adapters_shard_with_their_base_under_every_plan(config):
    targets = ALL if not config.fused_qkv else ("qkv", "o", "up", "down")
    model = eqx.filter_eval_shape(
        lambda k: add_lora(GPT(config, key=k), rank=2, targets=targets, key=k), jax.random.key(0)
    )
    flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(model)[0]}
    adapters = [p for p in flat if ".lora." in p]
    assert len(adapters) == 2 * len(targets)
    for name, plan in _plans().items():
        specs = eqxpar.partition_specs(model, plan)
        spec = {jax.tree_util.keystr(p): s for p, s in jax.tree_util.tree_flatten_with_path(specs)[0]}
        for path in adapters:
            base, _ = _projection_dims(path)
            got = _trim(spec[path])
            if name == "fsdp":
                # Shape-based rules: the adapter's own largest dimension, never the rank.
                rank_dim = flat[path].ndim - 1 if path.endswith("_a") else 1
                assert len(got) <= rank_dim or got[rank_dim] is None, (name, path, got)
                continue
            want = _expected_spec(spec[base], flat[base].ndim, path, flat[path])
            assert got == want, (name, path, got, want, spec[base])
        if name == "tp-auto":  # the rule of the issue, spelled out for one plan
            attn = jax.tree.map(
                _trim, specs.blocks.blocks.attn.lora, is_leaf=lambda x: isinstance(x, PartitionSpec)
            )
            mlp = jax.tree.map(
                _trim, specs.blocks.blocks.mlp.lora, is_leaf=lambda x: isinstance(x, PartitionSpec)
            )
            if config.fused_qkv:
                assert attn.qkv_a == PartitionSpec() and attn.qkv_b == PartitionSpec(
                    None, None, None, "tensor"
                )
            else:
                assert attn.q_a == PartitionSpec() and attn.q_b == PartitionSpec(None, None, "tensor")
            assert attn.o_a == PartitionSpec(None, "tensor") and attn.o_b == PartitionSpec()
            assert mlp.up_b == PartitionSpec(None, None, "tensor") and mlp.down_a == PartitionSpec(
                None, "tensor"
            )


def _trained_adapters(model, seed=5):
    # B nonzero (add_lora's is zero), so every adapter moves the output.
    adapters, frozen = eqx.partition(model, lora_trainable(model))
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [x + 0.2 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys, strict=True)]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


def _adapter_bytes(model, tokens_per_device: int) -> int:
    """What the adapters may move beyond the base model: their gradients' sums
    and one (tokens, rank) product per adapter and layer each way, twice over."""
    params = sum(x.size * 4 for x in jax.tree.leaves(eqx.filter(model, lora_trainable(model))))
    n = len([p for p in jax.tree.leaves(eqx.filter(model, lora_trainable(model)))]) // 2
    rank = model.blocks.blocks.attn.lora.rank
    activations = n * model.config.num_layers * tokens_per_device * rank * 4
    return 2 * (params + 2 * activations)


# tp-manual-sp in make test, the others in make test-slow (tests/_slow_cases.py).
PARITY_PLANS = {
    # Manual, sequence parallel: the column adapters ride on the base's gather.
    "tp-manual-sp": dict(mesh=dict(data=4, tensor=2), mode="manual", sequence_parallel=True),
    # Manual without sequence parallelism.
    "tp-manual": dict(mesh=dict(data=4, tensor=2), mode="manual"),
    # Manual with ring collective matmuls.
    "tp-overlap": dict(mesh=dict(data=4, tensor=2), mode="manual", sequence_parallel=True, tp_overlap=True),
    # Automatic (GSPMD) with FSDP: the adapters' model dimension split over fsdp.
    "fsdp-tp": dict(mesh=dict(data=2, fsdp=2, tensor=2), rules=eqxpar.rules.MEGATRON_FSDP),
    # Automatic, sequence parallel.
    "tp-auto-sp": dict(mesh=dict(data=4, tensor=2), sequence_parallel=True),
}


@pytest.mark.parametrize("name", list(PARITY_PLANS))
def test_adapted_model_trains_as_one_device_with_only_its_own_collectives(name):
    options = {"rules": eqxpar.rules.MEGATRON, **PARITY_PLANS[name]}
    plan = eqxpar.Plan(eqxpar.make_mesh(**options.pop("mesh")), **options)
    base = GPT(CONFIG, key=jax.random.key(0))
    model = _trained_adapters(add_lora(base, rank=2, alpha=4, targets=ALL, key=jax.random.key(1)))
    tokens = lm_tokens(0, batch=16, seq=CONFIG.max_seq_len, vocab=CONFIG.vocab_size)
    train_checked(plan, model, optax.sgd(0.1), lm_loss, [tokens])
    # Communication: the adapted step moves what the base step moves, plus at
    # most the adapters' own (their gradients and (tokens, rank) products).
    optim = optax.sgd(0.1)
    step = eqxpar.train.make_step(lm_loss, optim, plan)
    batch = eqxpar.shard_batch(tokens, plan)
    stats = [
        eqxpar.inspect.collective_stats(
            step.compile(eqxpar.train.init(m, optim, plan, key=jax.random.key(0)), batch)
        )
        for m in (base, model)
    ]
    extra = stats[1].total_wire_bytes - stats[0].total_wire_bytes
    allowance = _adapter_bytes(model, 16 * CONFIG.max_seq_len)
    assert 0 <= extra <= allowance, (extra, allowance, stats)
    # No new kind of collective (GSPMD, left free, moved fsdp-split adapters with
    # collective-permutes; they are gathered as FSDP gathers a weight instead).
    new = {kind for kind in stats[1].count if stats[1].count[kind] and not stats[0].count[kind]}
    assert not new, stats


@pytest.mark.parametrize("config", [CONFIG, FUSED], ids=["llama", "gpt2"])
def test_merge_folds_every_projection_into_its_weight(config):
    targets = ("qkv", "o", "up", "down") if config.fused_qkv else ALL
    model = _trained_adapters(
        add_lora(GPT(config, key=jax.random.key(0)), rank=3, alpha=6, targets=targets, key=jax.random.key(1))
    )
    tokens = lm_tokens(0, batch=2, seq=config.max_seq_len - 1, vocab=config.vocab_size)
    merged = merge_lora(model)
    assert jax.tree.structure(merged) == jax.tree.structure(
        eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    )
    adapted, folded = eqx.filter_jit(lambda m, w, t: (m(t), w(t)))(model, merged, tokens)
    assert_trees_close(folded, adapted)


def test_add_lora_starts_as_the_base_model_and_trainable_marks_only_adapters():
    base = GPT(CONFIG, key=jax.random.key(0))
    model = add_lora(base, rank=2, key=jax.random.key(1))  # PEFT's default targets: q and v
    lora = model.blocks.blocks.attn.lora
    assert lora.q_a.shape == (2, 64, 2) and lora.v_b.shape == (2, 2, 2, 16) and lora.k_a is None
    assert model.blocks.blocks.mlp.lora is None and lora.scale == 1.0
    tokens = lm_tokens(0, batch=2, seq=8, vocab=64)
    assert_trees_close(_logits(model, tokens), _logits(base, tokens))
    trainable = lora_trainable(model)
    assert jax.tree.structure(trainable) == jax.tree.structure(model)
    flags = {jax.tree_util.keystr(p): f for p, f in jax.tree_util.tree_flatten_with_path(trainable)[0]}
    assert {p for p, f in flags.items() if f} == {
        ".blocks.blocks.attn.lora.q_a",
        ".blocks.blocks.attn.lora.q_b",
        ".blocks.blocks.attn.lora.v_a",
        ".blocks.blocks.attn.lora.v_b",
    }


def test_gpt2_default_target_is_the_fused_qkv():
    model = add_lora(GPT(FUSED, key=jax.random.key(0)), rank=2, key=jax.random.key(1))
    assert model.blocks.blocks.attn.lora.qkv_b.shape == (2, 2, 3, 4, 16)


@pytest.mark.parametrize(
    "config, kwargs, match",
    [
        (CONFIG, dict(rank=0), "rank=0"),
        (CONFIG, dict(rank=2, alpha=-1.0), "alpha"),
        (CONFIG, dict(rank=2, dropout=1.0), r"dropout=1.0.*\[0, 1\)"),
        (CONFIG, dict(rank=2, targets="q"), "tuple of projection names"),
        (CONFIG, dict(rank=2, targets=("q", "x")), r"\['x'\] unknown"),
        (CONFIG, dict(rank=2, targets=("qkv",)), "separate wq, wk, wv"),
        (FUSED, dict(rank=2, targets=("q", "v")), "fused QKV"),
        (FUSED, dict(rank=2, targets=("gate",)), "no gate"),
        # An MoE model: its experts take no adapters, so MLP targets are refused.
        (
            MOE,
            dict(rank=2, targets=("q", "up")),
            r"MoE feed-forwards.*\['up'\].*targets=\('q', 'k', 'v', 'o'\)",
        ),
    ],
)
def test_add_lora_bad_arguments(config, kwargs, match):
    model = eqx.filter_eval_shape(GPT, config, key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match=match):
        add_lora(model, key=jax.random.key(1), **kwargs)


def test_lora_misuse_names_the_fix(tmp_path):
    base = GPT(CONFIG, key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match="no adapters"):
        lora_trainable(base)
    with pytest.raises(eqxpar.models.PretrainedError, match="no adapters"):
        save_lora(base, tmp_path)
    with pytest.raises(eqxpar.PlanError, match="no eqxpar.nn.Attention"):
        add_lora({"w": jnp.ones(3)}, rank=2, key=jax.random.key(0))
    model = add_lora(base, rank=2, key=jax.random.key(1))
    with pytest.raises(eqxpar.PlanError, match="already has adapters"):
        add_lora(model, rank=2, key=jax.random.key(1))
    with pytest.raises(eqxpar.models.PretrainedError, match="merge_lora"):
        eqxpar.models.save_pretrained(model, tmp_path / "unmerged")


def test_training_with_lora_trainable_moves_only_the_adapters():
    # Section 1's trainable filter: frozen weights get no optimizer state and stay
    # bit for bit; the adapters' steps equal one device's.
    plan = eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    )
    model = _trained_adapters(
        add_lora(GPT(CONFIG, key=jax.random.key(0)), rank=2, alpha=4, targets=ALL, key=jax.random.key(1))
    )
    trainable = lora_trainable(model)
    # eps well above float32 noise: Adam's g / (|g| + eps) would turn a tiny gradient's
    # last-bit difference (a sharded sum's order) into a whole step.
    optim = optax.adam(1e-2, eps=1e-3)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0), trainable=trainable)
    adapters, frozen = eqx.partition(model, trainable)
    adapter_bytes = sum(x.nbytes for x in jax.tree.leaves(adapters))
    moments = [x for x in jax.tree.leaves(state.opt_state) if eqx.is_array(x) and x.ndim]
    assert sum(x.nbytes for x in moments) == 2 * adapter_bytes  # Adam's two moments, adapters only
    step = eqxpar.train.make_step(lm_loss, optim, plan, trainable=trainable)
    batches = [lm_tokens(i, batch=16, seq=CONFIG.max_seq_len, vocab=CONFIG.vocab_size) for i in range(2)]

    @eqx.filter_jit
    def reference(adapters, opt_state, tokens):
        grads = eqx.filter_grad(lambda a: lm_loss(eqx.combine(a, frozen), tokens))(adapters)
        updates, opt_state = optim.update(grads, opt_state, adapters)
        return eqx.apply_updates(adapters, updates), opt_state

    ref, ref_state = adapters, optim.init(adapters)
    for tokens in batches:
        state, _ = step(state, tokens)
        ref, ref_state = reference(ref, ref_state, tokens)
    got_adapters, got_frozen = eqx.partition(state.model, trainable)
    assert_trees_close(got_adapters, ref)
    for a, b in zip(jax.tree.leaves(got_frozen), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # frozen: exactly the base


# The plans tests/test_frozen.py trains frozen weights under, beyond the tensor and
# automatic FSDP plans above: manual FSDP, context, expert (an MoE GPT, attention
# adapters) and every pipeline placement (the plan reorders the stack, adapters
# included; `stage_layers` pads a stage's slots).
def _pipeline_plan(schedule, chunks=1, **kw):
    return eqxpar.Plan(
        eqxpar.make_mesh(pipe=2, data=4),
        rules=eqxpar.pipeline.stage_rules(None),
        schedule=schedule,
        microbatches=2,
        chunks=chunks,
        **kw,
    )


LORA_PLANS = {
    "fsdp-manual": lambda: eqxpar.Plan(
        eqxpar.make_mesh(data=2, fsdp=4), rules=eqxpar.rules.FSDP(min_size=0), mode="manual"
    ),
    "context": lambda: eqxpar.Plan(
        eqxpar.make_mesh(context=2, data=4), mode="manual", context_attention="allgather"
    ),
    "expert": lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
    "1f1b-uneven": lambda: _pipeline_plan("1f1b", stage_layers=(1, 3)),
    "interleaved": lambda: _pipeline_plan("interleaved", chunks=2),
    "zb_v": lambda: _pipeline_plan("zb_v", chunks=2),
}
PIPELINE_LOSS = eqxpar.pipeline.PipelineLoss(
    eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last
)
# eps well above float32 noise: see test_training_with_lora_trainable_moves_only_the_adapters.
LORA_OPTIM = optax.adam(1e-2, eps=1e-3)


@eqx.filter_jit
def _adapters_step(adapters, frozen, opt_state, tokens):
    """One device's step of the adapters alone: (adapters, opt_state, loss). At
    module level, so cases of one model's shapes compile it once."""
    loss, grads = eqx.filter_value_and_grad(lambda a: lm_loss(eqx.combine(a, frozen), tokens))(adapters)
    updates, opt_state = LORA_OPTIM.update(grads, opt_state, adapters)
    return eqx.apply_updates(adapters, updates), opt_state, loss


@pytest.mark.parametrize("name", list(LORA_PLANS))
def test_lora_trains_as_one_device_under_manual_fsdp_context_expert_and_pipeline_plans(name):
    plan = LORA_PLANS[name]()
    pipeline = plan.schedule is not None
    if plan.expert_size > 1:  # adapters on the attention (an MoE block's experts take none)
        config, targets = MOE, ("q", "k", "v", "o")
    else:
        config, targets = dataclasses.replace(CONFIG, num_layers=4 if pipeline else 2), ALL
    model = _trained_adapters(
        add_lora(GPT(config, key=jax.random.key(0)), rank=2, alpha=4, targets=targets, key=jax.random.key(1))
    )
    trainable = lora_trainable(model)
    if config.moe_every:  # only the attention's (the shared experts are an MLP, which takes none)
        adapted = [
            jax.tree_util.keystr(p) for p, t in jax.tree_util.tree_flatten_with_path(trainable)[0] if t
        ]
        assert adapted and all(".attn.lora." in p for p in adapted), adapted
    state = eqxpar.train.init(model, LORA_OPTIM, plan, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(
        PIPELINE_LOSS if pipeline else lm_loss, LORA_OPTIM, plan, trainable=trainable
    )
    adapters, frozen = eqx.partition(model, trainable)
    ref, ref_state = adapters, LORA_OPTIM.init(adapters)
    for i in range(2):
        tokens = lm_tokens(i, batch=8, seq=8, vocab=CONFIG.vocab_size)
        state, metrics = step(state, tokens)
        ref, ref_state, ref_loss = _adapters_step(ref, frozen, ref_state, tokens)
        assert_trees_close(float(metrics["loss"]), float(ref_loss), err_msg=f"loss at step {i}")
    got_adapters, got_frozen = eqx.partition(eqxpar.nn.in_natural_order(state.model), trainable)
    assert_params_close(got_adapters, ref)
    for a, b in zip(jax.tree.leaves(got_frozen), jax.tree.leaves(frozen), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # frozen: exactly the base


def test_adapter_dropout_takes_the_step_key_and_matches_one_device_under_a_data_plan(tmp_path):
    # PEFT's lora_dropout: each adapter's input dropped, with a key only.
    make = lambda rate: _trained_adapters(  # noqa: E731
        add_lora(
            GPT(CONFIG, key=jax.random.key(0)),
            rank=2,
            alpha=4,
            targets=ALL,
            dropout=rate,
            key=jax.random.key(1),
        )
    )
    plain, dropped = make(0.0), make(0.3)
    assert dropped.blocks.blocks.mlp.lora.dropout == 0.3
    tokens = lm_tokens(0, batch=8, seq=8, vocab=CONFIG.vocab_size)
    key = jax.random.key(7)
    loss_of = eqx.filter_jit(lambda m, t, k: lm_loss(m, t, key=k))
    # Rate 0, or no key: exactly no dropout (the key reaches no layer).
    base = float(loss_of(plain, tokens, None))
    assert float(loss_of(plain, tokens, key)) == base and float(loss_of(dropped, tokens, None)) == base
    # With a key: other masks per key, the same for the same key.
    grad = eqx.filter_jit(eqx.filter_value_and_grad(lambda m, t, k: lm_loss(m, t, key=k)))
    ref = grad(dropped, tokens, key)
    assert abs(float(ref[0]) - base) > 1e-4
    assert abs(float(grad(dropped, tokens, jax.random.key(8))[0]) - float(ref[0])) > 1e-4
    # A data-parallel plan (automatic: threefry is partitionable) draws one
    # device's masks for the key; a manual tensor-parallel one its own, deterministically.
    data = eqxpar.Plan(eqxpar.make_mesh(data=8))
    loss, grads = eqxpar.train.make_value_and_grad(lm_loss, data)(dropped, tokens, key=key)
    assert_trees_close(float(loss), float(ref[0]))
    assert_trees_close(grads, eqx.filter(ref[1], eqx.is_array))
    # A manual tensor-parallel step: each device draws its own masks from the
    # step's key, the same ones for the same state.
    manual = eqxpar.Plan(
        eqxpar.make_mesh(data=4, tensor=2), rules=eqxpar.rules.MEGATRON, mode="manual", sequence_parallel=True
    )
    trainable = lora_trainable(dropped)
    optim = optax.sgd(0.1)
    state = eqxpar.train.init(dropped, optim, manual, key=jax.random.key(0), trainable=trainable)
    step = eqxpar.train.make_step(lm_loss, optim, manual, trainable=trainable, donate=False)
    (one, m1), (two, m2) = step(state, tokens), step(state, tokens)
    assert float(m1["loss"]) == float(m2["loss"]) and abs(float(m1["loss"]) - base) > 1e-4
    for a, b in zip(
        jax.tree.leaves(eqx.filter(one.model, trainable)),
        jax.tree.leaves(eqx.filter(two.model, trainable)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    save_lora(dropped, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["lora_dropout"] == 0.3
    # A pipeline passes its stack no key: refused rather than trained without dropout.
    with pytest.raises(eqxpar.PlanError, match=r"dropout=0.0"):
        PIPELINE_LOSS(dropped, tokens)


def test_save_lora_writes_every_layer_of_an_moe_model_under_its_own_index(tmp_path):
    # Mixtral's layout (every block MoE): one adapter per layer, named by its layer.
    config = GPTConfig(
        vocab_size=64,
        d_model=32,
        num_heads=4,
        num_layers=4,
        d_hidden=64,
        moe_every=1,
        experts=4,
        top_k=2,
        activation="swiglu",
        norm="rms",
    )
    model = add_lora(
        GPT(config, key=jax.random.key(0)), rank=2, targets=("q", "k", "v", "o"), key=jax.random.key(1)
    )
    model = with_drawn_b(model, key=jax.random.key(5), scale=1.0)
    save_lora(model, tmp_path)
    tensors = _read(tmp_path / "adapter_model.safetensors")
    # Attention's four projections (the experts take none), A and B, each of 4 layers.
    assert len(tensors) == 4 * 2 * 4
    lora = model.blocks.blocks.moe.attn.lora
    for layer in range(4):
        name = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        np.testing.assert_array_equal(tensors[f"{name}.lora_A.weight"], np.asarray(lora.q_a[layer]).T)
        b = np.asarray(lora.q_b[layer]).reshape(2, -1).T
        np.testing.assert_array_equal(tensors[f"{name}.lora_B.weight"], b)


def test_save_lora_refuses_an_moe_model_with_dense_blocks_between(tmp_path):
    # moe_every=2 is Qwen2-MoE's layout in Hugging Face (decoder_sparse_step), whose
    # shared experts carry a gate eqxpar's lack: save_pretrained cannot write the
    # base, so no adapter can name its modules. It wrote layers 0 and 1 only.
    config = GPTConfig(
        vocab_size=64, d_model=32, num_heads=4, num_layers=4, d_hidden=64, moe_every=2, experts=4, top_k=2
    )
    model = add_lora(GPT(config, key=jax.random.key(0)), rank=2, key=jax.random.key(1))
    with pytest.raises(eqxpar.models.PretrainedError, match=r"save_lora: .*GPTConfig\(moe_every=2\)"):
        save_lora(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    with pytest.raises(eqxpar.models.PretrainedError, match=r"GPTConfig\(moe_every=2\)"):
        eqxpar.models.save_pretrained(GPT(config, key=jax.random.key(0)), tmp_path / "base")
