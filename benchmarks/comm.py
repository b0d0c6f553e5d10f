"""Benchmark: what each layout sends per training step, against Megatron's formula.

For three models (an MLP stack, a transformer encoder, a decoder-only model with
grouped-query attention) on three meshes of 8 devices (2×4, 4×2, 1×8), this
compiles Keras's own train step under each layout and reads the partitioned
HLO with `kml.comm_report`:

- `auto`: `kml.auto_rules(model, mesh)`, the automatic planner;
- `preset`: `kml.mlp_rules([...])` or `kml.transformer_rules()`;
- `keras docs map`: `.*dense.*kernel -> (None, "model")`, `.*dense.*bias ->
  ("model",)`, the example of Keras's distribution guide: every Dense kernel
  split on its output features;
- `data-parallel`: `kml.ModelParallel(kml.Mesh(data=8))`, no rules (the same
  compile is shown under every mesh, for comparison);
- `auto + k/v output rule` (decoder, where its 2 key/value heads do not divide
  the model axis): the planner's rules and one rule keeping the key/value
  projections' outputs whole over the model axis;
- `formula`: what Megatron-LM's layout (Shoeybi et al., 2019) sends, counted by
  hand: per transformer layer 4 all-reduces of (local batch × seq × hidden)
  activations over the model axis (2 forward, 2 backward), per MLP pair 2 (the
  backward one dropped when the pair's input needs no gradient, as right after
  the model input), each at ring cost 2(n-1)/n; plus the data-parallel
  all-reduce of every parameter's per-device shard over the data axis at
  2(d-1)/d.

Bytes are wire bytes sent per device per step, scalar (loss) all-reduces left
out and counted separately. Memory is the per-device bytes of parameters plus
Adam's state from `dist.plan(model)`, against the ideal: every variable divided
by the model-axis size where the Megatron layout splits it (the projections of
each MLP pair, feed-forward and attention head, biases that go with split
outputs), and whole elsewhere (norms, embeddings, row-parallel biases, the
final head, optimizer scalars). The models are tiny, so every distribution
uses `replicate_below=0`: without it the small-matrix threshold would keep
most of their weights replicated and hide the layouts being compared.

Run:

    python benchmarks/comm.py                  # all models and meshes (about a minute on 2 cores)
    python benchmarks/comm.py --quick          # the 2×4 mesh only
    python benchmarks/comm.py --json out.json  # also write the numbers
    python benchmarks/comm.py --explain        # also the per-layer report where auto ≠ formula

Ratios, not timings: the devices are emulated CPUs, and XLA:CPU's collective
optimisations may differ from those of XLA:GPU and XLA:TPU (see README).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import re
import time
import warnings
from collections.abc import Callable
from typing import Any

import keras_meshlayout as kml

kml.emulate_devices(8)

import jax  # noqa: E402  (after emulate_devices, on purpose)
import keras  # noqa: E402
import numpy as np  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

MESHES = ((2, 4), (4, 2), (1, 8))
DOCS_MAP = [(r".*dense.*kernel", (None, "model")), (r".*dense.*bias", ("model",))]
#: Not part of the planner (yet): where key/value heads do not divide the model axis, keep the
#: key/value projections' outputs whole over it, so that XLA does not split their gradients
#: over sub-groups and then all-gather the replicated key/value weights every step.
KV_OUTPUTS = (
    r".*/(?:key|value)/output",
    ("data", None, None, None),
    "key/value heads do not divide: outputs whole over model",
)
KV_LAYOUT = "auto + k/v output rule"
FLOAT_BYTES = 4
ADAM_SLOTS = 2  # momentum and velocity per trainable variable

# -- the models ------------------------------------------------------------------------
# Every Dense layer has "dense" in its name, so the Keras docs map applies to all of them.


def build_mlp() -> keras.Model:
    """Two Megatron pairs and a small head: 128 → 512 → 128 → 512 → 128 → 16."""
    return keras.Sequential(
        [
            keras.Input((128,)),
            keras.layers.Dense(512, activation="gelu", name="dense_up_1"),
            keras.layers.Dense(128, name="dense_down_1"),
            keras.layers.Dense(512, activation="relu", name="dense_up_2"),
            keras.layers.Dense(128, name="dense_down_2"),
            keras.layers.Dense(16, name="dense_head"),
        ],
        name="mlp",
    )


ENCODER = dict(vocab=512, seq=32, hidden=128, heads=8, ffn=512, classes=16)


def build_encoder() -> keras.Model:
    """One post-norm encoder block (MultiHeadAttention, gelu FFN), pooled, classified.

    One block: in a flat functional model layer names are unique, and the preset
    matches its row-parallel layer only by the whole name `feedforward_output_dense`.
    """
    c = ENCODER
    tokens = keras.Input((c["seq"],), dtype="int32")
    hidden = keras.layers.Embedding(c["vocab"], c["hidden"], name="token_embedding")(tokens)
    attention = keras.layers.MultiHeadAttention(c["heads"], c["hidden"] // c["heads"], name="attention")
    hidden = keras.layers.Add()([hidden, attention(hidden, hidden)])
    hidden = keras.layers.LayerNormalization(name="attention_norm")(hidden)
    ffn = keras.layers.Dense(c["ffn"], activation="gelu", name="feedforward_intermediate_dense")(hidden)
    ffn = keras.layers.Dense(c["hidden"], name="feedforward_output_dense")(ffn)
    hidden = keras.layers.LayerNormalization(name="feedforward_norm")(keras.layers.Add()([hidden, ffn]))
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(tokens, keras.layers.Dense(c["classes"], name="head_dense")(pooled), name="encoder")


DECODER = dict(vocab=512, seq=32, hidden=128, heads=8, kv_heads=2, ffn=512, blocks=2)


class DecoderBlock(keras.layers.Layer):
    """A pre-norm Llama-style block: causal grouped-query attention, SwiGLU feed-forward.

    A custom layer, as in keras-hub: the planner cannot see its call graph and
    lays out its variables by name.
    """

    def __init__(self, hidden: int, heads: int, kv_heads: int, ffn: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.attention_norm = keras.layers.LayerNormalization(name="self_attention_layer_norm")
        self.attention = keras.layers.GroupQueryAttention(
            hidden // heads, heads, kv_heads, use_bias=False, name="self_attention"
        )
        self.feedforward_norm = keras.layers.LayerNormalization(name="feedforward_layer_norm")
        self.gate = keras.layers.Dense(ffn, activation="silu", use_bias=False, name="feedforward_gate_dense")
        self.up = keras.layers.Dense(ffn, use_bias=False, name="feedforward_intermediate_dense")
        self.down = keras.layers.Dense(hidden, use_bias=False, name="feedforward_output_dense")

    def call(self, x: Any) -> Any:
        h = self.attention_norm(x)
        x = x + self.attention(h, h, use_causal_mask=True)
        h = self.feedforward_norm(x)
        return x + self.down(self.gate(h) * self.up(h))


def build_decoder() -> keras.Model:
    """Token embedding, two decoder blocks (8 query heads, 2 key/value heads), untied LM head."""
    c = DECODER
    tokens = keras.Input((c["seq"],), dtype="int32")
    hidden = keras.layers.Embedding(c["vocab"], c["hidden"], name="token_embedding")(tokens)
    for i in range(c["blocks"]):
        block = DecoderBlock(c["hidden"], c["heads"], c["kv_heads"], c["ffn"], name=f"decoder_{i}")
        hidden = block(hidden)
    hidden = keras.layers.LayerNormalization(name="final_layer_norm")(hidden)
    logits = keras.layers.Dense(c["vocab"], name="lm_head_dense")(hidden)
    return keras.Model(tokens, logits, name="decoder")


# -- what Megatron's layout splits: the formula and the ideal memory both use it -------------


def mlp_shards(path: str, shape: tuple[int, ...], model: int) -> int:
    """Column layers split outputs (kernel and bias), row layers inputs (kernel only)."""
    layer, name = path.split("/")[-2:]
    if layer.startswith("dense_up"):
        return model if shape[-1] % model == 0 else 1
    if layer.startswith("dense_down") and name == "kernel":
        return model if shape[0] % model == 0 else 1
    return 1


def transformer_shards(heads: int, kv_heads: int) -> Callable[[str, tuple[int, ...], int], int]:
    """Attention split over heads (key/value only when their head count divides), FFN paired."""

    def shards(path: str, shape: tuple[int, ...], model: int) -> int:
        layer, name = path.split("/")[-2:]
        if layer == "query" or (layer == "attention_output" and name == "kernel"):
            return model if heads % model == 0 else 1
        if layer in ("key", "value"):
            return model if kv_heads % model == 0 else 1
        if layer.endswith(("gate_dense", "intermediate_dense")):
            return model if shape[-1] % model == 0 else 1
        if layer.endswith("output_dense") and name == "kernel":
            return model if shape[0] % model == 0 else 1
        return 1

    return shards


@dataclasses.dataclass
class Workload:
    """A model, one global batch for it, its preset, and Megatron's count of its traffic."""

    name: str
    build: Callable[[], keras.Model]
    x: np.ndarray
    y: np.ndarray
    preset: kml.LayoutRules
    #: Megatron's activation all-reduces per step: (how many, elements per sample each).
    activation_all_reduces: tuple[int, int]
    shards: Callable[[str, tuple[int, ...], int], int]
    described: str
    #: Key/value heads of grouped-query attention, if any.
    kv_heads: int | None = None


