"""The memory-budget planner: `kml.auto_rules(model, mesh, memory_budget=..., batch=...)`.

Its predicted bytes are checked against the compiled HLO (`kml.comm_report`)
and the plan's own memory figures, and a plan it makes under a tight budget
trains like one device.
"""

import functools
import re
import warnings

import keras
import keras_hub
import numpy as np
import pytest
from helpers import Reference, assert_laid_out_as_planned, assert_same_weights, train

import keras_meshlayout as kml

BATCH, LENGTH, CLASSES = 16, 16, 10
MESHES = {"2x4": (2, 4), "4x2": (4, 2)}


def build(arch: str) -> keras.Model:
    """A small keras-hub decoder with a pooled classification head."""
    if arch == "llama":  # grouped-query attention: 2 key/value heads for 8 query heads
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=512, num_layers=2, num_query_heads=8, num_key_value_heads=2,
            hidden_dim=128, intermediate_dim=512, dropout=0.0,
        )  # fmt: skip
    else:  # Gemma: one key/value head, heads-first kernels, gated FFN
        backbone = keras_hub.models.GemmaBackbone(
            vocabulary_size=512, num_layers=2, num_query_heads=8, num_key_value_heads=1,
            hidden_dim=128, intermediate_dim=1024, head_dim=16, dropout=0.0,
        )  # fmt: skip
    inputs = {
        name: keras.Input((LENGTH,), dtype="int32", name=name) for name in ("token_ids", "padding_mask")
    }
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(backbone(inputs))
    return keras.Model(inputs, keras.layers.Dense(CLASSES, name="head")(pooled), name=arch)


def batch(size: int = BATCH) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "token_ids": rng.integers(0, 512, (size, LENGTH)).astype("int32"),
        "padding_mask": np.ones((size, LENGTH), "int32"),
    }


@functools.cache
def reference_model(arch: str) -> keras.Model:
    keras.distribution.set_distribution(None)
    return build(arch)


@functools.cache  # deterministic: the no-budget plans are asked for again by each budget derived from them
def plan_for(arch: str, mesh_name: str, budget) -> tuple[kml.Mesh, kml.LayoutRules]:
    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    rules = kml.auto_rules(
        reference_model(arch), mesh, replicate_below=0, memory_budget=budget, batch=batch(), optimizer="adam"
    )
    return mesh, rules


def tp_memory(arch: str, mesh_name: str) -> int:
    return plan_for(arch, mesh_name, None)[1].cost.memory_bytes


def state_budget(arch: str, mesh_name: str, fraction: float) -> int:
    """A budget of the no-budget plan's batch, activations and temporaries, and `fraction` of its state.

    The budget is compared with the predicted peak; only the state shrinks with the layouts.
    """
    cost = plan_for(arch, mesh_name, None)[1].cost
    return cost.activation_bytes + int(cost.state_bytes * fraction)


# Budgets: the no-budget (tensor-parallel) plan's activations and a fraction of its state
# (`state_budget`); `inf` = least traffic.
AGREEMENT = [
    ("llama", "2x4", None),
    ("llama", "2x4", 1.0),
    ("llama", "4x2", None),
    ("llama", "4x2", float("inf")),
    ("llama", "4x2", 0.8),
    ("gemma", "2x4", 1.05),
    ("gemma", "4x2", None),
    ("gemma", "4x2", 1.0),  # 2-D kernels of 128 KiB and more, gathered again for the backward pass
]

