"""Recipe: train on a 2x4 mesh, checkpoint, and carry on training on a 1x8 mesh.

The pre-emption story: a job trains with data + tensor parallelism on a
data=2 x model=4 mesh and saves a checkpoint; it comes back on a machine (or
slice) where a data=1 x model=8 mesh suits better. Copy this file and adapt it:

1. train on 2x4 and save with `kml.save_checkpoint`: the weights and the
   optimizer state (stored with Orbax, each process writing only the shards
   its devices hold), the mesh and every variable's layout (plan.json), and a
   manifest written last, so a save that is interrupted never looks complete;
2. in the new setting, set the new distribution *first*, build and compile the
   same model, then `kml.load_checkpoint`: every variable takes the layout the
   new plan gives it, the values come back bit for bit, and the returned diff
   says which variables changed layout and what each device now holds;
3. carry on training where the first run stopped (here with
   `kml.ResumableCheckpoint`, which backs training up every few steps and, if
   this run died too, would resume it exactly, mid-epoch included).

Run it with:

    python recipes/checkpoint_resume.py          # or --epochs 1 --steps 4 for a quick check
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

# keras_meshlayout selects the JAX backend of Keras when it is imported before
# keras. Emulating devices must happen before JAX starts.
import keras_meshlayout as kml

kml.emulate_devices(8)  # adds 8 CPU devices; real accelerators stay the default

import jax  # noqa: E402  (after emulate_devices, on purpose)
import keras  # noqa: E402
import numpy as np  # noqa: E402

FEATURES, CLASSES = 32, 10
BATCH_SIZE = 64

#: One set of rules for both meshes: they name mesh axes, not sizes, so fc1 is
#: split 4 ways over "model" on 2x4 and 8 ways on 1x8.
RULES = kml.LayoutRules(
    [
        (r".*fc1/kernel", (None, "model")),
        (r".*fc1/bias", ("model",)),
        (r".*fc2/kernel", ("model", None)),
    ]
)


def pick_devices(count: int = 8) -> list:
    """The default accelerators when there are enough of them, else the emulated CPUs."""
    if jax.device_count() >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def build_classifier() -> keras.Model:
    """A 32 -> 256 -> 128 -> 10 classifier, compiled with Adam."""
    inputs = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(256, activation="gelu", name="fc1")(inputs)
    h = keras.layers.Dense(128, activation="gelu", name="fc2")(h)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="classifier")(h), name="mlp_resume")
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def make_dataset(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Synthetic, learnable data: labels come from a fixed random linear "teacher"."""
    rng = np.random.default_rng(seed)
    teacher = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    return x, (x @ teacher).argmax(axis=1).astype("int32")


def state(model: keras.Model) -> list[np.ndarray]:
    """Every model weight and optimizer variable, on the host."""
    return [np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]]


def main() -> None:
    args = _arguments()
    if args.dir is not None:
        run(args, args.dir)
        return
    with tempfile.TemporaryDirectory(prefix="kml-checkpoint-") as workdir:  # removed afterwards
        run(args, Path(workdir))


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2, help="epochs on each mesh (default: 2)")
    parser.add_argument("--steps", type=int, default=16, help="steps per epoch (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where to checkpoint (default: a temporary directory, removed at the end)",
    )
    return parser.parse_args()


def run(args: argparse.Namespace, workdir: Path) -> None:
    devices = pick_devices(8)
    x, y = make_dataset(args.steps * BATCH_SIZE, args.seed)
    fit = dict(batch_size=BATCH_SIZE, epochs=args.epochs, shuffle=False, verbose=2)

    # -- 1. Train on 2x4, then checkpoint --------------------------------------
    first = kml.ModelParallel(kml.Mesh(data=2, model=4, devices=devices), RULES, batch_axis="data")
    keras.distribution.set_distribution(first)
    keras.utils.set_random_seed(args.seed)
    model = build_classifier()
    model.fit(x, y, **fit)
    print(first.plan(model))
    checkpoint = kml.save_checkpoint(model, workdir / "step_1")
    saved = state(model)
    loss_saved = model.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0)
    print(f"\nSaved {checkpoint}: {', '.join(sorted(p.name for p in checkpoint.iterdir()))}")
    print(f"The plan travels with it: mesh {json.loads((checkpoint / 'plan.json').read_text())['mesh']}\n")

    # -- 2. A new distribution, a new model, the checkpoint restored ----------
    # The distribution is set *before* the model is built: variables are
    # created with the 1x8 layouts, and the checkpoint's values land in them.
    second = kml.ModelParallel(kml.Mesh(data=1, model=8, devices=devices), RULES, batch_axis="data")
    keras.distribution.set_distribution(second)
    resumed = build_classifier()
    diff = kml.load_checkpoint(resumed, checkpoint)
    print(second.plan(resumed))
    print()
    print(diff)

    restored = state(resumed)
    assert len(restored) == len(saved)
    assert all(np.array_equal(a, b) for a, b in zip(restored, saved, strict=True)), "not bit-identical"
    spec = resumed.get_layer("fc1").kernel.value.sharding.spec
    assert tuple(spec) == (None, "model"), spec
    print(f"\nRestored bit for bit ({len(restored)} variables, optimizer state included)")
    print(f"fc1/kernel is now laid out as {spec}")

    # -- 3. Carry on training ----------------------------------------------------
    # The loss is the one the first run stopped at; Adam's step count carries on.
    loss_restored = resumed.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0)
    assert abs(loss_restored - loss_saved) < 1e-5, (loss_saved, loss_restored)
    steps_before = int(resumed.optimizer.iterations)
    backup = kml.ResumableCheckpoint(workdir / "backup", save_freq=max(1, args.steps // 2))
    resumed.fit(x, y, callbacks=[backup], **fit)
    loss_after = resumed.evaluate(x, y, batch_size=BATCH_SIZE, verbose=0)
    print(
        f"loss: {loss_saved:.4f} when saved on 2x4, {loss_restored:.4f} restored on 1x8, "
        f"{loss_after:.4f} after {int(resumed.optimizer.iterations) - steps_before} more steps"
    )
    assert int(resumed.optimizer.iterations) == steps_before + args.epochs * args.steps
    assert loss_after < loss_saved, "training on the new mesh did not reduce the loss"


if __name__ == "__main__":
    main()
