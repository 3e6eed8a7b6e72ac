"""Pure collectives for code running inside `jax.shard_map`.

Every function here takes a keyword-only `axis_name`, a mesh axis that is *manual*
where it is called (a full `jax.shard_map`, or a partial-manual one whose
`axis_names` include it). They work with `check_vma=True` (the default) and
`check_vma=False`, and their gradients are exact:

- `all_gather` / `psum_scatter`: tiled gather / reduce-scatter along one array
  dimension; each is the other's transpose, so the backward pass of a gather is a
  reduce-scatter (the cheap one), not an all-reduce. In a partial-manual region
  where an automatic axis splits something, they run as plain `ppermute` rings
  (same bytes): XLA would otherwise gather the automatically split dimensions.
- `all_to_all`: tiled all-to-all (a `ppermute` per other device in a
  partial-manual region, for the same reason).
- `all_gather_mean_grad`: a gather whose backward pass averages the per-device
  gradients instead of summing them (FSDP weight shards).
- `all_gather_matmul` / `matmul_reduce_scatter`: the collective matmuls of
  sequence-parallel layers, computed as rings of `ppermute`s so that each block's
  transfer can overlap the matmul of the block before it. They move exactly the
  bytes of the ring all-gather / reduce-scatter they replace, and their loops are
  `fori_loop`s, so the program does not grow with the axis size. Each one's
  backward pass is the other ring plus one weight-gradient matmul after the loop
  (custom VJPs; see the comment above `_ag_matmul` for why not autodiff).

Ring schemes (device `i` of `n`, blocks numbered by the device that owns them):

- `all_gather_matmul`, unidirectional: every device sends the block it holds to its
  left neighbour (`i -> i-1`) while it multiplies that block, so at step `k` it holds
  block `i+k`; `n-1` transfers of one block each.
- `all_gather_matmul`, bidirectional: two streams start from the local block, one
  moving left (bringing blocks `i+1, i+2, ...`) and one moving right (bringing
  `i-1, i-2, ...`); the left stream makes `n//2` hops and the right one `(n-1)//2`,
  so `ceil((n-1)/2)` steps with two transfers each and still `n-1` blocks in total.
- `matmul_reduce_scatter`, unidirectional: an accumulator for output block `t`
  starts at device `t+1` and travels right (`i -> i+1`) through `t+2, ..., t`,
  each device adding its partial product for block `t` before passing it on; after
  `n-1` hops it arrives complete at device `t`. The partial product of a step does
  not depend on the accumulator being received, so they overlap.
- `matmul_reduce_scatter`, bidirectional: block `t` gets two accumulators, one
  collecting the partial products of the `n//2` devices after `t` (travelling left)
  and one those of the `(n-1)//2` devices before it (travelling right); device `t`
  adds both to its own partial product. Again `n-1` block transfers in
  `ceil((n-1)/2)` steps. (Splitting the contraction dimension between the two
  directions instead would send every accumulator twice: twice the bytes.)

With `n == 1` every function is its local, communication-free equivalent.
"""

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float, Shaped

from ._errors import AxisNameError, DivisibilityError, SpecError
from ._mesh import AXES, mesh_platform
from ._plan import current_plan
from ._varying import mark_varying, varying_axes

# ---------------------------------------------------------------------------
# Validation and varying-ness helpers
# ---------------------------------------------------------------------------


def _axis_size(axis_name: str, fn: str) -> int:
    try:
        return lax.axis_size(axis_name)
    except NameError:
        # jax says "unbound axis name" both for typos and for mesh axes that are Auto
        # (not manual) in a partial-manual shard_map; say which ones would work.
        mesh = jax.sharding.get_abstract_mesh()
        manual = () if mesh.empty else tuple(mesh.manual_axes)
        raise AxisNameError(
            f"{fn}: axis_name={axis_name!r} is not a manual mesh axis here (manual axes: "
            f"{manual}). Call {fn} inside jax.shard_map with {axis_name!r} in its "
            f"axis_names; eqxpar meshes have the axes {AXES}."
        ) from None


