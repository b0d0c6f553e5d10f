"""Planning for machines you do not have (issue 21, items 1, 2 and 4).

TPU targets come from libtpu's compile-only devices (`kml.Mesh(..., target=...)`), abstract
meshes of any size from `jax.sharding.AbstractMesh`; `kml.compile_step` compiles the real
Keras training step for a target from a dry build. Every compile here is XLA:TPU's, run on
this CPU-only machine: nothing is ever placed on those devices (they hold no array, so a
single allocation would fail the test).
"""

from __future__ import annotations

import collections
import functools
import math
import re
import sys
from collections.abc import Callable
from contextlib import nullcontext
from typing import NamedTuple

import hub_models
import jax
import keras
import keras_hub
import pytest
from helpers import build_convnet
from test_convs import hub_resnet
from test_errors import Case, raises_case

import keras_meshlayout as kml
from keras_meshlayout.planner._auto import plan_rules
from keras_meshlayout.planner._tables_2d import tpu_moved_rows
from keras_meshlayout.report._collectives import wire_bytes

FORMS = "Valid forms: tpu-v5e:RxC or tpu-v6e:RxC"

#: The warning every plan of a convnet's step for a TPU target gives (`_tpu_memory.warn_convnet_peak`).
CONVNET_PEAK = "XLA:TPU's peak of a convnet's step is an estimate"


def _real_build(mesh: kml.Mesh) -> keras.Model:
    with kml.ModelParallel(mesh).scope():
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])


TARGET_CASES = [
    Case(
        "unknown-generation",
        lambda: kml.parse_target("tpu-v9:2x4"),
        kml.InvalidTargetError,
        ("'tpu-v9:2x4'", "no TPU generation 'tpu-v9'", "tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e", FORMS),
    ),
    Case(
        "not-a-form",
        lambda: kml.parse_target("v5e-16"),
        kml.InvalidTargetError,
        ("'v5e-16' is not of a known form", FORMS),
    ),
    Case(
        "wrong-rank",
        lambda: kml.parse_target("tpu-v5p:4x4"),
        kml.InvalidTargetError,
        ("tpu-v5p slices are 3-D, 4x4 is 2-D", FORMS),
    ),
    Case(
        "shape-not-offered",
        lambda: kml.parse_target("tpu-v5e:3x3"),
        kml.InvalidTargetError,
        ("tpu-v5e comes in 2x2, 2x4,", "not 3x3", FORMS),
    ),
    Case(
        "slice-too-large",
        lambda: kml.parse_target("tpu-v5p:32x32x32"),
        kml.InvalidTargetError,
        ("a tpu-v5p slice has 1 to 6144 chips, 32x32x32 has 32768", FORMS),
    ),
    Case(
        "mesh-does-not-use-the-chips",
        lambda: kml.Mesh(data=2, model=2, target="tpu-v5e:2x4"),
        kml.InvalidTargetError,
        ("Mesh data=2,model=2 does not fit target tpu-v5e:2x4", "multiply to the target's 8 chips", FORMS),
    ),
    Case(
        "a-real-build-on-a-target",  # JAX's error was "MakeArraysFromHostBufferShards not available"
        lambda: _real_build(kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")),
        kml.InvalidMeshError,
        (
            "would be allocated on Mesh(data=2, model=4)",
            "TPU target tpu-v5e:2x4",
            "kml.dry_plan(build, dist)",
        ),
    ),
    Case(
        "target-with-devices",
        lambda: kml.Mesh((2, 4), ["data", "model"], target="tpu-v5e:2x4"),
        kml.InvalidMeshError,
        ("A target brings its own devices", 'target="tpu-v5e:2x4"'),
    ),
]


@pytest.mark.parametrize("case", TARGET_CASES, ids=lambda case: case.id)
def test_a_bad_target_is_one_line_naming_the_valid_forms(case: Case):
    raises_case(case)
    with pytest.raises(kml.MeshLayoutError) as info:
        case.make()
    assert "\n" not in str(info.value)


def test_a_target_without_libtpu_says_what_to_install(monkeypatch):
    """`sys.modules[name] = None` is how Python marks a module absent: `import libtpu` fails."""
    monkeypatch.setitem(sys.modules, "libtpu", None)
    with pytest.raises(kml.MissingLibtpuError) as info:
        kml.Mesh(data=2, model=2, target="tpu-v6e:2x2")  # a target no other test asks libtpu for
    message = str(info.value)
    assert "Target 'tpu-v6e:2x2' needs libtpu" in message and 'pip install ".[tpu-aot]"' in message
    assert "libtpu==0.0.42.* for jax 0.10.2" in message and "\n" not in message


def test_targets_carry_the_published_figures_and_libtpu_devices():
    """The table the planners read; the devices libtpu gives for it, one per chip (v4 as megacores)."""
    v5e, v4 = kml.parse_target("tpu-v5e:16x16"), kml.parse_target("tpu-v4:2x2x2")
    assert (v5e.chips, v5e.hbm_bytes, v5e.peak_flops, v5e.ici_bytes_per_s) == (256, 16 * 2**30, 197e12, 200e9)
    assert kml.parse_target("tpu-v5p:4x4x4:slices=2").chips == 128
    mesh = kml.Mesh(data=2, model=4, target=v4)
    assert (mesh.target, kml.core._mesh.platform_name(mesh)) == (v4, "tpu (TPU v4)")
    many = kml.Mesh(data=-1, model=4, target="tpu-v5e:2x4:slices=2")
    assert many.axis_sizes == {"data": 4, "model": 4}
    # The first axis crosses the two slices (the data-center network), the model axis stays in one.
    assert [sorted({d.slice_index for d in row}) for row in many.devices] == [[0], [0], [1], [1]]


def test_an_abstract_mesh_of_256_devices_plans_with_none():
    """No emulation: `auto_rules` and `dry_plan` on a 16 × 16 mesh with this process's 8 CPUs."""
    mesh = kml.Mesh(jax.sharding.AbstractMesh((16, 16), ("data", "model")))

    def build():
        return keras.Sequential(
            [
                keras.Input((1024,)),
                keras.layers.Dense(4096, name="up"),
                keras.layers.Dense(1024, name="down"),
            ],
            name="mlp",
        )

    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh)
    plan = kml.dry_plan(build, kml.ModelParallel(mesh, rules), optimizer="adam")
    assert (mesh.size, mesh.is_abstract, len(jax.devices())) == (256, True, 8)
    assert plan["mlp/up/kernel"].axes == (None, "model")
    assert plan["mlp/up/kernel"].bytes_per_device == 1024 * 4096 * 4 // 16


# -- the compile check on TPU v5e 2x4 (slow: one XLA:TPU compile per model) ---------------------


def decoder() -> keras.Model:
    """One causal decoder block and a language-model head."""
    tokens = keras.Input((32,), dtype="int32")
    hidden = keras.layers.Embedding(1024, 128, name="token_embedding")(tokens)
    attended = keras.layers.MultiHeadAttention(4, 32, name="attention")(hidden, hidden, use_causal_mask=True)
    hidden = keras.layers.LayerNormalization(name="attention_norm")(keras.layers.Add()([hidden, attended]))
    ffn = keras.layers.Dense(512, activation="gelu", name="ffn_up")(hidden)
    ffn = keras.layers.Dense(128, name="ffn_down")(ffn)
    hidden = keras.layers.LayerNormalization(name="ffn_norm")(keras.layers.Add()([hidden, ffn]))
    return keras.Model(tokens, keras.layers.Dense(1024, name="lm_head")(hidden), name="decoder")


class Compiled(NamedTuple):
    rules: kml.LayoutRules
    step: kml.CompiledStep


def _mixtral():
    return hub_models.build_classifier({r.name: r for r in hub_models.ROWS}["MixtralBackbone"])


def _inputs(name: str, model: keras.Model) -> tuple:
    if name == "decoder":
        return jax.ShapeDtypeStruct((16, 32), "int32"), jax.ShapeDtypeStruct((16, 32), "int32")
    if name == "convnet":
        return jax.ShapeDtypeStruct((16, 8, 8, 3), "float32"), jax.ShapeDtypeStruct((16,), "int32")
    x = {key: jax.ShapeDtypeStruct(v.shape, v.dtype) for key, v in hub_models.inputs_for(model).items()}
    return x, jax.ShapeDtypeStruct((hub_models.BATCH,), "int32")


BUILDS = {"decoder": decoder, "moe": _mixtral, "convnet": build_convnet}


@functools.cache
def compiled(name: str) -> Compiled:
    """The auto plan for v5e 2x4 and its training step compiled by XLA:TPU, once per model."""
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    build = BUILDS[name]
    warned = pytest.warns(kml.MeshLayoutWarning, match=CONVNET_PEAK) if name == "convnet" else nullcontext()
    with kml.dry_build(build) as model, warned:
        x, y = _inputs(name, model)
        # replicate_below=0 as in test_experts: the small Mixtral's key/value kernels are planned too.
        rules = kml.auto_rules(
            model, mesh, batch=x, optimizer="adam", replicate_below=0 if name == "moe" else None
        )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    return Compiled(rules, step)


