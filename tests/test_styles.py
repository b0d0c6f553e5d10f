"""The planner reads the computation, not how it was written.

One transformer block and one MLP (`tests/styles.py`), each written in the
styles Keras users write: functional layers, Sequential, a subclassed
`keras.Model` (and one whose `build()` leaves its layers to the first call),
custom layers with `add_weight` + `ops.matmul`, and
`keras.ops`/operators (`ops.silu(g) * u`, `ops.einsum` attention). Every style
of a family must get the same layouts (up to paths) and the same predicted
bytes, keep parameters per device near the tensor-parallel ideal, and train
sharded equal to one device.
"""

import math

import keras
import numpy as np
import pytest
import styles
from helpers import Reference, assert_laid_out_as_planned, assert_same_weights, train

import keras_meshlayout as kml

FAMILIES = {"block": styles.BLOCKS, "mlp": styles.MLPS}
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}
CASES = [(family, style) for family, builders in FAMILIES.items() for style in builders]
CASE_IDS = [f"{family}-{style}" for family, style in CASES]


def mesh_of(name: str) -> kml.Mesh:
    data, model = MESHES[name]
    return kml.Mesh(data=data, model=model)


def data(family: str, size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if family == "block":
        x = rng.integers(0, styles.VOCAB, (size, styles.LENGTH)).astype("int32")
    else:
        x = rng.normal(size=(size, styles.FEATURES)).astype("float32")
    return x, rng.integers(0, styles.CLASSES, size).astype("int32")


def build(family: str, style: str) -> keras.Model:
    keras.distribution.set_distribution(None)
    return FAMILIES[family][style]()


def layouts(model: keras.Model, rules: kml.LayoutRules) -> list[tuple[tuple[int, ...], tuple]]:
    """Each weight's shape and axes, in creation order: the plan up to paths."""
    out = []
    for variable in model.weights:
        rule = rules.match(variable.path)
        axes = (None,) * len(variable.shape) if rule is None else rule.expand(len(variable.shape))
        out.append((tuple(variable.shape), tuple(axes)))
    return out


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_style_gets_the_same_layouts(family, mesh_name):
    plans = {}
    for style in FAMILIES[family]:
        model = build(family, style)
        plans[style] = layouts(model, kml.auto_rules(model, mesh_of(mesh_name), replicate_below=0))
    first = next(iter(plans.values()))
    assert sum("model" in axes for _, axes in first) >= 4  # the plan splits both units
    for style, plan in plans.items():
        assert plan == first, style


def smallest_budget(model: keras.Model, mesh: kml.Mesh, x: np.ndarray) -> int:
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.auto_rules(model, mesh, replicate_below=0, memory_budget=1, batch=x, optimizer="adam")
    return error.value.smallest_bytes


@pytest.mark.parametrize("budget", ["none", "smallest"])
@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_style_gets_the_same_predicted_bytes(family, mesh_name, budget):
    costs = {}
    x, _ = data(family)
    mesh = mesh_of(mesh_name)
    for style in FAMILIES[family]:
        model = build(family, style)
        limit = None if budget == "none" else smallest_budget(model, mesh, x)
        rules = kml.auto_rules(model, mesh, replicate_below=0, memory_budget=limit, batch=x, optimizer="adam")
        cost = rules.cost
        costs[style] = (dict(cost.wire_bytes_by_axis), cost.state_bytes, cost.activation_bytes, limit)
    first = next(iter(costs.values()))
    assert first[0].get("model", 0) > 0  # activations are all-reduced over the model axis
    peak = first[1] + first[2]
    for style, (wire, state, activations, limit) in costs.items():
        assert (wire, state) == first[:2], style
        # The peak is walked over each style's own traced step (issue 21): a custom layer's
        # `add_weight` + `ops.matmul` traces to other buffers than a Dense layer (measured: up to 8%
        # of the peak apart), so the activations and the smallest budget agree to the prediction's
        # own band, 10% of the peak; the plan itself (bytes sent, state) is the same.
        assert abs(activations - first[2]) <= 0.1 * peak, style
        assert limit is None or abs(limit - first[3]) <= 0.1 * peak, style


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize(("family", "style"), CASES, ids=CASE_IDS)
def test_parameters_per_device_near_the_tensor_parallel_ideal(family, style, mesh_name):
    """No budget: parameters per device within 1.5x of the total over the model axis."""
    mesh = mesh_of(mesh_name)
    model = build(family, style)
    rules = kml.auto_rules(model, mesh, replicate_below=0)
    size = mesh.axis_sizes["model"]
    total = per_device = 0
    for shape, axes in layouts(model, rules):
        count = math.prod(shape)
        total += count
        per_device += count // (size if "model" in axes else 1)
    assert per_device <= 1.5 * total / size, (per_device, total / size)


def called(family: str, style: str) -> keras.Model:
    """The model built by a call, as `fit` builds it: the lazy style has no weight before (to load)."""
    model = FAMILIES[family][style]()
    if style.endswith("_lazy"):
        model(data(family, 2)[0])
    return model


@pytest.mark.parametrize(("family", "style"), CASES, ids=CASE_IDS)
def test_each_style_trains_sharded_like_one_device(family, style):
    keras.distribution.set_distribution(None)
    reference = Reference(lambda: called(family, style), data(family))
    mesh = mesh_of("2x4")
    rules = kml.auto_rules(build(family, style), mesh, replicate_below=0)  # the lazy one built by the planner
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    model = train(lambda: called(family, style), reference.initial, data(family), distribution=dist)
    keras.distribution.set_distribution(None)
    assert_laid_out_as_planned(model, dist.plan(model), mesh)
    assert_same_weights(model, reference.trained)


@pytest.mark.parametrize(
    ("mesh_name", "query", "key"),
    [("2x4", (None, "model"), (None, None)), ("4x2", (None, "model"), (None, "model"))],
    ids=["2-kv-heads-on-model-4", "2-kv-heads-on-model-2"],
)
def test_grouped_query_heads_in_a_custom_layer(mesh_name, query, key):
    """Key/value heads that do not divide stay whole beside split query heads, with the reason."""
    model = styles.grouped_query()
    rules = kml.auto_rules(model, mesh_of(mesh_name), replicate_below=0)
    assert rules.match("gqa/block/wq").axes == query
    assert rules.match("gqa/block/wo").axes == ("model", None)
    assert rules.match("gqa/block/wk").axes == key == rules.match("gqa/block/wv").axes
    if key == (None, None):
        note = rules.match("gqa/block/wk").note
        assert "grouped-query attention: key/value heads too few to divide" in note


def test_grouped_query_custom_layer_trains_like_one_device():
    reference = Reference(styles.grouped_query, data("block"))
    mesh = mesh_of("2x4")
    rules = kml.auto_rules(styles.grouped_query(), mesh, replicate_below=0)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    model = train(styles.grouped_query, reference.initial, data("block"), distribution=dist)
    keras.distribution.set_distribution(None)
    assert_same_weights(model, reference.trained)


# The split dimension's blocks through a reshape: heads merged or split, and cuts that would mix them.
RESHAPES = [
    ((2, 8, 32), (2, 8, 4, 8), 2, 4, 2),  # features into 4 heads of 8: the heads split
    ((2, 8, 32), (2, 8, 4, 8), 2, 8, None),  # 4 heads cannot split 8 ways
    ((2, 8, 4, 8), (2, 8, 32), 2, 4, 2),  # heads merged back into features
    ((2, 8, 4, 8), (2, 8, 32), 3, 4, None),  # the head dimension is not the major one
    ((2, 8, 2, 8), (2, 8, 16), 2, 4, None),  # 2 key/value heads on 4 devices
    ((16, 64), (16, 8, 8), 1, 4, 1),
]


@pytest.mark.parametrize(
    ("before", "after", "dim", "size", "expected"),
    RESHAPES,
    ids=["split-heads", "too-few-heads", "merge-heads", "minor-dim", "kv-heads", "rank-2"],
)
def test_a_reshape_keeps_the_split_blocks(before, after, dim, size, expected):
    from keras_meshlayout.planner._grower import _reshape_dim

    assert _reshape_dim(before, after, dim, size) == expected


def test_the_hand_offs_are_immutable():
    """Each stage hands the next a frozen value: nothing downstream can change the trace or a unit."""
    import dataclasses

    from keras_meshlayout.planner import find_units, trace_model

    model = styles.mlp_sequential()
    trace = trace_model(model, np.zeros((4, styles.FEATURES), "float32"))
    (unit, *_) = find_units(trace, 4)
    for value, field in ((trace, "nodes"), (unit, "members"), (unit.members[0], "dim")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
    with pytest.raises(TypeError):
        trace.uses["x"] = ()  # read-only mappings


# Fully sharded (ZeRO-3/FSDP, issue 11, item 2): under the smallest budget, weights outside every
# unit (norm scales and offsets, row biases, the small head's kernel) are split over the batch and
# model axes together, (("data", "model"), ...), and gathered over both when used; the embedding's
# vocabulary over (("model", "data"), None); the rest takes 2-D, column biases split over
# (("model", "data"),) beside their kernels. State per device against total ÷ 8, measured: the
# block 1.002 (2×4) and 1.004 (4×2), the MLP 1.008 and 1.017, in every style (before one
# dimension could take several axes: 1.145/1.090 and 1.167/1.147; before fully sharded:
# 1.26-1.41). What is left above the floor: the head's 10-element bias, which divides by neither
# 8 nor 4, and the scalars (Adam's step counter). The issue asks for 1.1; the bound is tighter.
FLOOR_BOUND = 1.05


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize(("family", "style"), CASES, ids=CASE_IDS)
def test_smallest_plan_near_the_fully_sharded_floor(family, style, mesh_name):
    from keras_meshlayout.core._memory import slot_model

    model = build(family, style)
    mesh = mesh_of(mesh_name)
    x, _ = data(family)
    budget = smallest_budget(model, mesh, x)
    rules = kml.auto_rules(model, mesh, replicate_below=0, memory_budget=budget, batch=x, optimizer="adam")
    memory = slot_model("adam")
    total = memory.scalar_bytes + sum(
        memory.state_bytes(tuple(v.shape), str(v.dtype), 1, v.trainable) for v in model.weights
    )
    assert "fully sharded" in rules.cost.layouts()
    assert rules.cost.state_bytes <= FLOOR_BOUND * total / 8, rules.cost.state_bytes / (total / 8)


@pytest.mark.parametrize(
    ("family", "style", "mesh_name"),
    [("block", "functional", "2x4"), ("block", "operators", "4x2"), ("mlp", "subclassed", "4x2")],
    ids=["block-functional-2x4", "block-operators-4x2", "mlp-subclassed-4x2"],
)
def test_smallest_plan_trains_like_one_device(family, style, mesh_name):
    reference = Reference(lambda: build(family, style), data(family))
    mesh = mesh_of(mesh_name)
    x, _ = data(family)
    probe = build(family, style)
    budget = smallest_budget(probe, mesh, x)
    rules = kml.auto_rules(probe, mesh, replicate_below=0, memory_budget=budget, batch=x, optimizer="adam")
    assert {"fully sharded", "2-D"} <= set(rules.cost.layouts())
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    model = train(FAMILIES[family][style], reference.initial, data(family), distribution=dist)
    assert_laid_out_as_planned(model, dist.plan(model), mesh)
    keras.distribution.set_distribution(None)
    assert_same_weights(model, reference.trained)