def _check_axis(axis: int, ndim: int, shape: tuple[int, ...], fn: str) -> int:
    if not -ndim <= axis < ndim:
        raise SpecError(
            f"{fn}: axis={axis} is out of range for x of shape {shape} (rank {ndim}). "
            f"Pass an axis in [{-ndim}, {ndim})."
        )
    return axis % ndim


def _check_matmul(x: Array, w: Array, axis: int, fn: str) -> int:
    if x.ndim < 2:
        raise SpecError(
            f"{fn}: x of shape {x.shape} has rank {x.ndim}; it needs the split dimension "
            "`axis` and a last (contraction) dimension. Add a length-1 dimension."
        )
    if w.ndim != 2:
        raise SpecError(f"{fn}: w of shape {w.shape} must be 2-D (d_in, d_out); reshape it.")
    if w.shape[0] != x.shape[-1]:
        raise SpecError(
            f"{fn}: w's first dimension {w.shape[0]} (w.shape={w.shape}) does not match "
            f"x's last dimension {x.shape[-1]} (x.shape={x.shape}). Pass w of shape "
            f"({x.shape[-1]}, d_out), the local shard that multiplies x's last dimension."
        )
    axis = _check_axis(axis, x.ndim, x.shape, fn)
    if axis == x.ndim - 1:
        raise SpecError(
            f"{fn}: axis={axis} is x's last dimension, the one contracted with w "
            f"(x.shape={x.shape}). Pass the split dimension, one of 0..{x.ndim - 2}."
        )
    return axis


def _check_divisible(x: Array, axis: int, n: int, axis_name: str, fn: str) -> None:
    if x.shape[axis] % n:
        raise DivisibilityError(
            f"{fn}: dimension {axis} of x (shape {x.shape}) has size {x.shape[axis]}, "
            f"which the {n} devices of mesh axis {axis_name!r} do not divide. Pad or "
            f"choose sizes so that x.shape[{axis}] is a multiple of {n}."
        )


def _prepare_matmul(
    x: Array, w: Array, axis_name: str, axis: int, fn: str, *, scatter: bool
) -> tuple[int, int, Array, Array]:
    """The checks and casts both collective matmuls start with: returns the axis
    size, the normalised `axis`, and `x`, `w` cast to varying."""
    n = _axis_size(axis_name, fn)
    axis = _check_matmul(x, w, axis, fn)
    if scatter:
        _check_divisible(x, axis, n, axis_name, fn)
    # Everything in the ring varies over axis_name (it arrives by ppermute) and over
    # whatever x and w already vary over: cast once, outside the loop (mark_varying),
    # so the transpose of the cast (a psum) runs once in the backward pass, not per
    # ring step (or, for a replicated weight, is the one psum its gradient needs,
    # placed after the loop).
    vma = varying_axes(x) | varying_axes(w) | {axis_name}
    return n, axis, mark_varying(x, vma), mark_varying(w, vma)


def _dot(a: Array, w: Array) -> Array:
    # Contract a's last dimension with w's first; tensordot keeps any leading
    # dimensions without broadcasting (rank promotion stays strict).
    return jnp.tensordot(a, w, axes=1)


def _ring(n: int, step: int) -> list[tuple[int, int]]:
    # (source, destination) pairs: every device sends to the one `step` further on.
    return [(j, (j + step) % n) for j in range(n)]


# ---------------------------------------------------------------------------
# Synchronous collectives
# ---------------------------------------------------------------------------


def wire_dtype(dtype: Any) -> Any:
    """The dtype to run a collective of `dtype` values in, here.

    XLA:CPU aborts compiling a bfloat16 all-reduce or reduce-scatter (the
    transpose of a tiled all-gather) in a partial-manual region: JAX puts a sharding annotation (a `copy`)
    in the reduction, which XLA:CPU's widening of bfloat16 reductions cannot
    clone. XLA:CPU moves bfloat16 collectives as float32 anyway, so there they are
    run in float32: same bytes, same rounding. The platform is that of the plan
    being traced (the default backend's outside one): a program compiled here
    for a TPU topology keeps its bfloat16 reductions (in float32 they doubled
    the wire bytes of an MoE's expert gradients' reduce-scatters).
    """
    if dtype != jnp.bfloat16 or _traced_platform() != "cpu":
        return dtype
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    return jnp.float32 if manual and manual != set(mesh.axis_names) else dtype


