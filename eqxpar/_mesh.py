"""Device meshes with eqxpar's fixed axis names."""

import math
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import AxisType, Mesh

from ._errors import MeshError
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

    On TPU devices (attached or described), the axes are laid along the chips'
    links by JAX (`jax.make_mesh`), innermost (`tensor`) on the closest chips, and
    an axis that spans more than one side of the torus is numbered back and forth
    along its rows, so that each device's neighbours on the axis are one link away.

    **Returns:** a `jax.sharding.Mesh` whose axes are all of type `Auto`, so the
    compiler (GSPMD) places the collectives outside `shard_map` regions and a
    partial-manual `shard_map` keeps the other axes sharded.

    **Raises:** `MeshError` when the sizes do not fit the devices (or do not use
    all of a topology's), when both `devices` and `topology` are given, and for a
    topology name that is unknown, that names a GPU system (JAX cannot compile for
    GPU topologies ahead of time: JAX issue #23971) or that needs libtpu where it is
    not installed.

    ```python
    mesh = eqxpar.make_mesh(data=2, tensor=4)   # 8 devices
    mesh = eqxpar.make_mesh(data=-1)            # all devices on `data`
    mesh = eqxpar.make_mesh(expert=4, data=2)   # experts split 4 ways
    # a v5p slice of 32 chips, to compile for on this machine (needs libtpu):
    # eqxpar.make_mesh(fsdp=8, tensor=4, topology="v5p-64")
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
    if topology is not None:
        devices = topology_devices(topology)
    devices = list(jax.devices() if devices is None else devices)
    total = _resolve_sizes(sizes, len(devices), topology)
    if not isinstance(split_physical_axes, bool):
        raise MeshError(f"make_mesh(split_physical_axes={split_physical_axes!r}): expected True or False.")
    shape = tuple(sizes[a] for a in AXES)
    try:
        mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices[:total])
    # JAX cannot lay the axes on the TPU torus (it raises NotImplementedError for
    # an axis that would split a side of the torus).
    except (ValueError, NotImplementedError) as error:
        if not split_physical_axes:
            raise MeshError(
                f"JAX cannot lay mesh {_shape_text(sizes)} over these {total} devices: {error} Choose "
                "sizes that each cover whole sides of the slice's chip grid, or pass "
                "make_mesh(..., split_physical_axes=True) to let an axis cut a side (its groups then "
                "span parts of several sides: slower links for that axis)."
            ) from error
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices[:total], allow_split_physical_axes=True)
        mesh = Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    ordered = neighbour_layout(mesh.devices, tuple(AXES.index(a) for a in NEIGHBOUR_AXES))
    if ordered is mesh.devices:
        return mesh
    return Mesh(ordered, AXES, axis_types=(AxisType.Auto,) * len(AXES))


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


def axis_size(mesh: Mesh, axes: str | Sequence[str] | None) -> int:
    """Number of devices a dimension split over `axes` of `mesh` is divided into."""
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)
