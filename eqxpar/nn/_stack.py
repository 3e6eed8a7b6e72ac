"""A stack of identical blocks stored once and run with `lax.scan`."""

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from jaxtyping import PRNGKeyArray, PyTree

from .._casting import cast_floating
from .._errors import PlanError
from .._fsdp import gather_weights, layer_gathers_for
from .._mesh import mesh_platform
from .._parallel_dims import ParallelDims
from .._param import stacked
from .._plan import current_plan
from .._remat import RematPolicy
from .._stack_order import OrderedStack, StackOrder
from .._varying import mark_varying, varying_axes

#: The collectives that sum over devices (`lax.psum` and `lax.psum_scatter`'s primitives).
_SUMS = frozenset({"psum", "psum_invariant", "reduce_scatter"})


def _checkpoint(fn: Callable, policy: Any) -> Callable:
    if isinstance(policy, RematPolicy):
        # Only what the policy names is kept (or moved to host memory): no
        # gathered weight is named, so none is kept.
        return jax.checkpoint(fn, policy=policy.checkpoint_policy(), prevent_cse=False)
    if policy == "none":
        # Under manual FSDP this keeps each layer's gathered weights for the
        # backward pass (one gather per step, like GSPMD); any other policy
        # gathers them again there, so no layer stays whole between the passes.
        return fn
    base = (
        jax.checkpoint_policies.checkpoint_dots
        if policy == "dots"
        else jax.checkpoint_policies.nothing_saveable
    )

    def policy_fn(prim, *args, **params):
        # Never keep a gathered weight (a dot of two weights would be one).
        if prim.name == "all_gather":
            return False
        # A matmul summed over devices (a row-parallel layer's output) is kept like
        # the matmul: recomputing it in the backward pass would run its all-reduce or
        # reduce-scatter a second time.
        if policy == "dots" and prim.name in _SUMS:
            return True
        return base(prim, *args, **params)

    return jax.checkpoint(fn, policy=policy_fn, prevent_cse=False)


