"""Matrix-multiply FLOPs read from compiled HLO: loops weighted by trip count,
fusions and calls descended into, conditionals at their costliest branch; and
from a jaxpr by the same rules (the advisor's count, before compiling)."""

import jax
import jax.numpy as jnp
import pytest

from eqxpar.inspect import matmul_flops


def test_one_matmul():
    x, w = jnp.ones((16, 32)), jnp.ones((32, 8))
    assert matmul_flops(jax.jit(jnp.matmul).lower(x, w).compile()) == 2 * 16 * 8 * 32


def test_a_scanned_gradient_counts_every_iteration():
    # cost_analysis counts a loop body once; here 3 layers x (1 forward + 2
    # backward products) are counted.
    def loss(w, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(layer, x, w)[0].sum()

    compiled = jax.jit(jax.grad(loss)).lower(jnp.ones((3, 32, 32)), jnp.ones((16, 32))).compile()
    assert matmul_flops(compiled) == 3 * 3 * 2 * 16 * 32 * 32
    assert matmul_flops(compiled.as_text()) == matmul_flops(compiled)


def test_batched_contraction_and_a_conditional_at_its_costliest_branch():
    def f(i, a, b):
        branches = [lambda: jnp.einsum("bik,bkj->bij", a, b), lambda: a[:, :, :4] @ b[:, :4, :]]
        return jax.lax.switch(i, branches)

    a, b = jnp.ones((2, 8, 16)), jnp.ones((2, 16, 4))
    compiled = jax.jit(f).lower(0, a, b).compile()
    assert matmul_flops(compiled) == 2 * (2 * 8 * 4) * 16
    assert matmul_flops(jax.make_jaxpr(f)(0, a, b)) == matmul_flops(compiled)


def test_a_jaxpr_counts_what_its_compiled_program_runs():
    # The scanned gradient above, a grouped (ragged) product and a closed-over
    # jaxpr or a bare one: the jaxpr's count is the compiled program's.
    def loss(w, x):
        def layer(h, w):
            return jnp.tanh(h @ w), None

        return jax.lax.scan(layer, x, w)[0].sum()

    args = (jnp.ones((3, 32, 32)), jnp.ones((16, 32)))
    closed = jax.make_jaxpr(jax.grad(loss))(*args)
    assert matmul_flops(closed) == 3 * 3 * 2 * 16 * 32 * 32
    assert matmul_flops(closed.jaxpr) == matmul_flops(closed)
    assert matmul_flops(closed) == matmul_flops(jax.jit(jax.grad(loss)).lower(*args).compile())

    rows, groups = jnp.ones((12, 16)), jnp.ones((3, 16, 8))
    sizes = jnp.array([4, 4, 4], jnp.int32)
    ragged = jax.make_jaxpr(jax.lax.ragged_dot)(rows, groups, sizes)
    assert matmul_flops(ragged) == 2 * 12 * 16 * 8


def test_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="ENTRY"):
        matmul_flops("HloModule m\n")
