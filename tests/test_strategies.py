"""The rule writer's ledger and each of its strategies, alone (issue 19, item 7).

`auto_rules` is an ordered list of strategies over one `Ledger`
(`planner/_auto.py: STRATEGIES`). Each test here runs one strategy on a fresh
ledger and checks what it decided, and what it left for the later ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import keras
import numpy as np
import pytest

import keras_meshlayout as kml
from keras_meshlayout.planner import _by_layers, _by_name, _by_trace, _convs, _notes, trace_model
from keras_meshlayout.planner._auto import STRATEGIES
from keras_meshlayout.planner._ledger import Ledger, Setting

MESH_AXIS, SIZE = "model", 4


def setting(model: keras.Model, batch=None, replicate_below: int = 0) -> Setting:
    trace = None if batch is None else trace_model(model, batch)
    return Setting(model, MESH_AXIS, SIZE, replicate_below, "data", trace)


def decisions(ledger: Ledger) -> dict[str, tuple]:
    """`{path: axes}` of the variable decisions, read back from the ledger's proposal."""
    return dict(ledger.proposal().axes)


def mlp(head: int = 10) -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(128, activation="relu", name="up"),
            keras.layers.Dense(32, name="down"),
            keras.layers.Dense(head, name="head"),
        ],
        name="mlp",
    )