#: What each budgeted case of AGREEMENT chooses, unit by unit (issue 20: one outcome, not "2-D or
#: vocab-parallel"): the budgets are tight enough that some kernels go 2-D and the token table
#: vocab-parallel, loose enough that most units stay as the least-traffic plan has them. The budget is
#: compared with the predicted peak, with 5% headroom (issue 21): a unit left replicated keeps its
#: activations whole over the model axis, so the state cut to fit differs from the fraction alone.
CHOSEN_LAYOUTS = {
    # The key/value kernels (2 heads on model=4, 1 on model=2) are split on head_dim (issue 19 item 4).
    ("llama", "2x4", 1.0): {
        "replicated": 7,
        "2-D": 2,
        "tensor-parallel": 2,
        "vocab-parallel": 1,
        "split, unused": 1,
        "head_dim split": 4,
    },
    # Since the walk neither writes nor sums the unread output table's zero gradient and scatters the
    # token table's gradient into early zeros (planner/_liveness.py), the budget (the no-budget plan's
    # activations and 80% of its state) is 4,515,604 bytes, was 4,908,820. Since a gradient's product
    # read by its transpose is one buffer and its sum over `data` waits for the end of the backward
    # pass (2026-12-06): one unit fully sharded (was two), predicted peak 4,085,160 (was 4,139,176),
    # compiled 4,410,332 (0.926; was 4,398,876), under the budget.
    ("llama", "4x2", 0.8): {
        "replicated": 6,
        "2-D": 2,
        "fully sharded": 1,
        "tensor-parallel": 2,
        "split, unused": 1,
    },
    ("gemma", "2x4", 1.05): {
        "replicated": 7,
        "2-D": 2,
        "tensor-parallel": 2,
        "vocab-parallel": 1,
        "head_dim split": 4,
    },
    ("gemma", "4x2", 1.0): {
        "replicated": 6,
        "2-D": 2,
        "tensor-parallel": 2,
        "vocab-parallel": 1,
        "head_dim split": 4,
    },
}


@pytest.mark.parametrize(("arch", "mesh_name", "fraction"), AGREEMENT)
def test_predicted_bytes_match_the_compiled_step(arch, mesh_name, fraction):
    budget = (
        None
        if fraction is None
        else "1TB"
        if fraction == float("inf")
        else state_budget(arch, mesh_name, fraction)
    )
    mesh, rules = plan_for(arch, mesh_name, budget)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    keras.distribution.set_distribution(dist)
    model = build(arch)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = kml.comm_report(model, batch(), np.zeros(BATCH, "int32"))
    model.optimizer.build(model.trainable_variables)
    memory = dist.plan(model).memory()

    cost = rules.cost
    for axis, measured in report.wire_bytes_by_axis.items():
        assert cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis
    assert cost.state_bytes == memory.parameters + memory.gradients + memory.optimizer
    if budget is not None and fraction != float("inf"):
        assert cost.memory_bytes <= budget
        assert cost.layouts() == CHOSEN_LAYOUTS[arch, mesh_name, fraction]


def test_no_budget_keeps_todays_rules():
    """With a batch, the rules are those without one, the grouped-query key/value kernels included.

    Their 2 heads do not divide model=4: both plans split them on head_dim, which over a batch axis
    of 2 sends as many bytes at less state (issue 19 item 4; the plan without a batch kept them
    replicated until `_by_layers.kv_head_dim`).
    """
    mesh = kml.Mesh(data=2, model=4)
    plain = kml.auto_rules(reference_model("llama"), mesh, replicate_below=0)
    costed = plan_for("llama", "2x4", None)[1]
    kv = re.compile(r".*/(key|value)/kernel")
    assert [r.pattern for r in plain.rules] == [r.pattern for r in costed.rules]
    for before, after in zip(plain.rules, costed.rules, strict=True):
        assert before.axes == after.axes, before.pattern
        if kv.fullmatch(before.pattern):
            assert before.axes == (None, None, "model"), before.pattern
    assert sum(bool(kv.fullmatch(r.pattern)) for r in plain.rules) == 4
    assert plain.cost is None and costed.cost.budget is None


@pytest.mark.parametrize(
    ("mesh_name", "smallest"),
    # On 2x4 no plan fits 0.85 of the state: the fully sharded layouts it needs keep the attention's
    # and the MLP's activations whole over `model` (`_propagate.Specs._activations_first`), 3.4 MiB
    # predicted for a budget of 3.3 (its 0.9 plan compiles to 3,559,212 bytes, 1.06x that prediction).
    [("2x4", 0.9), ("4x2", 0.85)],
)
def test_smaller_budgets_never_send_less(mesh_name, smallest):
    full = tp_memory("llama", mesh_name)
    previous_wire, previous_memory = -1.0, None
    for fraction in (f for f in (4.0, 1.05, 1.0, 0.95, 0.9, 0.85) if f >= smallest):
        budget = state_budget("llama", mesh_name, fraction)
        cost = plan_for("llama", mesh_name, budget)[1].cost
        assert cost.memory_bytes <= budget
        assert cost.wire_bytes >= previous_wire - 1e-6
        previous_wire, previous_memory = cost.wire_bytes, cost.memory_bytes
    assert previous_memory < full


