"""Small models, data and a single-device reference run shared by the tests."""

import dataclasses
import functools
import importlib
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

import eqxpar
from eqxpar import nn
from eqxpar.models import GPTConfig

from . import _fresh_python as fresh_python
from ._compile_flags import suite_xla_flags

# Float32 parity: sharded reductions sum in a different order than one device (and
# than another CPU's vector width), so results differ in the last bits. rtol 1e-5 is
# the contract, relative to each element *and* to its leaf's largest magnitude
# (assert_trees_close); ATOL is only the floor for leaves that are zero or tiny.
RTOL = 1e-5
ATOL = 1e-6


class LogicalMLP(eqx.Module):
    """A two-layer MLP whose weights carry eqxpar logical axes."""

    w1: Float[Array, "d_in d_hidden"] = eqxpar.param(axes=("embed", "mlp"))
    b1: Float[Array, " d_hidden"] = eqxpar.param(axes=("mlp",))
    w2: Float[Array, "d_hidden d_out"] = eqxpar.param(axes=("mlp", "embed"))
    activation: Callable  # a non-array leaf, as in eqx.nn.MLP

    def __init__(self, d_in: int, d_hidden: int, d_out: int, *, key):
        k1, k2 = jax.random.split(key)
        self.w1 = jax.random.normal(k1, (d_in, d_hidden)) / np.sqrt(d_in)
        self.b1 = jnp.zeros((d_hidden,))
        self.w2 = jax.random.normal(k2, (d_hidden, d_out)) / np.sqrt(d_hidden)
        self.activation = jax.nn.gelu

    def __call__(self, x):
        return self.activation(x @ self.w1 + self.b1) @ self.w2


class TinyTransformer(eqx.Module):
    """A pre-norm transformer block stack made only of `eqx.nn` layers."""

    embed: eqx.nn.Embedding
    attn: list
    norms: list
    mlps: list
    head: eqx.nn.Linear

    def __init__(self, *, vocab=32, dim=32, heads=4, layers=2, key):
        keys = jax.random.split(key, 3 * layers + 2)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.attn = [eqx.nn.MultiheadAttention(heads, dim, key=k) for k in keys[1 : 1 + layers]]
        self.norms = [eqx.nn.LayerNorm(dim) for _ in range(2 * layers)]
        self.mlps = [eqx.nn.MLP(dim, dim, 4 * dim, 1, key=k) for k in keys[1 + layers : 1 + 2 * layers]]
        self.head = eqx.nn.Linear(dim, vocab, use_bias=False, key=keys[-1])

    def __call__(self, tokens):
        h = jax.vmap(self.embed)(tokens)
        n = tokens.shape[0]
        mask = jnp.tril(jnp.ones((n, n), bool))
        for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps, strict=True)):
            x = jax.vmap(self.norms[2 * i])(h)
            h = h + attn(x, x, x, mask=mask)
            h = h + jax.vmap(mlp)(jax.vmap(self.norms[2 * i + 1])(h))
        return jax.vmap(self.head)(h)


def mse_loss(model, batch):
    x, y = batch
    return jnp.mean((jax.vmap(model)(x) - y) ** 2)


def lm_loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1])
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]))


def regression_batches(n_steps, *, batch=32, d_in=16, d_out=4, seed=0):
    keys = jax.random.split(jax.random.key(seed), n_steps)
    out = []
    for k in keys:
        kx, ky = jax.random.split(k)
        out.append((jax.random.normal(kx, (batch, d_in)), jax.random.normal(ky, (batch, d_out))))
    return out


def token_batches(n_steps, *, batch=16, seq=9, vocab=32, seed=0):
    keys = jax.random.split(jax.random.key(seed), n_steps)
    return [jax.random.randint(k, (batch, seq), 0, vocab) for k in keys]


def lm_tokens(seed: int, *, batch: int, seq: int, vocab: int = 32) -> jax.Array:
    """(batch, seq + 1) random token ids from `jax.random.key(seed)`: the inputs and
    next-token targets of `seq` positions (as `eqxpar.models.lm_loss` takes them)."""
    return jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, vocab)


def sequence_regression_batches(n: int, batch: int, *, seq: int, dim: int) -> list:
    """`n` batches (x, target), each (batch, seq, dim) standard normal, batch i from
    `jax.random.key(100 + i)`."""
    out = []
    for i in range(n):
        kx, ky = jax.random.split(jax.random.key(100 + i))
        out.append((jax.random.normal(kx, (batch, seq, dim)), jax.random.normal(ky, (batch, seq, dim))))
    return out


def cross_entropy_loss(model, batch):
    """Mean `eqxpar.nn.cross_entropy` of `model(ids)` against `labels`, for a model
    called on the whole (batch, seq) array of ids; `batch` is (ids, labels)."""
    ids, labels = batch
    return jnp.mean(nn.cross_entropy(model(ids), labels, head=model.head))


