"""keras-hub text backbones under the automatic planner: plans, sharded training, preset loading.

Every `*Backbone` in `keras_hub.models` is either a row of `hub_models.ROWS`
(built tiny from a config, no download) or in `SKIPPED` with the reason; a new
text backbone in a later keras-hub fails `test_every_backbone_is_tested_or_skipped`.
"""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
import threading

import hub_models
import jax
import keras
import keras_hub
import numpy as np
import pytest
from helpers import assert_laid_out_as_planned, assert_same_weights, train, trim
from hub_models import ROWS, Row
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml

_IMAGE = "image model"
_MULTIMODAL = "multimodal: vision and text towers"
SKIPPED = {
    "Backbone": "base class",
    "FeaturePyramidBackbone": "base class of image feature pyramids",
    "BASNetBackbone": _IMAGE,
    "CSPNetBackbone": _IMAGE,
    "DFineBackbone": _IMAGE,
    "DINOV2Backbone": _IMAGE,
    "DINOV3Backbone": _IMAGE,
    "DeepLabV3Backbone": _IMAGE,
    "DeiTBackbone": _IMAGE,
    "DenseNetBackbone": _IMAGE,
    "DepthAnythingBackbone": _IMAGE,
    "EfficientNetBackbone": _IMAGE,
    "HGNetV2Backbone": _IMAGE,
    "MiTBackbone": _IMAGE,
    "MobileNetBackbone": _IMAGE,
    "MobileNetV5Backbone": _IMAGE,
    "PARSeqBackbone": "image model: text recognition from an image encoder",
    "ResNetBackbone": _IMAGE,
    "RetinaNetBackbone": _IMAGE,
    "SAMBackbone": _IMAGE,
    "SAM3PromptableConceptBackbone": "image segmentation prompted by text",
    "SegFormerBackbone": _IMAGE,
    "SwinTransformerBackbone": _IMAGE,
    "VGGBackbone": _IMAGE,
    "ViTBackbone": _IMAGE,
    "ViTDetBackbone": _IMAGE,
    "XceptionBackbone": _IMAGE,
    "MoonshineBackbone": "audio model (speech recognition)",
    "WhisperBackbone": "audio model (speech recognition)",
    "VideoPrismBackbone": "video model",
    "BLIP2Backbone": _MULTIMODAL,
    "CLIPBackbone": _MULTIMODAL,
    "MetaCLIP2Backbone": _MULTIMODAL,
    "PaliGemmaBackbone": _MULTIMODAL,
    "SigLIPBackbone": _MULTIMODAL,
    "Gemma3nBackbone": "multimodal: text, vision and audio",
    "FluxBackbone": "diffusion model",
    "StableDiffusion3Backbone": "diffusion model",
}

#: Backbones whose auto plan splits no weight over `model` (on either mesh):
#: exact, so a backbone that starts splitting must leave the list.
#: (RWKV-7 left it when the planner started reading the traced computation: its channel mixing
#: is a column → row pair whatever its names.)
UNSPLIT: set[str] = set()

MESHES = {"2x4": dict(data=2, model=4), "4x2": dict(data=4, model=2)}
STEPS = 2


def _params(rows, meshes):
    return [
        pytest.param(row, mesh, id=f"{row.name}-{mesh}", marks=hub_models.marks(row))
        for row in rows
        for mesh in meshes
    ]


def test_import_keras_hub_loads_no_tensorflow():
    """keras-hub is installed without its TensorFlow-text dependency and never imports TensorFlow."""
    code = (
        "import sys, keras_meshlayout, keras_hub\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'tensorflow_text'))\n"
        "assert not loaded, loaded\n"
    )
    env = dict(os.environ, KERAS_BACKEND="jax")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_every_backbone_is_tested_or_skipped():
    classes = {}
    for name in dir(keras_hub.models):
        if name.endswith("Backbone"):
            classes.setdefault(getattr(keras_hub.models, name), []).append(name)
    tested = {row.name for row in ROWS}
    covered = tested | set(SKIPPED)
    # Aliases (Qwen2Backbone is QwenBackbone) count once.
    missing = sorted(names[0] for names in classes.values() if not covered & set(names))
    assert not missing, f"keras-hub backbones neither tested nor skipped (add a row to ROWS): {missing}"
    assert not tested & set(SKIPPED)
    assert set(SKIPPED) <= {name for names in classes.values() for name in names}, "stale SKIPPED entries"


def _split_count(plan: kml.Plan) -> int:
    return sum("model" in entry.axes for entry in plan)


