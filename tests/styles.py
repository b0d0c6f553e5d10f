"""One transformer block and one MLP, each written in the styles Keras users write.

Every builder of a family computes the same function with weights of the same
shapes, created in the same order, so their plans can be compared up to paths.
"""

from __future__ import annotations

import keras
from keras import ops

VOCAB, LENGTH, HIDDEN, HEADS, FFN, CLASSES = 32, 8, 32, 4, 128, 10
HEAD_DIM = HIDDEN // HEADS
FEATURES, WIDTH = 16, 64


# -- the transformer block ------------------------------------------------------------


def _attention(q, k, v):
    """Multi-head attention written with keras.ops on (batch, length, hidden) projections."""
    shape = (-1, LENGTH, HEADS, HEAD_DIM)
    q, k, v = (ops.reshape(t, shape) for t in (q, k, v))
    scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM**0.5
    out = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), v)
    return ops.reshape(out, (-1, LENGTH, HIDDEN))


def block_functional() -> keras.Model:
    """Functional: Keras layers, attention with keras.ops, SwiGLU with Multiply/Activation layers."""
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    h = keras.layers.LayerNormalization(name="norm1")(x)
    q, k, v = (keras.layers.Dense(HIDDEN, use_bias=False, name=n)(h) for n in ("q", "k", "v"))
    attended = keras.layers.Dense(HIDDEN, use_bias=False, name="o")(_attention(q, k, v))
    x = keras.layers.Add()([x, attended])
    h = keras.layers.LayerNormalization(name="norm2")(x)
    gate = keras.layers.Activation("silu")(keras.layers.Dense(FFN, use_bias=False, name="gate")(h))
    up = keras.layers.Dense(FFN, use_bias=False, name="up")(h)
    down = keras.layers.Dense(HIDDEN, use_bias=False, name="down")(keras.layers.Multiply()([gate, up]))
    x = keras.layers.Add()([x, down])
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.LayerNormalization(name="norm3")(x))
    return keras.Model(tokens, keras.layers.Dense(CLASSES, name="head")(pooled), name="functional")


def block_operators() -> keras.Model:
    """Functional, with the `*` and `+` operators and keras.ops between Dense layers."""
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")(tokens)
    h = keras.layers.LayerNormalization(name="norm1")(x)
    q, k, v = (keras.layers.Dense(HIDDEN, use_bias=False, name=n)(h) for n in ("q", "k", "v"))
    x = x + keras.layers.Dense(HIDDEN, use_bias=False, name="o")(_attention(q, k, v))
    h = keras.layers.LayerNormalization(name="norm2")(x)
    g = keras.layers.Dense(FFN, use_bias=False, name="gate")(h)
    u = keras.layers.Dense(FFN, use_bias=False, name="up")(h)
    x = x + keras.layers.Dense(HIDDEN, use_bias=False, name="down")(ops.silu(g) * u)
    pooled = ops.mean(keras.layers.LayerNormalization(name="norm3")(x), axis=1)
    return keras.Model(tokens, keras.layers.Dense(CLASSES, name="head")(pooled), name="operators")


