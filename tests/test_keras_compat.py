"""Drop-in for `keras.distribution` (issue 12): Keras's call forms on our classes, with Keras's meaning.

`kml.Mesh`, `kml.LayoutRules` and `kml.ModelParallel` are used here exactly as Keras's
`DeviceMesh`, `LayoutMap` and `ModelParallel` are (as Keras's own tests, the keras-io
distribution guide and keras-hub's `get_layout_map` use them), next to our own forms. The
guide's model and a keras-hub Gemma map train with `model.fit` equal to the same code with
plain Keras classes. The last table is the documented list of deliberate differences: each
row asserts our behaviour and, where we raise or warn, that the message says what Keras does.
"""

from __future__ import annotations

import re
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import keras
import keras_hub
import numpy as np
import pytest

import keras_meshlayout as kml

KERAS = types.SimpleNamespace(
    DeviceMesh=keras.distribution.DeviceMesh,
    LayoutMap=keras.distribution.LayoutMap,
    ModelParallel=keras.distribution.ModelParallel,
)
OURS = types.SimpleNamespace(DeviceMesh=kml.Mesh, LayoutMap=kml.LayoutRules, ModelParallel=kml.ModelParallel)
NAMESPACES = [KERAS, OURS]
NAMESPACE_IDS = ["keras", "kml"]


def device_names() -> list[str]:
    return keras.distribution.list_devices()  # ["cpu:0", ...], as the guide and keras-hub pass them


# -- constructors: DeviceMesh ---------------------------------------------------------------


@pytest.mark.parametrize(
    "build, names, ids",
    [
        (lambda: kml.Mesh((2, 4), ["data", "model"], device_names()), ["data", "model"], range(8)),
        (
            lambda: kml.Mesh(shape=(4, 2), axis_names=["batch", "model"], devices=device_names()),
            ["batch", "model"],
            range(8),
        ),
        (lambda: kml.Mesh((8,), ["data"]), ["data"], range(8)),
        (lambda: kml.Mesh((2, 2), ("data", "model"), jax.devices()[4:]), ("data", "model"), range(4, 8)),
        (
            lambda: kml.Mesh((2, 4), ["data", "model"], np.array(device_names()[::-1]).reshape(4, 2)),
            ["data", "model"],
            range(7, -1, -1),
        ),
        (lambda: kml.Mesh(data=2, model=4, devices=device_names()), ("data", "model"), range(8)),
        (
            lambda: kml.Mesh(data=2, model=4, devices=np.array(jax.devices()).reshape(2, 4)),
            ("data", "model"),
            range(8),
        ),
        (lambda: kml.Mesh({"data": 2, "model": 4}), ("data", "model"), range(8)),
    ],
    ids=[
        "keras-positional-strings",
        "keras-keywords",
        "keras-default-devices",
        "keras-jax-devices",
        "keras-2d-array-order-kept",
        "ours-with-strings",
        "ours-with-2d-array",
        "ours-mapping",
    ],
)
def test_mesh_call_forms(build, names, ids):
    mesh = build()
    assert isinstance(mesh, keras.distribution.DeviceMesh)
    assert mesh.axis_names == names  # Keras keeps axis_names as given
    assert mesh.devices.shape == mesh.shape
    assert mesh.device_ids.ravel().tolist() == list(ids)
    assert all(isinstance(d, jax.Device) for d in mesh.devices.flat)
    assert mesh.backend_mesh.shape == dict(zip(names, mesh.shape, strict=True))


@pytest.mark.parametrize(
    "build, keras_says, ours_says",
    [
        (lambda ns: ns.DeviceMesh((4,), "", ["cpu:0"] * 4), "Shape and axis_names cannot be empty", "Fix:"),
        (
            lambda ns: ns.DeviceMesh((4, 2), ["batch"], device_names()),
            "Shape and axis_names should have same size",
            "one name per axis",
        ),
        (
            lambda ns: ns.DeviceMesh((4, 2), ["batch", "model"], device_names()[:4]),
            "Shape does not match the number of devices",
            "needs 8 devices, and 4 were given",
        ),
    ],
    ids=["empty", "sizes-differ", "device-count"],
)
def test_mesh_errors_carry_keras_words(build, keras_says, ours_says):
    with pytest.raises(ValueError, match=keras_says):
        build(KERAS)
    with pytest.raises(kml.InvalidMeshError, match=keras_says) as raised:
        build(OURS)
    assert ours_says in str(raised.value) and "Received:" in str(raised.value)


