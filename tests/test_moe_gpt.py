"""Mixture-of-experts blocks in the model layers: a `TransformerBlock` with experts
equals its attention followed by its `MoE` called directly (forward, aux and
gradients); `Stacked` returns its blocks' aux stacked over the layers, under every
remat policy and with per-layer keys; an MoE `GPT` keeps its blocks in one stack
of groups, adds the configured auxiliary losses in `lm_loss`, trains under an
automatic data-parallel plan and on expert 4 x data 2 as on one device, warns
when micro-batches split its load-balance loss (and accumulates exactly without
it), and refuses pipelines; bad options raise eqxpar errors; examples/moe_gpt.py trains
and reports the expert load."""

import re
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqxpar
from eqxpar import nn
from eqxpar.models import GPT, GPTConfig, MoEGroup, gpt_first, gpt_last, lm_loss

from ._helpers import assert_trees_close, assert_trees_close_to_scale, example, lm_tokens, train_checked

D, HEADS, HIDDEN, E, BATCH, SEQ, VOCAB = 16, 2, 32, 4, 2, 8, 32


def make_x(seed=1):
    return jax.random.normal(jax.random.key(seed), (BATCH, SEQ, D))


def tokens(seed: int, batch: int = 8) -> jax.Array:
    return lm_tokens(seed, batch=batch, seq=SEQ, vocab=VOCAB)


def config(**kw) -> GPTConfig:
    base = dict(
        vocab_size=VOCAB,
        d_model=D,
        num_heads=HEADS,
        num_layers=4,
        d_hidden=HIDDEN,
        max_seq_len=SEQ,
        moe_every=2,
        experts=E,
    )
    return GPTConfig(**{**base, **kw})


# -- the block -----------------------------------------------------------------

BLOCKS = {
    "swiglu_rms_top2": nn.BlockConfig(
        nn.AttentionConfig(HEADS), moe=nn.MoEConfig(E, top_k=2), activation="swiglu", norm="rms"
    ),
    "gelu_layer_sigmoid_shared_capacity": nn.BlockConfig(
        nn.AttentionConfig(HEADS),
        moe=nn.MoEConfig(E, top_k=1, score="sigmoid", num_shared=1, capacity_factor=1.0),
        activation="gelu",
        norm="layer",
    ),
}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_block_with_experts_is_attention_then_moe(name):
    block = nn.TransformerBlock(D, HIDDEN, BLOCKS[name], key=jax.random.key(0))
    assert isinstance(block.mlp, nn.MoE) and block.experts == E
    assert block.mlp.activation == BLOCKS[name].activation
    x = make_x()
    cot = jax.random.normal(jax.random.key(2), x.shape)

    def reference(b, x):
        h = x + b.attn(b.norm1(x))
        y, aux = b.mlp(b.norm2(h))
        return h + y, aux

    @eqx.filter_jit
    def run(b, x, fn):
        def f(b):
            y, aux = fn(b, x)
            return jnp.sum(y * cot) + aux.load_balance_loss + aux.router_z_loss, (y, aux)

        (_, (y, aux)), grads = eqx.filter_value_and_grad(f, has_aux=True)(b)
        return y, aux, grads

    y, aux, grads = run(block, x, lambda b, x: b(x))
    y_ref, aux_ref, grads_ref = run(block, x, reference)
    assert_trees_close(y, y_ref)
    for got, want in zip(jax.tree.leaves(aux), jax.tree.leaves(aux_ref), strict=True):
        assert_trees_close(got, want)
    assert_trees_close_to_scale(grads, grads_ref)
    assert float(jnp.sum(aux.expert_load)) == BATCH * SEQ * block.mlp.top_k


