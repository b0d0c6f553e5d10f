"""predict/evaluate for any number of samples, and a model that survives an exception (issue 13).

Regression tests for two bugs: `model.predict(x)` with 251 samples and
`batch_size=32` on `data=2` raised `IndivisibleBatchError` at the short last
batch, and after an exception inside predict, evaluate or fit the model had no
weights left ("TypeError: 'NoneType' object is not callable" from predict,
evaluate and save).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_meshlayout as kml
from keras_meshlayout.core import _trainer_hooks

FEATURES, CLASSES = 8, 4
RULES = [
    (r".*hidden/kernel", (None, "model")),  # column-parallel
    (r".*hidden/bias", ("model",)),
    (r".*head/kernel", ("model", None)),  # row-parallel
]


def sequential() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="seq",
    )


def functional() -> keras.Model:
    """Two inputs, so each batch is several arrays."""
    left = keras.Input((FEATURES // 2,), name="left")
    right = keras.Input((FEATURES // 2,), name="right")
    hidden = keras.layers.Dense(16, activation="relu", name="hidden")(
        keras.layers.Concatenate()([left, right])
    )
    return keras.Model({"left": left, "right": right}, keras.layers.Dense(CLASSES, name="head")(hidden))


class Classifier(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(16, activation="relu", name="hidden")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def build(self, input_shape):
        self.hidden.build(input_shape)
        self.head.build((*input_shape[:-1], 16))

    def call(self, x):
        return self.head(self.hidden(x))


def subclassed() -> keras.Model:
    model = Classifier(name="classifier")
    model.build((None, FEATURES))
    return model


BUILDERS = {"sequential": sequential, "functional": functional, "subclassed": subclassed}


def compile_(model: keras.Model, steps_per_execution: int = 1) -> keras.Model:
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            "sparse_categorical_accuracy",
            keras.metrics.SparseCategoricalCrossentropy(from_logits=True),
        ],
        weighted_metrics=["sparse_categorical_accuracy"],
        steps_per_execution=steps_per_execution,
    )
    return model


def data(kind: str, samples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = x[:, :CLASSES].argmax(axis=1).astype("int32")
    if kind == "functional":
        x = {"left": x[:, : FEATURES // 2], "right": x[:, FEATURES // 2 :]}
    return x, y


def distribution() -> kml.ModelParallel:
    return kml.ModelParallel(kml.Mesh(data=2, model=4), RULES, batch_axis="data", replicate_below=0)


def initial_weights(kind: str) -> list[np.ndarray]:
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(7)
    return BUILDERS[kind]().get_weights()


def make(kind: str, weights, dist=None, steps_per_execution: int = 1) -> keras.Model:
    keras.distribution.set_distribution(dist)
    model = BUILDERS[kind]()
    model.set_weights(weights)
    return compile_(model, steps_per_execution)


def assert_close(actual, expected, what):
    for a, b in zip(keras.tree.flatten(actual), keras.tree.flatten(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0, err_msg=what)


@pytest.mark.parametrize(
    "kind, samples, batch_size, steps_per_execution, weighted",
    [
        ("sequential", 251, 32, 1, False),
        ("functional", 251, 32, 1, False),
        ("subclassed", 251, 32, 1, False),
        ("sequential", 5, 32, 1, False),
        ("sequential", 251, 31, 1, True),
        ("functional", 251, 32, 2, True),
    ],
    ids=[
        "sequential-251-by-32",
        "functional-251-by-32",
        "subclassed-251-by-32",
        "one-short-batch",
        "every-batch-odd-weighted",
        "steps-per-execution-weighted",
    ],
)
def test_predict_and_evaluate_any_sample_count_equal_one_device(
    kind, samples, batch_size, steps_per_execution, weighted
):
    x, y = data(kind, samples)
    weight = np.linspace(0.5, 2.0, samples).astype("float32") if weighted else None
    weights = initial_weights(kind)
    reference = make(kind, weights)
    want_outputs = reference.predict(x, batch_size=batch_size, verbose=0)
    want_logs = reference.evaluate(
        x, y, sample_weight=weight, batch_size=batch_size, verbose=0, return_dict=True
    )

    model = make(kind, weights, distribution(), steps_per_execution)
    outputs = model.predict(x, batch_size=batch_size, verbose=0)
    logs = model.evaluate(x, y, sample_weight=weight, batch_size=batch_size, verbose=0, return_dict=True)

    assert outputs.shape == (samples, CLASSES)
    assert_close(outputs, want_outputs, "predict")
    assert logs.keys() == want_logs.keys() and len(logs) == 4
    for name, value in logs.items():
        np.testing.assert_allclose(value, want_logs[name], atol=1e-5, rtol=0, err_msg=name)
    assert tuple(model.weights[0].value.sharding.spec) == (None, "model")  # tensor parallel throughout


def test_on_batch_forms_and_validation_take_any_batch():
    weights = initial_weights("sequential")
    x, y = data("sequential", 27)
    train_x, train_y = data("sequential", 64, seed=1)
    reference = make("sequential", weights)
    want = [reference.predict_on_batch(x), reference.test_on_batch(x, y)]
    reference.fit(train_x, train_y, batch_size=32, verbose=0, shuffle=False)
    want_val = reference.evaluate(x, y, verbose=0, return_dict=True)

    model = make("sequential", weights, distribution())
    assert_close(model.predict_on_batch(x), want[0], "predict_on_batch")
    assert_close(model.test_on_batch(x, y), want[1], "test_on_batch")
    history = model.fit(train_x, train_y, batch_size=32, validation_data=(x, y), verbose=0, shuffle=False)
    for name in ("loss", "sparse_categorical_accuracy"):
        np.testing.assert_allclose(history.history[f"val_{name}"][-1], want_val[name], atol=1e-5, rtol=0)


def test_predict_a_generator_of_uneven_batches_on_an_uncompiled_model():
    """The first batch is short (replicated); the later ones split again; order is kept."""
    x, _ = data("sequential", 251)
    sizes = [5, 32, 64, 3, 32, 115]

    def batches():
        start = 0
        for size in sizes:
            yield (x[start : start + size],)
            start += size

    weights = initial_weights("sequential")
    keras.distribution.set_distribution(None)
    reference = sequential()
    reference.set_weights(weights)
    want = reference.predict(batches(), steps=len(sizes), verbose=0)
    keras.distribution.set_distribution(distribution())
    model = sequential()
    model.set_weights(weights)
    assert_close(model.predict(batches(), steps=len(sizes), verbose=0), want, "predict of a generator")


@pytest.mark.parametrize(
    "call",
    [
        lambda model, x, y: model.fit(x, y, batch_size=32, verbose=0),
        lambda model, x, y: model.train_on_batch(x, y),
    ],
    ids=["fit", "train_on_batch"],
)
def test_training_still_refuses_a_batch_that_does_not_split(call):
    model = make("sequential", initial_weights("sequential"), distribution())
    x, y = data("sequential", 27)
    with pytest.raises(
        kml.IndivisibleBatchError, match=r"A batch of 27 samples .* batch axis 'data' of size 2"
    ):
        call(model, x, y)


def test_a_short_batch_is_replicated_only_inside_predict_and_evaluate():
    dist = distribution()
    assert not _trainer_hooks.replicates_batch(dist, (27, FEATURES))  # outside any Keras call
    with pytest.raises(kml.IndivisibleBatchError):
        dist.get_data_layout((27, FEATURES))
    token = _trainer_hooks._INFERENCE.set(True)
    try:
        assert _trainer_hooks.replicates_batch(dist, (27, FEATURES))
        assert dist.get_data_layout((27, FEATURES)).axes == (None, None)
        assert dist.get_data_layout((32, FEATURES)).axes == ("data", None)
    finally:
        _trainer_hooks._INFERENCE.reset(token)


# -- the model survives an exception --------------------------------------------------


class Switch(keras.layers.Layer):
    """Passes its input through; raises while training once `broken` is set (a bug in a custom layer)."""

    broken = False

    def call(self, x, training=False):
        if training and self.broken:
            raise RuntimeError("broken layer")
        return x


class RaiseAt(keras.callbacks.Callback):
    """Raises `error` at the end (or the beginning) of predict/evaluate batch `batch`."""

    def __init__(self, batch: int, error: BaseException, at: str = "end"):
        super().__init__()
        self.batch, self.error, self.at = batch, error, at

    def _maybe_raise(self, batch, at):
        if batch == self.batch and at == self.at:
            raise self.error

    def on_predict_batch_begin(self, batch, logs=None):
        self._maybe_raise(batch, "begin")

    def on_predict_batch_end(self, batch, logs=None):
        self._maybe_raise(batch, "end")

    on_test_batch_end = on_predict_batch_end


class PredictDuringFit(keras.callbacks.Callback):
    """After training batch `batch`, calls a predict that fails (its own callback raises)."""

    def __init__(self, batch: int):
        super().__init__()
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        if batch == self.batch:
            fails = RaiseAt(0, RuntimeError("nested"), at="begin")
            self.model.predict(np.zeros((4, FEATURES), "float32"), verbose=0, callbacks=[fails])


def switched() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="relu", name="hidden"),
            Switch(name="switch"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="seq",
    )


def fit_three_batches(model, x, y):
    model.fit(x[:96], y[:96], batch_size=32, verbose=0, shuffle=False)


def fit_on_full_batches(model, x, y):
    model.fit(x[:224], y[:224], batch_size=32, verbose=0, shuffle=False)


def break_and_fit(model, x, y):
    model.get_layer("switch").broken = True
    try:
        model.fit(x, y, batch_size=32, verbose=0, shuffle=False)
    finally:
        model.get_layer("switch").broken = False


FAILURES = [
    # (id, failing call, error type, how the single-device reference gets the expected weights)
    (
        "predict-callback-raises",
        lambda m, x, y: m.predict(x, batch_size=32, verbose=0, callbacks=[RaiseAt(2, RuntimeError("cb"))]),
        RuntimeError,
        None,
    ),
    (
        "evaluate-callback-raises",
        lambda m, x, y: m.evaluate(
            x, y, batch_size=32, verbose=0, callbacks=[RaiseAt(1, RuntimeError("cb"))]
        ),
        RuntimeError,
        None,
    ),
    (
        "predict-ctrl-c",
        lambda m, x, y: m.predict(x, batch_size=32, verbose=0, callbacks=[RaiseAt(0, KeyboardInterrupt())]),
        KeyboardInterrupt,
        None,
    ),
    ("fit-first-step-raises", break_and_fit, RuntimeError, None),
    (
        "predict-in-a-fit-callback-raises",  # the inner guard leaves fit's own state to fit
        lambda m, x, y: m.fit(x, y, batch_size=32, verbose=0, shuffle=False, callbacks=[PredictDuringFit(2)]),
        RuntimeError,
        fit_three_batches,
    ),
    (
        "validation-in-fit-raises",  # the epoch's training stays
        lambda m, x, y: m.fit(
            x[:224],
            y[:224],
            batch_size=32,
            validation_data=(x[:64], y[:64]),
            callbacks=[RaiseAt(1, RuntimeError("cb"))],
            verbose=0,
            shuffle=False,
        ),
        RuntimeError,
        fit_on_full_batches,
    ),
    (
        "fit-short-last-batch",
        lambda m, x, y: m.fit(x, y, batch_size=32, verbose=0, shuffle=False),
        kml.IndivisibleBatchError,
        fit_on_full_batches,  # the 7 full batches before the error stay trained
    ),
]


@pytest.mark.parametrize(
    "fail, error, expected", [row[1:] for row in FAILURES], ids=[row[0] for row in FAILURES]
)
def test_model_survives_an_exception(fail, error, expected, tmp_path):
    x, y = data("sequential", 251)
    keras.utils.set_random_seed(3)
    keras.distribution.set_distribution(None)
    weights = switched().get_weights()

    keras.distribution.set_distribution(None)
    reference = compile_(switched())
    reference.set_weights(weights)
    if expected is not None:
        expected(reference, x, y)
    want_weights = reference.get_weights()
    want_outputs = reference.predict(x, batch_size=32, verbose=0)
    want_logs = reference.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)

    keras.distribution.set_distribution(distribution())
    model = compile_(switched())
    model.set_weights(weights)
    with pytest.raises(error):
        fail(model, x, y)

    for variable, want in zip(model.weights, want_weights, strict=True):
        np.testing.assert_allclose(np.asarray(variable.value), want, atol=1e-5, rtol=0, err_msg=variable.path)
    assert_close(model.predict(x, batch_size=32, verbose=0), want_outputs, "predict after the error")
    logs = model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True)
    np.testing.assert_allclose(logs["loss"], want_logs["loss"], atol=1e-5, rtol=0)
    model.save(tmp_path / "after.keras")
    keras.distribution.set_distribution(None)
    loaded = keras.saving.load_model(tmp_path / "after.keras", custom_objects={"Switch": Switch})
    assert_close(loaded.get_weights(), want_weights, "saved after the error")