class _Attention(keras.layers.Layer):
    """A custom attention block named as keras-hub names its projections."""

    def __init__(self, kv: int = 64, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = 4
        self.q_proj, self.o_proj = (
            keras.layers.Dense(64, name="q_proj"),
            keras.layers.Dense(64, name="o_proj"),
        )
        self.k_proj, self.v_proj = (
            keras.layers.Dense(kv, name="k_proj"),
            keras.layers.Dense(kv, name="v_proj"),
        )

    def build(self, shape):
        for layer in (self.q_proj, self.k_proj, self.v_proj):
            layer.build(shape)
        self.o_proj.build((*shape[:-1], 64))

    def call(self, x):
        return self.o_proj(self.q_proj(x) + 0 * self.k_proj(x).sum() + 0 * self.v_proj(x).sum())


def attention_model(kv: int = 64) -> keras.Model:
    inputs = keras.Input((8, 64))
    return keras.Model(inputs, _Attention(kv, name="attn")(inputs), name="net")


# -- the ledger ---------------------------------------------------------------------------


def test_the_first_decision_wins_and_a_revision_keeps_its_place():
    ledger = Ledger("net", MESH_AXIS, "data")
    ledger.record("net/a/kernel", (None, "model"), "first", unit="u")
    ledger.record("net/b/kernel", ("model", None), "second", unit="u")
    ledger.record("net/a/kernel", (None, None), "ignored")
    ledger.revise("net/a/kernel", (None, None), "revised")
    assert ledger.rules() == [
        ("(?:net/)?a/kernel", (None, None), "revised"),
        ("(?:net/)?b/kernel", ("model", None), "second"),
    ]
    proposal = ledger.proposal()
    assert dict(proposal.units) == {"net/b/kernel": "u"}  # a replicated variable is in no unit
    assert dict(proposal.notes) == {"net/a/kernel": "revised", "net/b/kernel": "second"}


def test_a_relayout_keeps_the_unit_and_an_output_rule_is_no_variable():
    ledger = Ledger("net", MESH_AXIS, "data")
    ledger.record("net/a/kernel", (None, "model"), "split", unit="u")
    ledger.keep_output_whole("net/kv", rank=3)
    ledger.keep_output_whole("net/kv", rank=3)
    ledger.relayout("net/a/kernel", ("data", "model"), "2-D")
    assert ledger.unit("net/a/kernel") == "u"
    assert ledger.rules()[1] == ("(?:net/)?kv/output", ("data", None, None), _notes.KV_OUTPUT_WHOLE)
    assert len(ledger.rules()) == 2 and list(ledger.proposal().axes) == ["net/a/kernel"]
    assert ledger.proposal().whole_outputs == frozenset({"net/kv"})


# -- each strategy alone ------------------------------------------------------------------


def test_traced_units_pair_a_column_with_its_row_and_leave_the_head():
    model = mlp()
    ledger = Ledger(model.name, MESH_AXIS, "data")
    _by_trace.traced_units(ledger, setting(model, np.zeros((8, 32), "float32")))
    assert decisions(ledger) == {
        "mlp/up/kernel": (None, "model"),
        "mlp/up/bias": ("model",),
        "mlp/down/kernel": ("model", None),
        "mlp/down/bias": (None,),
    }
    assert ledger.unit("mlp/up/kernel") == ledger.unit("mlp/down/kernel") == "up → down"


@pytest.mark.parametrize(
    ("head", "axes", "note"),
    [
        (4096, (None, "model"), "final layer head, vocab-parallel"),
        (16, (None, None), "final layer: replicated"),
    ],
    ids=["as-large-as-the-largest-split", "smaller"],
)
def test_final_layers_split_only_a_head_as_large_as_the_largest_split_kernel(head, axes, note):
    model = mlp(head)
    ledger = Ledger(model.name, MESH_AXIS, "data")
    s = setting(model, np.zeros((8, 32), "float32"))
    _by_trace.final_layers(ledger, s)
    assert decisions(ledger)["mlp/head/kernel"] == (None, None)  # nothing split yet: nothing to match
    ledger = Ledger(model.name, MESH_AXIS, "data")
    _by_trace.traced_units(ledger, s)
    _by_trace.final_layers(ledger, s)
    assert decisions(ledger)["mlp/head/kernel"] == axes
    assert ledger.proposal().notes["mlp/head/kernel"].startswith(note)


@pytest.mark.parametrize(
    ("channels", "groups", "before", "hidden", "axes"),
    [
        (32, 1, "rescaled", 64, (None, None, None, "model")),
        (32, 1, None, 128, (None,) * 4),
        (30, 1, None, 64, None),
        (32, 2, None, 64, None),
        (32, 1, "dense", 64, None),
    ],
    ids=["split", "smaller-than-the-mlp", "channels-that-do-not-divide", "grouped", "reads-a-trained-value"],
)
def test_input_convs_split_a_patch_conv_on_its_output_channels_and_gather_its_output(
    channels, groups, before, hidden, axes
):
    """After `traced_units` (an MLP of 32 × `hidden` kernels), a 4 × 4 × 4 × 32 patch conv (2,048 weights)."""

    def build() -> keras.Model:
        layers = keras.layers
        x = inputs = keras.Input((8, 8, 4))
        if before is not None:  # a rescaled image is still the input; a projected one gets a gradient
            x = layers.Rescaling(0.5)(x) if before == "rescaled" else layers.Dense(4, name="proj")(x)
        x = layers.Conv2D(channels, 4, strides=4, groups=groups, name="patches")(x)
        x = layers.LayerNormalization(name="norm")(layers.Reshape((4, channels))(x))
        x = layers.Dense(channels, name="down")(layers.Dense(hidden, activation="gelu", name="up")(x))
        return keras.Model(inputs, layers.Dense(10, name="head")(x), name="net")

    with kml.dry_build(build) as model:  # read, never run: nothing allocated
        ledger = Ledger(model.name, MESH_AXIS, "data")
        s = setting(model, np.zeros((2, 8, 8, 4), "float32"))
        _by_trace.traced_units(ledger, s)
        _convs.input_convs(ledger, s)
    assert ledger.axes("patches/kernel") == axes
    assert not ledger.decided("head/kernel") and not ledger.decided("norm/gamma")
    outputs = [rule for rule in ledger.rules() if rule[0].endswith("/output")]
    if axes is None or not any(axes):
        assert outputs == [] and ledger.proposal().input_convs == frozenset()
        assert axes is None or ledger.proposal().notes["patches/kernel"].startswith(
            "input conv: replicated, so its output needs no gathering (2,048 weights, fewer than the 4,096"
        )
    else:
        assert ledger.axes("patches/bias") == ("model",)
        assert outputs == [("patches/output", ("data", None, None, None), _notes.INPUT_CONV_OUTPUT)]
        assert ledger.proposal().input_convs == {"patches/kernel"}


def test_lone_projections_are_noted_with_the_reason():
    model = mlp()
    ledger = Ledger(model.name, MESH_AXIS, "data")
    _by_trace.lone_projections(ledger, setting(model, np.zeros((8, 32), "float32")))
    notes = ledger.proposal().notes
    assert notes["mlp/up/kernel"] == _notes.NO_PARTNER and notes["mlp/head/kernel"] == _notes.FINAL_REPLICATED
    assert all(not any(axes) for axes in decisions(ledger).values())


def test_projection_pairs_read_the_layer_graph_when_nothing_is_traced():
    model = mlp()
    ledger = Ledger(model.name, MESH_AXIS, "data")
    _by_layers.projection_pairs(ledger, setting(model))
    assert decisions(ledger)["mlp/up/kernel"] == (None, "model")
    assert decisions(ledger)["mlp/down/kernel"] == ("model", None)
    assert ledger.proposal().notes["mlp/head/kernel"] == _notes.FINAL_REPLICATED
    traced = Ledger(model.name, MESH_AXIS, "data")  # with a trace, pairs are `traced_units`' job
    _by_layers.projection_pairs(traced, setting(model, np.zeros((8, 32), "float32")))
    assert not any(any(axes) for axes in decisions(traced).values())


def test_attention_layers_split_keras_attention_over_heads():
    inputs = keras.Input((8, 32))
    outputs = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="mha")(inputs, inputs)
    model = keras.Model(inputs, outputs, name="net")
    ledger = Ledger(model.name, MESH_AXIS, "data")
    _by_layers.attention_layers(ledger, setting(model))
    axes = decisions(ledger)
    assert axes["mha/query/kernel"] == (None, "model", None)
    assert axes["mha/attention_output/kernel"] == ("model", None, None)
    assert axes["mha/attention_output/bias"] == (None,)


