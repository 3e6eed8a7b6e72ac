"""Manual FSDP (ZeRO-3) inside `shard_map`: weights split over data-parallel axes
are all-gathered where they are used, and their gradients reduce-scattered by the
gather's transpose.

A weight whose spec splits a dimension over manual batch axes (`fsdp`, or `data`
too for full sharding) arrives in the region as a shard. Outside scanned stacks it
is gathered once, before the loss; inside an `eqxpar.nn.Stacked` each layer's
shards are gathered in the scanned body, so in the forward pass one layer's
weights are whole at a time. With the plan's `remat="none"` the gathered weights
are kept for the backward pass (one gather per weight and step, as GSPMD does);
with any other remat policy they are gathered again there, so no layer stays whole
between the passes (one more gather of the stack's weights).
"""

import contextlib
import contextvars
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Shaped

from ._collectives import wire_dtype
from ._errors import PlanError
from ._mesh import EXPERT_AXIS
from ._rules import mesh_axis_names
from ._specs import leaves_with_layout

#: `(dim, mesh axes)` pairs saying how one array is gathered.
Gather = tuple[tuple[int, tuple[str, ...]], ...]


def gather_weights(x: Shaped[Array, "..."], gather: Gather) -> Shaped[Array, "..."]:
    """All-gather the shard `x` along each `(dim, axes)` of `gather` (tiled), so that
    its gradient is reduce-scattered over those axes; `x` itself when `gather` is empty."""
    if not gather:
        return x
    dtype = x.dtype
    x = x.astype(wire_dtype(dtype))
    for dim, axes in gather:
        # One axis at a time, the minor first (a tiled gather over `(a, b)` is
        # the gather over `b`, then over `a`): the same bytes, and the TPU
        # compiler writes a gather over a group spanning several mesh axes of a
        # cut torus (fsdp x expert on v5p-128) as an all-reduce, twice the bytes.
        for axis in reversed(axes):
            x = lax.all_gather(x, axis, axis=dim, tiled=True)
    return x.astype(dtype)


def gathers_of(
    spec: PartitionSpec | None,
    axes: Collection[str],
    *,
    skip: int = 0,
    where: str,
    unsplit: Collection[str] = (),
) -> Gather:
    """The gathers that make an array with `spec` whole along the manual `axes`.

    `skip` leading dimensions (a stack's layer dimension) are dropped from the
    dims, and must not be split over `axes`. A dimension split over the `expert`
    axis alone is never gathered: it splits the experts of an MoE layer, each
    device keeping its own (the gradient is already whole there: the layer's
    all-to-alls bring every token of the expert group to them). A dimension
    split over `expert` beside other batch axes (`rules.EXPERT_FSDP`'s model
    dimension) is an FSDP split like any other, gathered over all of them.
    `unsplit` names mesh axes of size 1: beside others in an entry they split
    nothing, so they are neither gathered (a region leaves size-1 axes automatic)
    nor mixed with the manual ones (`rules.EXPERT_FSDP` on a mesh without `fsdp`).
    """
    if spec is None:
        return ()
    out = []
    for dim, entry in enumerate(spec):
        names = mesh_axis_names(entry)
        if names == (EXPERT_AXIS,):
            continue
        names = tuple(a for a in names if a not in unsplit)
        hit = tuple(a for a in names if a in axes)
        if not hit:
            continue
        if len(hit) != len(names):
            raise PlanError(
                f"{where}: spec {spec} splits dimension {dim} over {names}, mixing data-parallel "
                f"axes {hit} with other axes; a manual FSDP step gathers whole dimensions. Split the "
                "FSDP axes and the tensor axis over different dimensions (e.g. rules.MEGATRON_FSDP)."
            )
        if dim < skip:
            raise PlanError(
                f"{where}: spec {spec} splits the stack's layer dimension over {hit}; a manual FSDP "
                "step gathers a layer at a time, so split a weight dimension instead "
                "(rules.FSDP never splits the layer dimension)."
            )
        out.append((dim - skip, hit))
    return tuple(out)


def added_splits(spec: PartitionSpec | None, out_spec: PartitionSpec | None, axes: Collection[str]) -> Gather:
    """The `(dim, axes)` splits over the manual `axes` that `out_spec` (a ZeRO-1
    update's spec) adds to `spec` (the parameter's): where each device keeps only
    its slice of a gradient, reduce-scattered along `dim`.

    Unlike `gathers_of`, an `expert` axis counts here: ZeRO-1 splits the update of
    a weight replicated over `expert` (one outside the MoE layers) over it too, as
    over every batch axis.
    """
    if out_spec is None:
        return ()
    base = list(spec or PartitionSpec())
    out = []
    for dim, entry in enumerate(out_spec):
        before = set(mesh_axis_names(base[dim] if dim < len(base) else None))
        added = tuple(a for a in mesh_axis_names(entry) if a in axes and a not in before)
        if added:
            out.append((dim, added))
    return tuple(out)


