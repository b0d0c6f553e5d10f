"""How much of a memory budget a plan keeps free for the predicted peak's error (`planner/_headroom.py`).

A convnet's peak is predicted less closely than a dense model's (keras.applications at 224 x 224,
`benchmarks/convnet_peaks.py`: 0.76-1.25 of XLA:CPU's compiled peak, 0.64-1.10 of XLA:TPU's), so a
budget plan for one keeps more free: 30%, and on a TPU target 40% and 64 MiB at least.
"""

from __future__ import annotations

import contextlib
import math
import re

import jax
import keras
import pytest
from helpers import build_convnet

import keras_meshlayout as kml
from keras_meshlayout.planner._auto import plan_rules
from keras_meshlayout.planner._headroom import Headroom, peak_headroom
from keras_meshlayout.planner._peak import is_convnet
from keras_meshlayout.planner._trace import trace_step

MiB = 2**20
AT_LEAST = "(at least 64.0 MiB)"


@pytest.mark.parametrize(
    ("compiler", "convnet", "share", "spare"),
    [("cpu", False, 0.05, 0), ("tpu", False, 0.27, 0), ("cpu", True, 0.30, 0), ("tpu", True, 0.40, 64 * MiB)],
)
def test_each_compiler_and_kind_of_step_keeps_its_headroom(compiler, convnet, share, spare):
    assert peak_headroom(compiler, convnet) == Headroom(share, spare)


@pytest.mark.parametrize(
    ("headroom", "budget", "usable", "peak", "needed", "text"),
    [
        (Headroom(0.05), 1000, 950, 950, 1000, "5% headroom"),
        (Headroom(0.40), 1000, 600, 600, 1000, "40% headroom"),
        # The spare bytes decide where they are more than the share: a small budget.
        (Headroom(0.40, 64 * MiB), 100 * MiB, 36 * MiB, 36 * MiB, 100 * MiB, f"40% headroom {AT_LEAST}"),
        (Headroom(0.40, 64 * MiB), 1000 * MiB, 600 * MiB, 600 * MiB, 1000 * MiB, f"40% headroom {AT_LEAST}"),
    ],
)
def test_the_usable_budget_and_the_budget_needed_are_inverse(headroom, budget, usable, peak, needed, text):
    assert headroom.usable(budget) == usable
    assert headroom.needed(peak) == needed
    assert str(headroom) == text


def _patch_embedding() -> keras.Model:
    """A vision transformer's stem: one convolution, then tokens."""
    images = keras.Input((16, 16, 3))
    patches = keras.layers.Conv2D(32, 4, strides=4, name="patches")(images)
    tokens = keras.layers.Reshape((16, 32))(patches)
    tokens = keras.layers.Dense(32, name="mlp")(tokens)
    return keras.Model(images, keras.layers.Dense(10, name="head")(keras.ops.mean(tokens, axis=1)))


def _text_conv() -> keras.Model:
    """A depthwise conv1d over tokens (as Qwen 3.5's mixer): one spatial dimension."""
    tokens = keras.Input((16, 32))
    mixed = keras.layers.DepthwiseConv1D(4, padding="same", name="mixer")(tokens)
    mixed = keras.layers.Conv1D(32, 1, name="pointwise")(mixed)
    return keras.Model(tokens, keras.layers.Dense(10, name="head")(keras.ops.mean(mixed, axis=1)))


def _mlp() -> keras.Model:
    return keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(10)])


@pytest.mark.parametrize(
    ("build", "shape", "expected"),
    [
        (build_convnet, (8, 8, 8, 3), True),
        (_patch_embedding, (8, 16, 16, 3), False),
        (_text_conv, (8, 16, 32), False),
        (_mlp, (8, 32), False),
    ],
    ids=["convnet", "patch-embedding", "conv1d", "mlp"],
)
def test_a_convnet_is_two_image_convolutions_or_more(build, shape, expected):
    with kml.dry_build(build) as model:
        trace = trace_step(model, jax.ShapeDtypeStruct(shape, "float32"))
    assert is_convnet(trace) is expected


@pytest.mark.parametrize(
    ("target", "text"), [(None, "30% headroom"), ("tpu-v5e:2x4", "40% headroom (at least 64.0 MiB)")]
)
def test_a_convnets_budget_plan_keeps_its_headroom_and_names_the_budget_it_needs(target, text):
    """The smallest plan's predicted peak with 10% to spare is refused; the budget the error names
    is that peak over the convnet's headroom, and a plan made within it keeps that headroom."""
    mesh = kml.Mesh(data=2, model=4, target=target) if target else kml.Mesh(data=2, model=4)
    x = jax.ShapeDtypeStruct((16, 8, 8, 3), "float32")
    headroom = peak_headroom("tpu" if target else "cpu", convnet=True)
    warned = pytest.warns(kml.MeshLayoutWarning, match="a convnet's step is an estimate")
    with kml.dry_build(build_convnet) as model, warned if target else contextlib.nullcontext():
        least = plan_rules(model, mesh, batch=x, optimizer="adam", fully_sharded=True).cost.peak_bytes
        with pytest.raises(kml.MemoryBudgetError, match=f"with the {re.escape(text)}") as refused:
            kml.auto_rules(model, mesh, memory_budget=int(least / 0.90), batch=x, optimizer="adam")
        needed = refused.value.smallest_bytes
        assert needed == headroom.needed(least)
        assert needed == (least + 64 * MiB if target else math.ceil(least / 0.70))
        rules = kml.auto_rules(model, mesh, memory_budget=needed, batch=x, optimizer="adam")
    assert rules.cost.peak_bytes <= headroom.usable(needed)


def test_a_resnet50_budget_plan_at_224_x_224_fits_once_compiled():
    """keras.applications ResNet50 at 224 x 224 (16 images on 2x4): the smallest plan's peak is
    predicted at 0.773 of XLA:CPU's compiled one (0.735 before max pooling's positions were walked,
    `planner/_max_pooling.py`; the rest is transposed copies of activations held from the forward
    pass to the backward, not walked: docs/status.md). With 5% to spare, the plan said to fit the
    budget the planner named would compile to 1.23 times it; with the convnet's 30%, to 0.91."""

    def build():
        return keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=10)

    mesh = kml.Mesh(data=2, model=4)
    x, y = jax.ShapeDtypeStruct((16, 224, 224, 3), "float32"), jax.ShapeDtypeStruct((16,), "int32")
    with kml.dry_build(build) as model:
        with pytest.raises(kml.MemoryBudgetError, match="30% headroom") as refused:
            kml.auto_rules(model, mesh, memory_budget=1, batch=x, optimizer="adam")
        budget = refused.value.smallest_bytes
        rules = kml.auto_rules(model, mesh, memory_budget=budget, batch=x, optimizer="adam")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    assert rules.cost.peak_bytes / step.peak_bytes == pytest.approx(0.773, abs=0.01)  # the miss, pinned
    assert step.peak_bytes <= budget
