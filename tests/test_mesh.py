"""`kml.Mesh`: axis order, spec strings, size inference, device layout."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import keras_meshlayout as kml


@pytest.mark.parametrize(
    "spec, axis_sizes",
    [
        ("2x4", {"data": 2, "model": 4}),
        ("4X2", {"data": 4, "model": 2}),
        ("8", {"data": 8}),
        ("1x8", {"data": 1, "model": 8}),
        ("data=2,model=4", {"data": 2, "model": 4}),
        ("model=4, data=2", {"model": 4, "data": 2}),
        ("data=-1,model=4", {"data": 2, "model": 4}),
        ("-1x2", {"data": 4, "model": 2}),
        ("data=2,model=2,expert=2", {"data": 2, "model": 2, "expert": 2}),
        ("x=1,y=-1,z=1", {"x": 1, "y": 8, "z": 1}),
    ],
)
def test_parse(spec, axis_sizes):
    mesh = kml.Mesh.parse(spec)
    assert mesh.axis_sizes == axis_sizes
    assert mesh.axis_names == tuple(axis_sizes)
    assert mesh.shape == tuple(axis_sizes.values())
    assert kml.Mesh.parse(mesh.spec).axis_sizes == axis_sizes


def test_keyword_axes_keep_their_order_and_are_a_keras_device_mesh():
    mesh = kml.Mesh(model=4, data=2)
    assert isinstance(mesh, keras.distribution.DeviceMesh)
    assert mesh.axis_names == ("model", "data")
    assert mesh.devices.shape == (4, 2)
    assert mesh.size == 8
    assert repr(mesh) == "Mesh(model=4, data=2)"
    assert mesh.backend_mesh.shape == {"model": 4, "data": 2}


def test_mapping_form_allows_any_order():
    assert kml.Mesh({"b": 4, "a": 2}).axis_names == ("b", "a")


def test_devices_are_laid_out_by_jax_mesh_utils():
    """On CPU JAX keeps device order; the grid is exactly what mesh_utils gives."""
    from jax.experimental import mesh_utils

    mesh = kml.Mesh(data=2, model=4)
    expected = mesh_utils.create_device_mesh((2, 4), devices=jax.devices())
    assert (mesh.devices == expected).all()
    np.testing.assert_array_equal(mesh.device_ids, [[0, 1, 2, 3], [4, 5, 6, 7]])


def test_explicit_devices():
    devices = jax.devices()[4:]
    mesh = kml.Mesh(data=-1, model=2, devices=devices)
    assert mesh.shape == (2, 2)
    assert {d.id for d in mesh.devices.flat} == {4, 5, 6, 7}
    reversed_mesh = kml.Mesh.parse("4", devices=devices[::-1])
    assert [d.id for d in reversed_mesh.devices.flat] == [7, 6, 5, 4]