def test_unknown_device_name_is_our_error():
    with pytest.raises(kml.InvalidMeshError, match=r"No device is named 'cpu:99'\. The devices are cpu:0, "):
        kml.Mesh((8,), ["data"], ["cpu:99"] * 8)


# -- constructors: LayoutMap and ModelParallel -----------------------------------------------


@pytest.mark.parametrize(
    "build",
    [
        lambda mesh: kml.LayoutRules(mesh),
        lambda mesh: kml.LayoutRules(device_mesh=mesh),
        lambda mesh: kml.LayoutRules(mesh=mesh),
        lambda mesh: kml.LayoutRules([], mesh=mesh),
    ],
    ids=["keras-positional", "keras-keyword", "ours", "ours-with-rules"],
)
def test_layout_map_call_forms(build):
    mesh = kml.Mesh((2, 4), ["data", "model"])
    rules = build(mesh)
    assert rules.device_mesh is mesh and len(rules) == 0


@pytest.mark.parametrize(
    "build, auto_shard",
    [
        (lambda mesh, rules: kml.ModelParallel(layout_map=rules, batch_dim_name="data"), True),
        (
            lambda mesh, rules: kml.ModelParallel(
                layout_map=rules, batch_dim_name="data", auto_shard_dataset=False
            ),
            False,
        ),
        (
            lambda mesh, rules: kml.ModelParallel(device_mesh=mesh, layout_map=rules, batch_dim_name="data"),
            True,
        ),
        (lambda mesh, rules: kml.ModelParallel(mesh, rules, batch_dim_name="data"), False),
        (lambda mesh, rules: kml.ModelParallel(rules), False),
        (lambda mesh, rules: kml.ModelParallel(mesh, rules, batch_axis="data"), False),
        (lambda mesh, rules: kml.ModelParallel(mesh, rules, auto_shard_dataset=True), True),
    ],
    ids=[
        "keras",
        "keras-no-auto-shard",
        "keras-older-device-mesh",
        "keras-older-positional",
        "layout-map-alone",
        "ours",
        "ours-auto-shard",
    ],
)
def test_model_parallel_call_forms(build, auto_shard):
    mesh = kml.Mesh((2, 4), ["data", "model"], device_names())
    rules = kml.LayoutRules(mesh)
    rules[".*kernel"] = keras.distribution.TensorLayout([None, "model"])
    dist = build(mesh, rules)
    assert dist.device_mesh is mesh
    assert dist.batch_dim_name == "data" and dist.batch_axis == "data"
    assert dist.auto_shard_dataset is auto_shard  # Keras's default where Keras's form is used
    assert dist.rules.match("d/kernel").axes == (None, "model")
    assert dist.num_model_replicas == 2


@pytest.mark.parametrize(
    "build, error, fragments",
    [
        (
            lambda mesh: kml.ModelParallel(),
            kml.InvalidMeshError,
            ("needs a mesh", "You must specify a layout_map"),
        ),
        (
            lambda mesh: kml.ModelParallel(layout_map=kml.LayoutRules()),
            kml.InvalidMeshError,
            ("needs a mesh", "carried by the layout map"),
        ),
        (
            lambda mesh: kml.ModelParallel(mesh, [], layout_map=kml.LayoutRules(mesh)),
            kml.InvalidRuleError,
            ("both rules and layout_map=",),
        ),
        (
            lambda mesh: kml.ModelParallel(mesh, batch_axis="data", batch_dim_name="model"),
            kml.InvalidMeshError,
            ("batch_axis='data' and batch_dim_name='model' disagree",),
        ),
        (
            lambda mesh: kml.ModelParallel(mesh, device_mesh=kml.Mesh(data=8)),
            kml.InvalidMeshError,
            ("two names (ours and Keras's older one)",),
        ),
    ],
    ids=["nothing", "unbound-layout-map", "rules-twice", "batch-axis-twice", "mesh-twice"],
)
def test_model_parallel_argument_errors(build, error, fragments):
    with pytest.raises(error) as raised:
        build(kml.Mesh(data=2, model=4))
    for fragment in fragments:
        assert fragment in str(raised.value)


