"""Per-device bytes of arrays laid out by partition specs, shared by the
advisor's memory model (`_predict`) and its offload terms (`_offload`)."""

from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from .._mesh import axis_size
from .._rules import mesh_axis_names
from .._sizes import nbytes
from .._specs import is_array_like


def split_count(spec: Any, mesh: Mesh, drop: frozenset[str] = frozenset()) -> int:
    """The devices of `mesh` an array with `spec` is split over (1 where `spec` is
    not a `PartitionSpec`), leaving out the axes in `drop`."""
    if not isinstance(spec, PartitionSpec):
        return 1
    axes = [a for e in spec for a in mesh_axis_names(e) if a not in drop]
    return axis_size(mesh, axes)


def per_device_bytes(tree: Any, specs: Any, mesh: Mesh, drop: frozenset[str] = frozenset()) -> int:
    """The bytes one device holds of the arrays of `tree` (arrays or outlines)
    laid out by `specs` (a tree like it, spec leaves), split as `split_count` says."""
    leaves = jax.tree.leaves(tree)
    flat = jax.tree.structure(tree).flatten_up_to(specs)
    pairs = zip(leaves, flat, strict=True)
    return sum(nbytes(x) // split_count(s, mesh, drop) for x, s in pairs if is_array_like(x))
