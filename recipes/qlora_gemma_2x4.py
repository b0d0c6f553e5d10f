"""Recipe: QLoRA, Keras's way: quantize a keras-hub Gemma, enable LoRA, fine-tune on a 2x4 mesh.

Copy this file and adapt it. It follows Keras's own fine-tuning guide (`quantize("int8")`,
then `backbone.enable_lora(rank)`, then `fit`) and:

1. gets 8 devices (real accelerators if there are enough, else 8 emulated CPU
   devices) as a mesh of 2 along "data" and 4 along "model";
2. builds a small Gemma causal LM standing in for a real one
   (`keras_hub.models.GemmaBackbone.from_preset("gemma_2b_en")` needs a download; the
   steps are the same), quantizes it to int8 and enables LoRA of rank 4;
3. plans without allocating: `kml.dry_build` builds and quantizes it without computing a
   value (a 7 B model plans on a laptop), and `kml.auto_rules` splits the frozen int8 kernels
   over their heads and features with their scales, and the LoRA adapters with their kernels;
4. builds the model under `kml.ModelParallel(mesh, rules)`, so each weight lands already split,
   and trains with plain `model.fit`: only the adapters train;
5. prints the plan, and the planner's bytes per step beside the compiled step's.

Run it with:

    pip install ".[hub]" && pip install --no-deps keras-hub==0.32.0    # from the repository root
    python recipes/qlora_gemma_2x4.py      # or --epochs 1 --steps 4 for a quick check
"""

from __future__ import annotations

import argparse
import warnings

# keras_meshlayout selects the JAX backend of Keras when it is imported before keras.
import keras_meshlayout as kml

kml.emulate_devices(8)  # before JAX starts; real accelerators stay the default

import jax  # noqa: E402  (after emulate_devices, on purpose)
import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

VOCABULARY, LENGTH, BATCH_SIZE, RANK = 1024, 32, 8, 4
NAMES = ("token_ids", "padding_mask")


def pick_devices(count: int = 8) -> list:
    if jax.device_count() >= count:
        return jax.devices()[:count]
    return jax.devices("cpu")[:count]


def qlora_gemma() -> keras.Model:
    """A small Gemma causal LM, quantized to int8, with LoRA adapters on its attention.

    It calls the backbone under its tied token table (`reverse=True`), as `GemmaCausalLM` does;
    the task itself fits through `tf.data` or Grain, which this recipe does without.
    """
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCABULARY, num_layers=2, num_query_heads=4, num_key_value_heads=4,
        hidden_dim=128, intermediate_dim=512, head_dim=32, dropout=0.0,
    )  # fmt: skip
    inputs = {name: keras.Input((LENGTH,), dtype="int32", name=name) for name in NAMES}
    lm = keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True), name="gemma_lm")
    with warnings.catch_warnings():  # Keras says which layers have no int8 form (the norms)
        warnings.simplefilter("ignore", UserWarning)
        lm.quantize("int8")
    backbone.enable_lora(rank=RANK)
    lm.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return lm


def make_data(count: int) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Stand-in token sequences, each to be predicted one token ahead."""
    rng = np.random.default_rng(0)
    start = rng.integers(1, VOCABULARY, (count, 1))
    tokens = ((start + np.arange(LENGTH + 1)) % VOCABULARY).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((count, LENGTH), "int32")}
    return x, tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16, help="batches per epoch")
    args = parser.parse_args()

    mesh = kml.Mesh(data=2, model=4, devices=pick_devices())
    x, y = make_data(args.steps * BATCH_SIZE)
    batch = {k: v[:BATCH_SIZE] for k, v in x.items()}

    # Plan first, with no weight allocated and nothing quantized for real.
    with kml.dry_build(qlora_gemma) as abstract:
        rules = kml.auto_rules(abstract, mesh, batch=batch, optimizer="adam")
    print("planner:", rules.cost)

    dist = kml.ModelParallel(mesh, rules)
    keras.distribution.set_distribution(dist)
    lm = qlora_gemma()  # each weight made already split
    history = lm.fit(x, y, batch_size=BATCH_SIZE, epochs=args.epochs, verbose=2)
    print(dist.plan(lm))
    report = kml.comm_report(lm, batch, y[:BATCH_SIZE])
    print(f"predicted {rules.cost.wire_bytes / 2**20:.2f} MiB per device per step; compiled step sends "
          f"{report.wire_bytes / 2**20:.2f} MiB")  # fmt: skip
    trained, every = (sum(int(np.prod(v.shape)) for v in vs) for vs in (lm.trainable_weights, lm.weights))
    loss = history.history["loss"][-1]
    print(f"trained {trained:,} of {every:,} weights (the adapters); final loss {loss:.4f}")


if __name__ == "__main__":
    main()
