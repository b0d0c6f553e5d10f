"""What fills a device at the predicted peak: the largest buffers live there, named after the JAX operations
that write them (`rules.cost.peak_buffers`, `PeakMemory.buffers`, `plan --batch-size`'s list).

A small keras-hub Gemma language model whose tied table's logits dominate its step: at the walk's
peak (the loss, after the forward pass) the largest buffers are the logits and their gradient,
each `[batch, tokens, vocabulary]` split over the batch axis and, vocab-parallel, over the model axis.
"""

from __future__ import annotations

import math

import hub_models
import jax
import pytest

import keras_meshlayout as kml
from keras_meshlayout.planner._at_peak import AT_PEAK

VOCAB, TOKENS, BATCH, HIDDEN = 4096, 64, 16, 64


def lm():
    config = dict(vocabulary_size=VOCAB, num_layers=1, hidden_dim=HIDDEN, intermediate_dim=128, head_dim=16)
    heads = dict(num_query_heads=4, num_key_value_heads=1)
    return hub_models.causal_lm("GemmaBackbone", TOKENS, "lm", **heads, **config)


def planned(shape: tuple[int, int], target: str | None = None) -> kml.PlanCost:
    mesh = kml.Mesh(data=shape[0], model=shape[1], target=target)
    batch = {n: jax.ShapeDtypeStruct((BATCH, TOKENS), "int32") for n in ("token_ids", "padding_mask")}
    with kml.dry_build(lm) as model:
        return kml.auto_rules(model, mesh, batch=batch, optimizer="adam").cost


#: (mesh, target, the largest buffer at the peak: shape, pass, the mesh axes it is split over).
#: XLA:CPU's walk peaks at the loss, over the float32 logits (the batch over 'data', the vocabulary
#: over 'model'); XLA:TPU's keeps those in vector memory and peaks in the backward pass, over the
#: tied table's gradient (its rows over 'model').
CASES = {
    "2x4": ((2, 4), None, (BATCH, TOKENS, VOCAB), "forward", ("data", "model")),
    "4x2": ((4, 2), None, (BATCH, TOKENS, VOCAB), "forward", ("data", "model")),
    "8x1": ((8, 1), None, (BATCH, TOKENS, VOCAB), "forward", ("data",)),
    "tpu-v5e-2x4": ((2, 4), "tpu-v5e:2x4", (VOCAB, HIDDEN), "backward", ("model",)),
}


@pytest.mark.parametrize(("shape", "target", "largest", "step", "over"), CASES.values(), ids=list(CASES))
def test_the_largest_buffer_at_the_peak_is_named_with_its_shape_and_share(shape, target, largest, step, over):
    cost = planned(shape, target)
    buffers = cost.peak_buffers
    assert 0 < len(buffers) <= AT_PEAK
    assert [b.bytes for b in buffers] == sorted((b.bytes for b in buffers), reverse=True)
    sizes = dict(zip(("data", "model"), shape, strict=True))
    share = math.prod(largest) * 4 // math.prod(sizes[axis] for axis in over)
    assert (buffers[0].shape, buffers[0].dtype, buffers[0].bytes) == (largest, "float32", share)
    assert "token_embedding" in buffers[0].operation
    assert buffers[0].operation.endswith("(backward)") is (step == "backward")
    assert sum(b.bytes for b in buffers) <= cost.peak_bytes


def test_every_buffer_names_its_layer_and_the_pass_that_writes_it():
    buffers = planned((2, 4)).peak_buffers
    for buffer in buffers:
        path, _, primitive = buffer.operation.partition(": ")
        assert path and primitive and "jvp(" not in path, buffer  # JAX's jvp(...) wrappers are gone
    assert any(b.operation.startswith("gemma_backbone/") for b in buffers), buffers
    assert buffers[0].to_dict() == {
        "operation": buffers[0].operation,
        "shape": [BATCH, TOKENS, VOCAB],
        "dtype": "float32",
        "bytes": buffers[0].bytes,
    }


def test_max_poolings_positions_are_named_where_they_fill_the_peak():
    """On XLA:CPU a max pooling reads int32 position arrays as large as its input in the forward pass
    (`planner/_max_pooling.py`): at a pooled convnet's peak they are the largest buffers, named so."""
    import keras

    def pooled() -> keras.Model:
        layers = keras.layers
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                layers.Conv2D(32, 3, padding="same", activation="relu", name="c1"),
                layers.Conv2D(32, 3, padding="same", activation="relu", name="c2"),
                layers.MaxPooling2D(2, name="pool"),
                layers.Conv2D(64, 3, padding="same", activation="relu", name="c3"),
                layers.GlobalAveragePooling2D(),
                layers.Dense(10, name="head"),
            ],
            name="pooled",
        )

    with kml.dry_build(pooled) as model:
        x = jax.ShapeDtypeStruct((8, 32, 32, 3), "float32")
        cost = kml.auto_rules(model, kml.Mesh(data=2, model=4), batch=x, optimizer="adam").cost
    largest = cost.peak_buffers[0]
    assert largest.operation == "pool: reduce_window_max (the windows' positions)"
    assert (largest.shape, largest.dtype) == ((4, 8, 32, 32, 32), "int32")
    assert largest.bytes == 4 * 8 * 32 * 32 * 32 * 4 // 2  # four positions an element, the batch over 'data'