def test_least_traffic_plan_sends_no_more_than_tensor_parallel():
    no_budget = plan_for("llama", "2x4", None)[1].cost
    roomy = plan_for("llama", "2x4", "1TB")[1].cost
    assert roomy.wire_bytes < no_budget.wire_bytes
    assert "replicated" in roomy.layouts()  # small attention blocks send less left whole


def test_every_choice_is_explained_in_the_plan():
    mesh, rules = plan_for("llama", "2x4", state_budget("llama", "2x4", 0.9))
    keras.distribution.set_distribution(dist := kml.ModelParallel(mesh, rules, replicate_below=0))
    table = str(dist.plan(build("llama")))
    assert "2-D: saves" in table and "/device" in table and "per step" in table
    for choice in rules.cost.choices:
        assert choice.note.startswith(choice.layout)
    assert "sent per device per step" in str(rules.cost)


def test_a_budget_too_small_is_refused_with_the_smallest_plan_and_what_fills_its_peak():
    with pytest.raises(
        kml.MemoryBudgetError, match=r"smallest plan needs .* batch, activations and temporaries.*Fix"
    ) as error:
        plan_for("llama", "2x4", "1MB")
    # The three largest buffers live at that plan's peak, named after the operations writing them.
    said = str(error.value).split(" Largest at that peak: ")[1].split(". Fix:")[0]
    assert len(said.split(", ")) >= 3 and all(" from " in part for part in said.split("), ")), said


def test_a_budget_needs_a_batch():
    with pytest.raises(kml.InvalidOptionError, match="needs batch="):
        kml.auto_rules(reference_model("llama"), kml.Mesh(data=2, model=4), memory_budget="1GB")


def test_a_plan_under_a_tight_budget_trains_like_one_device():
    def build_gemma():
        return build("gemma")

    data = (batch(32), np.random.default_rng(1).integers(0, CLASSES, 32))
    reference = Reference(build_gemma, data)
    mesh, rules = plan_for("gemma", "2x4", state_budget("gemma", "2x4", 1.05))
    assert {"2-D", "vocab-parallel"} <= set(rules.cost.layouts())
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    model = train(build_gemma, reference.initial, data, dist)
    assert_same_weights(model, reference.trained)
    assert_laid_out_as_planned(model, dist.plan(model), mesh)


# Other keras-hub architectures (tests/hub_models.py): embeddings with positions sliced off a
# longer table (BERT), a table looked up twice (T5), fused query/key/value heads (Falcon), key/value
# kernels read by two projections (T5Gemma 2).
# keras-hub's T5 layers build inside their own call and drop a mask, which Keras flags.
@pytest.mark.filterwarnings(r"ignore:.*'transformer_(en|de)coder_layer_\d+'.*unbuilt state:UserWarning")
@pytest.mark.filterwarnings(r"ignore:Layer '\w+' \(of type T5MultiHeadAttention\) was passed an input with")
@pytest.mark.parametrize(
    ("backbone", "mesh_name", "tight"),
    [
        ("BertBackbone", "4x2", True),
        ("T5Backbone", "2x4", True),
        ("FalconBackbone", "4x2", False),
        # key/value kernels read twice (merged self/cross attention), split on head_dim: was 0.94
        ("T5Gemma2Backbone", "2x4", False),
    ],
)
def test_predicted_bytes_match_on_other_backbones(backbone, mesh_name, tight):
    import hub_models
    from keras.src.backend.common import global_state

    def fresh() -> keras.Model:
        # T5 leaves layer names to Keras's global counter: restart it so rebuilt paths match the rules.
        global_state.set_global_attribute("object_name_uids", None)
        return hub_models.build_classifier(row)

    row = next(row for row in hub_models.ROWS if row.name == backbone)
    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    with kml.dry_build(fresh) as probe:  # planned as built, without allocating its weights
        x = hub_models.inputs_for(probe)
        options = dict(replicate_below=0, batch=x, optimizer="adam")
        budget = None
        if tight:
            with pytest.raises(kml.MemoryBudgetError) as error:
                kml.auto_rules(probe, mesh, memory_budget=1, **options)
            budget = error.value.smallest_bytes
        rules = kml.auto_rules(probe, mesh, memory_budget=budget, **options)
    keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
    model = fresh()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = kml.comm_report(model, x, np.zeros(hub_models.BATCH, "int32"))
    assert rules.cost.wire_bytes == pytest.approx(report.wire_bytes, rel=0.02)
    if backbone == "BertBackbone":  # its position table, read through a slice, its width over both axes
        assert rules.match("position_embedding/embeddings").axes == (None, ("data", "model"))
        (choice,) = [c for c in rules.cost.choices if c.unit.endswith("position_embedding/embeddings")]
        moved = [t for t in report.transfers if t.layer.endswith("position_embedding")]
        assert choice.layout == "fully sharded"
        assert choice.wire_bytes == pytest.approx(sum(t.wire_bytes for t in moved), rel=0.02)


