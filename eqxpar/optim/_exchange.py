"""Muon's orthogonalisation over a mesh: each matrix gathered whole on its owner
only (one all-to-all), orthogonalised there, and its blocks sent back (another).

Runs inside one `jax.shard_map` over every mesh axis, on the update's shards as the
step laid them out (`eqxpar._update_layout`), so nothing is resharded on the way in
or out. Every device runs the same program: the owners differ only in which branch
of a `lax.switch` over their index along the group's axes they take, each branch
orthogonalising the matrices that device owns (`_matrices.OwnerGroup`).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec
from jaxtyping import Array

from ._matrices import MatrixLeaf, OwnerGroup, owner_groups

#: `orthogonalize(x, ns_coeffs, dimension_numbers) -> x`: optax's Newton–Schulz.
Orthogonalize = Callable[[Array, Array, Any], Array]


def _as_matrices(x: Array, leaf: MatrixLeaf) -> Array:
    """One device's block of a leaf as `(count, *local matrix dims)`."""
    return x.transpose(leaf.batch_dims + leaf.matrix_dims).reshape((leaf.count, *leaf.local_matrix))


def _from_matrices(y: Array, leaf: MatrixLeaf) -> Array:
    order = leaf.batch_dims + leaf.matrix_dims
    blocked = y.reshape(tuple(leaf.local_shape[d] for d in order))
    return blocked.transpose(np.argsort(order))


def _block_order(leaf: MatrixLeaf, group: OwnerGroup) -> list[int]:
    """The permutation from `(*group axes, *local matrix dims)` to, per matrix
    dimension, the axes that split it (major first) then its local block: the order
    in which the blocks of the devices tile the whole matrix."""
    order: list[int] = []
    for j, axes in enumerate(leaf.splits):
        order += [group.axes.index(a) for a in axes] + [len(group.axes) + j]
    return order


def _whole(blocks: Array, leaf: MatrixLeaf, group: OwnerGroup) -> Array:
    """`(devices, piece)` blocks of one matrix (in device order) -> the whole matrix."""
    tiled = blocks.reshape(group.sizes + leaf.local_matrix).transpose(_block_order(leaf, group))
    return tiled.reshape(leaf.full_matrix)


def _blocks(whole: Array, leaf: MatrixLeaf, group: OwnerGroup) -> Array:
    """The inverse of `_whole`."""
    order = _block_order(leaf, group)
    split_shape = tuple((group.sizes + leaf.local_matrix)[p] for p in order)
    return whole.reshape(split_shape).transpose(np.argsort(order)).reshape(group.devices, leaf.piece)


def _row(parts: list[Array], width: int, dtype: Any) -> Array:
    used = sum(p.shape[-1] for p in parts)
    pad = [jnp.zeros(parts[0].shape[:-1] + (width - used,), dtype)] if parts and used < width else []
    return jnp.concatenate(parts + pad, axis=-1) if parts else jnp.zeros((width,), dtype)


def _owner_branch(
    device: int,
    group: OwnerGroup,
    leaves: Sequence[MatrixLeaf],
    orthogonalize: Orthogonalize,
    recv: Array,
    coeffs: Array,
) -> Array:
    """What owner `device` does: assemble each matrix it owns from every device's
    block (`recv` row s: device s's blocks), orthogonalise it whole, and lay its
    blocks out per device for the way back."""
    columns = []
    for k in group.owned(device):
        leaf = leaves[group.matrices[k][0]]
        start = group.offset[k]
        whole = _whole(recv[:, start : start + leaf.piece], leaf, group)
        matrix = whole.reshape(leaf.rows, -1)
        done = orthogonalize(matrix, coeffs, None).reshape(whole.shape)
        columns.append(_blocks(done, leaf, group))
    if not columns:
        return jnp.zeros_like(recv)
    return _row(columns, group.width, recv.dtype)


def _exchange(
    group: OwnerGroup, leaves: Sequence[MatrixLeaf], local: list[Array], orthogonalize, coeffs
) -> dict:
    """The orthogonalised blocks of the group's leaves on this device: `{leaf: array}`."""
    members = sorted({i for i, _ in group.matrices})
    dtype = local[members[0]].dtype
    matrices = {i: _as_matrices(local[i], leaves[i]) for i in members}
    rows = []
    for d in range(group.devices):
        parts = [matrices[i][b].reshape(-1) for i, b in (group.matrices[k] for k in group.owned(d))]
        rows.append(_row(parts, group.width, dtype))
    send = jnp.stack(rows)
    recv = jax.lax.all_to_all(send, group.axes, 0, 0, tiled=True)
    branches = [
        functools.partial(_owner_branch, d, group, leaves, orthogonalize) for d in range(group.devices)
    ]
    done = jax.lax.switch(jax.lax.axis_index(group.axes), branches, recv, coeffs)
    back = jax.lax.all_to_all(done, group.axes, 0, 0, tiled=True)
    out: dict[int, list] = {i: [None] * leaves[i].count for i in members}
    for k, (i, b) in enumerate(group.matrices):
        start = group.offset[k]
        out[i][b] = back[group.owner[k], start : start + leaves[i].piece].reshape(leaves[i].local_matrix)
    return {i: _from_matrices(jnp.stack(out[i]), leaves[i]) for i in members}


def orthogonalize_on_mesh(
    xs: Sequence[Array],
    dims: Sequence[Any],
    specs: Sequence[PartitionSpec],
    mesh: Mesh,
    orthogonalize: Orthogonalize,
    coeffs: Array,
) -> list[Array]:
    """Orthogonalise every matrix of `xs` (global arrays laid out as `specs` on
    `mesh`; `dims` their dimension numbers) whole, each on one device.

    A leaf whose matrices no spec splits is orthogonalised where it lies (optax's
    own call on the device's block: its matrices are whole there). The others go
    through `_exchange`: per device the bytes of its blocks leave once and come back
    once, so the update moves about twice the Muon leaves' bytes over all devices.
    """
    mesh_shape = dict(mesh.shape)
    leaves = [
        MatrixLeaf.of(tuple(x.shape), d, s, mesh_shape) for x, d, s in zip(xs, dims, specs, strict=True)
    ]
    groups = owner_groups(leaves, [x.dtype for x in xs], mesh.axis_names)

    def per_device(local, coeffs):
        out = list(local)
        for i, leaf in enumerate(leaves):
            if not leaf.axes:
                out[i] = orthogonalize(local[i], coeffs, dims[i])
        for group in groups:
            for i, y in _exchange(group, leaves, list(local), orthogonalize, coeffs).items():
                out[i] = y
        return tuple(out)

    region = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(tuple(specs), PartitionSpec()),
        out_specs=tuple(specs),
        # A branch of an owner that holds no matrix returns zeros, which carry no
        # varying axes; every output's layout is set by construction (see above).
        check_vma=False,
    )
    return list(region(tuple(xs), coeffs))