def workloads() -> list[Workload]:
    rng = np.random.default_rng(0)
    mlp_batch, seq_batch = 64, 16
    enc, dec = ENCODER, DECODER
    return [
        Workload(
            name="mlp",
            build=build_mlp,
            x=rng.normal(size=(mlp_batch, 128)).astype("float32"),
            y=rng.integers(0, 16, size=mlp_batch).astype("int32"),
            preset=kml.mlp_rules(["dense_up_1", "dense_down_1", "dense_up_2", "dense_down_2"]),
            # Pair 1: forward only (its input is the model input); pair 2: forward + backward.
            activation_all_reduces=(3, 128),
            shards=mlp_shards,
            described="MLP 128→512→128→512→128→16 (2 pairs), batch 64",
        ),
        Workload(
            name="encoder",
            build=build_encoder,
            x=rng.integers(0, enc["vocab"], size=(seq_batch, enc["seq"])).astype("int32"),
            y=rng.integers(0, enc["classes"], size=seq_batch).astype("int32"),
            preset=kml.transformer_rules(),
            activation_all_reduces=(4, enc["seq"] * enc["hidden"]),
            shards=transformer_shards(enc["heads"], enc["heads"]),
            described=(
                f"encoder, 1 block: MultiHeadAttention {enc['heads']} heads, hidden {enc['hidden']}, "
                f"FFN {enc['ffn']}, seq {enc['seq']}, batch {seq_batch}"
            ),
        ),
        Workload(
            name="decoder (GQA)",
            build=build_decoder,
            x=rng.integers(0, dec["vocab"], size=(seq_batch, dec["seq"])).astype("int32"),
            y=rng.integers(0, dec["vocab"], size=(seq_batch, dec["seq"])).astype("int32"),
            preset=kml.transformer_rules(),
            activation_all_reduces=(4 * dec["blocks"], dec["seq"] * dec["hidden"]),
            shards=transformer_shards(dec["heads"], dec["kv_heads"]),
            kv_heads=dec["kv_heads"],
            described=(
                f"decoder, {dec['blocks']} blocks: GroupQueryAttention {dec['heads']} query / "
                f"{dec['kv_heads']} key-value heads, causal, SwiGLU FFN {dec['ffn']}, hidden "
                f"{dec['hidden']}, vocab {dec['vocab']}, seq {dec['seq']}, batch {seq_batch}"
            ),
        ),
    ]