def test_a_biased_key_value_kernel_split_on_head_dim_is_predicted_and_trains():
    """Issue 19 item 4: Qwen's key/value projections have a bias, so no head_dim split was offered and
    the smallest plan held 1.42x the floor at replicate_below=0 (QwenMoe 1.25x). Split, XLA gathers the
    kernel and the projection's output over 'model'; the bias stays whole. Measured: 1.065x, 1.04x."""
    import hub_models
    from helpers import compiled_step

    row = next(row for row in hub_models.ROWS if row.name == "QwenBackbone")
    mesh = kml.Mesh(data=2, model=4)

    def build_qwen() -> keras.Model:
        return hub_models.build_classifier(row)

    y = np.random.default_rng(1).integers(0, hub_models.CLASSES, hub_models.BATCH).astype("int32")
    with kml.dry_build(build_qwen) as model:  # planned as built, without allocating its weights
        x = hub_models.inputs_for(model)
        options = dict(batch=x, optimizer="adam", replicate_below=0)
        with pytest.raises(kml.MemoryBudgetError) as error:
            kml.auto_rules(model, mesh, memory_budget=1, **options)
        rules = kml.auto_rules(model, mesh, memory_budget=error.value.smallest_bytes, **options)
    assert rules.cost.layouts()["head_dim split"] == 4
    assert rules.match("transformer_layer_0/self_attention/key/bias").axes == (None, None)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    report, state = compiled_step(build_qwen, dist, x, y)
    assert rules.cost.wire_bytes_by_axis["model"] == pytest.approx(
        report.wire_bytes_by_axis["model"], rel=0.02
    )
    assert rules.cost.wire_bytes == pytest.approx(report.wire_bytes, rel=0.02)
    assert rules.cost.state_bytes == state
    reference = Reference(build_qwen, (x, y), batch_size=4)
    model = train(build_qwen, reference.initial, (x, y), dist, batch_size=4)
    assert_same_weights(model, reference.trained)


# Keras's own attention layers (MultiHeadAttention, GroupQueryAttention with 2 key/value heads)
# and Dense feed-forward kernels re-gathered for the backward pass over a 4-way batch axis.
@pytest.mark.parametrize(("kv_heads", "mesh_name"), [(None, "4x2"), (2, "2x4")])
def test_predicted_bytes_match_on_keras_attention_layers(kv_heads, mesh_name):
    from helpers import build_encoder

    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    x = np.random.default_rng(0).integers(0, 128, (32, 16)).astype("int32")
    probe = build_encoder(kv_heads)
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.auto_rules(probe, mesh, replicate_below=0, memory_budget=1, batch=x, optimizer="adam")
    rules = kml.auto_rules(
        probe, mesh, replicate_below=0, memory_budget=error.value.smallest_bytes, batch=x, optimizer="adam"
    )
    assert "2-D" in rules.cost.layouts()
    keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
    model = build_encoder(kv_heads)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = kml.comm_report(model, x, np.zeros(32, "int32"))
    assert rules.cost.wire_bytes == pytest.approx(report.wire_bytes, rel=0.02)


def test_predicted_bytes_match_under_mixed_precision():
    """Activations computed in bfloat16 are still summed in float32 across devices."""
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        mesh = kml.Mesh(data=2, model=4)
        rules = kml.auto_rules(build("llama"), mesh, replicate_below=0, batch=batch(), optimizer="adam")
        keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
        model = build("llama")
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        report = kml.comm_report(model, batch(), np.zeros(BATCH, "int32"))
    finally:
        keras.config.set_dtype_policy("float32")
    assert {transfer.dtype for transfer in report.transfers} == {"f32"}
    assert rules.cost.wire_bytes == pytest.approx(report.wire_bytes, rel=0.02)