@pytest.mark.parametrize(
    ("kv", "key_axes", "whole_output"),
    [(64, (None, "model"), False), (32, (None, None), True)],
    ids=["as-many-kv-heads", "too-few-kv-heads"],
)
def test_attention_blocks_found_by_their_projection_names(kv, key_axes, whole_output):
    model = attention_model(kv)
    ledger = Ledger(model.name, MESH_AXIS, "data")
    _by_name.attention_blocks(ledger, setting(model))
    axes = decisions(ledger)
    assert axes["attn/q_proj/kernel"] == (None, "model")
    assert axes["attn/o_proj/kernel"] == ("model", None)
    assert axes["attn/k_proj/kernel"] == key_axes
    assert (ledger.proposal().whole_outputs == {"attn/k_proj", "attn/v_proj"}) is whole_output


def kv_model(bias: bool = False) -> keras.Model:
    """A key projection into 2 heads of 16 (`EinsumDense`, as keras-hub Llama's), then a Dense."""
    inputs = keras.Input((8, 64))
    key = keras.layers.EinsumDense("btd,dnh->btnh", (8, 2, 16), bias_axes="nh" if bias else None, name="key")(
        inputs
    )
    return keras.Model(
        inputs, keras.layers.Dense(4, name="head")(keras.layers.Reshape((8, 32))(key)), name="net"
    )


@pytest.mark.parametrize(
    ("bias", "batch_size", "axes"),
    [(False, 2, (None, None, "model")), (False, 1, (None, None, None)), (True, 2, (None, None, None))],
    ids=["split", "no-batch-axis", "with-a-bias"],
)
def test_kv_head_dim_splits_a_whole_key_value_kernel_on_its_head_dim(bias, batch_size, axes):
    """Issue 19 item 4: the plan without a batch kept these kernels replicated (Gemma 1.22x the ideal at
    replicate_below=0); only the costs split them. Over a batch axis of 2 or more the split sends no more."""
    model = kv_model(bias)
    ledger = Ledger(model.name, MESH_AXIS, "data")
    ledger.record("key/kernel", (None, None, None), "kept whole before")
    ledger.keep_output_whole("key")
    trace = trace_model(model, np.zeros((4, 8, 64), "float32"))
    _by_layers.kv_head_dim(ledger, Setting(model, MESH_AXIS, SIZE, 0, "data", trace, batch_size))
    assert decisions(ledger)["key/kernel"] == axes
    expected = _notes.kv_head_dim_split(2, 16, MESH_AXIS, SIZE) if any(axes) else "kept whole before"
    assert ledger.proposal().notes["key/kernel"] == expected
    assert not ledger.unit("key/kernel")  # a unit of its own for the costs, as before


