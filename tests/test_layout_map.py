"""keras-hub's own layout maps through our resolution (`kml.rules_from_layout_map`).

keras-hub's `get_layout_map` splits key/value kernels over both mesh axes; with
2 key/value heads that crashes plain Keras inside JAX on Gemma at 2×4 and on
Llama/Qwen at 4×2. Converted to `LayoutRules`, the same maps are replicated on
the offending dimension with a recorded reason, or refused with our error.
"""

from __future__ import annotations

import re

import keras
import keras_hub
import numpy as np
import pytest
from helpers import Reference, assert_laid_out_as_planned, assert_same_weights, train

import keras_meshlayout as kml

BATCH = 16
LENGTH = 8
TINY = dict(
    vocabulary_size=128,
    num_layers=2,
    num_query_heads=4,
    num_key_value_heads=2,
    hidden_dim=64,
    intermediate_dim=128,
)

#: Backbone, mesh (batch × model), the key/value kernel and the dimension that cannot split.
CRASHES = [
    ("Gemma", (2, 4), "decoder_block_0/attention/key/kernel", 0, "model", 4),
    ("Llama", (4, 2), "transformer_layer_0/self_attention/key/kernel", 1, "batch", 4),
    ("Qwen", (4, 2), "transformer_layer_0/self_attention/key/kernel", 1, "batch", 4),
]
IDS = [f"{name}-{shape[0]}x{shape[1]}" for name, shape, *_ in CRASHES]


def build_backbone(name: str) -> keras.Model:
    extra = {"head_dim": 16, "dropout": 0.0} if name == "Gemma" else {"dropout": 0.0}
    return getattr(keras_hub.models, f"{name}Backbone")(**TINY, **extra)


def mesh_of(shape: tuple[int, int]) -> kml.Mesh:
    return kml.Mesh(batch=shape[0], model=shape[1])


def hub_map(name: str, mesh: kml.Mesh) -> keras.distribution.LayoutMap:
    return getattr(keras_hub.models, f"{name}Backbone").get_layout_map(mesh)


# -- the conversion --------------------------------------------------------------


def hand_made_map() -> keras.distribution.LayoutMap:
    layout_map = keras.distribution.LayoutMap(kml.Mesh(data=2, model=4))
    layout_map["block.*dense.kernel"] = (None, "model")
    layout_map["block_0/dense/kernel"] = ("model", None)  # a plain path: Keras prefers it
    layout_map["block.*dense/output"] = ("data", None)
    return layout_map


@pytest.mark.parametrize(
    "matching, path, expected",
    [
        ("fullmatch", "block_0/dense/kernel", ("model", None)),  # exact key first
        ("fullmatch", "block_1/dense/kernel", (None, "model")),
        ("fullmatch", "model/block_1/dense/kernel", None),  # fullmatch: anchored at both ends
        ("search", "model/block_1/dense/kernel", (None, "model")),  # search: anywhere
        ("search", "block_0/dense/kernel", ("model", None)),
        ("search", "model/block_1/dense/output", ("data", None)),
        ("fullmatch", "block_1/dense/output", ("data", None)),
    ],
)
def test_conversion_matches_what_keras_matches(matching, path, expected):
    rules = kml.rules_from_layout_map(hand_made_map(), matching=matching)
    rule = rules.match(path)
    assert (None if rule is None else rule.axes) == expected
    if rule is not None:
        assert re.fullmatch(r"from LayoutMap key '.*' \(re\.(search|fullmatch)\)", rule.note)


def test_conversion_follows_the_installed_keras():
    """Keras 3.14+ full-matches keys; the default follows whatever Keras is installed."""
    layout_map = hand_made_map()
    default = kml.rules_from_layout_map(layout_map)
    for path in ("block_0/dense/kernel", "block_1/dense/kernel", "x/block_1/dense/kernel"):
        want = layout_map[path]
        got = default.match(path)
        assert (None if want is None else tuple(want.axes)) == (None if got is None else got.axes)


