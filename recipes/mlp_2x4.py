"""Recipe: train an MLP classifier with data + tensor parallelism on a 2x4 mesh.

Copy this file and adapt it. It shows the whole keras_meshlayout workflow:

1. get 8 devices (8 real accelerators if the machine has them, otherwise 8
   emulated CPU devices, so it runs on a laptop too);
2. arrange them in a named mesh: 2 along "data", 4 along "model";
3. write ordered layout rules: which weights are split over "model";
4. set a `kml.ModelParallel` distribution, then build and train as usual;
5. print the plan: what every variable got, and why.

Run it with:

    python recipes/mlp_2x4.py            # or --epochs 1 --steps 4 for a quick check
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

FEATURES, CLASSES = 32, 10
BATCH_SIZE = 64  # global batch: 32 samples on each of the 2 "data" slices


def pick_devices(count: int = 8) -> list:
    """The default accelerators when there are enough of them, else the emulated CPUs."""
    if jax.device_count() >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def build_classifier() -> keras.Model:
    """A 32 -> 256 -> 128 -> 10 classifier. Layer names are what the rules match."""
    inputs = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(256, activation="gelu", name="fc1")(inputs)
    h = keras.layers.Dense(128, activation="gelu", name="fc2")(h)
    logits = keras.layers.Dense(CLASSES, name="classifier")(h)
    return keras.Model(inputs, logits, name="mlp_2x4")


def make_dataset(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic, learnable data: labels come from a fixed random linear "teacher"."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = (x @ teacher).argmax(axis=1).astype("int32")
    return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="training epochs (default: 3)")
    parser.add_argument("--steps", type=int, default=32, help="steps per epoch (default: 32)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args()

    # -- 1 + 2. The mesh ------------------------------------------------------
    # Axes are named and keep their order. The product of the sizes must equal
    # the number of devices; kml.Mesh checks this and says what to change if not.
    devices = pick_devices(8)
    mesh = kml.Mesh(data=2, model=4, devices=devices)
    print(f"{len(devices)} {devices[0].platform} devices as {mesh}")

    # -- 3. The rules ---------------------------------------------------------
    # Each rule is (regex, axes). The regex must match the whole variable.path
    # (re.fullmatch), and the first matching rule wins. Axes give one entry per
    # tensor dimension: a mesh axis to split that dimension over, or None.
    #
    # The classic Megatron pairing for two consecutive Dense layers:
    # - fc1 is column-parallel: its (32, 256) kernel is split on the output
    #   features, so each "model" device computes 64 of the 256 activations;
    # - fc2 is row-parallel: its (256, 128) kernel is split on the input
    #   features, matching fc1's split, so no gather is needed in between.
    # The classifier has no rule: unmatched variables are replicated, and any
    # variable under `replicate_below` elements (default 4096) would stay
    # replicated even with a rule, which is why fc1's 256-element bias shows
    # as replicated in the plan below.
    rules = kml.LayoutRules(
        [
            (r".*fc1/kernel", (None, "model")),
            (r".*fc1/bias", ("model",)),
            (r".*fc2/kernel", ("model", None)),
        ]
    )

    # -- 4. The distribution, then ordinary Keras ------------------------------
    # The batch is split over "data". Every variable's layout is checked
    # against its shape as Keras creates it; a dimension that does not divide
    # by its mesh axis is replicated with a warning (or pass
    # on_indivisible="error"). Optimizer slots take their parameter's layout.
    distribution = kml.ModelParallel(mesh, rules, batch_axis="data")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(args.seed)

    model = build_classifier()  # variables are created sharded, right here
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    x, y = make_dataset(args.steps * BATCH_SIZE, args.seed)

    loss_before = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)["loss"]
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=args.epochs, verbose=2)
    loss_after = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0, return_dict=True)["loss"]
    print(f"loss: {loss_before:.4f} before training, {loss_after:.4f} after")

    # -- 5. The plan ------------------------------------------------------------
    # One row per variable (weights, then optimizer state): the rule that
    # matched, the layout it got, bytes per device, and why it differs from
    # what was asked. plan.to_dict() gives the same as JSON-ready data.
    plan = distribution.plan(model)
    print(plan)

    # The plan is not a guess: it is what the arrays actually are.
    for variable in model.weights:
        spec = tuple(variable.value.sharding.spec)
        actual = spec + (None,) * (len(variable.shape) - len(spec))
        assert actual == plan[variable.path].axes, (variable.path, actual, plan[variable.path].axes)

    assert loss_after < loss_before, f"training did not reduce the loss ({loss_before} -> {loss_after})"


if __name__ == "__main__":
    main()
