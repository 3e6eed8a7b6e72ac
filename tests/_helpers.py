"""Small models, data and a single-device reference run shared by the tests."""

import os
import pathlib
import subprocess
import sys
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

import eqxpar

# Float32 parity: sharded reductions sum in a different order than one device, so
# results differ in the last bits; rtol 1e-5 is the contract, atol covers entries
# that sit near zero, where a relative bound says nothing.
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


def reference_run(model, optimizer, loss_fn, batches):
    """Train on one device with plain jax.jit; return (losses, final model)."""
    device = jax.devices()[0]
    model = jax.tree.map(lambda x: jax.device_put(x, device) if eqx.is_array(x) else x, model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(eqx.combine(p, static), batch))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    losses = []
    for batch in batches:
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, device))
        losses.append(float(loss))
    return losses, eqx.combine(params, static)


def run_steps(step, state, batches):
    """Run `step` over `batches` from `state`; return (losses, final state)."""
    losses = []
    for batch in batches:
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, state


def assert_trees_close(a, b, *, rtol=RTOL, atol=ATOL):
    la, lb = jax.tree.leaves(eqx.filter(a, eqx.is_array)), jax.tree.leaves(eqx.filter(b, eqx.is_array))
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


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


ROOT = pathlib.Path(__file__).parent.parent


def run_example(script: str, args, *, xla_flags: str | None = None) -> subprocess.CompletedProcess:
    """Run `examples/<script>` with `args` in a fresh interpreter; the example sets
    its own device count, so the test's XLA_FLAGS are replaced by `xla_flags`."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
