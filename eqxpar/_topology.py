"""TPU topologies by name, for meshes compiled ahead of time on any machine.

With `libtpu` installed (`pip install "eqxpar[tpu]"`), JAX describes a TPU slice
that is not attached (`jax.experimental.topologies.get_topology_desc`): its devices
carry their chip coordinates, so a mesh laid over them, and programs compiled for
it, are what the slice would run. This module turns the names people use for a
slice into such a description and orders a mesh's innermost axes along the chips'
links.
"""

import importlib.util
import math
import re
from typing import Any

import numpy as np

from ._errors import MeshError

#: Accelerator types counted in chips, and their slice shapes (Cloud TPU's).
_CHIP_SHAPES: dict[int, str] = {
    1: "1x1",
    4: "2x2",
    8: "2x4",
    16: "4x4",
    32: "4x8",
    64: "8x8",
    128: "8x16",
    256: "16x16",
}
_CHIP_COUNTED = {"v5litepod": "v5e", "v5e": "v5e", "v6e": "v6e"}

#: v5p slices below 64 chips, whose shapes are not all multiples of 4.
_SMALL_V5P = {4: (2, 2, 1), 8: (2, 2, 2), 16: (2, 2, 4), 32: (2, 4, 4)}

_GPU_NAME = re.compile(r"^(gpu|cuda|rocm|nvidia|amd|\d*x?(a|h|b|gb|l)\d+|v100|mi\d+)", re.IGNORECASE)
_TYPE_NAME = re.compile(r"^(v\d+[a-z]*)-(\d+)$")
#: `2xv5p-64`: two slices of a v5p-64, joined by the data-centre network (DCN).
_SLICES_NAME = re.compile(r"^(\d+)x(v\d.*)$")
_SHAPE_NAME = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+)*)$")

_KNOWN = (
    "a TPU v5p, v5e or v6e slice, as an accelerator type (`v5p-64`, `v5litepod-16`, "
    "`v6e-16`) or as a generation and chip shape (`v5p:2x4x4`, `v5e:4x4`, `v6e:16x16`), "
    "with `Nx` in front for N slices (`2xv5p-64`)"
)


