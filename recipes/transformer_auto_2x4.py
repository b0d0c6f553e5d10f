"""Recipe: train a small transformer classifier on a 2x4 mesh with the automatic planner.

Copy this file and adapt it. Instead of writing layout rules by hand, it asks
`kml.auto_rules` for them:

1. get 8 devices (8 real accelerators if the machine has them, otherwise 8
   emulated CPU devices, so it runs on a laptop too) as a mesh of 2 along
   "data" and 4 along "model";
2. build the model once without a distribution, and let `kml.auto_rules`
   read its layers, shapes and functional graph: attention is split over
   heads, each feed-forward pair becomes column- then row-parallel, the
   embedding, norms and classifier stay replicated; every rule says why;
3. build the model again under `kml.ModelParallel(mesh, rules)` and train it
   with plain `model.fit`;
4. print the plan (its "why" column holds the planner's notes) and the
   communication report of one compiled training step.

Run it with:

    python recipes/transformer_auto_2x4.py     # or --epochs 1 --steps 4 for a quick check
"""

from __future__ import annotations

import argparse

# keras_meshlayout selects the JAX backend of Keras when it is imported before
# keras (or set KERAS_BACKEND=jax yourself). Emulating devices must happen
# before JAX starts, that is before the first JAX operation or device query.
import keras_meshlayout as kml

kml.emulate_devices(8)  # adds 8 CPU devices; real accelerators stay the default

import jax  # noqa: E402  (after emulate_devices, on purpose)
import keras  # noqa: E402
import numpy as np  # noqa: E402

VOCAB, SEQ, HIDDEN, HEADS, FFN, BLOCKS, CLASSES = 64, 16, 64, 4, 256, 2, 4
BATCH_SIZE = 32  # global batch: 16 sequences on each of the 2 "data" slices


def pick_devices(count: int = 8) -> list:
    """The default accelerators when there are enough of them, else the emulated CPUs."""
    if jax.device_count() >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def build_classifier() -> keras.Model:
    """Token embedding, two post-norm encoder blocks, mean pooling, a classifier.

    The planner reads the functional graph, not the names: any names work.
    """
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    hidden = keras.layers.Embedding(VOCAB, HIDDEN, name="token_embedding")(tokens)
    for i in range(BLOCKS):
        attention = keras.layers.MultiHeadAttention(HEADS, HIDDEN // HEADS, name=f"block{i}_attention")
        hidden = keras.layers.Add()([hidden, attention(hidden, hidden)])
        hidden = keras.layers.LayerNormalization(name=f"block{i}_attention_norm")(hidden)
        ffn = keras.layers.Dense(FFN, activation="gelu", name=f"block{i}_ffn_in")(hidden)
        ffn = keras.layers.Dense(HIDDEN, name=f"block{i}_ffn_out")(ffn)
        hidden = keras.layers.Add()([hidden, ffn])
        hidden = keras.layers.LayerNormalization(name=f"block{i}_ffn_norm")(hidden)
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    logits = keras.layers.Dense(CLASSES, name="classifier")(pooled)
    return keras.Model(tokens, logits, name="encoder")


def make_dataset(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic, learnable data: the label is the vocabulary quarter most tokens fall in."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, size=(samples, SEQ)).astype("int32")
    buckets = x // (VOCAB // CLASSES)
    counts = np.stack([(buckets == c).sum(axis=1) for c in range(CLASSES)], axis=1)
    return x, counts.argmax(axis=1).astype("int32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (default: 3)")
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args()

    # -- 1. The mesh ------------------------------------------------------------
    devices = pick_devices(8)
    mesh = kml.Mesh(data=2, model=4, devices=devices)
    print(f"{len(devices)} {devices[0].platform} devices as {mesh}")

    # -- 2. The rules, from the model's structure ---------------------------------
    # The planner needs a built model but no distribution: build a probe (its
    # weights are thrown away) and hand it over with the mesh. It returns
    # ordinary kml.LayoutRules, one exact-path rule per variable, each with a
    # note; edit or extend them like hand-written rules if you disagree.
    rules = kml.auto_rules(build_classifier(), mesh)

    # -- 3. The distribution, then ordinary Keras ----------------------------------
    distribution = kml.ModelParallel(mesh, rules, batch_axis="data")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(args.seed)

    model = build_classifier()  # variables are created sharded, right here
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=2e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = make_dataset(args.steps * BATCH_SIZE, args.seed)

    loss_before = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)["loss"]
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=args.epochs, verbose=2)
    loss_after = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)["loss"]
    print(f"loss: {loss_before:.4f} before training, {loss_after:.4f} after")

    # -- 4. The plan and the communication -----------------------------------------
    # The "why" column shows each planner note: which layers form a column → row
    # pair, why attention is split over heads, why the classifier stays whole.
    plan = distribution.plan(model)
    print(plan)
    for variable in model.weights:  # the plan is what the arrays actually are
        spec = tuple(variable.value.sharding.spec)
        actual = spec + (None,) * (len(variable.shape) - len(spec))
        assert actual == plan[variable.path].axes, (variable.path, actual, plan[variable.path].axes)

    # One training step, compiled but not run: every collective, the layer it
    # comes from, and the bytes each device sends. Per block, expect one
    # all-reduce over "model" after the attention output projection and one
    # after the second feed-forward layer (forward), their mirrors in the
    # backward pass, and the gradients' all-reduce over "data".
    report = kml.comm_report(model, x[:BATCH_SIZE], y[:BATCH_SIZE])
    print()
    print(report)
    assert report.count("all-gather") == 0, "the planner's layouts never gather a weight"

    assert loss_after < loss_before, f"training did not reduce the loss ({loss_before} -> {loss_after})"


if __name__ == "__main__":
    main()