def kept_axes(spec: PartitionSpec | None) -> frozenset[str]:
    """The mesh axes `spec` splits that a step keeps split rather than gathers
    (`expert`, where it splits a dimension alone: the experts): a gradient there
    is already whole, summed over nothing more."""
    if spec is None:
        return frozenset()
    return frozenset(EXPERT_AXIS for entry in spec if mesh_axis_names(entry) == (EXPERT_AXIS,))


def gathered_axes(spec: PartitionSpec | None, axes: Collection[str]) -> frozenset[str]:
    """The manual `axes` that `spec` splits (the gradient is reduce-scattered there)."""
    if spec is None:
        return frozenset()
    return frozenset(a for entry in spec for a in mesh_axis_names(entry) if a in axes)


def gather_whole(params: Any, specs: Any, axes: Collection[str], *, unsplit: Collection[str] = ()) -> Any:
    """`params` (floating-point leaves, None elsewhere) with every shard over the
    manual `axes` gathered whole, stacks included (their layer dimension too).

    Gradient accumulation gathers once this way, before its micro-batch loop, so
    that the gradients are reduce-scattered once, after it (the gather's
    transpose), rather than once per micro-batch. `unsplit`: the mesh's size-1
    axes (`gathers_of`).
    """
    return jax.tree.map(
        lambda x, spec: (
            x
            if x is None
            else gather_weights(
                x, gathers_of(spec, axes, where=f"a weight of shape {x.shape}", unsplit=unsplit)
            )
        ),
        params,
        specs,
        is_leaf=lambda x: x is None,
    )


# The per-layer gathers of the stacks of the model being differentiated, by the
# identity of each stack array (the traced value the stack will scan over). A
# scoped context rather than a field on the user's module: the step sets it
# around the loss, and `eqxpar.nn.Stacked` reads it in its scanned body.
_LAYER_GATHERS: contextvars.ContextVar[dict[int, Gather] | None] = contextvars.ContextVar(
    "eqxpar_layer_gathers", default=None
)


@contextlib.contextmanager
def layer_gathers(gathers: dict[int, Gather]) -> Iterator[None]:
    """Within the block, stacks whose arrays are keys of `gathers` (by `id`)
    all-gather each layer's slice of them as the value says."""
    token = _LAYER_GATHERS.set(gathers)
    try:
        yield
    finally:
        _LAYER_GATHERS.reset(token)


def layer_gathers_for(arrays: Sequence[Any]) -> tuple[Gather, ...] | None:
    """The per-layer gathers of a stack's `arrays` (leaf order), or None when no
    step registered them (no manual FSDP step, or not this model's stack)."""
    gathers = _LAYER_GATHERS.get()
    if not gathers:
        return None
    found = [gathers.get(id(x)) for x in arrays]
    if all(g is None for g in found):
        return None
    if any(g is None for g in found):
        raise PlanError(
            "a scanned stack (eqxpar.nn.Stacked) was called with some of its arrays replaced since the "
            "step prepared the model (e.g. by eqx.tree_at or a cast inside the loss), so a manual FSDP "
            "step cannot tell which layer shards to gather. Transform the weights inside the block, or "
            "use Plan(compute_dtype=...) for casts."
        )
    return tuple(found) if any(found) else None


def prepare_model(
    model: Any, specs: Any, axes: Collection[str], *, unsplit: Collection[str] = ()
) -> tuple[Any, dict[int, Gather]]:
    """The per-device model with its FSDP shards made whole where used, and the
    per-layer gathers of its stacks (for `layer_gathers`). `unsplit`: the mesh's
    size-1 axes (`gathers_of`).

    Leaves outside stacked fields (`eqxpar.stacked`, e.g. `eqxpar.nn.Stacked`) are
    gathered now; leaves inside are gathered a layer at a time by the stack's scan.
    """
    leaves, treedef = jax.tree.flatten(model)
    spec_leaves = treedef.flatten_up_to(specs)
    layout = [leading for _, _, _, leading in leaves_with_layout(model)]
    out, per_layer = [], {}
    for leaf, spec, leading in zip(leaves, spec_leaves, layout, strict=True):
        if not (hasattr(leaf, "shape") and isinstance(spec, PartitionSpec)):
            out.append(leaf)
        elif leading:
            per_layer[id(leaf)] = gathers_of(
                spec, axes, skip=1, where="a Stacked block's weight", unsplit=unsplit
            )
            out.append(leaf)
        else:
            where = f"a weight of shape {leaf.shape}"
            out.append(gather_weights(leaf, gathers_of(spec, axes, where=where, unsplit=unsplit)))
    return jax.tree.unflatten(treedef, out), per_layer
