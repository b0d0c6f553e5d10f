"""End to end: real `model.fit` on real meshes matches single-device training.

Each case builds a model under a `kml.ModelParallel`, loads the same initial
weights as a model trained without any distribution, trains both on the same
batches, and checks (1) the weights agree to 1e-5, (2) every variable, optimizer
slots included, is laid out exactly as the plan says.
"""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from helpers import (
    BATCH,
    MLP_RULES,
    Reference,
    assert_laid_out_as_planned,
    assert_same_weights,
    build_mlp,
    train,
    trim,
)

import keras_meshlayout as kml

STEPS = 4


def build_attention() -> keras.Model:
    """Token embedding, multi-head self-attention, pooled classifier."""
    tokens = keras.Input((8,), dtype="int32")
    hidden = keras.layers.Embedding(64, 32, name="embed")(tokens)
    hidden = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="attn")(hidden, hidden)
    hidden = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(tokens, keras.layers.Dense(10, name="head")(hidden), name="tiny_attention")


#: Heads over `model` for query/key/value (hidden, heads, head_dim) and the output
#: projection (heads, head_dim, hidden); embeddings over their hidden dimension.
ATTENTION_RULES = [
    (r"attn/(query|key|value)/kernel", (None, "model", None)),
    (r"attn/(query|key|value)/bias", ("model", None)),
    (r"attn/attention_output/kernel", ("model", None, None)),
    (r"embed/embeddings", (None, "model")),
]


def mlp_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 32)).astype("float32")
    return x, x[:, :10].argmax(axis=1).astype("int32")


def attention_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.integers(0, 64, size=(BATCH * STEPS, 8)).astype("int32")
    return x, (x[:, 0] % 10).astype("int32")


@pytest.fixture(scope="module")
def mlp_reference() -> Reference:
    return Reference(build_mlp, mlp_data())


@pytest.fixture(scope="module")
def attention_reference() -> Reference:
    return Reference(build_attention, attention_data())


@pytest.mark.parametrize(
    "spec, rules",
    [
        ("data=2,model=4", MLP_RULES),
        ("data=1,model=8", MLP_RULES),
        ("data=8,model=1", MLP_RULES),
        ("data=4,model=2", MLP_RULES),
        ("data=8", None),
    ],
    ids=["2x4", "1x8", "8x1", "4x2", "data-only"],
)
def test_mlp_fit_matches_single_device(spec, rules, mlp_reference):
    mesh = kml.Mesh.parse(spec)
    distribution = kml.ModelParallel(mesh, rules, batch_axis="data")
    model = train(build_mlp, mlp_reference.initial, mlp_data(), distribution)

    assert_same_weights(model, mlp_reference.trained)
    plan = distribution.plan(model)
    assert_laid_out_as_planned(model, plan, mesh)
    if rules is None:
        assert all(entry.replicated for entry in plan)
        return
    model_size = mesh.axis_sizes["model"]
    assert plan["mlp/hidden_1/kernel"].axes == (None, "model")
    assert plan["mlp/hidden_2/kernel"].axes == ("model", None)
    assert plan["mlp/hidden_2/kernel"].bytes_per_device == 256 * 128 * 4 // model_size
    # The head is small, but the user's own rule splits it, and the plan says so (issue 12:
    # replicate_below keeps only the small matrices of preset and planner rules whole).
    head = plan["mlp/head/kernel"]
    assert (head.requested, head.axes) == (("model", None), ("model", None))
    assert head.reasons == (
        "small: 1280 elements < replicate_below=4096, split anyway: a rule of your own "
        "(replicate_below keeps only preset and planner rules' small matrices whole)",
    )
    # Optimizer slots follow their parameter.
    momentum = next(entry for entry in plan if entry.path.endswith("/mlp_hidden_1_kernel_momentum"))
    assert (momentum.axes, momentum.source) == ((None, "model"), "parameter")