# A language model's head over its vocabulary is planned like any unit (issue 11, item 3): split
# over the model axis, the loss reducing the split logits; under a tight budget, also over data.
VOCAB_LM, HIDDEN_LM = 512, 64


def build_lm() -> keras.Model:
    tokens = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB_LM, HIDDEN_LM, name="embed")(tokens)
    up = keras.layers.Dense(256, activation="gelu", name="up")(x)
    x = x + keras.layers.Dense(HIDDEN_LM, name="down")(up)
    return keras.Model(tokens, keras.layers.Dense(VOCAB_LM, use_bias=False, name="lm_head")(x), name="lm")


@pytest.mark.parametrize("tight", [False, True], ids=["no-budget", "smallest"])
@pytest.mark.parametrize("mesh_name", MESHES)
def test_a_large_final_layer_is_split_and_predicted(mesh_name, tight):
    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB_LM, (BATCH, LENGTH)).astype("int32")
    y = rng.integers(0, VOCAB_LM, (BATCH, LENGTH)).astype("int32")
    budget = None
    if tight:
        with pytest.raises(kml.MemoryBudgetError) as error:
            kml.auto_rules(build_lm(), mesh, replicate_below=0, memory_budget=1, batch=x, optimizer="adam")
        budget = error.value.smallest_bytes
    rules = kml.auto_rules(
        build_lm(), mesh, replicate_below=0, memory_budget=budget, batch=x, optimizer="adam"
    )
    head = rules.match("lm_head/kernel")
    assert head.axes == (("data", "model") if tight else (None, "model"))
    assert "vocab-parallel" in head.note and "at least the 16,384 of the largest split kernel" in head.note
    keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
    model = build_lm()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = kml.comm_report(model, x, y)
    for axis, measured in report.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis


# One memory model (`_memory.SlotModel`): the budget planner's state equals the plan's count of the
# optimizer's real variables, whatever the optimizer; Adafactor's factored statistics included.
@pytest.mark.parametrize(
    "optimizer",
    [
        keras.optimizers.Adam,
        lambda: keras.optimizers.SGD(momentum=0.9),
        keras.optimizers.SGD,
        keras.optimizers.Adafactor,
        keras.optimizers.Lion,
        lambda: keras.optimizers.Adam(amsgrad=True),
        # Muon keeps AdamW's velocity beside its momentum for the vectors, the embeddings and the
        # layers it excludes (its predicted state had counted one slot each: 0.83 of the peak).
        keras.optimizers.Muon,
        lambda: keras.optimizers.Muon(exclude_layers=["lm_head"], exclude_embeddings=False),
    ],
    ids=["adam", "sgd-momentum", "sgd", "adafactor", "lion", "amsgrad", "muon", "muon-excluding-the-head"],
)
def test_predicted_state_equals_the_plan_for_every_optimizer(optimizer):
    mesh = kml.Mesh(data=2, model=4)
    x = np.zeros((BATCH, LENGTH), "int32")
    with warnings.catch_warnings():  # Muon's: its update's peak is estimated (tests/test_errors.py)
        warnings.filterwarnings("ignore", "Muon orthogonalises", kml.MeshLayoutWarning)
        rules = kml.auto_rules(build_lm(), mesh, replicate_below=0, batch=x, optimizer=optimizer())
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    keras.distribution.set_distribution(dist)
    model = build_lm()
    real = optimizer()
    real.build(model.trainable_variables)
    memory = kml.plan_model(dist, model, real).memory()
    assert rules.cost.state_bytes == memory.parameters + memory.gradients + memory.optimizer


# Grouped-query attention inside a custom layer (tests/styles.py): with 2 key/value heads on a
# 4-way model axis the key/value weights stay whole, and no layer output rule can keep their
# outputs whole, so XLA gathers them and their slots every step; the prediction counts that.
@pytest.mark.parametrize("mesh_name", MESHES)
def test_predicted_bytes_match_on_custom_layer_grouped_query_attention(mesh_name):
    import styles

    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    rng = np.random.default_rng(0)
    x = rng.integers(0, styles.VOCAB, (BATCH, styles.LENGTH)).astype("int32")
    rules = kml.auto_rules(styles.grouped_query(), mesh, replicate_below=0, batch=x, optimizer="adam")
    keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
    model = styles.grouped_query()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = kml.comm_report(model, x, np.zeros(BATCH, "int32"))
    for axis, measured in report.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis.get(axis, 0.0) == pytest.approx(measured, rel=0.02), axis


