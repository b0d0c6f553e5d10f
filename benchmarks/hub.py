"""Benchmark: keras-hub backbones, every layout at a glance, and the memory-budget planner.

For a small Gemma-like decoder (one key/value head, heads-first kernels) and
a small Llama-like one (grouped-query attention: 2 key/value heads for 8 query
heads), each with a pooled classification head, on 2×4 and 4×2 meshes of 8
emulated devices, this compiles Keras's own train step (Adam) under each
layout from a dry build, its state donated as `fit` does (`kml.compile_step`),
and reads the partitioned HLO:

- `keras-hub map`: the backbone's own `get_layout_map(mesh)` (2-D: every
  kernel over both axes), through `kml.rules_from_layout_map` and our
  resolution, which replicates what does not divide; the `plain Keras`
  column says whether the same map through `keras.distribution.ModelParallel`
  builds at all;
- `data-parallel`: `kml.ModelParallel(kml.Mesh(data=8))`, no rules;
- `preset`: `kml.transformer_rules()`;
- `planner, no budget`: `kml.auto_rules(model, mesh)`, tensor-parallel;
- `planner, least traffic`: `auto_rules(..., memory_budget="1TB")`;
- `planner at keras-hub memory`: `auto_rules(..., memory_budget=M)` with M the
  keras-hub map's compiled peak ÷ 0.95 (the budget bounds the planner's
  predicted peak with 5% kept free for the prediction's error); where no plan
  fits M, the smallest plan instead (`MemoryBudgetError.smallest_bytes`).

`wire` is the bytes each device sends per step (ring formulas), `state` the
per-device bytes of parameters, gradients and Adam's slots from the plan,
`peak` the compiled step's per-device peak (XLA's `memory_analysis`),
`predicted` the planner's own bytes sent for its plan (`rules.cost`), and
`pred/HLO` their ratio. Every distribution uses `replicate_below=0`: the
models are tiny.

Run:

    python benchmarks/hub.py                  # both models, both meshes (about 8 min on 2 loaded cores)
    python benchmarks/hub.py --quick          # the Llama-like model on 2×4 only
    python benchmarks/hub.py --json out.json  # also write the numbers
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import warnings

import keras_meshlayout as kml

kml.emulate_devices(8)

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

BATCH, LENGTH, CLASSES, VOCAB = 16, 32, 10, 512
HEADROOM = 0.05  # the share of a memory budget `kml.auto_rules` leaves free (see its `memory_budget`)


def gemma() -> keras.Model:
    return keras_hub.models.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8, num_key_value_heads=1,
        hidden_dim=256, intermediate_dim=1024, head_dim=32, dropout=0.0,
    )  # fmt: skip


def llama() -> keras.Model:
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_query_heads=8, num_key_value_heads=2,
        hidden_dim=256, intermediate_dim=1024, dropout=0.0,
    )  # fmt: skip


MODELS = {
    "gemma-like": (gemma, keras_hub.models.GemmaBackbone),
    "llama-like": (llama, keras_hub.models.LlamaBackbone),
}


def classifier(backbone_fn) -> keras.Model:
    backbone = backbone_fn()
    inputs = {
        name: keras.Input((LENGTH,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")
    }
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(pooled))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def batch() -> dict[str, np.ndarray]:
    return {
        "token_ids": np.zeros((BATCH, LENGTH), "int32"),
        "padding_mask": np.ones((BATCH, LENGTH), "int32"),
    }


def measure(backbone_fn, dist: kml.ModelParallel) -> tuple[float, int, int]:
    """Wire bytes per device per step, per-device training state and compiled peak, under `dist`.

    The step is Keras's own, compiled from a dry build with its state donated as `fit` does
    (`kml.compile_step`), so its peak is what one device holds while `fit` runs it.
    """
    build = functools.partial(classifier, backbone_fn)
    step = kml.compile_step(build, dist, batch(), np.zeros(BATCH, "int32"))
    memory = kml.dry_plan(build, dist).memory()
    return step.comm.wire_bytes, memory.parameters + memory.gradients + memory.optimizer, step.peak_bytes


def plain_keras(backbone_cls, backbone_fn, mesh: kml.Mesh) -> str:
    """Whether keras-hub's own map builds under plain `keras.distribution.ModelParallel`."""
    layout_map = backbone_cls.get_layout_map(mesh, data_parallel_dim_name="data")
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="data")
    )
    try:
        backbone_fn()
        return "builds"
    except Exception as error:
        return f"crashes ({type(error).__name__})"
    finally:
        keras.distribution.set_distribution(None)


