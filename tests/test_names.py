"""The planner's name vocabulary on real keras-hub backbones.

For each backbone whose weights `auto_rules` used to leave unsplit (Dense
`q_proj`-style attention, T5's `*_projector`, Falcon's `dense_h_to_4h`, Bloom's
`mlp_output_dense`, ESM's `q_dense_layer`, GPT-NeoX's fused `query_key_value`),
a tiny copy is planned on a 2×4 mesh: the table says which layers split over
`model`, and two `model.fit` steps under the plan must equal single-device
training.
"""

from __future__ import annotations

import inspect

import keras
import keras_hub
import numpy as np
import pytest
from helpers import Reference, assert_laid_out_as_planned, assert_same_weights, train

import keras_meshlayout as kml

BATCH = 16
LENGTH = 8

#: Tiny sizes: 4 query heads, 2 key/value heads where the backbone has them.
TINY = dict(
    vocabulary_size=128,
    num_layers=2,
    num_heads=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_dim=64,
    intermediate_dim=128,
    head_size=16,
    max_sequence_length=32,
    max_position_embeddings=32,
    dropout=0.0,
    attention_dropout=0.0,
    attention_bias=False,
    mlp_bias=False,
    layer_norm_epsilon=1e-6,
    rope_theta=10000.0,
    partial_rotary_factor=1.0,
    rope_layer_enabled_list=[True, True],
    layer_types=["attention", "attention"],
)

COLUMN, ROW = (None, "model"), ("model", None)
HEADS_IN, HEADS_OUT = (None, "model", None), ("model", None, None)

#: Backbone → {layer/variable: layout} of every variable split over `model`; all others replicated.
VOCAB = ("model", None)  # a table read by one look-up: its rows split over 'model'

SPLITS = {
    "SmolLM": {
        "token_embedding/embeddings": VOCAB,  # vocab-parallel (issue 19)
        "q_proj/kernel": COLUMN,  # 4 heads: split; k_proj/v_proj: 2 key/value heads, kept whole
        "o_proj/kernel": HEADS_OUT,
        "gate_proj/kernel": COLUMN,
        "up_proj/kernel": COLUMN,
        "down_proj/kernel": ROW,
    },
    "T5": {
        "token_embedding/embeddings": VOCAB,  # read by encoder and decoder: vocab-parallel (issue 19)
        "query_projector/kernel": COLUMN,
        "key_projector/kernel": COLUMN,
        "value_projector/kernel": COLUMN,
        "output_projector/kernel": ROW,  # the attention output and the feed-forward output
        "input_projector/kernel": COLUMN,
        "gate_projector/kernel": COLUMN,
    },
    "Falcon": {
        "token_embedding/embeddings": VOCAB,  # vocab-parallel (issue 19)
        **{f"{name}_dense/kernel": HEADS_IN for name in ("query", "key", "value")},
        **{f"{name}_dense/bias": ROW for name in ("query", "key", "value")},
        "output_dense/kernel": ROW,
        "dense_h_to_4h/kernel": COLUMN,
        "dense_h_to_4h/bias": ("model",),
        "dense_4h_to_h/kernel": ROW,
    },
    "Bloom": {
        "token_embedding/embeddings": VOCAB,  # vocab-parallel (issue 19)
        **{f"{name}_dense/kernel": HEADS_IN for name in ("query", "key", "value")},
        **{f"{name}_dense/bias": ROW for name in ("query", "key", "value")},
        "output_dense/kernel": ROW,
        "mlp_intermediate_dense/kernel": COLUMN,
        "mlp_intermediate_dense/bias": ("model",),
        "mlp_output_dense/kernel": ROW,
    },
    "ESM": {
        "token_embedding/embeddings": VOCAB,  # vocab-parallel (issue 19)
        **{f"{name}_dense_layer/kernel": COLUMN for name in "qkv"},
        **{f"{name}_dense_layer/bias": ("model",) for name in "qkv"},
        "o_dense_layer/kernel": ROW,
        "feedforward_intermediate_dense/kernel": COLUMN,
        "feedforward_intermediate_dense/bias": ("model",),
        "feedforward_output_dense/kernel": ROW,
    },
    "RoformerV2": {
        "token_embedding/embeddings": VOCAB,  # vocab-parallel (issue 19)
        **{f"{name}_dense_layer/kernel": COLUMN for name in "qkv"},
        "o_dense_layer/kernel": ROW,
        "feedforward_intermediate_dense/kernel": COLUMN,
        "feedforward_output_dense/kernel": ROW,
    },
    "GPTNeoX": {
        "token_embedding/embeddings": VOCAB,  # vocab-parallel (issue 19)
        "query_key_value/kernel": HEADS_IN,  # (hidden, heads, 3 × head_dim): heads on their own axis
        "query_key_value/bias": ROW,
        "attention_output/kernel": ROW,
        "feedforward_intermediate_dense/kernel": COLUMN,
        "feedforward_intermediate_dense/bias": ("model",),
        "feedforward_output_dense/kernel": ROW,
    },
}