def test_converted_rules_are_the_users_own():
    """Regression (issue 12): replicate_below overrode a map's rules for small matrices."""
    rules = kml.rules_from_layout_map(hand_made_map())
    assert not any(rule.suggested for rule in rules.rules)
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    resolution = distribution.resolve("block_1/dense/kernel", (16, 16))  # 256 elements
    assert resolution.axes == (None, "model")
    assert resolution.reasons[0].startswith("small: 256 elements < replicate_below=4096, split anyway")


def test_conversion_refuses_what_is_not_a_layout_map():
    with pytest.raises(kml.InvalidRuleError, match=r"needs a keras\.distribution\.LayoutMap"):
        kml.rules_from_layout_map({"dense/kernel": (None, "model")})
    with pytest.raises(kml.InvalidOptionError, match="matching must be"):
        kml.rules_from_layout_map(hand_made_map(), matching="match")


# -- keras-hub's maps: a crash in Keras, a reason or our error here ---------------


@pytest.mark.parametrize("name, shape, path, dim, axis, size", CRASHES, ids=IDS)
def test_plain_keras_crashes_in_jax(name, shape, path, dim, axis, size):
    mesh = mesh_of(shape)
    distribution = keras.distribution.ModelParallel(layout_map=hub_map(name, mesh), batch_dim_name="batch")
    with pytest.raises(ValueError) as raised, distribution.scope():
        build_backbone(name)
    assert type(raised.value).__name__ == "IndivisibleError"  # jax._src.sharding: no variable named
    assert type(raised.value).__module__.startswith("jax")


@pytest.mark.parametrize("name, shape, path, dim, axis, size", CRASHES, ids=IDS)
def test_ours_replicates_with_the_reason(name, shape, path, dim, axis, size):
    mesh = mesh_of(shape)
    rules = kml.rules_from_layout_map(hub_map(name, mesh))
    distribution = kml.ModelParallel(
        mesh, rules, batch_axis="batch", on_indivisible="replicate", replicate_below=0
    )
    with pytest.warns(kml.IndivisibleShapeWarning) as warned, distribution.scope():
        model = build_backbone(name)
    assert any(repr(path) in str(warning.message) for warning in warned)
    entry = distribution.plan(model)[path]
    assert entry.requested[dim] == axis and entry.axes[dim] is None
    assert entry.reasons == (f"dimension {dim} (size 2) does not divide by mesh axis {axis!r} (size {size})",)
    assert entry.rule.note.startswith("from LayoutMap key")


@pytest.mark.parametrize("name, shape, path, dim, axis, size", CRASHES, ids=IDS)
def test_ours_refuses_with_the_error_policy(name, shape, path, dim, axis, size):
    mesh = mesh_of(shape)
    rules = kml.rules_from_layout_map(hub_map(name, mesh))
    distribution = kml.ModelParallel(
        mesh, rules, batch_axis="batch", on_indivisible="error", replicate_below=0
    )
    with pytest.raises(kml.IndivisibleShapeError) as raised, distribution.scope():
        build_backbone(name)
    message = str(raised.value)
    for part in (repr(path), f"dimension {dim} (size 2)", f"mesh axis {axis!r} of size {size}"):
        assert part in message


def build_classifier() -> keras.Model:
    backbone = build_backbone("Gemma")
    inputs = {key: keras.Input((LENGTH,), dtype="int32", name=key) for key in backbone.input}
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled), name="classifier")


def test_converted_gemma_map_trains_like_one_device():
    mesh = mesh_of((2, 4))
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 128, size=(BATCH * 2, LENGTH)).astype("int32")
    data = ({"token_ids": ids, "padding_mask": np.ones_like(ids)}, rng.integers(0, 10, size=BATCH * 2))
    reference = Reference(build_classifier, data, BATCH)
    rules = kml.rules_from_layout_map(hub_map("Gemma", mesh))
    distribution = kml.ModelParallel(mesh, rules, batch_axis="batch", replicate_below=0)
    with pytest.warns(kml.IndivisibleShapeWarning):
        model = train(build_classifier, reference.initial, data, distribution, BATCH)
    assert_same_weights(model, reference.trained)
    plan = distribution.plan(model)
    assert_laid_out_as_planned(model, plan, mesh)
    assert plan["decoder_block_0/attention/query/kernel"].axes == ("model", "batch", None)