def test_dense_block_returns_an_array():
    block = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=jax.random.key(0))
    assert isinstance(block.mlp, nn.MLP) and block.experts == 0
    y = block(make_x())
    assert isinstance(y, jax.Array) and y.shape == (BATCH, SEQ, D)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(activation="relu"), r"BlockConfig\(activation='relu'\): expected 'gelu' or 'swiglu'"),
        (dict(norm="batch"), r"BlockConfig\(norm='batch'\): expected 'layer' or 'rms'"),
        (dict(norm_eps=0.0), r"BlockConfig\(norm_eps=0.0\): expected a small positive number"),
        (dict(dropout=1.0), r"BlockConfig\(dropout=1.0\): expected a rate in \[0, 1\)"),
    ],
)
def test_block_config_names_the_bad_field(fields, match):
    with pytest.raises(eqxpar.PlanError, match=match):
        nn.BlockConfig(**{"attention": nn.AttentionConfig(HEADS), **fields})


# -- the stack -----------------------------------------------------------------


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_stacked_returns_aux_stacked_over_layers(remat):
    """Dropout on, so each layer's key matters: the stack equals its blocks called
    in order with the stack's per-layer keys, and aux row i is block i's."""
    depth = 3
    stack = nn.Stacked(
        # No biases: the attention's key bias has a zero gradient, all rounding noise.
        lambda k: nn.TransformerBlock(
            D,
            HIDDEN,
            nn.BlockConfig(
                nn.AttentionConfig(HEADS, use_bias=False), moe=nn.MoEConfig(E), dropout=0.1, use_bias=False
            ),
            key=k,
        ),
        depth=depth,
        key=jax.random.key(3),
    )
    x, key = make_x(), jax.random.key(4)

    def scanned(s):
        h, aux = s(x, key=key)
        return jnp.mean(h**2) + jnp.sum(aux.load_balance_loss) + jnp.sum(aux.router_z_loss), aux

    def looped(s):
        h, auxes = x, []
        for i, k in enumerate(jax.random.split(key, depth)):
            h, aux = s[i](h, key=k)
            auxes.append(aux)
        aux = jax.tree.map(lambda *a: jnp.stack(a), *auxes)
        return jnp.mean(h**2) + jnp.sum(aux.load_balance_loss) + jnp.sum(aux.router_z_loss), aux

    plan = eqxpar.Plan(eqxpar.make_mesh(data=8), remat=remat)
    grad = eqx.filter_value_and_grad(scanned, has_aux=True)
    with plan:
        (got, aux), got_g = eqx.filter_jit(grad)(stack)
    (want, want_aux), want_g = eqx.filter_jit(eqx.filter_value_and_grad(looped, has_aux=True))(stack)
    assert isinstance(aux, nn.MoEAux)
    assert aux.expert_load.shape == (depth, E) and aux.load_balance_loss.shape == (depth,)
    assert_trees_close(float(got), float(want))
    for a, b in zip(jax.tree.leaves(aux), jax.tree.leaves(want_aux), strict=True):
        assert_trees_close(a, b)
    assert_trees_close_to_scale(got_g, want_g)


class _Odd(eqx.Module):
    w: jax.Array

    def __init__(self, key):
        self.w = jax.random.normal(key, (D,))

    def __call__(self, x):
        return x * self.w[None, None], x, x  # neither x nor (x, aux)


def test_stacked_block_returning_something_else_raises():
    stack = nn.Stacked(_Odd, depth=2, key=jax.random.key(0))
    with pytest.raises(eqxpar.PlanError, match=r"\(activation, aux\)"):
        stack(make_x())


# -- the model -----------------------------------------------------------------


@pytest.fixture(scope="module")
def moe_gpt():
    return eqx.filter_jit(GPT)(config(num_shared_experts=1), key=jax.random.key(0))


def test_gpt_layout_and_logits(moe_gpt):
    blocks = moe_gpt.blocks
    assert blocks.depth == 2 and isinstance(blocks.blocks, MoEGroup)
    assert len(blocks.blocks.dense) == 1 and isinstance(blocks.blocks.dense[0].mlp, nn.MLP)
    moe = blocks.blocks.moe.mlp
    assert isinstance(moe, nn.MoE) and moe.experts == E and moe.shared is not None
    assert moe.w_in.shape == (2, E, D, HIDDEN)  # (groups, experts, ...)
    # Every block an MoE block: groups of one.
    every = GPT(config(moe_every=1), key=jax.random.key(0)).blocks
    assert every.depth == 4 and every.blocks.dense == ()

    t = tokens(1)[:, :-1]
    logits, aux = eqx.filter_jit(lambda m, t: m.logits_and_aux(t))(moe_gpt, t)
    assert logits.shape == (8, SEQ, VOCAB) and aux.expert_load.shape == (2, E)
    np.testing.assert_allclose(aux.expert_load.sum(1), 8 * SEQ * 2)
    np.testing.assert_array_equal(eqx.filter_jit(lambda m, t: m(t))(moe_gpt, t), logits)

    dense = GPT(config(moe_every=0, experts=0), key=jax.random.key(0))
    logits, aux = dense.logits_and_aux(t)
    assert aux is None and logits.shape == (8, SEQ, VOCAB)