def test_attention_and_embedding_fit_with_heads_sharded(attention_reference):
    mesh = kml.Mesh(data=2, model=4)
    distribution = kml.ModelParallel(mesh, ATTENTION_RULES, batch_axis="data", replicate_below=0)
    model = train(build_attention, attention_reference.initial, attention_data(), distribution)

    assert_same_weights(model, attention_reference.trained)
    plan = distribution.plan(model)
    assert_laid_out_as_planned(model, plan, mesh)
    for name in ("query", "key", "value"):
        kernel = plan[f"attn/{name}/kernel"]
        assert kernel.axes == (None, "model", None)
        assert kernel.bytes_per_device == 32 * 4 * 8 * 4 // 4
    assert plan["attn/attention_output/kernel"].axes == ("model", None, None)
    assert plan["embed/embeddings"].axes == (None, "model")
    assert plan["head/kernel"].source == "default"
    assert plan.unmatched_rules == ()


def test_batch_axis_need_not_be_first(mlp_reference):
    """The batch goes over whichever axis is named, here the second one."""
    mesh = kml.Mesh(model=2, data=4)
    distribution = kml.ModelParallel(mesh, MLP_RULES, batch_axis="data")
    model = train(build_mlp, mlp_reference.initial, mlp_data(), distribution)
    assert_same_weights(model, mlp_reference.trained)
    layout = distribution.get_data_layout((BATCH, 32))
    assert layout.axes == ("data", None)
    assert_laid_out_as_planned(model, distribution.plan(model), mesh)


def test_plain_keras_model_parallel_uses_first_match(mlp_reference):
    """Handed to Keras's own ModelParallel, the rules keep first-match semantics.

    Keras 3.15's `LayoutMap` raises when two patterns match one path; ours
    takes the first, in order, whatever the Keras version.
    """
    mesh = kml.Mesh(data=2, model=4)
    rules = kml.LayoutRules(
        [(r"mlp/hidden_1/kernel", (None, "model")), (r".*kernel", ("model", None))], mesh=mesh
    )
    distribution = keras.distribution.ModelParallel(layout_map=rules, batch_dim_name="data")
    model = train(build_mlp, mlp_reference.initial, mlp_data(), distribution)
    assert_same_weights(model, mlp_reference.trained)
    specs = {v.path: trim(v.value.sharding.spec) for v in model.weights}
    assert specs["mlp/hidden_1/kernel"] == (None, "model")
    assert specs["mlp/hidden_2/kernel"] == ("model",)
    assert specs["mlp/head/kernel"] == ("model",)  # plain Keras has no small-variable rule


def test_plan_renders_and_serialises(mlp_reference):
    import json

    distribution = kml.ModelParallel(
        kml.Mesh(data=2, model=4), [*MLP_RULES, (r".*hiden_3/kernel", (None, "model"))]
    )
    with distribution.scope():
        model = build_mlp()
    with pytest.warns(kml.UnmatchedRuleWarning, match=r"rule #3 '\.\*hiden_3/kernel'"):
        plan = distribution.plan(model)
    text = str(plan)
    for fragment in ["mlp/hidden_1/kernel", "(None, model)", "small: 1280 elements", "matched no variable"]:
        assert fragment in text
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["mesh"] == {"data": 2, "model": 4}
    assert data["unmatched_rules"] == [{"index": 3, "pattern": r".*hiden_3/kernel", "axes": [None, "model"]}]
    assert data["totals"]["bytes_per_device"] == plan.bytes_per_device
    hidden_1 = next(v for v in data["variables"] if v["path"] == "mlp/hidden_1/kernel")
    assert hidden_1 == {
        "path": "mlp/hidden_1/kernel",
        "shape": [32, 256],
        "dtype": "float32",
        "rule": {"index": 0, "pattern": r".*hidden_1/kernel", "note": ""},
        "requested": [None, "model"],
        "axes": [None, "model"],
        "reasons": [],
        "source": "rule",
        "role": "parameter",
        "shards": 4,
        "bytes": 32 * 256 * 4,
        "bytes_per_device": 32 * 256,
    }
    replicated = sum(int(np.prod(w.shape)) * 4 for w in model.weights)
    assert plan.replicated_bytes == replicated
    assert jax.device_count() == 8


