"""Issue 21: kernels split over the batch axis in fully sharded plans, as XLA:CPU gathers them.

`planner/_batch_gathers.py` says how often a kernel split over `data` is gathered in a step. Over a
2-device batch axis XLA:CPU gathers a row kernel again for its input gradient when the projection's
output on one device is at most 1/model of the kernel's gathered copy; each case below sits on one
side of that line. A small head split over both axes after a `LayerNormalization` is the remaining
miss: its input gradient comes back split on its features, and XLA:CPU runs the norm's backward
pass in that layout (the collectives pinned below), which the planner does not cost yet.
"""

from __future__ import annotations

import collections
import dataclasses
import functools

import hub_models
import jax
import keras
import numpy as np
import pytest
from helpers import compiled_step

import keras_meshlayout as kml
from keras_meshlayout.planner._auto import plan_rules


def mlp(features: int, width: int, outputs: int):
    def build() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(width, activation="relu", name="up"),
                keras.layers.Dense(outputs, name="down"),
            ],
            name="mlp",
        )

    return build


def norm_head() -> keras.Model:
    """Input 8 → Dense 256 → LayerNormalization → Dense 10 (the head's kernel 2,560 elements)."""
    inputs = keras.Input((8,))
    hidden = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(256, name="wide")(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden), name="small")


@functools.cache
def fully_sharded_step(build, data: int, model: int, rows: int, replicate_below: int | None = None):
    """`build()`'s fully sharded plan on `data × model` of the 8 devices, and its compiled Adam step."""
    x = np.zeros((rows, *build().input_shape[1:]), "float32")
    y = np.zeros((rows, *build().output_shape[1:]), "float32")
    mesh = kml.Mesh(data=data, model=model, devices=jax.devices()[: data * model])
    with kml.dry_build(build) as probe:
        rules = plan_rules(
            probe, mesh, batch=x, optimizer="adam", fully_sharded=True, replicate_below=replicate_below
        )
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam")
    return rules, step


#: (features, width, outputs, mesh, rows, gathers of the row kernel): its gathered copy is
#: `width / model × outputs`, its output on one device `rows / 2 × outputs`.
REGATHERED = [
    (32, 256, 128, (2, 4), 32, 2),  # 16 × 128 output = 1/4 of the 64 × 128 copy: gathered again
    (32, 256, 128, (2, 4), 40, 1),  # 20 × 128: kept
    (32, 256, 128, (2, 2), 128, 2),  # 64 × 128 = 1/2 of the 128 × 128 copy
    (32, 256, 128, (2, 2), 144, 1),  # 72 × 128
    (64, 512, 64, (2, 4), 16, 2),  # tests/test_mesh_choice.py's MLP, 8 rows per device (was 0.862)
]


