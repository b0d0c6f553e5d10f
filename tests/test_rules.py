"""`kml.LayoutRules`: ordered, full-match rules that behave as a Keras `LayoutMap`."""

from __future__ import annotations

import re

import jax
import keras
import numpy as np
import pytest

import keras_meshlayout as kml

RULES = [
    (r".*dense_1/kernel", (None, "model")),
    (r".*dense_1/.*", ("model",)),
    (r".*/kernel", ("model", None)),
    (r".*dense_1/output", ("data", "model")),
]


@pytest.mark.parametrize(
    "path, index",
    [
        ("mlp/dense_1/kernel", 0),  # rules 0 and 2 match: the first wins
        ("mlp/dense_1/bias", 1),
        ("mlp/dense_2/kernel", 2),
        ("mlp/dense_2/bias", None),
        ("dense_1/kernel", 0),
        ("mlp/dense_1/kernel_extra", 1),  # full match: '.*dense_1/kernel' does not match a longer path
        ("mlp/dense_10/kernel", 2),
        ("mlp/dense_1/output", 3),  # layer outputs only match output rules
        ("mlp/dense_2/output", None),
    ],
)
def test_first_full_match_wins(path, index):
    rule = kml.LayoutRules(RULES).match(path)
    assert (rule.index if rule else None) == index


def test_fullmatch_not_search():
    """Keras before 3.14 used re.search; we always use re.fullmatch."""
    rules = kml.LayoutRules([(r"dense", (None,))])
    assert rules.match("mlp/dense/bias") is None
    assert rules.match("dense") is not None


def test_is_an_ordered_mutable_layout_map():
    mesh = kml.Mesh(data=2, model=4)
    rules = kml.LayoutRules(RULES[:2], mesh=mesh)
    assert isinstance(rules, keras.distribution.LayoutMap)
    rules[r".*bias"] = ("model",)
    assert list(rules) == [RULES[0][0], RULES[1][0], r".*bias"]
    assert len(rules) == 3
    del rules[RULES[1][0]]
    assert [r.index for r in rules.rules] == [0, 1]
    assert rules.match("mlp/dense_1/bias").pattern == r".*bias"
    layout = rules["mlp/dense_1/kernel"]
    assert isinstance(layout, keras.distribution.TensorLayout)
    assert (layout.axes, layout.device_mesh) == ((None, "model"), mesh)
    assert rules["nothing/matches"] is None
    assert rules.get("nothing/matches") is None
    with pytest.raises(KeyError):
        del rules["not a pattern"]


def test_accepts_mappings_and_tensor_layouts():
    rules = kml.LayoutRules(
        {r".*kernel": keras.distribution.TensorLayout((None, "model")), r".*bias": ["model"]}
    )
    assert [r.axes for r in rules.rules] == [(None, "model"), ("model",)]


def test_keras_layout_map_becomes_rules_in_insertion_order():
    mesh = kml.Mesh(data=2, model=4)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[r".*dense.*kernel"] = (None, "model")
    layout_map[r".*kernel"] = ("model", None)
    distribution = kml.ModelParallel(mesh, layout_map)
    assert [(r.pattern, r.axes) for r in distribution.rules.rules] == [
        (r".*dense.*kernel", (None, "model")),
        (r".*kernel", ("model", None)),
    ]
    # Keras's own map raises on two matches; the converted rules take the first.
    assert distribution.rules["mlp/dense/kernel"].axes == (None, "model")


def test_bind_and_tensor_layouts_for_outputs():
    mesh = kml.Mesh(data=2, model=4)
    rules = kml.LayoutRules(RULES)
    assert rules.mesh is None
    bound = rules.bind(mesh)
    assert bound.bind(mesh) is bound and bound.device_mesh is mesh
    distribution = kml.ModelParallel(mesh, bound)
    assert distribution.get_tensor_layout("mlp/dense_1/output").axes == ("data", "model")
    assert distribution.get_tensor_layout("mlp/dense_2/output") is None


def test_unmatched_lists_variable_rules_that_hit_nothing():
    rules = kml.LayoutRules([*RULES, (r".*dense_3/kernel", (None, "model"))])
    unmatched = rules.unmatched(["mlp/dense_1/kernel", "mlp/dense_2/kernel"])
    assert [r.index for r in unmatched] == [1, 4]  # output rules are not variable rules