#: Inputs beyond token ids, by backbone: name → what to fill.
EXTRA_INPUTS = {
    "padding_mask": lambda ids: np.ones_like(ids),
    "segment_ids": lambda ids: np.zeros_like(ids),
}


def build_backbone(name: str) -> keras.Model:
    cls = getattr(keras_hub.models, f"{name}Backbone")
    params = inspect.signature(cls.__init__).parameters
    return cls(**{key: value for key, value in TINY.items() if key in params})


def build_classifier(name: str) -> keras.Model:
    """The backbone, mean-pooled, under a small classifier head: every variable named."""
    backbone = build_backbone(name)
    inputs = {key: keras.Input((LENGTH,), dtype="int32", name=key) for key in backbone.input}
    outputs = backbone(inputs)
    if isinstance(outputs, dict):  # T5: encoder and decoder sequences
        outputs = keras.layers.Concatenate(axis=1, name="sequences")(
            [outputs[key] for key in sorted(outputs)]
        )
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(outputs)
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled), name="classifier")


def data_for(model: keras.Model, count: int = BATCH * 2) -> tuple[dict, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 128, size=(count, LENGTH)).astype("int32")
    x = {}
    for key in model.input:
        fill = next((make for suffix, make in EXTRA_INPUTS.items() if key.endswith(suffix)), None)
        x[key] = ids if fill is None else fill(ids).astype("int32")
    return x, rng.integers(0, 10, size=count).astype("int32")


@pytest.fixture(scope="module")
def mesh() -> kml.Mesh:
    return kml.Mesh(data=2, model=4)


# keras-hub's T5 layers build inside their own call and drop a mask, which Keras flags at build time.
@pytest.mark.filterwarnings(r"ignore:.*'transformer_(en|de)coder_layer_\d+'.*unbuilt state:UserWarning")
@pytest.mark.filterwarnings(
    r"ignore:Layer '\w+' \(of type T5MultiHeadAttention\) was passed an input with a mask"
)
@pytest.mark.parametrize(
    "name",
    [
        # T5's layer norms are auto-named (`t5_layer_norm`, `t5_layer_norm_1`, ...), so a
        # second build names them anew and the probe's rules for them match nothing.
        pytest.param(name, marks=pytest.mark.filterwarnings("ignore::keras_meshlayout.UnmatchedRuleWarning"))
        if name == "T5"
        else name
        for name in sorted(SPLITS)
    ],
)
def test_backbone_splits_by_name_and_trains_like_one_device(name, mesh):
    build = lambda: build_classifier(name)  # noqa: E731
    probe = build()
    rules = kml.auto_rules(probe, mesh)
    split = {}
    for variable in probe.weights:
        rule = rules.match(variable.path)
        if rule is None:
            continue  # buffers and weights no planner step touches (rotary frequencies): replicated
        assert rule.note, variable.path
        if "model" in rule.axes:
            split["/".join(variable.path.split("/")[-2:])] = rule.axes
    assert split == SPLITS[name]

    data = data_for(probe)
    reference = Reference(build, data, BATCH, initial=probe.get_weights())  # one build fewer
    distribution = kml.ModelParallel(mesh, rules, replicate_below=0)
    model = train(build, reference.initial, data, distribution, BATCH)
    assert_same_weights(model, reference.trained)
    assert_laid_out_as_planned(model, distribution.plan(model), mesh)


def test_grouped_query_dense_projections_keep_their_output_whole(mesh):
    """SmolLM's Dense k_proj/v_proj hold 2 key/value heads: replicated, with outputs kept whole."""
    rules = kml.auto_rules(build_backbone("SmolLM"), mesh)
    key = rules.match("transformer_layer_0/self_attn/k_proj/kernel")
    assert key.axes == (None, None) and "2 key/value heads" in key.note
    assert rules.match("transformer_layer_0/self_attn/k_proj/output").axes == ("data", None, None)
    assert rules.match("transformer_layer_0/self_attn/q_proj/kernel").note == (
        "attention q_proj: heads split (4 heads of 16, output features)"
    )


@pytest.mark.parametrize(
    "path, note",
    [
        (
            "mixtral_block_0/mixtral_sparse_moe_block/experts/expert_feedforward_gate_dense",
            "mixture-of-experts",
        ),
        ("transformer_layer_0/sparse_moe_block/experts/gate_up_proj", "mixture-of-experts"),
        ("rwkv_layer_0/RWKV_TIME_MIX/receptance/kernel", "RWKV"),
        ("rwkv_layer_0/RWKV_CMIX/dense_k/kernel", "RWKV"),
    ],
    ids=["mixtral-experts", "gpt-oss-experts", "rwkv-time-mix", "rwkv-channel-mix"],
)
def test_expert_and_rwkv_weights_are_replicated_with_a_note(path, note):
    rule = kml.transformer_rules().match(path)
    assert rule.expand(3) == (None, None, None) and rule.note.startswith(note)