def dense_kv_model(bias: bool = False) -> keras.Model:
    """A `Dense` key projection into 2 heads of 16, reshaped into them (as keras-hub SmolLM3's)."""
    inputs = keras.Input((8, 64))
    key = keras.layers.Dense(32, use_bias=bias, name="key")(inputs)
    heads = keras.layers.Reshape((8, 2, 16))(key)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.Flatten()(heads)), name="net")


@pytest.mark.parametrize(
    ("size", "bias", "axes"),
    [(SIZE, False, (None, "model")), (3, False, (None, None)), (SIZE, True, (None, None))],
    ids=["split", "indivisible", "with-a-bias"],
)
def test_kv_head_dim_splits_a_dense_key_value_kernel_on_its_output_features(size, bias, axes):
    """Issue 19 item 4: SmolLM3's Dense k_proj/v_proj (2 key/value heads, model=4) stayed whole (1.196x the
    ideal) while EinsumDense ones were split on head_dim; a Dense kernel's output features hold the heads
    and their head_dim together, so it is split there when they divide (32 features: over 4, not over 3)."""
    with kml.dry_build(lambda: dense_kv_model(bias)) as model:  # nothing allocated: no initializer compiles
        ledger = Ledger(model.name, MESH_AXIS, "data")
        ledger.replicate(model.get_layer("key").weights, "kept whole before")
        ledger.keep_output_whole("key", rank=3)
        ledger.kv_heads["key"] = 2  # as `_by_name.attention_blocks` records a Dense key/value projection
        trace = trace_model(model, np.zeros((4, 8, 64), "float32"))
        _by_layers.kv_head_dim(ledger, Setting(model, MESH_AXIS, size, 0, "data", trace, 2))
    assert decisions(ledger)["key/kernel"] == axes
    expected = _notes.kv_head_dim_split(2, 32, MESH_AXIS, size, dense=True) if any(axes) else None
    assert ledger.proposal().notes["key/kernel"] == (expected or "kept whole before")
    assert not expected or "output features (2 heads × 16) are split over it" in expected


