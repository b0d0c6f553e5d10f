"""The zoo: the automatic planner across what real models are made of (issue 19's proof).

One table (`ARCHS`) of architectures, each a small model built from a real
constructor: every keras-hub text backbone of `hub_models.ROWS` at a realistic
vocabulary : hidden ratio (1,024 rows at hidden 64, as `benchmarks/planner_zoo.py`),
pooled under a small classifier head; keras.applications convnets (`weights=None`,
32 × 32 images) and keras-hub's ResNet; a keras-hub vision transformer; and one
LoRA (`enable_lora(4)`), one int8, one int4 and one float8 (`quantize(...)`) Llama, one block
deep. Each is planned
with Adam for one batch on data=2 × model=4 (`replicate_below=0`: at these
sizes the policy's threshold would keep kernels whole that are millions of
elements in the real models) and checked for:

1. the no-budget plan's parameters per device ÷ the tensor-parallel ideal
   (parameters ÷ 4) within its family's bound (`BOUNDS`);
2. the smallest memory-budget plan's state per device ÷ the fully sharded floor
   (total state ÷ 8) within `FLOOR_BOUND` (and, for the convnets, its search under a
   minute: `tests/test_convs.py` leaves both to this module);
3. the predicted bytes per step = the compiled step's, per mesh axis, ± 2%
   (`kml.compile_step`, from a dry build; rows planned exactly like another
   are compiled once, `SAME_STEP`; the few that take 40-100 s to compile are
   in `NOT_COMPILED` with the figures measured once);
4. keras-hub's hand-written layout maps (`Backbone.get_layout_map`) matched or
   beaten by the no-budget plan on state per device and on compiled bytes per step;
5. the no-budget plan's predicted peak per device within 10% of the compiled step's
   (issue 21, item 3; the same compile as 3.).

A model that misses a check today is in `MISSES` with the figure measured and
why (a strict xfail: it fails as soon as the miss is fixed). Sharded `fit`
against one device is `tests/test_hub.py`'s, one backbone per family.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Callable

import keras
import keras_hub
import numpy as np
import pytest
from hub_models import BATCH, ROWS, Row, build_classifier, fresh_names, inputs_for, marks
from test_convs import CONVNETS, IMAGE, images

import keras_meshlayout as kml
from keras_meshlayout.planner._headroom import PEAK_HEADROOM

VOCAB = 1024  # 16 × hidden, a realistic vocabulary : hidden ratio (Llama-3 8B: 31; BERT: 40)
MESH = {"data": 2, "model": 4}
#: No-budget parameters per device ÷ the tensor-parallel ideal, by family (issue 19).
BOUNDS = {
    "dense text": 1.15, "MoE": 1.25, "convnet": 1.5, "vision": 1.15, "two towers": 1.15, "adapter": 1.15,
}  # fmt: skip
FLOOR_BOUND = 1.10  # smallest budget plan ÷ fully sharded floor, every family
TOLERANCE = 0.02  # predicted ÷ compiled bytes per axis
PEAK_TOLERANCE = 0.10  # predicted ÷ compiled peak per device
MOE = {"GptOssBackbone", "MixtralBackbone", "QwenMoeBackbone", "Qwen3MoeBackbone", "Qwen3_5MoeBackbone"}
#: keras-hub 0.32's backbones with a hand-written `get_layout_map` (Llama3's and Qwen2's are Llama's and
#: Qwen's).
HAND_MAPS = ("GemmaBackbone", "LlamaBackbone", "QwenBackbone", "QwenMoeBackbone", "Qwen3MoeBackbone")

#: Rows planned exactly as another (the same weights' shapes and layouts, in any order, the same
#: predicted bytes per axis and state; `test_rows_that_share_a_compile_are_planned_alike` checks it)
#: are compiled once, as that other.
SAME_STEP = {
    "Llama3Backbone": "LlamaBackbone",
    "MistralBackbone": "LlamaBackbone",
    "Phi3Backbone": "LlamaBackbone",
    "OPTBackbone": "GPT2Backbone",
    "DistilBertBackbone": "GPT2Backbone",
    "RobertaBackbone": "GPT2Backbone",
    "XLMRobertaBackbone": "GPT2Backbone",
    "ElectraBackbone": "BertBackbone",
}
#: Not compiled here, and why, with the figures measured once (2026-12-02, predicted ÷ compiled bytes):
#: their compiles take 40-100 s each on 2 cores, more than the fits this module replaced saved.
_DELTA_NET = (
    "125 s compile; its depthwise conv1d kernel split on its channels (planner/_convs.lone_grouped_convs, "
    "so that XLA computes its gradient right): 'data×model' 1.000 (28,672; the conv's 3,584-byte gradient "
    "sum over both axes is gone), 'data' 1.218 (146,060 predicted, 119,924 compiled) and 'model' 0.484 "
    "(118,784 vs 245,224): XLA carries the channel split into the delta rule's slices and the "
    "projections' gradients and updates, not predicted (the sliced conv mixer's strict xfail in "
    "tests/test_grouped_conv.py). Before: 'data' 1.010, 'model' 0.999, 3,584 bytes over both axes unpredicted"
)
NOT_COMPILED = {
    "Qwen3_5Backbone": _DELTA_NET,
    "Qwen3_5MoeBackbone": "100 s compile; measured before its conv1d kernel was split (not since; "
    "Qwen3_5Backbone's figures): 'data' 1.012 (174,844 compiled; the router's gathers and "
    "load-balancing loss exact, the depthwise conv1d's 2,048-byte gradient sum sent over 'data'×'model' "
    "instead), 'model' 0.999, and 3,584 bytes over 'data'×'model' not predicted",
    "EfficientNetB0": "47 s compile; 'data' 1.000, 'model' 1.000 (586,800 compiled; was 1.134)",
    "MobileNetV3Small": "41 s compile; 'data' 1.002, 'model' 1.000 (216,048 compiled; was 0.958)",
}
#: Measured 2026-12-02 (keras-hub 0.32, jax 0.10.2, XLA:CPU); the planner's open work (issue 19).
_HAND_2D = (
    "its attention and MLP kernels are over both axes too, 2-D candidates that send more per step "
    "(the plan without a budget is the least traffic; a budget takes them)"
)
MISSES: dict[tuple[str, str], str] = {
    ("GemmaBackbone", "hand_budget"): "MemoryBudgetError at the map's compiled peak ÷ 0.95 (478,438 "
    "bytes): the smallest plan is predicted at 464,076, 1.050 of its compiled 441,960 (2026-12-07): "
    "the walk holds each RMS norm's x / sqrt(var), which XLA:CPU recomputes from the residual in the "
    "backward pass (8 KiB a norm), and counts the vocab-parallel look-up's rows in batch shards where "
    "XLA:CPU holds them whole (16 KiB, not 8); both counted, Qwen's budget plan compiles over the map "
    "(docs/status.md); it passed while the walk left out the table gradient's zeros, which XLA:CPU "
    "allocates early in the forward pass (32 KiB a device)",
    # predicted ÷ compiled bytes per step, by axis
    # keras-hub's hand maps (2-D: key/value and embeddings over both axes) vs the no-budget plan
    ("GemmaBackbone", "hand_memory"): "1.167× the hand map's state (343,208 vs 294,056 bytes per device; "
    f"the table over both axes since): {_HAND_2D}",
    ("QwenBackbone", "hand_memory"): "1.819× the hand map's state (542,376 vs 298,152; the table over both "
    f"axes since): {_HAND_2D}",
}


@dataclasses.dataclass(frozen=True)
class Arch:
    """One architecture of the zoo: how to build it and feed it, its family."""

    name: str
    family: str
    build: Callable[[], keras.Model]
    data: Callable[[keras.Model], tuple]
    marks: tuple = ()


def _tokens(model: keras.Model) -> tuple:
    return inputs_for(model), np.zeros(BATCH, "int32")


def _images(model: keras.Model) -> tuple:
    return images(BATCH, IMAGE)


def _wide(row: Row) -> Row:
    """The row at the zoo's vocabulary."""
    config = {k: VOCAB if k in ("vocabulary_size", "vocab_size") else v for k, v in row.config.items()}
    return dataclasses.replace(row, config=config)