# -- measuring -----------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    model: str
    mesh: str
    layout: str
    wire_bytes: float = 0.0  # scalars excluded
    by_axis: dict[str, float] = dataclasses.field(default_factory=dict)
    scalar_bytes: float = 0.0
    all_gathers: int = 0
    state_bytes: int = 0
    formula_bytes: float = 0.0
    ideal_state_bytes: float = 0.0
    error: str = ""
    warnings: int = 0
    report: kml.CommReport | None = dataclasses.field(default=None, repr=False)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("report")
        data["vs_formula"] = self.wire_bytes / self.formula_bytes if self.formula_bytes else None
        data["vs_ideal_state"] = self.state_bytes / self.ideal_state_bytes if self.ideal_state_bytes else None
        return data


def measure(work: Workload, mesh: kml.Mesh, rules: Any) -> Row:
    """Builds the model under `rules` on `mesh`, compiles one step, reads traffic and state."""
    row = Row(work.name, mesh.spec, "")
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", kml.MeshLayoutWarning)
        try:
            distribution = kml.ModelParallel(mesh, rules, replicate_below=0)
            with distribution.scope():
                model = work.build()
                model.compile(
                    optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                )
                report = kml.comm_report(model, work.x, work.y)
                plan = distribution.plan(model)  # after comm_report: the optimizer is built
        except Exception as error:  # a layout that fails is a result: record its class
            row.error = type(error).__name__
            return row
    # Presets cover many model families, so their unmatched rules are expected: count only
    # the dimensions that were replicated because they do not divide.
    row.warnings = sum(issubclass(w.category, kml.IndivisibleShapeWarning) for w in caught)
    row.report = report
    scalars = [t for t in report.transfers if not t.shape]
    row.scalar_bytes = sum(t.wire_bytes for t in scalars)
    row.wire_bytes = report.wire_bytes - row.scalar_bytes
    by_axis: dict[str, float] = collections.defaultdict(float)
    for t in report.transfers:
        if t.shape:
            by_axis["×".join(t.axes) or "-"] += t.wire_bytes
    row.by_axis = dict(by_axis)
    row.all_gathers = report.count("all-gather")
    row.state_bytes = plan.bytes_per_device
    return row


