"""The shared mesh helpers every module uses: axis sizes by name, and device ids as text (issue 15)."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import keras
import numpy as np
import pytest

import keras_meshlayout as kml
from keras_meshlayout.core._format import id_ranges
from keras_meshlayout.core._mesh import mesh_axis_sizes


@pytest.mark.parametrize(
    "build",
    [
        lambda: kml.Mesh(data=2, model=4),
        lambda: keras.distribution.DeviceMesh((2, 4), ["data", "model"], keras.distribution.list_devices()),
        lambda: jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model")),
    ],
    ids=["kml-mesh", "keras-device-mesh", "jax-mesh"],
)
def test_axis_sizes_of_every_kind_of_mesh(build):
    sizes = mesh_axis_sizes(build())
    assert sizes == {"data": 2, "model": 4} and list(sizes) == ["data", "model"]
    assert all(type(size) is int for size in sizes.values())


@pytest.mark.parametrize(
    "ids, text",
    [
        ([], ""),
        ([5], "5"),
        ([0, 1], "0-1"),
        ([0, 1, 2, 3, 8], "0-3, 8"),
        ((0, 4), "0, 4"),
        ((4, 5, 6, 7, 0, 1, 2, 3), "4-7, 0-3"),
    ],
    ids=["none", "one", "pair", "run-and-single", "apart", "two-runs-in-mesh-order"],
)
def test_device_ids_as_text(ids, text):
    assert id_ranges(ids) == text


def test_no_module_pairs_axis_names_with_sizes_itself():
    """`mesh_axis_sizes` is the one place: a module re-deriving it would drift (e.g. on a jax Mesh)."""
    package = Path(kml.__file__).parent
    pattern = re.compile(r"zip\(\s*[\w.]*axis_names\s*,\s*[\w.]*shape")
    found = [
        f"{path.relative_to(package)}:{number}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "_mesh.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], "use keras_meshlayout.core._mesh.mesh_axis_sizes(mesh) instead:\n" + "\n".join(found)
