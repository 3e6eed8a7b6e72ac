"""Host offload (`Plan(offload=...)`): optimizer state, parameters and named
activations in host memory, under every plan family, bit for bit the plain step."""

import importlib.util

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import eqxpar
from eqxpar import nn
from eqxpar.pipeline import PipelineLoss, stage_rules

from ._helpers import StackedLM, assert_trees_close_to_scale, stacked_lm_batches

QKV = ("query_proj", "key_proj", "value_proj")


def _lm_loss(model, batch):
    # Right in every layout, sequence parallelism included.
    ids, targets = batch
    return nn.sequence_mean(nn.cross_entropy(model(ids), targets, head=model.head))


PIPELINE_LOSS = PipelineLoss(
    first=lambda m, batch: m.embed(batch[0]),
    stack=lambda m: m.blocks,
    last=lambda m, h, batch: jnp.mean(
        optax.softmax_cross_entropy_with_integer_labels(m.head(m.norm(h)), batch[1])
    ),
)


def _plan(family: str, **options) -> eqxpar.Plan:
    if family == "data":
        return eqxpar.Plan(eqxpar.make_mesh(data=8), **options)
    if family == "fsdp-auto":
        return eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), **options)
    if family == "fsdp-manual":
        return eqxpar.Plan(eqxpar.make_mesh(fsdp=8), rules=eqxpar.rules.FSDP(), mode="manual", **options)
    if family == "tensor-sp":
        mesh = eqxpar.make_mesh(data=2, tensor=4)
        return eqxpar.Plan(
            mesh, rules=eqxpar.rules.MEGATRON, sequence_parallel=True, mode="manual", **options
        )
    if family == "pipeline":
        mesh = eqxpar.make_mesh(pipe=2, data=4)
        return eqxpar.Plan(mesh, rules=stage_rules(), schedule="1f1b", microbatches=2, **options)
    raise AssertionError(family)


FAMILIES = ("data", "fsdp-auto", "fsdp-manual", "tensor-sp", "pipeline")


def _train(plan: eqxpar.Plan, steps: int = 3):
    model = StackedLM(key=jax.random.key(0), depth=2)
    optimizer = optax.adamw(1e-2)
    loss = PIPELINE_LOSS if plan.schedule is not None else _lm_loss
    state = eqxpar.train.init(model, optimizer, plan, key=jax.random.key(1))
    step = eqxpar.train.make_step(loss, optimizer, plan)
    losses = []
    for batch in stacked_lm_batches(steps):
        state, metrics = step(state, batch)
        losses.append(np.asarray(metrics["loss"]))
    return losses, state