def moe_regression_loss(model, batch):
    """Mean squared error of a model returning (y, `nn.MoEAux`), plus 0.01 x its
    load-balance loss and 1e-3 x its router z-loss; `batch` is (x, target)."""
    x, target = batch
    y, aux = model(x)
    return jnp.mean((y - target) ** 2) + 0.01 * aux.load_balance_loss + 1e-3 * aux.router_z_loss


# The one-device references are compiled once per (loss, optimizer), not once per
# test: a parametrized test compares many plans with the same reference, and jit's
# cache then serves every case after the first (the references were a quarter of
# such a test's time).


def _cached_by(build):
    """`build` cached by its arguments (callables), unless one is unhashable."""
    cached = functools.lru_cache(maxsize=256)(build)

    def get(*args):
        try:
            return cached(*args)
        except TypeError:  # an unhashable loss or optimizer: build afresh
            return build(*args)

    return get


@_cached_by
def _value_and_grad(loss_fn):
    return eqx.filter_jit(eqx.filter_value_and_grad(loss_fn))


@_cached_by
def _update(optimizer):
    @eqx.filter_jit
    def update(grads, opt_state, model):
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_inexact_array))
        return eqx.apply_updates(model, updates), opt_state

    return update


@_cached_by
def _reference_step(optimizer, loss_fn):
    @eqx.filter_jit
    def step(params, static, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def value_and_grad_on_one_device(model, loss_fn, batch):
    """`loss_fn`'s value and gradients at (`model`, `batch`), both put on the first
    device, with `eqx.filter_value_and_grad` under `eqx.filter_jit`."""
    model, batch = jax.device_put((model, batch), jax.devices()[0])
    return _value_and_grad(loss_fn)(model, batch)


def reference_run(model, optimizer, loss_fn, batches):
    """Train on one device with plain jax.jit; return (losses, final model)."""
    device = jax.devices()[0]
    model = jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)
    step = _reference_step(optimizer, loss_fn)
    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, static, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, eqx.combine(params, static)