#: Predicted ÷ XLA:TPU's bytes per step, by mesh axis (measured with libtpu 0.0.42.1, jax 0.10.2).
#: The decoder and the convnet are exact, as on XLA:CPU. The small Mixtral's key/value kernels (2
#: heads) are split on head_dim: XLA:TPU gathers each in bfloat16 forward and again backward (the
#: bytes of one float32 gather) and moves their heads' gradients in bfloat16 where its dots read
#: them, which the costs follow on a target. Before the HLO parser counted one asynchronous
#: collective once (XLA:TPU prints a copy in each of its fusions) it read 2.3x those bytes (0.42).
#: The router kernels' update, which XLA:TPU splits over the experts and gathers back (the kernel
#: and its slots), is costed (`_expert_costs`; 0.918 before). The rest, 8,460 bytes at hidden 64,
#: is the routing's per-token collectives (all-to-alls, permutes, 1-float all-reduces over the
#: experts): not modelled, 5% here, under 1% at hidden 512 (`LMS`).
AGREEMENT = {
    "decoder": {"data": (1.0, 0.02), "model": (1.0, 0.02)},
    "convnet": {"data": (1.0, 0.02)},
    "moe": {"data": (1.0, 0.02), "model": (0.947, 0.005)},
}


@pytest.mark.parametrize("name", sorted(BUILDS), ids=sorted(BUILDS))
def test_the_step_compiles_for_tpu_v5e_and_its_traffic_is_predicted(name):
    rules, step = compiled(name)
    assert (step.platform, step.device_kind) == ("tpu", "TPU v5 lite")
    assert step.peak_bytes == step.argument_bytes + step.output_bytes - step.alias_bytes + step.temp_bytes
    # The state is donated as in fit: the new weights and slots overwrite the old ones.
    assert 0 < step.alias_bytes <= min(step.argument_bytes, step.output_bytes)
    measured = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}  # not scalar sums
    assert set(measured) == set(AGREEMENT[name])
    for axis, (ratio, tolerance) in AGREEMENT[name].items():
        assert rules.cost.wire_bytes_by_axis[axis] / measured[axis] == pytest.approx(ratio, abs=tolerance), (
            axis
        )
    data = step.to_dict()
    keys = {"platform", "device_kind", "argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"}
    assert keys | {"live_peak_bytes"} <= set(data)
    # Live on chip and in HBM: above the arguments, though these steps' temporaries in HBM are 0 B.
    assert step.live_peak_bytes > step.argument_bytes and "live at once" in str(step)


# -- bytes per step on XLA:TPU: one all-reduce for projections' summed input gradients -----------

LM_BATCH, LM_LENGTH = 8, 64


def _hub_lm(
    cls: str, hidden: int, intermediate: int, dtype: str = "float32", layers: int = 1, **extra
) -> keras.Model:
    """A keras-hub decoder (one layer) under its output table (`reverse=True`), as a causal LM runs it."""
    config = dict(vocabulary_size=1024, num_layers=layers, hidden_dim=hidden, intermediate_dim=intermediate)
    config.update(num_query_heads=8, num_key_value_heads=2, dropout=0.0, dtype=dtype, **extra)
    backbone = getattr(keras_hub.models, cls)(**config)
    inputs = {n: keras.Input((LM_LENGTH,), dtype="int32", name=n) for n in ("token_ids", "padding_mask")}
    return keras.Model(inputs, backbone.token_embedding(backbone(inputs), reverse=True), name="lm")


#: A dense Llama 3 and a Mixtral (4 experts, top 2); the MoE's hidden is wider so that its routing's
#: per-token collectives (not modelled: all-to-alls, permutes, 1-float all-reduces) stay under 2%.
LMS = {
    "llama3": functools.partial(_hub_lm, "Llama3Backbone", 128, 256),
    "mixtral": functools.partial(_hub_lm, "MixtralBackbone", 512, 256, num_experts=4, top_k=2),
}


def _lm_rules(build, mesh: kml.Mesh) -> kml.LayoutRules:
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    with kml.dry_build(build) as model:
        return kml.auto_rules(model, mesh, batch=x, optimizer="adam", replicate_below=0)


#: `data × model` on v5e 2x4: 2 key/value heads divide a model axis of 2; on one of 4 they are
#: split on head_dim (issue 21: predicted ÷ XLA:TPU on `model` was 0.874 for Llama 3, 0.63 for
#: Mixtral; the same plans on XLA:CPU: 1.000).
LM_MESHES = {"heads": (4, 2), "head_dim": (2, 4)}


@pytest.mark.parametrize("split", sorted(LM_MESHES), ids=sorted(LM_MESHES))
@pytest.mark.parametrize("name", sorted(LMS), ids=sorted(LMS))
def test_tensor_parallel_bytes_follow_xla_tpu_within_2_percent(name, split):
    """XLA:TPU turns `all-reduce(a) + all-reduce(b)` into one all-reduce of `a + b`; XLA:CPU does not.

    Query, key and value read their norm's output alone, so the gradient of it is summed before one
    all-reduce over `model` (XLA:CPU: three); the experts' gate and up projections likewise (two).
    Before the costs followed the target, predicted / TPU HLO on `model` was 1.60 (Llama 3, hidden
    256) and 1.63 (Mixtral); on XLA:CPU meshes the formulas are unchanged (`test_costs`, the zoo).
    Key/value kernels split on head_dim are gathered in bfloat16 in each pass, and their heads'
    gradients move in bfloat16 where a dot reads them (`planner/_kv_costs.py`).
    """
    build = LMS[name]
    data, model = LM_MESHES[split]
    mesh = kml.Mesh(data=data, model=model, target="tpu-v5e:2x4")
    rules = _lm_rules(build, mesh)
    layouts = {c.unit.rpartition("/")[2]: c.layout for c in rules.cost.choices}
    assert (layouts.get("key"), layouts.get("value")) == (
        ("head_dim split",) * 2 if model == 4 else (None, None)
    )
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    step = kml.compile_step(build, dist, x, y, optimizer="adam", loss=loss)
    measured = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}  # not scalar sums
    predicted = {axis: b for axis, b in rules.cost.wire_bytes_by_axis.items() if b > 64}
    assert set(predicted) == set(measured) == {"data", "model"}
    for axis in measured:
        assert predicted[axis] / measured[axis] == pytest.approx(1.0, abs=0.02), (axis, predicted, measured)


#: Fully sharded (`plan_rules(fully_sharded=True)`) on v5e 2x4: (data, model) -> predicted ÷ XLA:TPU on
#: `data` before the kernels read before the last attention were counted as gathered again for the
#: backward pass (issue 21: 0.924, 0.905 and 0.913 on a hidden-256 Llama 3 on 2×4, 4×2 and 8×1).
FSDP_MESHES = {"2x4": (2, 4), "8x1": (8, 1)}


def _fully_sharded(build: Callable[[], keras.Model], split: str) -> Compiled:
    """`build`'s fully sharded plan on v5e 2x4 split as `split`, and its step compiled by XLA:TPU."""
    data, model = FSDP_MESHES[split]
    mesh = kml.Mesh(data=data, model=model, target="tpu-v5e:2x4")
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32")
    with kml.dry_build(build) as lm:
        rules = plan_rules(lm, mesh, batch=x, optimizer="adam", fully_sharded=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return Compiled(
        rules, kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    )


@pytest.mark.parametrize("split", sorted(FSDP_MESHES), ids=sorted(FSDP_MESHES))
def test_fully_sharded_transformer_bytes_and_peak_follow_xla_tpu(split):
    """XLA:TPU gathers a fully sharded kernel in bfloat16 for the forward pass and, unless the forward
    pass reads it after the last attention (the last layer's feed-forward, the output table), again for
    the backward pass; the weights' gradients are all-reduced over `data` at these sizes. Bytes per
    axis within 2%, the peak within 10% (measured 0.998-0.999 on hidden 256)."""
    rules, step = _fully_sharded(functools.partial(_hub_lm, "Llama3Backbone", 128, 256, layers=2), split)
    measured = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}  # not scalar sums
    predicted = {axis: b for axis, b in rules.cost.wire_bytes_by_axis.items() if b > 64}
    assert set(predicted) == set(measured)
    for axis in measured:
        assert predicted[axis] / measured[axis] == pytest.approx(1.0, abs=0.02), (axis, predicted, measured)
    assert rules.cost.peak_bytes / step.peak_bytes == pytest.approx(1.0, abs=0.10)


#: A 2-layer keras-hub Mixtral (hidden 256, intermediate 512, 4 experts, top 2, 8 rows x 64 tokens)
#: fully sharded on v5e 2x4 -> predicted / XLA:TPU's peak (libtpu 0.0.42.1). Its bytes per axis are
#: within 2%: `data` 0.9962 (`data=2,model=4`) and 0.9943 (`data=8`; 1.0006 and 0.9957 before the routing was
#: costed in the banks' shards, `_expert_costs.tpu_router_shards`), were 1.208 and 1.873 while the
#: expert kernels were costed as gathered (XLA:TPU gathers the 512 tokens instead, `_expert_gathers`),
#: `data×model` 1.000, was 1.331 (the output table over both axes, gathered once in bfloat16).
MOE_FSDP_PEAKS = {"2x4": 0.434, "8x1": 0.480}
#: `model` on `data=2,model=4`: 0.982 (0.977 before the router kernels' update, split over the
#: experts and gathered back with its slots, was costed); the rest is the routing's per-token
#: collectives over the experts (ten `(256, 2)` all-reduces and an all-to-all a layer), not modelled.


