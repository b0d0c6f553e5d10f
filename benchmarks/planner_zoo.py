"""The planner across keras-hub 0.32's text backbones: how close to the ideal and to the floor.

Each backbone of `tests/hub_models.py` (small configs: 2 layers, hidden 64), with a
vocabulary of 1,024 rows (a realistic vocabulary : hidden ratio of 16), is planned on
data=2 × model=4 with Adam, for one batch of 8 × 8 tokens. For each it prints the
no-budget plan's parameters per device ÷ the tensor-parallel ideal (parameters ÷ 4) and
the smallest memory-budget plan's state per device ÷ the fully sharded floor (total
state ÷ 8), under the default policy and with `replicate_below=0`: at hidden 64 the
default policy's 4,096-element threshold keeps whole the key/value kernels of
grouped-query attention (64 × 2 × 16), position tables (32 × 64) and routers, which
at real sizes hold millions of elements and are split.

    python benchmarks/planner_zoo.py                 # about 4 minutes on 2 cores
    python benchmarks/planner_zoo.py --json docs/benchmarks/planner_zoo.json
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

VOCAB = 1024


def shards(axes: tuple, axis_sizes: dict[str, int]) -> int:
    """How many pieces a layout splits a weight into; an entry names no axis, one, or several."""
    named = [a for entry in axes for a in (entry if isinstance(entry, tuple) else (entry,)) if a]
    return math.prod(axis_sizes[a] for a in named)


def measure(row, kml, hub_models, replicate_below: int | None = None) -> dict:
    config = {k: (VOCAB if k in ("vocabulary_size", "vocab_size") else v) for k, v in row.config.items()}
    model = row.cls(**config, name="backbone")
    mesh = kml.Mesh(data=2, model=4)
    batch = hub_models.inputs_for(model)
    free = kml.auto_rules(model, mesh, replicate_below=replicate_below, batch=batch)
    parameters = sum(math.prod(v.shape) for v in model.weights)
    per_device = 0
    for variable in model.weights:
        rule = free.match(variable.path)
        axes = rule.expand(len(variable.shape)) if rule is not None else None
        kept_whole = len(variable.shape) >= 2 and not variable.path.endswith("/bias")
        if kept_whole and math.prod(variable.shape) < free.policy.replicate_below:
            axes = None  # what kml.ModelParallel does with a small weight matrix
        per_device += math.prod(variable.shape) // shards(axes or (), mesh.axis_sizes)
    budgeted = dict(batch=batch, optimizer="adam", replicate_below=replicate_below)
    try:
        kml.auto_rules(model, mesh, memory_budget=1, **budgeted)
    except kml.MemoryBudgetError as error:
        smallest_bytes = error.smallest_bytes
    smallest = kml.auto_rules(model, mesh, memory_budget=smallest_bytes, **budgeted)
    trainable = sum(math.prod(v.shape) for v in model.trainable_weights)
    floor = (16 * trainable + 4 * (parameters - trainable)) / 8
    return {
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
    print(
        "| backbone | no budget ÷ TP ideal | smallest ÷ floor | replicate_below=0: no budget | smallest |\n"
        "|---|---:|---:|---:|---:|"
    )
    for row in hub_models.ROWS:
        result = {"model": row.name, **measure(row, kml, hub_models)}
        unthresholded = measure(row, kml, hub_models, replicate_below=0)
        result["no_budget_params_over_tp_ideal_replicate_below_0"] = unthresholded[
            "no_budget_params_over_tp_ideal"
        ]
        result["smallest_over_floor_replicate_below_0"] = unthresholded["smallest_over_floor"]
        results.append(result)
        ratios = [result[key] for key in list(result)[2:]]
        print(f"| {row.name} | " + " | ".join(f"{ratio:.2f}" for ratio in ratios) + " |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
