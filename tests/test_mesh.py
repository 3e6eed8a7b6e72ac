import jax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import eqxpar


def test_default_axes_and_order():
    mesh = eqxpar.make_mesh(data=2, tensor=4)
    assert mesh.axis_names == ("data", "pipe", "fsdp", "expert", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "pipe": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 4}
    # tensor is innermost: neighbouring devices share a data index.
    assert [d.id for d in mesh.devices[0, 0, 0, 0, 0]] == [d.id for d in jax.devices()[:4]]


def test_infer_one_axis():
    mesh = eqxpar.make_mesh(fsdp=-1, tensor=2)
    assert mesh.shape["fsdp"] == 4


def test_fewer_devices_than_available_and_override():
    mesh = eqxpar.make_mesh(data=2)
    assert mesh.devices.size == 2
    devices = jax.devices()[4:]
    mesh = eqxpar.make_mesh(data=-1, devices=devices)
    assert mesh.shape["data"] == 4
    assert {d.id for d in mesh.devices.flat} == {d.id for d in devices}


def test_mesh_too_large_names_the_numbers():
    with pytest.raises(eqxpar.MeshError, match=r"needs 16 devices but only 8"):
        eqxpar.make_mesh(data=4, tensor=4)


def test_two_inferred_axes():
    with pytest.raises(eqxpar.MeshError, match="at most one"):
        eqxpar.make_mesh(data=-1, tensor=-1)


def test_inferred_axis_must_divide():
    with pytest.raises(eqxpar.MeshError, match="does not divide"):
        eqxpar.make_mesh(data=-1, tensor=3)


@pytest.mark.parametrize("bad", [0, -2, True])
def test_bad_sizes(bad):
    with pytest.raises(eqxpar.MeshError, match="not a valid size"):
        eqxpar.make_mesh(data=bad)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.sampled_from([1, 2, 4, 8]), min_size=6, max_size=6), st.integers(0, 5))
def test_any_fitting_shape_builds(sizes, infer):
    names = eqxpar.AXES
    kwargs = dict(zip(names, sizes, strict=True))
    total = 1
    for s in sizes:
        total *= s
    if total > 8:
        with pytest.raises(eqxpar.MeshError):
            eqxpar.make_mesh(**kwargs)
        return
    mesh = eqxpar.make_mesh(**kwargs)
    assert tuple(mesh.shape[n] for n in names) == tuple(sizes)
    rest = total // sizes[infer]
    kwargs[names[infer]] = -1
    assert eqxpar.make_mesh(**kwargs).shape[names[infer]] == 8 // rest
