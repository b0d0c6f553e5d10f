"""Tiny keras-hub text backbones for the hub tests: one table row per backbone class.

Every row builds from a config alone (no download): vocabulary 128, 2 layers,
hidden 64, 4 query heads (2 key/value heads where the class takes them),
intermediate 128, and dropout 0 everywhere, since dropout would make sharded
and single-device training differ.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import keras
import keras_hub
import numpy as np
import pytest

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128
LAYERS = 2
MAX_LENGTH = 32
BATCH = 8
LENGTH = 8
CLASSES = 10

_BASE = dict(vocabulary_size=VOCAB, num_layers=LAYERS, hidden_dim=HIDDEN, intermediate_dim=INTERMEDIATE)
_ENCODER = dict(_BASE, num_heads=HEADS, dropout=0.0, max_sequence_length=MAX_LENGTH)
_GQA = dict(_BASE, num_query_heads=HEADS, num_key_value_heads=KV_HEADS, dropout=0.0)
_T5GEMMA = dict(
    vocabulary_size=VOCAB,
    encoder_hidden_dim=HIDDEN,
    encoder_intermediate_dim=INTERMEDIATE,
    encoder_num_layers=LAYERS,
    encoder_num_attention_heads=HEADS,
    encoder_num_key_value_heads=KV_HEADS,
    encoder_head_dim=HEAD_DIM,
    encoder_layer_types=["full_attention"] * LAYERS,
    decoder_hidden_dim=HIDDEN,
    decoder_intermediate_dim=INTERMEDIATE,
    decoder_num_layers=LAYERS,
    decoder_num_attention_heads=HEADS,
    decoder_num_key_value_heads=KV_HEADS,
    decoder_head_dim=HEAD_DIM,
    decoder_layer_types=["full_attention"] * LAYERS,
    dropout_rate=0.0,
    attention_dropout=0.0,
)

#: Qwen 3.5's gated delta-net layers, then one full-attention layer.
_LINEAR_ATTENTION = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=KV_HEADS,
    linear_num_value_heads=HEADS,
    linear_key_head_dim=HEAD_DIM,
    linear_value_head_dim=HEAD_DIM,
)


@dataclasses.dataclass(frozen=True, eq=False)
class Row:
    """One backbone class and the config of its tiny instance."""

    name: str
    config: dict[str, Any]

    @property
    def cls(self) -> type:
        return getattr(keras_hub.models, self.name)

    def __str__(self) -> str:
        return self.name


ROWS = [
    Row("AlbertBackbone", dict(_ENCODER, embedding_dim=HIDDEN)),
    Row("BartBackbone", _ENCODER),
    Row("BertBackbone", _ENCODER),
    Row("BloomBackbone", dict(_BASE, num_heads=HEADS, dropout=0.0)),
    Row("DebertaV3Backbone", dict(_ENCODER, bucket_size=8)),
    Row("DistilBertBackbone", _ENCODER),
    Row("ESMBackbone", _ENCODER),
    Row(
        "EdRecBackbone",
        dict(
            vocab_size=VOCAB,
            num_layers_enc=LAYERS,
            num_layers_dec=LAYERS,
            hidden_dim=HIDDEN,
            intermediate_dim=INTERMEDIATE,
            num_heads=HEADS,
            dropout=0.0,
        ),
    ),
    Row(
        "ElectraBackbone",
        dict(
            vocab_size=VOCAB,
            num_layers=LAYERS,
            num_heads=HEADS,
            hidden_dim=HIDDEN,
            embedding_dim=HIDDEN,
            intermediate_dim=INTERMEDIATE,
            dropout=0.0,
            max_sequence_length=MAX_LENGTH,
        ),
    ),
    Row("FNetBackbone", dict(_BASE, dropout=0.0, max_sequence_length=MAX_LENGTH)),
    Row(
        "FalconBackbone",
        dict(_BASE, num_attention_heads=HEADS, attention_dropout_rate=0.0, feedforward_dropout_rate=0.0),
    ),
    Row("GPT2Backbone", _ENCODER),
    Row("GPTNeoXBackbone", _ENCODER),
    Row("GemmaBackbone", dict(_GQA, head_dim=HEAD_DIM)),
    Row("Gemma3Backbone", dict(_GQA, head_dim=HEAD_DIM, image_size=16)),
    Row("Gemma4Backbone", dict(_GQA, head_dim=HEAD_DIM, image_size=16, sliding_window_size=LENGTH)),
    Row("GptOssBackbone", dict(_GQA, num_experts=4, top_k=2, head_dim=HEAD_DIM, sliding_window=LENGTH)),
    Row("LlamaBackbone", _GQA),
    Row("Llama3Backbone", _GQA),
    Row("MistralBackbone", _GQA),
    Row("MixtralBackbone", dict(_GQA, num_experts=4, top_k=2)),
    Row("OPTBackbone", _ENCODER),
    Row("Phi3Backbone", _GQA),
    Row("QwenBackbone", _GQA),
    Row("Qwen3Backbone", dict(_GQA, head_dim=HEAD_DIM)),
    Row("Qwen3MoeBackbone", dict(_GQA, head_dim=HEAD_DIM, moe_intermediate_dim=32, num_experts=4, top_k=2)),
    Row("Qwen3_5Backbone", dict(_GQA, head_dim=HEAD_DIM, **_LINEAR_ATTENTION)),
    Row(
        "Qwen3_5MoeBackbone",
        dict(
            {k: v for k, v in _GQA.items() if k != "intermediate_dim"},
            head_dim=HEAD_DIM,
            moe_intermediate_dim=32,
            shared_expert_intermediate_size=64,
            num_experts=4,
            top_k=2,
            **_LINEAR_ATTENTION,
        ),
    ),
    Row(
        "QwenMoeBackbone",
        dict(_GQA, moe_intermediate_dim=32, shared_expert_intermediate_dim=64, num_experts=4, top_k=2),
    ),
    Row(
        "RWKV7Backbone",
        dict(
            hidden_size=HIDDEN,
            head_size=HEAD_DIM,
            num_layers=LAYERS,
            vocabulary_size=VOCAB,
            intermediate_dim=INTERMEDIATE,
            gate_lora=16,
            mv_lora=16,
            aaa_lora=16,
            decay_lora=16,
            dropout_rate=0.0,
        ),
    ),
    Row("RobertaBackbone", _ENCODER),
    Row(
        "RoformerV2Backbone",
        dict(_BASE, num_heads=HEADS, head_size=HEAD_DIM, dropout=0.0),
    ),
    Row(
        "SmolLM3Backbone",
        dict(
            vocabulary_size=VOCAB,
            hidden_dim=HIDDEN,
            intermediate_dim=INTERMEDIATE,
            num_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            attention_bias=False,
            attention_dropout=0.0,
            rope_layer_enabled_list=[True, False],
            layer_types=["attention"] * LAYERS,
            mlp_bias=False,
            layer_norm_epsilon=1e-6,
            max_position_embeddings=MAX_LENGTH,
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
        ),
    ),
    Row("T5Backbone", dict(_BASE, num_heads=HEADS, key_value_dim=HEAD_DIM, dropout=0.0)),
    Row("T5GemmaBackbone", _T5GEMMA),
    Row("T5Gemma2Backbone", _T5GEMMA),
    Row("XLMRobertaBackbone", _ENCODER),
    Row("XLNetBackbone", dict(_BASE, num_heads=HEADS, dropout=0.0)),
]


def marks(row: Row) -> list:
    """The warning filters a row's builds need (warnings are errors in the tests)."""
    found = []
    if row.name == "RWKV7Backbone":
        # keras-hub warns, at every build, that its optional CUDA kernels are not installed.
        found.append(pytest.mark.filterwarnings("ignore:The 'rwkv_ops' package is not installed"))
    if row.name == "T5Backbone":
        # keras-hub's T5 feeds a masked embedding into its attention layer, which drops the mask.
        found.append(pytest.mark.filterwarnings("ignore:Layer '(self|cross)_attention' .* mask attached"))
    return found


