"""Placing pytrees on a plan's mesh: `shard`, `shard_batch`, `annotate`."""

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, PyTree

from ._batch_layout import BatchLayout
from ._errors import BatchError, PlanError
from ._plan import Plan, current_plan
from ._specs import check_spec, drop_axes, is_array_like, partition_specs
from ._stack_order import in_plan_order


def _manual_axes() -> frozenset[str]:
    return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def _place(x: Any, spec: PartitionSpec, mesh: Mesh, *, where: str, may_alias: bool = True) -> Any:
    if isinstance(x, jax.core.Tracer):
        manual = _manual_axes()
        if manual:
            # Inside shard_map the manual axes are already split by hand (shapes
            # are per device along them); only the automatic axes can still be
            # constrained.
            spec = drop_axes(spec, manual)
            if all(e is None for e in spec) or manual >= set(mesh.axis_names):
                return x
            check_spec(spec, tuple(x.shape), mesh, where=where)
            return jax.lax.with_sharding_constraint(x, spec)
        check_spec(spec, tuple(x.shape), mesh, where=where)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))
    check_spec(spec, tuple(x.shape), mesh, where=where)
    if isinstance(x, jax.ShapeDtypeStruct):
        # An outline (a state or batch compiled from shapes): placing it is giving
        # it the sharding; nothing is allocated.
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, spec), weak_type=x.weak_type
        )
    placed = jax.device_put(x, NamedSharding(mesh, spec), may_alias=may_alias)
    if may_alias or not shares_buffer(placed, x):
        return placed
    # `may_alias=False` is not kept by JAX everywhere: placing a one-device array
    # on a replicated sharding reuses its buffer as that device's copy (jax
    # 0.10.2), and a donating step would then delete the caller's array.
    return _copy(placed)


# A jit output never aliases an input that is not donated: a fresh buffer per shard.
_copy = jax.jit(jax.numpy.copy)


def shares_buffer(a: Any, b: Any) -> bool:
    """Whether jax arrays `a` and `b` hold any device buffer in common (True when
    the backend cannot say: the safe answer for a caller that copies on True)."""
    if not (isinstance(a, jax.Array) and isinstance(b, jax.Array)):
        return False
    try:
        pointers = {s.data.unsafe_buffer_pointer() for s in b.addressable_shards}
        return any(s.data.unsafe_buffer_pointer() in pointers for s in a.addressable_shards)
    except (NotImplementedError, RuntimeError):  # a backend without buffer pointers
        return True


def named_shardings(tree: PyTree, plan: Plan) -> PyTree:
    """The `NamedSharding` of every array leaf of `tree` under `plan` (None elsewhere)."""
    return shardings_of(partition_specs(tree, plan), plan.mesh)


#: The memory kind of host memory the device can read and write directly
#: (`Plan(offload=...)` keeps offloaded arrays there).
HOST_MEMORY = "pinned_host"


def in_memory(shardings: PyTree, kind: str | None) -> PyTree:
    """`shardings` (NamedShardings, None elsewhere) in memory `kind` (None: as they are)."""
    if kind is None:
        return shardings
    return jax.tree.map(
        lambda s: None if s is None else s.with_memory_kind(kind),
        shardings,
        is_leaf=lambda s: isinstance(s, NamedSharding) or s is None,
    )


def shardings_of(specs: PyTree, mesh: Mesh) -> PyTree:
    """`specs` (PartitionSpecs, None elsewhere) as NamedShardings on `mesh`."""
    return jax.tree.map(
        lambda s: None if s is None else NamedSharding(mesh, s),
        specs,
        is_leaf=lambda s: isinstance(s, PartitionSpec) or s is None,
    )