# -- scope, set_distribution, dataset, get_*_layout --------------------------------------------


def test_scope_and_set_distribution():
    mesh = kml.Mesh((2, 4), ["data", "model"])
    outer = kml.ModelParallel(layout_map=kml.LayoutRules(mesh), batch_dim_name="data")
    inner = kml.ModelParallel(mesh)
    assert keras.distribution.distribution() is None
    with outer.scope():
        assert keras.distribution.distribution() is outer
        with inner.scope():
            assert keras.distribution.distribution() is inner
        assert keras.distribution.distribution() is outer
    assert keras.distribution.distribution() is None
    keras.distribution.set_distribution(outer)
    assert keras.distribution.distribution() is outer


@pytest.mark.parametrize("auto_shard", [True, False], ids=["auto-shard", "no-auto-shard"])
def test_distribute_dataset_in_one_process_returns_the_dataset(auto_shard):
    dist = kml.ModelParallel(
        layout_map=kml.LayoutRules(kml.Mesh((2, 4), ["data", "model"])),
        batch_dim_name="data",
        auto_shard_dataset=auto_shard,
    )
    dataset = [np.arange(8)]
    assert dist.distribute_dataset(dataset) is dataset


@pytest.mark.parametrize(
    "shape, axes",
    [((16, 28), ("data", None)), ((None, 28), ("data", None)), ((4, 2, 2), ("data", None, None)), ((), ())],
    ids=["batch", "symbolic-batch", "rank-3", "scalar"],
)
def test_get_data_layout(shape, axes):
    mesh = kml.Mesh((2, 4), ["data", "model"])
    dist = kml.ModelParallel(layout_map=kml.LayoutRules(mesh), batch_dim_name="data")
    layout = dist.get_data_layout(shape)
    assert layout.axes == axes and layout.device_mesh is mesh


def test_get_variable_and_tensor_layout():
    mesh = kml.Mesh((2, 4), ["data", "model"])
    layout_map = kml.LayoutRules(mesh)
    layout_map[".*kernel"] = keras.distribution.TensorLayout([None, "model"])
    layout_map["/model/layer/tensor"] = ("data", None)
    dist = kml.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    kernel = keras.Variable(np.zeros((64, 16)), name="kernel")
    seed = keras.Variable([0, 1], name="seed")
    assert (dist.get_variable_layout(kernel).axes, dist.get_variable_layout(seed).axes) == (
        (None, "model"),
        (None,),
    )
    assert dist.get_variable_layout(kernel).device_mesh is mesh
    assert dist.get_tensor_layout("/model/layer/tensor").axes == ("data", None)
    assert dist.get_tensor_layout("/model/layer/other") is None


# -- the layout map as a dict ---------------------------------------------------------------


def test_layout_map_dict_behaviour():
    mesh = kml.Mesh((4, 2), ["data", "model"])
    sharded_2d = keras.distribution.TensorLayout([None, "model"])
    sharded_1d = keras.distribution.TensorLayout(["model"])
    replicated_2d = keras.distribution.TensorLayout([None, None])
    layout_map = kml.LayoutRules(mesh)
    layout_map[".*dense.*kernel"] = replicated_2d
    layout_map["dense/kernel"] = sharded_2d  # an exact key, after a regex that matches it too
    layout_map["dense/bias"] = sharded_1d
    layout_map["conv/bias"] = ("model",)
    assert len(layout_map) == 4
    assert (
        list(layout_map)
        == list(layout_map.keys())
        == [".*dense.*kernel", "dense/kernel", "dense/bias", "conv/bias"]
    )
    assert layout_map["dense/kernel"] is sharded_2d  # the exact key wins, and is the very layout stored
    assert sharded_2d.device_mesh is mesh  # filled in from the map, as Keras does
    assert layout_map["dense_2/kernel"] is replicated_2d
    assert layout_map["conv/bias"].axes == ("model",) and layout_map["conv/bias"].device_mesh is mesh
    assert layout_map["conv/bias"] is layout_map["conv/bias"]
    assert [value for _, value in layout_map.items()][:3] == [replicated_2d, sharded_2d, sharded_1d]
    assert layout_map["conv2d/kernel"] is None
    assert "dense/bias" in layout_map and "dense_2/bias" not in layout_map  # membership is by key
    assert layout_map.pop("dense/bias") is sharded_1d
    with pytest.raises(KeyError):
        layout_map.pop(".*bias")
    del layout_map["conv/bias"]
    assert len(layout_map) == 2
    with pytest.raises(ValueError, match="dense/kernel already exist"):
        layout_map["dense/kernel"] = sharded_2d
    with pytest.raises(ValueError, match="should be a TensorLayout"):
        layout_map["conv.kernel"] = ["a", "b"]


