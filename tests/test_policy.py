"""One policy object for `on_indivisible` / `replicate_below` (issue 15): `kml.LayoutPolicy`.

Set once, on the rules (`kml.auto_rules(..., policy=...)` or `kml.LayoutRules(..., policy=...)`),
and honoured by `kml.ModelParallel`; the older keywords keep their meaning, and a keyword
that disagrees with `policy=` in the same call is an error.
"""

from __future__ import annotations

import inspect
import re

import helpers
import keras
import numpy as np
import pytest

import keras_meshlayout as kml

P = kml.LayoutPolicy
MESH = {"data": 2, "model": 4}


def mlp() -> keras.Model:
    """Kernels of 8×16 and 16×8 (128 elements): below the default threshold of 4096."""
    return helpers.mlp(8, ("up", 16), ("down", 8))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"on_indivisible": "ignore"}, "on_indivisible must be one of ('replicate', 'error'). Received: "),
        ({"replicate_below": -1}, "replicate_below must be a non-negative integer element count"),
        ({"replicate_below": 1.5}, "Received: replicate_below=1.5."),
        ({"replicate_below": True}, "Received: replicate_below=True."),
    ],
    ids=["unknown-on-indivisible", "negative", "float", "bool"],
)
def test_a_bad_policy_is_a_clear_error(kwargs, message):
    with pytest.raises(kml.InvalidOptionError, match=re.escape(message)):
        P(**kwargs)


def test_a_policy_is_frozen_and_compares_by_value():
    policy = P(replicate_below=0)
    assert policy == P("replicate", 0) and hash(policy) == hash(P("replicate", 0))
    with pytest.raises(AttributeError):
        policy.replicate_below = 5  # type: ignore[misc]
    assert P() == P("replicate", kml.DEFAULT_REPLICATE_BELOW)


#: (rules' policy, ModelParallel keywords, the policy in force or the error's text).
RESOLUTION = [
    ("default", None, {}, P()),
    ("old-keywords", None, {"on_indivisible": "error", "replicate_below": 0}, P("error", 0)),
    ("old-keyword-alone", None, {"replicate_below": 10}, P("replicate", 10)),
    ("policy", None, {"policy": P("error", 10)}, P("error", 10)),
    (
        "policy-and-the-same-keyword",
        None,
        {"policy": P(replicate_below=10), "replicate_below": 10},
        P("replicate", 10),
    ),
    ("rules-policy", P("error", 0), {}, P("error", 0)),
    ("keyword-over-rules-policy", P("error", 0), {"replicate_below": 100}, P("error", 100)),
    ("policy-over-rules-policy", P("error", 0), {"policy": P(replicate_below=7)}, P("replicate", 7)),
    (
        "conflicting-replicate-below",
        None,
        {"policy": P(replicate_below=10), "replicate_below": 20},
        "ModelParallel got policy=LayoutPolicy(on_indivisible='replicate', replicate_below=10) and "
        "replicate_below=20, which disagree: both set replicate_below (the policy says 10). Fix: pass "
        "only policy=, or drop replicate_below= (or give it the policy's value).",
    ),
    (
        "conflicting-on-indivisible",
        None,
        {"policy": P("error"), "on_indivisible": "replicate"},
        "ModelParallel got policy=LayoutPolicy(on_indivisible='error', replicate_below=4096) and "
        "on_indivisible='replicate', which disagree: both set on_indivisible (the policy says 'error').",
    ),
    (
        "not-a-policy",
        None,
        {"policy": {"replicate_below": 0}},
        "ModelParallel: policy must be a kml.LayoutPolicy. Received: policy={'replicate_below': 0}.",
    ),
    ("bad-old-keyword", None, {"replicate_below": -3}, "Received: replicate_below=-3."),
]


@pytest.mark.parametrize(
    "rules_policy, kwargs, want", [row[1:] for row in RESOLUTION], ids=[r[0] for r in RESOLUTION]
)
def test_model_parallel_policy(rules_policy, kwargs, want):
    mesh = kml.Mesh(**MESH)
    rules = kml.LayoutRules([(r".*up/kernel", (None, "model"))], policy=rules_policy)
    if isinstance(want, str):
        with pytest.raises(kml.InvalidOptionError, match=re.escape(want)):
            kml.ModelParallel(mesh, rules, **kwargs)
        return
    dist = kml.ModelParallel(mesh, rules, **kwargs)
    assert dist.policy == want
    assert (dist.on_indivisible, dist.replicate_below) == (want.on_indivisible, want.replicate_below)


@pytest.mark.parametrize(
    "set_once",
    [{"policy": P(replicate_below=0)}, {"replicate_below": 0}],
    ids=["policy", "old-keyword"],
)
def test_set_once_on_auto_rules_honoured_by_model_parallel(set_once):
    """The small kernels the planner splits under replicate_below=0 are split when trained."""
    mesh = kml.Mesh(**MESH)
    rules = kml.auto_rules(mlp(), mesh, **set_once)
    assert rules.policy == P(replicate_below=0)
    dist = kml.ModelParallel(mesh, rules)  # no policy given here
    assert dist.replicate_below == 0
    with dist.scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="mse")
    model.fit(np.ones((8, 8), "float32"), np.zeros((8, 8), "float32"), batch_size=8, epochs=1, verbose=0)
    specs = {v.path: tuple(v.value.sharding.spec) for v in model.trainable_variables}
    assert specs["mlp/up/kernel"] == (None, "model") and specs["mlp/down/kernel"] == ("model",), specs
    assert dist.plan(model).replicate_below == 0