def _text(row: Row) -> Arch:
    family = "MoE" if row.name in MOE else "dense text"
    build = fresh_names(functools.partial(build_classifier, _wide(row)))
    return Arch(row.name, family, build, _tokens, tuple(marks(row)))


def vit() -> keras.Model:
    """keras-hub's vision transformer (16 patches of 8 × 8 and a class token) under a pooled head."""
    backbone = keras_hub.models.ViTBackbone(
        image_shape=IMAGE,
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=64,
        mlp_dim=128,
        name="backbone",
    )
    inputs = keras.Input(IMAGE)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(pooled), name="classifier")


#: Token positions of the two-tower and speech rows' text.
SEQUENCE = 16


def _two_towers(vision: type, text: type, backbone: type, name: str, **config) -> keras.Model:
    """A keras-hub two-tower backbone (each tower two blocks, 16 patches of 8 × 8 and 16 tokens) under
    its image → text logits, trained as CLIP is: each image's caption its class."""
    towers = (
        vision(patch_size=8, hidden_dim=64, num_layers=2, num_heads=4, intermediate_dim=256,
               image_shape=IMAGE, name="vision"),
        text(vocabulary_size=VOCAB, embedding_dim=64, hidden_dim=64, num_layers=2, num_heads=4,
             intermediate_dim=256, max_sequence_length=SEQUENCE, name="text"),
    )  # fmt: skip
    both = backbone(*towers, name="backbone", **config)
    return keras.Model(both.input, both(both.input)["vision_logits"], name=name)