def test_short_last_batch_is_a_clear_error():
    """Regression: Keras reuses the first batch's sharding for a short last batch.

    100 samples in batches of 64 leave a last batch of 36, which does not split
    over 8 devices; JAX alone raises an `IndivisibleError` naming no axis.
    """
    distribution = kml.ModelParallel(kml.Mesh(data=8))
    keras.distribution.set_distribution(distribution)
    model = build_mlp()
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = mlp_data()
    with pytest.raises(kml.IndivisibleBatchError, match=r"36 samples .* batch axis 'data' of size 8"):
        model.fit(x[:100], y[:100], batch_size=64, verbose=0)
    model.fit(x[:128], y[:128], batch_size=64, verbose=0)  # whole batches train as usual


def test_layer_output_rules_apply_and_show_in_the_plan(mlp_reference):
    """A `/output` rule keeps an activation in a layout; the plan lists it."""
    rules = [*MLP_RULES, (r"mlp/hidden_1/output", ("data", "model"))]
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    model = train(build_mlp, mlp_reference.initial, mlp_data(), distribution)
    assert_same_weights(model, mlp_reference.trained)
    plan = distribution.plan(model)
    [(rule, layers)] = plan.outputs
    assert (rule.index, layers) == (3, ("mlp/hidden_1",))
    assert plan.to_dict()["outputs"] == [
        {"index": 3, "pattern": "mlp/hidden_1/output", "axes": ["data", "model"], "layers": ["mlp/hidden_1"]}
    ]
    assert "Layer outputs kept in a layout" in str(plan)
    assert distribution.get_tensor_layout("mlp/hidden_1/output").axes == ("data", "model")


def test_the_plan_lists_a_seed_generators_state_as_keras_lays_it_out():
    """Regression: a Dropout's `SeedGenerator` state was missing from the plan, and a rule that really
    laid it out was reported as matching nothing (`UnmatchedRuleWarning`)."""
    rules = kml.LayoutRules([(r".*up/kernel", (None, "model")), (r".*seed_generator_state", ("data",))])
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    keras.distribution.set_distribution(dist)
    layers = [keras.Input((16,)), keras.layers.Dense(64, name="up"), keras.layers.Dropout(0.1, name="drop")]
    model = keras.Sequential([*layers, keras.layers.Dense(4, name="head")], name="seq")
    model.compile(optimizer="adam", loss="mse")
    model.fit(np.zeros((16, 16), "float32"), np.zeros((16, 4), "float32"), batch_size=16, verbose=0)
    plan = dist.plan(model)  # no UnmatchedRuleWarning: warnings are errors here
    (seed,) = [v for v in model.variables if "seed_generator_state" in v.path]
    (entry,) = [e for e in plan if e.path == seed.path]
    assert (entry.axes, entry.role) == (("data",), "rng")
    assert seed.value.sharding.spec == jax.sharding.PartitionSpec("data")
    assert plan.unmatched_rules == ()
    assert plan.memory().total == sum(
        e.bytes_per_device * (2 if e.role == "parameter" else 1) for e in plan if e.role != "rng"
    )


def _mlp_for_planning() -> keras.Model:
    layers = [keras.Input((16,)), keras.layers.Dense(64, name="up"), keras.layers.Dense(16, name="down")]
    return keras.Sequential(layers, name="mlp")


def test_model_parallel_splits_the_batch_where_auto_rules_planned_it():
    """Regression: on `Mesh(model=4, data=2)` auto_rules planned the batch over 'data' and ModelParallel
    split it over 'model' (its first axis), silently: the compiled step gathered the split kernels
    (2,046 bytes over 'model' against 384 predicted)."""
    keras.distribution.set_distribution(None)
    mesh = kml.Mesh(model=4, data=2)
    rules = kml.auto_rules(_mlp_for_planning(), mesh, replicate_below=0)
    assert rules.batch_axis == "data" and rules.bind(mesh).batch_axis == "data"
    assert kml.ModelParallel(mesh, rules).batch_dim_name == "data"
    with pytest.warns(kml.MeshLayoutWarning, match="planned by kml.auto_rules with the batch over 'data'"):
        kml.ModelParallel(mesh, rules, batch_axis="model")
    hand = kml.LayoutRules([(".*up/kernel", (None, "model"))])
    assert hand.batch_axis is None and kml.ModelParallel(mesh, hand).batch_dim_name == "model"