@functools.cache
def _fully_sharded_mixtral(split: str) -> Compiled:
    """The small Mixtral planned fully sharded and compiled by XLA:TPU, once per mesh."""
    build = functools.partial(_hub_lm, "MixtralBackbone", 256, 512, layers=2, num_experts=4, top_k=2)
    return _fully_sharded(build, split)


@pytest.mark.parametrize("split", sorted(FSDP_MESHES), ids=sorted(FSDP_MESHES))
def test_a_fully_sharded_moe_sends_what_xla_tpu_compiles_gathering_its_tokens(split):
    """An expert bank whose gate and up kernels are split over `data` on their intermediate dimension,
    each shard at least the block's input for the whole batch: XLA:TPU gathers the 512 tokens (in
    bfloat16) instead of the kernels, all-reduces the output projection's partial sums over `data`
    and gathers their gradient back; no kernel is gathered, no kernel gradient summed."""
    rules, step = _fully_sharded_mixtral(split)
    layouts = {c.unit.rpartition("/")[2]: c.layout for c in rules.cost.choices}
    assert layouts["experts"] == "2-D"
    measured = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}  # not scalar sums
    predicted = {axis: b for axis, b in rules.cost.wire_bytes_by_axis.items() if b > 64}
    assert set(predicted) == set(measured)
    for axis in measured:
        assert predicted[axis] / measured[axis] == pytest.approx(1.0, abs=0.02), (
            axis,
            predicted,
            measured,
        )
    gathers = {t.shape for t in step.comm.transfers if t.kind == "all-gather" and "experts" in t.layer}
    assert gathers <= {(512, 256), (1, 512, 256), (4 // FSDP_MESHES[split][1], 512, 256)}, gathers


def test_a_fully_sharded_moe_on_a_model_axis_of_one_chip_splits_weights_over_the_expert_axis():
    """Fully sharded on `data=2,expert=4,model=1` the expert axis serves as the model axis: every axis
    within 2% of XLA:TPU's bytes (`data` 0.996, `expert` 0.982, `data×expert` 1.000) and 8.2 MB of
    state a chip. Split over `data` alone it was `data` 1.37, `expert` 0.53, 1.5 MB over both axes
    not predicted, and 15.2 MB of state."""
    build = functools.partial(_hub_lm, "MixtralBackbone", 256, 512, layers=2, num_experts=4, top_k=2)
    mesh = kml.Mesh(data=2, expert=4, model=1, target="tpu-v5e:2x4")
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32")
    with kml.dry_build(build) as lm:
        rules = plan_rules(lm, mesh, batch=x, optimizer="adam", fully_sharded=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    measured = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}
    assert set(measured) == {"data", "expert", "data×expert"}
    for axis, sent in measured.items():
        assert rules.cost.wire_bytes_by_axis[axis] / sent == pytest.approx(1.0, abs=0.02), axis
    assert rules.cost.state_bytes < 8.5e6


@pytest.mark.xfail(
    strict=True,
    reason="the peak of the fully sharded Mixtral is 0.434 (2x4) and 0.480 (8x1) of XLA:TPU's: XLA:TPU "
    "leaves 8.0 MB (2x4) and 8.1 MB (8x1) of temporaries in HBM where the walk, its transient far under "
    "v5e's on-chip 64 MiB, keeps them all on chip (`_tpu_memory.in_hbm`). Its dumped buffer assignment "
    "allocates 4.0 MB in HBM (2x4), and a 2-layer Llama 3 of hidden 256 reports 0 B for 3.5-3.9 MB so "
    "allocated (data-parallel, tensor-parallel, fully sharded on 8x1) but 8.5 MB for 4.3 MB fully sharded "
    "on 2x4: which small steps XLA:TPU keeps on chip is not modelled",
)
@pytest.mark.parametrize("split", sorted(FSDP_MESHES), ids=sorted(FSDP_MESHES))
def test_the_peak_of_a_fully_sharded_moe_follows_xla_tpu(split):
    rules, step = _fully_sharded_mixtral(split)
    ratio = rules.cost.peak_bytes / step.peak_bytes
    assert ratio == pytest.approx(MOE_FSDP_PEAKS[split], abs=0.01)  # the measured miss, pinned
    assert ratio == pytest.approx(1.0, abs=0.10)


class _ExpertBank(keras.layers.Layer):
    """Mixtral's expert feed-forward as keras-hub writes it: einsums over every expert, SwiGLU, summed."""

    def __init__(self, experts: int, intermediate: int, **kwargs):
        super().__init__(**kwargs)
        self.experts, self.intermediate = experts, intermediate

    def build(self, shape):
        kernel = (self.experts, self.intermediate, shape[-1])
        self.gate, self.up, self.down = (self.add_weight(kernel, name=n) for n in ("gate", "up", "down"))

    def call(self, x):
        gate = keras.ops.einsum("eih,th->eti", self.gate, x)  # JAX: a dot_general, then a transpose
        up = keras.ops.einsum("eih,th->eti", self.up, x)
        return keras.ops.sum(keras.ops.einsum("eti,eih->eth", keras.ops.silu(gate) * up, self.down), axis=0)


def test_the_peak_of_an_expert_banks_swiglu_follows_xla_tpu():
    """16,384 tokens a chip, one expert of intermediate 2,048 a chip (v5e `data=2,model=4`): XLA:TPU
    keeps the gate and up products in the einsums' own layout for the backward pass and recomputes
    the gate's sigmoid from them (3 x 128 MiB live at the peak). Predicted 0.998 of the compiled
    peak; 0.685 while the products, each read only by a transpose that is fused into its readers,
    were held by neither (`_fusion.laid_out`), 1.31 with the sigmoid held too
    (`_liveness._recomputed_on_tpu`)."""

    def build():
        tokens = keras.Input((128,))
        return keras.Model(tokens, _ExpertBank(4, 2048, name="experts")(tokens), name="moe")

    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    x = jax.ShapeDtypeStruct((32768, 128), "float32")
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    assert {r.pattern.rpartition("/")[2]: r.axes for r in rules.rules} == dict.fromkeys(
        ("gate", "up", "down"), ("model", None, None)
    )
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, x, optimizer="adam")
    assert step.temp_bytes > 3 * 2**27  # in HBM: above what v5e keeps on chip
    assert rules.cost.peak_bytes / step.peak_bytes == pytest.approx(1.0, abs=0.05)


class WindowedMlp(NamedTuple):
    rules: kml.LayoutRules
    step: kml.CompiledStep
    hlo: str
    model: keras.Model


@functools.cache
def _windowed_mlp() -> WindowedMlp:
    """A Dense MLP 256 → 1024 → 256 fully sharded over v5e `data=8` at 16,384 rows, compiled by XLA:TPU."""
    from keras_meshlayout.report import _compile

    def build():
        dense = keras.layers.Dense
        layers = [keras.Input((256,)), dense(1024, name="up"), dense(256, name="down")]
        return keras.Sequential(layers, name="mlp")

    mesh = kml.Mesh(data=8, model=1, target="tpu-v5e:2x4")
    x = jax.ShapeDtypeStruct((16384, 256), "float32")
    with kml.dry_build(build) as model:
        rules = plan_rules(model, mesh, batch=x, optimizer="adam", fully_sharded=True)
    compiled = []
    lower = _compile._lower

    def keep(*args):
        lowered, step, unread = lower(*args)
        compiled.append(step)
        return lowered, step, unread

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_compile, "_lower", keep)
        step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, x, optimizer="adam")
    return WindowedMlp(rules, step, compiled[0].as_text(), model)


def test_a_windowed_reduce_scatter_is_counted_once_per_run_of_its_loop():
    """From about 2,048 tokens per device over `data=8`, XLA:TPU reduce-scatters a fully sharded kernel's
    gradient as a windowed einsum (and gathers the first kernel so, forward): a loop whose body (4
    collective-permutes of one shard) runs twice, one permute before it: 9 per kernel counted (5 before
    loops were counted: 2,111,495 of the 3,422,215 bytes the step sends; predicted 4,600,967, an
    all-reduce of each gradient, not yet the windowed loop)."""
    step = _windowed_mlp().step
    permutes = collections.Counter(
        (t.layer, t.phase, t.shape) for t in step.comm.transfers if t.kind == "collective-permute"
    )
    assert permutes == {("up", "forward", (1, 32, 1024)): 9, ("up", "backward", (32, 1024)): 9,
                        ("down", "backward", (128, 256)): 9}  # fmt: skip
    assert step.comm.wire_bytes_by_axis["data"] == pytest.approx(3_422_215, abs=1)


