"""The planner at real shapes: Llama-3 8 B and 70 B (128K vocabulary) and Mixtral 8×7 B, planned dry.

Each model is a keras-hub backbone built inside `kml.dry_build` (nothing is
allocated) and planned by `kml.auto_rules` on a data=2 × model=4 mesh with
Adam, for one step of 4 sequences of 2048 tokens. For each it prints:

- the no-budget plan's parameters per device ÷ the tensor-parallel ideal
  (every parameter split over `model`: parameters ÷ 4), planned with the
  batch (so a look-up table goes over both axes where that sends no more);
- the smallest memory-budget plan's state per device (parameters, gradients,
  Adam's two moments) ÷ the fully sharded floor (total state ÷ 8), and its
  predicted traffic per step;
- the planning time, in a fresh process per model.

    python benchmarks/planner_shapes.py            # a few minutes on 2 cores
    python benchmarks/planner_shapes.py --json docs/benchmarks/planner_shapes.json
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time

_LLAMA3 = dict(vocabulary_size=128256, num_key_value_heads=8, rope_max_wavelength=500000)
SHAPES = {
    "Llama-3 8B": (
        "Llama3Backbone",
        dict(_LLAMA3, num_layers=32, hidden_dim=4096, num_query_heads=32, intermediate_dim=14336),
    ),
    "Llama-3 70B": (
        "Llama3Backbone",
        dict(_LLAMA3, num_layers=80, hidden_dim=8192, num_query_heads=64, intermediate_dim=28672),
    ),
    "Mixtral 8x7B": (
        "MixtralBackbone",
        dict(
            vocabulary_size=32000,
            num_layers=32,
            hidden_dim=4096,
            num_query_heads=32,
            num_key_value_heads=8,
            intermediate_dim=14336,
            num_experts=8,
            top_k=2,
        ),
    ),
}
BATCH, SEQUENCE = 4, 2048


def shards(axes: tuple, axis_sizes: dict[str, int]) -> int:
    """How many pieces a layout splits a weight into; an entry names no axis, one, or several."""
    named = [a for entry in axes for a in (entry if isinstance(entry, tuple) else (entry,)) if a]
    return math.prod(axis_sizes[a] for a in named)


def measure(name: str) -> dict:
    """Runs in a fresh process: the no-budget and the smallest plans of one shape."""
    import keras_meshlayout as kml

    kml.emulate_devices(8)
    import jax
    import keras_hub

    cls, config = SHAPES[name]
    mesh = kml.Mesh(data=2, model=4)
    batch = {
        "token_ids": jax.ShapeDtypeStruct((BATCH, SEQUENCE), "int32"),
        "padding_mask": jax.ShapeDtypeStruct((BATCH, SEQUENCE), "int32"),
    }
    start = time.perf_counter()
    with kml.dry_build(lambda: getattr(keras_hub.models, cls)(**config, dtype="float32")) as probe:
        free = kml.auto_rules(probe, mesh, batch=batch, optimizer="adam")
        no_budget = time.perf_counter() - start
        try:
            kml.auto_rules(probe, mesh, memory_budget=1, batch=batch, optimizer="adam")
        except kml.MemoryBudgetError as error:
            smallest_bytes = error.smallest_bytes
        smallest = kml.auto_rules(probe, mesh, memory_budget=smallest_bytes, batch=batch, optimizer="adam")
        parameters = sum(math.prod(v.shape) for v in probe.weights)
        per_device = 0
        for variable in probe.weights:
            rule = free.match(variable.path)
            axes = rule.expand(len(variable.shape)) if rule is not None else None
            per_device += math.prod(variable.shape) // shards(axes or (), mesh.axis_sizes)
    floor = 4 * parameters * 4 / 8  # float32 parameters, gradients and Adam's two moments, over 8 devices
    return {
        "model": name,
        "parameters": parameters,
        "no_budget_seconds": round(no_budget, 1),
        "seconds": round(time.perf_counter() - start, 1),
        "no_budget_params_over_tp_ideal": per_device / (parameters / mesh.axis_sizes["model"]),
        "smallest_state_bytes": smallest.cost.state_bytes,
        "smallest_over_floor": smallest.cost.state_bytes / floor,
        "smallest_wire_bytes": smallest.cost.wire_bytes,
        "smallest_layouts": smallest.cost.layouts(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--measure", choices=SHAPES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure)))
        return
    results = []
    for name in SHAPES:
        out = subprocess.run(
            [sys.executable, __file__, "--measure", name],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    columns = ("model", "parameters", "no budget: params/device ÷ TP ideal", "smallest plan ÷ floor")
    print("| " + " | ".join((*columns, "its traffic/step", "plan time")) + " |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['model']} | {r['parameters'] / 1e9:.2f} B | {r['no_budget_params_over_tp_ideal']:.3f} | "
            f"{r['smallest_over_floor']:.3f} | {r['smallest_wire_bytes'] / 2**30:.1f} GiB | "
            f"{r['seconds']:.0f} s |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