def ring(n: int) -> float:
    return 2 * (n - 1) / n


def megatron(work: Workload, model: keras.Model, data: int, tp: int) -> tuple[float, float]:
    """Megatron's wire bytes per device per step, and the ideal per-device state bytes."""
    count, per_sample = work.activation_all_reduces
    local_batch = work.x.shape[0] // data
    activations = count * local_batch * per_sample * FLOAT_BYTES * ring(tp)
    shards = [work.shards(w.path, tuple(w.shape), tp) for w in model.trainable_weights]
    shard_bytes = sum(_nbytes(w) / s for w, s in zip(model.trainable_weights, shards, strict=True))
    gradients = shard_bytes * ring(data)
    optimizer_scalars = 2 * FLOAT_BYTES  # Adam's iteration and learning rate
    ideal_state = shard_bytes * (1 + ADAM_SLOTS) + optimizer_scalars
    return activations + gradients, ideal_state


def _nbytes(variable: keras.Variable) -> int:
    return math.prod(variable.shape) * np.dtype(variable.dtype).itemsize


def run(quick: bool) -> tuple[list[Row], list[Workload]]:
    meshes = MESHES[:1] if quick else MESHES
    rows: list[Row] = []
    works = workloads()
    for work in works:
        probe = work.build()  # unsharded: the planner's input and the formula's shapes
        data_parallel = measure(work, kml.Mesh(data=8), None)
        for data, tp in meshes:
            mesh = kml.Mesh(data=data, model=tp)
            formula, ideal = megatron(work, probe, data, tp)
            rules = {
                "auto": kml.auto_rules(probe, mesh, replicate_below=0),
                "preset": work.preset,
                "keras docs map": DOCS_MAP,
            }
            if work.kv_heads is not None and work.kv_heads % tp:
                auto = [(r.pattern, r.axes, r.note) for r in rules["auto"].rules]
                rules[KV_LAYOUT] = kml.LayoutRules([KV_OUTPUTS, *auto])
            group = [dataclasses.replace(measure(work, mesh, rules[name]), layout=name) for name in rules]
            group.append(dataclasses.replace(data_parallel, mesh=mesh.spec, layout="data-parallel"))
            for row in group:
                row.formula_bytes, row.ideal_state_bytes = formula, ideal
            rows.append(Row(work.name, mesh.spec, "formula", formula, formula_bytes=formula))
            rows[-1].state_bytes, rows[-1].ideal_state_bytes = round(ideal), ideal
            rows.extend(group)
    return rows, works


