"""Device meshes with eqxpar's fixed axis names."""

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from ._errors import MeshError
from ._slices import check_granules, granules, hybrid_array, slice_count
from ._topology import neighbour_layout, topology_devices

#: Mesh axis names, outermost first. Every eqxpar mesh has all six, size 1 where
#: unused, so one set of rules (e.g. "embed" -> "fsdp") serves every mesh. The order
#: follows communication intensity: `data` (one gradient reduction per step) is
#: outermost, so it lands across hosts; `expert` (two all-to-alls per
#: mixture-of-experts layer), `context` (keys and values passed around in every
#: attention layer) and `tensor` (collectives inside every layer) are innermost,
#: so their devices are neighbours.
AXES: tuple[str, ...] = ("data", "pipe", "fsdp", "expert", "context", "tensor")

#: The axes whose collectives run inside every layer: on TPU their groups are laid
#: so that consecutive members are neighbouring chips (`make_mesh`).
NEIGHBOUR_AXES: tuple[str, ...] = ("expert", "context", "tensor")

#: Axes a mesh may spread over several slices (`make_mesh(dcn=...)`): their
#: collectives run once per step (`data`'s gradient reduction), once per layer and
#: step (`fsdp`'s gathers) or between pipeline stages (`pipe`), never inside every
#: layer's matmuls, as the `NEIGHBOUR_AXES`' do.
DCN_AXES: tuple[str, ...] = ("data", "pipe", "fsdp")

#: The mesh axis that splits the sequence of every activation (context parallelism).
CONTEXT_AXIS = "context"

#: The mesh axis that splits the experts of mixture-of-experts layers (expert
#: parallelism). Outside those layers it is a batch axis: its devices hold
#: distinct examples, and each MoE layer sends every token to the device holding
#: its expert and back (all-to-all).
EXPERT_AXIS = "expert"

#: Axes a batch's leading dimension is split over: FSDP is data parallel in its
#: activations, so both carry distinct examples; so does `expert` (when larger
#: than 1, see `EXPERT_AXIS`).
BATCH_AXES: tuple[str, ...] = ("data", "fsdp", "expert")