def test_lm_loss_adds_the_aux_losses(moe_gpt):
    t = tokens(2)

    @eqx.filter_jit
    def parts(m, t):
        logits, aux = m.logits_and_aux(t[:, :-1])
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]))
        return ce, aux, lm_loss(m, t)

    ce, aux, loss = parts(moe_gpt, t)
    c = moe_gpt.config
    want = (
        ce
        + c.load_balance_coef * jnp.mean(aux.load_balance_loss)
        + c.router_z_coef * jnp.mean(aux.router_z_loss)
    )
    assert_trees_close(float(loss), float(want))
    assert float(loss) > float(ce)
    # Coefficients 0: the cross-entropy alone.
    bare = GPT(config(num_shared_experts=1, load_balance_coef=0, router_z_coef=0.0), key=jax.random.key(0))
    assert_trees_close(float(parts(bare, t)[2]), float(ce))


PLANS = {
    "data8": lambda: eqxpar.Plan(eqxpar.make_mesh(data=8)),
    # The examples' mesh: each device of `expert` holds one of the 4 experts.
    "expert4_data2": lambda: eqxpar.Plan(eqxpar.make_mesh(expert=4, data=2), rules=eqxpar.rules.EXPERT),
    # The weights outside the experts split over fsdp x expert (gathered over both
    # where used), the experts' model dimension over fsdp: MaxText's layout.
    "expert4_fsdp2_expert_fsdp": lambda: eqxpar.Plan(
        eqxpar.make_mesh(expert=4, fsdp=2), rules=eqxpar.rules.EXPERT_FSDP
    ),
}


@pytest.mark.parametrize("plan", list(PLANS))
def test_moe_gpt_matches_one_device(plan):
    """Loss, gradients and AdamW updates of an MoE GPT (softmax top-2 with a shared
    expert, every second block) under automatic data parallelism, and with the
    experts split over `expert`, equal one device's over three steps."""
    model = eqx.filter_jit(GPT)(config(num_shared_experts=1), key=jax.random.key(5))
    plan = PLANS[plan]()
    losses, _ = train_checked(plan, model, optax.adamw(1e-2), lm_loss, [tokens(s) for s in range(3)])
    assert all(np.isfinite(losses))


