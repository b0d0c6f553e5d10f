"""Shared by the end-to-end tests: training with and without a distribution, and checks."""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml

BATCH = 64


def fresh_env(*drop: str) -> dict[str, str]:
    """This environment for a process a test starts: without the session's `XLA_FLAGS` (the process
    emulates its own devices, as on a user's machine), `KERAS_BACKEND` and `drop`.

    It keeps the session's XLA:CPU optimisation level (`tests/conftest.py`): a step the process
    compiles is then the same machine code as the session's, so their results can be compared bit
    for bit.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND", *drop)}
    level = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.startswith("--xla_backend_optimization")]
    if level:
        env["XLA_FLAGS"] = " ".join(level)
    return env


#: Column-parallel first hidden layer, row-parallel second. The last rule also
#: matches the classifier head, which stays replicated because it is small.
MLP_RULES = [
    (r".*hidden_1/kernel", (None, "model")),
    (r".*hidden_1/bias", ("model",)),
    (r".*/kernel", ("model", None)),
]


def mlp(features: int, *layers: tuple[str, int] | tuple[str, int, str], name: str = "mlp") -> keras.Model:
    """The one small test model: `keras.Input((features,))`, then a `Dense` per `(name, units[, activation])`.

    Its variables are `<name>/<layer>/kernel` and `<name>/<layer>/bias`. Every test file's
    small MLP is built here, so that they differ only in the sizes and names they need.

    Example:
        >>> model = mlp(8, ("up", 16, "relu"), ("down", 8))
        >>> [w.path for w in model.weights][:2]
        ['mlp/up/kernel', 'mlp/up/bias']
    """
    dense = [
        keras.layers.Dense(units, activation=rest[0] if rest else None, name=layer)
        for layer, units, *rest in layers
    ]
    return keras.Sequential([keras.Input((features,)), *dense], name=name)


def build_mlp() -> keras.Model:
    """The 32 → 256 → 128 → 10 classifier of the issue."""
    return mlp(32, ("hidden_1", 256, "relu"), ("hidden_2", 128, "relu"), ("head", 10))


def train(build, weights, data, distribution=None, batch_size=BATCH) -> keras.Model:
    """Builds, loads `weights`, and fits for one epoch without shuffling."""
    keras.distribution.set_distribution(distribution)
    model = build()
    model.set_weights(weights)
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(*data, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


class Reference:
    """Initial weights and single-device trained weights, computed once per model."""

    def __init__(self, build, data, batch_size=BATCH, initial=None):
        """`initial`: weights to start from (say, those of a model already built); else a new build's."""
        if initial is None:
            keras.utils.set_random_seed(42)
            initial = build().get_weights()
        self.initial = initial
        self.trained = train(build, self.initial, data, batch_size=batch_size).get_weights()
        moved = max(np.abs(a - b).max() for a, b in zip(self.initial, self.trained, strict=True))
        assert moved > 1e-3, "training must change the weights for the comparison to mean anything"


def assert_laid_out_as_planned(model: keras.Model, plan: kml.Plan, mesh: kml.Mesh) -> None:
    """Every model and optimizer variable is sharded exactly as the plan says."""
    variables = list(model.weights) + list(model.optimizer.variables)
    assert [v.path for v in variables] == [entry.path for entry in plan]
    for variable in variables:
        axes = plan[variable.path].axes
        sharding = variable.value.sharding
        expected = NamedSharding(mesh.backend_mesh, PartitionSpec(*axes))
        assert sharding.is_equivalent_to(expected, len(variable.shape)), (variable.path, sharding, axes)
        assert trim(sharding.spec) == trim(PartitionSpec(*axes)), variable.path


def trim(spec: PartitionSpec) -> tuple:
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def assert_same_weights(model: keras.Model, expected: list[np.ndarray]) -> None:
    for variable, want in zip(model.weights, expected, strict=True):
        np.testing.assert_allclose(np.asarray(variable.value), want, atol=1e-5, rtol=0, err_msg=variable.path)


