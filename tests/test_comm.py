"""The communication report on real compiles of a Keras train step.

The model is a replicated Dense followed by a Megatron pair, F → D_IN → H → D_OUT:
`pre` (replicated), `up` (column-parallel: output features over `model`) and
`down` (row-parallel: input features over `model`). Every expected byte count
below is derived from these sizes, the mesh and the Megatron argument
(Shoeybi et al. 2019), never copied from a run:

- forward: `down` multiplies feature shards, so its (B/data, D_OUT) output is
  all-reduced over `model`; `up` needs nothing, its input being replicated;
- backward: the gradient of `up`'s input, (B/data, D_IN), is a sum over the
  feature shards, all-reduced over `model` (it would not exist were `up` first);
- update: each parameter's gradient shard, and the scalar loss, all-reduced
  over `data`.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest
from helpers import mlp

import keras_meshlayout as kml
from keras_meshlayout.core._format import format_bytes

#: Sizes chosen so that no activation, (BATCH / DATA) × features, has a weight's shape.
F, D_IN, H, D_OUT = 6, 12, 16, 8
BATCH = 40
DATA, MODEL = 2, 4
FLOAT = 4  # bytes

MEGATRON_RULES = [
    (r"mlp/up/kernel", (None, "model")),
    (r"mlp/up/bias", ("model",)),
    (r"mlp/down/kernel", ("model", None)),
]
#: The map of Keras's distribution guide: every Dense kernel (and bias) split on
#: its output features.
DOCS_RULES = [(r".*kernel", (None, "model")), (r".*bias", ("model",))]

#: Per device, the elements of each layer's parameter shards, hence of its gradients.
MEGATRON_SHARD_ELEMENTS = {
    "pre": F * D_IN + D_IN,  # replicated
    "up": (D_IN * H + H) // MODEL,  # column-parallel kernel and bias
    "down": H * D_OUT // MODEL + D_OUT,  # row-parallel kernel, replicated bias
}
ALL_ELEMENTS = F * D_IN + D_IN + D_IN * H + H + H * D_OUT + D_OUT


def build_mlp() -> keras.Model:
    return mlp(F, ("pre", D_IN), ("up", H, "relu"), ("down", D_OUT))


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH, F)).astype("float32"), rng.normal(size=(BATCH, D_OUT)).astype("float32")


def compiled_model(distribution: kml.ModelParallel) -> keras.Model:
    with distribution.scope():
        model = build_mlp()
        model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), loss="mse")
    return model


def report_for(distribution: kml.ModelParallel) -> tuple[keras.Model, kml.CommReport]:
    model = compiled_model(distribution)
    with distribution.scope():
        return model, kml.comm_report(model, *batch())


@pytest.fixture(scope="module")
def megatron() -> tuple[kml.ModelParallel, keras.Model, kml.CommReport]:
    distribution = kml.ModelParallel(
        kml.Mesh(data=DATA, model=MODEL), MEGATRON_RULES, batch_axis="data", replicate_below=0
    )
    return (distribution, *report_for(distribution))


@pytest.fixture(scope="module")
def docs_map() -> kml.CommReport:
    distribution = kml.ModelParallel(
        kml.Mesh(data=DATA, model=MODEL), DOCS_RULES, batch_axis="data", replicate_below=0
    )
    return report_for(distribution)[1]


@pytest.fixture(scope="module")
def data_parallel() -> kml.CommReport:
    return report_for(kml.ModelParallel(kml.Mesh(data=8)))[1]


def test_megatron_pair_sends_one_activation_all_reduce_each_way(megatron):
    _, _, report = megatron
    over_model = [t for t in report.transfers if t.axes == ("model",)]
    activations = (BATCH // DATA) * FLOAT
    assert [(t.kind, t.group_size, t.layer, t.phase, t.dtype, t.nbytes) for t in over_model] == [
        ("all-reduce", MODEL, "down", "forward", "f32", activations * D_OUT),
        ("all-reduce", MODEL, "up", "backward", "f32", activations * D_IN),
    ]
    ring = 2 * (MODEL - 1) / MODEL
    assert [t.wire_bytes for t in over_model] == [ring * activations * D_OUT, ring * activations * D_IN]
    assert report.wire_bytes_by_axis["model"] == pytest.approx(ring * activations * (D_OUT + D_IN))


def test_megatron_pair_all_reduces_each_gradient_shard_over_data(megatron):
    distribution, model, report = megatron
    over_data = [t for t in report.transfers if t.axes == ("data",)]
    assert {(t.kind, t.group_size, t.dtype) for t in over_data} == {("all-reduce", DATA, "f32")}
    by_layer: dict[str, int] = {}
    for t in over_data:
        assert t.phase == ("forward" if t.layer == "(loss)" else "backward"), t
        by_layer[t.layer] = by_layer.get(t.layer, 0) + t.nbytes
    want = {layer: elements * FLOAT for layer, elements in MEGATRON_SHARD_ELEMENTS.items()}
    assert by_layer == {**want, "(loss)": FLOAT}
    ring = 2 * (DATA - 1) / DATA
    assert report.wire_bytes_by_axis["data"] == pytest.approx(ring * (sum(want.values()) + FLOAT))
    # The same shards as the plan says each device holds.
    plan = distribution.plan(model)
    assert sum(plan[v.path].bytes_per_device for v in model.trainable_variables) == sum(want.values())


def test_megatron_pair_sends_nothing_else(megatron):
    _, _, report = megatron
    assert {c.kind for c in report.collectives} == {"all-reduce"}  # no all-gather of anything
    assert set(report.wire_bytes_by_axis) == {"model", "data"}
    assert report.wire_bytes == pytest.approx(sum(report.wire_bytes_by_axis.values()))


def test_docs_map_communicates_more_over_model(megatron, docs_map):
    """Every kernel column-parallel: each next layer must gather what the last one split."""
    _, _, report = megatron
    assert docs_map.wire_bytes_by_axis["model"] > report.wire_bytes_by_axis["model"]
    assert docs_map.count("all-gather") > 0
    weights = {(F, D_IN), (D_IN, H), (H, D_OUT), (D_IN,), (H,), (D_OUT,)}
    gathered = {tuple(sorted(t.shape)) for t in docs_map.transfers if t.kind == "all-gather"}
    assert gathered.isdisjoint(tuple(sorted(shape)) for shape in weights)  # activations, not weights


def test_data_parallel_all_reduces_every_gradient(data_parallel):
    report = data_parallel
    assert {(t.kind, t.axes, t.group_size) for t in report.transfers} == {("all-reduce", ("data",), 8)}
    assert sum(t.nbytes for t in report.transfers) == (ALL_ELEMENTS + 1) * FLOAT
    assert report.wire_bytes_by_axis == {"data": pytest.approx(2 * 7 / 8 * (ALL_ELEMENTS + 1) * FLOAT)}


def test_memory_flops_and_rendering(megatron):
    _, _, report = megatron
    assert set(report.memory) == {
        "arguments",
        "outputs",
        "temporaries",
        "aliased",
        "code",
        "live_peak",
        "total",
    }
    assert all(type(value) is int and value >= 0 for value in report.memory.values())
    assert min(report.memory["arguments"], report.memory["outputs"], report.memory["total"]) > 0
    assert report.flops_per_device > 0
    assert report.flops_unpartitioned / report.flops_per_device > 1

    data = report.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["mesh"] == {"data": DATA, "model": MODEL}
    assert data["collectives"] == {"all-reduce": report.count("all-reduce")}
    assert data["wire_bytes_per_device"] == report.wire_bytes
    assert len(data["transfers"]) == len(report.transfers)

    text = str(report)
    assert "Communication per training step on mesh data=2 × model=4" in text
    assert f"Sent per device per step: {format_bytes(report.wire_bytes)} (model: " in text
    rows = [[cell.strip() for cell in line.split("│")[1:-1]] for line in text.splitlines() if "│" in line]
    forward = (BATCH // DATA) * D_OUT * FLOAT
    wire = format_bytes(2 * (MODEL - 1) / MODEL * forward)
    assert ["down", "forward", "all-reduce", "model (4)", "1", format_bytes(forward), wire] in rows
    assert "Memory per device: " in text and "FLOPs per device: " in text


def test_report_leaves_the_model_untouched():
    distribution = kml.ModelParallel(
        kml.Mesh(data=DATA, model=MODEL), MEGATRON_RULES, batch_axis="data", replicate_below=0
    )
    model = compiled_model(distribution)
    x, y = batch()
    with distribution.scope():
        before = [np.array(v.value) for v in model.weights]
        shardings = [v.value.sharding for v in model.weights]
        kml.comm_report(model, x, y)
        assert int(model.optimizer.iterations.value) == 0
        for variable, value, sharding in zip(model.weights, before, shardings, strict=True):
            np.testing.assert_array_equal(np.asarray(variable.value), value, err_msg=variable.path)
            assert variable.value.sharding == sharding, variable.path

        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.value) == 1
    assert any(not np.array_equal(np.asarray(v.value), b) for v, b in zip(model.weights, before, strict=True))
