"""Plans read what the variables really hold (issue 23: "what you see is what runs").

A plan of a model built outside the distribution used to show the rules' layouts and "73%
saved" while every kernel sat whole on one device; setting the distribution after the build
ended in JAX's "incompatible devices" traceback mid-step.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers import mlp
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml
from keras_meshlayout import _compat

RULES = [(r".*up/kernel", (None, "model")), (r".*up/bias", ("model",))]


def _distribution() -> kml.ModelParallel:
    return kml.ModelParallel(kml.Mesh(data=2, model=4), RULES, batch_axis="data", replicate_below=0)


def _model() -> keras.Model:
    return mlp(8, ("up", 16, "relu"), ("down", 8))


def test_a_model_built_outside_the_distribution_is_planned_as_it_really_is():
    dist = _distribution()
    model = _model()  # no set_distribution, no scope: one device
    with pytest.warns(kml.LayoutMismatchWarning) as caught:
        plan = dist.plan(model)
    [warning] = [w for w in caught if w.category is kml.LayoutMismatchWarning]
    message = str(warning.message)
    assert message.startswith("4 variable(s) ('mlp/up/kernel', 'mlp/up/bias', 'mlp/down/kernel' and 1 more)")
    assert "live on 1 device(s), not on the mesh data=2 x model=4 (8 devices)" in message
    assert "the model was built outside the distribution" in message
    assert "Fix: build the model (and load its weights) under the distribution" in message
    kernel = plan["mlp/up/kernel"]
    assert (kernel.axes, kernel.shards, kernel.requested) == ((None, None), 1, (None, "model"))
    assert kernel.reasons == ("lives on 1 device(s) outside the mesh (see the warning below)",)
    assert plan.bytes_per_device == plan.replicated_bytes  # nothing is saved: nothing is sharded
    assert message in plan.warnings
    assert "warning: 4 variable(s)" in str(plan)  # and a line under the table


def test_setting_the_distribution_after_the_build_is_our_error_before_any_compute():
    dist = _distribution()
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    before = [w.numpy().copy() for w in model.weights]
    keras.distribution.set_distribution(dist)
    x, y = np.zeros((16, 8), "float32"), np.zeros((16, 8), "float32")
    for call in (lambda: model.fit(x, y, batch_size=8, verbose=0), lambda: model.predict(x, verbose=0)):
        with pytest.raises(kml.LayoutMismatchError) as raised:
            call()
        message = str(raised.value)
        assert "the distribution was set after the model was built" in message
        assert "JAX would otherwise refuse the step with 'Received incompatible devices'" in message
    for weight, value in zip(model.weights, before, strict=True):
        np.testing.assert_array_equal(weight.numpy(), value)  # nothing ran, nothing was lost


@pytest.mark.parametrize(
    ("made_early", "named", "fix"),
    [
        ("optimizer", "('early/iteration', 'early/learning_rate')", "create the optimizer and metrics after"),
        ("metric", "('early/total', 'early/count')", "pass them by name"),
    ],
)
def test_an_optimizer_or_metric_made_before_the_distribution_is_named_as_such(made_early, named, fix):
    """Regression: a metric object created before `set_distribution` failed mid-step in JAX
    ("Received incompatible devices"); an early optimizer was blamed on the model's build."""
    early = (
        keras.optimizers.Adam(name="early")
        if made_early == "optimizer"
        else keras.metrics.MeanSquaredError("early")
    )
    keras.distribution.set_distribution(_distribution())
    model = _model()
    if made_early == "optimizer":
        model.compile(optimizer=early, loss="mse")
    else:
        model.compile(optimizer="adam", loss="mse", metrics=[early])
    x = np.zeros((16, 8), "float32")
    with pytest.raises(kml.LayoutMismatchError) as raised:
        model.fit(x, x, batch_size=8, verbose=0)
    message = str(raised.value)
    assert message.startswith(f"2 variable(s) {named} live on 1 device(s)"), message
    assert f"the {made_early} object was created before the distribution was set" in message
    assert fix in message


def test_a_model_built_under_another_mesh_says_so_and_how_to_move_it():
    """Regression: a model built on a 4-device kml mesh, then fit under a 2x4 one, was told it had been
    made "on one device" and to set the distribution first, which it had."""
    with kml.ModelParallel(kml.Mesh(data=1, model=4, devices=jax.devices()[:4]), RULES).scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse")
    keras.distribution.set_distribution(_distribution())
    x = np.zeros((16, 8), "float32")
    with pytest.raises(kml.LayoutMismatchError) as raised:
        model.fit(x, x, batch_size=8, verbose=0)
    message = str(raised.value)
    assert "live on 4 device(s), not on the mesh data=2 x model=4 (8 devices)" in message
    assert "they were laid out for another mesh of 4 devices" in message and "one device" not in message
    assert (
        "kml.save_checkpoint(model, path) under the old one, kml.load_checkpoint(new, path) here" in message
    )


def test_a_model_built_on_another_arrangement_of_the_same_devices_is_shown_as_it_is():
    """Regression: built under 2x4, planned under 4x2 (the same 8 devices and axis names), the plan read
    the kernel's spec on the new mesh: 2 shards and 2,048 bytes a device, where it held 4 and 1,024."""
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), RULES))
    model = _model()
    other = kml.ModelParallel(kml.Mesh(data=4, model=2), [(r".*up/kernel", ("model", None))])
    keras.distribution.set_distribution(other)
    held_otherwise = r"2 variable\(s\) \('mlp/up/kernel', 'mlp/up/bias'\) hold"
    with pytest.warns(kml.LayoutMismatchWarning, match=held_otherwise):
        entry = other.plan(model)["mlp/up/kernel"]
    kernel = model.get_layer("up").kernel.value
    assert entry.bytes_per_device == kernel.addressable_shards[0].data.nbytes == 8 * 16 * 4 // 4
    assert entry.reasons[0].startswith("its array is laid out on another mesh of these devices (data=2 x")


def test_a_variable_placed_otherwise_on_the_mesh_is_shown_with_its_real_layout():
    dist = _distribution()
    with dist.scope():
        model = _model()
    kernel = model.get_layer("up").kernel
    moved = jax.device_put(kernel.value, NamedSharding(dist.device_mesh.backend_mesh, PartitionSpec("model")))
    _compat.set_raw_value(kernel, moved)  # placed by other code (assign would re-lay it out)
    assert kernel.value.sharding.spec == PartitionSpec("model")
    with pytest.warns(
        kml.LayoutMismatchWarning, match=r"1 variable\(s\) \('mlp/up/kernel'\) hold arrays sharded"
    ):
        plan = dist.plan(model)
    entry = plan["mlp/up/kernel"]
    assert (entry.axes, entry.shards) == (("model", None), 4)
    assert entry.reasons == ("its array is sharded (model, None), not as the rules give",)


def test_a_model_built_under_the_distribution_plans_silently():
    dist = _distribution()
    with dist.scope():
        model = _model()
    plan = dist.plan(model)  # warnings are errors in this suite
    assert plan.mismatches == ()
    assert plan["mlp/up/kernel"].axes == (None, "model")