def clip() -> keras.Model:
    hub = keras_hub.models
    return _two_towers(
        hub.CLIPVisionEncoder, hub.CLIPTextEncoder, hub.CLIPBackbone, "clip", projection_dim=64
    )


def siglip() -> keras.Model:
    hub = keras_hub.models
    return _two_towers(hub.SigLIPVisionEncoder, hub.SigLIPTextEncoder, hub.SigLIPBackbone, "siglip")


def whisper() -> keras.Model:
    """keras-hub's Whisper (2 encoder and 2 decoder blocks over 32 frames of 16 mels), its decoder pooled."""
    backbone = keras_hub.models.WhisperBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=64, intermediate_dim=256, num_mels=16,
        max_encoder_sequence_length=32, max_decoder_sequence_length=SEQUENCE, name="backbone",
    )  # fmt: skip
    decoded = backbone(backbone.input)["decoder_sequence_output"]
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(decoded)
    return keras.Model(backbone.input, keras.layers.Dense(10, name="head")(pooled), name="whisper")


def _image_text(model: keras.Model) -> tuple:
    x = {"images": images(BATCH, IMAGE)[0], "token_ids": np.zeros((BATCH, SEQUENCE), "int32")}
    return x, np.arange(BATCH, dtype="int32")


def _speech(model: keras.Model) -> tuple:
    x = {
        "encoder_features": np.zeros((BATCH, 32, 16), "float32"),
        "decoder_token_ids": np.zeros((BATCH, SEQUENCE), "int32"),
        "decoder_padding_mask": np.ones((BATCH, SEQUENCE), "int32"),
    }
    return x, np.zeros(BATCH, "int32")


#: The adapter rows' Llama, one block deep: what an adapter or an int8 kernel adds is per block, and
#: the second block compiled the same again (int8: 24 s of compile at two blocks).
_LLAMA = _wide(next(row for row in ROWS if row.name == "LlamaBackbone"))
_LLAMA = dataclasses.replace(_LLAMA, config=dict(_LLAMA.config, num_layers=1))


def lora_llama() -> keras.Model:
    model = build_classifier(_LLAMA)
    model.get_layer("backbone").enable_lora(4)
    return model


def int8_llama() -> keras.Model:
    model = build_classifier(_LLAMA)
    with warnings.catch_warnings():  # Keras warns for each layer it has no int8 form of (norms, dropout)
        warnings.filterwarnings("ignore", "Layer .* does not have a `quantize` method", UserWarning)
        model.quantize("int8")
    return model


def quantized_llama(mode: str) -> keras.Model:
    model = build_classifier(_LLAMA)
    with warnings.catch_warnings():  # for the layers with no such form (norms, dropout; tables under float8)
        warnings.filterwarnings("ignore", "Layer .* does not have a `quantize` method", UserWarning)
        warnings.filterwarnings("ignore", "Invalid quantization mode", UserWarning)
        model.quantize(mode)
    return model