def _traced_platform() -> str:
    """The platform of the plan being traced (`with plan:`, or an eqxpar
    step's), else the default backend's."""
    plan = current_plan()
    return jax.default_backend() if plan is None else mesh_platform(plan.mesh)


def all_gather(x: Shaped[Array, "..."], *, axis_name: str, axis: int = 0) -> Shaped[Array, "..."]:
    """Tiled all-gather: concatenate every device's `x` along dimension `axis`.

    The result varies over `axis_name` (as `jax.lax.all_gather`), and its transpose
    under autodiff is a reduce-scatter of the cotangent: the gradient reaching this
    device's `x` is its block of the *sum* over devices of the result's cotangents.
    This is right with `check_vma=True` and `check_vma=False` alike (with
    `check_vma=False` and `out_specs` that do not mention `axis_name`, shard_map
    divides the cotangent by the axis size first, so the sum is again exact).
    `jax.lax.all_gather_invariant` would instead give an invariant result whose
    transpose is a slice; combined with anything varying that costs an all-reduce
    plus a slice in the backward pass where one reduce-scatter suffices.

    **Arguments:**

    - `x`: this device's block.
    - `axis_name`: the manual mesh axis to gather over.
    - `axis`: the dimension to concatenate along (negative counts from the end).

    **Returns:** `x.shape` with dimension `axis` multiplied by the axis size `n`;
    block `j` along `axis` is device `j`'s `x`.

    **Raises:** `SpecError` if `axis` is out of range, `AxisNameError` if
    `axis_name` is not a manual axis here.

    ```python
    # x: (seq/n, d) per device -> (seq, d)
    full = eqxpar.collectives.all_gather(x, axis_name="tensor", axis=0)
    ```
    """
    n = _axis_size(axis_name, "all_gather")
    axis = _check_axis(axis, x.ndim, x.shape, "all_gather")
    if n == 1:
        return mark_varying(x, {axis_name})
    if _automatic_axes_split():
        return _ring_all_gather(mark_varying(x, {axis_name}), axis_name, axis)
    return lax.all_gather(x, axis_name, axis=axis, tiled=True)


def psum_scatter(x: Shaped[Array, "..."], *, axis_name: str, axis: int = 0) -> Shaped[Array, "..."]:
    """Tiled reduce-scatter: sum `x` over devices, keep this device's block of `axis`.

    Equal to `jax.lax.psum(x, axis_name)` split into `n` blocks along `axis`, of which
    device `i` keeps block `i`, but moves `(n-1)/n` of the tensor instead of twice
    that. Its transpose under autodiff is a tiled all-gather of the cotangent.

    **Arguments:**

    - `x`: this device's addend, full size along `axis`.
    - `axis_name`: the manual mesh axis to reduce over.
    - `axis`: the dimension to scatter along; its size must be divisible by `n`.

    **Returns:** `x.shape` with dimension `axis` divided by `n`.

    **Raises:** `SpecError` if `axis` is out of range, `DivisibilityError` if
    `n` does not divide `x.shape[axis]`, `AxisNameError` if `axis_name` is not a
    manual axis here.

    ```python
    # partial sums (seq, d) per device -> summed (seq/n, d)
    y = eqxpar.collectives.psum_scatter(partial, axis_name="tensor", axis=0)
    ```
    """
    n = _axis_size(axis_name, "psum_scatter")
    axis = _check_axis(axis, x.ndim, x.shape, "psum_scatter")
    _check_divisible(x, axis, n, axis_name, "psum_scatter")
    if n == 1:
        return mark_varying(x, {axis_name})
    if _automatic_axes_split():
        return _ring_psum_scatter(mark_varying(x, {axis_name}), axis_name, axis)
    return lax.psum_scatter(x, axis_name, scatter_dimension=axis, tiled=True)