def test_without_a_policy_the_default_threshold_keeps_small_kernels_whole():
    """What "set once" fixes: before, ModelParallel fell back to 4096 whatever auto_rules planned with."""
    mesh = kml.Mesh(**MESH)
    planned = kml.auto_rules(mlp(), mesh, replicate_below=0).rules
    rules = kml.LayoutRules([(rule.pattern, rule.axes) for rule in planned], suggested=True)
    assert rules.policy is None
    with kml.ModelParallel(mesh, rules).scope():
        model = mlp()
    assert tuple(model.get_layer("up").kernel.value.sharding.spec) == (None, None)


def test_on_indivisible_set_on_the_rules_is_honoured():
    """A kernel of 8×6 split over model=4: replicated by default, an error under the rules' policy."""
    mesh = kml.Mesh(**MESH)

    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(6, name="up")], name="mlp")

    split = [(r".*up/kernel", (None, "model"))]
    with pytest.warns(kml.IndivisibleShapeWarning), kml.ModelParallel(mesh, kml.LayoutRules(split)).scope():
        build()
    strict = kml.LayoutRules(split, policy=P(on_indivisible="error"))
    with (
        pytest.raises(kml.IndivisibleShapeError, match=r"mlp/up/kernel"),
        kml.ModelParallel(mesh, strict).scope(),
    ):
        build()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"policy": P(replicate_below=0), "replicate_below": 64},
            "auto_rules() got policy=LayoutPolicy(on_indivisible='replicate', replicate_below=0) and "
            "replicate_below=64, which disagree",
        ),
        (
            {"policy": "replicate"},
            "auto_rules(): policy must be a kml.LayoutPolicy. Received: policy='replicate'.",
        ),
    ],
    ids=["conflict", "not-a-policy"],
)
def test_auto_rules_policy_errors(kwargs, message):
    with pytest.raises(kml.InvalidOptionError, match=re.escape(message)):
        kml.auto_rules(mlp(), kml.Mesh(**MESH), **kwargs)


def test_auto_rules_attaches_the_default_policy_and_takes_policy_as_a_keyword():
    assert kml.auto_rules(mlp(), kml.Mesh(**MESH)).policy == P()
    parameter = inspect.signature(kml.auto_rules).parameters["policy"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None


def test_rules_keep_their_policy_when_bound_and_reject_another_type():
    policy = P("error", 0)
    rules = kml.LayoutRules([(r".*kernel", (None, "model"))], policy=policy)
    assert rules.bind(kml.Mesh(**MESH)).policy is policy
    assert kml.LayoutRules().policy is None
    with pytest.raises(kml.InvalidOptionError, match=r"LayoutRules: policy must be a kml.LayoutPolicy"):
        kml.LayoutRules(policy=0)


PRESETS = [
    ("mlp", lambda **kw: kml.mlp_rules(["up"], **kw)),
    ("transformer", lambda **kw: kml.transformer_rules(**kw)),
    ("conv", lambda **kw: kml.conv_rules(**kw)),
]


@pytest.mark.parametrize("make", [make for _, make in PRESETS], ids=[name for name, _ in PRESETS])
def test_presets_take_a_policy_and_carry_it(make):
    assert make().policy == P()
    assert make(policy=P("error", 0)).policy == P("error", 0)
    with pytest.raises(kml.InvalidOptionError, match=r"_rules\(\): policy must be a kml.LayoutPolicy"):
        make(policy="error")


def test_a_preset_policy_set_once_is_honoured_by_model_parallel():
    """mlp_rules(policy=replicate_below=0) splits a 8×16 kernel the default threshold keeps whole."""
    mesh = kml.Mesh(**MESH)

    def build():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="up")], name="mlp")

    with kml.ModelParallel(mesh, kml.mlp_rules(["up"])).scope():
        assert tuple(build().get_layer("up").kernel.value.sharding.spec) == (None, None)
    with kml.ModelParallel(mesh, kml.mlp_rules(["up"], policy=P(replicate_below=0))).scope():
        assert tuple(build().get_layer("up").kernel.value.sharding.spec) == (None, "model")


def test_a_misspelt_layer_in_the_mlp_preset_is_an_unmatched_rule():
    """Regression: `kml.mlp_rules` (and `--preset mlp:...`) made every rule optional, so a misspelt
    layer left its kernel replicated behind a column-parallel one with no warning, even under
    `--strict`. Its kernel rules are the user's layers now; a bias rule stays optional."""
    import warnings

    def planned(layers: list[str]) -> kml.Plan:
        dist = kml.ModelParallel(kml.Mesh(data=2, model=4), kml.mlp_rules(layers))
        with dist.scope():
            dense = keras.layers.Dense
            fc2 = dense(32, name="fc2", use_bias=False)
            model = keras.Sequential([keras.Input((32,)), dense(64, name="fc1"), fc2], name="mlp")
        return dist.plan(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = planned(["fc1", "fc_2"])
    assert [rule.pattern for rule in plan.unmatched_rules] == ["(?:.*/)?fc_2/kernel"]
    assert [w.category for w in caught] == [kml.UnmatchedRuleWarning]
    assert not planned(["fc1", "fc2"]).unmatched_rules  # fc2 has no bias: its bias rule is optional