def test_unbound_rules_handed_to_keras_say_how_to_bind():
    rules = kml.LayoutRules([(r".*kernel", (None, "model"))])
    with pytest.raises(kml.InvalidRuleError, match=r"not bound to a mesh.*rules\.bind\(mesh\)"):
        keras.distribution.ModelParallel(layout_map=rules, batch_dim_name="data")


def test_rejected_rule_is_not_kept():
    """Regression: a rule naming an unknown axis used to be appended before validation."""
    rules = kml.LayoutRules([(r".*a", ("model",))], mesh=kml.Mesh(data=2, model=4))
    with pytest.raises(kml.InvalidRuleError, match="'expert'"):
        rules[r".*b"] = ("expert",)
    assert list(rules) == [r".*a"]
    assert rules["x/b"] is None


def test_equal_meshes_bind_the_same_rules():
    rules = kml.LayoutRules([(r".*a", ("model",))], mesh=kml.Mesh(data=2, model=4))
    assert rules.bind(kml.Mesh(data=2, model=4)) is rules
    with pytest.raises(kml.InvalidRuleError, match="bound to Mesh"):
        rules.bind(kml.Mesh(data=4, model=2))


@pytest.mark.parametrize(
    "build, error",
    [
        (lambda: kml.LayoutRules([], mesh="2x4"), kml.InvalidRuleError),
        (lambda: kml.LayoutRules(5), kml.InvalidRuleError),
        (lambda: kml.Mesh(["data"]), kml.InvalidMeshError),
        (lambda: kml.Mesh.parse("1_0"), kml.InvalidMeshError),
        (lambda: kml.ModelParallel(kml.Mesh(data=8), replicate_below=np.int64(0)), None),
    ],
    ids=["mesh-string", "rules-int", "mesh-list", "underscore-size", "numpy-int-accepted"],
)
def test_wrong_argument_types_get_our_errors(build, error):
    if error is None:
        build()
        return
    with pytest.raises(error):
        build()


@pytest.mark.parametrize(
    "axes, shape, expected",
    [
        ((..., "model"), (3, 3, 16, 32), (None, None, None, "model")),
        ((..., "model"), (32,), ("model",)),
        (("model", ...), (8, 4, 4), ("model", None, None)),
        ((None, ..., "model"), (4, 8), (None, "model")),
        ((...,), (4, 4), (None, None)),
    ],
    ids=["conv2d-kernel", "bias", "leading", "ellipsis-empty", "only-ellipsis"],
)
def test_ellipsis_fills_leftover_dimensions(axes, shape, expected):
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*", axes)], replicate_below=0)
    assert distribution.resolve("v", shape).axes == expected


def test_ellipsis_rule_too_long_for_the_rank_is_a_rank_mismatch():
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*", (None, ..., "model"))])
    with pytest.raises(kml.RankMismatchError, match="rank at least 2"):
        distribution.resolve("layer/bias", (8,))


def test_notes_travel_to_the_plan():
    rules = kml.LayoutRules([(r".*kernel", (None, "model"), "column-parallel")])
    assert rules.rules[0].note == "column-parallel"
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    assert distribution.rules.rules[0].note == "column-parallel"
    with distribution.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1024, name="d")], name="m")
    plan = distribution.plan(model)
    assert plan["m/d/kernel"].to_dict()["rule"]["note"] == "column-parallel"
    assert "column-parallel" in str(plan)


# -- linear-time lookup (issue 11 item 4): literal patterns by dictionary, same answers ------------


@pytest.mark.parametrize(
    "pattern, strings",
    [
        ("net/dense/kernel", {"net/dense/kernel"}),
        (r"net/dense\.1/kernel", {"net/dense.1/kernel"}),
        (r"(?:net/)?dense/kernel", {"dense/kernel", "net/dense/kernel"}),
        (r"net/(?:query|key)/kernel", {"net/query/kernel", "net/key/kernel"}),
        (r"(?:a|b)?/k", {"a/k", "b/k", "/k"}),
        (r"a\ b\-c", {"a b-c"}),
        (r".*kernel", None),
        (r"dense_\d/kernel", None),
        (r"dense+", None),
        (r"(?:net.)?dense", None),
        (r"(net)/dense", None),
        (r"(?:net/)*dense", None),
        ("(?:a/)?" * 7 + "k", None),  # 128 strings: matched as a regex
    ],
    ids=[
        "plain",
        "escaped",
        "optional-prefix",
        "alternatives",
        "optional-alternatives",
        "escaped-space-and-dash",
        "wildcard",
        "class-escape",
        "quantifier",
        "regex-in-group",
        "capturing-group",
        "repeated-group",
        "too-many",
    ],
)
def test_literal_strings(pattern, strings):
    from keras_meshlayout.core._matcher import literal_strings

    found = literal_strings(pattern)
    assert (None if found is None else set(found)) == strings
    if strings is not None:
        assert all(re.fullmatch(pattern, text) for text in strings)