def run(name: str, mesh_shape: tuple[int, int]) -> list[dict]:
    backbone_fn, backbone_cls = MODELS[name]
    mesh = kml.Mesh(data=mesh_shape[0], model=mesh_shape[1])
    reference = classifier(backbone_fn)
    rows = []

    def add(layout: str, dist: kml.ModelParallel, rules=None, note: str = "") -> int:
        wire, state, peak = measure(backbone_fn, dist)
        cost = None if rules is None else rules.cost
        rows.append(
            {
                "model": name,
                "mesh": f"{mesh_shape[0]}×{mesh_shape[1]}",
                "layout": layout,
                "wire_bytes": wire,
                "state_bytes": state,
                "peak_bytes": peak,
                "predicted_wire_bytes": None if cost is None else cost.wire_bytes,
                "predicted_peak_bytes": None if cost is None else cost.peak_bytes,
                "note": note,
            }
        )
        return peak

    hub_rules = kml.rules_from_layout_map(backbone_cls.get_layout_map(mesh, data_parallel_dim_name="data"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kml.IndivisibleShapeWarning)
        hub_peak = add("keras-hub map", kml.ModelParallel(mesh, hub_rules, replicate_below=0),
                       note=f"plain Keras: {plain_keras(backbone_cls, backbone_fn, mesh)}")  # fmt: skip
    add("data-parallel (8×1)", kml.ModelParallel(kml.Mesh(data=8)))
    add("preset", kml.ModelParallel(mesh, kml.transformer_rules(), replicate_below=0))

    def planner(layout: str, budget) -> None:
        rules = kml.auto_rules(reference, mesh, replicate_below=0, memory_budget=budget, batch=batch())
        layouts = ", ".join(f"{n} {kind}" for kind, n in sorted(rules.cost.layouts().items()))
        add(layout, kml.ModelParallel(mesh, rules, replicate_below=0), rules, layouts)

    planner("planner, no budget", None)
    planner("planner, least traffic", "1TB")
    try:  # the budget bounds the predicted peak, less the headroom kept for the prediction's error
        planner("planner at keras-hub memory", math.ceil(hub_peak / (1 - HEADROOM)))
    except kml.MemoryBudgetError as error:
        # No plan is predicted to peak within the map's compiled peak: show the smallest plan.
        planner("planner, smallest plan", error.smallest_bytes)
        rows[-1]["note"] = f"keras-hub memory out of reach; {rows[-1]['note']}"
    return rows


def table(rows: list[dict]) -> Table:
    out = Table(title="keras-hub backbones: bytes sent per device per step, and per-device state (Adam)")
    numbers = ("wire", "state", "peak", "predicted", "pred/HLO")
    for column in ("model", "mesh", "layout", *numbers, "note"):
        out.add_column(column, justify="right" if column in numbers else "left")
    for row in rows:
        wire, state, predicted = row["wire_bytes"], row["state_bytes"], row["predicted_wire_bytes"]
        out.add_row(
            row["model"],
            row["mesh"],
            row["layout"],
            "—" if wire is None else f"{wire / 2**20:.2f} MiB",
            "—" if state is None else f"{state / 2**20:.2f} MiB",
            f"{row['peak_bytes'] / 2**20:.2f} MiB",
            "" if predicted is None else f"{predicted / 2**20:.2f} MiB",
            "" if predicted is None else f"{predicted / wire:.3f}",
            row["note"],
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the Llama-like model on 2×4 only")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--only", nargs="*", help="cases such as llama-like:4x2")
    args = parser.parse_args()
    cases = [("llama-like", (2, 4))] if args.quick else [(m, s) for m in MODELS for s in ((2, 4), (4, 2))]
    if args.only:
        cases = [(m, s) for m, s in cases if f"{m}:{s[0]}x{s[1]}" in args.only]
    rows = [row for name, shape in cases for row in run(name, shape)]
    Console(width=200).print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