@pytest.mark.parametrize(("row", "mesh_name"), _params(ROWS, MESHES))
def test_auto_plan(row, mesh_name):
    """auto_rules plans every tiny backbone on both meshes with no warning; the split count is recorded."""
    mesh = kml.Mesh(**MESHES[mesh_name])
    build = hub_models.fresh_names(functools.partial(hub_models.build_backbone, row))
    with kml.dry_build(build) as backbone:
        rules = kml.auto_rules(backbone, mesh)
    plan = kml.dry_plan(build, kml.ModelParallel(mesh, rules))
    split = _split_count(plan)
    print(f"{row.name} on {mesh_name}: {split} of {len(plan)} variables split over 'model'")
    if row.name in UNSPLIT:
        assert split == 0, f"{row.name} now splits {split} variables: remove it from UNSPLIT"
    else:
        assert split > 0, f"the auto plan of {row.name} splits nothing over 'model'"


def _data(row: Row, steps: int):
    """`steps` batches of inputs for the backbone and class labels for the head."""
    with kml.dry_build(functools.partial(hub_models.build_backbone, row)) as backbone:
        batches = [hub_models.inputs_for(backbone, seed) for seed in range(steps)]
    x = {name: np.concatenate([batch[name] for batch in batches]) for name in batches[0]}
    y = np.random.default_rng(steps).integers(0, hub_models.CLASSES, size=steps * hub_models.BATCH)
    return x, y


@functools.cache
def _reference(row: Row, steps: int = STEPS) -> tuple:
    """The build function, the data, and the initial and single-device trained weights.

    Like `helpers.Reference`, with one build fewer: the model whose initial
    weights are taken is the one trained.
    """
    build = hub_models.fresh_names(functools.partial(hub_models.build_classifier, row))
    data = _data(row, steps)
    keras.utils.set_random_seed(42)
    model = build()
    initial = model.get_weights()
    trained = train(lambda: model, initial, data, batch_size=hub_models.BATCH).get_weights()
    moved = max(np.abs(a - b).max() for a, b in zip(initial, trained, strict=True))
    assert moved > 1e-3, "training must change the weights for the comparison to mean anything"
    return build, data, initial, trained


_CHAOTIC = (
    "keras-hub's {} trained data-parallel (kml.ModelParallel with no rule: no weight split) already "
    "differs from single-device by {} after two steps: float32 rounding, amplified (one step: {}), not "
    "the layout; single-device training from initial weights moved by one ulp differs by {} too"
)
_CONV_GRAD = (
    "XLA bug (jax 0.10.2, Shardy and GSPMD): the kernel gradient of the gated delta-net's depthwise "
    "conv1d (a batch_group_count convolution) is all-reduced over the whole mesh, not just 'data', so "
    "on 2x4 it is 4x too large even with no rule (kml.ModelParallel(mesh, LayoutRules([]))); "
    "conv1d_kernel is off by 0.05 after one step; data=8 and data=2 meshes agree to 1e-7"
)
#: Trained one step, compared to `ONE_STEP_ATOL`, and why: their second step amplifies float32
#: rounding past 1e-5 whatever the layout (measured with keras-hub 0.32.0, jax 0.10.2).
ONE_STEP = {"EdRecBackbone": _CHAOTIC.format("EdRec", "0.1", "5e-5", "0.08")}
#: One step of data-parallel training differs by up to 7e-5 there; a layout error moves weights by
#: the size of a step (1e-2 and more).
ONE_STEP_ATOL = 2e-4
_CONV_SPLIT = (
    "trains like one device since auto_rules splits the gated delta-net's depthwise conv1d kernel on its "
    "channels (planner/_convs.lone_grouped_convs): measured once, two steps under "
    "auto_rules(replicate_below=0), every weight within 2.4e-7 on 2x4 and 2.7e-7 on 4x2 (conv1d_kernel "
    "was 0.19 off on 2x4). Not trained here: the one-device run takes 150-200 s and each sharded fit "
    "210-240 s on 2 cores; the same pattern in small is trained in tests/test_grouped_conv.py. Under the "
    "default replicate_below this tiny config's 512-weight kernel is kept whole, and XLA's bug is back"
)
#: Planned above, not trained (the XLA bug of tests/test_grouped_conv.py: kml.GroupedConvWarning
#: cannot see a depthwise convolution inside a custom layer), with the reason.
NOT_TRAINED = {
    "Qwen3_5Backbone": _CONV_SPLIT,
    "Qwen3_5MoeBackbone": f"{_CONV_GRAD}. Measured before the planner split the conv's channels, as "
    "Qwen3_5Backbone's (its delta-net is the same layer); not measured since",
}
#: One backbone per family trained with `fit` against one device, on its mesh. Every row is planned
#: above and, in tests/test_zoo.py, planned with a budget and compiled against the prediction; a fit
#: per family is what those leave to prove (the fits of all ~40 rows were the suite's largest cost).
FITS = {
    "GPT2Backbone": ("2x4", "dense decoder: multi-head attention, learned positions"),
    "LlamaBackbone": ("4x2", "decoder with grouped-query attention: 2 key/value heads over 'model' (2)"),
    "BertBackbone": ("2x4", "encoder: token-type and position tables, post-norm"),
    "BartBackbone": ("2x4", "encoder-decoder: cross-attention"),
    "Qwen3MoeBackbone": ("2x4", "mixture of experts, expert-parallel (Mixtral's fit: tests/test_experts.py)"),
    "EdRecBackbone": ("2x4", "encoder-decoder trained one step (ONE_STEP)"),
}
TRAIN = [(row, FITS[row.name][0]) for row in ROWS if row.name in FITS]