def naive_match(patterns: list[str], path: str) -> int | None:
    """The documented semantics, by brute force: an exact key, else the first full match."""
    if path in patterns:
        return patterns.index(path)
    for index, pattern in enumerate(patterns):
        if pattern.endswith("/output") == path.endswith("/output") and re.fullmatch(pattern, path):
            return index
    return None


LOOKUP_RULE_SETS = {
    "planner": [r"(?:net/)?d_1/kernel", r"(?:net/)?d_1/bias", r"(?:net/)?d_2/kernel", r"net/d_2/output"],
    "regex-before-literal": [r".*kernel", r"(?:net/)?d_1/kernel", r"net/d_2/kernel", r".*/output"],
    "literal-before-regex": [r"(?:net/)?d_1/kernel", r".*kernel", r".*d_.*/bias", r"net/d_1/bias"],
    "overlapping-literals": [r"(?:net/)?d_1/kernel", r"net/d_1/kernel", r"(?:net|m)/d_1/kernel", r".*"],
    "exact-regex-key": [r".*", r"net/d_.*/kernel", r".*/output", r"net/d_1/output"],
    # More regexes than one alternation holds, a literal among them, groups of their own.
    "many-regexes": [*(rf"(net)/d_{i}\d*/(kernel|bias)" for i in range(70)), r"net/d_2/kernel", r".*"],
    # Back-references and inline flags are tried one by one.
    "numbered-groups": [r"(?i)NET/D_1/KERNEL", r"(\w+)/d_\d/(?P<w>kernel)", r"(d)_(1)/\2", r".*"],
}
LOOKUP_PATHS = [
    "net/d_1/kernel",
    "d_1/kernel",
    "m/d_1/kernel",
    "net/d_1/bias",
    "net/d_2/kernel",
    "d_2/kernel",
    "net/d_2/output",
    "net/d_1/output",
    "net/d_.*/kernel",
    ".*",
    "other",
]


@pytest.mark.parametrize("name", list(LOOKUP_RULE_SETS), ids=list(LOOKUP_RULE_SETS))
def test_lookup_gives_the_documented_answer(name):
    patterns = LOOKUP_RULE_SETS[name]
    rules = kml.LayoutRules([(p, ("model",)) for p in patterns])
    for path in LOOKUP_PATHS:
        rule = rules.match(path)
        assert (None if rule is None else rule.index) == naive_match(patterns, path), path
    del rules[patterns[0]]  # the tables follow every change
    rules[patterns[0]] = ("model",)
    moved = patterns[1:] + patterns[:1]
    for path in LOOKUP_PATHS:
        rule = rules.match(path)
        assert (None if rule is None else rule.pattern) == (
            None if naive_match(moved, path) is None else moved[naive_match(moved, path)]
        ), path


def test_an_earlier_regex_beats_an_escaped_literal_but_not_an_exact_key():
    rules = kml.LayoutRules(
        [
            (r".*kernel", ("model", None)),
            (r"(?:net/)?d/kernel", (None, "model")),
            ("net/d/kernel", (None, None)),
        ]
    )
    assert rules.match("d/kernel").index == 0  # first match: the regex comes first
    assert rules.match("net/d/kernel").index == 2  # a key equal to the path wins, as in Keras


# -- one dimension split over several mesh axes (issue 11, item 2) ------------------------

MESH_2X4 = {"data": 2, "model": 4}