def test_a_windowed_kernel_gradient_reads_bfloat16_copies_of_its_inputs_as_the_walk_holds_them():
    """The loops that reduce-scatter the kernels' gradients carry each projection's input in bfloat16,
    2,048 rows a chip, whole on its features (the batch's `bf16[2048,256]`, the hidden `bf16[2048,1024]`):
    the copies the peak walk keeps from the forward pass to those loops (`_windowed_copies.windowed_operands`;
    on the Mixtral 8x7 B row of `benchmarks/targets.py` 1.2 GiB of them at the peak, its predicted peak
    0.80 -> 0.92 of the compiled)."""
    from keras_meshlayout.planner._propagate import Specs
    from keras_meshlayout.planner._trace import trace_step
    from keras_meshlayout.planner._windowed_copies import windowed_operands

    mlp = _windowed_mlp()
    bodies = re.findall(r"^%\S*windowed_dot_general_body_rs\S* \((.*)\) -> ", mlp.hlo, re.MULTILINE)
    carried = {shape for body in bodies for shape in re.findall(r"bf16\[\d+,\d+\]", body)}
    assert carried == {"bf16[2048,256]", "bf16[2048,1024]"}
    trace = trace_step(mlp.model, jax.ShapeDtypeStruct((16384, 256), "float32"))
    paths = {path: mlp.rules.match(path).axes for path in trace.variables.values()}
    assert all("data" in axes for path, axes in paths.items() if path.endswith("kernel"))  # fully sharded
    specs = Specs(trace, paths, {"data": 8, "model": 1}, "data")
    held = sorted(size for *_, size in windowed_operands(trace, specs, paths, "data", set()))
    assert held == [2048 * 256 * 2, 2048 * 1024 * 2]


#: A Dense MLP (256 → 1024 → 256) fully sharded over `data` alone at 16,384 rows: data -> (target, the
#: collective-permutes of each kernel's windowed reduce-scatter, 0: all-reduced). Over 16 and 32 devices
#: the gradients are windowed as over 4 and 8 (`d + 1` permutes of a shard; predicted as all-reduces
#: before: a keras-hub Llama 3 on v5p `data=16,model=4` at 1.37x XLA:TPU's `data` bytes, Mixtral 8x7 B
#: widths on v5e `data=32,model=8` 1.151x in all); over 64 the kernels are gathered as all-reduces of
#: their bfloat16 shards written into zeros (0.83x before) and the gradients all-reduced.
WINDOWED_OVER = {16: ("tpu-v5e:4x4", 17), 32: ("tpu-v5e:4x8", 33), 64: ("tpu-v5e:8x8", 0)}


@pytest.mark.parametrize("data", sorted(WINDOWED_OVER), ids=[f"data={d}" for d in sorted(WINDOWED_OVER)])
def test_large_batch_axes_reduce_scatter_and_gather_as_xla_tpu_compiles(data):
    target, permutes = WINDOWED_OVER[data]

    def build():
        dense = keras.layers.Dense
        layers = [keras.Input((256,)), dense(1024, name="up"), dense(256, name="down")]
        return keras.Sequential(layers, name="mlp")

    mesh = kml.Mesh(data=data, model=1, target=target)
    x = jax.ShapeDtypeStruct((16384, 256), "float32")
    with kml.dry_build(build) as model:
        rules = plan_rules(model, mesh, batch=x, optimizer="adam", fully_sharded=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, x, optimizer="adam")
    counted = collections.Counter(
        t.layer for t in step.comm.transfers if t.kind == "collective-permute" and t.phase == "backward"
    )
    assert counted["down"] == permutes, counted
    predicted, compiled = rules.cost.wire_bytes_by_axis["data"], step.comm.wire_bytes_by_axis["data"]
    assert predicted / compiled == pytest.approx(1.0, abs=0.01)


#: A token table of 1,024 rows × 256 split over both axes, looked up by `tokens` ids of the whole batch:
#: (batch, model, tokens) -> (look-up moved the rows, gradient moved them), as XLA:TPU compiled a
#: fully sharded keras-hub Llama 3 (libtpu 0.0.42.1). XLA:CPU's rule (rows moved up to one token a row,
#: the table gathered above) said gathered for every case above 1,024 tokens: on v5p `data=16,model=4`
#: at Llama-3 8 B widths, 4.2 GB a step over both axes, 0.61 of the compiled bytes predicted.
TABLE_LOOKUPS = {
    "2x4-768": (2, 4, 768, (False, False)),  # over 2 devices XLA:TPU follows XLA:CPU's rule
    "4x4-1024": (4, 4, 1024, (True, True)),  # a tie in the gradient's memory: moved, the first way
    "4x4-1152": (4, 4, 1152, (True, False)),  # the gradient summed in the model-axis block instead
    "4x4-1280": (4, 4, 1280, (False, False)),
    "8x8-1024": (8, 8, 1024, (True, True)),
    "8x8-1152": (8, 8, 1152, (False, False)),
    "16x4-1056": (16, 4, 1056, (True, True)),
    "16x4-1152": (16, 4, 1152, (True, True)),
    "16x4-1280": (16, 4, 1280, (False, False)),
}


@pytest.mark.parametrize("case", sorted(TABLE_LOOKUPS), ids=sorted(TABLE_LOOKUPS))
def test_xla_tpu_moves_a_tables_rows_where_that_touches_less_memory_than_gathering_it(case):
    batch, model, tokens, expected = TABLE_LOOKUPS[case]
    assert tuple(tpu_moved_rows((1024, 256), (tokens, 256), "float32", batch, model)) == expected


def test_llama_3_8b_widths_on_v5p_move_the_token_tables_rows():
    """131,072 tokens of a 128,256-row table over `data=16,model=4`: the rows move both ways."""
    assert tuple(tpu_moved_rows((128_256, 4096), (64, 2048, 4096), "float32", 16, 4)) == (True, True)


def test_a_token_table_over_both_axes_is_looked_up_as_xla_tpu_compiles_it():
    """`data=4,model=4`, 1,024 tokens of an 896-row table: XLA:TPU all-reduces the whole batch's looked-up
    rows over both axes and sums the gradient in each device's model-axis block, all-reduced over `data`
    (as 1,152 tokens of 1,024 rows, where the block gathered over `data` was predicted: `data×model` 0.003
    and `data` 1.25 of the compiled bytes)."""
    build = functools.partial(_hub_lm, "Llama3Backbone", 256, 512, vocabulary_size=896)
    mesh = kml.Mesh(data=4, model=4, target="tpu-v5e:4x4")
    x = {n: jax.ShapeDtypeStruct((16, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((16, LM_LENGTH), "int32")
    with kml.dry_build(build) as lm:
        rules = plan_rules(lm, mesh, batch=x, optimizer="adam", fully_sharded=True)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    table = [t for t in step.comm.transfers if t.layer.endswith("backbone/token_embedding")]
    assert {(t.kind, t.axes, t.shape) for t in table if t.dtype == "f32"} == {
        ("all-reduce", ("data", "model"), (16, LM_LENGTH, 256))
    }
    for axis, sent in step.comm.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] / sent == pytest.approx(1.0, abs=0.02), axis


@pytest.mark.parametrize("dtype", ["bfloat16", "mixed_bfloat16"])
def test_under_bfloat16_xla_tpu_moves_activations_in_bfloat16(dtype):
    """Partial sums in the layer's dtype (XLA:CPU: float32), a float32 look-up cast before its all-reduce,
    the logits' maximum in bfloat16, the norm's one cast read by gate and up merged (issue 21); under
    `mixed_bfloat16` the float32 kernels' gradients all-reduced over `data` in bfloat16, before their cast.

    Before the costs followed XLA:TPU, predicted ÷ compiled on `model` was 2.22 for both dtypes, and
    1.509 on `data` under `mixed_bfloat16`.
    """
    build = functools.partial(_hub_lm, "Llama3Backbone", 128, 256, dtype=dtype)
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    rules = _lm_rules(build, mesh)
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules, replicate_below=0), x, y, loss=loss)
    predicted, measured = rules.cost.wire_bytes_by_axis, step.comm.wire_bytes_by_axis
    for axis in ("model", "data"):
        assert predicted[axis] / measured[axis] == pytest.approx(1.0, abs=0.02), (axis, predicted, measured)


def test_expert_banks_on_an_expert_axis_send_what_xla_tpu_compiles():
    """On `data=2,expert=2,model=2` the Mixtral's banks go over `expert`, attention over `model`;
    XLA:TPU's all-reduces over each axis and its gathers of the router kernel, updated in the
    experts' shards (the kernel and Adam's two slots), are predicted within 2% (`expert` 0.986,
    0.974 before the gathers were costed). The routing's per-token permutes over `expert×model`
    (2,048 bytes) are not modelled."""
    mesh = kml.Mesh(data=2, expert=2, model=2, target="tpu-v5e:2x4")
    build = LMS["mixtral"]
    rules = _lm_rules(build, mesh)
    assert {c.layout for c in rules.cost.choices if c.unit.endswith("/experts")} == {"expert-parallel"}
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules, replicate_below=0), x, y, loss=loss)
    predicted, measured = rules.cost.wire_bytes_by_axis, dict(step.comm.wire_bytes_by_axis)
    assert measured.pop("expert×model") <= 2048
    assert set(measured) == {"data", "expert", "model"}
    for axis in measured:
        assert predicted[axis] / measured[axis] == pytest.approx(1.0, abs=0.02), (axis, predicted, measured)
    gathers = [t for t in step.comm.transfers if t.phase == "update" and t.kind == "all-gather"]
    assert {t.axes for t in gathers} == {("expert",)} and len(gathers) == 3  # the kernel and two slots


