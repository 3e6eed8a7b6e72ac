"""eqxpar.collectives: gathers, reduce-scatters and ring collective matmuls equal their
dense counterparts forward and backward, move exactly the bytes of the collectives
they replace, keep the program size fixed as the axis grows, and reject bad input
with eqxpar errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import collectives as C
from eqxpar.inspect import collective_stats

from ._helpers import assert_trees_close

# rtol is the float32 contract; entries are sums of O(1) products, and those that
# land near zero need an absolute bound (the ring adds in a different order): ATOL
# is its floor, raised to rtol x each leaf's largest magnitude (assert_trees_close).
ATOL = 1e-5
SIZES = (1, 2, 4, 8)
T = "tensor"


def _tp(fn, mesh, in_specs, out_specs, check_vma=True):
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names={T}, check_vma=check_vma
    )


def _spec(ndim, dim):
    """A spec splitting dimension `dim` (of `ndim`) over the tensor axis."""
    return P(*[T if i == dim % ndim else None for i in range(ndim)])


def _normal(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _value_and_vjp(f, args, cot):
    """f(*args) and the gradients of sum(f(*args) * cot) w.r.t. every argument."""

    def run(*a):
        out, vjp = jax.vjp(f, *a)
        return out, vjp(cot)

    return jax.jit(run)(*args)


def _assert_parity(sharded, dense, args, seed=0, grad_scale=1.0):
    cot = _normal(np.random.default_rng(seed), jax.eval_shape(dense, *args).shape)
    out_s, grads_s = _value_and_vjp(sharded, args, cot)
    out_d, grads_d = _value_and_vjp(dense, args, cot)
    assert out_s.shape == out_d.shape
    assert_trees_close(out_s, out_d, atol=ATOL)
    for g_s, g_d in zip(grads_s, grads_d, strict=True):
        assert_trees_close(g_s, np.asarray(g_d) * grad_scale, atol=ATOL)


# ---------------------------------------------------------------------------
# all_gather / psum_scatter / all_gather_mean_grad
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", SIZES)
def test_all_gather_matches_dense(n, axis, check_vma):
    # Each device returns the whole gathered array (stacked along a new leading
    # dimension), so the gradient reaching device j's block is block j of the SUM
    # over devices of their cotangents: the reduce-scatter transpose.
    mesh = eqxpar.make_mesh(tensor=n)
    x = _normal(np.random.default_rng(1), (3 * n, 4) if axis == 0 else (4, 3 * n))
    gather = _tp(
        lambda x: C.all_gather(x, axis_name=T, axis=axis)[None],
        mesh,
        _spec(2, axis),
        P(T),
        check_vma,
    )
    _assert_parity(gather, lambda x: jnp.broadcast_to(x[None], (n, *x.shape)), (x,))


@pytest.mark.parametrize("n", SIZES)
def test_all_gather_replicated_output_without_check_vma(n):
    # With check_vma=False the gathered array may be returned as replicated (out_specs
    # P()); shard_map then divides the cotangent by n and the reduce-scatter sums n
    # copies of it back: the gradient is exactly the cotangent's block.
    mesh = eqxpar.make_mesh(tensor=n)
    x = _normal(np.random.default_rng(2), (2 * n, 3))
    gather = _tp(lambda x: C.all_gather(x, axis_name=T), mesh, P(T), P(), check_vma=False)
    _assert_parity(gather, lambda x: x, (x,))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("n", SIZES)
def test_psum_scatter_matches_dense(n, axis, check_vma):
    mesh = eqxpar.make_mesh(tensor=n)
    shape = (n, 2 * n, 3) if axis == 0 else (n, 3, 2 * n)
    x = _normal(np.random.default_rng(3), shape)
    scatter = _tp(
        lambda x: C.psum_scatter(x[0], axis_name=T, axis=axis),
        mesh,
        P(T),
        _spec(2, axis),
        check_vma,
    )
    _assert_parity(scatter, lambda x: x.sum(0), (x,))


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("n", SIZES)
def test_all_gather_mean_grad_averages_gradients(n, check_vma):
    # Forward: the all-gather. Backward: the per-device gradients' mean, i.e. the
    # all-gather's gradient divided by n.
    mesh = eqxpar.make_mesh(tensor=n)
    x = _normal(np.random.default_rng(4), (2 * n, 3))
    gather = _tp(lambda x: C.all_gather_mean_grad(x, axis_name=T)[None], mesh, P(T), P(T), check_vma)
    dense = lambda x: jnp.broadcast_to(x[None], (n, *x.shape))  # noqa: E731
    _assert_parity(gather, dense, (x,), grad_scale=1.0 / n)


def test_gather_and_scatter_transpose_to_each_other():
    # The backward pass of a gather is a reduce-scatter (not an all-reduce), and of a
    # reduce-scatter an all-gather.
    mesh = eqxpar.make_mesh(tensor=4)
    x = jnp.ones((8, 3))
    for gather in (C.all_gather, C.all_gather_mean_grad):
        f = _tp(lambda x, g=gather: g(x, axis_name=T)[None], mesh, P(T), P(T))
        stats = collective_stats(jax.jit(jax.grad(lambda x, f=f: jnp.sum(f(x) ** 2))).lower(x).compile())
        assert set(stats.count) == {"all-gather", "reduce-scatter"}, stats.as_dict()
    f = _tp(lambda x: C.psum_scatter(x[0], axis_name=T), mesh, P(T), P(T))
    x = jnp.ones((4, 8, 3))
    stats = collective_stats(jax.jit(jax.grad(lambda x: jnp.sum(f(x) ** 2))).lower(x).compile())
    assert set(stats.count) == {"all-gather", "reduce-scatter"}, stats.as_dict()


# ---------------------------------------------------------------------------
# Collective matmuls: parity, forward and backward
# ---------------------------------------------------------------------------

# (n, bidirectional, check_vma, axis): every size both ways with the defaults, and
# check_vma=False / axis=0 on one size.
MATMUL_CASES = [(n, b, True, 1) for n in SIZES for b in (False, True)] + [
    (4, b, False, 0) for b in (False, True)
]


def _ag_problem(n, axis, seed, batch=2, s=3, d_in=5, d_out=4):
    """x split over `tensor` along `axis`, a column-parallel w, and the sharded op."""
    rng = np.random.default_rng(seed)
    x_shape = [batch, batch]
    x_shape[axis] = n * s
    x = _normal(rng, (*x_shape, d_in))
    w = _normal(rng, (d_in, n * d_out))
    return x, w


def _ag_matmul(mesh, axis, bidirectional, check_vma=True, ndim=3):
    return _tp(
        lambda x, w: C.all_gather_matmul(x, w, axis_name=T, axis=axis, bidirectional=bidirectional),
        mesh,
        (_spec(ndim, axis), P(None, T)),
        _spec(ndim, -1),
        check_vma,
    )


def _rs_problem(n, axis, seed, batch=2, s=3, d_in=5, d_out=4):
    rng = np.random.default_rng(seed)
    x_shape = [batch, batch]
    x_shape[axis] = n * s
    x = _normal(rng, (*x_shape, n * d_in))
    w = _normal(rng, (n * d_in, d_out))
    return x, w


def _matmul_rs(mesh, axis, bidirectional, check_vma=True, ndim=3):
    return _tp(
        lambda x, w: C.matmul_reduce_scatter(x, w, axis_name=T, axis=axis, bidirectional=bidirectional),
        mesh,
        (_spec(ndim, -1), P(T)),
        _spec(ndim, axis),
        check_vma,
    )


@pytest.mark.parametrize(("n", "bidirectional", "check_vma", "axis"), MATMUL_CASES)
def test_all_gather_matmul_matches_dense(n, bidirectional, check_vma, axis):
    mesh = eqxpar.make_mesh(tensor=n)
    x, w = _ag_problem(n, axis, seed=n)
    _assert_parity(_ag_matmul(mesh, axis, bidirectional, check_vma), jnp.matmul, (x, w), seed=n)


@pytest.mark.parametrize(("n", "bidirectional", "check_vma", "axis"), MATMUL_CASES)
def test_matmul_reduce_scatter_matches_dense(n, bidirectional, check_vma, axis):
    mesh = eqxpar.make_mesh(tensor=n)
    x, w = _rs_problem(n, axis, seed=n)
    _assert_parity(_matmul_rs(mesh, axis, bidirectional, check_vma), jnp.matmul, (x, w), seed=n)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_all_gather_matmul_replicated_weight_gradient(bidirectional):
    # A weight replicated over the axis gets the sum of every device's gradient.
    n = 4
    mesh = eqxpar.make_mesh(tensor=n)
    x, w = _ag_problem(n, 1, seed=5)
    w = w[:, :4]
    f = _tp(
        lambda x, w: C.all_gather_matmul(x, w, axis_name=T, axis=1, bidirectional=bidirectional)[None],
        mesh,
        (P(None, T), P()),
        P(T),
    )
    _assert_parity(f, lambda x, w: jnp.broadcast_to((x @ w)[None], (n, *x.shape[:-1], w.shape[1])), (x, w))


@st.composite
def _matmul_shapes(draw):
    batch = draw(st.integers(0, 3))  # 0: x has no batch dimension
    return dict(
        n=draw(st.sampled_from(SIZES)),
        s=draw(st.integers(1, 3)),
        d_in=draw(st.integers(1, 4)),
        d_out=draw(st.integers(1, 4)),
        batch=batch,
        axis=draw(st.sampled_from([0, 1])) if batch else 0,
        bidirectional=draw(st.booleans()),
    )


def _split_shape(n, s, batch, axis, last):
    shape = [n * s] if not batch else [batch, batch]
    shape[axis] = n * s
    return (*shape, last)


@settings(max_examples=12, deadline=None)
@given(_matmul_shapes())
def test_all_gather_matmul_equals_gather_then_matmul(case):
    n, axis = case["n"], case["axis"]
    rng = np.random.default_rng(0)
    x = _normal(rng, _split_shape(n, case["s"], case["batch"], axis, case["d_in"]))
    w = _normal(rng, (case["d_in"], n * case["d_out"]))
    f = _ag_matmul(eqxpar.make_mesh(tensor=n), axis, case["bidirectional"], ndim=x.ndim)
    out = jax.jit(f)(x, w)
    assert out.shape == (*x.shape[:-1], n * case["d_out"])
    assert_trees_close(out, x @ w, atol=ATOL)


@settings(max_examples=12, deadline=None)
@given(_matmul_shapes())
def test_matmul_reduce_scatter_equals_matmul_then_scatter(case):
    n, axis = case["n"], case["axis"]
    rng = np.random.default_rng(0)
    x = _normal(rng, _split_shape(n, case["s"], case["batch"], axis, n * case["d_in"]))
    w = _normal(rng, (n * case["d_in"], case["d_out"]))
    f = _matmul_rs(eqxpar.make_mesh(tensor=n), axis, case["bidirectional"], ndim=x.ndim)
    out = jax.jit(f)(x, w)
    assert out.shape == (*x.shape[:-1], case["d_out"])
    assert_trees_close(out, x @ w, atol=ATOL)


# ---------------------------------------------------------------------------
# Collective matmuls: what the compiled program does
# ---------------------------------------------------------------------------

B, S, D_IN, D_OUT = 2, 3, 5, 4  # per-device block sizes of the HLO tests


@functools.cache
def _compiled(kind, n, bidirectional):
    """The forward program of a collective matmul (`ring`) or of the synchronous
    collective + matmul it replaces (`sync`), on n devices."""
    mesh = eqxpar.make_mesh(tensor=n)
    if kind.startswith("ag"):
        x, w = jnp.ones((B, n * S, D_IN)), jnp.ones((D_IN, n * D_OUT))
        if kind == "ag_ring":
            f = _ag_matmul(mesh, 1, bidirectional)
        else:
            f = _tp(
                lambda x, w: C.all_gather(x, axis_name=T, axis=1) @ w,
                mesh,
                (P(None, T), P(None, T)),
                P(None, None, T),
            )
    else:
        x, w = jnp.ones((B, n * S, n * D_IN)), jnp.ones((n * D_IN, D_OUT))
        if kind == "rs_ring":
            f = _matmul_rs(mesh, 1, bidirectional)
        else:
            f = _tp(
                lambda x, w: C.psum_scatter(x @ w, axis_name=T, axis=1),
                mesh,
                (P(None, None, T), P(T)),
                P(None, T),
            )
    return jax.jit(f).lower(x, w).compile()


def _permutes_in_text(compiled):
    return len(re.findall(r"\scollective-permute(?:-start)?\(", compiled.as_text()))


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_gather_matmul_moves_the_bytes_of_a_ring_all_gather(n, bidirectional):
    ring = collective_stats(_compiled("ag_ring", n, bidirectional))
    sync = collective_stats(_compiled("ag_sync", n, bidirectional))
    assert set(ring.count) == {"collective-permute"}, ring.as_dict()
    block_bytes = B * S * D_IN * 4
    assert ring.bytes["collective-permute"] == (n - 1) * block_bytes
    # (n-1)/n of the all-gather's result: what a ring all-gather puts on the wire.
    assert n * ring.bytes["collective-permute"] == (n - 1) * sync.bytes["all-gather"]


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_matmul_reduce_scatter_moves_the_bytes_of_a_ring_reduce_scatter(n, bidirectional):
    ring = collective_stats(_compiled("rs_ring", n, bidirectional))
    sync = collective_stats(_compiled("rs_sync", n, bidirectional))
    assert set(ring.count) == {"collective-permute"}, ring.as_dict()
    assert ring.bytes["collective-permute"] == (n - 1) * B * S * D_OUT * 4
    assert ring.bytes["collective-permute"] == (n - 1) * sync.bytes["reduce-scatter"]


@pytest.mark.parametrize("kind", ["ag_ring", "rs_ring"])
def test_program_size_does_not_grow_with_n(kind):
    # Weighted by trip count the permutes grow as n-1; the instructions do not. The
    # unidirectional ring is one permute in a loop for every n. The bidirectional one
    # has a prologue and an epilogue around its loop: at most 5 permutes, the same
    # for every n >= 5 of one parity.
    for bidirectional, sizes in ((False, (2, 4, 8)), (True, (6, 8))):
        programs = {n: _compiled(kind, n, bidirectional) for n in sizes}
        weighted = {n: collective_stats(c).count["collective-permute"] for n, c in programs.items()}
        assert weighted == {n: n - 1 for n in sizes}
        assert len({_permutes_in_text(c) for c in programs.values()}) == 1
    assert max(_permutes_in_text(_compiled(kind, n, True)) for n in (2, 4, 6, 8)) <= 5


# ---------------------------------------------------------------------------
# Partial-manual shard_map: TP manual, data automatic
# ---------------------------------------------------------------------------


def _partial_manual_problem(kind):
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    rng = np.random.default_rng(6)
    batch, seq, d, f = 8, 32, 16, 32
    if kind == "ag":
        x = jax.device_put(_normal(rng, (batch, seq, d)), NamedSharding(mesh, P("data", T)))
        w = jax.device_put(_normal(rng, (d, f)), NamedSharding(mesh, P(None, T)))
    else:
        x = jax.device_put(_normal(rng, (batch, seq, f)), NamedSharding(mesh, P("data", None, T)))
        w = jax.device_put(_normal(rng, (f, d)), NamedSharding(mesh, P(T)))
    return mesh, x, w


@pytest.mark.parametrize("bidirectional", [False, True])
def test_partial_manual_keeps_the_batch_sharded_over_data(bidirectional):
    mesh, x, w = _partial_manual_problem("ag")
    f = _ag_matmul(mesh, 1, bidirectional)
    assert_trees_close(jax.jit(f)(x, w), np.asarray(x) @ np.asarray(w), atol=ATOL)
    flops = jax.jit(f).lower(x, w).compile().cost_analysis()["flops"]
    dense_flops = 2 * x.size * w.shape[1]
    if bidirectional:
        # n=4 bidirectional has no loop, so cost_analysis sees every block's matmul:
        # 1/8 of the dense flops (batch over data, sequence over tensor), not 1/4.
        assert flops == pytest.approx(dense_flops / 8, rel=0.05)
    else:
        # cost_analysis counts a loop body once, whatever its trip count; compare with
        # the same program given x replicated over data, which computes every example.
        replicated = jax.device_put(x, NamedSharding(mesh, P(None, T)))
        flops_replicated = jax.jit(f).lower(replicated, w).compile().cost_analysis()["flops"]
        assert flops == pytest.approx(flops_replicated / 2, rel=0.05)


@pytest.mark.parametrize("kind", ["ag", "rs"])
def test_partial_manual_gradients_reduce_over_data_once(kind):
    # Autodiff through the ring would compute the weight gradient one block at a time,
    # and the compiler would all-reduce each partial over `data` inside the loop; the
    # custom backward pass computes it once, after the loop.
    mesh, x, w = _partial_manual_problem(kind)
    f = _ag_matmul(mesh, 1, False) if kind == "ag" else _matmul_rs(mesh, 1, False)
    _assert_parity(f, jnp.matmul, (x, w), seed=7)
    cot = jnp.ones(jax.eval_shape(f, x, w).shape)
    compiled = jax.jit(lambda x, w: jax.vjp(f, x, w)[1](cot)).lower(x, w).compile()
    stats = collective_stats(compiled)
    assert stats.count["all-reduce"] == 1, stats.as_dict()
    assert set(stats.count) == {"all-reduce", "collective-permute"}, stats.as_dict()


# ---------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------


def _trace(fn, *args, mesh=None, specs=None):
    mesh = mesh or eqxpar.make_mesh(tensor=4)
    specs = specs or tuple(P() for _ in args)
    jax.eval_shape(_tp(fn, mesh, specs, P()), *args)


def test_axis_out_of_range_raises_spec_error():
    x = jnp.ones((8, 3))
    for fn in (C.all_gather, C.psum_scatter, C.all_gather_mean_grad):
        with pytest.raises(eqxpar.SpecError, match=r"axis=2 is out of range.*\[-2, 2\)"):
            _trace(lambda x, fn=fn: fn(x, axis_name=T, axis=2), x)
    for fn in (C.all_gather_matmul, C.matmul_reduce_scatter):
        with pytest.raises(eqxpar.SpecError, match="axis=-4 is out of range"):
            _trace(lambda x, w, fn=fn: fn(x, w, axis_name=T, axis=-4), jnp.ones((2, 8, 3)), jnp.ones((3, 2)))
        with pytest.raises(eqxpar.SpecError, match="last dimension, the one contracted"):
            _trace(lambda x, w, fn=fn: fn(x, w, axis_name=T, axis=-1), jnp.ones((2, 8, 3)), jnp.ones((3, 2)))


def test_weight_not_matching_x_raises_spec_error():
    for fn in (C.all_gather_matmul, C.matmul_reduce_scatter):
        with pytest.raises(eqxpar.SpecError, match=r"w's first dimension 5 .*x's last dimension 3"):
            _trace(lambda x, w, fn=fn: fn(x, w, axis_name=T), jnp.ones((8, 3)), jnp.ones((5, 2)))


def test_indivisible_scatter_raises_divisibility_error():
    with pytest.raises(eqxpar.DivisibilityError, match=r"size 6.*4 devices.*multiple of 4"):
        _trace(lambda x: C.psum_scatter(x, axis_name=T), jnp.ones((6, 3)))
    with pytest.raises(eqxpar.DivisibilityError, match=r"size 6.*multiple of 4"):
        _trace(
            lambda x, w: C.matmul_reduce_scatter(x, w, axis_name=T, axis=1),
            jnp.ones((2, 6, 3)),
            jnp.ones((3, 2)),
        )


def test_non_manual_axis_raises_axis_name_error():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    for name in ("data", "tensr"):
        with pytest.raises(eqxpar.AxisNameError, match=rf"axis_name='{name}'.*\('tensor',\)"):
            _trace(lambda x, name=name: C.all_gather(x, axis_name=name), jnp.ones((8, 3)), mesh=mesh)