class Stacked(OrderedStack):
    """`depth` identical blocks stored as one module and applied in order with
    `lax.scan`, so compile time does not grow with depth.

    Every array of `blocks` has a leading layer dimension, named `"layers"` for the
    rules (unsharded unless a rule maps it); `rules.FSDP` never splits it. The
    active plan's `remat` decides what the scan keeps for the backward pass.

    **Arguments:**

    - `make_block`: `make_block(key) -> block`, called once under `eqx.filter_vmap`
      to build all blocks at once; a block maps `(x, *args) -> x` (same shape), or
      `(x, *args) -> (x, aux)` with `aux` any pytree of arrays (e.g. an MoE block's
      `MoEAux`).
    - `depth`: number of blocks (keyword-only).
    - `unroll`: how many layers one iteration of the scan runs (keyword-only,
      `lax.scan`'s `unroll`; `True`: all of them, no loop; stored as that number,
      so that `True` and `1` do not compare equal as static fields and share a
      compiled program). Compile time grows with it. A short stack may run faster
      unrolled on a GPU: a pipeline stage of two wide blocks (d 1024, 4 x 1024
      tokens) ran its backward with recomputation in 6.1 ms unrolled against 9.8 ms
      scanned on an H200 (BENCHMARKS.md).
    - `key`: PRNG key (keyword-only).

    Calling the stack applies block 0, then 1, ...: `stack(x, *args, **kwargs)`
    passes the extra arguments to every block unchanged, except `key=`: that is
    split into one key per layer (`jax.random.split(key, depth)`, scanned with the
    layers) and block `i` gets `key=keys[i]` if its `__call__` takes `key`.

    A pipeline plan may store the rows in its own order (`Plan.stack_order`:
    interleaved chunks, uneven stages with padding rows); `order` records it (None:
    natural order, row `i` = layer `i`), `depth` counts the stored rows and
    `layers` the layers. Calling a stack stored that way, or indexing it, still
    goes through the layers in natural order; `eqxpar.nn.in_natural_order` gives
    the natural storage back.

    Blocks that return `(x, aux)` (an output whose structure is not the input's,
    a pair whose first part is) make the stack return `(y, aux)`, every leaf of
    `aux` stacked over a leading `depth` dimension (layer `i`'s at index `i`); only
    `x` is carried from layer to layer. A block that returns the structure it was
    given (e.g. a tuple carry) is carried whole, as before.

    ```python
    config = eqxpar.nn.BlockConfig(eqxpar.nn.AttentionConfig(4))
    stack = eqxpar.nn.Stacked(lambda k: eqxpar.nn.TransformerBlock(64, 256, config, key=k),
                              depth=8, key=key)
    y = stack(x)                                   # x: (batch, seq, 64)
    moe_config = dataclasses.replace(config, moe=eqxpar.nn.MoEConfig(8))
    moe = eqxpar.nn.Stacked(lambda k: eqxpar.nn.TransformerBlock(64, 256, moe_config, key=k),
                            depth=8, key=key)
    y, aux = moe(x)                                # aux.expert_load: (8, 8) = (layers, experts)
    ```
    """

    blocks: PyTree = stacked(leading=("layers",))
    depth: int = eqx.field(static=True)
    unroll: int = eqx.field(static=True, default=1)
    # How the rows are stored: None is natural order (row i = layer i); a
    # pipeline plan stores some stacks permuted and padded (`Plan.stack_order`).
    # Recorded here so that every way out can give the natural order back.
    order: StackOrder | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        make_block: Callable[[PRNGKeyArray], Any],
        *,
        depth: int,
        unroll: int | bool = 1,
        key: PRNGKeyArray,
    ):
        if not isinstance(depth, int) or depth < 1:
            raise PlanError(f"Stacked(depth={depth!r}): expected a positive integer number of blocks.")
        self.unroll = _layers_per_iteration(unroll, depth)
        self.blocks = eqx.filter_vmap(make_block)(jax.random.split(key, depth))
        self.depth = depth
        self.order = None

    @classmethod
    def from_blocks(cls, blocks: Sequence[Any], *, unroll: int | bool = 1) -> "Stacked":
        """Stack already-built blocks of one structure (e.g. to convert a model
        that keeps a list of layers); `unroll` as in `Stacked`."""
        blocks = list(blocks)
        if not blocks:
            raise PlanError("Stacked.from_blocks([]): give at least one block.")
        structures = {jax.tree.structure(eqx.filter(b, eqx.is_array)) for b in blocks}
        if len(structures) != 1:
            raise PlanError(
                "Stacked.from_blocks: the blocks differ in structure; a stack needs identical "
                "blocks (same class, same shapes, same static settings)."
            )
        arrays = [eqx.filter(b, eqx.is_array) for b in blocks]
        static = eqx.filter(blocks[0], eqx.is_array, inverse=True)
        stacked_arrays = jax.tree.map(lambda *xs: jnp.stack(xs), *arrays)
        obj = object.__new__(cls)
        object.__setattr__(obj, "blocks", eqx.combine(stacked_arrays, static))
        object.__setattr__(obj, "depth", len(blocks))
        object.__setattr__(obj, "unroll", _layers_per_iteration(unroll, len(blocks)))
        object.__setattr__(obj, "order", None)
        return obj

    @property
    def layers(self) -> int:
        """Number of layers (`depth` counts stored rows, padding included)."""
        return self.depth if self.order is None else self.order.layers

    def __getitem__(self, index: int) -> Any:
        """Block `index` (in the natural order, whatever the storage order) as an
        ordinary module."""
        if self.order is not None:
            index = int(self.order.natural_rows()[index])
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda x: x[index], arrays), static)

    def casts_per_layer(self) -> bool:
        """True: a step with a compute dtype (`Plan(compute_dtype=...)`) leaves this
        stack's weights in their own dtype and the stack casts each layer's inside
        its loop, so no cast copy of the whole stack (nor its gradient in the
        compute dtype) is ever held."""
        return True

    def with_rows(self, blocks: PyTree) -> "Stacked":
        """This stack (its settings) holding `blocks` instead, read as consecutive
        layers in natural order (e.g. one pipeline stage's rows)."""
        out = eqx.tree_at(lambda s: s.blocks, self, blocks, is_leaf=lambda x: x is None)
        rows = [x.shape[0] for x in jax.tree.leaves(blocks) if hasattr(x, "shape") and x.ndim]
        object.__setattr__(out, "depth", rows[0] if rows else self.depth)
        object.__setattr__(out, "order", None)
        return out

    def stored_in(self, order: StackOrder | None) -> "Stacked":
        """This stack's layers stored in `order` (None: natural order), from
        whatever order they are stored in now: one gather of the rows (padding
        rows are zeros). Works on a stack of weights, of their gradients, of
        optimizer moments, of `jax.ShapeDtypeStruct`s or of PartitionSpecs (only
        the arrays move)."""
        if order == self.order:
            return self
        if order is not None and order.layers != self.layers:
            raise PlanError(
                f"a stack of {self.layers} layers cannot be stored in {order.describe()}, which holds "
                f"{order.layers} layers. Build the plan's stage_layers for this stack."
            )
        current = np.arange(self.layers) if self.order is None else self.order.natural_rows()
        target = np.arange(self.layers) if order is None else order.rows()
        source = np.where(target >= 0, current[np.maximum(target, 0)], 0)
        pad = np.nonzero(target < 0)[0]

        def move(x: Any) -> Any:
            if isinstance(x, jax.ShapeDtypeStruct):
                return jax.ShapeDtypeStruct((len(target), *x.shape[1:]), x.dtype)
            if not eqx.is_array(x):
                return x
            out = x[source]
            return out.at[pad].set(0) if len(pad) else out

        out = eqx.tree_at(
            lambda s: s.blocks, self, jax.tree.map(move, self.blocks), is_leaf=lambda x: x is None
        )
        object.__setattr__(out, "depth", len(target))
        object.__setattr__(out, "order", order)
        return out

    def __call__(self, x: PyTree, *args: Any, **kwargs: Any) -> PyTree:
        key = kwargs.pop("key", None)
        plan = current_plan()
        dims = None if plan is None else ParallelDims.of(plan)
        policy, compute_dtype = ("none", None) if dims is None else (dims.remat, dims.compute_dtype)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)
        # The step left the stack's weights in host memory (Plan(offload=("params",))
        # off XLA:CPU, outside pipelines); each layer's slice comes over below.
        offloaded = dims is not None and dims.streams_stacked_params_on(mesh_platform(plan.mesh))
        # Under a manual FSDP step: how each array of a layer is all-gathered in
        # the scanned body (one layer's weights whole at a time; the gather's
        # transpose reduce-scatters the gradient). Set by the step around the loss.
        gathers = layer_gathers_for(jax.tree.leaves(arrays))
        if self.order is not None:
            # Stored in a pipeline's order (e.g. a model taken out of a pipeline
            # plan's state): run the layers in their natural order all the same.
            arrays = jax.tree.map(lambda x: x[self.order.natural_rows()], arrays)

        if key is not None and not _accepts_key(self.blocks):
            key = None

        # XLA:CPU runs independent collectives of a loop body concurrently: fence a
        # layer's FSDP gathers (and, transposed, its reduce-scatters) off from the
        # block's own collectives over other axes, or the simulated devices can
        # start them in different orders and wait on each other for ever.
        fence = gathers is not None and plan is not None and mesh_platform(plan.mesh) == "cpu"

        def layer(h, params):
            if key is not None:
                params, layer_key = params
            params = _onto_device(params) if offloaded else params
            # This layer's weights only, before any gather: the step leaves a
            # stack's weights in their dtype (see casts_per_layer).
            params = params if compute_dtype is None else cast_floating(params, compute_dtype)
            if gathers is not None:
                leaves, treedef = jax.tree.flatten(params)
                leaves = [gather_weights(x, g) for x, g in zip(leaves, gathers, strict=True)]
                if fence:
                    h = _wait_for(h, leaves)
                params = jax.tree.unflatten(treedef, leaves)
            block = eqx.combine(params, static)
            if key is not None:
                return block(h, *args, key=layer_key, **kwargs)
            return block(h, *args, **kwargs)

        layer = _checkpoint(layer, "inputs" if policy == "full" else policy)

        carry = jax.tree.structure(x)

        split = _saved_input_split(None if plan is None else plan.mesh, dims)

        def body(h, p):
            # The layer's checkpoint saves its input `h`: kept split over the tensor
            # axis, and its output handed on split, the row-parallel sum that ends a
            # block becomes a reduce-scatter and the next block all-gathers.
            h, aux = _carried(layer(split(h), p), carry)
            return split(h), aux

        def run(h, arrays):
            try:
                h, aux = jax.lax.scan(body, h, arrays, unroll=self.unroll)
            except TypeError as e:
                if "carry" not in str(e):
                    raise
                raise PlanError(
                    "a block of this eqxpar.nn.Stacked returns an activation that differs between "
                    "devices along a manual mesh axis along which its input does not (JAX: the scan's "
                    f"carry types differ: {str(e).splitlines()[0][:200]}). Under "
                    "Plan(sequence_parallel=True) in a manual step the stack's input must be this "
                    "device's sequence block: pass the input through eqxpar.nn.split_sequence (or an "
                    "eqxpar.nn.Embedding), and reduce per-token losses with eqxpar.nn.sequence_mean."
                ) from e
            return h if aux is None else (h, aux)

        if policy == "full":
            run = _checkpoint(run, "inputs")
        if key is not None:
            return run(x, (arrays, jax.random.split(key, self.layers)))
        return run(x, arrays)


