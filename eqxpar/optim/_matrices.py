"""How Muon's matrices lie on the mesh, and which device orthogonalises each:
static facts, decided from shapes and specs before anything is traced.

A Muon leaf is a batch of matrices (`optax.contrib.MuonDimensionNumbers`: the
reduction and output dimensions make the matrix, every other dimension indexes
matrices, as optax's `vmap` does). Its spec splits some dimensions over mesh axes.
A split of a batch dimension (the layers of a stack over `pipe`, the experts over
`expert`) leaves every matrix whole on its device: nothing moves. A split of a
matrix dimension (FSDP, ZeRO-1, tensor parallelism) leaves each device a block of
every matrix; those matrices go whole to one owner among the devices that hold
their blocks, balanced by size, and only the orthogonalised blocks come back.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from jax.sharding import PartitionSpec

from .._errors import EqxparError
from .._rules import mesh_axis_names


def normalized_dims(shape: tuple[int, ...], dims: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`(reduction dims, output dims)` of a leaf of `shape` under `dims` (a
    `MuonDimensionNumbers` or None), as optax's Newton–Schulz reads them: a 2-D leaf
    is always the matrix `(0, 1)`; other ranks need dimension numbers."""
    if len(shape) == 2:
        return (0,), (1,)
    if dims is None:
        raise EqxparError(
            f"Muon was given a leaf of shape {shape} without dimension numbers; Newton-Schulz takes "
            "matrices. Pass muon_weight_dimension_numbers with a MuonDimensionNumbers(reduction_axis=..., "
            "output_axis=...) for it (e.g. (1, 2) for a stack of layers' matrices), or None to put it on AdamW."
        )
    as_tuple = lambda a: (a,) if isinstance(a, int) else tuple(a)  # noqa: E731
    reduction = tuple(a % len(shape) for a in as_tuple(dims.reduction_axis))
    output = tuple(a % len(shape) for a in as_tuple(dims.output_axis))
    if set(reduction) & set(output):
        raise EqxparError(
            f"Muon dimension numbers {dims} for a leaf of shape {shape} name dimensions "
            f"{sorted(set(reduction) & set(output))} as both reduction and output; give disjoint ones."
        )
    return reduction, output


@dataclasses.dataclass(frozen=True)
class MatrixLeaf:
    """One Muon leaf as each device holds it: `batch_dims` index its matrices,
    `matrix_dims` (reduction then output, optax's order) make each matrix,
    `splits[j]` are the mesh axes (size > 1, major first) that split matrix
    dimension `j`, and `local_shape` is one device's block of the leaf."""

    batch_dims: tuple[int, ...]
    matrix_dims: tuple[int, ...]
    rows: int
    local_shape: tuple[int, ...]
    splits: tuple[tuple[str, ...], ...]
    split_sizes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, shape: tuple[int, ...], dims: Any, spec: PartitionSpec, mesh_shape: dict) -> "MatrixLeaf":
        reduction, output = normalized_dims(shape, dims)
        matrix = reduction + output
        batch = tuple(d for d in range(len(shape)) if d not in matrix)
        entries = tuple(spec) + (None,) * (len(shape) - len(spec))
        axes = [tuple(a for a in mesh_axis_names(e) if mesh_shape[a] > 1) for e in entries]
        local = tuple(n // math.prod(mesh_shape[a] for a in axes[d]) for d, n in enumerate(shape))
        rows = math.prod(shape[d] for d in reduction)
        splits = tuple(axes[d] for d in matrix)
        sizes = tuple(tuple(mesh_shape[a] for a in s) for s in splits)
        return cls(batch, matrix, rows, local, splits, sizes)

    @property
    def axes(self) -> frozenset[str]:
        """The mesh axes the matrices are split over: the devices an owner gathers from."""
        return frozenset(a for s in self.splits for a in s)

    @property
    def local_matrix(self) -> tuple[int, ...]:
        """One device's block of one matrix, in the matrix dimensions' order."""
        return tuple(self.local_shape[d] for d in self.matrix_dims)

    @property
    def full_matrix(self) -> tuple[int, ...]:
        """One whole matrix, in the matrix dimensions' order."""
        return tuple(n * math.prod(s) for n, s in zip(self.local_matrix, self.split_sizes, strict=True))

    @property
    def count(self) -> int:
        """Matrices on each device (the product of its local batch dimensions)."""
        return math.prod(self.local_shape[d] for d in self.batch_dims)

    @property
    def piece(self) -> int:
        """Elements of one device's block of one matrix."""
        return math.prod(self.local_matrix)


@dataclasses.dataclass(frozen=True)
class OwnerGroup:
    """The matrices split over the same mesh axes, in one dtype, with their owners.

    `matrices[k] = (leaf, index)`: the `index`-th matrix of leaf `leaf` (a position
    in the list of Muon leaves). `owner[k]` is a linear index over `axes` (in their
    order, row-major, as `jax.lax.axis_index(axes)` numbers devices); `offset[k]`
    where its blocks sit in the owner's exchange row; `width` the longest row.
    """

    axes: tuple[str, ...]
    sizes: tuple[int, ...]
    matrices: tuple[tuple[int, int], ...]
    owner: tuple[int, ...]
    offset: tuple[int, ...]
    width: int

    @property
    def devices(self) -> int:
        return math.prod(self.sizes)

    def owned(self, device: int) -> list[int]:
        """The matrices `device` orthogonalises, in its row's order (by offset)."""
        return sorted((k for k, o in enumerate(self.owner) if o == device), key=lambda k: self.offset[k])


def owner_groups(
    leaves: Sequence[MatrixLeaf], dtypes: Sequence[Any], axis_order: Sequence[str]
) -> list[OwnerGroup]:
    """The exchange groups of `leaves` (those split over at least one axis), owners
    assigned largest matrix first to the least loaded device (by elements moved)."""
    keys: dict[tuple, list[int]] = {}
    for i, (leaf, dtype) in enumerate(zip(leaves, dtypes, strict=True)):
        if leaf.axes:
            axes = tuple(a for a in axis_order if a in leaf.axes)
            keys.setdefault((axes, str(dtype)), []).append(i)
    groups = []
    for (axes, _), members in keys.items():
        first = leaves[members[0]]
        size_of = {
            a: n
            for s, ns in zip(first.splits, first.split_sizes, strict=True)
            for a, n in zip(s, ns, strict=True)
        }
        sizes = tuple(size_of[a] for a in axes)
        matrices = tuple((i, b) for i in members for b in range(leaves[i].count))
        devices = math.prod(sizes)
        load, owner, offset = [0] * devices, [0] * len(matrices), [0] * len(matrices)
        for k in sorted(range(len(matrices)), key=lambda k: -leaves[matrices[k][0]].piece):
            d = min(range(devices), key=lambda d: load[d])
            owner[k], offset[k] = d, load[d]
            load[d] += leaves[matrices[k][0]].piece
        groups.append(OwnerGroup(axes, sizes, matrices, tuple(owner), tuple(offset), max(load)))
    return groups