def run_steps(step, state, batches):
    """Run `step` over `batches` from `state`; return (losses, final state)."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


def _array_leaves(tree) -> list[np.ndarray]:
    """The array leaves of `tree` (and Python numbers: a loss, a list of losses) as
    numpy arrays; non-array leaves (an activation function) are dropped."""
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array_like))]


def assert_trees_close(a, b, *, rtol=RTOL, atol=ATOL, err_msg=""):
    """Every leaf of `a` equals the reference `b`'s elementwise, to float32 rounding.

    For what a strategy promises exactly: losses, gradients, outputs, plain-SGD
    parameters. Per inexact leaf, each element must satisfy

        |a - b| <= rtol * |b| + max(atol, rtol * max|b|)

    that is, `rtol` relative to the element, plus an absolute term relative to *the
    leaf's* largest magnitude (k = rtol, with `atol` as a floor for leaves that are
    all zero or tiny). Integer and bool leaves (counts) must be equal. Leaves may be
    Python numbers (a loss; a list of losses is one leaf per step), shapes must match.

    Why the leaf's scale: an element is a sum (a matmul, a mean over the batch, a
    psum over devices) whose order the device split and the CPU's vector width
    choose; its float32 rounding scales with the terms' magnitudes, which the leaf's
    scale bounds, not with the element, which may sit near zero after cancellation.
    An elementwise atol of 1e-6 on a leaf whose elements reach 4 is 2 float32 ulps of
    4: one element of a pipeline gradient, 0.05 in a leaf reaching 4, came out 2.1e-6
    off on an AVX2 CPU (a different summation order), which is rounding, not a bug.

    Why it still catches real errors: a gradient scaled by a factor c, missing one
    of n devices' shares, or with the wrong sign is off by |c - 1| |b|, about |b| / n,
    or 2 |b| in every element; the bound is 1e-5 of the leaf's largest element plus
    1e-5 of the element, so every element above ~1e-4 of the leaf's scale fails on a
    factor as small as 1.1 or a share of 1 in 8 (tests/test_parity_helpers.py).
    """
    la, lb = _array_leaves(a), _array_leaves(b)
    assert len(la) == len(lb), (len(la), len(lb))
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert x.shape == y.shape, (i, x.shape, y.shape)
        if not (jnp.issubdtype(x.dtype, jnp.inexact) or jnp.issubdtype(y.dtype, jnp.inexact)):
            np.testing.assert_array_equal(x, y, err_msg=f"{err_msg} (leaf {i})")
            continue
        x, y = x.astype(np.float64), y.astype(np.float64)
        finite = np.abs(y[np.isfinite(y)])
        scale = float(finite.max()) if finite.size else 0.0
        np.testing.assert_allclose(
            x, y, rtol=rtol, atol=max(atol, rtol * scale), err_msg=f"{err_msg} (leaf {i}, scale {scale:.3g})"
        )


def param_bytes(model) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def assert_trees_close_to_scale(a, b, *, rtol=RTOL, atol=ATOL):
    """Every leaf within `rtol` of the reference *relative to that leaf's scale*:
    max|a - b| <= rtol * max|b| + atol (the floor for leaves whose exact value is
    zero, e.g. an attention key bias, which softmax ignores).

    For tensor-parallel results: each element is a sum over many paths whose order
    the split changes, so its float32 error scales with the terms' magnitude (the
    leaf's scale), not with the element itself, which may sit near zero.
    """
    la, lb = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape
        scale = float(np.max(np.abs(y)))
        assert float(np.max(np.abs(x - y))) <= rtol * scale + atol, (float(np.max(np.abs(x - y))), scale)


def assert_params_close(a, b, *, rtol=RTOL, err_msg=""):
    """Parameters after optimizer steps, `a` against a reference `b`, each leaf
    relative to *that leaf's* scale: max|a - b| <= rtol * max|b| per leaf (a leaf
    that is zero in the reference must be zero), as the benchmarks' parity
    (`_measure.max_rel_err`) measures.

    Why not elementwise: Adam's (and AdamW's) update is lr * m / (sqrt(v) + eps), at
    the first step lr * g / (|g| + eps), whose slope lr * eps / (|g| + eps)^2 reaches
    lr / eps (3e5 at lr 3e-3) for |g| near eps. A gradient element near zero is
    mostly the rounding of a sum whose order the device split and the CPU's vector
    width choose. In the data-parallel transformer test, built for SSE4.2 (as on a CPU
    without AVX-512), one such element came out -1.147e-7 on one device and -1.158e-7
    on eight (1e-9 apart: 5e-8 of its leaf's gradient scale, far inside rtol 1e-5),
    and after five AdamW steps its parameter was 2e-6 off: 5e-5 of the element, and
    still 2e-5 of the leaf's scale. Adam amplifies gradient rounding without a
    useful bound, so a parity test after Adam steps:

    - compares losses and gradients elementwise (`assert_trees_close`: rtol of each
      element plus rtol of its leaf's largest magnitude), where a
      missing all-reduce, a wrong factor or a wrong shard shows;
    - compares parameters with this helper against a one-device optimizer fed the
      step's *own* gradients (`assert_steps_match_one_device`), so only the
      optimizer's arithmetic separates them (measured: within 2e-7 of each leaf's
      scale, often bit-exact), not two runs' differently rounded gradients.

    Plain SGD (and momentum) does not amplify: its parameters may be compared
    elementwise, or with this helper against a separate one-device run.
    """
    la, lb = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb), (len(la), len(lb))
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert x.shape == y.shape, (i, x.shape, y.shape)
        if not x.size:
            continue
        err, scale = float(np.max(np.abs(x - y))), float(np.max(np.abs(y)))
        assert err <= rtol * scale, (
            f"{err_msg}leaf {i} {x.shape}: max|a - b| = {err:.3g} > {rtol:g} x the leaf's scale {scale:.3g}"
        )


class RecordedGradients(NamedTuple):
    """The gradients an optimizer built by `record_gradients` was last given."""

    grads: Any


def record_gradients(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer`, also keeping in its state the gradients of its last update, so a
    test reads back the gradients a compiled step really used (not a second program's,
    whose rounding may differ). The state is `(RecordedGradients(grads), inner)`."""

    def init(params):
        return RecordedGradients(jax.tree.map(jnp.zeros_like, params)), optimizer.init(params)

    def update(grads, state, params=None):
        updates, inner = optimizer.update(grads, state[1], params)
        return updates, (RecordedGradients(grads), inner)

    return optax.GradientTransformation(init, update)


def recorded_gradients(opt_state) -> Any:
    """The gradients kept in `opt_state` by the one `record_gradients` inside it."""
    is_recorded = lambda x: isinstance(x, RecordedGradients)  # noqa: E731
    found = [s for s in jax.tree.leaves(opt_state, is_leaf=is_recorded) if is_recorded(s)]
    assert len(found) == 1, f"expected one RecordedGradients in the optimizer state, found {len(found)}"
    return found[0].grads


def assert_steps_match_one_device(
    advance: Callable[[Any], tuple[Any, Any, Any]],
    model: Any,
    optimizer: optax.GradientTransformation,
    loss_fn: Callable,
    batches: Iterable,
) -> list[float]:
    """Check a training run against one device, step by step; return its losses.

    `advance(batch) -> (model, opt_state, loss)` runs one step of the run under test,
    which starts from `model` with `record_gradients(optimizer)`, and returns its
    state after the step. At every step:

    - its loss and its gradients (the step's own, from its optimizer state) equal
      `jax.value_and_grad(loss_fn)` on one device at the parameters the step
      started from (the first: `model` itself), elementwise (`assert_trees_close`);
    - its parameters equal, per leaf (`assert_params_close`), those of `optimizer`
      run on one device from `model` and fed the same gradients: the update was
      applied, once, to the right parameters, with the optimizer state carried.

    Gradients are compared at the run's own parameters rather than along a separate
    one-device run, whose parameters Adam would drift apart (`assert_params_close`).
    """
    device = jax.devices()[0]

    def on_device(tree):  # a host copy: the run under test may donate its buffers
        return jax.tree.map(lambda x: jax.device_put(np.asarray(x), device) if eqx.is_array(x) else x, tree)

    value_and_grad, update = _value_and_grad(loss_fn), _update(optimizer)

    ref_model = start = on_device(model)
    ref_state = optimizer.init(eqx.filter(ref_model, eqx.is_inexact_array))
    losses = []
    for i, batch in enumerate(batches):
        want_loss, want_grads = value_and_grad(start, on_device(batch))
        got_model, opt_state, loss = advance(batch)
        grads = recorded_gradients(opt_state)
        assert_trees_close(float(loss), float(want_loss), err_msg=f"loss at step {i}")
        assert_trees_close(grads, want_grads, err_msg=f"gradients at step {i}")
        ref_model, ref_state = update(on_device(grads), ref_state, ref_model)
        assert_params_close(got_model, ref_model, err_msg=f"parameters after step {i}: ")
        start = on_device(got_model)
        losses.append(float(loss))
    return losses


def train_checked(plan, model, optimizer, loss_fn, batches, **step_kwargs):
    """`eqxpar.train` on `plan` over `batches`, every step checked against one device
    by `assert_steps_match_one_device`; return (losses, final state)."""
    recording = record_gradients(optimizer)
    state = eqxpar.train.init(model, recording, plan, key=jax.random.key(0))
    step = eqxpar.train.make_step(loss_fn, recording, plan, **step_kwargs)

    def advance(batch):
        nonlocal state
        state, metrics = step(state, batch)
        return state.model, state.opt_state, metrics["loss"]

    losses = assert_steps_match_one_device(advance, model, optimizer, loss_fn, batches)
    return losses, state


# -- attention: random inputs, (output, gradients), context-parallel runs ------------


def random_qkv(seed: int, s: int, hq: int, hkv: int, d: int = 8, batch: int = 2):
    """((q, k, v), cotangent) for attention over `s` positions, `hq` query and `hkv`
    key/value heads of size `d`: standard normal, q and the cotangent (batch, s, hq,
    d), k and v (batch, s, hkv, d)."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, s, hq, d))
    k = jax.random.normal(kk, (batch, s, hkv, d))
    v = jax.random.normal(kv, (batch, s, hkv, d))
    return (q, k, v), jax.random.normal(kc, q.shape)


def output_and_grads(f, args, cot):
    """(`f(*args)`, the gradients of sum(f(*args) * cot) with respect to the three
    arguments (q, k, v)), under `jax.jit`."""

    def loss(*a):
        out = f(*a)
        return jnp.sum(out * cot), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(*args)
    return out, grads


#: The absolute floor of attention outputs' and gradients' comparisons with
#: `assert_trees_close` (entries near zero, summed in another order); rtol x each
#: leaf's largest magnitude raises it.
ATTENTION_ATOL = 2e-6


def packed_segment_ids(seed: int, batch: int, s: int, pad: int = 3) -> jax.Array:
    """Packed documents of random lengths per row, the last `pad` tokens padding
    (their own id, 99)."""
    starts = jax.random.bernoulli(jax.random.key(seed), 0.2, (batch, s))
    ids = jnp.cumsum(starts, axis=1).astype(jnp.int32)
    return ids.at[:, s - pad :].set(99)


class PackedSequenceModel(eqx.Module):
    """Token embedding and two stacked blocks reading the rows' segment ids."""

    embed: nn.Embedding
    blocks: nn.Stacked

    def __init__(self, causal, key):
        k1, k2 = jax.random.split(key)
        self.embed = nn.Embedding(32, 32, key=k1)
        self.blocks = nn.Stacked(
            lambda k: nn.TransformerBlock(
                32,
                64,
                nn.BlockConfig(nn.AttentionConfig(4, num_kv_heads=2, rotary=True, causal=causal)),
                key=k,
            ),
            depth=2,
            key=k2,
        )

    def __call__(self, ids, seg):
        return self.blocks(self.embed(ids), segment_ids=seg)


def packed_sequence_loss(model, batch):
    """`PackedSequenceModel`'s loss: the sequence mean of each output's squared
    norm; `batch` is (ids, segment ids)."""
    ids, seg = batch
    return nn.sequence_mean(jnp.sum(jnp.square(model(ids, seg)), axis=-1))


#: The mesh axis `context_mesh` makes, and how q, k, v (batch, seq, heads, dim) split
#: over it: the sequence.
CONTEXT_AXIS = "context"
CONTEXT_SPEC = P(None, CONTEXT_AXIS)


def context_mesh(n: int) -> jax.sharding.Mesh:
    """A mesh of the first `n` devices along one Auto axis, `context`."""
    return jax.make_mesh(
        (n,), (CONTEXT_AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )


def context_attention_fn(n, *, causal, load_balanced, impl, block_size=4, segment_ids=None, **attention_kw):
    """Global q, k, v -> global output of `eqxpar.nn.context_attention` over `n`
    devices of `context_mesh(n)` (in `jax.shard_map`): the inputs laid out with
    `context_layout`, the output put back with `context_unlayout`. `segment_ids`
    (batch, seq), if given, are laid out the same way; `attention_kw` (dropout=,
    key=) go to `context_attention`."""
    lay = functools.partial(nn.context_layout, n=n, load_balanced=load_balanced)

    def attend(q, k, v, seg):
        return nn.context_attention(
            q, k, v, causal=causal, impl=impl, load_balanced=load_balanced, block_size=block_size,
            segment_ids=seg, **attention_kw,
        )  # fmt: skip

    specs = (CONTEXT_SPEC,) * 3 + (None if segment_ids is None else CONTEXT_SPEC,)
    sharded = jax.shard_map(attend, mesh=context_mesh(n), in_specs=specs, out_specs=CONTEXT_SPEC)

    def f(q, k, v):
        out = sharded(lay(q), lay(k), lay(v), None if segment_ids is None else lay(segment_ids))
        return nn.context_unlayout(out, n, load_balanced=load_balanced)

    return f


ROOT = pathlib.Path(__file__).parent.parent


def run_example(script: str, args) -> subprocess.CompletedProcess:
    """Run `examples/<script>` with `args` in a fresh interpreter (a fork of one that
    has imported JAX and eqxpar only: tests/_fresh_python.py), compiled as the
    suite compiles (tests/_compile_flags.py); the example sets its own device count,
    so the test's XLA_FLAGS are replaced by those."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["XLA_FLAGS"] = suite_xla_flags()
    return fresh_python.run(
        script=str(ROOT / "examples" / script), argv=list(args), cwd=ROOT, env=env, timeout=300
    )


def process_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0; it is dead for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def assert_processes_gone(pids: Iterable[int], what: str = "a process") -> None:
    """Every process of `pids` is dead, polled for up to 5 s (init may not have reaped it yet)."""
    pids = list(pids)
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if process_alive(p)], f"{what} survived"


class StreamedRun:
    """A subprocess whose output lines (stdout and stderr together) are collected,
    with arrival times, as they come."""

    def __init__(self, command: list[str], env: dict[str, str]):
        self.start = time.monotonic()
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: list[tuple[float, str]] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
        self.proc.stdout.close()

    def wait(self, timeout: float = 300) -> int:
        code = self.proc.wait(timeout)
        self.end = time.monotonic()
        self.reader.join(10)
        return code

    def wait_for_line(self, text: str, timeout: float = 120) -> None:
        """Block until a line containing `text` arrives (AssertionError if the run ends
        or `timeout` seconds pass first)."""
        deadline = time.monotonic() + timeout
        while not any(text in line for _, line in list(self.lines)):
            assert self.proc.poll() is None, f"ended before {text!r}:\n{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {text!r} within {timeout} s:\n{self.output[-4000:]}"
            time.sleep(0.02)

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)


# --- Models and data more than one test file uses ---------------------------------

# Two small GPTs: SwiGLU, RMSNorm, tied embeddings, grouped-query attention (8 query,
# 4 key/value heads); and GELU, LayerNorm, an untied head and biases everywhere.
GPT_CONFIGS = {
    "swiglu-tied-gqa": GPTConfig(
        vocab_size=32, d_model=32, num_heads=8, num_kv_heads=4, num_layers=2, d_hidden=64, max_seq_len=16
    ),
    "gelu-untied": GPTConfig(
        vocab_size=32,
        d_model=32,
        num_heads=4,
        num_layers=2,
        d_hidden=64,
        activation="gelu",
        norm="layer",
        tied=False,
        use_bias=True,
        max_seq_len=16,
    ),
}
# GPT-2 style: learned positions (no rotary), fused QKV, GELU, LayerNorm, biases,
# untied head; the options the benchmark workload needs, on a small model.
GPT2_STYLE = dataclasses.replace(
    GPT_CONFIGS["gelu-untied"], rotary=False, learned_positions=True, fused_qkv=True
)

# The context-parallel tests' GPTs: sequences of 32 tokens, 2 x 8 chunks of 2 tokens at
# context 8.
CONTEXT_CONFIGS = {
    # Rotary positions, SwiGLU, grouped-query heads (4 query, 2 key/value).
    "rotary-gqa": GPTConfig(
        vocab_size=32, d_model=32, num_heads=4, num_kv_heads=2, num_layers=2, d_hidden=64, max_seq_len=32
    ),
    "learned-positions": dataclasses.replace(GPT2_STYLE, max_seq_len=32),
}
CONTEXT_BATCH, CONTEXT_SEQ = 8, 32
context_tokens = functools.partial(lm_tokens, batch=CONTEXT_BATCH, seq=CONTEXT_SEQ)


class Encoder(eqx.Module):
    """Token embedding, two encoder (non-causal) blocks, both poolings and a small head."""

    embed: nn.Embedding
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head: jax.Array

    def __init__(self, key, *, vocab=32, d=16, heads=4, hidden=32):
        k = jax.random.split(key, 3)
        self.embed = nn.Embedding(vocab, d, key=k[0])
        self.blocks = nn.Stacked(
            lambda kk: nn.TransformerBlock(
                d, hidden, nn.BlockConfig(nn.AttentionConfig(heads, causal=False)), key=kk
            ),
            depth=2,
            key=k[1],
        )
        self.norm = nn.LayerNorm(d)
        self.head = jax.random.normal(k[2], (2 * d, 3)) / np.sqrt(d)

    def __call__(self, ids):
        h = self.norm(self.blocks(self.embed(ids)))
        pooled = jnp.concatenate([nn.mean_pool(h), nn.first_token(h)], axis=-1)
        return pooled @ self.head


def encoder_loss(model, batch):
    ids, targets = batch
    return jnp.mean(jnp.square(model(ids) - targets))


# TinyGPT's sizes: its tokens are (TINY_GPT_BATCH, TINY_GPT_SEQ + 1) ids below TINY_GPT_VOCAB.
TINY_GPT_VOCAB, TINY_GPT_SEQ, TINY_GPT_BATCH = 64, 16, 8


class TinyGPT(eqx.Module):
    """Vocabulary-parallel embedding and head around two tensor-parallel blocks."""

    embed: nn.Embedding
    blocks: list[nn.TransformerBlock]
    norm: nn.LayerNorm
    head: nn.Unembed

    def __init__(self, *, key, d=32, heads=8, hidden=64):
        k = jax.random.split(key, 4)
        self.embed = nn.Embedding(TINY_GPT_VOCAB, d, key=k[0])
        self.blocks = [
            nn.TransformerBlock(d, hidden, nn.BlockConfig(nn.AttentionConfig(heads)), key=k[1]),
            nn.TransformerBlock(
                d,
                hidden,
                nn.BlockConfig(nn.AttentionConfig(heads, fused_qkv=True), activation="swiglu", norm="rms"),
                key=k[2],
            ),
        ]
        self.norm = nn.LayerNorm(d)
        self.head = nn.Unembed(d, TINY_GPT_VOCAB, key=k[3])

    def __call__(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


MOE_D, MOE_HIDDEN, MOE_EXPERTS, MOE_SEQ = 16, 32, 8, 4


class MoEModel(eqx.Module):
    """An input projection, then the MoE layer: the projection's gradient needs
    the dispatch's transpose too."""

    proj: jax.Array
    moe: nn.MoE

    def __init__(self, *, activation="swiglu", use_bias=True, **routing):
        self.proj = jnp.eye(MOE_D) + 0.1 * jax.random.normal(jax.random.key(7), (MOE_D, MOE_D))
        config = nn.MoEConfig(MOE_EXPERTS, **routing)
        layer = dict(activation=activation, use_bias=use_bias)
        self.moe = nn.MoE(MOE_D, MOE_HIDDEN, config, **layer, key=jax.random.key(11))
        names = [n for n in ("b_in", "b_gate", "b_out") if getattr(self.moe, n) is not None]
        for name, k in zip(names, jax.random.split(jax.random.key(5), len(names)), strict=True):
            old = getattr(self.moe, name)
            self.moe = eqx.tree_at(
                lambda m, n=name: getattr(m, n), self.moe, 0.1 * jax.random.normal(k, old.shape)
            )

    def __call__(self, x):
        return self.moe(x @ self.proj)


def moe_batches(n, batch=16):
    return sequence_regression_batches(n, batch, seq=MOE_SEQ, dim=MOE_D)


EXAMPLES = ROOT / "examples"


def example(name: str):
    """The example module `name`, imported in this process (the test session already
    has 8 devices) for its plans: nothing is compiled."""
    # The examples import their siblings by name, as when run as scripts.
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name.removesuffix(".py"))
    finally:
        sys.path.remove(str(EXAMPLES))


# The pipeline tests' regression model: TINY_IN features in, TINY_OUT out, blocks of
# width TINY_D; PIPELINE_ROWS rows per micro-batch.
TINY_IN, TINY_D, TINY_OUT, PIPELINE_ROWS = 3, 8, 2, 2


class TinyBlock(eqx.Module):
    w: jax.Array
    b: jax.Array

    def __init__(self, key, d=TINY_D):
        self.w = jax.random.normal(key, (d, d)) / np.sqrt(d)
        self.b = 0.1 * jax.random.normal(jax.random.fold_in(key, 1), (d,))

    def __call__(self, x):
        return x + jnp.tanh(x @ self.w + self.b[None, :])


class Tiny(eqx.Module):
    """A linear input layer, a stack of residual blocks, a linear head."""

    w_in: jax.Array
    blocks: nn.Stacked
    w_out: jax.Array

    def __init__(self, depth, *, key, d=TINY_D, unroll=1):
        k = jax.random.split(key, 3)
        self.w_in = jax.random.normal(k[0], (TINY_IN, d))
        self.blocks = nn.Stacked(lambda kk: TinyBlock(kk, d), depth=depth, unroll=unroll, key=k[1])
        self.w_out = jax.random.normal(k[2], (d, TINY_OUT)) / np.sqrt(d)


def tiny_loss():
    return eqxpar.pipeline.PipelineLoss(
        first=lambda m, batch: batch[0] @ m.w_in,
        stack=lambda m: m.blocks,
        last=lambda m, h, batch: jnp.mean((h @ m.w_out - batch[1]) ** 2),
    )


def regression_batch(n, seed=0):
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n, TINY_IN)), jax.random.normal(ky, (n, TINY_OUT))


