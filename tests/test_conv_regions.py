"""A lone grouped convolution's channel split, carried by XLA through the values around it (issue 19).

`_convs.lone_grouped_convs` splits a depthwise kernel no unit took on its channels (with
them whole, XLA computes its gradient wrongly), and XLA then holds every value joined to it
by channel-wise operations split too: a ConvNeXt stage's residual stream, an Xception
block's. `planner/_conv_regions.py` finds that region, `ConvCosts.region_traffic` costs it.
Before, ConvNeXtTiny's model axis was predicted 0.600 of its compiled bytes and Xception's
0.690 (2x4); both are exact since, on 2x4 and 4x2. A convolution reading a concatenation (a
DenseNet's transition) is not split on its input channels at all: XLA would carry that split
back into every feature map the concatenation joins and reshuffle them each layer; nor is one
reading a token sequence laid out as an image (SegFormer's spatial reduction and patch merging):
XLA would carry it back through the transformer stage's residual stream.
"""

from __future__ import annotations

import functools

import keras
import keras_hub
import numpy as np
import pytest
from helpers import assert_predicted_as_compiled

import keras_meshlayout as kml
from keras_meshlayout.planner._conv_regions import channel_region
from keras_meshlayout.planner._trace import trace_model

L = keras.layers


def convnext_like(blocks: int = 2, channels: int = 32) -> keras.Model:
    """ConvNeXt's block as keras.applications writes it, small: depthwise 3 × 3, norm, MLP, residual."""
    images = keras.Input((8, 8, 3))
    x = L.Conv2D(channels, 2, strides=2, name="stem")(images)
    for i in range(blocks):
        y = L.DepthwiseConv2D(3, padding="same", name=f"dw{i}")(x)
        y = L.LayerNormalization(epsilon=1e-6, name=f"norm{i}")(y)
        y = L.Dense(4 * channels, activation="gelu", name=f"up{i}")(y)
        y = L.Dense(channels, name=f"down{i}")(y)
        x = L.Add(name=f"residual{i}")([x, y])
    return keras.Model(images, L.Dense(10, name="head")(L.GlobalAveragePooling2D(name="pool")(x)))


def convnext_stages() -> keras.Model:
    """Two ConvNeXt stages joined by its downsampling (a norm, a 2 × 2 convolution of stride 2)."""
    images = keras.Input((8, 8, 3))
    x = L.Conv2D(32, 2, strides=2, name="stem")(images)
    for stage, channels in enumerate((32, 64)):
        if stage:
            x = L.LayerNormalization(epsilon=1e-6, name=f"downsample{stage}_norm")(x)
            x = L.Conv2D(channels, 2, strides=2, name=f"downsample{stage}")(x)
        y = L.DepthwiseConv2D(3, padding="same", name=f"dw{stage}")(x)
        y = L.LayerNormalization(epsilon=1e-6, name=f"norm{stage}")(y)
        y = L.Dense(4 * channels, activation="gelu", name=f"up{stage}")(y)
        x = L.Add(name=f"residual{stage}")([x, L.Dense(channels, name=f"down{stage}")(y)])
    return keras.Model(images, L.Dense(10, name="head")(L.GlobalAveragePooling2D(name="pool")(x)))


def xception_like(size: int = 16) -> keras.Model:
    """Xception's entry-flow block and one middle-flow block as keras.applications writes them, small:
    separable convolutions under batch norms, a strided 1 × 1 convolution on the residual path."""
    images = keras.Input((size, size, 3))
    x = images
    for i, channels in enumerate((32, 64)):
        x = L.Conv2D(channels, 3, strides=2 - i, use_bias=False, name=f"block1_conv{i + 1}")(x)
        x = L.Activation("relu")(L.BatchNormalization(name=f"block1_conv{i + 1}_bn")(x))
    residual = L.Conv2D(128, 1, strides=2, padding="same", use_bias=False, name="residual")(x)
    residual = L.BatchNormalization(name="residual_bn")(residual)
    for i in range(2):
        x = L.Activation("relu")(x) if i else x
        x = L.SeparableConv2D(128, 3, padding="same", use_bias=False, name=f"block2_sepconv{i + 1}")(x)
        x = L.BatchNormalization(name=f"block2_sepconv{i + 1}_bn")(x)
    x = L.add([L.MaxPooling2D(3, strides=2, padding="same")(x), residual])
    residual = x
    for i in range(3):
        x = L.SeparableConv2D(128, 3, padding="same", use_bias=False, name=f"block3_sepconv{i + 1}")(
            L.Activation("relu")(x)
        )
        x = L.BatchNormalization(name=f"block3_sepconv{i + 1}_bn")(x)
    x = L.add([x, residual])
    return keras.Model(images, L.Dense(10, name="head")(L.GlobalAveragePooling2D(name="pool")(x)))


