"""The planner across keras-hub 0.32's text backbones: how close to the ideal and to the floor.

Each backbone of `tests/hub_models.py` (small configs: 2 layers, hidden 64), with a
vocabulary of 1,024 rows (a realistic vocabulary : hidden ratio of 16), is planned on
data=2 × model=4 with Adam, for one batch of 8 × 8 tokens. For each it prints the
no-budget plan's parameters per device ÷ the tensor-parallel ideal (parameters ÷ 4) and
the smallest memory-budget plan's state per device ÷ the fully sharded floor (total
state ÷ 8).

    python benchmarks/planner_zoo.py                 # about 2 minutes on 2 cores
    python benchmarks/planner_zoo.py --json docs/benchmarks/planner_zoo.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

VOCAB = 1024


def measure(row, kml, hub_models) -> dict:
    config = {k: (VOCAB if k in ("vocabulary_size", "vocab_size") else v) for k, v in row.config.items()}
    model = row.cls(**config, name="backbone")
    mesh = kml.Mesh(data=2, model=4)
    batch = hub_models.inputs_for(model)
    free = kml.auto_rules(model, mesh)
    parameters = sum(math.prod(v.shape) for v in model.weights)
    per_device = 0
    for variable in model.weights:
        rule = free.match(variable.path)
        axes = rule.expand(len(variable.shape)) if rule is not None else None
        per_device += math.prod(variable.shape) // math.prod(mesh.axis_sizes[a] for a in (axes or ()) if a)
    try:
        kml.auto_rules(model, mesh, memory_budget=1, batch=batch, optimizer="adam")
    except kml.MemoryBudgetError as error:
        smallest_bytes = error.smallest_bytes
    smallest = kml.auto_rules(model, mesh, memory_budget=smallest_bytes, batch=batch, optimizer="adam")
    trainable = sum(math.prod(v.shape) for v in model.trainable_weights)
    floor = (16 * trainable + 4 * (parameters - trainable)) / 8
    return {
        "model": row.name,
        "parameters": parameters,
        "no_budget_params_over_tp_ideal": per_device / (parameters / 4),
        "smallest_over_floor": smallest.cost.state_bytes / floor,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
    import keras_meshlayout as kml

    kml.emulate_devices(8)
    import hub_models

    results = []
    print("| backbone | no budget ÷ TP ideal | smallest ÷ floor |\n|---|---:|---:|")
    for row in hub_models.ROWS:
        result = measure(row, kml, hub_models)
        results.append(result)
        ideal, floor = result["no_budget_params_over_tp_ideal"], result["smallest_over_floor"]
        print(f"| {row.name} | {ideal:.2f} | {floor:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