@pytest.mark.parametrize(
    ("features", "width", "outputs", "mesh", "rows", "gathers"),
    REGATHERED,
    ids=["2x4-again", "2x4-kept", "2x2-again", "2x2-kept", "2x4-mesh-choice"],
)
def test_a_row_kernel_over_a_2_device_batch_axis_is_gathered_again_when_its_output_is_small(
    features, width, outputs, mesh, rows, gathers
):
    rules, step = fully_sharded_step(mlp(features, width, outputs), *mesh, rows)
    assert rules.match("mlp/down/kernel").axes == ("model", "data")
    copy = (width // mesh[1], outputs)
    counted = collections.Counter(
        t.phase
        for t in step.comm.transfers
        if t.kind == "all-gather" and t.axes == ("data",) and t.shape == copy
    )
    assert sum(counted.values()) == gathers and counted["forward"] == 1, counted
    assert rules.cost.wire_bytes == pytest.approx(step.comm.wire_bytes, rel=1e-9)


def deep_mlp() -> keras.Model:
    """Two Dense pairs, 64 → 512 → 64 → 512 → 64: the first pair's row kernel feeds the second pair."""
    layers = [keras.Input((64,))]
    for index, width in enumerate((512, 64, 512, 64)):
        layers.append(
            keras.layers.Dense(width, activation="relu" if index % 2 == 0 else None, name=f"d{index}")
        )
    return keras.Sequential(layers, name="deep")


def test_a_row_kernel_read_by_the_next_layer_is_gathered_once():
    """16 rows on 2×4: `d1`'s output (8 × 64 a device) is as small beside its gathered copy (128 × 64) as
    `d3`'s, but it feeds `d2`: XLA:CPU gathers `d1` once, `d3` (whose output is the model's) twice."""
    rules, step = fully_sharded_step(deep_mlp, 2, 4, 16)
    assert rules.match("deep/d1/kernel").axes == rules.match("deep/d3/kernel").axes == ("model", "data")
    counted = collections.Counter(
        t.layer
        for t in step.comm.transfers
        if t.kind == "all-gather" and t.axes == ("data",) and t.shape == (128, 64)
    )
    assert counted == {"d1": 1, "d3": 2}


#: (backbone, data axis, rows of 8 tokens): one-layer keras-hub decoders fully sharded over
#: `data=D,model=1`.
FEEDING_THE_NEXT_LAYER = [("LlamaBackbone", 8, 8), ("MixtralBackbone", 4, 8), ("LlamaBackbone", 4, 32)]


@pytest.mark.parametrize(("name", "data", "rows"), FEEDING_THE_NEXT_LAYER, ids=lambda value: str(value))
def test_kernels_gathered_whole_over_4_devices_or_more_feeding_the_next_layer_are_gathered_once(
    name, data, rows
):
    """Over `data` ≥ 4 with `model=1`, each attention and feed-forward kernel (larger than its
    projection's activations on one device) is gathered once, for the forward pass and its input
    gradient both; they were costed as gathered again (Llama 1.29x the compiled bytes on `data=4` and
    `data=8`, the small Mixtral 1.10x on `data=4`), as a kernel whose output is the model's is. At 32
    rows the token table (its 128 rows split over `data` alone) is gathered, not its looked-up rows
    moved: the batch's rows outweigh it (2 layers: 1.295x, then 1.099x before that, now exact; the
    one layer here 0.9986x, the pooled head's input gradient sending 576 bytes more than costed)."""
    row = next(row for row in hub_models.ROWS if row.name == name)
    build = functools.partial(
        hub_models.build_classifier, dataclasses.replace(row, config=dict(row.config, num_layers=1))
    )
    mesh = kml.Mesh(data=data, model=1, devices=jax.devices()[:data])
    with kml.dry_build(build) as model:
        repeat = rows // hub_models.BATCH
        x = {name: np.tile(ids, (repeat, 1)) for name, ids in hub_models.inputs_for(model).items()}
        y = np.zeros(rows, "int32")
        rules = plan_rules(model, mesh, batch=x, optimizer="adam", fully_sharded=True, replicate_below=0)
    report, state = compiled_step(build, kml.ModelParallel(mesh, rules), x, y)
    gathers = collections.Counter(
        t.layer for t in report.transfers if t.kind == "all-gather" and len(t.shape) >= 2
    )
    # (The expert bank's own gathers, of its tokens rather than its kernels, are `_expert_gathers`'.)
    projections = {
        layer: count
        for layer, count in gathers.items()
        if ("self_attention/" in layer or "feedforward" in layer) and "/experts" not in layer
    }
    assert len(projections) >= 5 and set(projections.values()) == {1}, projections
    within = 1e-9 if rows == hub_models.BATCH else 2e-3
    assert rules.cost.wire_bytes_by_axis == pytest.approx(report.wire_bytes_by_axis, rel=within)
    assert rules.cost.state_bytes == state


@pytest.mark.xfail(strict=True, reason="measured 1.226 of XLA:CPU's bytes (1.137 while d3 was counted once)")
def test_two_dense_pairs_fully_sharded_send_what_xla_compiles():
    """Over a 2-device batch axis XLA:CPU computes the middle projections' weight gradients from gathered
    activations (`d1`'s input, `d2`'s output gradient, 16 × 128 over `data`, and moves over both axes)
    instead of all-reducing them over `data`: not yet predicted."""
    rules, step = fully_sharded_step(deep_mlp, 2, 4, 16)
    assert rules.cost.wire_bytes == pytest.approx(step.comm.wire_bytes, rel=0.02)


#: A fully sharded head after a norm: predicted ÷ compiled bytes over `data×model`.
NORM_HEAD = [
    pytest.param(
        64,
        marks=pytest.mark.xfail(strict=True, reason="measured 0.756 over data×model, 0.792 in all"),
        id="dy-smaller-than-the-kernel",
    ),
    pytest.param(256, id="dy-as-large"),  # 1.000: the kernel's gathered copy makes the input gradient
]


@pytest.mark.parametrize("rows", NORM_HEAD)
def test_a_fully_sharded_head_after_a_norm_sends_what_xla_compiles(rows):
    rules, step = fully_sharded_step(norm_head, 2, 4, rows, replicate_below=0)
    assert rules.match("head/kernel").axes == (("data", "model"), None)
    for axis, measured in step.comm.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] == pytest.approx(measured, rel=0.02), axis


def test_the_norm_before_a_head_split_on_its_input_features_runs_its_backward_pass_split_on_features():
    """What XLA:CPU emits at 64 rows on 2×4, the head's output gradient (64 × 10) smaller than its
    kernel (256 × 10): the head's input gradient comes out split 8 ways on its 256 features, the norm's
    backward pass follows that layout and the gradient is gathered whole over both axes for `wide`.
    Each of three [64, 256] activations is moved from batch shards to feature shards (two all-to-alls
    over `data` of 32 × 32, one collective-permute over both axes of 64 × 32), the rows' statistics
    (64 values) are summed over both axes; no weight before the head all-reduces its gradient over
    `data` (every device holds the whole batch's gradient), and the norm's scale is gathered once."""
    _, step = fully_sharded_step(norm_head, 2, 4, 64, replicate_below=0)
    moved = collections.Counter(
        (t.kind, t.axes, t.shape) for t in step.comm.transfers if t.layer == "norm" and t.phase == "backward"
    )
    assert moved[("all-to-all", ("data",), (32, 1, 1, 32))] == 6
    assert moved[("collective-permute", ("data", "model"), (64, 1, 32))] == 3
    assert moved[("all-reduce", ("data", "model"), (64,))] == 2
    gathered = [
        t
        for t in step.comm.transfers
        if t.layer == "wide" and t.phase == "backward" and t.kind == "all-gather"
    ]
    assert [(t.axes, t.shape) for t in gathered] == [(("data", "model"), (64, 256))]
    summed = {t.layer for t in step.comm.transfers if t.kind == "all-reduce" and t.axes == ("data",)}
    assert summed == {"head", "(loss)"}
    scale = [
        t for t in step.comm.transfers if t.layer == "norm" and t.kind == "all-gather" and t.shape == (256,)
    ]
    assert len(scale) == 2  # the scale and the offset, forward only (the plan counts the scale twice)