def _batch(count: int = 16, shape: tuple[int, ...] = (8, 8, 3)) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.uniform(0, 1, (count, *shape)).astype("float32"), rng.integers(0, 10, count)


def _mesh(shape: str) -> kml.Mesh:
    data, model = map(int, shape.split("x"))
    return kml.Mesh(data=data, model=model)


def test_the_region_runs_from_each_depthwise_conv_to_the_projections_around_it():
    """Both blocks' depthwise convs share one region, the residual stream: it leaves at each `up`
    (and the head), enters from each `down` and the stem, and meets three norm reductions a block."""
    with kml.dry_build(convnext_like) as model:
        trace = trace_model(model, _batch()[0])
    seeds = [n.index for n in trace.nodes if n.params.get("feature_group_count", 1) > 1]
    assert len(seeds) == 2

    def kind(node) -> str:  # as the plan lays them out: `up` a column, `down` a row, the rest whole
        reads = {trace.variables.get(v, "") for v in node.inputs}
        return "out" if any("up" in r for r in reads) else "in" if any("down" in r for r in reads) else ""

    region = channel_region(trace, seeds, kind)

    def layers(pairs) -> list[str]:
        return sorted(
            next(trace.variables[v].split("/")[0] for v in trace.nodes[i].inputs if v in trace.variables)
            for _, i in pairs
        )

    assert layers(region.exits) == ["head", "up0", "up1"]
    assert layers(region.entries) == ["down0", "down1", "stem"]
    assert len(region.reductions) == 6
    assert {"norm0/gamma", "norm1/beta", "dw0/bias", "down1/bias"} <= set(region.vectors)


@pytest.mark.parametrize("shape", ["2x4", "4x2"])
def test_a_convnext_like_block_sends_what_its_region_predicts(shape):
    """Predicted = compiled ± 2% per axis (exact on both; the model axis fails without the region costed)."""
    build = functools.partial(convnext_like)
    x, y = _batch()
    mesh = _mesh(shape)
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh, replicate_below=0, batch=x, optimizer="adam")
    axes = {"/".join(r.pattern.split("/")[-2:]): r.axes for r in rules.rules}
    assert axes["dw0/kernel"] == (None, None, "model", None)  # a lone grouped conv: the region's seed
    assert axes["up0/kernel"] == (None, "model") and axes["down0/kernel"] == ("model", None)
    assert_predicted_as_compiled(build, rules, kml.ModelParallel(mesh, rules, replicate_below=0), x, y)


@pytest.mark.parametrize(
    ("name", "size", "shape"),
    [("ConvNeXtTiny", 32, "2x4"), ("Xception", 71, "4x2")],
    ids=["ConvNeXtTiny-2x4", "Xception-4x2"],
)
def test_keras_applications_depthwise_convnets_send_what_is_predicted(name, size, shape):
    """Exact on every axis (also ConvNeXtTiny at 64 × 64 on 4x2 and Xception on 2x4, measured):
    each stage's first blocks gather twice, where the gathered activation outgrows twice the
    kernel's shard. And the peak within 10%: Xception's 0.840 on 4x2 (under) before its pointwise
    kernels' transposed copies were held from the forward pass (`_propagate.Specs._early`), 0.974
    since (1.004 on 2x4, was 0.898); ConvNeXtTiny's 1.002."""
    build = functools.partial(
        getattr(keras.applications, name), weights=None, input_shape=(size, size, 3), classes=10
    )
    x, y = _batch(16, (size, size, 3))
    mesh = _mesh(shape)
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    for axis, measured in step.comm.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis
    assert 0.9 <= rules.cost.peak_bytes / step.peak_bytes <= 1.1, (rules.cost.peak_bytes, step.peak_bytes)


#: (build, image size, predicted ÷ compiled peak on XLA:TPU) for `test_on_xla_tpu_depthwise_convnets_...`.
ON_TPU = {
    "ConvNeXtTiny": (functools.partial(keras.applications.ConvNeXtTiny, weights=None, classes=10), 32, 0.703),
    # keras.applications' Xception itself was this row until 2026-12-07 (72 CPU-s of the suite for
    # XLA:TPU's compile): 'model' 1.004 and its peak 0.755, measured. Its blocks here: 'model' 1.017
    # (1.052 with the pointwise input gradient summed in float32), the peak as a small convnet's, its
    # 16 KiB slots in HBM (`_tpu_memory.warn_convnet_peak`).
    "xception-like": (lambda input_shape, classes: xception_like(input_shape[0]), 16, 0.094),
}