# The search (`planner/_search.py`) reads only a `CostTable`: table-driven cases on hand-made
# candidates, independent of any model.
def _table(*units, reserve=0):
    from keras_meshlayout.planner import Candidate, CostTable, UnitCosts

    def unit(name, *options, proposed=0):
        candidates = tuple(Candidate(n, {}, s, {"data": w}) for n, s, w in options)
        return UnitCosts(name, candidates, proposed=proposed)

    return CostTable(tuple(unit(*u[:-1], proposed=u[-1]) for u in units), reserve)


SEARCH = [
    # (budget, expected layouts, why)
    (None, ("tensor-parallel", "replicated"), "no budget: the proposal's own layouts"),
    (10_000, ("replicated", "replicated"), "roomy: the least traffic everywhere"),
    (700, ("tensor-parallel", "replicated"), "the move that saves most per byte of traffic first"),
    (350, ("tensor-parallel", "vocab-parallel"), "a move the budget no longer needs is walked back"),
    (300, ("2-D", "vocab-parallel"), "tight: both units split as far as they go"),
]


@pytest.mark.parametrize(("budget", "expected", "why"), SEARCH, ids=[c[2] for c in SEARCH])
def test_search_picks_the_least_traffic_within_the_budget(budget, expected, why):
    from keras_meshlayout.planner import search

    table = _table(
        ("ffn", ("replicated", 800, 100.0), ("tensor-parallel", 200, 120.0), ("2-D", 100, 150.0), 1),
        ("embed", ("replicated", 400, 10.0), ("vocab-parallel", 100, 400.0), 0),
        reserve=50,
    )
    chosen = search(table, budget)
    assert tuple(u.candidates[i].layout for u, i in zip(table.units, chosen, strict=True)) == expected


def test_search_refuses_a_budget_below_the_smallest_plan():
    from keras_meshlayout.planner import search

    table = _table(("ffn", ("replicated", 800, 100.0), ("tensor-parallel", 200, 80.0), 1), reserve=50)
    with pytest.raises(kml.MemoryBudgetError, match=r"smallest plan needs 250 B .*50 B of it") as error:
        search(table, 249)
    assert error.value.smallest_bytes == 250


# Fully sharded (ZeRO-3/FSDP) weights, checked against the compiled step: alone (a model with no
# unit at all: a lone projection, a norm, a small head) and mixed with 2-D units (tests/styles.py),
# under the smallest budget, on both meshes (the batch axis larger and smaller than the model axis).
# Under the smallest budget every such weight whose first dimension divides by 8 is split over
# both axes at once, (("data", "model"), ...): gathered over "data×model" where it is read.
def build_lone() -> keras.Model:
    inputs = keras.Input((32,))
    hidden = keras.layers.LayerNormalization(name="norm")(keras.layers.Dense(64, name="lone")(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden), name="lone")


