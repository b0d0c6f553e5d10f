"""A model is traced once per state: planning it again reuses its traces, changing it traces afresh."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_meshlayout as kml
from keras_meshlayout.planner import trace_model
from keras_meshlayout.planner._trace import trace_step

X = np.zeros((8, 16), "float32")


def mlp() -> keras.Model:
    return keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(64, name="up"), keras.layers.Dense(16, name="down")],
        name="mlp",
    )


class Subclassed(keras.Model):
    """The same MLP written as a subclassed model calling `keras.ops`."""

    def __init__(self):
        super().__init__(name="mlp")
        self.up, self.down = keras.layers.Dense(64, name="up"), keras.layers.Dense(16, name="down")

    def call(self, x):
        return self.down(keras.ops.relu(self.up(x)))


def subclassed() -> keras.Model:
    model = Subclassed()
    model(X)
    return model


def _lora(model):
    model.get_layer("up").enable_lora(2)


def _freeze(model):
    model.get_layer("up").trainable = False


def _bfloat16(model):
    model.get_layer("up").dtype_policy = "mixed_bfloat16"


def _int8(model):
    model.get_layer("up").quantize("int8")


def _variables(trace, model, batch):
    return set(trace.variables.values()) == {v.path for v in model.variables}


def _trained(trace, model, batch):
    return not any(trace.variables.get(v) == "mlp/up/kernel" for v in trace.trained)


def _computes_in_bfloat16(trace, model, batch):
    return "bfloat16" in set(trace.dtypes.values())


def _batch(trace, model, batch):
    return {(trace.shapes[v], trace.dtypes[v]) for v in trace.inputs} == {(batch.shape, str(batch.dtype))}


#: (change to the model, batch, what the new trace shows) that each give a new trace.
CHANGES = [
    pytest.param(_lora, X, _variables, id="enable_lora"),
    pytest.param(_int8, X, _variables, id="quantize"),
    pytest.param(_freeze, X, _trained, id="a frozen layer"),
    pytest.param(_bfloat16, X, _computes_in_bfloat16, id="a layer's dtype policy"),
    pytest.param(None, np.zeros((4, 16), "float32"), _batch, id="another batch size"),
    pytest.param(None, np.zeros((8, 16), "float16"), _batch, id="another batch dtype"),
]


@pytest.mark.parametrize("build", [mlp, subclassed], ids=["sequential", "subclassed"])
@pytest.mark.parametrize("trace", [trace_model, trace_step], ids=["forward", "step"])
def test_the_same_model_on_the_same_shapes_is_traced_once(trace, build):
    model = build()
    first = trace(model, X)
    assert trace(model, np.ones((8, 16), "float32")) is first  # the values do not matter, only shapes
    assert trace(build(), X) is not first  # another model of the same code


@pytest.mark.parametrize(("change", "batch", "shows"), CHANGES)
def test_a_changed_model_or_batch_is_traced_afresh(change, batch, shows):
    model = mlp()
    before = trace_model(model, X)
    if change is not None:
        change(model)
    after = trace_model(model, batch)
    assert after is not before
    assert shows(after, model, batch)


def test_a_budget_retried_after_the_error_plans_as_a_fresh_model_would():
    """The budget workflow: a `MemoryBudgetError`, then a plan within its `smallest_bytes`, on one model."""
    model, fresh = mlp(), mlp()
    mesh = kml.Mesh(data=2, model=4)
    options = dict(batch=X, optimizer="adam", replicate_below=0)
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.auto_rules(model, mesh, memory_budget=1, **options)
    budget = error.value.smallest_bytes
    again = kml.auto_rules(model, mesh, memory_budget=budget, **options)
    alone = kml.auto_rules(fresh, mesh, memory_budget=budget, **options)
    assert again.rules == alone.rules
    assert again.cost.peak_bytes == alone.cost.peak_bytes
    assert again.cost.wire_bytes_by_axis == alone.cost.wire_bytes_by_axis
