"""Recipe: one training script for one process or many, on a 2x4 mesh.

Copy this file and adapt it. A 2x4 mesh is often two hosts of four
accelerators: "data" across the hosts, "model" inside each host, where the
fast links are. The same script runs

- on one machine in two processes of four emulated CPU devices each, as two
  hosts would (the local launcher starts them, joined on a loopback port):

      python -m keras_meshlayout.launch -n 2 --devices-per-process 4 recipes/multi_process_2x4.py

- alone, in one process with eight emulated devices:

      python recipes/multi_process_2x4.py          # or --epochs 1 --steps 4

- on a cluster, one process per host, unchanged: `kml.initialize()` lets JAX
  find SLURM, Open MPI, Kubernetes or Cloud TPU settings (see the README).

What changes from a single-process script is small:

1. `kml.initialize()` comes first, before anything uses JAX;
2. the mesh puts "data" across processes (`kml.Mesh` does by default);
3. each process passes `fit` only its part of every global batch
   (`kml.process_slice`, with `kml.local_batch_size` as the batch size);
4. only process 0 prints and writes files.
"""

from __future__ import annotations

import argparse

# keras_meshlayout selects the JAX backend of Keras when it is imported before keras.
import keras_meshlayout as kml

# Joins the other processes when started by the launcher (or on a cluster), and
# emulates 8 CPU devices in all: 4 in each of 2 processes, or 8 when alone.
# It must run before JAX starts, so before anything else touches JAX.
process_id, num_processes = kml.initialize(emulate_devices=8)

import jax  # noqa: E402  (after kml.initialize, on purpose)
import keras  # noqa: E402
import numpy as np  # noqa: E402

FEATURES, CLASSES = 32, 10
BATCH_SIZE = 64  # the global batch: 32 rows from each of the 2 "data" positions


def pick_devices(count: int = 8) -> list:
    """The default accelerators of all processes when there are enough, else the CPUs."""
    if jax.device_count() >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def build_classifier() -> keras.Model:
    """A 32 -> 256 -> 128 -> 10 classifier. Layer names are what the rules match."""
    inputs = keras.Input((FEATURES,), name="features")
    h = keras.layers.Dense(256, activation="gelu", name="fc1")(inputs)
    h = keras.layers.Dense(128, activation="gelu", name="fc2")(h)
    logits = keras.layers.Dense(CLASSES, name="classifier")(h)
    return keras.Model(inputs, logits, name="multi_process_2x4")


def make_dataset(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The global dataset, identical in every process: labels from a fixed linear teacher."""
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
    parser.add_argument("--save", default=None, help="write the trained weights here (a .weights.h5 file)")
    args = parser.parse_args()
    main_process = process_id == 0

    # -- The mesh: "data" across processes, "model" within each ---------------
    # With devices in 2 processes, kml.Mesh lays the first axis named in
    # across_processes (default: "data") over the processes, with JAX's hybrid
    # mesh utilities. A mesh whose "model" axis would have to span processes is
    # refused, since its collectives would cross the slow links every step.
    mesh = kml.Mesh(data=2, model=4, devices=pick_devices(8), across_processes=("data",))
    if main_process:
        print(f"{num_processes} process(es); {mesh}")
        print("\n".join(kml.process_layout(mesh)))

    # -- The rules and the distribution, as in a single process ----------------
    rules = kml.LayoutRules(
        [
            (r".*fc1/kernel", (None, "model")),  # column-parallel
            (r".*fc1/bias", ("model",)),
            (r".*fc2/kernel", ("model", None)),  # row-parallel
        ]
    )
    # auto_shard_dataset=False: each process passes its own part of the data
    # (below); Keras's automatic sharding only takes tf.data datasets.
    distribution = kml.ModelParallel(mesh, rules, batch_axis="data", auto_shard_dataset=False)
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(args.seed)  # the same initial weights in every process

    model = build_classifier()
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate=3e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

    # -- The data: every process feeds its part of each global batch ------------
    # Keras assembles each global batch from the processes' parts. Cut the
    # same global dataset in every process; process_slice keeps this process's
    # rows of every batch of BATCH_SIZE (all of them when alone), in order, so
    # fit must not shuffle them (shuffle the global data beforehand instead).
    x, y = make_dataset(args.steps * BATCH_SIZE, args.seed)
    local_x, local_y = kml.process_slice((x, y), batch_size=BATCH_SIZE)
    local_batch = kml.local_batch_size(BATCH_SIZE)

    def loss() -> float:
        logs = model.evaluate(local_x, local_y, batch_size=local_batch, verbose=0, return_dict=True)
        return logs["loss"]

    loss_before = loss()
    model.fit(
        local_x,
        local_y,
        batch_size=local_batch,
        epochs=args.epochs,
        shuffle=False,
        verbose=2 if main_process else 0,
    )
    loss_after = loss()  # the same global loss in every process

    if main_process:
        print(f"loss: {loss_before:.4f} before training, {loss_after:.4f} after")
        print(distribution.plan(model))
        if args.save:
            # Every process holds whole copies of the weights here ("model" is
            # within each process), so process 0 alone can write them; the file
            # loads in a single process on any mesh.
            model.save_weights(args.save)
            print(f"weights saved to {args.save}")
    assert loss_after < loss_before, f"training did not reduce the loss ({loss_before} -> {loss_after})"


if __name__ == "__main__":
    main()