def pipeline_plan(name, *, pipe, microbatches, chunks=1, data=1, tensor=1, rules=None, **kwargs):
    mesh = eqxpar.make_mesh(pipe=pipe, data=data, tensor=tensor)
    return eqxpar.Plan(
        mesh,
        rules=eqxpar.pipeline.stage_rules(rules),
        schedule=name,
        microbatches=microbatches,
        chunks=chunks,
        **kwargs,
    )


# FSDP over the `embed` dimension only.
FSDP_ONLY = eqxpar.rules.Logical({"embed": "fsdp"})
STACKED_LM_VOCAB, STACKED_LM_SEQ, STACKED_LM_BATCH = 64, 16, 8


class StackedLM(eqx.Module):
    """Vocabulary-parallel embedding and head around a scanned stack of blocks."""

    embed: nn.Embedding
    blocks: nn.Stacked
    norm: nn.LayerNorm
    head: nn.Unembed

    def __init__(self, *, key, d=32, heads=4, hidden=64, depth=2):
        k = jax.random.split(key, 3)
        self.embed = nn.Embedding(STACKED_LM_VOCAB, d, key=k[0])
        self.blocks = nn.Stacked(
            lambda kk: nn.TransformerBlock(
                d, hidden, nn.BlockConfig(nn.AttentionConfig(heads), activation="swiglu", norm="rms"), key=kk
            ),
            depth=depth,
            key=k[1],
        )
        self.norm = nn.LayerNorm(d)
        self.head = nn.Unembed(d, STACKED_LM_VOCAB, key=k[2])

    def __call__(self, ids):
        return self.head(self.norm(self.blocks(self.embed(ids))))