def test_tensor_layout_on_the_same_mesh_is_accepted_and_another_refused():
    mesh = kml.Mesh((2, 4), ["data", "model"])
    same = keras.distribution.TensorLayout([None, "model"], kml.Mesh((2, 4), ["data", "model"]))
    rules = kml.LayoutRules(mesh)
    rules[".*kernel"] = same
    dist = kml.ModelParallel(layout_map=rules)
    assert dist.resolve("d/kernel", (64, 64)).axes == (None, "model")
    other = keras.distribution.TensorLayout([None, "model"], kml.Mesh((4, 2), ["data", "model"]))
    with pytest.raises(
        kml.InvalidRuleError,
        match=r"TensorLayout on Mesh\(data=4, model=2\).*Keras's LayoutMap would keep it",
    ):
        rules[".*bias"] = other


# -- no copy: rules added later take effect -----------------------------------------------------


def _unbound() -> kml.LayoutRules:
    return kml.LayoutRules([(r".*/kernel", (None, "model"))])


def _bound() -> kml.LayoutRules:
    return kml.LayoutRules([(r".*/kernel", (None, "model"))], mesh=kml.Mesh(data=2, model=4))


def _keras_map() -> keras.distribution.LayoutMap:
    layout_map = keras.distribution.LayoutMap(kml.Mesh(data=2, model=4))
    layout_map[r".*/kernel"] = (None, "model")
    return layout_map


@pytest.mark.parametrize("make", [_unbound, _bound, _keras_map], ids=["unbound", "bound", "keras-layout-map"])
def test_model_parallel_does_not_copy_the_rules(make):
    rules = make()
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    assert dist.resolve("d/bias", (64,)).axes == (None,)
    rules[r".*/bias"] = ("model",)  # added after the distribution was made
    assert dist.resolve("d/bias", (64,)).axes == ("model",)
    with dist.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, name="d")], name="m")
    assert model.get_layer("d").bias.value.sharding.spec == jax.sharding.PartitionSpec("model")


# -- output rules with '...' --------------------------------------------------------------------


def test_output_rule_with_leading_ellipsis_is_refused_when_written():
    with pytest.raises(kml.InvalidRuleError, match=r"'\.\.\.' can stand only at the end of an output rule"):
        kml.LayoutRules([(r"m/d/output", (..., "model"))])


def test_output_rule_with_trailing_ellipsis_trains():
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r"m/d/output", ("data", ...))])
    keras.distribution.set_distribution(dist)
    model = keras.Sequential([keras.Input((4, 8)), keras.layers.Dense(8, name="d")], name="m")
    assert dist.get_tensor_layout("m/d/output").axes == ("data",)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((16, 4, 8), "float32"), np.ones((16, 4, 8), "float32"), batch_size=8, verbose=0)


# -- the unmatched-rule warning at fit ------------------------------------------------------------