def test_on_xla_cpu_each_projection_all_reduces_its_input_gradient():
    """The same Llama 3 planned for 8 CPU devices (no target): XLA:CPU's three query/key/value and two
    gate/up all-reduces, where XLA:TPU sends one each: two (key, value) and one (gate) more, and
    four per-position sums of the loss over the split logits, where XLA:TPU sends three."""
    build = LMS["llama3"]
    on_tpu = _lm_rules(build, kml.Mesh(data=4, model=2, target="tpu-v5e:2x4")).cost.wire_bytes_by_axis
    on_cpu = _lm_rules(build, kml.Mesh(data=4, model=2)).cost.wire_bytes_by_axis
    hidden_grad = LM_BATCH // 4 * LM_LENGTH * 128 * 4  # one device's (tokens, hidden) float32 gradient
    per_position = LM_BATCH // 4 * LM_LENGTH * 4  # and one float32 per position: the loss's fourth sum
    assert on_cpu["data"] == on_tpu["data"]
    expected = 3 * wire_bytes("all-reduce", hidden_grad, 2) + wire_bytes("all-reduce", per_position, 2)
    assert on_cpu["model"] - on_tpu["model"] == expected


def test_a_data_parallel_v5e_16x16_mesh_feeds_each_host_one_block_and_compiles():
    """Regression: `data=256, model=1` on v5e 16x16 failed "not contiguous" in `compile_step`.

    JAX's mesh utilities order 256 chips along the physical ring, which put host 0's 2x2
    square of chips at data positions 0, 1, 16 and 17; each host must feed one block.
    """
    from keras_meshlayout.core._process_data import process_batch_block

    mesh = kml.Mesh(data=256, model=1, target="tpu-v5e:16x16")
    hosts = sorted({device.process_index for device in mesh.devices.flat})
    blocks = [process_batch_block(mesh, "data", process=host)[:2] for host in hosts]
    assert len(hosts) == 64 and sorted(blocks) == [(start, start + 4) for start in range(0, 256, 4)]
    # The ring order is kept within each host: one host's chips sit on one 2x2 square.
    assert len({(d.coords[0] // 2, d.coords[1] // 2) for d in mesh.devices[:4].flat}) == 1

    def build():
        return keras.Sequential([keras.Input((128,)), keras.layers.Dense(256, name="up")], name="m")

    dist = kml.ModelParallel(mesh, [(r".*up/kernel", (None, "model"))])
    x, y = jax.ShapeDtypeStruct((512, 128), "float32"), jax.ShapeDtypeStruct((512, 256), "float32")
    step = kml.compile_step(build, dist, x, y)
    assert step.platform == "tpu" and step.comm.wire_bytes_by_axis["data"] > 0


# -- the predicted peak on XLA:TPU ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDS), ids=sorted(BUILDS))
def test_the_peak_of_toy_steps_on_tpu_is_within_ten_percent_of_the_compiled_one(name):
    """XLA:TPU keeps these toy steps' activations in on-chip memory (0 B of temporaries) and pads
    the state to its tiles: before the walk followed both, predicted ÷ compiled was 1.84 (decoder),
    1.36 (convnet) and 1.02 (Mixtral); now 0.995, 0.994 and 0.996 (libtpu 0.0.42.1)."""
    rules, step = compiled(name)
    assert step.temp_bytes == 0
    assert 0.9 <= rules.cost.peak_bytes / step.peak_bytes <= 1.1, (rules.cost.peak_bytes, step.peak_bytes)


@pytest.mark.parametrize("optimizer", ["Adam", "SGD"])
def test_the_peak_of_an_optimizer_accumulating_gradients_follows_xla_tpu(optimizer):
    """XLA:TPU keeps this MLP's step without accumulation on chip (0 B of temporaries); with
    `gradient_accumulation_steps=4` its update's conditional puts 3.0x (Adam) and 1.49x (SGD) the
    gradients in HBM. Predicted 0.929 and 1.001 of the compiled peak with the update counted
    (`_update_memory.accumulated_update`), 0.57 without (libtpu 0.0.42.1)."""
    from test_peak import accumulated_peaks

    predicted, compiled = accumulated_peaks(optimizer, (8, 1), target="tpu-v5e:2x4")
    assert predicted / compiled == pytest.approx(1.0, abs=0.10), (predicted, compiled)


#: (shape, float32 bytes) of buffers in XLA:TPU's buffer assignment of the toy steps above (v5e,
#: libtpu 0.0.42.1): parameters, slots and the batch, padded to 8 x 128 tiles over the two
#: dimensions XLA picks, 512 B at least.
TILED = [
    ((), 512),
    ((64,), 512),
    ((32, 32), 16384),
    ((64, 10), 8192),
    ((64, 2, 4), 4096),
    ((128, 1, 32), 16384),
    ((3, 3, 3, 32), 18432),
    ((3, 3, 32, 64), 147456),
    ((8, 8, 8, 3), 98304),
]


@pytest.mark.parametrize(("shape", "expected"), TILED, ids=[str(s) for s, _ in TILED])
def test_tpu_buffers_are_padded_to_the_tiles_xla_tpu_assigns(shape, expected):
    from keras_meshlayout.planner._tpu_memory import tiled_bytes

    assert tiled_bytes(shape, 4) == expected


def _gemma(tokens: int) -> keras.Model:
    """keras-hub Gemma, 2 layers (hidden 512, 8 query heads over 2 key/value heads), its tied table of
    8,192 rows as the head, over `tokens` tokens."""
    config = dict(vocabulary_size=8192, num_layers=2, hidden_dim=512, intermediate_dim=1024, head_dim=64)
    return hub_models.causal_lm(
        "GemmaBackbone", tokens, f"gemma_{tokens}", num_query_heads=8, num_key_value_heads=2, **config
    )


@pytest.mark.parametrize(("tokens", "temp_mib"), [(1024, (256, 300)), (512, (40, 64))], ids=["1024", "512"])
def test_the_peak_of_a_decoder_whose_temporaries_outgrow_the_chip_follows_xla_tpu(tokens, temp_mib):
    """16 × 1,024 tokens on v5e `data=2,model=4`: 269 MiB of temporaries in HBM. Three rules carry the
    walk there: the query heads grouped by a reshape keep their split (`_propagate._reshape`; 3.36
    before), a residual sum read by several fusions is written rather than duplicated
    (`_fusion._at_most_unary`), and short-lived buffers such as the logits are held in vector memory
    (`_liveness._short_lived`): 1.24 with the first alone, 0.96 with all three. At 16 × 512 tokens
    XLA:TPU keeps all but 53 MiB of the walk's 99 MiB transient on chip, which the walk had counted
    all in HBM (1.63) and leaves 40 MiB of on chip since (`_tpu_memory.in_hbm`: 1.09)."""
    build = functools.partial(_gemma, tokens)
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    x = {n: jax.ShapeDtypeStruct((16, tokens), "int32") for n in ("token_ids", "padding_mask")}
    y = jax.ShapeDtypeStruct((16, tokens), "int32")
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    assert temp_mib[0] * 2**20 < step.temp_bytes < temp_mib[1] * 2**20
    assert 0.9 <= rules.cost.peak_bytes / step.peak_bytes <= 1.1, (rules.cost.peak_bytes, step.peak_bytes)


#: (shape, itemsize, batch dim, feature dim, bytes) of convolution activations in XLA:TPU's buffer
#: assignment (v5e, libtpu 0.0.42.1): features in the 128 lanes, the batch in the rows.
FEATURE_MINOR = [
    ((8, 128, 128, 8), 4, 0, 3, 64 * 2**20),  # 4 MiB of elements
    ((8, 128, 128, 8), 2, 0, 3, 32 * 2**20),
    ((8, 64, 64, 16), 2, 0, 3, 8 * 2**20),
    ((8, 32, 32, 128), 4, 0, 3, 4 * 2**20),  # unpadded
]


@pytest.mark.parametrize(
    ("shape", "itemsize", "batch", "feature", "expected"),
    FEATURE_MINOR,
    ids=[str(c[:2]) for c in FEATURE_MINOR],
)
def test_convolution_activations_take_the_lanes_with_their_features_however_few(
    shape, itemsize, batch, feature, expected
):
    from keras_meshlayout.planner._tpu_memory import feature_minor_bytes

    assert feature_minor_bytes(shape, itemsize, batch, feature) == expected


def _bottleneck() -> keras.Model:
    """ResNet's first bottleneck block of a stage: its shortcut and its first 1 × 1 convolution read
    one input (a small stem's, kept whole)."""
    layers = keras.layers
    images = keras.Input((16, 16, 3))
    x = layers.Conv2D(64, 3, strides=2, padding="same", name="stem", activation="relu")(images)
    shortcut = layers.Conv2D(256, 1, name="b_0_conv")(x)
    y = layers.Conv2D(64, 1, name="b_1_conv", activation="relu")(x)
    y = layers.Conv2D(64, 3, padding="same", name="b_2_conv", activation="relu")(y)
    x = layers.Activation("relu")(layers.Add()([shortcut, layers.Conv2D(256, 1, name="b_3_conv")(y)]))
    return keras.Model(images, layers.Dense(10, name="head")(layers.GlobalAveragePooling2D()(x)))


def test_convolutions_reading_one_input_sum_its_gradient_in_one_all_reduce_on_xla_tpu():
    """Both split on their output channels, the shortcut's and the first convolution's input gradients
    are summed over `model` in one all-reduce by XLA:TPU (two on XLA:CPU), as for projections: the
    model axis was predicted 1.33x XLA:TPU's bytes (ResNet50 at 32 x 32: 1.091, 0.975 after, 1.000 since)."""
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    x, y = jax.ShapeDtypeStruct((16, 16, 16, 3), "float32"), jax.ShapeDtypeStruct((16,), "int32")
    with kml.dry_build(_bottleneck) as model, pytest.warns(kml.MeshLayoutWarning, match=CONVNET_PEAK):
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam", replicate_below=2000)
    assert rules.match("b_0_conv/kernel").axes[-1] == rules.match("b_1_conv/kernel").axes[-1] == "model"
    dist = kml.ModelParallel(mesh, rules, replicate_below=2000)
    step = kml.compile_step(_bottleneck, dist, x, y, optimizer="adam", loss="sparse_categorical_crossentropy")
    for axis, measured in step.comm.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] == pytest.approx(measured, rel=0.02), axis


def _bottleneck_block(x, filters: int, name: str, shortcut: bool = False, strides: int = 1):
    """A bottleneck block as keras.applications ResNet writes it (a shortcut convolution on a stage's
    first)."""
    layers = keras.layers
    if shortcut:
        x0 = layers.Conv2D(4 * filters, 1, strides=strides, name=f"{name}_0_conv")(x)
        x0 = layers.BatchNormalization(name=f"{name}_0_bn")(x0)
    y = layers.Conv2D(filters, 1, strides=strides, name=f"{name}_1_conv")(x)
    y = layers.Activation("relu")(layers.BatchNormalization(name=f"{name}_1_bn")(y))
    y = layers.Conv2D(filters, 3, padding="same", name=f"{name}_2_conv")(y)
    y = layers.Activation("relu")(layers.BatchNormalization(name=f"{name}_2_bn")(y))
    y = layers.Conv2D(4 * filters, 1, name=f"{name}_3_conv")(y)
    y = layers.BatchNormalization(name=f"{name}_3_bn")(y)
    return layers.Activation("relu")(layers.Add()([x0 if shortcut else x, y]))


def _resnet_like() -> keras.Model:
    """ResNet's stem (a convolution, a batch norm, a max pooling) and two stages of three bottleneck
    blocks, 32 and 512 filters, over 4 × 4 images (the last stage at one position, as ResNet50's at
    32 × 32)."""
    layers = keras.layers
    images = keras.Input((4, 4, 3))
    x = layers.Conv2D(32, 3, strides=2, padding="same", name="stem", activation="relu")(images)
    x = layers.MaxPooling2D(3, strides=1, padding="same")(layers.BatchNormalization(name="stem_bn")(x))
    for stage, filters in enumerate((32, 512)):
        x = _bottleneck_block(x, filters, f"s{stage}_b0", shortcut=True, strides=2 if stage else 1)
        for block in (1, 2):
            x = _bottleneck_block(x, filters, f"s{stage}_b{block}")
    return keras.Model(images, layers.Dense(10, name="head")(layers.GlobalAveragePooling2D()(x)))


#: `(build, images, convolutions split alone)`: the toy above, keras-hub's ResNet (its strided 3 × 3
#: convolutions read their input zero-padded) and its pre-activation one.
RESNETS = {
    "toy": (_resnet_like, (4, 4, 3), {"s0_b1_2_conv/kernel", "s1_b1_3_conv/kernel"}),
    "keras-hub-ResNet": (hub_resnet, (32, 32, 3), {"stack0_block1_2_conv/kernel"}),
    "keras-hub-ResNet-pre-activation": (functools.partial(hub_resnet, True), (32, 32, 3), set()),
}


@pytest.mark.parametrize("name", list(RESNETS), ids=list(RESNETS))
def test_a_resnet_sends_what_xla_tpu_compiles(name):
    """XLA:TPU's ways with a ResNet, `model` bytes predicted ÷ compiled 1.000 (keras.applications
    ResNet50 at 32 × 32 the same, 2×4 and 4×2, and a subclassed one of custom layers calling
    `keras.ops.conv`; they were 0.975 and 0.990, the toy 1.038, keras-hub's 1.036 and its
    pre-activation one 1.129; a stage's first block as
    `test_convolutions_reading_one_input_sum_its_gradient_in_one_all_reduce_on_xla_tpu`):

    - a 3 × 3 (or last 1 × 1) convolution split alone on its input channels: its region's entry has
      its output gradient gathered twice in bfloat16 (once in float32 on XLA:CPU), not once as the
      grouped convolutions' first entries; in bfloat16 also at 8 rows a device, the toy's last
      stage's, as each device's 128 channels fill the lanes (ConvNeXtTiny's 192 stay float32:
      `test_conv_regions.py`);
    - the channel-wise weights of its region are all-reduced after the update, but all-gathered where
      each device's shard fills whole rows of 128 lanes (the toy's last stage's 512 and 2,048 over 4);
    - a convolution that reads its input zero-padded (keras-hub's strided 3 × 3) has that input
      gathered, or its gradient all-reduced, unpadded, where XLA:CPU moves the padded one;
    - two convolutions split on their input channels whose outputs are added with no norm between
      (a pre-activation block's shortcut and last 1 × 1) are all-reduced once, summed first.

    keras-hub's ResNet with basic blocks is 1.027 (1.028 pre-activation; were 1.063 and 1.123):
    XLA:TPU gathers its first block's entry once, not twice, not followed."""
    build, image, alone = RESNETS[name]
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    x, y = jax.ShapeDtypeStruct((16, *image), "float32"), jax.ShapeDtypeStruct((16,), "int32")
    with kml.dry_build(build) as model, pytest.warns(kml.MeshLayoutWarning, match=CONVNET_PEAK):
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam")
    assert alone <= {choice.unit for choice in rules.cost.choices}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(build, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss=loss)
    for axis, measured in step.comm.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] == pytest.approx(measured, rel=0.02), axis
    model_bytes = step.comm.wire_bytes_by_axis["model"]
    assert rules.cost.wire_bytes_by_axis["model"] == pytest.approx(model_bytes, rel=1e-3)  # exact


def _depthwise_convnet() -> keras.Model:
    """Convolutions over 128 x 128 images: 32 features, a depthwise convolution, strided ones after."""
    images = keras.Input((128, 128, 3))
    hidden = keras.layers.Conv2D(32, 3, padding="same", activation="relu", name="stem")(images)
    hidden = keras.layers.DepthwiseConv2D(3, padding="same", activation="relu", name="depthwise")(hidden)
    hidden = keras.layers.Conv2D(64, 3, strides=2, padding="same", activation="relu", name="down")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return keras.Model(images, keras.layers.Dense(10, name="head")(hidden), name="depthwise_convnet")


def test_the_peak_of_a_convnet_on_tpu_counts_its_padded_activations_and_is_not_under_the_compiled_one():
    """XLA:TPU stores a convolution's result features minor: the stem's 32 features over `model=4`
    are 8 a device, padded to 128 lanes (16x). The walk had counted 4 MiB per activation, put the
    step on chip, and predicted 0.03 of the compiled peak: a plan said to fit that did not. It also
    fuses the ReLU into the convolutions that read it and writes the backward pass's input gradients
    in bfloat16 (`_liveness._convolved_only`). What is left over-predicts: XLA:TPU keeps 37 MiB of
    its 157 MiB transient in vector memory, which the walk counts in HBM for a convnet's step
    (`_tpu_memory.in_hbm`: 0.975 with 40 MiB kept, but Xception 0.54): 1.31 re-measured 2026-12-06
    (157.8 MiB predicted, 120.8 compiled), 2.09 when this test was written."""
    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    x, y = jax.ShapeDtypeStruct((16, 128, 128, 3), "float32"), jax.ShapeDtypeStruct((16,), "int32")
    warned = pytest.warns(kml.MeshLayoutWarning, match=CONVNET_PEAK)
    with kml.dry_build(_depthwise_convnet) as model, warned:  # its depthwise kernel split
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam", replicate_below=0)
    assert any("model" in str(rule.axes) for rule in rules.rules if "stem" in rule.pattern)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    step = kml.compile_step(_depthwise_convnet, dist, x, y, optimizer="adam", loss=loss)
    assert step.temp_bytes > 64 * 2**20  # the padded activations are in HBM
    assert 1.0 <= rules.cost.peak_bytes / step.peak_bytes <= 1.4, (rules.cost.peak_bytes, step.peak_bytes)


#: (the walk's transient, on-chip bytes, the step's gradients, a convnet's step, what of the transient
#: XLA:TPU holds in HBM) in MiB: all on chip up to `on_chip`, all but 40 MiB up to 192 MiB on v5e (more
#: just over 64 MiB) but not the gradients nor a convnet's, all of it beyond; none kept on v5p.
IN_HBM = [
    (64, 64, 0, False, 0),
    (65, 64, 7, False, 7),  # 58 MiB kept of 63: the gradients stay in HBM
    (70, 64, 7, False, 12),  # a decoder at 4 x 1,024 tokens: 58 kept
    (88, 64, 7, False, 48),  # from here on 40 kept
    (176, 64, 7, False, 136),
    (187, 64, 7, False, 147),  # a 4-layer Gemma at 16 x 512 tokens: 1.201 with all 187 in HBM, 0.978
    (192, 64, 7, False, 152),
    (193, 64, 7, False, 193),
    (257, 64, 7, False, 257),
    (100, 64, 80, False, 80),  # 20 MiB that are not gradients kept
    (65, 64, 144, False, 65),  # the wide MLP: all gradients
    (100, 64, 7, True, 100),
    (5, 0, 0, False, 5),
]


@pytest.mark.parametrize(
    ("transient", "on_chip", "gradients", "convnet", "expected"), IN_HBM, ids=[str(c) for c in IN_HBM]
)
def test_what_of_the_transient_xla_tpu_keeps_on_chip_shrinks_then_ends_as_it_grows(
    transient, on_chip, gradients, convnet, expected
):
    from keras_meshlayout.planner._tpu_memory import in_hbm

    mib = 2**20
    held = in_hbm(transient * mib, on_chip * mib, gradients=gradients * mib, convnet=convnet)
    assert held == expected * mib


#: Each generation's figures for the peak walk (`Generation.on_chip_bytes`, `hbm_alignment`,
#: `vmem_bytes`), and what aligning the temporaries adds under Adam (4 arrays per variable) to a
#: step of 19 variables.
CHIPS = {
    "tpu-v5e:2x2": (64 * 2**20, 0, 112 * 2**20, 0),
    "tpu-v5p:2x2x1": (0, 16384, 0, 361 * 16384),
    "tpu-v6e:2x4": (64 * 2**20, 0, 112 * 2**20, 0),
}


@pytest.mark.parametrize("target", sorted(CHIPS), ids=sorted(CHIPS))
def test_each_generation_gives_the_walk_its_own_on_chip_memory_and_hbm_alignment(target):
    from keras_meshlayout.planner._peak import chip_of
    from keras_meshlayout.planner._tpu_memory import Chip, aligned_bytes

    on_chip, alignment, vmem, aligned = CHIPS[target]
    chip = chip_of(kml.Mesh(data=kml.parse_target(target).chips, target=target))
    assert chip == Chip(on_chip, alignment, vmem)
    assert aligned_bytes(19, 4.0, chip.alignment) == aligned


def _wide_mlp() -> keras.Model:
    layers = [keras.layers.Dense(4096, activation="gelu", name="up"), keras.layers.Dense(4096, name="mid")]
    head = keras.layers.Dense(1000, name="head")
    return keras.Sequential([keras.Input((4096,)), *layers, head], name="mlp")


def test_the_peak_follows_xla_tpu_where_its_temporaries_are_in_hbm():
    """XLA:TPU applies each gradient as it is written (no second, summed copy of them all, no
    partial-sum buffer) and writes a transposed gradient once: the walk follows it on a target.
    Before it did, predicted ÷ compiled was 1.44 here (1.48 on 2x4, now 0.992); XLA:CPU: 1.000."""
    mesh = kml.Mesh(data=8, model=1, target="tpu-v5e:2x4")
    x, y = jax.ShapeDtypeStruct((64, 4096), "float32"), jax.ShapeDtypeStruct((64,), "int32")
    with kml.dry_build(_wide_mlp) as model:
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam", replicate_below=0)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(_wide_mlp, dist, x, y, optimizer="adam", loss=loss)
    assert step.temp_bytes > 2**24  # the gradients' buffers are in HBM, not on chip
    assert 0.98 <= rules.cost.peak_bytes / step.peak_bytes <= 1.01, (rules.cost.peak_bytes, step.peak_bytes)


# -- multi-slice targets: what crosses the data-center network -----------------------------------


def _mlp() -> keras.Model:
    layers = [keras.layers.Dense(512, activation="relu", name="up"), keras.layers.Dense(64, name="down")]
    return keras.Sequential([keras.Input((64,)), *layers], name="mlp")


#: Predicted ÷ XLA:TPU's bytes within a slice and between slices, two v5e 2x2 slices, the MLP at
#: 64 rows, least-traffic plans (libtpu 0.0.42.1). XLA:TPU's per-slice program sends what crosses
#: slices to the megascale runtime (`report/_megascale.py`), which the report used to miss: the
#: data axis's gradients were 0 bytes on `data=2` (all of them between slices), and on `data=4` the
#: planner's ring said 1.49x what the in-slice collectives alone sent. It pads what it sends to
#: its tiles: a combined gradient of 16,577 floats goes as 17,408 (0.952).
SLICES = {
    "data=2,model=4": (1.000, 0.952),
    "data=4,model=2": (0.994, 0.979),
    "data=8,model=1": (0.993, 0.949),
}


def _on_two_slices(spec: str, fully_sharded: bool) -> tuple:
    """The MLP planned for two v5e 2x2 slices split as `spec`, and its step compiled by XLA:TPU:
    `(target, axis sizes, rules, step)`."""
    target = kml.parse_target("tpu-v5e:2x2:slices=2")
    sizes = {axis: int(size) for axis, size in (part.split("=") for part in spec.split(","))}
    mesh = kml.Mesh(**sizes, target=target)
    batch = jax.ShapeDtypeStruct((64, 64), "float32")
    with kml.dry_build(_mlp) as model:
        rules = plan_rules(model, mesh, batch=batch, optimizer="adam", fully_sharded=fully_sharded)
    step = kml.compile_step(_mlp, kml.ModelParallel(mesh, rules), batch, batch, optimizer="adam")
    return target, sizes, rules, step


@pytest.mark.parametrize("spec", sorted(SLICES), ids=sorted(SLICES))
def test_on_two_slices_the_batch_axis_sends_its_share_between_slices_as_predicted(spec):
    """The data axis is laid over the slices: its all-reduces run as a reduce-scatter within each
    slice, an all-reduce of the shard across them and an all-gather within (the DCN's share of the
    ring's bytes is (slices - 1) / (devices - 1)), and the planner's split of them matches."""
    from keras_meshlayout.planner._mesh_splits import network_bytes

    target, sizes, rules, step = _on_two_slices(spec, fully_sharded=False)
    ici, dcn = network_bytes(rules.cost.wire_bytes_by_axis, sizes, target)
    measured = step.comm.wire_bytes_by_network
    assert {t.axes for t in step.comm.transfers if t.network == "dcn"} == {("data",)}
    assert (ici / measured["ici"], dcn / measured["dcn"]) == pytest.approx(SLICES[spec], abs=0.002)
    assert step.comm.to_dict()["wire_bytes_by_network"] == measured
    assert "between slices (DCN)" in str(step.comm)


#: The same MLP fully sharded (ZeRO-3) on the two slices: predicted ÷ XLA:TPU's bytes within a slice
#: and between slices. XLA:TPU gathers each kernel in bfloat16 within a slice and in float32 across
#: them (`_mesh_splits.float32_across_slices`): the DCN figures were 0.800, 0.815 and 0.717 while the
#: gathers were counted in bfloat16 there too. Still short on `data=8,model=1`: the second kernel's
#: input gradient moved by an all-to-all that runs wholly between the slices (14,336 bytes, costed at
#: the ring's share) and its output gradient gathered across them in float32 as well.
FULLY_SHARDED_SLICES = {
    "data=2,model=4": (1.000, 0.958),
    "data=4,model=2": (0.993, 0.976),
    "data=8,model=1": (1.019, 0.853),
}


@pytest.mark.parametrize("spec", sorted(FULLY_SHARDED_SLICES), ids=sorted(FULLY_SHARDED_SLICES))
def test_fully_sharded_kernels_cross_slices_in_float32_as_predicted(spec):
    from keras_meshlayout.planner._mesh_splits import float32_across_slices, network_bytes

    target, sizes, rules, step = _on_two_slices(spec, fully_sharded=True)
    cast = rules.cost.cast_gather_bytes_by_axis
    assert set(cast) == {"data"} and 0 < cast["data"] < rules.cost.wire_bytes_by_axis["data"]
    extra = float32_across_slices(cast, sizes, target)
    by_axis = {axis: sent + extra.get(axis, 0.0) for axis, sent in rules.cost.wire_bytes_by_axis.items()}
    ici, dcn = network_bytes(by_axis, sizes, target, across=extra)
    measured = step.comm.wire_bytes_by_network
    assert (ici / measured["ici"], dcn / measured["dcn"]) == pytest.approx(
        FULLY_SHARDED_SLICES[spec], abs=0.002
    )


#: Predicted ÷ XLA:TPU's bytes per axis on v5p and v6e (libtpu 0.0.42.1), the MLP above at 64 rows;
#: both were measured on v5e only before. The toy decoder and keras-hub Llama 3 of this file are
#: 1.000 on both axes on both too (measured, not in the tests: 7-9 s each). With them, the predicted
#: ÷ compiled peak (issue 21): before the walk followed v5p's buffers (activations in HBM however
#: small, each temporary aligned to 16 KiB) it was 0.229 (MLP), 0.282 (decoder), 0.273 (Llama 3) on
#: v5p, now 0.990, 1.083, 0.927; on v6e 2x4 the MLP is 0.919 (unchanged). The MLP on v5p went to
#: 0.977 when a sum of two buffers read more than once was written (`_fusion._at_most_unary`).
GENERATIONS = {"tpu-v5p:2x2x1": {"data": 2, "model": 2}, "tpu-v6e:2x4": {"data": 2, "model": 4}}
PEAKS = {"tpu-v5p:2x2x1": 0.977, "tpu-v6e:2x4": 0.919}


@pytest.mark.parametrize("target", sorted(GENERATIONS), ids=sorted(GENERATIONS))
def test_v5p_and_v6e_send_what_the_planner_predicts(target):
    """And hold the predicted peak: on v5p through its own figures (`Generation.on_chip_bytes`,
    `hbm_alignment`), on v6e through v5e's."""
    mesh = kml.Mesh(**GENERATIONS[target], target=target)
    batch = jax.ShapeDtypeStruct((64, 64), "float32")
    with kml.dry_build(_mlp) as model:
        rules = kml.auto_rules(model, mesh, batch=batch, optimizer="adam")
    step = kml.compile_step(_mlp, kml.ModelParallel(mesh, rules), batch, batch, optimizer="adam")
    assert step.device_kind == kml.parse_target(target).device_kind
    measured = step.comm.wire_bytes_by_axis
    assert set(measured) == {"data", "model"}
    for axis, sent in measured.items():
        assert rules.cost.wire_bytes_by_axis[axis] / sent == pytest.approx(1.0, abs=0.001), axis
    assert rules.cost.peak_bytes / step.peak_bytes == pytest.approx(PEAKS[target], abs=0.002)


#: Fully sharded over both axes (input 512 → Dense 512 → LayerNormalization → Dense 1024, 64 rows of
#: 8 per batch shard) -> predicted ÷ compiled `data×model` bytes (libtpu 0.0.42.1). Over 64 devices
#: XLA:TPU gathers each kernel's bfloat16 copy as an all-reduce of its shard written into zeros (twice
#: an all-gather's bytes): 0.518 on v5p 4x4x4 (and Mixtral 8x7 B's output table there, 0.500) while
#: predicted as all-gathers; over 32 devices it all-gathers them.
REDUCED_GATHERS = {
    "tpu-v5p:4x4x4": ((8, 8), "all-reduce", 0.994),
    "tpu-v5e:8x8": ((8, 8), "all-reduce", 0.994),
    "tpu-v5e:4x8": ((8, 4), "all-gather", 1.020),
}


def _norm_head() -> keras.Model:
    x = keras.Input((512,))
    h = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(512, name="pre")(x))
    return keras.Model(x, keras.layers.Dense(1024, use_bias=False, name="head")(h))


