"""A backward pass split into its input-cotangent half (zero-bubble's `I`) and its
weight half (`W`): together they compute what the whole pull-back does, and run
each matmul of it once."""

import jax
import jax.extend as jex
import jax.numpy as jnp

from eqxpar.inspect import matmul_flops
from eqxpar.pipeline._split_backward import split_pull_back

from ._helpers import assert_trees_close


def _split(fn, *args):
    """The pull-back of `fn` at `args` (the last is the input) as a flat function,
    its inputs, the whole backward's outputs, and its split (as the engine
    splits a stage's: `split_pull_back`)."""
    out, pull = jax.vjp(fn, *args)
    seed = jax.random.normal(jax.random.key(9), out.shape)
    halves, inputs = split_pull_back(*jax.tree.flatten(pull), seed, first=False)
    backward = jex.core.jaxpr_as_fun(jex.core.ClosedJaxpr(halves.jaxpr, halves.consts))
    return backward, inputs, backward(*inputs), halves


def _stack(shared):
    """Layers scanned over stacked weights, and (`shared`) one weight every layer uses."""

    def fn(ws, u, x):
        def layer(h, w):
            h = jnp.tanh(h @ w)
            return (h @ u if shared else h), None

        return jax.lax.scan(layer, x, ws)[0]

    k = jax.random.split(jax.random.key(0), 3)
    ws = jax.random.normal(k[0], (3, 32, 32)) / 6
    u = jax.random.normal(k[1], (32, 32)) / 6
    return fn, (ws, u, jax.random.normal(k[2], (8, 32)))


def test_halves_compute_the_whole_pull_back():
    for shared in (False, True):
        fn, args = _stack(shared)
        _, inputs, whole, halves = _split(fn, *args)
        (dx,), stash = halves.input_half(inputs)
        weights = halves.weight_half(inputs, stash)
        assert_trees_close(dx, whole[-1])
        for got, want in zip(weights, whole[:-1], strict=True):
            assert_trees_close(got, want)
        # The weight half needs the cotangents of the layers' outputs: the stash.
        assert stash


def test_each_matmul_runs_once():
    # Per layer: forward h @ w; backward dh = dy @ w.T (input half), dw = h.T @ dy
    # (weight half). The weight half does not run the chain of dh again.
    fn, args = _stack(shared=False)
    backward, inputs, _, halves = _split(fn, *args)
    whole = matmul_flops(jax.jit(backward).lower(*inputs).compile())
    a = matmul_flops(jax.jit(lambda *xs: halves.input_half(xs)).lower(*inputs).compile())
    stash = halves.input_half(inputs)[1]
    b = matmul_flops(jax.jit(lambda s, *xs: halves.weight_half(xs, s)).lower(stash, *inputs).compile())
    assert a + b == whole, (a, b, whole)
    assert a == b == 3 * 2 * 8 * 32 * 32