def test_rules_planned_with_no_batch_axis_say_how_to_keep_the_batch_whole():
    keras.distribution.set_distribution(None)
    rules = kml.auto_rules(_mlp_for_planning(), kml.Mesh(model=8), replicate_below=0)
    assert rules.batch_axis is None
    with pytest.warns(
        kml.MeshLayoutWarning, match=r"Fix: a batch axis of size 1.*kml.Mesh\(data=1, model=8\)"
    ):
        kml.ModelParallel(kml.Mesh(model=8), rules)
    mesh = kml.Mesh(data=1, model=8)
    assert kml.ModelParallel(mesh, kml.auto_rules(_mlp_for_planning(), mesh)).batch_dim_name == "data"


@pytest.mark.parametrize(
    ("pattern", "axes", "layers", "error", "message"),
    [
        (
            ".*up/output",
            ("data", "model", None),
            [keras.layers.Dense(64, name="up")],
            kml.RankMismatchError,
            r"rule #0 '\.\*up/output' -> \('data', 'model', None\) gives the output of layer '.*up' "
            r"3 entries, "
            r"but that output has rank 2 \(shape \(None, 64\)\)\. Fix: one entry per dimension, e\.g\. "
            r"\('data', None\)",
        ),
        (
            ".*up/output",
            ("data",),
            [keras.layers.Dense(64, name="up")],
            kml.RankMismatchError,
            "gives the output of layer '.*up' 1 entries, but that output has rank 2",
        ),
        (
            ".*lstm/output",
            ("data", None),
            [keras.layers.Reshape((4, 4)), keras.layers.LSTM(8, return_state=True, name="lstm")],
            kml.InvalidRuleError,
            r"lays out the output of layer 'lstm', which returns 3 tensors "
            r"\(\(None, 8\), \(None, 8\), \(None, 8\)\)",
        ),
    ],
    ids=["rank-3-on-rank-2", "rank-1-on-rank-2", "three-outputs"],
)
def test_an_output_rule_that_cannot_lay_out_the_output_is_a_clear_error_before_any_step(
    pattern, axes, layers, error, message
):
    """Regression: the wrong rank failed inside JAX's `with_sharding_constraint` at the first step, a
    too-short rule was padded silently, and a layer returning several tensors failed in
    `jax.device_put` while the functional model was built; none named the rule or the layer."""
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), [(pattern, axes)]))
    inputs = keras.Input((16,))
    with pytest.raises(error, match=message):
        outputs = inputs
        for layer in layers:
            outputs = layer(outputs)


@pytest.mark.parametrize(
    ("hidden", "split"), [(64, False), (512, True)], ids=["small-kernel", "large-kernel"]
)
def test_a_bias_follows_its_kernel_kept_whole_as_small(hidden, split):
    """Regression: `mlp_rules` kept a small `up` kernel whole (`replicate_below`) and split its bias,
    so XLA gathered the bias and the kernel's update every step: 18,816 bytes over 'model', where no
    rules at all send none."""
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), kml.mlp_rules(["up", "down"]))
    keras.distribution.set_distribution(dist)
    inputs = keras.Input((16,))
    hidden_out = keras.layers.Dense(hidden, activation="relu", name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(16, name="down")(hidden_out), name="m")
    model.compile(optimizer="adam", loss="mse")
    plan = dist.plan(model)
    assert plan["up/kernel"].axes == ((None, "model") if split else (None, None))
    assert plan["up/bias"].axes == (("model",) if split else (None,))
    assert model.get_layer("up").bias.value.sharding.spec == jax.sharding.PartitionSpec(*plan["up/bias"].axes)
    if not split:
        assert "its layer's kernel is small and kept whole" in plan["up/bias"].reasons[0]
        x = np.zeros((8, 16), "float32")
        assert kml.comm_report(model, x, x).wire_bytes_by_axis.get("model", 0) == 0


