"""On a real TPU chip: the planner's predicted peak, XLA:TPU's compiled figures, and what the step takes.

Everything else kml says about TPUs is compiled ahead of time from libtpu's compile-only devices
on a CPU-only machine. This script runs where a TPU is attached (one chip is enough): for each
keras-hub decoder below it

1. plans the model with `kml.auto_rules` on `kml.Mesh(data=1, model=1)` of the chip, with no
   `target=`: the planner reads the chip's generation off its devices (`_peak.generation_of`);
2. compiles Keras's own training step with `kml.compile_step` (a dry build, nothing allocated):
   XLA:TPU's `memory_analysis()`, argument + output + temporaries - aliased;
3. trains two steps with `model.fit` on random tokens and reads the chip's
   `memory_stats()["peak_bytes_in_use"]`: the arrays the chip held at its peak (weights,
   optimizer state, the batch). It does not count a program's temporaries: on a v5e chip it was
   the step's argument bytes to 4%, while `memory_analysis()` put 5.6-6.0 GB of temporaries beside
   them, and a step whose temporaries exceed the HBM is refused at compile time.

Each model runs in a fresh process (the chip's peak counter starts at zero), and prints one
JSON line per model.

    python benchmarks/real_tpu.py                  # every model, 1-2 min each on a v5e chip
    python benchmarks/real_tpu.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

#: name -> (keras-hub class, config, batch rows, sequence length).
MODELS = {
    "Llama 3, hidden 1024, 4 layers, 8 x 1024 tokens": (
        "Llama3Backbone",
        dict(vocabulary_size=32000, num_layers=4, hidden_dim=1024, intermediate_dim=4096,
             num_query_heads=16, num_key_value_heads=4),
        8,
        1024,
    ),
    "Llama 3, hidden 2048, 4 layers, 8 x 2048 tokens": (
        "Llama3Backbone",
        dict(vocabulary_size=32000, num_layers=4, hidden_dim=2048, intermediate_dim=8192,
             num_query_heads=16, num_key_value_heads=4),
        8,
        2048,
    ),
    "Mixtral, hidden 1024, 2 layers, 8 experts, 8 x 1024 tokens": (
        "MixtralBackbone",
        dict(vocabulary_size=32000, num_layers=2, hidden_dim=1024, intermediate_dim=2048,
             num_query_heads=16, num_key_value_heads=4, num_experts=8, top_k=2),
        8,
        1024,
    ),
}  # fmt: skip


def build_lm(cls: str, config: dict, length: int):
    """The backbone under its output table (`reverse=True`), as keras-hub's causal LMs run it."""
    import keras
    import keras_hub

    backbone = getattr(keras_hub.models, cls)(**config, dropout=0.0, dtype="float32")
    names = ("token_ids", "padding_mask")
    inputs = {name: keras.Input((length,), dtype="int32", name=name) for name in names}
    return keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True), name="lm")


def measure(name: str) -> dict:
    """Runs in a fresh process: one model planned, compiled and trained on the chip."""
    import jax
    import keras
    import numpy as np

    import keras_meshlayout as kml
    from keras_meshlayout.planner._peak import compiler_of, generation_of

    cls, config, rows, length = MODELS[name]
    x = {key: jax.ShapeDtypeStruct((rows, length), "int32") for key in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((rows, length), "int32")

    def build():
        return build_lm(cls, config, length)

    mesh = kml.Mesh(data=1, model=1)
    device = jax.devices()[0]
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    distribution = kml.ModelParallel(mesh, rules)
    row = {
        "model": name,
        "device_kind": device.device_kind,
        "generation": getattr(generation_of(mesh), "name", None),
        "compiler": compiler_of(mesh),
        "jax": jax.__version__,
        "predicted_peak_bytes": rules.cost.peak_bytes,
        "bytes_limit": int((device.memory_stats() or {}).get("bytes_limit", 0)),
    }
    try:
        step = kml.compile_step(build, distribution, x, y, optimizer="adam", loss=loss)
    except jax.errors.JaxRuntimeError as error:  # XLA:TPU refuses a step whose temporaries exceed HBM
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        return {**row, "compile_error": str(error).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0]}
    keras.distribution.set_distribution(distribution)
    model = build()
    model.compile(optimizer="adam", loss=loss)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, config["vocabulary_size"], (2 * rows, length), dtype="int32")
    data = {"token_ids": tokens, "padding_mask": np.ones_like(tokens)}
    model.fit(data, np.roll(tokens, -1, axis=1), batch_size=rows, epochs=1, verbose=0)
    runtime = int((device.memory_stats() or {}).get("peak_bytes_in_use", 0))
    return {
        **row,
        "compile_error": None,
        "compiled": step.to_dict(),
        "runtime_peak_bytes": runtime,
        "predicted_over_compiled": rules.cost.peak_bytes / step.peak_bytes,
        "arguments_over_runtime": step.argument_bytes / runtime if runtime else None,
    }


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    results = []
    for name in MODELS:
        env = {**os.environ, "KERAS_BACKEND": "jax"}
        command = [sys.executable, __file__, "--measure", name]
        out = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
        if out.returncode:
            print(f"{name}: failed\n{out.stderr[-3000:]}", flush=True)
            continue
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = results[-1]
        if r["compile_error"]:
            predicted = r["predicted_peak_bytes"] / 2**30
            print(f"{name}: predicted {predicted:.2f} GiB; XLA:TPU: {r['compile_error']}", flush=True)
        else:
            print(
                f"{name}: predicted {r['predicted_peak_bytes'] / 2**30:.2f} GiB, compiled "
                f"{r['compiled']['peak_bytes'] / 2**30:.2f} (predicted / compiled "
                f"{r['predicted_over_compiled']:.3f}); arrays at the chip's peak "
                f"{r['runtime_peak_bytes'] / 2**30:.2f} GiB, the step's arguments "
                f"{r['compiled']['argument_bytes'] / 2**30:.2f}",
                flush=True,
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