@pytest.mark.parametrize(
    "axes, shape, sizes, expected, shards",
    [
        ((("data", "model"), None), (16, 3), MESH_2X4, (("data", "model"), None), 8),
        ((None, ("model", "data")), (3, 8), MESH_2X4, (None, ("model", "data")), 8),
        ((("model",), "data"), (4, 2), MESH_2X4, (("model",), "data"), 8),
        ((("data", "model"),), (24,), MESH_2X4, (("data", "model"),), 8),
        ((..., ("data", "model")), (2, 2, 8), MESH_2X4, (None, None, ("data", "model")), 8),
        ([["data", "model"], None], (8, 8), MESH_2X4, (("data", "model"), None), 8),
        ((("data", "model"), None), (12, 3), MESH_2X4, (None, None), 1),
        ((("data", "model"), None), (16, 3), {"data": 4, "model": 2}, (("data", "model"), None), 8),
        ((("data", "model"), None), (4, 3), {"data": 4, "model": 1}, (("data", "model"), None), 4),
    ],
    ids=[
        "both-axes",
        "minor-first",
        "one-axis-tuple",
        "vector",
        "ellipsis",
        "lists-from-json",
        "12-not-by-8-replicated",
        "4x2",
        "size-1-axis",
    ],
)
def test_a_dimension_splits_over_the_product_of_its_axes(axes, shape, sizes, expected, shards):
    from keras_meshlayout.core._resolve import resolve

    rules = kml.LayoutRules([(r".*", axes)])
    resolution = resolve("d/kernel", shape, "float32", rules, sizes, replicate_below=0, warn=False)
    assert (resolution.axes, resolution.shards) == (expected, shards)
    assert resolution.bytes_per_device == 4 * int(np.prod(shape)) // shards


@pytest.mark.parametrize(
    "axes, mesh, message",
    [
        (
            (("data", "data"), None),
            None,
            "Layout rule #0 '.*kernel' uses mesh axis 'data' more than once in axes (('data', 'data'), "
            "None). A mesh axis can split only one dimension of a tensor, once. Fix: keep 'data' in "
            "one entry only and put None (or the other axes) elsewhere.",
        ),
        (
            (("data", "model"), "model"),
            None,
            "Layout rule #0 '.*kernel' uses mesh axis 'model' more than once in axes (('data', "
            "'model'), 'model').",
        ),
        (
            ((), None),
            None,
            "Layout rule #0 '.*kernel' has entry () in axes ((), None); an entry that splits one "
            "dimension over several mesh axes must be a non-empty tuple of mesh-axis names, e.g. "
            "('data', 'model').",
        ),
        (
            (("data", 2), None),
            None,
            "Layout rule #0 '.*kernel' has entry ('data', 2) in axes (('data', 2), None);",
        ),
        (
            (("data", "pipe"), None),
            kml.Mesh(data=2, model=4),
            "Layout rule #0 '.*kernel' -> (('data', 'pipe'), None) names mesh axis 'pipe', but the "
            "mesh has axes ('data', 'model') (shape (2, 4)).",
        ),
    ],
    ids=["same-axis-twice-in-an-entry", "same-axis-in-two-entries", "empty", "not-a-name", "unknown-axis"],
)
def test_bad_multi_axis_entries_are_refused(axes, mesh, message):
    with pytest.raises(kml.InvalidRuleError) as raised:
        kml.LayoutRules([(r".*kernel", axes)], mesh=mesh)
    assert str(raised.value).startswith(message), str(raised.value)


def test_indivisible_multi_axis_entry_names_every_axis_and_size():
    distribution = kml.ModelParallel(
        kml.Mesh(data=2, model=4), [(r".*", (("data", "model"), None))], on_indivisible="error"
    )
    with pytest.raises(kml.IndivisibleShapeError) as raised:
        distribution.resolve("d/kernel", (12, 3))
    assert str(raised.value).startswith(
        "Variable 'd/kernel' has shape (12, 3); rule #0 '.*' -> (('data', 'model'), None) splits "
        "dimension 0 (size 12) over mesh axes 'data' (size 2) x 'model' (size 4) = 8, and 12 is not "
        "a multiple of 8. Fix: choose a mesh whose 'data' x 'model' axes (their product) divides 12,"
    ), str(raised.value)
    replicate = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*", (("data", "model"), None))])
    with pytest.warns(kml.IndivisibleShapeWarning, match=r"'data' \(size 2\) x 'model' \(size 4\) = 8 "):
        assert replicate.resolve("d/kernel", (12, 3)).axes == (None, None)