def all_to_all(
    x: Shaped[Array, "..."], *, axis_name: str, split_axis: int, concat_axis: int
) -> Shaped[Array, "..."]:
    """Tiled all-to-all: cut `x` into `n` blocks along `split_axis`, send block `j`
    to device `j`, and concatenate the blocks received along `concat_axis` in the
    order of the devices that sent them.

    Each device sends `(n-1)/n` of `x`. Its transpose under autodiff is the
    all-to-all back (`split_axis` and `concat_axis` swapped). In a partial-manual
    region where an automatic axis splits something it runs as `n-1` `ppermute`s
    (same bytes): XLA would otherwise gather the automatically split dimensions
    first (as for `all_gather`).

    **Arguments:**

    - `x`: this device's array.
    - `axis_name`: the manual mesh axis to exchange over.
    - `split_axis`: the dimension cut into `n` blocks, one per device; its size
      must be divisible by `n`.
    - `concat_axis`: the dimension the received blocks are concatenated along.

    **Returns:** `x.shape` with dimension `split_axis` divided by `n` and then
    dimension `concat_axis` multiplied by `n`; block `j` along `concat_axis` is
    device `j`'s block for this device.

    **Raises:** `SpecError` if an axis is out of range, `DivisibilityError` if
    `n` does not divide `x.shape[split_axis]`, `AxisNameError` if `axis_name` is
    not a manual axis here.

    ```python
    # (batch, seq/n, heads, d) per device -> (batch, seq, heads/n, d): Ulysses
    by_heads = eqxpar.collectives.all_to_all(q, axis_name="context", split_axis=2, concat_axis=1)
    ```
    """
    n = _axis_size(axis_name, "all_to_all")
    split_axis = _check_axis(split_axis, x.ndim, x.shape, "all_to_all")
    concat_axis = _check_axis(concat_axis, x.ndim, x.shape, "all_to_all")
    _check_divisible(x, split_axis, n, axis_name, "all_to_all")
    x = mark_varying(x, {axis_name})
    if n == 1:
        return x
    if _automatic_axes_split():
        return _ring_all_to_all(x, axis_name, split_axis, concat_axis)
    return lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def _ring_all_to_all(x: Array, axis_name: str, split_axis: int, concat_axis: int) -> Array:
    # Shift s (1 .. n-1): every device i sends its block for device i+s there.
    # Device `me` receives device me-s's block for it, which goes to position me-s.
    n, me = lax.axis_size(axis_name), lax.axis_index(axis_name)
    size = x.shape[split_axis] // n

    def block(j: Array) -> Array:
        return lax.dynamic_slice_in_dim(x, (j % n) * size, size, split_axis)

    own = block(me)
    shape = list(own.shape)
    shape[concat_axis] *= n
    out = mark_varying(jnp.zeros(shape, x.dtype), varying_axes(x))
    width = own.shape[concat_axis]
    out = lax.dynamic_update_slice_in_dim(out, own, me * width, concat_axis)
    for s in range(1, n):
        received = lax.ppermute(block(me + s), axis_name, [(i, (i + s) % n) for i in range(n)])
        out = lax.dynamic_update_slice_in_dim(out, received, ((me - s) % n) * width, concat_axis)
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_cotangent(x: Array, scale: float) -> Array:
    return x


def _scale_cotangent_fwd(x: Array, scale: float) -> tuple[Array, None]:
    return x, None


def _scale_cotangent_bwd(scale: float, _: None, ct: Array) -> tuple[Array]:
    return (ct * scale,)


_scale_cotangent.defvjp(_scale_cotangent_fwd, _scale_cotangent_bwd)


