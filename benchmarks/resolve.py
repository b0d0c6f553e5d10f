"""Rule resolution: 10,000 variable paths against 500 rules, ours and Keras's `LayoutMap`.

Each path is looked up once, as `ModelParallel` does when Keras creates the
variable: `kml.LayoutRules.match(path)` here, `keras.distribution.LayoutMap[path]`
there, on the same rules. Two rule sets:

- `planner`: one rule per variable for 500 of the 10,000 variables, written as
  `kml.auto_rules` writes them, the path escaped with the model's name an
  optional prefix (`(?:net/)?block_7/ffn_in/kernel`); the other 9,500 paths
  match nothing (replicated), the costliest case for a scan.
- `mixed`: 450 such rules and 50 real regexes after them (`.*block_7/.*norm.*/scale`),
  which match other paths.

A Keras `LayoutMap` full-matches every key against every path (and raises when
two match, so the rules are disjoint); ours looks patterns that match only fixed
paths up in a dictionary and tries in order only the regex rules before the
dictionary's answer. Both give the same layout for every path (checked).

    python benchmarks/resolve.py              # about 40 s on 2 cores, most of it Keras's
    python benchmarks/resolve.py --paths 2000 # quicker

Not a test: timings depend on the machine. Prints a table and the ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras

import keras_meshlayout as kml

LAYERS = ("attn_query", "attn_key", "attn_value", "attn_out", "ffn_in", "ffn_gate", "ffn_out", "norm")
WEIGHTS = ("kernel", "bias", "scale", "extra")


def paths(count: int) -> list[str]:
    """`count` distinct variable paths of a deep model named `net`."""
    out = []
    block = 0
    while len(out) < count:
        for layer in LAYERS:
            for weight in WEIGHTS:
                out.append(f"net/block_{block}/{layer}/{weight}")
        block += 1
    return out[:count]


def planner_pattern(path: str) -> str:
    model, _, rest = path.partition("/")
    return f"(?:{re.escape(model + '/')})?{re.escape(rest)}"


def rule_set(kind: str, all_paths: list[str], count: int) -> list[tuple[str, tuple]]:
    stride = len(all_paths) // count
    chosen = [all_paths[i * stride + i % len(WEIGHTS)] for i in range(count)]  # every kind of weight
    if kind == "planner":
        return [(planner_pattern(p), ("model",) if p.endswith("bias") else (None, "model")) for p in chosen]
    others = [p for p in all_paths if not p.endswith("/scale")]
    step = len(others) // (count - 50)
    literal = [
        (planner_pattern(p), ("model",) if p.endswith("bias") else (None, "model"))
        for p in others[::step][: count - 50]
    ]
    blocks = sorted({int(p.split("/")[1].split("_")[1]) for p in all_paths})[-50:]
    regexes = [(rf".*block_{b}/.*norm.*/scale", ("model",)) for b in blocks]
    return (literal + regexes)[:count]


def time_ours(rules: list[tuple[str, tuple]], all_paths: list[str]) -> tuple[float, list]:
    layout_rules = kml.LayoutRules(rules)
    start = time.perf_counter()
    found = [layout_rules.match(path) for path in all_paths]
    return time.perf_counter() - start, [None if r is None else r.axes for r in found]


def time_keras(rules: list[tuple[str, tuple]], all_paths: list[str], mesh: kml.Mesh) -> tuple[float, list]:
    layout_map = keras.distribution.LayoutMap(mesh)
    for pattern, axes in rules:
        layout_map[pattern] = axes
    start = time.perf_counter()
    found = [layout_map[path] for path in all_paths]
    return time.perf_counter() - start, [None if layout is None else tuple(layout.axes) for layout in found]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", type=int, default=10_000)
    parser.add_argument("--rules", type=int, default=500)
    args = parser.parse_args()
    kml.emulate_devices(8)
    mesh = kml.Mesh(data=2, model=4)
    all_paths = paths(args.paths)
    print(f"{args.paths} paths x {args.rules} rules; Keras {keras.version()}\n")
    print("| rules | matched paths | kml.LayoutRules | keras LayoutMap | Keras / ours |")
    print("|---|---|---|---|---|")
    for kind in ("planner", "mixed"):
        rules = rule_set(kind, all_paths, args.rules)
        ours, our_axes = time_ours(rules, all_paths)
        theirs, their_axes = time_keras(rules, all_paths, mesh)
        assert our_axes == their_axes, f"{kind}: ours and Keras's differ"
        matched = sum(axes is not None for axes in our_axes)
        print(
            f"| {kind} ({len(rules)}) | {matched} | {ours * 1e3:.1f} ms | {theirs:.2f} s | "
            f"**{theirs / ours:.0f}x** |"
        )


if __name__ == "__main__":
    main()