def make_mesh(
    *,
    # Any: the sizes are checked below, with an eqxpar error (a type checker's
    # error would not name the fix).
    data: Any = 1,
    pipe: Any = 1,
    fsdp: Any = 1,
    expert: Any = 1,
    context: Any = 1,
    tensor: Any = 1,
    devices: Sequence[jax.Device] | None = None,
    # Any: a name or a jax.experimental.topologies.TopologyDescription, checked
    # below (that module is imported only when a topology is asked for).
    topology: Any = None,
    slices: Any = None,
    dcn: Any = None,
    split_physical_axes: Any = False,
) -> Mesh:
    """Build a device mesh with eqxpar's axes `("data", "pipe", "fsdp", "expert", "context", "tensor")`.

    **Arguments:**

    - `data`, `pipe`, `fsdp`, `expert`, `context`, `tensor`: axis sizes
      (`expert` splits the experts of `eqxpar.nn.MoE` layers and is a batch axis
      elsewhere: expert parallelism; `context` splits the sequence: context
      parallelism; see `eqxpar.Plan`). Size 1 is allowed (the axis is
      still present, so rules may name it). At most one size may be `-1`, meaning
      "whatever the device count leaves".
    - `devices`: devices to lay out, in order; defaults to `jax.devices()`. When the
      sizes use fewer devices than given, the first ones are used.
    - `split_physical_axes`: on a TPU slice, let an axis cut a side of the chip
      grid where the sizes cannot each cover whole sides (e.g. expert 8 x fsdp 8
      on a 4x4x4 v5p-128), as MaxText's `allow_split_physical_axes` (default
      False: such sizes raise `MeshError` naming this option).
    - `topology`: instead of `devices`, a TPU slice that need not be attached, to
      compile for ahead of time on any machine (needs libtpu: `pip install
      "eqxpar[tpu]"`): an accelerator type (`"v5p-64"`: 64 TensorCores, 32 chips;
      `"v5litepod-16"`, `"v6e-16"`: 16 chips), a generation and chip shape
      (`"v5p:2x4x4"`, `"v5e:4x4"`, `"v6e:16x16"`), or a
      `jax.experimental.topologies.TopologyDescription`. The sizes must use all
      of its devices (one per chip). See the Concepts page, "TPU topologies".
      `"2xv5p-64"` (or `slices=2`) names two such slices joined by the
      data-centre network (DCN).
    - `slices`: with a topology name, how many copies of the slice (default 1).
    - `dcn`: the factor of each axis that spans slices, e.g. `{"data": 2}`: a
      hybrid mesh (JAX's `mesh_utils.create_hybrid_device_mesh`, MaxText's
      `dcn_*_parallelism`). Axis `a` of size `n` is `dcn[a]` slices of `n /
      dcn[a]` devices each; every other axis stays inside a slice, laid out there
      as without `dcn`. Slices are TPU slices (`device.slice_index`), or on CPU
      the processes of a multi-process run (each process one slice). Only
      `data`, `pipe` and `fsdp` may cross slices (`DCN_AXES`). Over devices of
      several TPU slices without `dcn`, the slices go to the outermost axes that
      take them (`data`, then `pipe`, then `fsdp`).

    On TPU devices (attached or described), the axes are laid along the chips'
    links by JAX (`jax.make_mesh`), innermost (`tensor`) on the closest chips, and
    an axis that spans more than one side of the torus is numbered back and forth
    along its rows, so that each device's neighbours on the axis are one link away.

    **Returns:** a `jax.sharding.Mesh` whose axes are all of type `Auto`, so the
    compiler (GSPMD) places the collectives outside `shard_map` regions and a
    partial-manual `shard_map` keeps the other axes sharded.

    **Raises:** `MeshError` when the sizes do not fit the devices (or do not use
    all of a topology's), when both `devices` and `topology` are given, when a
    `dcn` factor does not divide its axis, names a tensor, context or expert axis,
    or does not match the slices (their count, or the devices in each), and for a
    topology name that is unknown, that names a GPU system (JAX cannot compile for
    GPU topologies ahead of time: JAX issue #23971) or that needs libtpu where it is
    not installed.

    ```python
    mesh = eqxpar.make_mesh(data=2, tensor=4)   # 8 devices
    mesh = eqxpar.make_mesh(data=-1)            # all devices on `data`
    mesh = eqxpar.make_mesh(expert=4, data=2)   # experts split 4 ways
    # a v5p slice of 32 chips, to compile for on this machine (needs libtpu):
    # eqxpar.make_mesh(fsdp=8, tensor=4, topology="v5p-64")
    # two v5p-64 slices: FSDP inside each, data parallel across them (HSDP):
    # eqxpar.make_mesh(data=2, fsdp=32, dcn={"data": 2}, topology="2xv5p-64")
    ```
    """
    sizes = {
        "data": data,
        "pipe": pipe,
        "fsdp": fsdp,
        "expert": expert,
        "context": context,
        "tensor": tensor,
    }
    if topology is not None and devices is not None:
        raise MeshError(
            f"make_mesh got both devices= ({len(devices)} devices) and "
            f"topology={topology!r}; expected one of them. Pass the topology alone: "
            "its devices are laid out in the order of its chips."
        )
    if slices is not None and topology is None:
        raise MeshError(
            f"make_mesh(slices={slices!r}) without a topology: slices= counts copies of a "
            "topology to compile for. For attached devices, pass dcn= (e.g. dcn={'data': 2})."
        )
    if topology is not None:
        devices = topology_devices(topology, slices)
    devices = list(jax.devices() if devices is None else devices)
    total = _resolve_sizes(sizes, len(devices), topology)
    if not isinstance(split_physical_axes, bool):
        raise MeshError(f"make_mesh(split_physical_axes={split_physical_axes!r}): expected True or False.")
    factors = _dcn_factors(dcn, sizes, devices)
    axis_types = (AxisType.Auto,) * len(AXES)
    if factors is None:
        grid = _lay_out(devices[:total], sizes, split_physical_axes)
        return Mesh(grid, AXES, axis_types=axis_types)
    dcn_shape = tuple(factors.get(a, 1) for a in AXES)
    ici = {a: sizes[a] // factors.get(a, 1) for a in AXES}
    groups = granules(devices)
    count = math.prod(dcn_shape)
    if len(groups) % count:
        raise MeshError(
            f"make_mesh(dcn={factors}) spreads the mesh over {count} slices, which does not divide the "
            f"{len(groups)} slices the devices form. Use dcn sizes whose product divides {len(groups)}."
        )
    groups = groups[:count]
    check_granules(groups, factors, math.prod(ici.values()), total)
    grid = hybrid_array(
        groups,
        dcn_shape,
        tuple(ici[a] for a in AXES),
        lambda granule, _: _lay_out(granule, ici, split_physical_axes),
    )
    return Mesh(grid, AXES, axis_types=axis_types)


def _lay_out(devices: list[Any], sizes: dict[str, int], split_physical_axes: bool) -> np.ndarray:
    """The devices (those of one slice) as an array of the axes' `sizes`, laid
    along the chips' links on TPU."""
    shape = tuple(sizes[a] for a in AXES)
    try:
        mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)
        grid = mesh.devices
    # JAX cannot lay the axes on the TPU torus (it raises NotImplementedError for
    # an axis that would split a side of the torus).
    except (ValueError, NotImplementedError) as error:
        if not split_physical_axes:
            raise MeshError(
                f"JAX cannot lay mesh {_shape_text(sizes)} over these {len(devices)} devices: {error} Choose "
                "sizes that each cover whole sides of the slice's chip grid, or pass "
                "make_mesh(..., split_physical_axes=True) to let an axis cut a side (its groups then "
                "span parts of several sides: slower links for that axis)."
            ) from error
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return neighbour_layout(grid, tuple(AXES.index(a) for a in NEIGHBOUR_AXES))