def stacked_lm_batches(n):
    """`n` (inputs, targets) batches of `StackedLM`'s tokens."""
    out = []
    for t in token_batches(n, batch=STACKED_LM_BATCH, seq=STACKED_LM_SEQ + 1, vocab=STACKED_LM_VOCAB, seed=3):
        out.append((t[:, :-1], t[:, 1:]))
    return out


# --- A pretrained model through every pipeline plan (tests/data/pipeline_journey) ---

JOURNEY_DATA = pathlib.Path(__file__).parent / "data" / "pipeline_journey"
# (schedule, chunks, stage_layers) over pipe 2 x data 4, two micro-batches, of the
# 8-layer Llama there: each schedule with equal stages and with uneven ones.
PIPELINE_JOURNEYS = {
    "gpipe": ("gpipe", 1, None),
    "1f1b": ("1f1b", 1, None),
    "interleaved": ("interleaved", 2, None),
    "zero_bubble": ("zero_bubble", 1, None),
    "gpipe-uneven": ("gpipe", 1, (3, 5)),
    "1f1b-uneven": ("1f1b", 1, (5, 3)),
    "interleaved-uneven": ("interleaved", 2, (1, 3, 2, 2)),
    "zero_bubble-uneven": ("zero_bubble", 1, (3, 5)),
    # The V placement: device 0 holds the first and last stages, device 1 the turn.
    # DualPipeV needs 2 * pipe micro-batches: 4, over data 2.
    "zb_v": ("zb_v", 2, None),
    "dualpipe_v": ("dualpipe_v", 2, None, 4),
    "zb_v-uneven": ("zb_v", 2, (1, 3, 2, 2)),
    "dualpipe_v-uneven": ("dualpipe_v", 2, (3, 1, 2, 2), 4),
}


