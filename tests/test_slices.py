"""Meshes over several slices joined by the data-centre network (`make_mesh(dcn=...)`,
topologies such as "2xv5p-64"), and the collectives that cross slices in a program
compiled for them (`collective_stats(..., mesh=)`, `dcn_wire_bytes`).

TPU slices are described by libtpu (skipped, with the reason, where it is not
installed); on CPU each process is a slice, checked over two processes in
tests/test_slices_processes.py.
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


def _groups(mesh, axis):
    """The device groups along `axis`: one row per group."""
    at = mesh.axis_names.index(axis)
    return np.moveaxis(mesh.devices, at, -1).reshape(-1, mesh.shape[axis])


def _ids(mesh):
    return [d.id for d in mesh.devices.flat]


@needs_libtpu
def test_data_across_two_slices_fsdp_inside_each():
    mesh = eqxpar.make_mesh(data=2, fsdp=32, dcn={"data": 2}, topology="2xv5p-64")
    assert (mesh.shape["data"], mesh.shape["fsdp"]) == (2, 32)
    # Each data group pairs a chip with the same chip of the other slice.
    for a, b in _groups(mesh, "data"):
        assert (a.slice_index, b.slice_index) == (0, 1) and a.coords == b.coords
    # Each fsdp group is one whole slice.
    for group in _groups(mesh, "fsdp"):
        assert len({d.slice_index for d in group}) == 1 and len(group) == 32
    assert len(set(_ids(mesh))) == 64
    # The same mesh from slices=, from the topology's devices, and with the slices
    # given to `data` by default.
    assert _ids(eqxpar.make_mesh(data=2, fsdp=32, topology="v5p-64", slices=2, dcn={"data": 2})) == _ids(mesh)
    assert _ids(eqxpar.make_mesh(data=2, fsdp=32, topology="2xv5p-64")) == _ids(mesh)
    from jax.experimental import topologies

    described = topologies.get_topology_desc("v5p:2x4x4", "tpu", num_slices=2)
    assert _ids(eqxpar.make_mesh(data=2, fsdp=32, devices=described.devices)) == _ids(mesh)


@needs_libtpu
def test_inner_axes_stay_on_neighbouring_chips_of_one_slice():
    mesh = eqxpar.make_mesh(data=4, fsdp=2, tensor=4, dcn={"data": 4}, topology="4xv5p:2x2x2")
    for group in _groups(mesh, "tensor"):
        assert len({d.slice_index for d in group}) == 1
        steps = {
            sum(abs(p - q) for p, q in zip(x.coords, y.coords, strict=True))
            for x, y in zip(group, group[1:], strict=False)
        }
        assert steps == {1}
    assert [d.slice_index for d in _groups(mesh, "data")[0]] == [0, 1, 2, 3]


@needs_libtpu
def test_an_axis_split_between_slices_and_chips():
    # data 2 x fsdp 8 over 4 slices of 4 chips: fsdp spans 2 slices (the outer
    # factor of its index), data the other 2.
    mesh = eqxpar.make_mesh(data=2, fsdp=8, dcn={"data": 2, "fsdp": 2}, topology="4xv5p:2x2x1")
    fsdp = _groups(mesh, "fsdp")[0]
    assert [d.slice_index for d in fsdp] == [0] * 4 + [1] * 4
    assert [d.slice_index for d in _groups(mesh, "data")[0]] == [0, 2]


@needs_libtpu
@pytest.mark.parametrize(
    ("sizes", "dcn", "topology", "match"),
    [
        (
            {"data": 2, "tensor": 32},
            {"tensor": 2},
            "2xv5p-64",
            "'tensor' axis across slices.*Keep tensor within",
        ),
        ({"data": 2, "context": 32}, {"context": 2}, "2xv5p-64", "'context' axis across slices"),
        ({"expert": 2, "fsdp": 32}, {"expert": 2}, "2xv5p-64", "'expert' axis across slices"),
        (
            {"data": 2, "fsdp": 32},
            {"data": 4},
            "2xv5p-64",
            r"4 slices do not divide the data axis \(data=2\)",
        ),
        ({"data": 4, "fsdp": 16}, {"data": 4}, "2xv5p-64", "over 4 slices, which does not divide the 2"),
        ({"data": 2, "fsdp": 8}, {"data": 2}, "4xv5p:2x2x1", r"needs 8 devices in each slice.*have \[4\]"),
        ({"data": 2, "fsdp": 32}, {"batch": 2}, "2xv5p-64", "'batch' is not a mesh axis"),
        ({"data": 2, "fsdp": 32}, {"data": 2.0}, "2xv5p-64", r"data=2\.0 is not a number of slices"),
        ({"data": 2, "fsdp": 32}, ["data"], "2xv5p-64", "expected a dict of axis -> slices"),
        ({"tensor": 8}, None, "2xv5p:2x2x1", r"spans 2 slices.*dcn=\{'data': 2\}"),
    ],
)
def test_dcn_errors_name_the_axis(sizes, dcn, topology, match):
    with pytest.raises(MeshError, match=match):
        eqxpar.make_mesh(**sizes, dcn=dcn, topology=topology)


@needs_libtpu
def test_slice_counts_given_twice_or_without_a_topology():
    with pytest.raises(MeshError, match="the name says 2 slices"):
        eqxpar.make_mesh(data=-1, topology="2xv5p-16", slices=4)
    with pytest.raises(MeshError, match="positive number of slices"):
        eqxpar.make_mesh(data=-1, topology="v5p-16", slices=0)
    from jax.experimental import topologies

    described = topologies.get_topology_desc("v5p:2x2x1", "tpu")
    with pytest.raises(MeshError, match="already has its slice count"):
        eqxpar.make_mesh(data=-1, topology=described, slices=2)


def test_slices_without_a_topology_and_one_process_refused():
    with pytest.raises(MeshError, match=r"slices=2\) without a topology.*dcn="):
        eqxpar.make_mesh(data=2, slices=2)
    # One process is one slice on CPU: dcn over processes needs as many of them.
    with pytest.raises(MeshError, match=r"over 2 slices, which does not divide the 1"):
        eqxpar.make_mesh(data=2, fsdp=4, dcn={"data": 2})
    # A factor of 1 is no slice at all: the mesh is the one-slice mesh.
    assert _ids(eqxpar.make_mesh(data=2, fsdp=4, dcn={"data": 1})) == _ids(eqxpar.make_mesh(data=2, fsdp=4))


@needs_libtpu
def test_what_crosses_slices_is_counted_on_its_axis():
    """A weight gradient over a batch split data x fsdp, compiled for two slices:
    the data reduction crosses slices (the megascale runtime's sends), the rest
    stays on one slice's chips."""
    mesh = eqxpar.make_mesh(data=2, fsdp=4, dcn={"data": 2}, topology="2xv5p:2x2x1")
    x = jax.ShapeDtypeStruct((8, 1024), jnp.float32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    w = jax.ShapeDtypeStruct((1024, 512), jnp.float32, sharding=NamedSharding(mesh, P("fsdp")))

    def grad(x, w):
        return jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)

    compiled = jax.jit(grad, out_shardings=NamedSharding(mesh, P("fsdp"))).lower(x, w).compile()
    text = compiled.as_text()
    assert "_xla_megascale_transfer_type" in text
    stats = eqxpar.inspect.collective_stats(compiled, mesh=mesh)
    shard = 1024 * 512 * 4 // 4  # the gradient's fsdp shard, float32
    # Two slices: an all-reduce sends its buffer once (2 (n-1)/n = 1).
    assert stats.dcn_wire_bytes == {"all-reduce": shard}
    assert stats.by_axes["all-reduce"] == {("data",): shard}
    # Inside a slice, the replica groups name one slice's 4 chips, all on fsdp.
    assert "replica_groups={{0,1,2,3}}" in text
    assert all(axes == ("fsdp",) for kind, by in stats.by_axes.items() if kind != "all-reduce" for axes in by)
    assert stats.total_dcn_wire_bytes == shard
