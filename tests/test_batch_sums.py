"""How often XLA sums each gradient over the batch axis, read off the forward trace (`planner/_batch_sums`).

Regression tests for issue 19's `data`-axis misses: keras-hub ALBERT (one block called at every
depth, predicted 0.780× the compiled step), DeBERTaV3 (a relative table normed before it is
repeated over the batch, 0.898×) and FNet (Fourier mixing, 0.653×). `tests/test_zoo.py` compiles
those three and holds the prediction to ±2%; here each mechanism is checked on a tiny model
without compiling.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_meshlayout as kml
from keras_meshlayout.planner._batch_sums import batch_sums
from keras_meshlayout.planner._trace import trace_model

BATCH, LENGTH, WIDTH = 4, 6, 8


def sums(model: keras.Model, x: np.ndarray):
    return batch_sums(trace_model(model, x))


def test_a_layer_called_twice_sums_its_gradient_twice():
    shared, once = keras.layers.Dense(WIDTH, name="shared"), keras.layers.Dense(WIDTH, name="once")
    inputs = keras.Input((WIDTH,))
    outputs = once(shared(shared(inputs)))
    got = sums(keras.Model(inputs, outputs), np.zeros((BATCH, WIDTH), "float32"))
    assert got.reads == {"shared/kernel": 2, "shared/bias": 2, "once/kernel": 1, "once/bias": 1}
    assert got.meetings == () and got.gathered == ()


class NormedTable(keras.layers.Layer):
    """A table normed (with a scale) before it is repeated over the batch and added, as DeBERTa's."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(LENGTH, WIDTH), name="table")
        self.scale = self.add_weight(shape=(WIDTH,), initializer="ones", name="scale")

    def call(self, x):
        table = self.table - keras.ops.mean(self.table, axis=-1, keepdims=True)
        normed = keras.ops.expand_dims(table * self.scale, 0)
        return x + keras.ops.repeat(normed, keras.ops.shape(x)[0], axis=0)


class Merged(keras.layers.Layer):
    """A scale read where the batch is merged with the sequence, `(B, T, C)` as `(B·T, C)`."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(WIDTH,), initializer="ones", name="scale")

    def call(self, x):
        return keras.ops.reshape(keras.ops.reshape(x, (-1, WIDTH)) * self.scale, keras.ops.shape(x))


class Positions(keras.layers.Layer):
    """A position table longer than the sequence: its first rows broadcast over the batch."""

    def build(self, input_shape):
        self.table = self.add_weight(shape=(4 * LENGTH, WIDTH), name="table")

    def call(self, x):
        return x + keras.ops.broadcast_to(self.table[:LENGTH], keras.ops.shape(x))


@pytest.mark.parametrize(
    ("layer", "reads"),
    [
        # The scale's gradient comes after the batch is summed: only the table's is summed.
        (NormedTable(name="rel"), {"rel/table": 1}),
        (Merged(name="norm"), {"norm/scale": 1}),
        (Positions(name="positions"), {"positions/table": 0.25}),  # the rows read
    ],
    ids=["normed-then-repeated", "batch-merged-with-sequence", "sliced-position-table"],
)
def test_weights_read_before_the_batch_meet_it_once(layer, reads):
    inputs = keras.Input((LENGTH, WIDTH))
    got = sums(keras.Model(inputs, layer(inputs)), np.zeros((BATCH, LENGTH, WIDTH), "float32"))
    assert dict(got.reads) == reads
    assert got.meetings == ()


def test_a_value_computed_from_two_weights_is_summed_where_it_meets_the_batch():
    class Outer(keras.layers.Layer):
        def build(self, input_shape):
            self.rows = self.add_weight(shape=(LENGTH, 1), name="rows")
            self.cols = self.add_weight(shape=(1, WIDTH), name="cols")

        def call(self, x):
            return x + keras.ops.expand_dims(self.rows * self.cols, 0)  # (1, T, C) from (T, 1) and (1, C)

    inputs = keras.Input((LENGTH, WIDTH))
    got = sums(keras.Model(inputs, Outer(name="outer")(inputs)), np.zeros((BATCH, LENGTH, WIDTH), "float32"))
    assert dict(got.reads) == {}
    assert got.meetings == (LENGTH * WIDTH * 4,)


def test_a_fourier_transform_of_the_batch_gathers_it():
    class Mixing(keras.layers.Layer):
        def call(self, x):
            real, _ = keras.ops.fft2((x, keras.ops.zeros_like(x)))
            return real

    inputs = keras.Input((LENGTH, WIDTH))
    outputs = keras.layers.Dense(WIDTH, name="out")(Mixing(name="mixing")(inputs))
    got = sums(keras.Model(inputs, outputs), np.zeros((BATCH, LENGTH, WIDTH), "float32"))
    assert got.gathered == (BATCH * LENGTH * WIDTH * 8,)  # complex64, the whole batch


def test_the_plan_predicts_a_shared_layer_s_gradient_all_reduce_per_call():
    shared = keras.layers.Dense(WIDTH, name="shared")
    inputs = keras.Input((WIDTH,))
    model = keras.Model(inputs, shared(shared(inputs)))
    x = np.zeros((BATCH, WIDTH), "float32")
    options = dict(batch=x, optimizer="sgd", replicate_below=10**9)  # everything replicated
    rules = kml.auto_rules(model, kml.Mesh(data=2, model=4), **options)
    per_call = 4 * (WIDTH * WIDTH + WIDTH)  # a ring all-reduce over 2 devices sends its bytes once
    assert rules.cost.wire_bytes_by_axis == {"data": 2 * per_call + 4}  # and the loss's scalar
