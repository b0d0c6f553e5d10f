"""`keras-meshlayout demo`: a real MLP classifier trained on a 2×4 mesh, then its plan."""

from __future__ import annotations

import argparse
from typing import Any

from ._args import EXIT_OK, positive_int

__all__ = ["HELP", "NAME", "add_parser", "run", "run_demo"]

NAME = "demo"
HELP = "train an MLP on a 2x4 mesh (8 emulated CPU devices without accelerators) and print its plan"


def add_parser(commands: Any) -> None:
    """Adds the `demo` subcommand to `commands` (the parser's subparsers)."""
    demo = commands.add_parser(
        NAME,
        help=HELP,
        description="Train a 32-256-128-10 MLP on a data=2, model=4 mesh and print its plan and the "
        "communication of one training step.",
    )
    demo.add_argument("--steps", type=positive_int, default=20, help="training steps per epoch (default: 20)")
    demo.add_argument(
        "--batch-size",
        type=positive_int,
        default=64,
        help="global batch size, a multiple of 2 (default: 64)",
    )
    demo.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Runs the demo with the parsed `--steps` and `--batch-size`."""
    run_demo(steps=args.steps, batch_size=args.batch_size)
    return EXIT_OK


def run_demo(steps: int = 20, batch_size: int = 64, seed: int = 0) -> float:
    """Trains a 32 → 256 → 128 → 10 MLP on a `data=2, model=4` mesh; prints its plan and traffic.

    Uses the default accelerators when there are at least 8, and otherwise 8
    emulated CPU devices. Returns the final training loss.
    """
    from ..core._backend import emulate_devices

    emulate_devices(8)  # only the CPU platform: accelerators, if any, stay the default
    import jax
    import keras
    import numpy as np

    from ..core._distribution import ModelParallel
    from ..core._mesh import Mesh
    from ..core._rules import LayoutRules
    from ..report._comm import comm_report

    devices = jax.devices() if jax.device_count() >= 8 else jax.devices("cpu")
    mesh = Mesh(data=2, model=4, devices=devices[:8])
    rules = LayoutRules(
        [
            (r".*hidden_1/kernel", (None, "model")),  # column-parallel: split output features
            (r".*hidden_1/bias", ("model",)),
            (r".*hidden_2/kernel", ("model", None)),  # row-parallel: split input features
        ]
    )
    distribution = ModelParallel(mesh, rules, batch_axis="data")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(seed)

    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(256, activation="relu", name="hidden_1"),
            keras.layers.Dense(128, activation="relu", name="hidden_2"),
            keras.layers.Dense(10, name="head"),
        ],
        name="mlp",
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(steps * batch_size, 32)).astype("float32")
    y = (x[:, :10].argmax(axis=1)).astype("int32")  # a learnable labelling
    print(f"Devices: {len(devices)} × {devices[0].platform}; mesh {mesh}")
    history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=2)
    print(distribution.plan(model))
    print()
    print(comm_report(model, x[:batch_size], y[:batch_size]))
    return float(history.history["loss"][-1])