def _onto_device(params: PyTree) -> PyTree:
    """One layer's weights moved from host memory onto the device, in the scan's
    body: the passes hold one layer's weights there, not the stack's (the
    transfer's transpose sends the layer's gradient back to host memory)."""
    return jax.tree.map(lambda w: jax.device_put(w, jax.memory.Space.Device), params)


def _carried(out: PyTree, carry: Any) -> tuple[PyTree, PyTree]:
    """A block's output as (carried activation, aux or None), for an input of
    structure `carry`."""
    if jax.tree.structure(out) == carry:
        return out, None
    if isinstance(out, tuple) and len(out) == 2 and jax.tree.structure(out[0]) == carry:
        # (h, aux): carry h, and let the scan stack aux over the layers.
        return out
    raise PlanError(
        "a block of this eqxpar.nn.Stacked returned a value of structure "
        f"{jax.tree.structure(out)} for an input of structure {carry}; expected the input's "
        "structure (the carried activation) or a pair (activation, aux) whose first part has "
        "it. Return the activation, or (activation, aux)."
    )


def _saved_input_split(mesh: Any, dims: ParallelDims | None) -> Callable[[PyTree], PyTree]:
    """What the stack applies to its carry at each layer boundary: under a plan
    whose `split_saved_inputs` holds, constrain every `(batch, ..., features)` leaf
    to the batch axes and the tensor axis along the features (leaves that do not
    divide are left alone); otherwise nothing."""
    if dims is None or not dims.split_saved_inputs or jax.sharding.get_abstract_mesh().manual_axes:
        return lambda h: h
    batch, tensor, blocks = dims.batch_axes, dims.tensor_axis, dims.batch_size_multiple

    def constrain(x: Any) -> Any:
        if not isinstance(x, jax.core.Tracer) or x.ndim < 3:
            return x
        if x.shape[0] % blocks or x.shape[-1] % dims.tensor_size:
            return x
        spec = PartitionSpec(batch or None, *([None] * (x.ndim - 2)), tensor)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return lambda h: jax.tree.map(constrain, h)