def test_multi_axis_layouts_format_and_round_trip_through_json():
    import json

    from keras_meshlayout.checkpoint import _plan_diff
    from keras_meshlayout.core._axes import axes_from_json
    from keras_meshlayout.core._format import format_axes

    assert format_axes((("data", "model"), None)) == "(('data','model'), None)"
    distribution = kml.ModelParallel(
        kml.Mesh(data=2, model=4), [(r".*", (("data", "model"), None))], replicate_below=0
    )
    entry = distribution.resolve("d/kernel", (16, 8)).to_dict()
    loaded = json.loads(json.dumps(entry))
    assert loaded["axes"] == loaded["requested"] == [["data", "model"], None]
    assert axes_from_json(loaded["axes"]) == (("data", "model"), None)
    assert loaded["shards"] == 8 and loaded["bytes_per_device"] == 16 * 8 * 4 // 8
    assert _plan_diff._format_axes(loaded["axes"], {"data": 2, "model": 4}) == "((data=2,model=4), None)"


def test_tensor_layouts_with_a_multi_axis_entry_reach_jax():
    mesh = kml.Mesh(data=2, model=4)
    rules = kml.LayoutRules(mesh)
    rules["d/kernel"] = keras.distribution.TensorLayout((("data", "model"), None))
    rules["d/bias"] = (("model", "data"),)
    assert rules["d/kernel"].backend_layout.spec == jax.sharding.PartitionSpec(("data", "model"), None)
    assert rules["d/bias"].backend_layout.spec == jax.sharding.PartitionSpec(("model", "data"))


def test_fit_with_a_kernel_split_over_both_axes_matches_one_device():
    """A (256, 128) kernel in 8 row blocks on 2x4, its momentum too, trains as on one device."""
    from helpers import Reference, assert_laid_out_as_planned, assert_same_weights, build_mlp, train

    rng = np.random.default_rng(0)
    data = (rng.normal(size=(128, 32)).astype("float32"), rng.integers(0, 10, size=(128,)))
    reference = Reference(build_mlp, data)
    mesh = kml.Mesh(data=2, model=4)
    rules = [
        (r".*hidden_1/kernel", (None, ("model", "data"))),
        (r".*hidden_1/bias", (("model", "data"),)),
        (r".*hidden_2/kernel", (("data", "model"), None)),
    ]
    distribution = kml.ModelParallel(mesh, rules, batch_axis="data")
    model = train(build_mlp, reference.initial, data, distribution)
    assert_same_weights(model, reference.trained)
    plan = distribution.plan(model)
    assert_laid_out_as_planned(model, plan, mesh)
    kernel = plan["mlp/hidden_2/kernel"]
    assert (kernel.axes, kernel.shards, kernel.bytes_per_device) == (
        (("data", "model"), None),
        8,
        256 * 128 * 4 // 8,
    )
    spec = model.get_layer("hidden_2").kernel.value.sharding.spec
    assert spec == jax.sharding.PartitionSpec(("data", "model"), None)
    shard_shapes = {s.data.shape for s in model.get_layer("hidden_2").kernel.value.addressable_shards}
    assert shard_shapes == {(32, 128)}
    momentum = next(e for e in plan if e.path.endswith("/mlp_hidden_2_kernel_momentum"))
    assert (momentum.axes, momentum.shards) == ((("data", "model"), None), 8)


@pytest.mark.parametrize("storage", ["orbax", "h5"])
def test_checkpoints_keep_multi_axis_layouts(storage, tmp_path):
    """The manifest's plan holds ('data', 'model') as a JSON list; loading elsewhere reads it back."""
    from helpers import build_mlp

    rules = [(r".*hidden_2/kernel", (("data", "model"), None)), (r".*hidden_1/bias", (("model", "data"),))]
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    keras.distribution.set_distribution(distribution)
    model = build_mlp()
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.ones((16, 32), "float32"), np.ones((16, 10), "float32"), batch_size=16, verbose=0)
    saved = [np.asarray(w) for w in model.get_weights()]
    path = kml.save_checkpoint(model, tmp_path / "ckpt", storage=storage)
    for target, changed in (
        (kml.ModelParallel(kml.Mesh(data=4, model=2), rules), 0),
        (kml.ModelParallel(kml.Mesh(data=8)), 6),
    ):
        keras.distribution.set_distribution(target)
        restored = build_mlp()
        restored.compile(optimizer="adam", loss="mse")
        diff = kml.load_checkpoint(restored, path)
        for want, got in zip(saved, restored.get_weights(), strict=True):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert len(diff.changes) == changed
        if changed:
            kernel = next(c for c in diff.changes if c.path == "mlp/hidden_2/kernel")
            assert (kernel.before, kernel.after) == ((("data", "model"), None), (None, None))
            assert "((data=2,model=4), None)" in str(diff)
    keras.distribution.set_distribution(None)


