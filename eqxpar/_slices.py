"""Devices grouped into slices (granules) joined by the data-centre network (DCN),
and a mesh array assembled from one array per slice.

A TPU pod runs several slices: inside one, chips talk over ICI links; between
slices, over DCN, an order of magnitude slower. A mesh over several slices (a
hybrid mesh, as `jax.experimental.mesh_utils.create_hybrid_device_mesh` builds)
gives each named DCN axis an outer factor that counts slices, every other axis
staying inside a slice. On CPU, each process is a slice: its devices share memory,
and other processes are reached over the network (gloo).
"""

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ._errors import MeshError


def _tpu_slice(device: Any) -> int | None:
    """A TPU device's `slice_index` (0 where a slice's description has none, its
    hosts being processes of one slice); None for other devices (CPU devices of a
    multi-process run carry a `slice_index` too, 0 on every process)."""
    if getattr(device, "platform", None) != "tpu":
        return None
    index = getattr(device, "slice_index", None)
    return 0 if index is None else int(index)


def slice_key(device: Any) -> int:
    """The slice a device belongs to: its TPU `slice_index`, else (CPU, GPU) its process."""
    index = _tpu_slice(device)
    return int(device.process_index) if index is None else index


def granules(devices: Sequence[Any]) -> list[list[Any]]:
    """`devices` grouped by slice (`slice_key`), slices in ascending order, each
    slice's devices in the order given."""
    groups: dict[int, list[Any]] = {}
    for device in devices:
        groups.setdefault(slice_key(device), []).append(device)
    return [groups[key] for key in sorted(groups)]


def slice_count(devices: Sequence[Any]) -> int:
    """How many slices (processes on CPU) `devices` span."""
    return len({slice_key(d) for d in devices})


def hybrid_array(
    groups: list[list[Any]],
    dcn_shape: tuple[int, ...],
    ici_shape: tuple[int, ...],
    lay_out: Callable[[list[Any], tuple[int, ...]], np.ndarray],
) -> np.ndarray:
    """The mesh array over `groups` (one list of devices per slice): each slice laid
    out by `lay_out(devices, ici_shape)`, the slices then placed along `dcn_shape`
    (slice `g` at `np.unravel_index(g, dcn_shape)`), so that axis `i` has size
    `dcn_shape[i] * ici_shape[i]`, its slice index the outer factor."""
    if len(groups) != math.prod(dcn_shape):
        raise AssertionError((len(groups), dcn_shape))
    blocks = np.empty(len(groups), dtype=object)
    for g, devices in enumerate(groups):
        blocks[g] = lay_out(devices, ici_shape)
    stacked = np.stack(list(blocks)).reshape(dcn_shape + ici_shape)
    rank = len(ici_shape)
    # (dcn_0, ..., dcn_k, ici_0, ..., ici_k) -> (dcn_0, ici_0, dcn_1, ici_1, ...)
    order = [i for pair in zip(range(rank), range(rank, 2 * rank), strict=True) for i in pair]
    shape = tuple(d * i for d, i in zip(dcn_shape, ici_shape, strict=True))
    return stacked.transpose(order).reshape(shape)


def check_granules(groups: list[list[Any]], dcn: dict[str, int], per_slice: int, total: int) -> None:
    """Raise `MeshError` unless `groups` are `prod(dcn)` slices of `per_slice`
    devices each."""
    wanted = math.prod(dcn.values())
    sizes = sorted({len(g) for g in groups})
    if len(groups) != wanted:
        where = "slices" if _tpu_slice(groups[0][0]) is not None else "processes"
        raise MeshError(
            f"make_mesh(dcn={dcn}) spreads the mesh over {wanted} slices, but the {total} devices "
            f"form {len(groups)} slice(s) ({where}; on CPU each process is one). Use dcn sizes whose "
            f"product is {len(groups)}, or run on {wanted} slices (or processes)."
        )
    if sizes != [per_slice]:
        raise MeshError(
            f"make_mesh(dcn={dcn}) needs {per_slice} devices in each slice (the mesh's {total} devices "
            f"over {wanted} slices), but the slices have {sizes}. Choose axis sizes that use every "
            "device of every slice."
        )


def slice_factors(devices: np.ndarray) -> tuple[int, ...]:
    """How many TPU slices each axis of the mesh array `devices` spans (1 for an
    axis inside a slice, and for devices that are not TPU slices': the processes
    of a CPU run share one program): the distinct slices along it from the first
    device."""
    factors = []
    for axis in range(devices.ndim):
        line = devices[tuple(slice(None) if i == axis else 0 for i in range(devices.ndim))]
        factors.append(len({_tpu_slice(d) for d in line}))
    return tuple(factors)