@pytest.mark.parametrize("plan_first", [False, True], ids=["fit-alone", "plan-then-fit"])
def test_fit_warns_once_about_a_rule_that_matched_nothing(plan_first):
    dist = kml.ModelParallel(
        kml.Mesh(data=2, model=4), [(r".*hidden/kernel", (None, "model")), (r".*hiden/bias", ("model",))]
    )
    keras.distribution.set_distribution(dist)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, name="hidden")], name="m")
    model.compile(optimizer="sgd", loss="mse")
    data = np.ones((16, 8), "float32"), np.ones((16, 64), "float32")
    if plan_first:
        with pytest.warns(kml.UnmatchedRuleWarning, match=r"rule #1 '\.\*hiden/bias'"):
            dist.plan(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(*data, batch_size=8, epochs=2, verbose=0)
        model.evaluate(*data, batch_size=8, verbose=0)
    unmatched = [w for w in caught if issubclass(w.category, kml.UnmatchedRuleWarning)]
    assert len(unmatched) == (0 if plan_first else 1)
    if not plan_first:
        assert re.search(
            r"rule #1 '\.\*hiden/bias' -> \('model',\) matched no variable", str(unmatched[0].message)
        )


# -- replicate_below: the user's rules are honoured, suggested ones keep small matrices whole ---


@pytest.mark.parametrize(
    "suggested, axes, reason",
    [
        (
            False,
            (None, "model"),
            "small: 1280 elements < replicate_below=4096, split anyway: a rule of your own",
        ),
        (True, (None, None), "small: 1280 elements < replicate_below=4096"),
    ],
    ids=["user-rule", "suggested-rule"],
)
def test_small_matrix_follows_a_user_rule(suggested, axes, reason):
    rules = kml.LayoutRules([(r".*head/kernel", (None, "model"))], suggested=suggested)
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    resolution = dist.resolve("m/head/kernel", (160, 8))
    assert resolution.axes == axes
    assert resolution.reasons[0].startswith(reason)


def test_presets_are_suggested_and_user_additions_are_not():
    rules = kml.mlp_rules(["fc1", "fc2"])
    assert all(rule.suggested for rule in rules.rules)
    # The layers named are the user's: their kernels must match; a layer may have no bias.
    assert [rule.optional for rule in rules.rules] == [False, True, False, True]
    rules[r".*head/kernel"] = (None, "model")
    assert not rules.rules[-1].suggested and not rules.rules[-1].optional


# -- the keras-io guide and keras-hub, trained with our classes and with Keras's ----------------


def _guide_model() -> keras.Model:
    """The keras-io distribution guide's model (guides/distribution, "ModelParallel")."""
    inputs = keras.Input(shape=(28, 28, 1))
    y = keras.layers.Flatten()(inputs)
    y = keras.layers.Dense(units=200, use_bias=False, activation="relu", name="d1")(y)
    y = keras.layers.Dropout(0.4)(y)
    y = keras.layers.Dense(units=10, activation="softmax", name="d2")(y)
    return keras.Model(inputs=inputs, outputs=y)


def _guide_distribution(ns: types.SimpleNamespace) -> keras.distribution.Distribution:
    mesh_2d = ns.DeviceMesh(shape=(2, 4), axis_names=["data", "model"], devices=device_names())
    layout_map = ns.LayoutMap(mesh_2d)
    layout_map["d1/kernel"] = (None, "model")
    layout_map["d1/bias"] = ("model",)  # the guide's d1 has no bias: this rule matches nothing
    layout_map["d2/output"] = ("data", None)
    return ns.ModelParallel(layout_map=layout_map, batch_dim_name="data")


def _guide_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 28, 28, 1)).astype("float32"), rng.normal(size=(64, 10)).astype("float32")


def _hub_model() -> keras.Model:
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=128,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        head_dim=8,
        dropout=0.0,
    )
    inputs = {key: keras.Input((8,), dtype="int32", name=key) for key in backbone.input}
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled), name="classifier")


