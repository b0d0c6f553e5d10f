"""Dry planning at scale: a ~7-billion-parameter decoder planned without allocating it.

Builds a decoder-only transformer written with Keras layers (32 blocks, hidden
4096, 32 heads, SwiGLU feed-forward 11008, vocabulary 32000; 6.7 B parameters),
derives its rules with `kml.auto_rules` and plans it with Adam on a 2×4 mesh,
all with the weights deferred. Prints the wall time, the peak resident memory
of the process and its ratio to the model's float32 size, and the per-device
training state of the plan.

Baseline, side by side: the same model scaled down 64× in parameters (8 blocks,
hidden 1024, vocabulary 8000), planned dry and also built for real, so the
ratio of the two costs shows what deferring saves.

    python benchmarks/dry_plan.py            # the 7B figure (about 20 s, < 1 GiB)
    python benchmarks/dry_plan.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time


def build_decoder(blocks: int, hidden: int, heads: int, ffn: int, vocab: int, sequence: int = 2048):
    import keras

    tokens = keras.Input((sequence,), dtype="int32")
    x = keras.layers.Embedding(vocab, hidden, name="token_embedding")(tokens)
    for i in range(blocks):
        h = keras.layers.LayerNormalization(name=f"block_{i}_attention_norm")(x)
        attention = keras.layers.MultiHeadAttention(
            heads, hidden // heads, use_bias=False, name=f"block_{i}_attention"
        )
        x = keras.layers.Add()([x, attention(h, h, use_causal_mask=True)])
        h = keras.layers.LayerNormalization(name=f"block_{i}_ffn_norm")(x)
        gate = keras.layers.Dense(ffn, activation="silu", use_bias=False, name=f"block_{i}_gate_dense")(h)
        up = keras.layers.Dense(ffn, use_bias=False, name=f"block_{i}_up_dense")(h)
        down = keras.layers.Dense(hidden, use_bias=False, name=f"block_{i}_down_dense")
        x = keras.layers.Add()([x, down(keras.layers.Multiply()([gate, up]))])
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    return keras.Model(tokens, keras.layers.Dense(vocab, use_bias=False, name="lm_head")(x), name="decoder")


SIZES = {
    "7b": dict(blocks=32, hidden=4096, heads=32, ffn=11008, vocab=32000),
    "small": dict(blocks=8, hidden=1024, heads=16, ffn=2752, vocab=8000),
}


def measure(size: str, real: bool) -> dict:
    """Runs in a fresh process: plans (dry, or after a real build) and reports its costs."""
    import keras_meshlayout as kml

    kml.emulate_devices(8)
    import keras

    config = SIZES[size]
    mesh = kml.Mesh(data=2, model=4)
    start = time.perf_counter()
    with kml.dry_build(lambda: build_decoder(**config)) as probe:
        rules = kml.auto_rules(probe, mesh)
        parameters = sum(math.prod(v.shape) for v in probe.weights)
    distribution = kml.ModelParallel(mesh, rules)
    if real:
        with distribution.scope():
            model = build_decoder(**config)
            optimizer = keras.optimizers.Adam()
            optimizer.build(model.trainable_variables)
            plan = kml.plan_model(distribution, model, optimizer)
    else:
        plan = kml.dry_plan(lambda: build_decoder(**config), distribution, optimizer="adam")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory = plan.memory()
    return {
        "size": size,
        "mode": "real" if real else "dry",
        "parameters": parameters,
        "variables": len(plan),
        "seconds": round(seconds, 2),
        "peak_rss_bytes": peak,
        "peak_rss_over_fp32_model": peak / (4 * parameters),
        "state_per_device_bytes": memory.total,
        "split_variables": sum(not e.replicated for e in plan),
    }


def run(size: str, real: bool) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--measure", size, *(["--real"] if real else [])],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--measure", choices=SIZES, help=argparse.SUPPRESS)
    parser.add_argument("--real", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.real)))
        return
    results = [run("7b", real=False), run("small", real=False), run("small", real=True)]
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Planning a decoder on data=2 × model=4 with Adam (fresh process each)")
    for column in ("model", "mode", "parameters", "seconds", "peak RSS", "RSS / fp32 model", "state/device"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["size"],
            r["mode"],
            f"{r['parameters'] / 1e9:.2f} B",
            f"{r['seconds']:.1f}",
            f"{r['peak_rss_bytes'] / 2**20:.0f} MiB",
            f"{r['peak_rss_over_fp32_model']:.3f}",
            f"{r['state_per_device_bytes'] / 2**30:.2f} GiB",
        )
    console = Console()
    console.print(table)
    dry, real = results[1], results[2]
    console.print(
        f"small model, dry vs real build: {real['seconds'] / dry['seconds']:.1f}x the time and "
        f"{real['peak_rss_bytes'] / dry['peak_rss_bytes']:.1f}x the peak memory for the real build"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