def _memory_kinds(tree) -> set:
    # Arrays and outlines (jax.ShapeDtypeStruct) alike.
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if hasattr(x, "sharding") and x.shape}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_offloaded_step_is_the_plain_one_bit_for_bit(family):
    # The optimizer state and the parameters live in host memory between steps;
    # the step moves them to the device and back inside the program. Nothing
    # else changes, so every loss and every array is the plain step's exactly.
    plain_losses, plain = _train(_plan(family))
    losses, state = _train(_plan(family, offload=("optimizer", "params")))
    assert _memory_kinds(state.opt_state) == {"pinned_host"}
    assert _memory_kinds(state.model) == {"pinned_host"}
    assert _memory_kinds(plain.opt_state) == {"device"}
    np.testing.assert_array_equal(np.stack(losses), np.stack(plain_losses))
    for a, b in zip(
        jax.tree.leaves((state.model, state.opt_state)),
        jax.tree.leaves((plain.model, plain.opt_state)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_offloaded_state_saves_and_restores_from_host_memory(tmp_path):
    # Saved from host memory; restored into it under the same plan, and onto the
    # device under another plan (FSDP without offload), bit for bit both ways.
    pytest.importorskip("orbax.checkpoint")
    from eqxpar.checkpoint import CheckpointManager

    offloaded = _plan("data", offload=("optimizer", "params"))
    _, state = _train(offloaded, steps=1)
    with CheckpointManager(tmp_path) as manager:
        manager.save(1, state)
    like = eqxpar.train.init(
        StackedLM(key=jax.random.key(5), depth=2),
        optax.adamw(1e-2),
        offloaded,
        key=jax.random.key(1),
        abstract=True,
    )
    assert _memory_kinds(like.opt_state) == {"pinned_host"}
    same, _ = CheckpointManager(tmp_path).restore(like=like, plan=offloaded)
    assert _memory_kinds(same.opt_state) == _memory_kinds(same.model) == {"pinned_host"}
    other_plan = _plan("fsdp-auto")
    other, _ = CheckpointManager(tmp_path).restore(like=like, plan=other_plan)
    assert _memory_kinds(other.opt_state) == {"device"}
    for restored in (same, other):
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
            np.testing.assert_array_equal(
                np.asarray(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else a),
                np.asarray(jax.random.key_data(b) if jnp.issubdtype(b.dtype, jax.dtypes.prng_key) else b),
            )
    # Either restored state steps on under its plan.
    for plan, restored in ((offloaded, same), (other_plan, other)):
        step = eqxpar.train.make_step(_lm_loss, optax.adamw(1e-2), plan)
        new, metrics = step(restored, stacked_lm_batches(2)[1])
        assert np.isfinite(float(metrics["loss"]))


def test_activation_offload_warns_on_cpu_and_computes_the_saved_policy():
    # XLA:CPU lowers the offload to a plain save: the step warns, naming the
    # backend, and gives the saved policy's results exactly.
    saved = _plan("data", remat=eqxpar.RematPolicy(saved=QKV))
    offloaded = _plan("data", remat=eqxpar.RematPolicy(offloaded=QKV), offload=("activations",))
    saved_losses, saved_state = _train(saved, steps=2)
    with pytest.warns(eqxpar.OffloadWarning, match="XLA:CPU.*'cpu'.*query_proj"):
        losses, state = _train(offloaded, steps=2)
    np.testing.assert_array_equal(np.stack(losses), np.stack(saved_losses))
    for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(saved_state.model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_named_policy_keeps_what_it_names_and_matches_the_plain_step():
    # RematPolicy(saved=...) recomputes what it does not name; the gradients are
    # the plain step's to float32 rounding.
    model = StackedLM(key=jax.random.key(0), depth=2)
    batch = stacked_lm_batches(1)[0]
    plain = eqxpar.train.make_value_and_grad(_lm_loss, _plan("data"))(model, batch)
    policy = eqxpar.RematPolicy(saved=("mlpwi", "decoder_layer_input"))
    named = eqxpar.train.make_value_and_grad(_lm_loss, _plan("data", remat=policy))(model, batch)
    assert_trees_close_to_scale(named, plain)


def test_the_names_are_in_the_layers_forward():
    # Every name of ACTIVATION_NAMES but the fused projection's is given by a
    # separate-projection block (and qkv_proj by a fused one), as the policy sees it.
    def names(fused):
        config = nn.BlockConfig(nn.AttentionConfig(4, fused_qkv=fused), activation="swiglu")
        block = nn.TransformerBlock(32, 64, config, key=jax.random.key(0))
        jaxpr = jax.make_jaxpr(block)(jnp.zeros((2, 8, 32)))
        return {str(e.params["name"]) for e in jaxpr.jaxpr.eqns if e.primitive.name == "name"}

    assert names(False) == set(eqxpar.ACTIVATION_NAMES) - {"qkv_proj"}
    assert names(True) == set(eqxpar.ACTIVATION_NAMES) - set(QKV)


def test_abstract_init_gives_outlines_in_host_memory():
    plan = _plan("fsdp-auto", offload=("optimizer",))
    outline = eqx.filter_eval_shape(StackedLM, key=jax.random.key(0))
    state = eqxpar.train.init(outline, optax.adamw(1e-2), plan, key=jax.random.key(1), abstract=True)
    assert _memory_kinds(state.opt_state) == {"pinned_host"}
    assert _memory_kinds(state.model) == {"device"}
    # It compiles from shapes, with the state's arguments and outputs in host memory.
    text = (
        eqxpar.train.make_step(_lm_loss, optax.adamw(1e-2), plan)
        .lower(state, stacked_lm_batches(1)[0])
        .as_text()
    )
    assert 'mhlo.memory_kind = "pinned_host"' in text


@pytest.mark.parametrize(
    "options, match",
    [
        (
            dict(offload="disk"),
            r"\['disk'\] unknown; expected some of \('optimizer', 'params', 'activations'\)",
        ),
        (dict(offload=3), "expected a sequence"),
        (dict(offload=("activations",)), "names none.*RematPolicy"),
        (dict(remat=eqxpar.RematPolicy(offloaded=("mlpwi",))), r"add 'activations' to Plan\(offload=...\)"),
        (dict(remat="some"), "RematPolicy"),
    ],
)
def test_bad_offload_options_raise_naming_the_fix(options, match):
    with pytest.raises(eqxpar.PlanError, match=match):
        _plan("data", **options)


@pytest.mark.parametrize(
    "arguments, match",
    [
        (dict(saved=("query",)), r"\['query'\] name no activation"),
        (dict(saved=("mlpwi",), offloaded=("mlpwi",)), "in both"),
        (dict(offloaded=3), "expected a sequence of activation names"),
    ],
)
def test_bad_remat_policies_raise_naming_the_fix(arguments, match):
    with pytest.raises(eqxpar.PlanError, match=match):
        eqxpar.RematPolicy(**arguments)


def test_aot_command_refuses_an_unknown_offload_part(capsys):
    from eqxpar import aot

    status = aot.main(
        ["--model", "gpt2", "--plan", "data=8", "--set", "num_layers=1", "--offload", "optimizer,disk"]
    )
    assert status == 2
    assert "['disk'] unknown" in capsys.readouterr().out


def test_aot_plan_of_offloads_the_named_activations():
    from eqxpar import aot

    plan = aot.plan_of({"fsdp": 8}, topology=None, offload=("activations", "optimizer"))
    assert plan.offload == ("optimizer", "activations")
    assert plan.remat == eqxpar.RematPolicy(offloaded=(*QKV, "qkv_proj"))


def test_aot_plan_of_keeps_the_saved_names_on_the_device(capsys):
    # The base an activation offload is measured against: the same names saved.
    from eqxpar import aot

    plan = aot.plan_of({"fsdp": 8}, topology=None, saved_names=QKV)
    assert plan.offload == () and plan.remat == eqxpar.RematPolicy(saved=QKV)
    both = aot.plan_of({"fsdp": 8}, topology=None, offload=("activations",), saved_names=("mlpwi",))
    assert both.remat == eqxpar.RematPolicy(saved=("mlpwi",), offloaded=(*QKV, "qkv_proj"))
    status = aot.main(["--model", "gpt2", "--plan", "data=8", "--saved-names", "query_proj,attention"])
    assert status == 2
    assert "['attention'] name no activation" in capsys.readouterr().out


def _update_inputs(optimizer, depth=4):
    model = StackedLM(key=jax.random.key(0), depth=depth)
    params = eqx.filter(model, eqx.is_inexact_array)
    grads = jax.tree.map(lambda x: jax.random.normal(jax.random.key(2), x.shape, x.dtype), params)
    return model, params, grads, optimizer.init(params)


@pytest.mark.parametrize(
    "optimizer, elementwise",
    [
        (optax.adamw(1e-2), True),
        (optax.adam(1e-2), True),
        (optax.sgd(1e-2, momentum=0.9), True),
        (optax.lion(1e-3), True),
        (optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2)), False),
        (optax.lamb(1e-2), False),
    ],
)
def test_only_an_elementwise_update_streams(optimizer, elementwise):
    # Chunking commutes with the update only where each new value is a function
    # of the same positions of its inputs: a global norm or a per-leaf trust
    # ratio (LAMB) reads the whole of every array.
    from eqxpar._train._streamed_update import elementwise_update

    _, params, grads, opt_state = _update_inputs(optimizer)
    assert elementwise_update(optimizer.update, grads, opt_state, params) is elementwise


@pytest.mark.parametrize("finite", [True, False])
def test_the_streamed_update_is_the_whole_update_chunk_by_chunk(finite):
    # One layer's chunk of every stacked array at a time (4 chunks), the
    # embedding, head and norms whole one shape at a time, over several steps;
    # a non-finite step keeps every old chunk.
    from eqxpar._train._streamed_update import chunk_count, streamed_update

    plan = _plan("fsdp-auto")
    optimizer = optax.adamw(1e-2)
    model, params, grads, opt_state = _update_inputs(optimizer)
    specs = eqxpar.partition_specs(model, plan)
    state_specs = eqxpar.partition_specs(opt_state, plan)
    chunks = chunk_count(model, specs)
    assert chunks == 4

    @jax.jit
    def streamed(grads, opt_state, params):
        return streamed_update(
            optimizer,
            grads,
            opt_state,
            params,
            chunks=chunks,
            mesh=plan.mesh,
            state_specs=state_specs,
            update_specs=specs,
            finite=jnp.asarray(finite),
        )

    @jax.jit
    def whole(grads, opt_state, params):
        updates, new_state = optimizer.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), new_state

    # In host memory, as the step keeps an offloaded state.
    on_host = jax.tree.map(
        lambda x, spec: jax.device_put(x, NamedSharding(plan.mesh, spec, memory_kind="pinned_host")),
        opt_state,
        state_specs,
    )
    a, b = (params, on_host), (params, opt_state)
    for _ in range(3):
        a = streamed(grads, a[1], a[0])
        b = whole(grads, b[1], b[0]) if finite else b
        # XLA:CPU fuses a chunk's update otherwise (a rounding apart).
        assert_trees_close_to_scale(a, b, rtol=1e-6, atol=1e-9)
        grads = jax.tree.map(lambda g: 0.5 * g + 0.01, grads)


