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

from collections.abc import Collection
from typing import Any

import jax
from jax import lax
from jax.sharding import PartitionSpec
from jaxtyping import Array, Shaped

from ._errors import PlanError
from ._rules import mesh_axis_names

#: `(dim, mesh axes)` pairs saying how one array is gathered.
Gather = tuple[tuple[int, tuple[str, ...]], ...]


def gather_weights(x: Shaped[Array, "..."], gather: Gather) -> Shaped[Array, "..."]:
    """All-gather the shard `x` along each `(dim, axes)` of `gather` (tiled), so that
    its gradient is reduce-scattered over those axes; `x` itself when `gather` is empty."""
    if not gather:
        return x
    for dim, axes in gather:
        x = lax.all_gather(x, axes, axis=dim, tiled=True)
    return x


def gathers_of(spec: PartitionSpec | None, axes: Collection[str], *, skip: int = 0, where: str) -> Gather:
    """The gathers that make an array with `spec` whole along the manual `axes`.

    `skip` leading dimensions (a stack's layer dimension) are dropped from the
    dims, and must not be split over `axes`.
    """
    if spec is None:
        return ()
    out = []
    for dim, entry in enumerate(spec):
        names = mesh_axis_names(entry)
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


def gathered_axes(spec: PartitionSpec | None, axes: Collection[str]) -> frozenset[str]:
    """The manual `axes` that `spec` splits (the gradient is reduce-scattered there)."""
    if spec is None:
        return frozenset()
    return frozenset(a for entry in spec for a in mesh_axis_names(entry) if a in axes)


def gather_whole(params: Any, specs: Any, axes: Collection[str]) -> Any:
    """`params` (floating-point leaves, None elsewhere) with every shard over the
    manual `axes` gathered whole, stacks included (their layer dimension too).

    Gradient accumulation gathers once this way, before its micro-batch loop, so
    that the gradients are reduce-scattered once, after it (the gather's
    transpose), rather than once per micro-batch.
    """
    return jax.tree.map(
        lambda x, spec: (
            x if x is None else gather_weights(x, gathers_of(spec, axes, where=f"a weight of shape {x.shape}"))
        ),
        params,
        specs,
        is_leaf=lambda x: x is None,
    )


def prepare_model(model: Any, specs: Any, axes: Collection[str]) -> Any:
    """The per-device model with its FSDP shards made whole where used: leaves
    outside scanned stacks gathered now, stacks told how to gather each layer."""
    from .nn._stack import Stacked

    def is_array_leaf(x: Any) -> bool:
        return hasattr(x, "shape") and hasattr(x, "dtype")

    def visit(node: Any, spec: Any) -> Any:
        if isinstance(node, Stacked):
            leaves = [x for x in jax.tree.leaves(node.blocks) if is_array_leaf(x)]
            spec_leaves = jax.tree.leaves(spec.blocks, is_leaf=lambda s: isinstance(s, PartitionSpec))
            if len(leaves) != len(spec_leaves):
                raise PlanError(
                    "a manual FSDP step could not match a Stacked module's arrays with their specs; "
                    "keep only arrays and static settings in a stack's blocks."
                )
            gathers = tuple(
                gathers_of(s, axes, skip=1, where="a Stacked block's weight") for s in spec_leaves
            )
            return node.with_layer_gathers(gathers if any(gathers) else None)
        if is_array_leaf(node) and isinstance(spec, PartitionSpec):
            return gather_weights(node, gathers_of(spec, axes, where=f"a weight of shape {node.shape}"))
        return node

    return jax.tree.map(visit, model, specs, is_leaf=lambda x: isinstance(x, Stacked))