def test_a_bound_view_shares_the_policy_and_cost_set_later():
    """Issue 20: `bind` copied `cost` and `policy` by hand, so a view drifted once either was set later."""
    import dataclasses

    rules = kml.LayoutRules([(r".*kernel", (None, "model"))])
    view = rules.bind(kml.Mesh(data=2, model=4))
    assert view is not rules and view.policy is None and view.cost is None
    policy, cost = kml.LayoutPolicy(replicate_below=0), object()
    rules.policy, rules.cost = policy, cost
    assert (view.policy, view.cost) == (policy, cost)
    assert view.origin is rules.origin
    with pytest.raises(dataclasses.FrozenInstanceError):
        rules.origin.cost = None  # one frozen value, replaced whole
    with pytest.raises(kml.InvalidOptionError, match=re.escape("policy must be a kml.LayoutPolicy")):
        view.policy = "replicate"


class _CaptureSharding(keras.layers.Layer):
    """Records the sharding its input has inside the compiled step."""

    captured = None

    def call(self, inputs):
        jax.debug.inspect_array_sharding(
            inputs, callback=lambda sharding: setattr(self, "captured", sharding)
        )
        return inputs


@pytest.mark.parametrize("pattern", [r".*dense.*output", r"dense/output", r".*dense/output"], ids=str)
def test_output_rules_are_matched_with_keras_meaning(pattern):
    """Issue 23: Keras's own `".*dense.*output"` was filed as a variable rule and dropped silently.

    Keras honours any key that matches `<layer path>/output`; so do we now (a pattern ending in
    `output`), and the output really gets the layout inside the compiled step.
    """
    mesh = kml.Mesh(batch=2, model=4)
    layout_map = kml.LayoutRules(mesh)
    layout_map[r".*dense.*kernel"] = (None, "model")
    layout_map[pattern] = ("batch", None)
    dist = kml.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    capture = _CaptureSharding()
    with dist.scope():
        inputs = keras.Input((8,))
        hidden = keras.layers.Dense(16, use_bias=False, name="dense")(inputs)
        model = keras.Model(inputs, keras.layers.Dense(4, name="head")(capture(hidden)), name="functional")
    assert layout_map.rules[1].for_outputs
    assert dist.get_tensor_layout("dense/output").axes == ("batch", None)
    plan = dist.plan(model)  # no UnmatchedRuleWarning (warnings are errors here)
    assert [(rule.pattern, layers) for rule, layers in plan.outputs] == [(pattern, ("dense",))]
    with dist.scope():
        model.compile(loss="mse")
        model.fit(np.zeros((16, 8), "float32"), np.zeros((16, 4), "float32"), batch_size=8, verbose=0)
    expected = jax.sharding.NamedSharding(mesh.backend_mesh, jax.sharding.PartitionSpec("batch", None))
    assert capture.captured.is_equivalent_to(expected, 2), capture.captured


def test_the_planners_rules_join_a_users_own_with_their_notes_and_flags():
    """`kml.LayoutRules([mine, *auto.rules])`: the planner's rules keep what they say and how they are
    kept (`suggested`, `keep_split`); a user's rule put first wins. Refused before as not a pair."""
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(64, name="up"), keras.layers.Dense(16, name="down")],
        name="mlp",
    )
    auto = kml.auto_rules(model, kml.Mesh(data=2, model=4), replicate_below=0)
    mine = kml.LayoutRules([(r"mlp/up/kernel", ("model", None)), *auto.rules])
    assert mine.match("mlp/up/kernel").axes == ("model", None) and not mine.match("mlp/up/kernel").suggested
    joined, planned = mine.match("mlp/down/kernel"), auto.match("mlp/down/kernel")
    assert (joined.axes, joined.note, joined.suggested) == (planned.axes, planned.note, True)
