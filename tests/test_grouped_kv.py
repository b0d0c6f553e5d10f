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


class DenseGQA(keras.layers.Layer):
    """A user's grouped-query attention block: `Dense` projections, 4 query heads, 2 key/value heads of 16."""

    def __init__(
        self, num_heads: int = 4, kv_heads: int = 2, head_dim: int = 16, bias: bool = False, **kwargs
    ):
        super().__init__(**kwargs)
        self.num_heads, self.kv_heads, self.head_dim = num_heads, kv_heads, head_dim
        self.q_proj = keras.layers.Dense(num_heads * head_dim, use_bias=False, name="q_proj")
        self.k_proj = keras.layers.Dense(kv_heads * head_dim, use_bias=bias, name="k_proj")
        self.v_proj = keras.layers.Dense(kv_heads * head_dim, use_bias=bias, name="v_proj")
        self.o_proj = keras.layers.Dense(64, use_bias=False, name="o_proj")

    def build(self, shape):
        for layer in (self.q_proj, self.k_proj, self.v_proj):
            layer.build(shape)
        self.o_proj.build((*shape[:-1], self.num_heads * self.head_dim))

    def _heads(self, x, count: int):
        return keras.ops.reshape(x, (-1, x.shape[1], count, self.head_dim))

    def call(self, x):
        query = self._heads(self.q_proj(x), self.num_heads)
        group = self.num_heads // self.kv_heads
        key = keras.ops.repeat(self._heads(self.k_proj(x), self.kv_heads), group, axis=2)
        value = keras.ops.repeat(self._heads(self.v_proj(x), self.kv_heads), group, axis=2)
        scores = keras.ops.einsum("btnh,bsnh->bnts", query, key) / self.head_dim**0.5
        mixed = keras.ops.einsum("bnts,bsnh->btnh", keras.ops.softmax(scores, axis=-1), value)
        return self.o_proj(keras.ops.reshape(mixed, (-1, x.shape[1], self.num_heads * self.head_dim)))


def user_gqa(bias: bool = False) -> keras.Model:
    inputs = keras.Input((8, 64))
    pooled = keras.layers.GlobalAveragePooling1D()(DenseGQA(bias=bias, name="attn")(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(pooled), name="user_gqa")


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "biased"])
def test_a_users_dense_key_value_projections_split_and_predicted_as_compiled(bias):
    """Issue 19 item 4 for a user-written block (SmolLM3's shape): Dense k_proj/v_proj with 2 key/value heads
    on model=4 stayed replicated. Now their output features are split and the prediction is the compiled
    step's. Without a bias each kernel is gathered once per step (as many bytes as replicated); with one
    XLA gathers the outputs instead (reading the model's input, no kernel gather backward): fewer bytes
    than replicated (measured: 41,772 vs 47,916 bytes per step), so the costs take it."""
    mesh, x = kml.Mesh(data=2, model=4), np.zeros((BATCH, 8, 64), "float32")
    rules = kml.auto_rules(user_gqa(bias), mesh, batch=x, optimizer="adam", replicate_below=0)
    for role in ("k_proj", "v_proj"):
        rule = rules.match(f"attn/{role}/kernel")
        assert rule.axes == (None, "model"), rule
        assert "output features (2 heads × 16) are split over it" in rule.note, rule.note
        assert rules.match(f"attn/{role}/output").axes == ("data", None, None)
    assert rules.match("attn/q_proj/kernel").axes == (None, "model")
    assert rules.cost.layouts()["head_dim split"] == 2
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    report, state = compiled_step(lambda: user_gqa(bias), dist, x, np.zeros(BATCH, "int32"))
    for axis, measured in report.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis
    assert rules.cost.state_bytes == state
    gathered = [
        t for t in report.transfers if t.kind == "all-gather" and t.layer.endswith(("k_proj", "v_proj"))
    ]
    each = (BATCH // 2, 8, 32) if bias else (64, 32)  # the output forward, or the kernel, once per step
    assert sorted(t.shape for t in gathered) == [each, each]
