"""JAX-native inputs and "did you mean" (issue 23): what a JAX user writes first is accepted.

`kml.Mesh(jax.make_mesh(...))`, `kml.ModelParallel(jax_mesh, ...)` and a `PartitionSpec` as a
rule's layout each raised before; a typo in an axis name or a rule got no suggestion.
"""

from __future__ import annotations

import warnings

import jax
import keras
import pytest
from helpers import mlp
from jax.experimental import mesh_utils
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml


@pytest.mark.parametrize(
    "make, shape",
    [
        (lambda: kml.Mesh(jax.make_mesh((2, 4), ("data", "model"))), (2, 4)),
        (
            lambda: kml.Mesh(jax.sharding.Mesh(mesh_utils.create_device_mesh((4, 2)), ("data", "model"))),
            (4, 2),
        ),
        (lambda: kml.Mesh(mesh_utils.create_device_mesh((2, 4)), ("data", "model")), (2, 4)),
    ],
    ids=["make_mesh", "jax-sharding-mesh", "mesh_utils-array"],
)
def test_a_mesh_from_jax(make, shape):
    mesh = make()
    assert isinstance(mesh, kml.Mesh) and mesh.shape == shape and mesh.axis_names == ("data", "model")
    assert mesh.backend_mesh.axis_names == ("data", "model")


def test_a_jax_mesh_keeps_its_device_order():
    devices = jax.devices()[::-1]
    jax_mesh = jax.sharding.Mesh(mesh_utils.create_device_mesh((2, 4), devices=devices), ("data", "model"))
    assert kml.Mesh(jax_mesh).device_ids.tolist() == [[d.id for d in row] for row in jax_mesh.devices]


@pytest.mark.parametrize(
    "make, fragments",
    [
        (
            lambda: kml.Mesh(jax.make_mesh((2, 4), ("data", "model")), ("a", "b")),
            ("A jax.sharding.Mesh brings its own axis names and devices", "kml.Mesh(jax_mesh) alone"),
        ),
        (
            lambda: kml.Mesh(mesh_utils.create_device_mesh((2, 4))),
            ("An array of devices (shape (2, 4)) needs one axis name per dimension",),
        ),
    ],
    ids=["jax-mesh-and-names", "array-without-names"],
)
def test_jax_forms_given_wrongly_say_how(make, fragments):
    with pytest.raises(kml.InvalidMeshError) as raised:
        make()
    assert all(fragment in str(raised.value) for fragment in fragments), str(raised.value)


def _shardings_of(model: keras.Model) -> dict[str, PartitionSpec]:
    return {weight.path: weight.value.sharding.spec for weight in model.weights}


def test_model_parallel_on_a_jax_mesh_with_partition_specs_as_layouts():
    jax_mesh = jax.make_mesh((2, 4), ("data", "model"))
    rules = [
        (r".*up/kernel", PartitionSpec(None, "model")),
        (r".*up/bias", PartitionSpec("model")),
        (r".*down/kernel", NamedSharding(jax_mesh, PartitionSpec("model"))),  # short: padded, as JAX does
    ]
    dist = kml.ModelParallel(jax_mesh, rules, batch_axis="data", replicate_below=0)
    assert isinstance(dist.device_mesh, kml.Mesh)
    with dist.scope():
        model = mlp(8, ("up", 16, "relu"), ("down", 8))
    assert _shardings_of(model) == {
        "mlp/up/kernel": PartitionSpec(None, "model"),
        "mlp/up/bias": PartitionSpec("model"),
        "mlp/down/kernel": PartitionSpec("model", None),
        "mlp/down/bias": PartitionSpec(None),
    }
    assert dist.plan(model)["mlp/down/kernel"].axes == ("model", None)


def test_a_named_sharding_on_another_mesh_is_refused():
    other = jax.make_mesh((4, 2), ("data", "model"))
    with pytest.raises(kml.InvalidRuleError, match="is a TensorLayout on"):
        kml.LayoutRules(
            [(r".*kernel", NamedSharding(other, PartitionSpec("model")))], mesh=kml.Mesh(data=2, model=4)
        )


@pytest.mark.parametrize(
    "make, fragment",
    [
        (
            lambda: kml.LayoutRules([(r".*kernel", (None, "modle"))], mesh=kml.Mesh(data=2, model=4)),
            "Did you mean 'model'?",
        ),
        (lambda: kml.ModelParallel(kml.Mesh(data=2, model=4), batch_axis="dta"), "Did you mean 'data'?"),
        (lambda: kml.Mesh(data=2, model=4, across_processes="modl"), "Did you mean 'model'?"),
    ],
    ids=["rule-axis", "batch-axis", "across-processes"],
)
def test_did_you_mean_for_axis_names(make, fragment):
    with pytest.raises(kml.MeshLayoutError) as raised:
        make()
    assert fragment in str(raised.value)


def test_a_rule_that_matches_nothing_names_the_nearest_paths():
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*upp/kernel", (None, "model"))])
    with dist.scope():
        model = mlp(8, ("up", 16), ("down", 8))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dist.plan(model)
    [message] = [str(w.message) for w in caught if w.category is kml.UnmatchedRuleWarning]
    assert message.endswith("Nearest variable paths: 'mlp/up/kernel', 'mlp/down/kernel'.")
    assert message in plan.warnings


def test_auto_rules_plans_on_a_jax_mesh_as_model_parallel_takes_it():
    """Regression: `kml.ModelParallel(jax_mesh, rules)` worked, but `kml.auto_rules(model, jax_mesh)`
    refused the mesh as not a `kml.Mesh`."""
    jax_mesh = jax.make_mesh((2, 4), ("data", "model"))
    rules = kml.auto_rules(mlp(16, ("up", 64, "relu"), ("down", 16)), jax_mesh, replicate_below=0)
    assert rules.match("mlp/up/kernel").axes == (None, "model") and rules.batch_axis == "data"
    assert kml.ModelParallel(jax_mesh, rules).batch_dim_name == "data"