def _no_warnings(f, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return f(*args)


def test_accumulation_warns_exactly_when_the_load_balance_loss_is_split():
    # The load-balance loss is a product of two batch means, so its mean over
    # micro-batches is not its value on the batch: warned whenever the batch is
    # split and load_balance_coef != 0, and only then. Traced, not compiled
    # (filter_eval_shape, Step.lower): the warning comes before compiling.
    plan, t = eqxpar.Plan(eqxpar.make_mesh(data=2)), tokens(3)
    model = GPT(config(num_layers=2), key=jax.random.key(0))

    def trace(f, model):
        return eqx.filter_eval_shape(f, model, t)

    with pytest.warns(
        eqxpar.AccumulationWarning, match=r"accumulate=4 .*load_balance_coef=0\.01.*accumulate=1"
    ):
        trace(eqxpar.train.make_value_and_grad(lm_loss, plan, accumulate=4), model)
    _no_warnings(trace, eqxpar.train.make_value_and_grad(lm_loss, plan), model)
    # The z-loss is a mean over tokens: exact under accumulation, no warning.
    no_balance = GPT(config(num_layers=2, load_balance_coef=0), key=jax.random.key(0))
    _no_warnings(trace, eqxpar.train.make_value_and_grad(lm_loss, plan, accumulate=4), no_balance)
    dense = GPT(config(num_layers=2, moe_every=0, experts=0), key=jax.random.key(0))
    _no_warnings(trace, eqxpar.train.make_value_and_grad(lm_loss, plan, accumulate=4), dense)
    # make_step warns when it builds its program (once per state layout).
    optim = optax.sgd(0.1)
    step = eqxpar.train.make_step(lm_loss, optim, plan, accumulate=2)
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    with pytest.warns(
        eqxpar.AccumulationWarning, match=r"accumulate=2 splits the batch into 2 micro-batches"
    ):
        step.lower(state, t)
    _no_warnings(step.lower, state, t)
    # A pipeline's micro-batches split the batch too (an MoE GPT then cannot run:
    # it is refused after the warning).
    pipelined = eqxpar.Plan(
        eqxpar.make_mesh(pipe=2), rules=eqxpar.pipeline.stage_rules(None), schedule="gpipe", microbatches=4
    )
    loss = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)
    with (
        pytest.raises(eqxpar.EqxparError),
        pytest.warns(eqxpar.AccumulationWarning, match=r"Plan\(microbatches=4\)"),
    ):
        trace(eqxpar.train.make_value_and_grad(loss, pipelined), model)


class _BatchNormedLoss(eqx.Module):
    """A model of the user's own whose loss holds a batch statistic, and says so."""

    w: jax.Array
    batch_statistic: bool = eqx.field(static=True)

    def batch_statistic_loss(self):
        if not self.batch_statistic:
            return None
        return "its loss divides by the batch's variance", "normalise per row instead"


def test_any_model_can_declare_a_term_that_accumulates_inexactly():
    # The core step knows no model's class (GPT's warning goes through the same
    # method): a module anywhere in the model declares the term and its fix.
    plan, x = eqxpar.Plan(eqxpar.make_mesh(data=2)), jnp.ones((8, 3))

    def loss(model, batch):
        y = batch @ model["inner"].w
        return jnp.mean(y) / (jnp.var(y) + 1.0)

    for declared, warns in ((True, True), (False, False)):
        model = {"inner": _BatchNormedLoss(jnp.ones((3,)), declared)}
        vg = eqxpar.train.make_value_and_grad(loss, plan, accumulate=2)
        if warns:
            with pytest.warns(
                eqxpar.AccumulationWarning,
                match=r"accumulate=2 splits .* its loss divides by the batch's variance: .*"
                r"accumulate=1 \(or fewer micro-batches\), or normalise per row instead",
            ):
                eqx.filter_eval_shape(vg, model, x)
        else:
            _no_warnings(eqx.filter_eval_shape, vg, model, x)


def test_accumulation_matches_the_full_batch_without_load_balance_loss():
    """With load_balance_coef=0 (the z-loss on: a mean over tokens) accumulate=4
    on expert 2 x data 2 gives the one-device full-batch loss and gradients."""
    model = GPT(config(num_layers=2, load_balance_coef=0, router_z_coef=0.1), key=jax.random.key(5))
    plan = eqxpar.Plan(eqxpar.make_mesh(expert=2, data=2), rules=eqxpar.rules.EXPERT)
    t = tokens(4, batch=16)
    loss, grads = _no_warnings(eqxpar.train.make_value_and_grad(lm_loss, plan, accumulate=4), model, t)
    ref_loss, ref_grads = eqx.filter_jit(eqx.filter_value_and_grad(lm_loss))(model, t)
    assert_trees_close(loss, ref_loss)
    assert_trees_close_to_scale(grads, ref_grads)


def test_moe_gpt_refuses_pipelines(moe_gpt):
    t = tokens(1)
    h = moe_gpt.embed_tokens(t[:, :-1])
    with pytest.raises(eqxpar.PlanError, match=r"gpt_first.*MoE blocks.*lm_loss under a plan without pipe"):
        gpt_first(moe_gpt, t)
    with pytest.raises(eqxpar.PlanError, match=r"gpt_last.*moe_every=0 for a pipeline"):
        gpt_last(moe_gpt, h, t)
    loss = eqxpar.pipeline.PipelineLoss(gpt_first, lambda m: m.blocks, gpt_last)
    with pytest.raises(eqxpar.PlanError, match="MoE blocks"):
        loss(moe_gpt, t)