@pytest.mark.parametrize(("build", "size", "peak"), list(ON_TPU.values()), ids=list(ON_TPU))
def test_on_xla_tpu_depthwise_convnets_send_what_their_regions_predict(build, size, peak):
    """Depthwise convnets for TPU v5e 2x4, 'model' bytes predicted ÷ compiled: ConvNeXtTiny 1.084
    and Xception 1.314 before XLA:TPU's ways were followed, 1.001 and 1.004 since (ConvNeXtTiny 1.007
    at 64 × 64 on 4x2, measured): each gathered activation cast to bfloat16 for the dots that read it
    (not on ConvNeXt's last stage, one position a device), an exit's input gathered again backward, an
    entry's output gradient twice except for the region's first two entries (once), a norm's
    reductions summed once each, the channel-wise weights all-reduced after the update where XLA:CPU
    gathers them, and a separable convolution's pointwise input gradient summed in bfloat16."""
    build = functools.partial(build, input_shape=(size, size, 3), classes=10)
    x, y = _batch(16, (size, size, 3))
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    with (
        kml.dry_build(build) as model,
        pytest.warns(kml.MeshLayoutWarning, match="XLA:TPU's peak of a convnet's step is an estimate"),
    ):
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    assert set(step.comm.wire_bytes_by_axis) == {"data", "model"}
    for axis, measured in step.comm.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] == pytest.approx(measured, rel=0.02), axis
    # The peak the warning is about: its temporaries in HBM are not predicted (docs/status.md).
    assert rules.cost.peak_bytes / step.peak_bytes == pytest.approx(peak, abs=0.01)


def densenet_like(layers: int = 2, growth: int = 16) -> keras.Model:
    """DenseNet's dense block and transition as keras.applications writes them, small."""
    images = keras.Input((8, 8, 3))
    x = L.Conv2D(32, 3, padding="same", use_bias=False, name="stem")(images)
    for i in range(layers):
        y = L.Activation("relu")(L.BatchNormalization(name=f"block{i}_0_bn")(x))
        y = L.Conv2D(4 * growth, 1, use_bias=False, name=f"block{i}_1_conv")(y)
        y = L.Activation("relu")(L.BatchNormalization(name=f"block{i}_1_bn")(y))
        y = L.Conv2D(growth, 3, padding="same", use_bias=False, name=f"block{i}_2_conv")(y)
        x = L.Concatenate(name=f"block{i}_concat")([x, y])
    x = L.Activation("relu")(L.BatchNormalization(name="pool_bn")(x))
    x = L.AveragePooling2D(2, name="pool")(L.Conv2D(32, 1, use_bias=False, name="pool_conv")(x))
    x = L.GlobalAveragePooling2D(name="avg")(x)
    return keras.Model(images, L.Dense(10, name="head")(x), name="densenet_like")


@pytest.mark.parametrize("shape", ["2x4", "4x2"])
def test_a_convolution_reading_a_concatenation_stays_whole_and_the_step_sends_what_is_predicted(shape):
    """Split on its input channels (a lone conv), the transition conv made XLA reshuffle the whole
    dense block (keras.applications DenseNet121 on 2x4: `model` 0.529 of the compiled bytes, and
    28.9 MB a step against 19.8 MB with its transitions whole, predicted to the byte since). Here,
    split: `model` 0.563 (2x4) and 0.534 (4x2) of the compiled bytes, 992,972 and 425,538 bytes a
    step; whole: exact, 384,812 and 212,290."""
    x, y = _batch()
    mesh = _mesh(shape)
    with kml.dry_build(densenet_like) as model:
        rules = kml.auto_rules(model, mesh, replicate_below=0, batch=x, optimizer="adam")
    rule = next(r for r in rules.rules if r.pattern.endswith("pool_conv/kernel"))
    assert rule.axes == (None, None, None, None)
    assert "reads a concatenation" in rule.note
    assert rules.cost.layouts()["tensor-parallel"] >= 1  # the dense layers' convolutions, as units
    assert_predicted_as_compiled(
        densenet_like, rules, kml.ModelParallel(mesh, rules, replicate_below=0), x, y
    )