def all_gather_mean_grad(x: Float[Array, "..."], *, axis_name: str, axis: int = 0) -> Float[Array, "..."]:
    """All-gather whose gradient is the *mean* over devices, not the sum.

    Forward: exactly `all_gather(x, axis_name=axis_name, axis=axis)`. Backward: the
    reduce-scatter of the cotangent divided by the axis size `n`. This is the FSDP
    weight gather: each device computes the gradient of its own batch's loss, and
    its weight shard receives the mean of those gradients, i.e. the gradient of the
    mean loss over the devices' batches, in one reduce-scatter (the division is
    applied to the shard, after the reduce-scatter, so it costs `1/n` of the
    elements). A `jax.custom_vjp`, so reverse mode only (no `jax.jvp`).

    **Arguments:**

    - `x`: this device's shard.
    - `axis_name`: the manual mesh axis to gather over.
    - `axis`: the dimension to concatenate along.

    **Returns:** `x.shape` with dimension `axis` multiplied by `n`.

    **Raises:** as `all_gather`.

    ```python
    # FSDP: weight shard (d_in/n, d_out) -> full (d_in, d_out); grads averaged
    w_full = eqxpar.collectives.all_gather_mean_grad(w_shard, axis_name="fsdp")
    ```
    """
    n = _axis_size(axis_name, "all_gather_mean_grad")
    _check_axis(axis, x.ndim, x.shape, "all_gather_mean_grad")
    return all_gather(_scale_cotangent(x, 1.0 / n), axis_name=axis_name, axis=axis)


# ---------------------------------------------------------------------------
# Collective matmuls
# ---------------------------------------------------------------------------


def _ag_ring(
    x: Array, f: Callable[[Array], Array], axis_name: str, axis: int, bidirectional: bool, keep_x: bool
) -> tuple[Array, Array | None]:
    # all_gather(f(x), axis) for n >= 2, with f applied block by block as the blocks
    # arrive (f: a matmul, or the identity for a plain ring all-gather; it must keep
    # dimension `axis`), and (if keep_x) the gathered x, which the ring sees anyway.
    # x, and whatever f closes over, already vary over axis_name.
    n = lax.axis_size(axis_name)
    block = x.shape[axis]
    vma = varying_axes(x)
    product = jax.eval_shape(f, x)
    out_shape = (*product.shape[:axis], n * block, *product.shape[axis + 1 :])
    out = mark_varying(jnp.zeros(out_shape, product.dtype), vma)
    xs_shape = (*x.shape[:axis], n * block, *x.shape[axis + 1 :])
    xs = mark_varying(jnp.zeros(xs_shape, x.dtype), vma) if keep_x else None
    me = lax.axis_index(axis_name)
    to_left, to_right = _ring(n, -1), _ring(n, +1)

    def place(acc: tuple, xb: Array, origin: Array) -> tuple:
        # xb is the block device `origin` (mod n) owns; its product goes there.
        out, xs = acc
        start = (origin % n) * block
        out = lax.dynamic_update_slice_in_dim(out, f(xb), start, axis)
        if xs is not None:
            xs = lax.dynamic_update_slice_in_dim(xs, xb, start, axis)
        return out, xs

    acc = (out, xs)
    if not bidirectional or n == 2:
        # Step k: hold block me+k; pass it left while multiplying it.
        def step(k, carry):
            acc, xb = carry
            received = lax.ppermute(xb, axis_name, to_left)
            return place(acc, xb, me + k), received

        acc, xb = lax.fori_loop(0, n - 1, step, (acc, x))
        return place(acc, xb, me + n - 1)

    # Bidirectional: stream a moves left (blocks me+1, me+2, ...: n//2 hops), stream b
    # moves right (blocks me-1, me-2, ...: (n-1)//2 hops). Each step multiplies the
    # blocks the previous step received while sending them on.
    hops_a, hops_b = n // 2, (n - 1) // 2
    a = lax.ppermute(x, axis_name, to_left)
    b = lax.ppermute(x, axis_name, to_right)
    acc = place(acc, x, me)

    def both(k, carry):
        acc, a, b = carry
        a_next = lax.ppermute(a, axis_name, to_left)
        b_next = lax.ppermute(b, axis_name, to_right)
        return place(place(acc, a, me + k), b, me - k), a_next, b_next

    if hops_b > 1:
        acc, a, b = lax.fori_loop(1, hops_b, both, (acc, a, b))
    # Step hops_b is b's last; when n is even, a goes one hop further.
    a_last = lax.ppermute(a, axis_name, to_left) if hops_a > hops_b else None
    acc = place(place(acc, a, me + hops_b), b, me - hops_b)
    if a_last is not None:
        acc = place(acc, a_last, me + hops_a)
    return acc