@pytest.mark.parametrize("target", sorted(REDUCED_GATHERS), ids=sorted(REDUCED_GATHERS))
def test_over_64_devices_a_small_kernel_split_over_both_axes_is_gathered_as_an_all_reduce(target):
    (data, model), kind, expected = REDUCED_GATHERS[target]
    mesh = kml.Mesh(data=data, model=model, target=target)
    x = jax.ShapeDtypeStruct((data * 8, 512), "float32")
    y = jax.ShapeDtypeStruct((data * 8, 1024), "float32")
    with kml.dry_build(_norm_head) as head:
        rules = plan_rules(head, mesh, batch=x, optimizer="adam", fully_sharded=True)
    assert {c.unit: c.layout for c in rules.cost.choices}["head/kernel"] == "fully sharded"
    step = kml.compile_step(_norm_head, kml.ModelParallel(mesh, rules), x, y, optimizer="adam", loss="mse")
    table = [t for t in step.comm.transfers if len(t.axes) == 2 and t.shape == (512, 1024)]
    gathers = {t.kind for t in table if t.dtype == "bf16"}
    assert gathers == {kind}, gathers
    both = rules.cost.wire_bytes_by_axis["data×model"] / step.comm.wire_bytes_by_axis["data×model"]
    assert both == pytest.approx(expected, abs=0.002)