class _DenseBlock(keras.layers.Layer):
    """A decoder block of Keras sublayers, its call() written with keras.ops."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm1 = keras.layers.LayerNormalization(name="norm1")
        self.q, self.k, self.v, self.o = (
            keras.layers.Dense(HIDDEN, use_bias=False, name=n) for n in ("q", "k", "v", "o")
        )
        self.norm2 = keras.layers.LayerNormalization(name="norm2")
        self.gate = keras.layers.Dense(FFN, use_bias=False, name="gate")
        self.up = keras.layers.Dense(FFN, use_bias=False, name="up")
        self.down = keras.layers.Dense(HIDDEN, use_bias=False, name="down")

    def call(self, x):
        h = self.norm1(x)
        x = x + self.o(_attention(self.q(h), self.k(h), self.v(h)))
        h = self.norm2(x)
        return x + self.down(ops.silu(self.gate(h)) * self.up(h))


class _SubclassedDecoder(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.embed = keras.layers.Embedding(VOCAB, HIDDEN, name="embed")
        self.block = _DenseBlock(name="block")
        self.norm3 = keras.layers.LayerNormalization(name="norm3")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def call(self, tokens):
        return self.head(ops.mean(self.norm3(self.block(self.embed(tokens))), axis=1))


def block_subclassed() -> keras.Model:
    """A subclassed keras.Model of a custom block of Dense sublayers."""
    model = _SubclassedDecoder(name="subclassed")
    model(ops.zeros((2, LENGTH), "int32"))
    return model


class _WeightsBlock(keras.layers.Layer):
    """A decoder block holding its own weights (add_weight), computing with ops.matmul."""

    def build(self, input_shape):
        def weight(name, shape, init="glorot_uniform"):
            return self.add_weight(shape=shape, initializer=init, name=name)

        self.gamma1, self.beta1 = weight("gamma1", (HIDDEN,), "ones"), weight("beta1", (HIDDEN,), "zeros")
        self.wq, self.wk, self.wv, self.wo = (weight(n, (HIDDEN, HIDDEN)) for n in ("wq", "wk", "wv", "wo"))
        self.gamma2, self.beta2 = weight("gamma2", (HIDDEN,), "ones"), weight("beta2", (HIDDEN,), "zeros")
        self.wg, self.wu = weight("wg", (HIDDEN, FFN)), weight("wu", (HIDDEN, FFN))
        self.wd = weight("wd", (FFN, HIDDEN))

    @staticmethod
    def _norm(x, gamma, beta):
        mean = ops.mean(x, axis=-1, keepdims=True)
        variance = ops.var(x, axis=-1, keepdims=True)
        return (x - mean) / ops.sqrt(variance + 1e-3) * gamma + beta

    def call(self, x):
        h = self._norm(x, self.gamma1, self.beta1)
        q, k, v = (ops.matmul(h, w) for w in (self.wq, self.wk, self.wv))
        x = x + ops.matmul(_attention(q, k, v), self.wo)
        h = self._norm(x, self.gamma2, self.beta2)
        return x + ops.matmul(ops.silu(ops.matmul(h, self.wg)) * ops.matmul(h, self.wu), self.wd)


def block_add_weight() -> keras.Model:
    """Custom layers with add_weight + ops.matmul, in a Sequential model."""
    return keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(VOCAB, HIDDEN, name="embed"),
            _WeightsBlock(name="block"),
            keras.layers.LayerNormalization(name="norm3"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="add_weight",
    )


def block_sequential_of_blocks() -> keras.Model:
    """A Sequential model whose block is a custom layer of Dense sublayers."""
    return keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(VOCAB, HIDDEN, name="embed"),
            _DenseBlock(name="block"),
            keras.layers.LayerNormalization(name="norm3"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="sequential",
    )


BLOCKS = {
    "functional": block_functional,
    "operators": block_operators,
    "subclassed": block_subclassed,
    "add_weight": block_add_weight,
    "sequential_of_blocks": block_sequential_of_blocks,
}


# -- the MLP ---------------------------------------------------------------------------


def mlp_sequential() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(WIDTH, activation="gelu", name="up1"),
            keras.layers.Dense(FEATURES, name="down1"),
            keras.layers.Dense(WIDTH, activation="relu", name="up2"),
            keras.layers.Dense(FEATURES, name="down2"),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="sequential",
    )


def mlp_functional_ops() -> keras.Model:
    """Functional, with `ops.gelu` and `ops.relu` between plain Dense layers."""
    x = inputs = keras.Input((FEATURES,))
    x = keras.layers.Dense(FEATURES, name="down1")(ops.gelu(keras.layers.Dense(WIDTH, name="up1")(x)))
    x = keras.layers.Dense(FEATURES, name="down2")(ops.relu(keras.layers.Dense(WIDTH, name="up2")(x)))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x), name="functional_ops")


def mlp_functional_layers() -> keras.Model:
    """Functional, with Activation layers between Dense layers."""
    x = inputs = keras.Input((FEATURES,))
    x = keras.layers.Activation("gelu")(keras.layers.Dense(WIDTH, name="up1")(x))
    x = keras.layers.Dense(FEATURES, name="down1")(x)
    x = keras.layers.ReLU()(keras.layers.Dense(WIDTH, name="up2")(x))
    x = keras.layers.Dense(FEATURES, name="down2")(x)
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(x), name="functional_layers")


class _SubclassedMLP(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.up1 = keras.layers.Dense(WIDTH, name="up1")
        self.down1 = keras.layers.Dense(FEATURES, name="down1")
        self.up2 = keras.layers.Dense(WIDTH, name="up2")
        self.down2 = keras.layers.Dense(FEATURES, name="down2")
        self.head = keras.layers.Dense(CLASSES, name="head")

    def call(self, x):
        x = self.down1(ops.gelu(self.up1(x)))
        return self.head(self.down2(ops.relu(self.up2(x))))


def mlp_subclassed() -> keras.Model:
    model = _SubclassedMLP(name="subclassed")
    model(ops.zeros((2, FEATURES)))
    return model


class _LazyMLP(_SubclassedMLP):
    """Its own `build()` builds nothing: the Dense layers are built at the first call."""

    def build(self, input_shape):
        pass


def mlp_subclassed_lazy() -> keras.Model:
    model = _LazyMLP(name="subclassed_lazy")
    model.build((None, FEATURES))  # built, its sub-layers not: no weight exists yet
    return model


class _Linear(keras.layers.Layer):
    """`x @ w + b` with add_weight, activation by operator-level ops."""

    def __init__(self, units, activation=None, **kwargs):
        super().__init__(**kwargs)
        self.units, self.activation = units, activation

    def build(self, input_shape):
        self.w = self.add_weight(shape=(input_shape[-1], self.units), initializer="glorot_uniform", name="w")
        self.b = self.add_weight(shape=(self.units,), initializer="zeros", name="b")

    def call(self, x):
        y = ops.matmul(x, self.w) + self.b
        if self.activation == "gelu":
            return ops.gelu(y)
        return ops.maximum(y, 0.0) if self.activation == "relu" else y


def mlp_add_weight() -> keras.Model:
    x = inputs = keras.Input((FEATURES,))
    x = _Linear(FEATURES, name="down1")(_Linear(WIDTH, "gelu", name="up1")(x))
    x = _Linear(FEATURES, name="down2")(_Linear(WIDTH, "relu", name="up2")(x))
    return keras.Model(inputs, _Linear(CLASSES, name="head")(x), name="add_weight")


def mlp_sequential_custom() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            _Linear(WIDTH, "gelu", name="up1"),
            _Linear(FEATURES, name="down1"),
            _Linear(WIDTH, "relu", name="up2"),
            _Linear(FEATURES, name="down2"),
            _Linear(CLASSES, name="head"),
        ],
        name="sequential_custom",
    )


MLPS = {
    "sequential": mlp_sequential,
    "functional_ops": mlp_functional_ops,
    "functional_layers": mlp_functional_layers,
    "subclassed": mlp_subclassed,
    "subclassed_lazy": mlp_subclassed_lazy,
    "add_weight": mlp_add_weight,
    "sequential_custom": mlp_sequential_custom,
}


class _GroupedQueryBlock(keras.layers.Layer):
    """Grouped-query attention with add_weight: 2 key/value heads repeated for 4 query heads."""

    def build(self, input_shape):
        kv = 2 * HEAD_DIM
        self.wq = self.add_weight(shape=(HIDDEN, HIDDEN), initializer="glorot_uniform", name="wq")
        self.wk = self.add_weight(shape=(HIDDEN, kv), initializer="glorot_uniform", name="wk")
        self.wv = self.add_weight(shape=(HIDDEN, kv), initializer="glorot_uniform", name="wv")
        self.wo = self.add_weight(shape=(HIDDEN, HIDDEN), initializer="glorot_uniform", name="wo")

    def call(self, x):
        q = ops.reshape(ops.matmul(x, self.wq), (-1, LENGTH, HEADS, HEAD_DIM))
        k, v = (
            ops.repeat(ops.reshape(ops.matmul(x, w), (-1, LENGTH, 2, HEAD_DIM)), HEADS // 2, axis=2)
            for w in (self.wk, self.wv)
        )
        scores = ops.softmax(ops.einsum("bqhd,bkhd->bhqk", q, k) / HEAD_DIM**0.5, axis=-1)
        out = ops.reshape(ops.einsum("bhqk,bkhd->bqhd", scores, v), (-1, LENGTH, HIDDEN))
        return x + ops.matmul(out, self.wo)


def grouped_query() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((LENGTH,), dtype="int32"),
            keras.layers.Embedding(VOCAB, HIDDEN, name="embed"),
            _GroupedQueryBlock(name="block"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(CLASSES, name="head"),
        ],
        name="gqa",
    )