@pytest.mark.parametrize("shape", ["1x8", "2x4"])
def test_a_downsampling_convolution_split_alone_seeds_the_region_before_it(shape):
    """On 1x8 nothing splits the depthwise kernels (nothing is summed over a batch axis of 1), yet
    the downsampling convolution, split on its input channels alone, makes XLA hold the first
    stage split over `model` (its depthwise convolution computed on split channels, its kernel
    updated split); on 2x4 the depthwise convolutions' own region holds it already."""
    x, y = _batch()
    mesh = _mesh(shape)
    with kml.dry_build(convnext_stages) as model:
        rules = kml.auto_rules(model, mesh, replicate_below=0, batch=x, optimizer="adam")
    axes = {"/".join(r.pattern.split("/")[-2:]): r.axes for r in rules.rules}
    assert axes["downsample1/kernel"] == (None, None, "model", None)
    assert ("model" in axes["dw0/kernel"]) == (shape == "2x4")
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    assert_predicted_as_compiled(convnext_stages, rules, dist, x, y)


def mit() -> keras.Model:
    """keras-hub's Mix Transformer (SegFormer's encoder), two small stages, under a pooled head."""
    backbone = keras_hub.models.MiTBackbone(
        layerwise_depths=[1, 1],
        num_layers=2,
        layerwise_num_heads=[1, 2],
        layerwise_sr_ratios=[2, 1],
        max_drop_path_rate=0.0,
        layerwise_patch_sizes=[7, 3],
        layerwise_strides=[4, 2],
        image_shape=(32, 32, 3),
        hidden_dims=[32, 64],
    )
    pooled = L.GlobalAveragePooling2D()(backbone.output)  # its last stage laid out as an image
    return keras.Model(backbone.input, L.Dense(10, name="head")(pooled), name="mit")


@pytest.mark.parametrize("shape", ["2x4", "4x2"])
def test_a_convolution_reading_a_token_sequence_stays_whole_and_the_step_sends_what_is_predicted(shape):
    """Split on its input channels (a lone conv), the spatial-reduction and patch-merging convolutions
    made XLA hold the first stage's residual stream split over `model`, its layer norms all-reduced
    and every projection's input gathered, forward and backward (64 × 64 images on 2x4: `model`
    0.489 of the compiled bytes, 3,013,056 a step; whole: exact, 1,179,648, 2.6x less)."""
    x, y = _batch(shape=(32, 32, 3))
    mesh = _mesh(shape)
    with kml.dry_build(mit) as model:
        rules = kml.auto_rules(model, mesh, replicate_below=0, batch=x, optimizer="adam")
    convs = [r for r in rules.rules if "token sequence laid out as an image" in r.note]
    assert [r.pattern.split("/")[0] for r in convs] == ["hierarchical_encoder_0_0", "patch_and_embed_1"]
    assert all(r.axes == (None,) * 4 for r in convs), convs
    assert rules.cost.layouts()["tensor-parallel"] >= 2  # the Mix-FFN pairs, their depthwise conv inside
    assert_predicted_as_compiled(mit, rules, kml.ModelParallel(mesh, rules, replicate_below=0), x, y)


def vitdet() -> keras.Model:
    """keras-hub's ViTDet (windowed attention, a convolutional neck), small, under a pooled head."""
    backbone = keras_hub.models.ViTDetBackbone(
        hidden_size=64,
        num_layers=2,
        intermediate_dim=256,
        num_heads=4,
        global_attention_layer_indices=[1],
        image_shape=(64, 64, 3),
        patch_size=8,
        window_size=4,
        num_output_channels=32,
    )
    pooled = L.GlobalAveragePooling2D()(backbone.output)
    return keras.Model(backbone.input, L.Dense(10, name="head")(pooled), name="vitdet")


def test_a_whole_convolution_entering_a_region_is_updated_split_and_its_output_gradient_gathered_once():
    """ViTDet's neck: a 1 x 1 convolution, a norm, a 3 x 3 convolution split on its input channels.
    XLA computes the 1 x 1 kernel's gradient split from the split output gradient, updates it split
    and gathers it after, and gathers the output gradient once, for the input gradient (64 x 64
    images on 2x4: `model` 1.032 and `data` 1.021 of the compiled bytes while costed as gathered
    twice, updated whole; exact since)."""
    x, y = _batch(shape=(64, 64, 3))
    mesh = _mesh("2x4")
    with kml.dry_build(vitdet) as model:  # the default policy: the 1 x 1 kernel (2,048) stays whole
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    split = [r for r in rules.rules if r.axes == (None, None, "model", None)]
    assert len(split) == 1 and "no unit" in split[0].note, split  # the neck's 3 x 3, split alone
    assert_predicted_as_compiled(vitdet, rules, kml.ModelParallel(mesh, rules), x, y)