def test_a_budget_on_a_tpu_target_keeps_27_percent_for_the_walks_error():
    """On a TPU target the walk is 0.87-1.06 of XLA:TPU's compiled peak (`benchmarks/targets.py`), and
    0.734 over long sequences, where XLA:TPU's heap packs loosely (docs/status.md), so a plan said to
    fit keeps 27% of the budget free (5% where the walk follows XLA:CPU): a budget the smallest plan
    fits with 20% to spare is refused, naming the budget it needs."""

    def build():
        layers = [keras.Input((256,)), keras.layers.Dense(1024), keras.layers.Dense(256)]
        return keras.Sequential(layers, name="mlp")

    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    x = jax.ShapeDtypeStruct((64, 256), "float32")
    with kml.dry_build(build) as model:
        least = plan_rules(model, mesh, batch=x, optimizer="adam", fully_sharded=True).cost.peak_bytes
        with pytest.raises(kml.MemoryBudgetError, match="27% headroom") as refused:
            kml.auto_rules(model, mesh, memory_budget=int(least / 0.80), batch=x, optimizer="adam")
        needed = refused.value.smallest_bytes
        assert needed == math.ceil(least / 0.73)
        rules = kml.auto_rules(model, mesh, memory_budget=needed, batch=x, optimizer="adam")
    assert rules.cost.peak_bytes <= 0.73 * needed