def journey_plan(name: str) -> eqxpar.Plan:
    schedule, chunks, layers, *rest = PIPELINE_JOURNEYS[name]
    microbatches = rest[0] if rest else 2
    # journey_tokens' 8 rows: one a micro-batch on each data-parallel device.
    return pipeline_plan(
        schedule,
        pipe=2,
        data=8 // microbatches,
        microbatches=microbatches,
        chunks=chunks,
        stage_layers=layers,
    )


def journey_tokens() -> jax.Array:
    return jnp.asarray(np.random.default_rng(1).integers(0, 64, size=(8, 9)).astype(np.int32))


def journey_optimizer() -> optax.GradientTransformation:
    # eps well above float32 noise: Adam's first step is g / (|g| + eps), which
    # would turn a gradient entry's last-bit difference (another CPU's summation
    # order) into a step of +-lr where |g| is tiny; here it stays at that noise.
    return optax.adamw(1e-2, eps=1e-3)


def journey_train(plan: eqxpar.Plan):
    """The 8-layer Llama read into `plan` (`from_pretrained(path, plan)`), one AdamW
    step on `journey_tokens()`: `(state, loss)`."""
    model = eqxpar.models.from_pretrained(JOURNEY_DATA / "base", plan)
    loss_fn = eqxpar.models.lm_loss
    if plan.schedule is not None:
        loss_fn = eqxpar.pipeline.PipelineLoss(
            eqxpar.models.gpt_first, lambda m: m.blocks, eqxpar.models.gpt_last
        )
    optim = journey_optimizer()
    state = eqxpar.train.init(model, optim, plan, key=jax.random.key(0))
    state, metrics = eqxpar.train.make_step(loss_fn, optim, plan)(state, journey_tokens())
    return state, float(metrics["loss"])