def _layers_per_iteration(unroll: int | bool, depth: int) -> int:
    if isinstance(unroll, bool):
        return depth if unroll else 1
    if isinstance(unroll, int) and unroll >= 1:
        return unroll
    raise PlanError(
        f"Stacked(unroll={unroll!r}): expected a positive number of layers per scan iteration, "
        "or True to unroll the whole stack."
    )


def _accepts_key(block: Any) -> bool:
    """Whether calling `block` takes a `key=` argument."""
    try:
        params = inspect.signature(block).parameters.values()
    except (TypeError, ValueError):
        return True
    return any(
        p.kind is inspect.Parameter.VAR_KEYWORD
        or (p.name == "key" and p.kind is not inspect.Parameter.POSITIONAL_ONLY)
        for p in params
    )


def _zero_of(leaves: Sequence[jax.Array]) -> jax.Array:
    # A float32 zero that depends on the leaves: XLA keeps `x * 0` for floats
    # (0 * inf is NaN), so whatever adds it waits for them.
    return sum((x.reshape(-1)[0] * 0).astype(jnp.float32) for x in leaves)


def _wait_for(a: jax.Array, b: Sequence[jax.Array]) -> jax.Array:
    """`a`, made to wait for the arrays `b` (a data dependency, which XLA:CPU's
    executor respects, unlike an optimization barrier); backward, their cotangents
    wait for `a`'s. Only the arrays that vary over the same mesh axes as `a` are
    tied: adding a zero must change no type."""
    varying = tuple(varying_axes(x) for x in b)
    tied = tuple(v == varying_axes(a) for v in varying)
    # The arrays' shapes and dtypes travel as static arguments, not residuals: an
    # outline residual would be closed over as a constant where the stack runs
    # inside a `lax.switch` branch (a pipeline stage), which cannot be lowered.
    outline = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for x in b)
    return _after(a, list(b), tied, varying, outline) if any(tied) else a


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _after(a: jax.Array, b: list, tied: tuple[bool, ...], varying: tuple, outline: tuple) -> jax.Array:
    return a + _zero_of([x for x, t in zip(b, tied, strict=True) if t]).astype(a.dtype)


def _after_fwd(
    a: jax.Array, b: list, tied: tuple[bool, ...], varying: tuple, outline: tuple
) -> tuple[jax.Array, None]:
    return _after(a, b, tied, varying, outline), None


def _after_bwd(
    tied: tuple[bool, ...], varying: tuple, outline: tuple, _: None, ct: jax.Array
) -> tuple[jax.Array, list]:
    # Each cotangent has its array's type: zero, plus `ct`'s data-dependent zero
    # where tied, cast to the array's varying axes where not.
    zero = _zero_of([ct])
    cts = []
    for (shape, dtype), t, axes in zip(outline, tied, varying, strict=True):
        z = jnp.zeros(shape, dtype)
        cts.append(z + zero.astype(dtype) if t else mark_varying(z, axes))
    return ct, cts


_after.defvjp(_after_fwd, _after_bwd)
