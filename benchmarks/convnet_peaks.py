"""Convnets' predicted peak and bytes against the compiled ones, at the image sizes they are trained at.

For each keras.applications convnet (`weights=None`, 10 classes), one step of 16 images with Adam
on a `data=2, model=4` mesh: `kml.auto_rules` plans it (no budget) and `kml.compile_step` compiles
Keras's own training step for the plan, for XLA:CPU (8 emulated devices) and for XLA:TPU (TPU v5e
2x4 through libtpu's compile-only devices: nothing runs). Each row is the plan's predicted
per-device peak (`rules.cost.peak_bytes`) over the compiled one (`memory_analysis()`), and its
bytes sent per device per step over each mesh axis (`rules.cost.wire_bytes_by_axis`) over the
compiled HLO's (`step.comm`): the baseline, compiled side by side; the figures are the compilers'
and do not depend on this machine's speed.

These are the misses `planner/_headroom.py`'s convnet headroom covers and
`_tpu_memory.warn_convnet_peak` reports (docs/status.md).

    python benchmarks/convnet_peaks.py                 # about 15 min on 2 cores; a fresh process per row
    python benchmarks/convnet_peaks.py --size 64 --only ResNet50
    python benchmarks/convnet_peaks.py --json docs/benchmarks/convnet_peaks.json
"""

from __future__ import annotations

import argparse
import json
import time

from _rows import run_rows

MODELS = ("ResNet50", "ConvNeXtTiny", "Xception", "MobileNetV2", "EfficientNetB0", "DenseNet121")
COMPILERS = ("cpu", "tpu-v5e:2x4")
BATCH = 16
MiB = 2**20


def measure(name: str, compiler: str, size: int) -> dict:
    """Runs in a fresh process: one convnet planned and compiled for one compiler."""
    import keras_meshlayout as kml

    if compiler == "cpu":
        kml.emulate_devices(8)
    import functools
    import warnings

    import jax
    import keras

    build = functools.partial(
        getattr(keras.applications, name), weights=None, input_shape=(size, size, 3), classes=10
    )
    x = jax.ShapeDtypeStruct((BATCH, size, size, 3), "float32")
    y = jax.ShapeDtypeStruct((BATCH,), "int32")
    mesh = kml.Mesh(data=2, model=4) if compiler == "cpu" else kml.Mesh(data=2, model=4, target=compiler)
    start = time.perf_counter()
    with kml.dry_build(build) as model, warnings.catch_warnings():
        warnings.simplefilter("ignore", kml.MeshLayoutWarning)  # the TPU convnet peak's own warning
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    plan_seconds = time.perf_counter() - start
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    return {
        "model": name,
        "compiler": compiler,
        "size": size,
        "predicted_peak_bytes": rules.cost.peak_bytes,
        "predicted_activation_bytes": rules.cost.activation_bytes,
        "compiled_peak_bytes": step.peak_bytes,
        "compiled_temp_bytes": step.temp_bytes,
        "peak_ratio": rules.cost.peak_bytes / step.peak_bytes,
        "predicted_wire_bytes": dict(rules.cost.wire_bytes_by_axis),
        "compiled_wire_bytes": dict(step.comm.wire_bytes_by_axis),
        "plan_seconds": round(plan_seconds, 1),
        "compile_seconds": round(step.compile_seconds, 1),
    }


def _bytes_ratio(r: dict, axis: str) -> str:
    """Predicted ÷ compiled bytes over `axis`, "—" where neither sends any."""
    predicted, compiled = r["predicted_wire_bytes"].get(axis, 0.0), r["compiled_wire_bytes"].get(axis, 0.0)
    return f"{predicted / compiled:.3f}" if compiled else ("—" if not predicted else "inf")


def _row(r: dict) -> str:
    return (
        f"| {r['model']} | {r['size']} x {r['size']} | {r['compiler']} | "
        f"{r['predicted_peak_bytes'] / MiB:.1f} | {r['compiled_peak_bytes'] / MiB:.1f} | "
        f"{r['peak_ratio']:.2f} | {_bytes_ratio(r, 'model')} | {_bytes_ratio(r, 'data')} | "
        f"{r['plan_seconds']:.0f} | {r['compile_seconds']:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--size", type=int, default=224, help="image height and width (default 224)")
    parser.add_argument("--only", choices=MODELS, help="one model only")
    parser.add_argument("--measure", nargs=2, metavar=("MODEL", "COMPILER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(*args.measure, args.size)))
        return
    print(
        "| model | images | compiler | predicted peak MiB | compiled peak MiB | predicted ÷ compiled "
        "| bytes ÷ compiled, model | bytes ÷ compiled, data | plan s | compile s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    models = [args.only] if args.only else MODELS
    cases = [(name, compiler) for name in models for compiler in COMPILERS]
    run_rows(__file__, cases, _row, extra=("--size", str(args.size)), json_path=args.json, timeout=1800)


if __name__ == "__main__":
    main()
