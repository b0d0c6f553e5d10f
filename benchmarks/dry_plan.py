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

The same 7 B decoder is also written two other ways: functional with
`keras.ops` attention (reshape/einsum/softmax) and an operator SwiGLU
(`ops.silu(g) * u`), and as a subclassed `keras.Model` of custom blocks. For
each style the second table shows: the no-budget plan's parameters per device
over the tensor-parallel ideal and whether it passes the replication guard
(`plan.check()`), and the smallest memory-budget plan's state per device over
the fully sharded floor (total state / 8), with the planning time and peak
memory of that process.

    python benchmarks/dry_plan.py            # the 7B figures (a few minutes, < 2 GiB each)
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


def build_ops_decoder(blocks: int, hidden: int, heads: int, ffn: int, vocab: int, sequence: int = 2048):
    """The same decoder, functional, with keras.ops attention and an operator SwiGLU."""
    import keras
    from keras import ops

    def attention(q, k, v):
        shape = (-1, sequence, heads, hidden // heads)
        q, k, v = (ops.reshape(t, shape) for t in (q, k, v))
        scores = ops.einsum("bqhd,bkhd->bhqk", q, k) / (hidden // heads) ** 0.5
        out = ops.einsum("bhqk,bkhd->bqhd", ops.softmax(scores, axis=-1), v)
        return ops.reshape(out, (-1, sequence, hidden))

    tokens = keras.Input((sequence,), dtype="int32")
    x = keras.layers.Embedding(vocab, hidden, name="token_embedding")(tokens)
    for i in range(blocks):
        h = keras.layers.LayerNormalization(name=f"block_{i}_attention_norm")(x)
        q, k, v = (keras.layers.Dense(hidden, use_bias=False, name=f"block_{i}_{n}")(h) for n in "qkv")
        x = x + keras.layers.Dense(hidden, use_bias=False, name=f"block_{i}_o")(attention(q, k, v))
        h = keras.layers.LayerNormalization(name=f"block_{i}_ffn_norm")(x)
        g = keras.layers.Dense(ffn, use_bias=False, name=f"block_{i}_w1")(h)
        u = keras.layers.Dense(ffn, use_bias=False, name=f"block_{i}_w3")(h)
        x = x + keras.layers.Dense(hidden, use_bias=False, name=f"block_{i}_w2")(ops.silu(g) * u)
    x = keras.layers.LayerNormalization(name="final_norm")(x)
    return keras.Model(tokens, keras.layers.Dense(vocab, use_bias=False, name="lm_head")(x), name="decoder")


def build_subclassed_decoder(
    blocks: int, hidden: int, heads: int, ffn: int, vocab: int, sequence: int = 2048
):
    """The same decoder as a subclassed keras.Model of custom blocks holding their own weights."""
    import keras
    from keras import ops

    class Block(keras.layers.Layer):
        def build(self, input_shape):
            def weight(name, shape):
                return self.add_weight(shape=shape, initializer="glorot_uniform", name=name)

            self.norm1 = keras.layers.LayerNormalization(name="attention_norm")
            self.norm2 = keras.layers.LayerNormalization(name="ffn_norm")
            self.norm1.build(input_shape)
            self.norm2.build(input_shape)
            square = (hidden, hidden)
            self.wq, self.wk, self.wv, self.wo = (weight(n, square) for n in ("wq", "wk", "wv", "wo"))
            self.w1, self.w3 = weight("w1", (hidden, ffn)), weight("w3", (hidden, ffn))
            self.w2 = weight("w2", (ffn, hidden))

        def call(self, x):
            h = self.norm1(x)
            shape = (-1, sequence, heads, hidden // heads)
            q, k, v = (ops.reshape(ops.matmul(h, w), shape) for w in (self.wq, self.wk, self.wv))
            scores = ops.softmax(ops.einsum("bqhd,bkhd->bhqk", q, k) / (hidden // heads) ** 0.5, axis=-1)
            out = ops.reshape(ops.einsum("bhqk,bkhd->bqhd", scores, v), (-1, sequence, hidden))
            x = x + ops.matmul(out, self.wo)
            h = self.norm2(x)
            return x + ops.matmul(ops.silu(ops.matmul(h, self.w1)) * ops.matmul(h, self.w3), self.w2)

    class Decoder(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.embedding = keras.layers.Embedding(vocab, hidden, name="token_embedding")
            self.blocks = [Block(name=f"block_{i}") for i in range(blocks)]
            self.norm = keras.layers.LayerNormalization(name="final_norm")
            self.head = keras.layers.Dense(vocab, use_bias=False, name="lm_head")

        def call(self, tokens):
            x = self.embedding(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(self.norm(x))

    model = Decoder(name="decoder")
    model(keras.Input((sequence,), dtype="int32"))  # builds symbolically: nothing is computed
    return model


BUILDERS = {"layers": build_decoder, "ops": build_ops_decoder, "subclassed": build_subclassed_decoder}

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


def measure_style(style: str) -> dict:
    """Runs in a fresh process: the no-budget and the smallest plans of the 7B decoder in one style."""
    import keras_meshlayout as kml

    kml.emulate_devices(8)
    import jax

    config = SIZES["7b"]
    mesh = kml.Mesh(data=2, model=4)
    build = BUILDERS[style]
    batch = jax.ShapeDtypeStruct((4, 2048), "int32")  # 4 sequences of 2048 tokens per step
    start = time.perf_counter()
    with kml.dry_build(lambda: build(**config)) as probe:
        free = kml.auto_rules(probe, mesh)
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
            shards = math.prod(mesh.axis_sizes[a] for a in (axes or ()) if a is not None)
            per_device += math.prod(variable.shape) // shards
    planning = time.perf_counter() - start
    plan = kml.dry_plan(lambda: build(**config), kml.ModelParallel(mesh, free), optimizer="adam")
    try:
        plan.check()
        guard = "passes"
    except kml.MemoryBudgetError:
        guard = "fails"
    memory = plan.memory()
    total_state = 4 * parameters * 4  # float32 parameters, gradients and Adam's two moments
    floor = total_state / 8
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "style": style,
        "parameters": parameters,
        "planning_seconds": round(planning, 2),
        "peak_rss_bytes": peak,
        "no_budget_params_over_tp_ideal": per_device / (parameters / mesh.axis_sizes["model"]),
        "no_budget_guard": guard,
        "no_budget_state_bytes": memory.total,
        "smallest_state_bytes": smallest.cost.state_bytes,
        "smallest_over_floor": smallest.cost.state_bytes / floor,
        "smallest_wire_bytes": smallest.cost.wire_bytes,
        "smallest_layouts": smallest.cost.layouts(),
        "floor_bytes": floor,
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
    parser.add_argument("--style", choices=BUILDERS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.real)))
        return
    if args.style:
        print(json.dumps(measure_style(args.style)))
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
    styles = [
        json.loads(
            subprocess.run(
                [sys.executable, __file__, "--style", style], check=True, capture_output=True, text=True
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        for style in BUILDERS
    ]
    table = Table(title="The 7B decoder in three styles, data=2 × model=4, Adam, 4 × 2048 tokens")
    for column in (
        "style", "plan time", "peak RSS", "no budget: params/device ÷ TP ideal", "guard",
        "smallest plan: state/device", "÷ fully sharded floor", "its traffic/step",
    ):  # fmt: skip
        table.add_column(column, justify="right")
    for r in styles:
        table.add_row(
            r["style"],
            f"{r['planning_seconds']:.1f} s",
            f"{r['peak_rss_bytes'] / 2**20:.0f} MiB",
            f"{r['no_budget_params_over_tp_ideal']:.2f}",
            r["no_budget_guard"],
            f"{r['smallest_state_bytes'] / 2**30:.2f} GiB",
            f"{r['smallest_over_floor']:.3f}",
            f"{r['smallest_wire_bytes'] / 2**30:.1f} GiB",
        )
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sizes": results, "styles": styles}, f, indent=2)


if __name__ == "__main__":
    main()