LORA_DATA = pathlib.Path(__file__).parent / "data" / "lora"
#: The adapted projections of each LoRA reference (every one the layout has).
LORA_TARGETS = {
    "llama": ("q", "k", "v", "o", "gate", "up", "down"),
    "gpt2": ("qkv", "o", "up", "down"),
    # Every block an MoE block (moe_every=1): attention adapters only, under
    # each layer's own index (add_lora refuses MLP targets on MoE models).
    "mixtral": ("q", "k", "v", "o"),
}


def lora_reference_model(name: str):
    """The tiny `tests/data/pretrained/<name>` checkpoint with adapters on every
    projection (`LORA_TARGETS`), rank 4, alpha 8, `A` from `add_lora`'s key 0
    and `B` drawn from key 1 (a "trained" adapter: `add_lora`'s zero `B` would
    leave the logits unchanged). What tests/data/lora/make_references.py writes."""
    base = eqxpar.models.from_pretrained(pathlib.Path(__file__).parent / "data" / "pretrained" / name)
    model = eqxpar.models.add_lora(base, rank=4, alpha=8, targets=LORA_TARGETS[name], key=jax.random.key(0))
    # 0.3 / sqrt(rank) moves the logits by O(1).
    return with_drawn_b(model, key=jax.random.key(1), scale=0.15)