# -- printing ------------------------------------------------------------------------------


def kib(count: float) -> str:
    return f"{count / 1024:,.1f}"


def table(rows: list[Row]) -> Table:
    out = Table(
        title="Sent per device per training step (KiB, scalar all-reduces excluded); "
        "parameter + Adam state per device (KiB)",
        title_justify="left",
    )
    for column, justify in [
        ("model", "left"),
        ("mesh", "left"),
        ("layout", "left"),
        ("sent", "right"),
        ("over model", "right"),
        ("over data", "right"),
        ("/ formula", "right"),
        ("all-gathers", "right"),
        ("state", "right"),
        ("/ ideal", "right"),
    ]:
        out.add_column(column, justify=justify)
    previous = None
    for i, row in enumerate(rows):
        last_of_group = i + 1 == len(rows) or (rows[i + 1].model, rows[i + 1].mesh) != (row.model, row.mesh)
        first = (row.model, row.mesh) != previous
        previous = (row.model, row.mesh)
        mesh_cell = row.mesh.replace(",", "×") if first else ""
        if row.layout == "data-parallel":
            mesh_cell = "data=8"
        if row.error:
            cells = [f"crashes ({row.error})", "", "", "", "", "", ""]
        elif row.layout == "formula":
            cells = [kib(row.wire_bytes), "", "", "1.00", "0", kib(row.state_bytes), "1.00"]
        else:
            cells = [
                kib(row.wire_bytes),
                kib(row.by_axis.get("model", 0.0)),
                kib(row.by_axis.get("data", 0.0)),
                f"{row.wire_bytes / row.formula_bytes:.2f}",
                str(row.all_gathers),
                kib(row.state_bytes),
                f"{row.state_bytes / row.ideal_state_bytes:.2f}",
            ]
        out.add_row(row.model if first else "", mesh_cell, row.layout, *cells, end_section=last_of_group)
    return out


def mesh_label(spec: str) -> str:
    return spec.replace(",", "×")


def explain(console: Console, rows: list[Row]) -> None:
    """The per-layer model-axis traffic of each auto plan that is not at the formula."""
    for row in rows:
        if row.layout != "auto" or row.report is None or at_formula(row):
            continue
        title = f"{row.model} on {mesh_label(row.mesh)}, auto"
        console.print(f"\n[bold]{title}[/bold]: traffic over model, per layer")
        grouped: dict[tuple, list[kml.Transfer]] = collections.defaultdict(list)
        for t in row.report.transfers:
            if "model" in t.axes:
                grouped[(t.layer or "-", t.phase, t.kind, t.group_size)].append(t)
        for (layer, phase, kind, size), items in grouped.items():
            sent = sum(t.wire_bytes for t in items)
            console.print(
                f"  {layer:44} {phase:9} {kind:11} group {size}  {len(items):3} arrays {kib(sent):>8} KiB"
            )


def at_formula(row: Row) -> bool:
    return abs(row.wire_bytes / row.formula_bytes - 1) < 0.005