#: Llama-3's shape, small: 8 layers 512 wide, a vocabulary small beside them (the
#: embedding's and head's moments come onto the device whole).
SMALL_LLAMA = dict(
    num_layers=8, d_model=512, num_heads=4, num_kv_heads=4, d_hidden=2048, vocab_size=1024, max_seq_len=256
)


@pytest.mark.slow  # two TPU compiles, 20-80 s
@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to compile for',
)
def test_on_the_tpu_compiler_the_streamed_update_takes_the_state_off_the_device():
    # Moved onto the device whole for the update, the state came back as
    # temporaries (on Llama-3-8B the peak fell by a fifth of it); streamed a
    # layer at a time, one layer's chunk of it is there at once.
    from eqxpar import aot

    config = eqxpar.models.preset("llama3-8b", **SMALL_LLAMA)
    reports = {
        offload: aot.compile_train_step(
            config,
            aot.plan_of({"fsdp": 4}, topology="v5p:2x2x1", rows_per_chip=1, offload=offload),
            batch=(1, 256),
            name="small",
        )
        for offload in ((), ("optimizer",))
    }
    plain, offloaded = reports[()], reports[("optimizer",)]
    moments = offloaded.host_argument_bytes
    assert moments == plain.argument_bytes - offloaded.argument_bytes
    # What the offload adds to the temporaries: a layer's chunk of the moments
    # in flight and the next one fetched (an eighth each of 8 layers'), and the
    # embedding's and head's, updated whole (3 % here); whole, the state came
    # back (on Llama-3-8B, 47 % of it).
    # (Measured: 10 % on libtpu 0.0.52, 17 % on 0.0.50.1. The bar, the
    # peak falling by 90 % of the moments, is the full model's: BENCHMARKS.md's
    # records and tests/test_advise_tpu.py.)
    assert offloaded.temp_bytes - plain.temp_bytes <= 0.35 * moments, (plain, offloaded)
