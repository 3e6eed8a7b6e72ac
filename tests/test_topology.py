"""Meshes over TPU topologies described by libtpu (`make_mesh(topology=...)`), laid
out on neighbouring chips, and compiled for ahead of time on this CPU machine.

Skipped, with the reason, where libtpu is not installed (the `tpu` extra, which the
`test` extra includes); the errors that need no libtpu run everywhere.
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import eqxpar
from eqxpar import MeshError

needs_libtpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None,
    reason='libtpu is not installed (pip install "eqxpar[tpu]"): no TPU topology to describe',
)


def _steps(mesh, axis):
    """Links between consecutive members of each group along `axis` (no wrap-around)."""
    groups = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
    groups = groups.reshape(-1, mesh.shape[axis])
    return {
        sum(abs(a - b) for a, b in zip(x.coords, y.coords, strict=True))
        for group in groups
        for x, y in zip(group[:-1], group[1:], strict=True)
    }


@needs_libtpu
@pytest.mark.parametrize(
    ("name", "chips", "kind"),
    [
        ("v5p:2x2x2", 8, "TPU v5"),
        ("v5p-16", 8, "TPU v5"),  # TensorCores: two per chip
        ("v5p-64", 32, "TPU v5"),  # 2x4x4
        ("V5P-128", 64, "TPU v5"),
        ("v5litepod-16", 16, "TPU v5 lite"),
        ("v5e:2x4", 8, "TPU v5 lite"),
        ("v6e-16", 16, "TPU v6 lite"),
        ("v6e:4x4", 16, "TPU v6 lite"),
        ("v5e-1", 1, "TPU v5 lite"),
    ],
)
def test_mesh_from_name(name, chips, kind):
    mesh = eqxpar.make_mesh(fsdp=-1, topology=name)
    assert mesh.shape["fsdp"] == chips
    assert {d.device_kind for d in mesh.devices.flat} == {kind}


@needs_libtpu
def test_accelerator_type_is_the_cloud_slice_shape():
    from eqxpar._topology import topology_name

    assert topology_name("v5p-8") == "v5p:2x2x1"
    assert topology_name("v5p-64") == "v5p:2x4x4"
    assert topology_name("v5p-768") == "v5p:4x8x12"
    assert topology_name("v5p-12288") == "v5p:16x16x24"
    assert topology_name("v5litepod-256") == "v5e:16x16"
    assert topology_name("v6e-8") == "v6e:2x4"
    assert topology_name("v5litepod:4x8") == "v5e:4x8"


@needs_libtpu
def test_topology_description_and_devices_agree():
    from jax.experimental import topologies

    description = topologies.get_topology_desc("v5p:2x2x2", "tpu")
    by_object = eqxpar.make_mesh(data=2, tensor=4, topology=description)
    by_name = eqxpar.make_mesh(data=2, tensor=4, topology="v5p:2x2x2")
    assert [d.id for d in by_object.devices.flat] == [d.id for d in by_name.devices.flat]


@needs_libtpu
@pytest.mark.parametrize(
    ("name", "sizes"),
    [
        ("v5p:2x2x2", {"data": 2, "tensor": 4}),  # tensor on a 2x2 plane
        ("v5p:2x2x2", {"tensor": 8}),  # the whole 2x2x2 cube
        ("v5p:2x2x2", {"expert": 2, "context": 2, "tensor": 2}),
        ("v5p:4x4x4", {"fsdp": 4, "context": 4, "tensor": 4}),
        ("v5p:4x4x4", {"fsdp": 4, "tensor": 16}),  # a 4x4 plane
        ("v5p:4x4x4", {"expert": 4, "context": 4, "tensor": 4}),
        ("v5e:4x4", {"fsdp": 2, "tensor": 8}),
    ],
)
def test_inner_axes_on_neighbouring_chips(name, sizes):
    """Consecutive members of every tensor, context and expert group are one ICI link
    apart (JAX numbers an axis over two sides of the torus row by row, which jumps
    from a row's end to the next row's start; make_mesh walks the rows back and
    forth)."""
    mesh = eqxpar.make_mesh(**sizes, topology=name)
    for axis in ("tensor", "context", "expert"):
        if mesh.shape[axis] > 1:
            assert _steps(mesh, axis) == {1}, (axis, _steps(mesh, axis))
    # Every chip once.
    assert len({d.id for d in mesh.devices.flat}) == mesh.devices.size


@needs_libtpu
def test_compile_ahead_of_time_for_the_topology():
    """A sharded jit function lowers and compiles for a v5p slice on this CPU machine."""
    mesh = eqxpar.make_mesh(fsdp=2, tensor=4, topology="v5p:2x2x2")
    sharding = NamedSharding(mesh, P("fsdp", "tensor"))

    def f(x):
        return jnp.sum(jnp.tanh(x) @ x.T)

    x = jax.ShapeDtypeStruct((256, 512), jnp.float32, sharding=sharding)
    compiled = jax.jit(f, in_shardings=sharding).lower(x).compile()
    memory = compiled.memory_analysis()
    assert memory is not None and memory.argument_size_in_bytes == 256 * 512 * 4 // 8
    assert "all-reduce" in compiled.as_text() or "all-gather" in compiled.as_text()


@needs_libtpu
@pytest.mark.parametrize(
    ("topology", "sizes", "match"),
    [
        ("h100:8", {"data": 8}, "GPU.*ahead of time.*23971"),
        ("8xH100", {"data": 8}, "GPU.*ahead of time"),
        ("tpu-8", {"data": 8}, "not a TPU topology name.*v5p-64"),
        ("v7x-8", {"data": 8}, "unknown TPU generation"),
        ("v4-16", {"data": 8}, "megacore"),
        ("v5p-65", {"data": 8}, "two per chip.*v5p-64"),
        ("v6e-12", {"data": 8}, r"not 12.*v6e:4x4"),
        ("v5p:3x3x3", {"data": 27}, "refused by libtpu"),
        ("v5p:2x2x2", {"data": 4}, "uses 4 devices but.*has 8.*product is 8"),
        ("v5p:2x2x2", {"data": 16}, "uses 16 devices but.*has 8"),
        ("v5p:4x4x4", {"fsdp": 8, "tensor": 8}, "cannot lay mesh fsdp=8 x tensor=8"),
        (3, {"data": 8}, "neither a name nor a TopologyDescription"),
    ],
)
def test_topology_errors(topology, sizes, match):
    with pytest.raises(MeshError, match=match):
        eqxpar.make_mesh(**sizes, topology=topology)


def test_devices_and_topology_both_given():
    with pytest.raises(MeshError, match="both devices=.*expected one of them"):
        eqxpar.make_mesh(data=8, devices=jax.devices(), topology="v5p-16")


def test_missing_libtpu_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "libtpu" else real(name, *a)
    )
    with pytest.raises(MeshError, match=r'needs libtpu.*pip install "eqxpar\[tpu\]"'):
        eqxpar.make_mesh(data=8, topology="v5p-16")


def test_cpu_meshes_keep_their_order():
    """Devices without chip coordinates (these CPU ones) are laid out as before."""
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in jax.devices()[:8]]