def shard(tree: PyTree, plan: Plan, specs: PyTree | None = None, *, copy: bool = True) -> PyTree:
    """Place `tree` on the plan's mesh: `device_put` outside jit, a sharding
    constraint inside jit (and only on the automatic axes inside `shard_map`).

    Non-array leaves (activation functions, static settings) are returned as they
    are, so an Equinox model goes in and an Equinox model comes out. Every
    `eqxpar.nn.Stacked` in `tree` is first stored in the order the plan runs it
    in (`Plan.stack_order`; a pipeline's order for interleaved or uneven stages),
    from whatever order it records, so no user code reorders layers.

    **Arguments:**

    - `tree`: any pytree, typically a model, optimizer state or batch.
    - `plan`: the plan whose mesh and rules give each leaf's spec.
    - `specs`: optional PartitionSpecs instead of the rules: one `PartitionSpec` for
      every leaf, or a pytree of them matching `tree`'s array leaves.

    - `copy`: outside jit, always give new buffers (default), so that donating the
      result (an eqxpar step donates its state) never deletes an array the caller
      still holds. `copy=False` lets an array that already has its sharding come
      back as it is (for inputs that are never donated, such as batches).

    **Returns:** a pytree of the same structure.

    ```python
    model = eqxpar.shard(model, plan)        # weights placed per the plan's rules
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"shard(..., plan={plan!r}): expected an eqxpar.Plan.")
    tree = in_plan_order(tree, plan)
    if specs is None:
        specs = partition_specs(tree, plan)
    elif not isinstance(specs, PartitionSpec):
        specs = in_plan_order(specs, plan)
    return place_tree(tree, plan.mesh, specs, copy=copy)


def place_tree(tree: PyTree, mesh: Mesh, specs: PyTree, *, copy: bool = True) -> PyTree:
    """`shard` without the layer order and the rules: `tree` placed as `specs` say
    (one `PartitionSpec` for every leaf, or a pytree of them) on `mesh`. The steps
    place their model, gradients, optimizer state and batch with it, already in
    the plan's order. `copy` as `shard`'s."""
    if isinstance(specs, PartitionSpec):
        spec = specs
        specs = jax.tree.map(lambda x: spec if is_array_like(x) else None, tree)
    leaves, treedef = jax.tree.flatten(tree)
    spec_leaves = treedef.flatten_up_to(specs)
    out = []
    for leaf, spec in zip(leaves, spec_leaves, strict=True):
        if spec is None or not is_array_like(leaf):
            out.append(leaf)
            continue
        out.append(
            _place(leaf, spec, mesh, where=f"shard: array of shape {tuple(leaf.shape)}", may_alias=not copy)
        )
    return jax.tree.unflatten(treedef, out)


def check_batch(batch: PyTree, layout: BatchLayout, *, microbatches: int = 1) -> int:
    """Check every batch leaf splits over the data-parallel devices of `layout`
    (and into `microbatches`); return the batch size."""
    sizes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
        if not is_array_like(leaf):
            continue
        where = jax.tree_util.keystr(path) or "<root>"
        if len(leaf.shape) == 0:
            raise BatchError(
                f"batch leaf {where} is a scalar; every batch leaf needs a leading batch "
                "dimension. Close over constants in the loss function instead."
            )
        sizes.add(leaf.shape[0])
        if len(sizes) > 1:
            raise BatchError(
                f"batch leaves have different leading (batch) sizes {sorted(sizes)}; "
                "every leaf of a batch must have the same batch size."
            )
    if not sizes:
        raise BatchError("the batch has no array leaves; pass arrays with a leading batch dimension.")
    (size,) = sizes
    if size == 0:
        raise BatchError(
            "the batch is empty (leading dimension 0): a mean over no examples is NaN. Pass at least "
            f"{layout.blocks * max(microbatches, 1)} examples (a multiple of the data-parallel size)."
        )
    if microbatches < 1:
        raise BatchError(f"accumulate={microbatches} is not a valid micro-batch count; expected >= 1.")
    _check_split(size, layout, microbatches)
    return size


def _check_split(size: int, layout: BatchLayout, microbatches: int) -> None:
    """Raise unless a batch of `size` rows cuts into `microbatches` equal parts that
    each split over the data-parallel devices; the message names the batch size,
    what cut it, and the nearest sizes that work."""
    dp = layout.blocks
    if size % microbatches == 0 and (size // microbatches) % dp == 0:
        return
    devices = f"{dp} data-parallel devices (mesh axes {layout.axes})"
    multiple = dp * microbatches
    if microbatches == 1:
        raise BatchError(
            f"batch size {size} is not divisible by the {devices}. Use a batch size that is a "
            f"multiple of {multiple}{_nearest(size, multiple)}."
        )
    split = layout.split_by(microbatches)
    fix = (
        f"Use a batch size that is a multiple of {multiple} ({microbatches} micro-batches x {dp} "
        f"devices){_nearest(size, multiple)}"
    )
    fix += _counts(size, dp, microbatches)
    if size % microbatches:
        raise BatchError(
            f"batch size {size} is not divisible by the {microbatches} micro-batches of {split}. {fix}."
        )
    raise BatchError(
        f"batch size {size}, cut into the {microbatches} micro-batches of {split}, gives micro-batches "
        f"of {size // microbatches} rows, which are not divisible by the {devices}. {fix}."
    )


def _counts(size: int, dp: int, microbatches: int) -> str:
    """The micro-batch counts nearest `microbatches` that fit a batch of `size`
    rows on `dp` devices, as a clause of an error message ("" if none)."""
    fits = [k for k in range(1, size + 1) if size % k == 0 and (size // k) % dp == 0]
    below = [k for k in fits if k < microbatches][-1:]
    above = [k for k in fits if k > microbatches][:1]
    near = " or ".join(map(str, below + above))
    return f"; or a micro-batch count that fits it ({near})" if near else ""


def _nearest(size: int, multiple: int) -> str:
    """The multiples of `multiple` nearest `size`, as a clause of an error message."""
    below = size // multiple * multiple
    above = below + multiple
    return f": the nearest are {below} and {above}" if below else f": the nearest is {above}"


def shard_batch(batch: PyTree, plan: Plan) -> PyTree:
    """Split every leaf's leading (batch) dimension over the plan's batch axes.

    **Raises:** `BatchError` when the batch size is not a multiple of the
    data-parallel size.

    ```python
    x, y = eqxpar.shard_batch((x, y), plan)
    ```
    """
    if not isinstance(plan, Plan):
        raise PlanError(f"shard_batch(..., plan={plan!r}): expected an eqxpar.Plan.")
    layout = BatchLayout.of(plan)
    check_batch(batch, layout)
    return place_tree(batch, plan.mesh, layout.spec, copy=False)


def annotate(x: ArrayLike, name: str) -> Array:
    """Constrain an activation to the sharding the current plan gives `name`.

    A no-op when no plan is active or the plan has no such annotation, so a model
    can be annotated once and still run on one device. Inside a `shard_map` the
    manual axes are dropped from the constraint.

    **Arguments:**

    - `x`: an activation, inside or outside jit.
    - `name`: an annotation name registered in the plan (`"batch"`,
      `"activations"`, or any name given in `Plan(annotations=...)`).

    **Returns:** `x`, constrained.

    ```python
    h = eqxpar.annotate(h, "activations")
    ```
    """
    plan = current_plan()
    if plan is None:
        return x
    spec = plan.annotation(name)
    if spec is None:
        return x
    if not hasattr(x, "shape"):
        x = jax.numpy.asarray(x)
    return _place(x, spec, plan.mesh, where=f"annotate(x, {name!r})")