def _v5p_shape(chips: int) -> tuple[int, int, int] | None:
    """Cloud TPU's v5p slice shape of `chips` chips: the most cubic one whose sides
    are multiples of 4 (smaller slices have their own), smallest side first."""
    if chips in _SMALL_V5P:
        return _SMALL_V5P[chips]
    best = None
    for a in range(4, chips + 1, 4):
        for b in range(a, chips // a + 1, 4):
            c, rest = divmod(chips, a * b)
            if rest or c < b or c % 4:
                continue
            if best is None or (c, b) < (best[2], best[1]):
                best = (a, b, c)
    return best


def topology_name(name: str) -> str:
    """The `generation:shape` name `get_topology_desc` takes for `name`.

    `v5p-N` counts TensorCores (two per chip, one JAX device per chip: megacore),
    so it is N/2 chips; `v5litepod-N` (or `v5e-N`) and `v6e-N` count chips.
    """
    if _GPU_NAME.match(name):
        raise MeshError(
            f"topology={name!r} names a GPU system; expected {_KNOWN}. JAX cannot "
            "compile for a GPU topology ahead of time (get_topology_desc raises "
            "NotImplementedError for cuda and rocm: JAX issues #23971 and #28376). "
            "Compile on the GPUs themselves, or simulate devices on CPU with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N."
        )
    if shape := _SHAPE_NAME.match(name):
        generation = _CHIP_COUNTED.get(shape[1], shape[1])
        _check_generation(name, generation)
        return f"{generation}:{shape[2]}"
    if not (kind := _TYPE_NAME.match(name)):
        raise MeshError(f"topology={name!r} is not a TPU topology name; expected {_KNOWN}.")
    generation, count = kind[1], int(kind[2])
    if generation in _CHIP_COUNTED:
        if count not in _CHIP_SHAPES:
            raise MeshError(
                f"topology={name!r}: {generation} slices have {sorted(_CHIP_SHAPES)} chips, "
                f"not {count}. Use one of those, or name the shape: "
                f"'{_CHIP_COUNTED[generation]}:4x4'."
            )
        return f"{_CHIP_COUNTED[generation]}:{_CHIP_SHAPES[count]}"
    _check_generation(name, generation)
    shape3 = _v5p_shape(count // 2) if count % 2 == 0 else None
    if shape3 is None:
        raise MeshError(
            f"topology={name!r}: v5p-N counts TensorCores, two per chip, and no v5p slice "
            f"has {count} of them. Use an accelerator type such as v5p-8, v5p-64 or "
            "v5p-128, or name the chip shape: 'v5p:4x4x4'."
        )
    return "v5p:" + "x".join(map(str, shape3))


def _check_generation(name: str, generation: str) -> None:
    if generation in ("v5p", "v5e", "v6e"):
        return
    if generation == "v4":
        raise MeshError(
            f"topology={name!r}: libtpu describes a v4 slice with one device per "
            "TensorCore (two per chip), whereas a v4 slice runs one device per chip "
            "(megacore), and JAX refuses to lay a mesh over such devices. Use a v5p, "
            "v5e or v6e topology, or compile on the v4 slice itself."
        )
    raise MeshError(f"topology={name!r} names an unknown TPU generation; expected {_KNOWN}.")


def split_slices(name: str) -> tuple[str, int]:
    """`("v5p-64", 2)` for `"2xv5p-64"`; `(name, 1)` for a name without a slice count."""
    if m := _SLICES_NAME.match(name):
        return m[2], int(m[1])
    return name, 1


def topology_devices(topology: Any, slices: Any = None) -> list[Any]:
    """The devices of `topology`: a name (see `topology_name`; `"2xv5p-64"` for two
    slices) or a `jax.experimental.topologies.TopologyDescription`. `slices` (an
    int, default 1, or the count in the name) asks libtpu for that many copies of
    the slice joined by the data-centre network: each device then carries its
    `slice_index`."""
    if not isinstance(topology, str):
        devices = getattr(topology, "devices", None)
        if devices is None:
            raise MeshError(
                f"topology={topology!r} is neither a name nor a TopologyDescription; "
                "expected a string such as 'v5p-64' or the result of "
                "jax.experimental.topologies.get_topology_desc(...)."
            )
        if slices is not None:
            raise MeshError(
                f"make_mesh(topology=<TopologyDescription>, slices={slices!r}): a description already "
                "has its slice count. Pass get_topology_desc(..., num_slices=N) alone, or a name."
            )
        return list(devices)
    base, named = split_slices(topology.strip().lower())
    if slices is not None and named != 1 and slices != named:
        raise MeshError(
            f"make_mesh(topology={topology!r}, slices={slices!r}): the name says {named} slices. "
            "Give the count once, in the name or in slices=."
        )
    count = named if slices is None else slices
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise MeshError(f"make_mesh(slices={slices!r}): expected a positive number of slices, e.g. slices=2.")
    name = topology_name(base)
    if importlib.util.find_spec("libtpu") is None:
        raise MeshError(
            f"topology={topology!r} needs libtpu, which describes TPU slices to JAX, and "
            'it is not installed. Install it with `pip install "eqxpar[tpu]"` (the '
            "libtpu release that pairs with your JAX)."
        )
    from jax.experimental import topologies

    try:
        # A slice of one chip has hosts of one chip; the default host is 2x2.
        options: dict[str, Any] = {"chips_per_host_bounds": [1, 1, 1]} if name.endswith(":1x1") else {}
        if count > 1:
            options["num_slices"] = count
        return list(topologies.get_topology_desc(name, "tpu", **options).devices)
    except Exception as error:  # JaxRuntimeError (INVALID_ARGUMENT), RuntimeError
        raise MeshError(
            f"topology={topology!r} ({name!r}) was refused by libtpu: {error}. Expected {_KNOWN}."
        ) from error


def _gray_order(sides: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every point of a grid of `sides`, each one step from the one before
    (boustrophedon: the first side fastest, reversed on every other row)."""
    if not sides:
        return [()]
    inner = [(i,) for i in range(sides[0])]
    for side in sides[1:]:
        inner = [point + (j,) for j in range(side) for point in (inner if j % 2 == 0 else inner[::-1])]
    return inner


def neighbour_order(devices: np.ndarray, axis: int) -> np.ndarray:
    """`devices` (a mesh's array) with `axis` reordered so that consecutive members
    of its groups sit on neighbouring chips, where JAX's order does not already.

    JAX places a mesh axis on whole physical axes of the torus; one spread over two
    or three of them is numbered row by row, so its groups jump from the end of one
    row to the start of the next. Walking the rows back and forth (boustrophedon)
    makes every step one link. The groups of the other axes are the same devices
    as before, only numbered differently. The same reordering of the axis serves all
    its groups, since JAX gives each group the same shape; where it does not shorten
    the longest step of any group, the order is left as it was.
    """
    size = devices.shape[axis]
    coords = getattr(devices.flat[0], "coords", None)
    if size <= 2 or coords is None:
        return devices
    groups = np.moveaxis(devices, axis, -1).reshape(-1, size)
    points = np.array([d.coords for d in groups[0]])
    low = points.min(axis=0)
    sides = tuple(int(s) for s in points.max(axis=0) - low + 1)
    if math.prod(sides) != size:
        return devices
    where = {tuple(int(c) for c in p - low): i for i, p in enumerate(points)}
    used = [i for i, side in enumerate(sides) if side > 1]
    order = []
    for point in _gray_order(tuple(sides[i] for i in used)):
        full = [0] * len(sides)
        for i, value in zip(used, point, strict=True):
            full[i] = value
        order.append(where[tuple(full)])
    reordered = np.take(devices, order, axis=axis)
    if _worst_step(reordered, axis) < _worst_step(devices, axis):
        return reordered
    return devices


def neighbour_layout(devices: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """The mesh array `devices` (JAX's layout) or the same devices in coordinate
    order (x fastest, as JAX lays meshes on a torus in general), whichever puts
    consecutive members of the groups along `axes` (innermost last) closer, each
    axis then walked back and forth by `neighbour_order`.

    JAX 0.12 lays a 2x2x2 v5p slice as one ring of 8 chips cut into the mesh's
    shape, which suits one axis of 8 or 4 but puts a size-2 axis's pair on a
    diagonal when two inner axes share the ring; coordinate order gives each of
    them a side of the cube.
    """
    if getattr(devices.flat[0], "coords", None) is None:
        return devices
    flat = sorted(devices.flat, key=lambda d: (*reversed(d.coords), getattr(d, "core_on_chip", 0)))
    candidates = [devices, np.array(flat, dtype=object).reshape(devices.shape)]
    for axis in axes:
        candidates = [neighbour_order(c, axis) for c in candidates]

    def cost(candidate: np.ndarray) -> tuple[int, ...]:
        return tuple(_worst_step(candidate, a) for a in reversed(axes) if candidate.shape[a] > 1)

    return min(candidates, key=cost)  # JAX's layout on a tie


def _worst_step(devices: np.ndarray, axis: int) -> int:
    """The longest hop, in links (no wrap-around), between consecutive members of
    the groups along `axis`."""
    groups = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
    return max(
        (
            sum(abs(a - b) for a, b in zip(x.coords, y.coords, strict=True))
            for group in groups
            for x, y in zip(group[:-1], group[1:], strict=True)
        ),
        default=0,
    )