ARCHS = {
    arch.name: arch
    for arch in [
        *(_text(row) for row in ROWS),
        *(Arch(name, "convnet", build, _images) for name, build in CONVNETS.items()),
        Arch("ViTBackbone", "vision", vit, _images),
        Arch("CLIPBackbone", "two towers", fresh_names(clip), _image_text),
        Arch("SigLIPBackbone", "two towers", fresh_names(siglip), _image_text),
        Arch("WhisperBackbone", "dense text", fresh_names(whisper), _speech),
        Arch("LoRA-Llama", "adapter", fresh_names(lora_llama), _tokens),
        Arch("int8-Llama", "adapter", fresh_names(int8_llama), _tokens),
        Arch("int4-Llama", "adapter", fresh_names(functools.partial(quantized_llama, "int4")), _tokens),
        Arch("float8-Llama", "adapter", fresh_names(functools.partial(quantized_llama, "float8")), _tokens),
    ]
}


def mesh() -> kml.Mesh:
    return kml.Mesh(**MESH)


def _params(check: str, names=None) -> list:
    """One `pytest.param` per architecture, a strict xfail where `MISSES` names it for `check`."""
    params = []
    for name in names or ARCHS:
        arch_marks = list(ARCHS[name].marks)
        if (name, check) in MISSES:
            arch_marks.append(pytest.mark.xfail(strict=True, reason=MISSES[name, check]))
        params.append(pytest.param(name, id=name, marks=arch_marks))
    return params


@dataclasses.dataclass(frozen=True)
class Planned:
    """An architecture's no-budget and smallest plans, its batch, and its parameter counts."""

    rules: kml.LayoutRules
    smallest: kml.LayoutRules | None  # within the smallest budget the search can meet
    layout: tuple  # (shape, axes) of every weight, in order
    x: object
    y: object
    parameters: int
    trainable: int
    per_device: int  # parameters per device under `rules`
    search_seconds: float  # the smallest budget's search: the 1-byte budget refused, then that budget


def _layout(model: keras.Model, rules: kml.LayoutRules) -> tuple:
    """`(shape, axes)` of each weight under the rules."""
    layout = []
    for variable in model.weights:
        rule = rules.match(variable.path)
        layout.append((tuple(variable.shape), rule.expand(len(variable.shape)) if rule is not None else ()))
    return tuple(layout)