def test_one_fit_per_family_and_the_special_tables_name_trained_rows():
    assert {row.name for row, _ in TRAIN} == set(FITS), "every FITS entry is a row of hub_models.ROWS"
    assert set(ONE_STEP) <= set(FITS), "a ONE_STEP backbone that is not trained: drop it"
    assert set(NOT_TRAINED) <= {row.name for row in ROWS} and not set(NOT_TRAINED) & set(FITS)


@pytest.mark.parametrize(
    ("row", "mesh_name"),
    [pytest.param(row, mesh, id=f"{row.name}-{mesh}", marks=hub_models.marks(row)) for row, mesh in TRAIN],
)
def test_sharded_fit_matches_single_device(row, mesh_name):
    """Backbone + head trained with `fit` under the auto plan equals the single-device run."""
    steps = 1 if row.name in ONE_STEP else STEPS
    build, data, initial, trained = _reference(row, steps)
    mesh = kml.Mesh(**MESHES[mesh_name])
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh)
    dist = kml.ModelParallel(mesh, rules)
    model = train(build, initial, data, dist, batch_size=hub_models.BATCH)
    if row.name in ONE_STEP:
        for variable, want in zip(model.weights, trained, strict=True):
            np.testing.assert_allclose(
                variable.value, want, atol=ONE_STEP_ATOL, rtol=0, err_msg=variable.path
            )
    else:
        assert_same_weights(model, trained)
    assert_laid_out_as_planned(model, dist.plan(model), mesh)


def _on_first_device(arrays) -> int:
    device = jax.devices()[0]
    return sum(
        shard.data.nbytes for array in arrays for shard in array.addressable_shards if shard.device == device
    )


def load_sharded_preset(preset: str, mesh: kml.Mesh) -> tuple[keras.Model, kml.ModelParallel]:
    """The README recipe: plan a preset from its config alone, then load its weights already sharded.

    The dry build reads only the preset's config (no weight is allocated), so
    `auto_rules` sees the structure; under the distribution, `from_preset`
    creates each variable sharded and loads the saved values into the shards.
    """

    def build():
        return keras_hub.models.Backbone.from_preset(preset, load_weights=False)

    with kml.dry_build(build) as backbone:
        rules = kml.auto_rules(backbone, mesh)
    dist = kml.ModelParallel(mesh, rules)
    keras.distribution.set_distribution(dist)
    return keras_hub.models.Backbone.from_preset(preset), dist


def test_preset_weights_load_sharded(tmp_path):
    """A locally saved preset loads under the distribution: saved values, planned layouts, a share each."""
    row = next(row for row in ROWS if row.name == "LlamaBackbone")
    config = dict(row.config, hidden_dim=128, intermediate_dim=512, num_query_heads=8, num_key_value_heads=4)
    keras.utils.set_random_seed(0)
    saved = row.cls(**config, name="backbone")
    saved.save_to_preset(str(tmp_path))
    expected = {variable.path: np.asarray(variable.value) for variable in saved.weights}
    full_bytes = sum(value.nbytes for value in expected.values())
    del saved
    gc.collect()

    mesh = kml.Mesh(data=2, model=4)
    before = {id(array) for array in jax.live_arrays()}
    backbone, dist = load_sharded_preset(str(tmp_path), mesh)
    gc.collect()
    # What the load left alive: arrays made since `before` (by identity, so arrays an earlier
    # test's garbage frees meanwhile do not hide a full copy kept somewhere).
    held = [array for array in jax.live_arrays() if id(array) not in before]
    variables = {id(variable.value) for variable in backbone.weights}
    extra = [array for array in held if id(array) not in variables]

    plan = dist.plan(backbone)
    assert [variable.path for variable in backbone.weights] == list(expected)
    for variable in backbone.weights:
        np.testing.assert_array_equal(
            np.asarray(variable.value), expected[variable.path], err_msg=variable.path
        )
        axes = plan[variable.path].axes
        want = NamedSharding(mesh.backend_mesh, PartitionSpec(*axes))
        assert variable.value.sharding.is_equivalent_to(want, len(variable.shape)), variable.path
        assert trim(variable.value.sharding.spec) == trim(PartitionSpec(*axes)), variable.path
    assert plan.bytes_per_device < 0.6 * full_bytes, "the plan should split most of this backbone"
    assert _on_first_device(variable.value for variable in backbone.weights) == plan.bytes_per_device
    threads = [thread.name for thread in threading.enumerate()]
    assert _on_first_device(extra) <= 4096, ([(a.shape, a.dtype, a.sharding) for a in extra], threads)