def test_a_mesh_of_tpu_devices_without_a_target_plans_as_its_generation():
    """On a TPU machine `kml.Mesh(data=..., model=...)` holds TPU devices and no target: the planner
    follows XLA:TPU for their generation (read off `device_kind`) as it does for `target=` (it followed
    XLA:CPU: a TPU VM's plan was costed and its peak walked as on a CPU)."""
    from keras_meshlayout.core._targets import target_devices
    from keras_meshlayout.planner._peak import chip_of, compiler_of, generation_of

    declared = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    found = kml.Mesh(data=2, model=4, devices=target_devices("tpu-v5e:2x4"))
    assert found.target is None
    assert generation_of(found).name == "tpu-v5e"
    assert (compiler_of(found), chip_of(found)) == (compiler_of(declared), chip_of(declared))
    assert compiler_of(kml.Mesh(data=2, model=4)) == "cpu"
    build = LMS["llama3"]
    x = {n: jax.ShapeDtypeStruct((LM_BATCH, LM_LENGTH), "int32") for n in ("token_ids", "padding_mask")}
    with kml.dry_build(build) as model:
        costs = [kml.auto_rules(model, mesh, batch=x, optimizer="adam").cost for mesh in (declared, found)]
    assert costs[0].peak_bytes == costs[1].peak_bytes
    assert costs[0].wire_bytes_by_axis == costs[1].wire_bytes_by_axis


def test_float8_projections_sharing_an_input_share_its_gradients_all_reduce_on_xla_tpu():
    """Each float8 projection quantizes and dequantizes its input on its own; XLA:TPU still sums their
    input gradients before one all-reduce over 'model' (query, key and value: one; gate and up: one).
    Predicted 1.60x the TPU HLO's bytes there before the merge looked through the quantizing."""
    from hub_models import BATCH, inputs_for
    from test_adapters import build_float8

    mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
    with kml.dry_build(build_float8) as model:
        x = inputs_for(model)
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam", replicate_below=0)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    step = kml.compile_step(
        build_float8,
        kml.ModelParallel(mesh, rules),
        x,
        jax.ShapeDtypeStruct((BATCH,), "int32"),
        optimizer="adam",
        loss=loss,
    )
    measured = {axis: b for axis, b in step.comm.wire_bytes_by_axis.items() if b > 64}  # not amax maxima
    predicted = {axis: b for axis, b in rules.cost.wire_bytes_by_axis.items() if b > 64}
    assert set(predicted) == set(measured) == {"data", "model"}
    for axis in measured:
        assert predicted[axis] / measured[axis] == pytest.approx(1.0, abs=0.02), (axis, predicted, measured)
