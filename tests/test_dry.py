"""Dry planning and the memory budget.

The dry plan must equal the plan of the model really built (and compiled,
with its optimizer built) under the same distribution; memory figures are
checked against sums worked out by hand.
"""

from __future__ import annotations

import re

import keras
import pytest
from helpers import MLP_RULES, build_convnet, build_encoder, build_mlp

import keras_meshlayout as kml


def build_unnamed() -> keras.Model:
    """Layer names left to Keras: a dry build must not use them up."""
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64), keras.layers.Dense(8)])


def real_plan(build, distribution: kml.ModelParallel, optimizer) -> kml.Plan:
    with distribution.scope():
        model = build()
        model.compile(optimizer=optimizer, loss="mse")
        model.optimizer.build(model.trainable_variables)
    return distribution.plan(model)


@pytest.mark.parametrize(
    "build, rules, optimizer",
    [
        (build_mlp, MLP_RULES, "adam"),
        (build_mlp, MLP_RULES, "adafactor"),
        (build_encoder, kml.transformer_rules(), "lion"),
        (lambda: build_encoder(kv_heads=2), "auto", "sgd"),
        (build_convnet, kml.conv_rules(), "adamw"),
        (build_unnamed, [(r".*dense(_\d+)?/kernel", (None, "model"))], "rmsprop"),
    ],
    ids=["mlp-adam", "mlp-adafactor", "encoder-lion", "gqa-auto-sgd", "convnet-adamw", "unnamed-rmsprop"],
)
def test_dry_plan_equals_the_real_plan(build, rules, optimizer):
    mesh = kml.Mesh(data=2, model=4)
    if rules == "auto":
        rules = kml.auto_rules(build(), mesh, replicate_below=0)
    distribution = kml.ModelParallel(mesh, rules, replicate_below=0)
    dry = kml.dry_plan(build, distribution, optimizer=optimizer)
    real = real_plan(build, distribution, optimizer)
    assert dry.to_dict() == real.to_dict()
    assert len(dry) > 0


def test_dry_plan_allocates_nothing_and_leaves_no_trace():
    from keras.src.backend.common import global_state

    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4))
    before = list(global_state.get_global_attribute("uninitialized_variables") or [])
    kml.dry_plan(build_unnamed, distribution, optimizer="adam")
    assert list(global_state.get_global_attribute("uninitialized_variables") or []) == before
    assert keras.distribution.distribution() is None


def causal_lm() -> keras.Model:
    """A keras-hub task: it compiles itself (Adam) on construction, inside the dry build too."""
    import keras_hub

    backbone = keras_hub.models.Llama3Backbone(
        vocabulary_size=256,
        num_layers=1,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
    )
    return keras_hub.models.Llama3CausalLM(backbone=backbone, preprocessor=None)


def test_a_task_that_compiles_itself_plans_dry_as_built():
    """Keras refuses a variable made from a value (the task's Adam counters) in a stateless scope."""
    mesh = kml.Mesh(data=2, model=4)
    with kml.dry_build(causal_lm) as model:
        rules = kml.auto_rules(model, mesh, replicate_below=0)
        assert model.compiled and isinstance(model.optimizer, keras.optimizers.Adam)
    distribution = kml.ModelParallel(mesh, rules, replicate_below=0)
    dry = kml.dry_plan(causal_lm, distribution)  # the task's own Adam, its slots included
    with distribution.scope():
        real = causal_lm()
        real.optimizer.build(real.trainable_variables)
    assert dry.to_dict() == distribution.plan(real).to_dict()
    assert sum(entry.role == "optimizer" for entry in dry) == 2 * len(real.trainable_variables) + 2


def test_compile_step_recompiles_a_task_with_the_optimizer_it_is_given():
    """A task's own Adam keeps two slots per weight; `optimizer="sgd"` keeps none: fewer argument bytes."""
    import numpy as np

    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4))
    x = {"token_ids": np.zeros((8, 16), "int32"), "padding_mask": np.ones((8, 16), "int32")}
    y = np.zeros((8, 16), "int32")
    own = kml.compile_step(causal_lm, distribution, x, y)
    sgd = kml.compile_step(causal_lm, distribution, x, y, optimizer="sgd")
    memory = kml.dry_plan(causal_lm, distribution, optimizer="adam").memory()
    assert own.argument_bytes - sgd.argument_bytes == memory.optimizer - 8  # Adam's slots; both have counters


# Per device on data=2 × model=4 with MLP_RULES, float32: hidden_1 kernel and bias
# split 4 ways, hidden_2 kernel and the head kernel (small, but the rule is the user's
# own) row-split 4 ways, the rest (hidden_2 and head biases) replicated.
PARAMS = 32 * 256 + 256 + 256 * 128 + 128 * 4 + 128 * 10 + 10 * 4
COUNTERS = 4 + 4  # int32 iteration and float32 learning rate


@pytest.mark.parametrize(
    "optimizer, slots",
    [
        (keras.optimizers.SGD(), 0),
        (keras.optimizers.SGD(momentum=0.9), 1),
        (keras.optimizers.Adam(), 2),
        (keras.optimizers.Adam(amsgrad=True), 3),
        (keras.optimizers.AdamW(), 2),
        (keras.optimizers.Lion(), 1),
    ],
    ids=["sgd", "sgd-momentum", "adam", "adam-amsgrad", "adamw", "lion"],
)
def test_memory_by_hand(optimizer, slots):
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), MLP_RULES)
    memory = kml.dry_plan(build_mlp, distribution, optimizer=optimizer).memory()
    assert (memory.parameters, memory.gradients) == (PARAMS, PARAMS)
    assert memory.optimizer == slots * PARAMS + COUNTERS
    assert memory.total == 2 * PARAMS + memory.optimizer
    assert memory.capacity is None and memory.fits is None