def _dcn_factors(dcn: Any, sizes: dict[str, int], devices: list[Any]) -> dict[str, int] | None:
    """The checked `dcn` factors (axes of factor 1 left out); over devices of several
    TPU slices without `dcn`, the slices given to the outermost axes that take
    them; None for a mesh inside one slice."""
    if dcn is None:
        count = slice_count(devices)
        if count == 1 or devices[0].platform != "tpu":
            return None
        return _infer_dcn(sizes, count)
    if not isinstance(dcn, Mapping):
        raise MeshError(f"make_mesh(dcn={dcn!r}): expected a dict of axis -> slices, e.g. dcn={{'data': 2}}.")
    factors: dict[str, int] = {}
    for axis, factor in dcn.items():
        if axis not in AXES:
            raise MeshError(
                f"make_mesh(dcn={dict(dcn)}): {axis!r} is not a mesh axis; expected one of {DCN_AXES}."
            )
        if not isinstance(factor, int) or isinstance(factor, bool) or factor < 1:
            raise MeshError(
                f"make_mesh(dcn={dict(dcn)}): {axis}={factor!r} is not a number of slices; expected a "
                "positive integer."
            )
        if factor == 1:
            continue
        if axis not in DCN_AXES:
            raise MeshError(
                f"make_mesh(dcn={dict(dcn)}) would put the {axis!r} axis across slices: its collectives run "
                "inside every layer, and the data-centre network between slices is an order of magnitude "
                f"slower than the links inside one. Keep {axis} within a slice; spread only {DCN_AXES}."
            )
        if sizes[axis] % factor:
            raise MeshError(
                f"make_mesh(dcn={dict(dcn)}): {factor} slices do not divide the {axis} axis "
                f"({axis}={sizes[axis]}): each slice holds an equal share of it. Use a factor of "
                f"{sizes[axis]}, e.g. dcn={{'{axis}': {sizes[axis]}}}."
            )
        factors[axis] = factor
    return factors


def _infer_dcn(sizes: dict[str, int], count: int) -> dict[str, int]:
    """The `count` slices spread over the outermost DCN axes, each taking what of
    the remaining count its size holds."""
    factors: dict[str, int] = {}
    left = count
    for axis in DCN_AXES:
        take = math.gcd(sizes[axis], left)
        if take > 1:
            factors[axis] = take
            left //= take
    if left > 1:
        raise MeshError(
            f"mesh {_shape_text(sizes)} spans {count} slices, which its data, pipe and fsdp axes do not "
            f"hold (an axis across slices must be a multiple of its share of them). Give the data axis "
            f"the slices: make_mesh(data={count}, ..., dcn={{'data': {count}}})."
        )
    return factors


def _shape_text(sizes: dict[str, int]) -> str:
    return " x ".join(f"{k}={v}" for k, v in sizes.items() if v != 1) or "1"


def _resolve_sizes(sizes: dict[str, Any], n_devices: int, topology: Any) -> int:
    """Check `sizes` (in place: a -1 becomes what `n_devices` leaves) against the
    devices, and return how many the mesh uses."""
    for name, size in sizes.items():
        if not isinstance(size, int) or isinstance(size, bool) or (size < 1 and size != -1):
            raise MeshError(
                f"mesh axis {name}={size!r} is not a valid size; expected a positive "
                "integer, or -1 to infer it from the device count."
            )
    inferred = [name for name, size in sizes.items() if size == -1]
    if len(inferred) > 1:
        raise MeshError(
            f"mesh axes {inferred} are all -1; at most one axis size can be inferred. "
            "Give explicit sizes to all but one of them."
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if inferred:
        if n_devices % known:
            raise MeshError(
                f"cannot infer {inferred[0]}=-1: the other axes use {known} devices, "
                f"which does not divide the {n_devices} available devices. Choose sizes "
                f"whose product divides {n_devices}."
            )
        sizes[inferred[0]] = n_devices // known
    total = math.prod(sizes.values())
    if topology is not None and total != n_devices:
        raise MeshError(
            f"mesh {_shape_text(sizes)} uses {total} devices but topology={topology!r} has "
            f"{n_devices} (one per chip). Use axis sizes whose product is {n_devices}, "
            "or set one of them to -1."
        )
    if total > n_devices:
        raise MeshError(
            f"mesh {_shape_text(sizes)} needs {total} devices but only {n_devices} are available. "
            f"Use axis sizes whose product is at most {n_devices}, or, to simulate "
            "devices on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{total} before importing jax."
        )
    return total


def mesh_platform(mesh: Mesh) -> str:
    """The platform of `mesh`'s devices (`"cpu"`, `"tpu"`, `"gpu"`): a mesh lies
    over devices of one platform."""
    return mesh.devices.flat[0].platform


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """Number of devices a dimension split over `axes` of `mesh` is divided into."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)