def _rs_ring(x: Array, f: Callable[[Array], Array], axis_name: str, axis: int, bidirectional: bool) -> Array:
    # psum_scatter(f(x), axis) for n >= 2, f applied to one block of x at a time (a
    # matmul, or the identity for a plain ring reduce-scatter); x, and whatever f
    # closes over, already vary over axis_name.
    n = lax.axis_size(axis_name)
    block = x.shape[axis] // n
    me = lax.axis_index(axis_name)
    to_left, to_right = _ring(n, -1), _ring(n, +1)

    def partial(target: Array) -> Array:
        # This device's addend for output block `target` (mod n).
        return f(lax.dynamic_slice_in_dim(x, (target % n) * block, block, axis))

    if not bidirectional or n == 2:
        # The accumulator here at step k is for block me-1-k: it started at device
        # (me-1-k)+1 and moves right, so at k = n-1 it is this device's own.
        def step(k, acc):
            return lax.ppermute(acc, axis_name, to_right) + partial(me - 1 - k)

        return lax.fori_loop(1, n, step, partial(me - 1))

    # Bidirectional: block t's accumulator a collects devices t+n//2, ..., t+1 moving
    # left and b collects t-(n-1)//2, ..., t-1 moving right; device t adds both to
    # its own addend. At step k the a here is for block me-hops_a+k, the b for
    # block me+hops_b-k.
    hops_a, hops_b = n // 2, (n - 1) // 2
    a, b = partial(me - hops_a), partial(me + hops_b)

    def both(k, carry):
        a, b = carry
        a = lax.ppermute(a, axis_name, to_left) + partial(me - hops_a + k)
        b = lax.ppermute(b, axis_name, to_right) + partial(me + hops_b - k)
        return a, b

    if hops_b > 1:
        a, b = lax.fori_loop(1, hops_b, both, (a, b))
    b_in = lax.ppermute(b, axis_name, to_right)
    if hops_a > hops_b:
        # n even: a takes one more step (for block me-1) than b.
        a = lax.ppermute(a, axis_name, to_left) + partial(me - 1)
    return partial(me) + lax.ppermute(a, axis_name, to_left) + b_in


def _contract_all_but_last(a: Array, b: Array) -> Array:
    # sum over every leading position of a[..., i] * b[..., o]: the weight gradient.
    leading = list(range(a.ndim - 1))
    return jnp.tensordot(a, b, axes=(leading, leading))


# Custom VJPs, not autodiff through the loops: autodiff would compute the weight
# gradient as one small matmul per ring step, each contracting the batch dimension.
# In a partial-manual shard_map whose batch is sharded over an Auto axis (data), the
# compiler then all-reduces each step's partial weight gradient over that axis
# inside the loop: n all-reduces instead of one. Here the backward pass of each ring
# is the other ring (as in Megatron sequence parallelism), and the weight gradient
# is one matmul against the gathered operand, after the loop.


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _ag_matmul(x: Array, w: Array, axis_name: str, axis: int, bidirectional: bool) -> Array:
    return _ag_ring(x, functools.partial(_dot, w=w), axis_name, axis, bidirectional, keep_x=False)[0]


def _ag_matmul_fwd(x: Array, w: Array, axis_name: str, axis: int, bidirectional: bool) -> tuple:
    out, xs = _ag_ring(x, functools.partial(_dot, w=w), axis_name, axis, bidirectional, keep_x=True)
    return out, (xs, w)


def _ag_matmul_bwd(axis_name: str, axis: int, bidirectional: bool, res: tuple, ct: Array) -> tuple:
    xs, w = res
    dx = _rs_ring(ct, functools.partial(_dot, w=w.T), axis_name, axis, bidirectional).astype(xs.dtype)
    dw = _contract_all_but_last(xs, ct).astype(w.dtype)
    return dx, dw