def with_drawn_b(model, *, key, scale):
    """`model` (from `add_lora`) with every zero adapter leaf, the `B`s, drawn as
    `scale` times a standard normal, one key of `key`'s split per adapter leaf."""
    adapters, frozen = eqx.partition(model, eqxpar.models.lora_trainable(model))
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(key, len(leaves))
    leaves = [
        x if jnp.any(x) else scale * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), frozen)


# --- Packed sequences: the same documents packed into rows, or one per row ------

#: Tokens per row of the packing tests: 16 model inputs (a multiple of 2 x 4
#: context chunks) plus one.
PACKED_ROW = 17

#: The packing tests' GPTs.
PACKED_CONFIGS = {
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


def packed_documents(seed: int, rows: int) -> list[list[np.ndarray]]:
    """`rows` rows of two random documents each that fit in `PACKED_ROW` tokens together
    (the rest of the row padding); ids 1..31 (0 is padding)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        a = int(rng.integers(3, 10))
        b = int(rng.integers(3, PACKED_ROW - a + 1))
        out.append([rng.integers(1, 32, size=n).astype(np.int32) for n in (a, b)])
    return out


def packed_batch(docs: list[list[np.ndarray]]) -> dict[str, jax.Array]:
    """Each row's documents packed into one row of `PACKED_ROW` tokens: segment ids 0, 1,
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
        pad = PACKED_ROW - len(tokens)
        tokens += [0] * pad
        seg += [9] * pad
        pos += [0] * pad
        w += [0.0] * pad
        for k, v in zip(cols, (tokens, seg, pos, w), strict=True):
            cols[k].append(v)
    dtypes = {"tokens": jnp.int32, "segment_ids": jnp.int32, "positions": jnp.int32, "weights": jnp.float32}
    return {k: jnp.asarray(np.array(v), dtypes[k]) for k, v in cols.items()}


def padded_batch(docs: list[list[np.ndarray]]) -> dict[str, jax.Array]:
    """The same documents one per row, padded to `PACKED_ROW` tokens (weight 0)."""
    return packed_batch([[d] for row in docs for d in row])