def findings(rows: list[Row], works: list[Workload]) -> list[str]:
    """Where the auto plan is not at the formula, what the compiled step does instead."""
    expected = {work.name: work.activation_all_reduces[0] for work in works}
    lines = []
    for row in rows:
        if row.layout != "auto" or row.report is None or at_formula(row):
            continue
        size = row.report.axis_sizes["model"]
        model = [t for t in row.report.transfers if "model" in t.axes]
        whole = [t for t in model if t.kind == "all-reduce" and t.group_size == size]
        # One entry per kind of layer: decoder_0/query and decoder_1/query are decoder_*/query.
        backward = [re.sub(r"_\d+/", "_*/", t.layer) for t in whole if t.phase == "backward"]
        backward = list(dict.fromkeys(backward))
        text = (
            f"{row.model} on {mesh_label(row.mesh)}: auto at {row.wire_bytes / row.formula_bytes:.2f}× the "
            f"formula: {len(whole)} activation all-reduces over model where Megatron has "
            f"{expected[row.model]}; the backward ones after {', '.join(backward)}"
        )
        partial = [t for t in model if t.group_size < size]
        if partial:
            groups = sorted({t.group_size for t in partial})
            gathered = [t for t in partial if t.kind == "all-gather"]
            updates = [t for t in gathered if t.phase == "update"]
            text += (
                f"; {len(partial)} arrays moved within groups of {'/'.join(map(str, groups))} model "
                f"devices, {len(gathered)} of them all-gathers, {len(updates)} of those in the update "
                "(weights and Adam moments)"
            )
        lines.append(text)
    return lines


WHY = (
    "why: Megatron adds the gradients that flow back into a block's input from query, key and value "
    "(and from a gated feed-forward's two column projections) before one all-reduce; the XLA:CPU "
    "compile all-reduces each partial gradient, then adds. XLA:GPU runs an all-reduce-reassociate pass "
    "that rewrites add(all-reduce(a), all-reduce(b)) as all-reduce(a + b); not measured here. "
    "Key/value heads that do not divide the model axis are replicated (both plans); XLA then splits "
    "their gradient over sub-groups of the model axis and all-gathers the key/value weights and "
    "moments back every step."
)


def notes(rows: list[Row]) -> list[str]:
    lines = []
    for row in rows:
        if row.warnings:
            lines.append(
                f"{row.model} on {mesh_label(row.mesh)}, {row.layout}: {row.warnings} "
                "IndivisibleShapeWarning(s) (dimensions that do not divide by the model axis were replicated)"
            )
    scalars = {row.scalar_bytes for row in rows if row.layout != "formula" and not row.error}
    lines.append(
        "scalar all-reduces (loss) left out of 'sent': "
        + ", ".join(f"{b:.0f} B" for b in sorted(scalars))
        + " per device"
    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 2×4 mesh only")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--explain", action="store_true", help="per-layer traffic where auto ≠ formula")
    args = parser.parse_args()

    start = time.perf_counter()
    rows, works = run(args.quick)
    elapsed = time.perf_counter() - start

    console = Console(width=150)
    devices = jax.devices("cpu")[:8]
    console.print(
        f"{len(devices)} emulated {devices[0].platform} devices; keras {keras.__version__}, "
        f"jax {jax.__version__}; every layout with replicate_below=0"
    )
    for work in works:
        console.print(f"  {work.name}: {work.described}")
    console.print(table(rows))
    console.print(
        "auto: kml.auto_rules(model, mesh); preset: kml.mlp_rules / kml.transformer_rules(); keras docs "
        "map: .*dense.*kernel (None, 'model'), .*dense.*bias ('model',); data-parallel: "
        "kml.Mesh(data=8), no rules.\n"
        "formula: Megatron-LM (Shoeybi et al. 2019): 4 activation all-reduces per transformer "
        "layer, 2 per MLP pair (1 after the model input), at 2(n-1)/n over model; every "
        "parameter's Megatron shard all-reduced over data at 2(d-1)/d.\n"
        "ideal state: parameters + Adam moments, each divided by the model-axis size where "
        "Megatron's layout splits it, whole elsewhere (norms, embeddings, row biases, head)."
    )
    for line in notes(rows):
        console.print(f"note: {line}")
    found = findings(rows, works)
    for line in found:
        console.print(f"finding: {line}")
    if found:
        console.print(WHY)
    if args.explain:
        explain(console, rows)
    console.print(f"{len(rows)} rows in {elapsed:.0f} s")
    if args.json:
        result = {
            "devices": f"{len(devices)} × {devices[0].platform}",
            "keras": keras.__version__,
            "jax": jax.__version__,
            "replicate_below": 0,
            "models": {work.name: work.described for work in works},
            "rows": [row.to_dict() for row in rows],
            "findings": found,
            "seconds": elapsed,
        }
        with open(args.json, "w", encoding="utf-8") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
