"""Notebooks (issue 23): plans, reports, pictures and meshes render as a cell's value, and
`show_sharding` draws what a live variable or array really holds.

Rendered through IPython's own display formatter, as Jupyter calls it for a cell's value.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers import mlp
from IPython.core.formatters import DisplayFormatter
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml

RULES = [(r".*up/kernel", (None, "model"))]


def _shown(value: object) -> dict[str, str]:
    shown, _ = DisplayFormatter().format(value)
    return shown


@pytest.fixture(scope="module")
def planned():
    mesh = kml.Mesh(data=2, model=4)
    dist = kml.ModelParallel(mesh, RULES, replicate_below=0)
    with dist.scope():
        model = mlp(8, ("up", 16, "relu"), ("down", 8))
    return mesh, dist, model


def _values(planned):
    mesh, dist, model = planned
    return {
        "plan": (dist.plan(model), "Layout plan on mesh data=2 × model=4"),
        "picture": (kml.show_mesh(mesh), "data=2"),
        "mesh": (mesh, "Mesh(data=2, model=4): 8 cpu devices"),
    }


@pytest.mark.parametrize("kind", ["plan", "picture", "mesh"], ids=str)
def test_a_cell_value_renders_as_html_and_pretty_text(kind, planned):
    value, fragment = _values(planned)[kind]
    shown = _shown(value)
    assert "object at 0x" not in shown["text/plain"]  # what it showed before
    assert fragment in shown["text/plain"]
    html = shown["text/html"]
    assert html.startswith("<pre style=") and html.rstrip().endswith("</pre>")
    assert fragment.replace("×", "&#215;") in html or fragment in html
    assert "<span style=" in html  # coloured, as in the terminal


def test_a_comm_report_renders(planned):
    _, dist, model = planned
    keras.distribution.set_distribution(dist)
    model.compile(optimizer="sgd", loss="mse")
    report = kml.comm_report(model, np.zeros((8, 8), "float32"), np.zeros((8, 8), "float32"))
    shown = _shown(report)
    assert shown["text/plain"] == str(report)
    assert "all-reduce" in shown["text/plain"] and "<span style=" in shown["text/html"]


def test_show_sharding_of_a_live_variable_says_what_it_holds_beside_the_rules(planned):
    mesh, dist, model = planned
    kernel = model.get_layer("up").kernel
    with dist.scope():
        text = str(kml.show_sharding(mesh, kernel))
    assert text.splitlines()[:3] == [
        "mlp/up/kernel (8, 16) float32 · layout (None, model) · mesh data=2 × model=4",
        "holds (None, model) (read from its array)",
        "the rules give (None, model): the same",
    ]
    assert "128 B per device" in text.splitlines()[3]


def test_show_sharding_of_a_jax_array(planned):
    mesh, _, _ = planned
    array = jax.device_put(
        np.zeros((4, 8), "float32"), NamedSharding(mesh.backend_mesh, PartitionSpec("data"))
    )
    text = str(kml.show_sharding(mesh, array))
    assert text.splitlines()[:2] == [
        "array (4, 8) float32 · layout (data, None) · mesh data=2 × model=4",
        "holds (data, None) (read from its array)",
    ]
    with pytest.raises(kml.InvalidOptionError, match=r"lives on 1 device\(s\), not on this mesh"):
        kml.show_sharding(mesh, jax.numpy.zeros((4, 8)))
    with pytest.raises(kml.InvalidOptionError, match="pass axes only with a shape"):
        kml.show_sharding(mesh, array, (None, None))