def fresh_names(build: Callable[[], keras.Model]) -> Callable[[], keras.Model]:
    """`build`, with Keras's auto-generated layer names restarted: every build gets the same paths.

    Some keras-hub backbones (T5, T5Gemma, Mixtral, the Qwen MoEs) leave layer
    names to Keras, which numbers them globally; the auto rules match exact paths.
    """
    from keras.src.backend.common import global_state

    @functools.wraps(build)
    def wrapped():
        global_state.set_global_attribute("object_name_uids", None)
        return build()

    return wrapped


def build_backbone(row: Row) -> keras.Model:
    return row.cls(**row.config, name="backbone")


def build_classifier(row: Row) -> keras.Model:
    """The backbone, mean-pooled, under a small classifier head."""
    backbone = build_backbone(row)
    inputs = {
        name: keras.Input(tensor.shape[1:], dtype=tensor.dtype, name=name)
        for name, tensor in backbone.input.items()
    }
    outputs = backbone(inputs)
    if isinstance(outputs, dict):
        key = next(k for k in ("sequence_output", "decoder_sequence_output") if k in outputs)
        outputs = outputs[key]
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(outputs)
    logits = keras.layers.Dense(CLASSES, name="classifier_head")(pooled)
    return keras.Model(inputs, logits, name="classifier")


def causal_lm(cls: str, length: int, name: str = "lm", **config: Any) -> keras.Model:
    """keras-hub's backbone `cls` built from `config` under its token table's reverse (`reverse=True`,
    its output table, tied or not), as a causal language model runs it over `length` tokens."""
    backbone = getattr(keras_hub.models, cls)(dropout=0.0, **config)
    inputs = {n: keras.Input((length,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    return keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True), name=name)


def inputs_for(model: keras.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """Token ids, all-ones padding masks, zero segment ids and positions for the model's inputs."""
    rng = np.random.default_rng(seed)
    data = {}
    for name, tensor in model.input.items():
        shape = (BATCH, LENGTH)
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        if "padding_mask" in name:
            data[name] = np.ones(shape, dtype)
        elif "segment_ids" in name:
            data[name] = np.zeros(shape, dtype)
        elif "position_ids" in name:
            data[name] = np.broadcast_to(np.arange(LENGTH, dtype=dtype), shape).copy()
        elif "token_ids" in name:
            data[name] = rng.integers(1, VOCAB, size=shape).astype(dtype)
        else:
            raise ValueError(f"no data recipe for the input {name!r} of {model.name}")
    return data
