"""Planning for rented TPUs: Llama-3 8 B / 70 B and Mixtral 8×7 B shapes, meshes chosen and compiled.

Each model is a keras-hub backbone with its language-model head (the untied 128K-row output
table of Llama-3, Mixtral's 32K one), built inside `kml.dry_build` (nothing is allocated),
for one step of one sequence of 2048 tokens per chip with Adam and float32 weights. For each
target, TPU v5e 16×16 (256 chips, 16 GiB HBM each) and v5p 4×4×4 (64 chips, 95 GiB):

1. `kml.choose_mesh` plans every data × model split of the chips (over the target's devices) and picks
   the one with the least predicted step time ("plan s": its wall time);
2. `kml.compile_step` AOT-compiles Keras's own training step for that mesh and its rules with
   XLA:TPU, from libtpu's compile-only devices on this CPU-only machine ("compile s").

Printed per row: the chosen mesh, the predicted and compiled per-device peak and bytes sent
per step, their ratios, whether the compiled peak fits the chip's HBM, and the process's peak
host memory.

Depth: the widths (hidden, heads, key/value heads, feed-forward, vocabulary, experts) are the
real models', the depth is not. One XLA:TPU compile of a single Llama-3 8 B layer for 256 chips
took 106 s here and two layers 179 s (2 loaded cores): the compile time grows with every
layer, so the default is `--layers 2`: every figure is of a 2-layer model at full width (the state, the
traffic and the peak all grow with depth; the choice of mesh can change with it). Memory is
not the limit (about 1.5 GiB of host memory per compile).

The choice is made with no memory budget (`memory_budget="1TiB"`), so that every model is
ranked and compiled even where it does not fit: XLA:TPU then refuses the step (its
temporaries over the HBM), and the row says so.

    python benchmarks/targets.py                # 10-15 min on 2 loaded cores; a fresh process per row
    python benchmarks/targets.py --json docs/benchmarks/targets.json
    python benchmarks/targets.py --layers 1 --only "Llama-3 8B"
"""

from __future__ import annotations

import argparse
import json
import resource
import time

from _rows import run_rows
from planner_shapes import SHAPES as _FULL_DEPTH  # the same models as the dry planner's rows

#: name -> (keras-hub class, config without its depth, the real model's number of layers).
SHAPES = {
    name: (cls, {k: v for k, v in config.items() if k != "num_layers"}, config["num_layers"])
    for name, (cls, config) in _FULL_DEPTH.items()
}
TARGETS = ("tpu-v5e:16x16", "tpu-v5p:4x4x4")
SEQUENCE = 2048
GiB = 2**30


def build_lm(cls: str, config: dict, layers: int):
    """The backbone under its output table (`reverse=True`), as keras-hub's causal LMs run it."""
    import keras
    import keras_hub

    backbone = getattr(keras_hub.models, cls)(**config, num_layers=layers, dtype="float32")
    names = ("token_ids", "padding_mask")
    inputs = {name: keras.Input((SEQUENCE,), dtype="int32", name=name) for name in names}
    logits = backbone.token_embedding(backbone(inputs), reverse=True)
    return keras.Model(inputs, logits, name="lm")


def measure(name: str, target: str, layers: int) -> dict:
    """Runs in a fresh process: the mesh chosen for one model on one target, and its compile."""
    import jax
    import keras

    import keras_meshlayout as kml

    cls, config, depth = SHAPES[name]
    chips = kml.parse_target(target).chips
    x = {key: jax.ShapeDtypeStruct((chips, SEQUENCE), "int32") for key in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((chips, SEQUENCE), "int32")

    def build():
        return build_lm(cls, config, layers)

    start = time.perf_counter()
    choice = kml.choose_mesh(build, target, batch=x, optimizer="adam", memory_budget="1TiB")
    plan_seconds = time.perf_counter() - start
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    distribution = kml.ModelParallel(choice.mesh, choice.rules)
    predicted = {axis: b for axis, b in choice.rules.cost.wire_bytes_by_axis.items() if b > 64}
    row = {
        "model": name,
        "target": target,
        "layers": layers,
        "full_depth": depth,
        "mesh": choice.best.spec,
        "fsdp": choice.best.fsdp,
        "alternatives": [option.to_dict() for option in choice.alternatives],
        "plan_seconds": round(plan_seconds, 1),
        "predicted_peak_bytes": choice.best.peak_bytes,
        "predicted_wire_bytes_by_axis": predicted,
        "hbm_bytes": choice.target.hbm_bytes,
    }
    try:
        step = kml.compile_step(build, distribution, x, y, optimizer="adam", loss=loss)
    except jax.errors.JaxRuntimeError as error:  # XLA:TPU refuses a step whose temporaries exceed HBM
        if "RESOURCE_EXHAUSTED" not in str(error):
            raise
        message = str(error).split("RESOURCE_EXHAUSTED: ")[-1].splitlines()[0]
        return {**row, "compile_error": message, "fits": False, "compile_seconds": None}
    compiled = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}  # not scalar sums
    row.update(
        compile_error=None,
        compile_seconds=round(step.compile_seconds, 1),
        compiled_peak_bytes=step.peak_bytes,
        peak_ratio=choice.best.peak_bytes / step.peak_bytes,
        compiled=step.to_dict(),
        fits=step.peak_bytes <= choice.target.hbm_bytes,
        compiled_wire_bytes_by_axis=compiled,
        wire_ratio=sum(predicted.values()) / max(sum(compiled.values()), 1.0),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    )
    return row


def _row(r: dict) -> str:
    if r["compile_error"]:
        return (
            f"| {r['model']} ({r['layers']} of {r['full_depth']} layers) | {r['target']} | {r['mesh']} | "
            f"{r['predicted_peak_bytes'] / GiB:.2f} | XLA:TPU: {r['compile_error']} | | no | | | "
            f"{r['plan_seconds']:.0f} | |"
        )
    sent = sum(r["compiled_wire_bytes_by_axis"].values())
    return (
        f"| {r['model']} ({r['layers']} of {r['full_depth']} layers) | {r['target']} | {r['mesh']} | "
        f"{r['predicted_peak_bytes'] / GiB:.2f} | {r['compiled_peak_bytes'] / GiB:.2f} | "
        f"{r['peak_ratio']:.2f} | "
        f"{'yes' if r['fits'] else 'no'} | {sent / GiB:.2f} | {r['wire_ratio']:.3f} | "
        f"{r['plan_seconds']:.0f} | {r['compile_seconds']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of each model (default 2)")
    parser.add_argument("--only", choices=SHAPES, help="one model only")
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.layers)))
        return
    cases = [(name, target) for name in ([args.only] if args.only else SHAPES) for target in TARGETS]
    run_rows(__file__, cases, _row, extra=("--layers", str(args.layers)), json_path=args.json)


if __name__ == "__main__":
    main()