def _hub_distribution(
    ns: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> keras.distribution.Distribution:
    mesh = ns.DeviceMesh((2, 4), ["batch", "model"], device_names())
    with monkeypatch.context() as patch:  # keras-hub builds its map with keras.distribution.LayoutMap
        patch.setattr(keras.distribution, "LayoutMap", ns.LayoutMap)
        layout_map = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    assert type(layout_map) is ns.LayoutMap
    return ns.ModelParallel(layout_map=layout_map, batch_dim_name="batch")


def _hub_data() -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(1)
    ids = rng.integers(1, 128, size=(32, 8)).astype("int32")
    return {"token_ids": ids, "padding_mask": np.ones_like(ids)}, rng.integers(0, 10, size=32)


class Program(NamedTuple):
    build: Callable[[], keras.Model]
    distribution: Callable[..., keras.distribution.Distribution]
    data: Callable[[], tuple]
    loss: str
    warns: str | None  # an UnmatchedRuleWarning ours issues (plain Keras says nothing)
    sharded: int  # variables split in both


PROGRAMS = {
    "keras-io-guide": Program(_guide_model, _guide_distribution, _guide_data, "mse", r"'d1/bias'", 1),
    "keras-hub-gemma": Program(
        _hub_model, _hub_distribution, _hub_data, "sparse_categorical_crossentropy", None, 15
    ),
}


def _fit(program: Program, ns: types.SimpleNamespace, initial: list, monkeypatch: pytest.MonkeyPatch):
    args = (ns, monkeypatch) if program.distribution is _hub_distribution else (ns,)
    keras.distribution.set_distribution(program.distribution(*args))
    keras.utils.set_random_seed(7)  # the same dropout masks in both runs
    model = program.build()
    model.set_weights(initial)
    model.compile(loss=program.loss, optimizer=keras.optimizers.Adam(1e-2))
    model.fit(*program.data(), batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name", list(PROGRAMS), ids=list(PROGRAMS))
def test_keras_code_trains_the_same_with_our_classes(name, monkeypatch):
    program = PROGRAMS[name]
    keras.utils.set_random_seed(0)
    initial = program.build().get_weights()
    theirs = _fit(program, KERAS, initial, monkeypatch)
    if program.warns:
        with pytest.warns(kml.UnmatchedRuleWarning, match=program.warns):
            ours = _fit(program, OURS, initial, monkeypatch)
    else:
        ours = _fit(program, OURS, initial, monkeypatch)
    moved = max(np.abs(a - b).max() for a, b in zip(initial, ours.get_weights(), strict=True))
    assert moved > 1e-3
    split = 0
    for mine, keras_variable in zip(ours.weights, theirs.weights, strict=True):
        assert mine.path == keras_variable.path
        spec = mine.value.sharding.spec
        assert spec == keras_variable.value.sharding.spec, mine.path
        split += any(axis is not None for axis in spec)
        np.testing.assert_allclose(
            np.asarray(mine.value), np.asarray(keras_variable.value), atol=1e-5, rtol=0, err_msg=mine.path
        )
    assert split == program.sharded


# -- the documented differences -----------------------------------------------------------------


def _mesh_2x4() -> kml.Mesh:
    return kml.Mesh((2, 4), ["data", "model"], device_names())


def _rank_mismatch():
    layout_map = kml.LayoutRules(_mesh_2x4())
    layout_map[".*kernel"] = keras.distribution.TensorLayout([None, "model"])
    dist = kml.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    return dist.get_variable_layout(keras.Variable(np.zeros((8,)), name="kernel"))


def _rank_mismatch_short():
    layout_map = kml.LayoutRules(_mesh_2x4())
    layout_map[".*kernel"] = keras.distribution.TensorLayout(["model"])
    dist = kml.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    return dist.get_variable_layout(keras.Variable(np.zeros((8, 4)), name="kernel"))


def _two_matches():
    layout_map = kml.LayoutRules(_mesh_2x4())
    layout_map[".*dense.*bias"] = (None,)
    layout_map[".*bias"] = ("model",)
    return layout_map["dense_2/bias"].axes


def _indivisible():
    dist = kml.ModelParallel(layout_map=kml.LayoutRules({".*kernel": (None, "model")}, mesh=_mesh_2x4()))
    return dist.resolve("d/kernel", (64, 10)).axes


def _indivisible_error():
    rules = kml.LayoutRules({".*kernel": (None, "model")}, mesh=_mesh_2x4())
    dist = kml.ModelParallel(layout_map=rules, on_indivisible="error")
    return dist.resolve("d/kernel", (64, 10))


def _auto_shard_default():
    return kml.ModelParallel(_mesh_2x4()).auto_shard_dataset


def _axis_name():
    return kml.Mesh((8,), ["data-parallel"])


def _other_mesh():
    rules = kml.LayoutRules(_mesh_2x4())
    rules[".*kernel"] = keras.distribution.TensorLayout([None, "model"], kml.Mesh((8,), ["model"]))


def _membership():
    layout_map = kml.LayoutRules(_mesh_2x4())
    layout_map[".*kernel"] = (None, "model")
    return "d/kernel" in layout_map, ".*kernel" in layout_map


def _list_value():
    layout_map = kml.LayoutRules(_mesh_2x4())
    layout_map[".*kernel"] = [None, "model"]
    return layout_map["d/kernel"].axes


class Difference(NamedTuple):
    run: Callable[[], object]
    ours: object  # the value returned, or the error or warning class raised
    keras_says: str | None  # what the message says Keras does, where we raise or warn


#: The README's list of deliberate differences from Keras 3.15, one row each.
DIFFERENCES = {
    "rank-checked": Difference(
        _rank_mismatch,
        kml.RankMismatchError,
        "JAX would refuse it when placing the variable",
    ),
    "rank-checked-short": Difference(
        _rank_mismatch_short,
        kml.RankMismatchError,
        "JAX pads a short layout with None: the last 1 dimension(s) would be replicated without a word",
    ),
    "first-match-wins": Difference(_two_matches, (None,), None),  # Keras: ValueError, matches multiple keys
    "indivisible-replicated": Difference(
        _indivisible, kml.IndivisibleShapeWarning, "Plain Keras would fail here in JAX"
    ),
    "indivisible-error": Difference(
        _indivisible_error, kml.IndivisibleShapeError, "Plain Keras would hand the layout to JAX"
    ),
    "auto-shard-default": Difference(_auto_shard_default, False, None),  # Keras: True
    "axis-names-identifiers": Difference(
        _axis_name, kml.InvalidMeshError, "Keras's DeviceMesh takes any name"
    ),
    "tensor-layout-other-mesh": Difference(
        _other_mesh, kml.InvalidRuleError, "Keras's LayoutMap would keep it"
    ),
    "membership-by-key": Difference(_membership, (False, True), None),  # Keras: True for any string
    "list-values": Difference(_list_value, (None, "model"), None),  # Keras: "should be a TensorLayout"
}


@pytest.mark.parametrize("name", list(DIFFERENCES), ids=list(DIFFERENCES))
def test_documented_differences_from_keras(name):
    difference = DIFFERENCES[name]
    if isinstance(difference.ours, type) and issubclass(difference.ours, Warning):
        with pytest.warns(difference.ours) as warned:
            difference.run()
        assert difference.keras_says in str(warned[0].message)
    elif isinstance(difference.ours, type):
        with pytest.raises(difference.ours) as raised:
            difference.run()
        assert difference.keras_says in str(raised.value)
    else:
        assert difference.run() == difference.ours


@pytest.mark.parametrize("page", ["README.md", "docs/differences.md"])
def test_every_difference_is_documented(page):
    text = (Path(__file__).parents[1] / page).read_text(encoding="utf-8")
    ids = set(re.findall(r"^\| `([\w-]+)`", text, re.M)) | set(re.findall(r" / `([\w-]+)` \|", text))
    assert ids == set(DIFFERENCES), f"{page} lists {sorted(ids)}, the tests {sorted(DIFFERENCES)}"


@pytest.mark.parametrize(
    "axes, shape, placed",
    [(("model",), (8, 4), ("model", None)), ((None, "model"), (8,), None)],
    ids=["short-is-padded", "long-is-refused"],
)
def test_what_keras_and_jax_do_with_a_layout_of_another_rank(axes, shape, placed):
    """What the `rank-checked` rows of docs/differences.md say Keras and JAX do (jax 0.10.2)."""
    mesh = keras.distribution.DeviceMesh((2, 4), ("data", "model"), jax.devices())
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = keras.distribution.TensorLayout(list(axes))
    dist = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    with dist.scope():
        if placed is None:
            with pytest.raises(IndexError):  # from inside JAX, naming no variable
                keras.Variable(np.zeros(shape, "float32"), name="kernel")
            return
        variable = keras.Variable(np.zeros(shape, "float32"), name="kernel")
    assert (
        tuple(variable.value.sharding.spec) + (None,) * (len(shape) - len(variable.value.sharding.spec))
        == placed
    )