def test_adafactor_memory_by_hand():
    """Adafactor keeps a full velocity plus row and column statistics of each matrix."""
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), MLP_RULES)
    memory = kml.dry_plan(build_mlp, distribution, optimizer="adafactor").memory()
    factored = (32 + 256) + (256 + 128) + (128 + 10)  # replicated: optimizer statistics follow no rule
    placeholders = 3 * 2 * 4  # two int32 scalars per bias
    assert memory.optimizer == PARAMS + factored * 4 + placeholders + COUNTERS


def memory_under_policy(policy: str) -> kml.MemoryEstimate:
    """The dry plan's memory of the MLP built under a Keras dtype policy, with Adam."""

    def build():
        keras.config.set_dtype_policy(policy)
        try:
            return build_mlp()
        finally:
            keras.config.set_dtype_policy("float32")

    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), MLP_RULES)
    return kml.dry_plan(build, distribution, optimizer="adam").memory()


def test_bfloat16_variables_halve_the_state():
    memory = memory_under_policy("bfloat16")
    assert (memory.parameters, memory.optimizer) == (PARAMS // 2, PARAMS + COUNTERS)


def test_mixed_precision_keeps_float32_state():
    """Under mixed_bfloat16 variables, gradients and slots stay float32."""
    memory = memory_under_policy("mixed_bfloat16")
    assert (memory.parameters, memory.gradients, memory.optimizer) == (PARAMS, PARAMS, 2 * PARAMS + COUNTERS)


def test_guard_names_the_largest_replicated_variables():
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4))  # no rules: all replicated
    plan = kml.dry_plan(build_mlp, distribution, optimizer="adam")
    with pytest.raises(kml.MemoryBudgetError) as info:
        plan.check()
    message = str(info.value)
    assert "100% of each device's training state" in message
    first = message.splitlines()[2]
    assert first.startswith("  mlp/hidden_2/kernel (256, 128) float32: 256.0 KiB per device")
    assert "dim 0 (256) over data (2) or model (4); dim 1 (128) over data (2) or model (4)" in first
    assert "Fix:" in message
    plan.check(max_replicated_fraction=1.0)


def test_guard_checks_the_device_capacity():
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), MLP_RULES)
    plan = kml.dry_plan(build_mlp, distribution, optimizer="adam")
    plan.check(device_memory="1MiB")
    with pytest.raises(kml.MemoryBudgetError, match=r"more than the 100.0 KiB available"):
        plan.check(device_memory="100KiB")
    assert plan.memory("1MB").fits is True
    with pytest.raises(kml.InvalidOptionError, match="Cannot read a memory size"):
        plan.memory("lots")


def test_a_plan_with_nothing_left_to_split_that_does_not_fit_says_what_helps():
    """Regression: the message listed "Largest replicated variables:" and then none."""
    rules = [(".*kernel", ("data", "model")), (".*bias", (("data", "model"),))]

    def build() -> keras.Model:
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, name="wide")], name="one")

    plan = kml.dry_plan(build, kml.ModelParallel(kml.Mesh(data=2, model=4), rules, replicate_below=0))
    with pytest.raises(kml.MemoryBudgetError) as info:
        plan.check(device_memory="1KB")
    message = str(info.value)
    assert "No replicated variable is left that a mesh axis could split" in message
    assert "Largest replicated variables" not in message and "a device with more memory" in message


def test_the_guard_accepts_what_the_planner_keeps_replicated_and_says_why():
    """Issue 23: `plan --auto` failed its own guard ("... or use kml.auto_rules"), which --auto is."""
    from helpers import mlp

    mesh = kml.Mesh(data=2, model=4)

    def build():
        return mlp(30, ("up", 66, "relu"), ("mid", 66, "relu"), ("down", 30))  # 66 does not divide by 4

    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh)
    plan = kml.dry_plan(build, kml.ModelParallel(mesh, rules), optimizer="adam")
    assert plan.replicated_bytes == plan.bytes_per_device  # the planner's honest answer: all whole
    assert "mlp/mid/kernel" in plan.intended
    assert any(path.endswith("/mlp_mid_kernel_momentum") for path in plan.intended)  # its slots too
    plan.check()  # no MemoryBudgetError for its own choice
    note = plan.intended_replication()
    assert note.startswith("100% of each device's training state stays replicated by the planner's")
    assert "pair up → mid: 66 features do not divide by 'model' (4)" in note
    assert "--memory-budget SIZE --batch-size N" in note and "another mesh" in note
    assert plan.intended_replication(max_replicated_fraction=1.0) is None
    # The same layout written by hand is the user's: the guard still fails it.
    hand = kml.dry_plan(build, kml.ModelParallel(mesh), optimizer="adam")
    assert hand.intended == frozenset()
    with pytest.raises(kml.MemoryBudgetError, match=re.escape("or use kml.auto_rules / a preset")):
        hand.check()