class OffsetNorm(keras.layers.Layer):
    """An RMS norm as Gemma's, `x * (1 + scale)`: its scale is added to before it multiplies."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="zeros", name="scale")

    def call(self, x):
        x = x * keras.ops.rsqrt(keras.ops.mean(keras.ops.square(x), axis=-1, keepdims=True) + 1e-6)
        return x * (1 + self.scale)


def build_offset() -> keras.Model:
    """Regression: the scale of `x * (1 + scale)` was costed as gathered once; XLA gathers it twice."""
    inputs = keras.Input((32,))
    hidden = OffsetNorm(name="norm")(keras.layers.Dense(64, name="lone")(inputs))
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden), name="offset")


def _styles_builder(name: str):
    import styles

    builders = {"lone": build_lone, "offset": build_offset, "block": styles.block_functional}
    return {**builders, "mlp": styles.mlp_sequential}[name]


ALONE = ("lone", "offset")  # models with no unit at all: every weight fully sharded


@pytest.mark.parametrize("mesh_name", MESHES)
@pytest.mark.parametrize(
    "name", ["lone", "offset", "block", "mlp"], ids=["alone", "alone-offset-norm", "mixed-block", "mixed-mlp"]
)
def test_fully_sharded_predicted_bytes_match_the_compiled_step(name, mesh_name):
    import styles

    build_model = _styles_builder(name)
    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    rng = np.random.default_rng(0)
    if name == "block":
        x = rng.integers(0, styles.VOCAB, (64, styles.LENGTH)).astype("int32")
    else:
        x = rng.normal(size=(64, 32 if name in ALONE else styles.FEATURES)).astype("float32")
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.auto_rules(build_model(), mesh, replicate_below=0, memory_budget=1, batch=x, optimizer="adam")
    budget = error.value.smallest_bytes
    probe = build_model()
    rules = kml.auto_rules(probe, mesh, replicate_below=0, memory_budget=budget, batch=x, optimizer="adam")
    layouts = set(rules.cost.layouts())
    expected = {"fully sharded"} if name in ALONE else {"fully sharded", "2-D"}
    assert layouts == expected if name in ALONE else expected <= layouts
    # The head's kernel divides by 2 x 4 = 8 on its input features: split over both axes at once.
    head = rules.match("head/kernel")
    assert head.axes == (("data", "model"), None), head
    assert "split 8 ways over 'data' and 'model', gathered over both before its projection" in head.note
    if name == "mlp":  # a column bias beside its 2-D kernel: over both axes, model-major
        assert rules.match("sequential/up1/bias").axes == (("model", "data"),)
    if name == "block":  # a small table: its vocabulary over both axes, model-major
        assert rules.match("embed/embeddings").axes == (("model", "data"), None)
    keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
    model = build_model()
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    report = kml.comm_report(model, x, rng.integers(0, 10, 64).astype("int32"))
    assert set(report.wire_bytes_by_axis) == set(rules.cost.wire_bytes_by_axis)
    for axis, measured in report.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] == pytest.approx(measured, rel=0.02), axis
    if name == "offset":  # exact: its scale gathered over both axes forward and backward (was once)
        assert rules.cost.wire_bytes_by_axis == report.wire_bytes_by_axis


def build_pooled_head(width: int = 32) -> keras.Model:
    """A table, mean-pooled, under a head whose kernel is `width × 10`."""
    ids = keras.Input((8,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(512, width, name="table")(ids))
    return keras.Model(ids, keras.layers.Dense(CLASSES, name="head")(pooled), name="pooled")


@pytest.mark.parametrize(
    ("rows", "width", "mesh_name", "axes"),
    [
        (8, 32, "2x4", (("data", "model"), None)),
        (8, 32, "4x2", (("data", "model"), None)),
        (32, 32, "2x4", (("data", "model"), None)),
        (8, 36, "4x2", ("data", None)),  # 36 rows do not divide by 8: over 'data' only
    ],
    ids=["both-2x4", "both-4x2", "dy-as-large", "data-4x2"],
)
def test_a_fully_sharded_heads_input_gradient_is_predicted(rows, width, mesh_name, axes):
    """Regression (issue 19): a head split on its input features after a pooling, its output gradient
    (rows × 10) smaller than its kernel: XLA:CPU gathers that gradient over 'data' and moves the input
    gradient back to batch shards, gathered whole over both axes (160 + 896 bytes unpredicted at 8 rows on
    2×4: 0.972 over 'data', 0.945 over both) or, split over 'data' only, by an all-to-all over it (4×2:
    0.958 over 'data'). At 32 rows it reuses the kernel's gathered copy: nothing more."""
    mesh = kml.Mesh(data=MESHES[mesh_name][0], model=MESHES[mesh_name][1])
    x = np.zeros((rows, 8), "int32")
    options = dict(batch=x, optimizer="adam", replicate_below=0)
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.auto_rules(build_pooled_head(width), mesh, memory_budget=1, **options)
    budget = error.value.smallest_bytes
    rules = kml.auto_rules(build_pooled_head(width), mesh, memory_budget=budget, **options)
    assert rules.match("head/kernel").axes == axes
    keras.distribution.set_distribution(kml.ModelParallel(mesh, rules, replicate_below=0))
    model = build_pooled_head(width)
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings():  # XLA:CPU's rematerialisation notice for the input gradient
        warnings.simplefilter("ignore")
        report = kml.comm_report(model, x, np.zeros(rows, "int32"))
    assert set(report.wire_bytes_by_axis) == set(rules.cost.wire_bytes_by_axis)
    for axis, measured in report.wire_bytes_by_axis.items():
        assert rules.cost.wire_bytes_by_axis[axis] == pytest.approx(measured, rel=0.02), axis