def test_model_parallel_with_another_replicate_below_than_planned_warns():
    keras.distribution.set_distribution(None)
    mesh = kml.Mesh(data=2, model=4)
    rules = kml.auto_rules(_mlp_for_planning(), mesh, replicate_below=0)
    assert kml.ModelParallel(mesh, rules).replicate_below == 0  # the rules carry theirs
    dist = kml.ModelParallel(mesh, rules, replicate_below=100_000)  # the warning comes with a layout
    match = (
        r"replicate_below=100000\) lays out '.*up/kernel' \(1024 elements\) otherwise than kml.auto_rules "
    )
    with pytest.warns(kml.MeshLayoutWarning, match=match + r"planned it, with replicate_below=0: whole here"):
        dist.resolve("mlp/up/kernel", (16, 64))
    dist.resolve("mlp/down/kernel", (64, 16))  # once
    # Told a threshold under which the plan's layouts stay as planned, it says nothing.
    kml.ModelParallel(mesh, kml.auto_rules(_mlp_for_planning(), mesh), replicate_below=0).resolve(
        "mlp/up/kernel", (16, 64)
    )


def _tiny_classifier() -> keras.Model:
    layers = [keras.Input((8,)), keras.layers.Dense(32, name="d1"), keras.layers.Dense(3, name="head")]
    return keras.Sequential(layers, name="tiny")


def _compiled_tiny(spe: int) -> keras.Model:
    keras.utils.set_random_seed(7)
    model = _tiny_classifier()
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", steps_per_execution=spe)
    return model


@pytest.mark.parametrize("spe", [1, 3, 4])
def test_an_error_part_way_through_a_group_of_steps_keeps_every_step_trained(spe):
    """Regression: with `steps_per_execution` > 1 an error after the first step of a group (here the
    short last batch, `IndivisibleBatchError`) left every variable deleted, and the next `fit`
    crashed the process: Keras keeps the state between a group's steps in a local variable."""
    x = np.random.default_rng(0).normal(size=(44, 8)).astype("float32")
    y = np.arange(44) % 3  # 5 batches of 8, then one of 4 that 8 devices cannot split
    keras.distribution.set_distribution(None)
    reference = _compiled_tiny(1)
    reference.fit(x[:40], y[:40], batch_size=8, epochs=1, verbose=0, shuffle=False)
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=8)))
    model = _compiled_tiny(spe)
    with pytest.raises(kml.IndivisibleBatchError):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    assert int(model.optimizer.iterations) == 5
    for got, want in zip(model.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
    model.fit(x[:40], y[:40], batch_size=8, epochs=1, verbose=0)  # and it trains on
    assert int(model.optimizer.iterations) == 10


def test_evaluate_that_fails_part_way_through_a_group_leaves_the_weights_as_they_were():
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=8)))
    model = _compiled_tiny(4)
    weights = model.get_weights()

    def batches():
        for step in range(8):
            if step == 5:
                raise ValueError("batch 5 is unreadable")
            yield np.ones((8, 8), "float32"), np.zeros(8, "int32")

    with pytest.raises(ValueError, match="batch 5 is unreadable"):
        model.evaluate(batches(), verbose=0)
    for got, want in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_output_rule_that_matches_no_layer_is_flagged_by_the_plan():
    """Regression: a misspelt output rule left the output unconstrained, silently (variable rules warned)."""
    rules = [(".*upp/output", ("data", None)), (".*down/output", ("data", None))]
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), rules)
    keras.distribution.set_distribution(dist)
    layers = [keras.Input((16,)), keras.layers.Dense(64, name="up"), keras.layers.Dense(8, name="down")]
    model = keras.Sequential(layers, name="s")
    with pytest.warns(kml.UnmatchedRuleWarning) as caught:
        plan = dist.plan(model)
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("rule #0 '.*upp/output' -> ('data', None) matched no layer output")
    assert "Nearest layer outputs: 's/up/output'" in message and message in plan.warnings