def _per_device(layout: tuple) -> int:
    def shards(entry) -> int:  # an entry names no axis, one, or several (a table over both axes)
        return math.prod(MESH[a] for a in (entry if isinstance(entry, tuple) else (entry,)) if a)

    return sum(math.prod(shape) // math.prod(map(shards, axes)) for shape, axes in layout)


@functools.cache
def planned(name: str) -> Planned:
    """The no-budget and the smallest-budget plans of one dry build (nothing allocated), once each."""
    arch = ARCHS[name]
    with kml.dry_build(arch.build) as model:
        x, y = arch.data(model)
        options = dict(replicate_below=0, batch=x, optimizer="adam")
        rules = kml.auto_rules(model, mesh(), **options)
        start = time.perf_counter()
        try:
            kml.auto_rules(model, mesh(), memory_budget=1, **options)
            smallest = None  # a 1-byte budget fitted: the test says so
        except kml.MemoryBudgetError as error:
            smallest = kml.auto_rules(model, mesh(), memory_budget=error.smallest_bytes, **options)
        search_seconds = time.perf_counter() - start
        parameters = sum(math.prod(v.shape) for v in model.weights)
        trainable = sum(math.prod(v.shape) for v in model.trainable_weights)
        layout = _layout(model, rules)
        per_device = _per_device(layout)
        return Planned(rules, smallest, layout, x, y, parameters, trainable, per_device, search_seconds)


@pytest.mark.parametrize("name", _params("no_budget"))
def test_no_budget_parameters_per_device_near_the_tensor_parallel_ideal(name):
    got = planned(name)
    ratio = got.per_device / (got.parameters / MESH["model"])
    assert ratio <= BOUNDS[ARCHS[name].family], f"{name}: {ratio:.3f}× the tensor-parallel ideal"


@pytest.mark.parametrize("name", _params("smallest"))
def test_smallest_budget_plan_near_the_fully_sharded_floor(name):
    got = planned(name)
    assert got.smallest is not None, f"{name}: a budget of 1 byte raised no MemoryBudgetError"
    # Adam: a trainable parameter's value, gradient and two slots; a frozen one's value.
    floor = (16 * got.trainable + 4 * (got.parameters - got.trainable)) / math.prod(MESH.values())
    ratio = got.smallest.cost.state_bytes / floor
    assert ratio <= FLOOR_BOUND, f"{name}: {ratio:.3f}× the fully sharded floor"
    if ARCHS[name].family == "convnet":  # ResNet50's search took minutes before: seconds now (2.4 s idle)
        took = got.search_seconds
        assert took < 60, f"{name}: the smallest budget's search took {took:.1f} s"


@functools.cache
def compiled(name: str, hand: bool = False, budget: int | None = None) -> tuple[kml.CommReport, int, int]:
    """The Adam step compiled from a dry build under the auto plan (or keras-hub's own map).

    Returns its communication report, the plan's state bytes per device (parameters,
    gradients, Adam's slots) and the compiled step's peak bytes per device. With `budget`, the
    plan is `auto_rules(memory_budget=budget)`'s instead of the no-budget one. Nothing is
    allocated: `kml.compile_step` lowers Keras's own `train_step` for the plan's shardings.
    """
    arch, got = ARCHS[name], planned(name)
    if hand:
        layout_map = getattr(keras_hub.models, name).get_layout_map(mesh(), data_parallel_dim_name="data")
        dist = kml.ModelParallel(mesh(), kml.rules_from_layout_map(layout_map), replicate_below=0)
    else:
        dist = kml.ModelParallel(mesh(), got.rules if budget is None else budgeted(name, budget))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    with warnings.catch_warnings():  # the hand maps split key/value heads that do not divide (replicated),
        warnings.simplefilter("ignore", kml.IndivisibleShapeWarning)
        warnings.simplefilter("ignore", kml.UnmatchedRuleWarning)  # Qwen3Moe's map names a dense MLP it lacks
        step = kml.compile_step(arch.build, dist, got.x, got.y, optimizer="adam", loss=loss)
        memory = kml.dry_plan(arch.build, dist, optimizer="adam").memory()
    return step.comm, memory.parameters + memory.gradients + memory.optimizer, step.peak_bytes


def budgeted(name: str, budget: int) -> kml.LayoutRules:
    """`auto_rules(memory_budget=budget)` on a dry build of `name`, as `planned` calls it."""
    arch, got = ARCHS[name], planned(name)
    with kml.dry_build(arch.build) as model:
        options = dict(replicate_below=0, batch=got.x, optimizer="adam")
        return kml.auto_rules(model, mesh(), memory_budget=budget, **options)


COMPILED = [name for name in ARCHS if name not in SAME_STEP and name not in NOT_COMPILED]


@pytest.mark.parametrize("name", _params("compiled", COMPILED))
def test_predicted_bytes_per_axis_match_the_compiled_step(name):
    got = planned(name)
    report, state, _ = compiled(name)
    predicted, measured = got.rules.cost.wire_bytes_by_axis, report.wire_bytes_by_axis
    for axis in sorted(set(predicted) | set(measured)):
        want = measured.get(axis, 0.0)
        assert predicted.get(axis, 0.0) == pytest.approx(want, rel=TOLERANCE), (
            f"{name} over {axis!r}: predicted {predicted.get(axis, 0.0):,.0f}, compiled {want:,.0f} bytes"
        )
    assert got.rules.cost.state_bytes == state


@pytest.mark.parametrize("name", _params("peak", COMPILED))
def test_the_predicted_peak_is_within_ten_percent_of_the_compiled_one(name):
    """Regression: 11 of these 35 were over by 11-23% (Llama 1.226, T5 1.218, BART 1.202): the walk wrote
    an unread table's zero gradient and summed it, summed whole the gradient of a table whose rows move,
    and left a shared table's per-look-up gradients whole (`planner/_liveness.py`, `_propagate.py`)."""
    predicted, (_, _, peak) = planned(name).rules.cost.peak_bytes, compiled(name)
    ratio = predicted / peak
    assert ratio == pytest.approx(1.0, abs=PEAK_TOLERANCE), f"{name}: {predicted:,} vs {peak:,} bytes"


HAND = [
    pytest.param(
        name,
        measure,
        id=f"{name}-{measure}",
        marks=[pytest.mark.xfail(strict=True, reason=MISSES[key])]
        if (key := (name, f"hand_{measure}")) in MISSES
        else [],
    )
    for name in HAND_MAPS
    for measure in ("memory", "bytes")
]


@pytest.mark.parametrize(("name", "measure"), HAND)
def test_the_auto_plan_matches_or_beats_keras_hubs_hand_map(name, measure):
    """State per device and compiled bytes per step: the no-budget auto plan ≤ keras-hub's map."""
    (auto_report, auto_state, _), (hand_report, hand_state, _) = compiled(name), compiled(name, hand=True)
    if measure == "memory":
        assert auto_state <= hand_state, f"{name}: auto {auto_state:,} vs hand {hand_state:,} bytes of state"
    else:
        auto, hand = auto_report.wire_bytes, hand_report.wire_bytes
        assert auto <= hand, f"{name}: auto sends {auto:,.0f} vs hand {hand:,.0f} bytes per step"


@pytest.mark.parametrize("name", _params("hand_budget", list(HAND_MAPS)))
def test_the_hand_maps_memory_as_the_budget_gives_a_plan_no_bigger_and_no_chattier(name):
    """The hand map's compiled peak (plus the planner's headroom) as `memory_budget`: a plan whose
    compiled peak is no bigger than the map's and that sends no more bytes per step.

    "No bigger" is measured as the budget is, by the compiled peak: `memory_budget` bounds the
    step's peak, and within it the search buys the least traffic, with state if that is what the
    room allows (Qwen: 444,072 bytes of state against the map's 298,152, at a compiled peak of
    594,436 against its 597,444 and 0.76x its bytes). A user who needs less state asks for it with
    a smaller budget. The headroom is the planner's margin for its own prediction, not room to
    exceed the map: the compiled peak is held to the map's, up to that prediction's error (2.5%).
    """
    hand_report, _, hand_peak = compiled(name, hand=True)
    budget = math.ceil(hand_peak / (1 - PEAK_HEADROOM))  # as `MemoryBudgetError.smallest_bytes`
    report, _, peak = compiled(name, budget=budget)
    # The search fills its budget less the headroom, by the predicted peak: compiled, a plan there
    # exceeds the map by the prediction's own error. Gemma's budget plan is predicted at 0.980 of its
    # compiled peak (454,376 of 463,620 bytes: 1.02x the map's 454,516; the plan found before the
    # walk kept grouped query heads split, 0.978 of 441,960, happened to land under the map's).
    assert peak <= hand_peak * 1.025, (
        f"{name}: budget {budget:,}: compiled peak {peak:,}, the map's {hand_peak:,}"
    )
    assert report.wire_bytes <= hand_report.wire_bytes, (
        f"{name}: budget {budget:,}: auto sends {report.wire_bytes:,.0f}, hand {hand_report.wire_bytes:,.0f}"
    )


@pytest.mark.parametrize("name", list(SAME_STEP), ids=list(SAME_STEP))
def test_rows_that_share_a_compile_are_planned_alike(name):
    got, other = planned(name), planned(SAME_STEP[name])
    assert collections.Counter(got.layout) == collections.Counter(other.layout)  # as multisets: the order
    assert got.rules.cost.wire_bytes_by_axis == other.rules.cost.wire_bytes_by_axis
    assert got.rules.cost.state_bytes == other.rules.cost.state_bytes


def test_every_family_has_its_bound_and_every_miss_names_a_real_check():
    assert {arch.family for arch in ARCHS.values()} == set(BOUNDS)
    checks = {"no_budget", "smallest", "compiled", "peak", "hand_memory", "hand_bytes", "hand_budget"}
    assert not set(SAME_STEP) & set(SAME_STEP.values()) and set(SAME_STEP.values()) <= set(COMPILED)
    for name, check in MISSES:
        assert name in ARCHS and check in checks, (name, check)
        assert not check.startswith("hand") or name in HAND_MAPS, (name, check)
