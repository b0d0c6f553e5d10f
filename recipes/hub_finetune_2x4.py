"""Recipe: fine-tune a small keras-hub Llama backbone on a 2x4 mesh, within a memory budget.

Copy this file and adapt it. It:

1. gets 8 devices (real accelerators if there are enough, else 8 emulated CPU
   devices) as a mesh of 2 along "data" and 4 along "model";
2. saves a small Llama backbone as a local preset, standing in for a real one
   (`keras_hub.models.LlamaBackbone.from_preset("llama3.2_1b")` needs a
   download): the path below is the same for both;
3. plans without allocating: the model is built inside `kml.dry_build` (no
   weight exists), and `kml.auto_rules(..., memory_budget=..., batch=...)`
   picks, per attention block, feed-forward pair and embedding, the layout
   that fits the budget at the least traffic, each rule saying what it saves
   and costs;
4. loads the preset under `kml.ModelParallel(mesh, rules)`, so each weight
   lands already split, adds a classification head and trains with plain
   `model.fit`;
5. prints the plan, the planner's prediction and the measured communication
   of one compiled step.

Run it with:

    pip install ".[hub]" && pip install --no-deps keras-hub==0.32.0    # from the repository root
    python recipes/hub_finetune_2x4.py      # or --epochs 1 --steps 4 for a quick check
"""

from __future__ import annotations

import argparse
import tempfile

# keras_meshlayout selects the JAX backend of Keras when it is imported before keras.
import keras_meshlayout as kml

kml.emulate_devices(8)  # before JAX starts; real accelerators stay the default

import jax  # noqa: E402  (after emulate_devices, on purpose)
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

LENGTH, CLASSES, BATCH_SIZE = 32, 4, 16
BUDGET = "6MiB"  # per device: parameters, gradients, Adam's slots and the activation reserve


def pick_devices(count: int = 8) -> list:
    if jax.device_count() >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def save_small_preset(directory: str) -> None:
    """A stand-in for a downloaded preset: a small Llama backbone saved locally."""
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=512, num_layers=2, num_query_heads=8, num_key_value_heads=2,
        hidden_dim=128, intermediate_dim=512, dropout=0.0,
    )  # fmt: skip
    backbone.save_to_preset(directory)


def classifier(preset: str, load_weights: bool = True) -> keras.Model:
    """The preset's backbone, mean-pooled, with a new classification head."""
    backbone = keras_hub.models.LlamaBackbone.from_preset(preset, load_weights=load_weights)
    inputs = {
        name: keras.Input((LENGTH,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")
    }
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(pooled), name="classifier")


def make_data(count: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 512, (count, LENGTH)).astype("int32")
    labels = (tokens[:, 0] % CLASSES).astype("int32")  # a task the model can learn
    return {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="batches per epoch")
    args = parser.parse_args()

    mesh = kml.Mesh(data=2, model=4, devices=pick_devices())
    x, y = make_data(args.steps * BATCH_SIZE)
    with tempfile.TemporaryDirectory() as preset:
        save_small_preset(preset)

        # Plan first, with no weight allocated.
        with kml.dry_build(lambda: classifier(preset, load_weights=False)) as abstract:
            rules = kml.auto_rules(
                abstract, mesh, memory_budget=BUDGET, batch={k: v[:BATCH_SIZE] for k, v in x.items()},
                optimizer="adam", replicate_below=0,
            )  # fmt: skip
        print("planner:", rules.cost)

        dist = kml.ModelParallel(mesh, rules, replicate_below=0)
        keras.distribution.set_distribution(dist)
        model = classifier(preset)  # the weights load already split
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        history = model.fit(x, y, batch_size=BATCH_SIZE, epochs=args.epochs, verbose=2)
    print(dist.plan(model))
    report = kml.comm_report(model, {k: v[:BATCH_SIZE] for k, v in x.items()}, y[:BATCH_SIZE])
    print(f"predicted {rules.cost.wire_bytes / 2**20:.2f} MiB per device per step; compiled step sends "
          f"{report.wire_bytes / 2**20:.2f} MiB")  # fmt: skip
    print(f"final loss {history.history['loss'][-1]:.4f}")


if __name__ == "__main__":
    main()