def build_encoder(kv_heads: int | None = None) -> keras.Model:
    """One post-norm transformer encoder block with a pooled classifier."""
    tokens = keras.Input((16,), dtype="int32")
    hidden = keras.layers.Embedding(128, 64, name="token_embedding")(tokens)
    if kv_heads is None:
        attention = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16, name="attention")
    else:
        attention = keras.layers.GroupQueryAttention(16, 4, kv_heads, name="attention")
    hidden = keras.layers.Add()([hidden, attention(hidden, hidden)])
    hidden = keras.layers.LayerNormalization(name="attention_norm")(hidden)
    ffn = keras.layers.Dense(256, activation="gelu", name="feedforward_intermediate_dense")(hidden)
    ffn = keras.layers.Dense(64, name="feedforward_output_dense")(ffn)
    hidden = keras.layers.LayerNormalization(name="feedforward_norm")(keras.layers.Add()([hidden, ffn]))
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(tokens, keras.layers.Dense(10, name="head")(pooled), name="encoder")


def build_convnet() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="conv_1"),
            keras.layers.Conv2D(64, 3, padding="same", activation="relu", name="conv_2"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10, name="head"),
        ],
        name="convnet",
    )


def values(model: keras.Model) -> list[np.ndarray]:
    """Model weights, then optimizer variables (when built), as host arrays."""
    optimizer = getattr(model, "optimizer", None)
    slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return [np.asarray(v.value) for v in [*model.weights, *slots]]


def assert_bit_identical(model: keras.Model, expected: list[np.ndarray]) -> None:
    got = values(model)
    assert len(got) == len(expected)
    paths = [v.path for v in [*model.weights, *model.optimizer.variables]]
    for path, a, b in zip(paths, got, expected, strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b), path


def compiled_step(build, dist: kml.ModelParallel, x, y) -> tuple[kml.CommReport, int]:
    """The comm report of `build()`'s Adam step compiled under `dist`, and its state bytes per device.

    `dist` is the global distribution while the model is built and compiled, and is unset after.
    """
    keras.distribution.set_distribution(dist)
    try:
        model = build()
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        report = kml.comm_report(model, x, y)
        model.optimizer.build(model.trainable_variables)
        memory = dist.plan(model).memory()
    finally:
        keras.distribution.set_distribution(None)
    return report, memory.parameters + memory.gradients + memory.optimizer


def assert_predicted_as_compiled(build, rules: kml.LayoutRules, dist: kml.ModelParallel, x, y) -> None:
    """The planner's bytes per axis = the compiled step's ± 2%, and its state bytes = the plan's, exactly."""
    report, state = compiled_step(build, dist, x, y)
    for axis, measured in report.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis
    assert rules.cost.state_bytes == state


def compiled_peak(model: keras.Model, x, y) -> int:
    """XLA's per-device peak of `model`'s own training step: argument + output + temporaries - aliased.

    Compiled (never run) for the current distribution with the state donated, as Keras's
    `fit` compiles it, so the updated state reuses the state's buffers.
    """
    import jax

    from keras_meshlayout import _compat

    distribution = keras.distribution.distribution()
    _compat.symbolic_build(model, (x, y, None))

    def abstract(variable: keras.Variable) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(
            variable.value.shape, variable.value.dtype, sharding=variable.value.sharding
        )

    def abstract_input(array):
        array = np.asarray(array)
        sharding = distribution.get_data_layout(array.shape).backend_layout
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)

    groups = (model.trainable_variables, model.non_trainable_variables)
    groups += (model.optimizer.variables, model.metrics_variables)
    state = tuple([abstract(v) for v in group] for group in groups)
    batch = (keras.tree.map_structure(abstract_input, x), abstract_input(y), None)
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, _compat.state_shardings(model)))
    stats = step.lower(state, batch).compile().memory_analysis()
    return (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        + stats.temp_size_in_bytes
        - stats.alias_size_in_bytes
    )