_ag_matmul.defvjp(_ag_matmul_fwd, _ag_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _matmul_rs(x: Array, w: Array, axis_name: str, axis: int, bidirectional: bool) -> Array:
    return _rs_ring(x, functools.partial(_dot, w=w), axis_name, axis, bidirectional)


def _matmul_rs_fwd(x: Array, w: Array, axis_name: str, axis: int, bidirectional: bool) -> tuple:
    return _rs_ring(x, functools.partial(_dot, w=w), axis_name, axis, bidirectional), (x, w)


def _matmul_rs_bwd(axis_name: str, axis: int, bidirectional: bool, res: tuple, ct: Array) -> tuple:
    x, w = res
    dx, cts = _ag_ring(ct, functools.partial(_dot, w=w.T), axis_name, axis, bidirectional, keep_x=True)
    dw = _contract_all_but_last(x, cts).astype(w.dtype)
    return dx.astype(x.dtype), dw


_matmul_rs.defvjp(_matmul_rs_fwd, _matmul_rs_bwd)


def _identity(x: Array) -> Array:
    return x


# Plain ring all-gather / reduce-scatter: what `all_gather` and `psum_scatter` run in
# a partial-manual region (see `_automatic_axes_split`). Each is the other's
# transpose, so the backward pass stays a ring too.


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _ring_all_gather(x: Array, axis_name: str, axis: int) -> Array:
    return _ag_ring(x, _identity, axis_name, axis, False, keep_x=False)[0]


def _ring_all_gather_fwd(x: Array, axis_name: str, axis: int) -> tuple[Array, None]:
    return _ring_all_gather(x, axis_name, axis), None


def _ring_all_gather_bwd(axis_name: str, axis: int, _: None, ct: Array) -> tuple[Array]:
    return (_rs_ring(ct, _identity, axis_name, axis, False),)


_ring_all_gather.defvjp(_ring_all_gather_fwd, _ring_all_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _ring_psum_scatter(x: Array, axis_name: str, axis: int) -> Array:
    return _rs_ring(x, _identity, axis_name, axis, False)


def _ring_psum_scatter_fwd(x: Array, axis_name: str, axis: int) -> tuple[Array, None]:
    return _ring_psum_scatter(x, axis_name, axis), None


def _ring_psum_scatter_bwd(axis_name: str, axis: int, _: None, ct: Array) -> tuple[Array]:
    return (_ag_ring(ct, _identity, axis_name, axis, False, keep_x=False)[0],)


_ring_psum_scatter.defvjp(_ring_psum_scatter_fwd, _ring_psum_scatter_bwd)


def _automatic_axes_split() -> bool:
    # In a partial-manual shard_map (some mesh axes automatic), XLA 0.10 partitions
    # an all-gather or reduce-scatter over a manual axis by first gathering every
    # dimension the automatic axes split: the batch, sharded over an automatic
    # `data`, would be gathered, and every device would then compute on the whole
    # batch. ppermute (and psum) keep those dimensions split, so there the same
    # collective runs as a ring of ppermutes, which moves the same bytes.
    mesh = jax.sharding.get_abstract_mesh()
    manual = set(mesh.manual_axes)
    return bool(manual) and any(size > 1 for name, size in mesh.shape.items() if name not in manual)


def all_gather_matmul(
    x: Float[Array, "*shape d_in"],
    w: Float[Array, "_d_in d_out"],
    *,
    axis_name: str,
    axis: int = 0,
    bidirectional: bool = False,
) -> Float[Array, "... d_out"]:
    """`all_gather(x, axis) @ w`, computed as a ring of `ppermute`s.

    Each device holds one block of a dimension `axis` of `x` that is split over
    `axis_name` (e.g. the sequence), and a local weight `w` (e.g. a column-parallel
    shard). Instead of gathering `x` first, the blocks travel round the ring and
    each is multiplied as it passes, so a block's transfer overlaps the previous
    block's matmul. Bytes moved: `n-1` blocks of `x`, as a ring all-gather. The
    backward pass is the `matmul_reduce_scatter` ring for `x`'s gradient and one
    matmul against the gathered `x` for `w`'s; both equal the dense gradients.
    (A `jax.custom_vjp`: reverse mode only, as for `all_gather_mean_grad`.)

    **Arguments:**

    - `x`: this device's block, `(..., s, ..., d_in)`; `axis` indexes the split
      dimension (any but the last, which is contracted with `w`).
    - `w`: `(d_in, d_out)`.
    - `axis_name`: the manual mesh axis `x` is split over; `n` its size.
    - `axis`: the split dimension of `x`.
    - `bidirectional`: send half of the blocks each way round the ring: about
      `n/2` steps of two transfers instead of `n-1` steps of one, same bytes.

    **Returns:** `x.shape` with dimension `axis` multiplied by `n` and the last
    dimension `d_out`; block `j` along `axis` is device `j`'s `x @ w`.

    **Raises:** `SpecError` if `axis` is out of range or the last dimension, or
    `w.shape[0] != x.shape[-1]`; `AxisNameError` if `axis_name` is not manual here.

    ```python
    # sequence parallel -> column parallel: x (batch, seq/n, d), w (d, f/n)
    h = eqxpar.collectives.all_gather_matmul(x, w, axis_name="tensor", axis=1)
    # h: (batch, seq, f/n)
    ```
    """
    n, axis, x, w = _prepare_matmul(x, w, axis_name, axis, "all_gather_matmul", scatter=False)
    if n == 1:
        return _dot(x, w)
    return _ag_matmul(x, w, axis_name, axis, bidirectional)


def matmul_reduce_scatter(
    x: Float[Array, "*shape d_in"],
    w: Float[Array, "_d_in d_out"],
    *,
    axis_name: str,
    axis: int = 0,
    bidirectional: bool = False,
) -> Float[Array, "... d_out"]:
    """`psum_scatter(x @ w, axis)`, computed as a ring of `ppermute`s.

    Each device holds the full extent of dimension `axis` of `x` and a shard of the
    contraction dimension (e.g. a row-parallel layer's input and weight shard), so
    `x @ w` is one addend of the result. Instead of multiplying and then
    reduce-scattering, an accumulator for each output block travels round the ring,
    and every device adds its partial product for that block before passing it on;
    the partial product does not depend on the accumulator in flight, so the two
    overlap. Bytes moved: `n-1` output blocks, as a ring reduce-scatter. The
    backward pass is the `all_gather_matmul` ring for `x`'s gradient (gathering the
    cotangent on the way) and one matmul for `w`'s; both equal the dense gradients.
    (A `jax.custom_vjp`: reverse mode only.)

    **Arguments:**

    - `x`: `(..., S, ..., d_in_local)`, full size `S` along `axis` (any dimension but
      the last); `n` must divide `S`.
    - `w`: `(d_in_local, d_out)`.
    - `axis_name`: the manual mesh axis the contraction is split over; `n` its size.
    - `axis`: the dimension of the result to scatter.
    - `bidirectional`: give each output block two accumulators travelling in
      opposite directions: about `n/2` steps of two transfers instead of `n-1`
      steps of one, same bytes.

    **Returns:** `x.shape` with dimension `axis` divided by `n` and the last
    dimension `d_out`: this device's block of the sum over devices of `x @ w`.

    **Raises:** `SpecError` if `axis` is out of range or the last dimension, or
    `w.shape[0] != x.shape[-1]`; `DivisibilityError` if `n` does not divide
    `x.shape[axis]`; `AxisNameError` if `axis_name` is not manual here.

    ```python
    # row parallel -> sequence parallel: x (batch, seq, f/n), w (f/n, d)
    y = eqxpar.collectives.matmul_reduce_scatter(x, w, axis_name="tensor", axis=1)
    # y: (batch, seq/n, d)
    ```
    """
    n, axis, x, w = _prepare_matmul(x, w, axis_name, axis, "matmul_reduce_scatter", scatter=True)
    if n == 1:
        return _dot(x, w)
    return _matmul_rs(x, w, axis_name, axis, bidirectional)
