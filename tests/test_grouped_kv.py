"""Grouped-query attention with too few key/value heads (issue 19, item 4).

keras-hub's tiny Llama (`tests/hub_models.py`: 2 key/value heads for 4 query
heads) on data=2 × model=4: the key/value heads do not divide the model axis.
Their kernels were replicated; the planner now costs a split on their head_dim
(gathered over 'model' once per step, gradient reduced over 'data' in shards)
beside replicating them, and the plan without a budget takes the split, which
sends as many bytes per step at less state (measured compiled: 261,932 bytes
both ways, state 457,896 → 359,592).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import pytest
from helpers import Reference, assert_laid_out_as_planned, assert_same_weights, compiled_step, train
from hub_models import BATCH, CLASSES, ROWS, build_classifier, inputs_for

import keras_meshlayout as kml

KERNELS = [f"transformer_layer_{i}/self_attention/{role}/kernel" for i in (0, 1) for role in ("key", "value")]


def build() -> keras.Model:
    return build_classifier(next(r for r in ROWS if r.name == "LlamaBackbone"))


@dataclasses.dataclass(frozen=True)
class Planned:
    mesh: kml.Mesh
    rules: kml.LayoutRules
    report: kml.CommReport
    state_bytes: int


@pytest.fixture(scope="module")
def planned() -> Planned:
    """The no-budget plan (small matrices not kept whole) and its compiled step (one compile)."""
    mesh = kml.Mesh(data=2, model=4)
    x = inputs_for(build())
    rules = kml.auto_rules(build(), mesh, batch=x, optimizer="adam", replicate_below=0)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    report, state = compiled_step(build, dist, x, np.zeros(BATCH, "int32"))
    return Planned(mesh, rules, report, state)


def test_key_value_kernels_split_on_head_dim(planned):
    """Each key/value kernel `(hidden, 2 heads, head_dim 16)` is split on head_dim, with the reason."""
    for path in KERNELS:
        rule = planned.rules.match(path)
        assert rule.axes == (None, None, "model"), path
        assert "2 key/value heads do not divide by 'model' (4)" in rule.note
        assert "head_dim (16) is split over it, gathered once per step" in rule.note
        assert rule.note.startswith("head_dim split: saves "), rule.note
        assert "sends as much per step as replicated" in rule.note
        # The output stays whole over 'model': the activations move as when the kernel is replicated.
        output = planned.rules.match(path.replace("/kernel", "/output"))
        assert output.axes == ("data", None, None, None)
    choices = [c for c in planned.rules.cost.choices if c.layout == "head_dim split"]
    assert sorted(c.unit for c in choices) == sorted(p.rsplit("/", 1)[0] for p in KERNELS)


def test_prediction_matches_the_compiled_step(planned):
    """Predicted bytes per axis = the compiled step's, state = the plan's (measured: equal exactly)."""
    for axis, measured in planned.report.wire_bytes_by_axis.items():
        assert planned.rules.cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis
    assert planned.rules.cost.state_bytes == planned.state_bytes
    # The figures measured when the candidates were compared (replicated: 261,932 and 457,896).
    assert planned.report.wire_bytes == pytest.approx(261_932, rel=0.02)
    assert planned.state_bytes == 359_592


def test_sharded_fit_matches_one_device(planned):
    """`fit` under the plan (key/value kernels split on head_dim) equals the single-device run."""
    x = inputs_for(build())
    y = np.random.default_rng(0).integers(0, CLASSES, size=BATCH)
    data = (x, y)
    reference = Reference(build, data, BATCH)
    dist = kml.ModelParallel(planned.mesh, planned.rules, replicate_below=0)
    model = train(build, reference.initial, data, dist, BATCH)
    assert_same_weights(model, reference.trained)
    assert_laid_out_as_planned(model, dist.plan(model), planned.mesh)
    assert dist.plan(model)[KERNELS[0]].axes == (None, None, "model")