class _HeadBiases(keras.layers.Layer):
    """Query heads with per-head weights beside them, as XLNet's relative attention reads them."""

    def __init__(self, heads: int = 4, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.layers.EinsumDense("btd,dnh->btnh", (8, heads, 16), name="query")
        self.heads = heads

    def build(self, shape):
        self.query.build(shape)
        self.bias = self.add_weight(shape=(self.heads, 16), name="bias")  # added to the split heads
        self.table = self.add_weight(shape=(2, self.heads, 16), name="table")  # heads: a batch dimension
        self.plain = self.add_weight(shape=(8, 64), name="plain")  # added to the whole input

    def call(self, x):
        q = self.query(x + self.plain) + self.bias
        return keras.ops.einsum("btnh,snh->btns", q, self.table)


def test_beside_split_splits_per_head_weights_with_the_heads_they_meet():
    """The bug it pins: XLNet's per-head biases stayed whole, and XLA all-gathered each (with Adam's
    two slots) after every update: 'model' bytes predicted 0.965 of the compiled step's."""
    inputs = keras.Input((8, 64))
    model = keras.Model(inputs, _HeadBiases(name="attn")(inputs), name="net")
    ledger = Ledger(model.name, MESH_AXIS, "data")
    ledger.record("attn/query/kernel", (None, "model", None), "heads split", unit="attn")
    _by_trace.beside_split(ledger, setting(model, np.zeros((2, 8, 64), "float32")))
    axes = decisions(ledger)
    assert axes["attn/bias"] == ("model", None) and axes["attn/table"] == (None, "model", None)
    assert ledger.unit("attn/bias") == ledger.unit("attn/table") == "attn"
    assert ledger.proposal().notes["attn/bias"] == _notes.beside_split("attn", MESH_AXIS)
    assert not ledger.decided("attn/plain")  # beside the unsplit input: left to the later strategies


def test_named_weights_decide_only_what_is_left():
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(64, 32, name="token_embedding")(tokens)
    model = keras.Model(tokens, keras.layers.LayerNormalization(name="final_norm")(x), name="net")
    ledger = Ledger(model.name, MESH_AXIS, "data")
    ledger.record("final_norm/gamma", (None,), "decided before")
    _by_name.named_weights(ledger, setting(model))
    notes = ledger.proposal().notes
    assert notes["token_embedding/embeddings"].startswith("by name: ")
    assert notes["final_norm/gamma"] == "decided before"


def test_auto_rules_is_the_ordered_list_of_strategies():
    assert [s.__module__.rsplit(".", 1)[1] + "." + s.__name__ for s in STRATEGIES] == [
        "_by_layers.attention_layers",
        "_by_name.attention_blocks",
        "_experts.expert_banks",
        "_by_trace.traced_units",
        "_by_layers.kv_head_dim",
        "_convs.conv_units",
        "_convs.lone_convs",
        "_convs.lone_grouped_convs",
        "_convs.input_convs",
        "_by_trace.final_layers",
        "_by_layers.projection_pairs",
        "_embeddings.vocab_parallel_tables",
        "_embeddings.tied_tables",
        "_by_trace.beside_split",
        "_by_trace.unused_weights",
        "_by_name.named_weights",
        "_by_trace.lone_projections",
        "_lora.lora_adapters",
        "_quantized.int8_scales",
        "_by_trace.left_whole",
        "_grouped_batch.grouped_convs_batch_split",
    ]
    model = mlp(4096)
    ledger = Ledger(model.name, MESH_AXIS, "data")
    s = setting(model, np.zeros((8, 32), "float32"), replicate_below=kml.DEFAULT_REPLICATE_BELOW)
    for strategy in STRATEGIES:
        strategy(ledger, s)
    rules = kml.auto_rules(model, kml.Mesh(data=2, model=4))
    assert [(r.pattern, r.axes, r.note) for r in rules.rules] == ledger.rules()


# -- size: every planner module under 500 lines, every function under 60 lines of code ---------


def _code_lines(function: ast.FunctionDef, lines: list[str]) -> int:
    body = function.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    skip = range(body[0].lineno, body[0].end_lineno + 1) if docstring else range(0)
    return sum(
        1
        for number in range(function.lineno, function.end_lineno + 1)
        if number not in skip and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")
    )


PLANNER = sorted((Path(kml.__file__).parent / "planner").glob("*.py"))


@pytest.mark.parametrize("path", PLANNER, ids=[p.stem for p in PLANNER])
def test_planner_modules_and_functions_stay_small(path):
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 500, f"{path.name} has {len(lines)} lines"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            count = _code_lines(node, lines)
            assert count <= 60, f"{path.name}:{node.lineno} {node.name} has {count} lines of code"


class _Cumulative(keras.layers.Layer):
    """A custom layer whose weight only an operation no strategy knows reads (a cumulative sum)."""

    def build(self, shape):
        self.table = self.add_weight(shape=(shape[-1], 64), name="table")

    def call(self, x):
        return x @ keras.ops.cumsum(self.table, axis=0)


def test_a_weight_no_strategy_splits_plans_replicated_with_the_reason():
    """Issue 19's bad input: an unknown operation still plans, and the note names what read it."""
    inputs = keras.Input((32,))
    model = keras.Model(inputs, _Cumulative(name="odd")(inputs), name="net")
    rules = kml.auto_rules(model, kml.Mesh(data=2, model=4))
    rule = rules.match("odd/table")
    assert rule.axes == (None, None)
    assert rule.note == "replicated: no strategy splits a weight read by cumsum"