def test_moe_group_checks_its_blocks():
    dense = nn.TransformerBlock(D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS)), key=jax.random.key(0))
    moe = nn.TransformerBlock(
        D, HIDDEN, nn.BlockConfig(nn.AttentionConfig(HEADS), moe=nn.MoEConfig(E)), key=jax.random.key(1)
    )
    with pytest.raises(eqxpar.PlanError, match=r"last block has a dense MLP.*experts=n"):
        MoEGroup((dense,), dense)
    with pytest.raises(eqxpar.PlanError, match=r"a block of `dense` has experts"):
        MoEGroup((moe,), moe)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(moe_every=3), eqxpar.DivisibilityError, r"num_layers=4, moe_every=3.*moe_every in \[1, 2, 4\]"),
        (dict(experts=0), eqxpar.PlanError, r"moe_every=2, experts=0.*Pass experts > 0"),
        (dict(moe_every=0), eqxpar.PlanError, r"experts=4, moe_every=0.*Pass moe_every=k"),
        (dict(moe_every=-1), eqxpar.PlanError, r"moe_every=-1.*integer >= 0"),
        (dict(top_k=0), eqxpar.PlanError, r"top_k=0.*from 1 to experts=4"),
        (dict(top_k=5), eqxpar.PlanError, r"top_k=5.*from 1 to experts=4"),
        (
            dict(moe_score="relu"),
            eqxpar.PlanError,
            r"GPTConfig\(moe_score='relu'\): expected 'softmax' or 'sigmoid'",
        ),
        (dict(capacity_factor=0.0), eqxpar.PlanError, r"capacity_factor=0.0.*None for dropless"),
        (
            dict(num_shared_experts=-1),
            eqxpar.PlanError,
            r"GPTConfig\(num_shared_experts=-1\): expected an integer",
        ),
        (dict(load_balance_coef=-0.1), eqxpar.PlanError, r"load_balance_coef=-0.1.*>= 0"),
        (dict(router_z_coef=float("nan")), eqxpar.PlanError, r"router_z_coef=nan"),
    ],
)
def test_bad_moe_config_raises(kwargs, error, match):
    with pytest.raises(error, match=match):
        config(**kwargs)


# -- the example ---------------------------------------------------------------


def test_example_trains_and_reports_expert_load(capsys):
    moe_example = example("moe_gpt")
    result = moe_example.main(
        [
            *("--steps", "2", "--eval-every", "2", "--batch-size", "8", "--seq-len", "16"),
            *("--d-model", "16", "--heads", "2", "--layers", "2", "--moe-every", "2", "--experts", "4"),
        ]
    )
    out = capsys.readouterr().out
    assert "mesh data 2 x expert 4 (1 experts per device)" in out, out
    assert re.search(r"step 2: loss [0-9.]+", out), out
    final = re.search(r"final eval loss ([0-9.]+) nats/char", out)
    assert final and 0 < float(final.group(1)) < 10, out
    load = re.search(r"expert load \(share of routed tokens\), MoE block 0: ((?:[0-9.]+ ?){4})", out)
    assert load, out
    assert abs(sum(float(v) for v in load.group(1).split()) - 1) < 0.01
    assert np.isfinite(result)


def test_config_makes_the_layer_configs():
    moe = config(top_k=1, moe_score="sigmoid", num_shared_experts=1, capacity_factor=1.5)
    assert moe.moe_config == nn.MoEConfig(E, top_k=1, score="sigmoid", num_shared=1, capacity_factor=1.5)
    assert moe.block_config(moe=True).moe == moe.moe_config and moe.block_config().moe is None
    assert config(moe_every=0, experts=0).moe_config is None
    attention = config(attention="blockwise", attention_block=8, num_kv_heads=2).attention_config
    assert (attention.kernel, attention.block_size, attention.kv_heads) == ("blockwise", 8, 2)
