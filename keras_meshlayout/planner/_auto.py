"""The automatic planner: layout rules derived from the model's traced computation.

`auto_rules` traces the model's forward pass on abstract values (`planner/`:
nothing runs, and a `kml.dry_build` model works) and reads its units off the
dataflow, whatever wrote it (Keras layers, `keras.ops` calls, operators,
custom layers with `add_weight`, subclassed models). It writes one rule per
decision, each with a note that explains it, and only ever chooses layouts
that keep weights where they are:

- Keras attention layers (`MultiHeadAttention`, `GroupQueryAttention`), and
  attention blocks in custom layers named as in Keras and keras-hub code, are
  split over heads; key/value projections with too few heads stay replicated;
- a projection whose output features, split over the model axis, flow through
  operations that keep them split (element-wise chains, gating products,
  bias adds, reshapes into heads, attention einsums) into projections that sum
  over them becomes a column → row unit (`planner.find_units`);
- a final projection as large as the largest kernel the plan splits (a
  language model's head) is split over its output features; a smaller one,
  and any projection with no partner, stays replicated, with the reason noted;
  so is a convolution reading the model's input that no unit takes (a vision
  transformer's patch embedding), its layer output gathered whole;
- what remains (embeddings, norms) is matched by name against
  `transformer_rules`; without a trace (a subclassed model never called), the
  Keras layer graph pairs projections instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import keras

from .. import _compat
from ..core._errors import (
    InvalidOptionError,
    MemoryBudgetError,
)
from ..core._format import format_bytes
from ..core._grouped_scan import abstract_batch
from ..core._memory import parse_bytes
from ..core._mesh import mesh_axis_sizes
from ..core._policy import LayoutPolicy, resolve_policy
from ..core._rules import LayoutRules
from . import (
    _by_layers,
    _by_name,
    _by_trace,
    _convs,
    _embeddings,
    _experts,
    _grouped_batch,
    _lora,
    _peak,
    _quantized,
)
from ._arguments import check_budget_args, check_mesh_and_model, checked_axes
from ._at_peak import filled_by
from ._costs import CostTable, cost_units
from ._headroom import peak_headroom
from ._layers import auto_named, packed_axes
from ._ledger import Ledger, Setting
from ._remat import recomputed_products
from ._search import explain, plan_cost, search
from ._tpu_memory import warn_convnet_peak
from ._trace import Trace, trace_model
from ._updates import warn_unpredicted_updates, with_update_wire

__all__ = ["STRATEGIES", "auto_rules", "plan_rules", "smallest"]

Strategy = Callable[[Ledger, Setting], None]

#: The strategies, in order: each decides the variables no earlier one decided (a traced unit
#: may revise what an earlier strategy left whole); each is one function over the ledger.
STRATEGIES: tuple[Strategy, ...] = (
    _by_layers.attention_layers,  # Keras attention layers, over heads
    _by_name.attention_blocks,  # attention blocks in custom layers, by their projections' names
    _experts.expert_banks,  # mixture-of-experts weights split on their expert dimension
    _by_trace.traced_units,  # column → row pairs and attention heads in the dataflow
    _by_layers.kv_head_dim,  # grouped-query key/value kernels kept whole, split on head_dim instead
    _convs.conv_units,  # convolutions' output → input channels, through batch norms and depthwise convs
    _convs.lone_convs,  # a convolution no unit took, split on its input channels
    _convs.lone_grouped_convs,  # a grouped convolution no unit took (Qwen 3.5's), on its channels
    _convs.input_convs,  # a convolution reading the input (a patch embedding): output channels, gathered
    _by_trace.final_layers,  # a language model's head, split when it is the largest kernel
    _by_layers.projection_pairs,  # pairs along the layer graph when nothing was traced
    _embeddings.vocab_parallel_tables,  # large look-up tables split over their vocabulary
    _embeddings.tied_tables,  # tied tables (look-up and language-model head) split over their vocabulary
    _by_trace.beside_split,  # weights read beside a split activation (per-head biases), split with it
    _by_trace.unused_weights,  # trainable weights the step never reads, split at no cost
    _by_name.named_weights,  # the rest by name (`transformer_rules`)
    _by_trace.lone_projections,  # the projections no unit took, noted
    _lora.lora_adapters,  # LoRA adapters laid out as their base kernel
    _quantized.int8_scales,  # int8 kernels' scales split with their output features
    _by_trace.left_whole,  # anything else, replicated with the operations that read it
    _grouped_batch.grouped_convs_batch_split,  # a grouped conv left whole: its output over every axis
)


def auto_rules(
    model: keras.Model,
    mesh: keras.distribution.DeviceMesh,
    *,
    model_axis: str = "model",
    batch_axis: str | None = None,
    replicate_below: int | None = None,
    memory_budget: int | str | None = None,
    batch: Any = None,
    optimizer: str | keras.optimizers.Optimizer | None = None,
    policy: LayoutPolicy | None = None,
) -> LayoutRules:
    """Derives layout rules for a built model on a mesh, explaining each decision.

    Every rule matches one variable path exactly (with or without the model's
    name in front, which a Sequential model loses when reloaded from a
    `.keras` file) and carries a note saying why
    (shown in `dist.plan(model)`). Pass the result to `kml.ModelParallel`.

    Args:
        model: A built Keras model (any distribution, or none).
        mesh: The mesh the rules are for.
        model_axis: The mesh axis for tensor parallelism. Mixture-of-experts banks are split
            over it too, unless the mesh has an axis named `expert`, which then takes them.
        batch_axis: The mesh axis the batch is split over (for the layer-output
            rules of grouped-query attention). Defaults to the first other axis.
        replicate_below: Projections whose kernels have fewer elements stay
            replicated; defaults to the policy's (`kml.DEFAULT_REPLICATE_BELOW`).
            The returned rules carry it, so `kml.ModelParallel` applies it too.
        memory_budget: Per-device memory (bytes or `"16GiB"`) that one training
            step's predicted peak must fit with 5% to spare for the prediction's
            error (27% on a TPU target; for a convnet 30%, and on a TPU target 40%
            and 64 MiB at least: `_headroom.peak_headroom`):
            parameters, gradients, optimizer slots, the batch's shard, and the
            activations and temporaries the traced step keeps alive at its worst
            (attention scores, dequantised int8 kernels, feature maps, remat blocks
            recomputed; see `PlanCost.peak_bytes`).
            Each unit of weights (a projection pair, an attention block, an
            embedding) then gets the layout that fits at the least traffic:
            replicated, tensor-parallel, 2-D (its largest other dimension also
            split over `batch_axis`), for embeddings vocab-parallel, and for
            weights outside every unit (norms, biases, a small head) fully
            sharded (split over `batch_axis`, gathered when used); the note
            of each rule says what it saves and costs. At the smallest plan's
            own budget (`MemoryBudgetError.smallest_bytes`) or under it, that
            plan (the least state) unless another predicted to peak lower fits.
            `None` keeps the planner's tensor-parallel layout (with `batch`, a
            look-up table goes over both axes where that sends no more bytes
            and holds less than vocab-parallel).
        batch: One global batch of inputs (arrays, or anything with `shape`
            and `dtype`). Needed with `memory_budget`; with it, the returned
            rules carry `rules.cost`, a `kml.PlanCost` predicting the bytes
            each device sends per step (as `kml.comm_report` counts them) and
            holds at the step's peak (`peak_bytes`, within about 10% of XLA's
            compiled figure on the models measured in docs/status.md).
        optimizer: The optimizer whose slots count towards the budget;
            defaults to the model's own once compiled.
        policy: A `kml.LayoutPolicy` (`on_indivisible`, `replicate_below`):
            planned with and carried by the returned rules (`rules.policy`),
            so `kml.ModelParallel` applies it without being told again.

    Returns:
        The rules, bound to nothing: hand them to `kml.ModelParallel(mesh, rules)`.

    Raises:
        InvalidRuleError: `model_axis` is not an axis of `mesh`.
        InvalidMeshError: `mesh` is not a mesh, or `batch_axis` is not one of its axes or is
            `model_axis`.
        InvalidOptionError: `memory_budget` without `batch`.
        MemoryBudgetError: Even the smallest layout does not fit `memory_budget`.

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> model = keras.Sequential([
        ...     keras.Input((64,)),
        ...     keras.layers.Dense(256, activation="gelu", name="up"),
        ...     keras.layers.Dense(64, name="down"),
        ...     keras.layers.Dense(10, name="head"),
        ... ], name="mlp")
        >>> rules = kml.auto_rules(model, kml.Mesh(data=2, model=4))
        >>> for rule in rules.rules[:3]:
        ...     print(rule.pattern, rule.axes)
        (?:mlp/)?up/kernel (None, 'model')
        (?:mlp/)?up/bias ('model',)
        (?:mlp/)?down/kernel ('model', None)
        >>> rules.rules[2].note
        'row-parallel: up → down, input features split; one all-reduce forward, one backward'
        >>> head = rules.rules[-2].note
        >>> head.split(" (")[0]
        'final layer: replicated, so its output needs no gathering'
        >>> head.split(" (")[1]
        '640 weights, fewer than the 16,384 of the largest split kernel)'

        With a memory budget, each unit gets the layout that fits at the least
        traffic, and the rules predict what a training step costs:

        >>> import numpy as np
        >>> x = np.zeros((64, 64), "float32")
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> roomy = kml.auto_rules(model, mesh, memory_budget="1GB", batch=x, optimizer="adam")
        >>> roomy.rules[0].note.split(" (")[0]
        'tensor-parallel: saves 387.0 KiB/device, sends 84.8 KiB less per step than replicated'
        >>> tight = kml.auto_rules(model, mesh, memory_budget="170KB", batch=x, optimizer="adam")
        >>> tight.rules[0].pattern, tight.rules[0].axes
        ('(?:mlp/)?up/kernel', ('data', 'model'))
        >>> tight.rules[0].note.split(" (")[0]
        '2-D: saves 451.5 KiB/device, sends 68.6 KiB less per step than replicated'
        >>> tight.cost.wire_bytes, tight.cost.peak_bytes <= 170_000, tight.cost.layouts()
        (64684.0, True, {'2-D': 1, 'replicated': 2})
    """
    return plan_rules(
        model, mesh, model_axis=model_axis, batch_axis=batch_axis, replicate_below=replicate_below,
        memory_budget=memory_budget, batch=batch, optimizer=optimizer, policy=policy,
    )  # fmt: skip


def plan_rules(
    model: keras.Model,
    mesh: keras.distribution.DeviceMesh,
    *,
    model_axis: str = "model",
    batch_axis: str | None = None,
    replicate_below: int | None = None,
    memory_budget: int | str | None = None,
    batch: Any = None,
    optimizer: str | keras.optimizers.Optimizer | None = None,
    policy: LayoutPolicy | None = None,
    fully_sharded: bool = False,
) -> LayoutRules:
    """`auto_rules`, or with `fully_sharded` (and a `batch`) its fully sharded plan (ZeRO-3/FSDP).

    Fully sharded, every unit takes its candidate of least state whatever it sends (`smallest`):
    a unit's 2-D layout (tensor-parallel, with its kernels' largest other dimension also split
    over `batch_axis`, gathered there before use), a weight outside every unit split over
    `batch_axis` (and the model axis where it divides), a table over both axes: the plan
    `auto_rules` falls back to when nothing else fits. `memory_budget` is then only checked.
    """
    mesh = check_mesh_and_model(model, mesh)
    batch_axis = checked_axes(mesh, model_axis, batch_axis)
    if fully_sharded:
        model_axis = _fully_sharded_model_axis(mesh, model_axis, batch_axis)
    size = mesh_axis_sizes(mesh)[model_axis]
    batch_size = mesh_axis_sizes(mesh).get(batch_axis, 1) if batch_axis else 1
    check_budget_args(memory_budget, batch, fully_sharded, batch_axis, batch_size)
    chosen_policy = resolve_policy("auto_rules()", policy, replicate_below=replicate_below)
    trace = _trace(model, batch)
    expert = _expert_axis(mesh, model_axis, batch_axis)
    setting = Setting(
        model, model_axis, size, chosen_policy.replicate_below, batch_axis, trace, batch_size,
        expert, mesh_axis_sizes(mesh)[expert] if expert else 1,
    )  # fmt: skip
    ledger = Ledger(
        model.name,
        model_axis,
        batch_axis,
        auto_named(model),
        tuple(v.path for v in model.weights),
        replicate_below=chosen_policy.replicate_below,
        shapes={v.path: tuple(v.shape) for v in model.weights},
        packed=packed_axes(model),
    )
    # LoRA layers read as their base kernel (`_lora` lays out the adapters), int4 ones as their packed one.
    with _compat.lora_off(model), _quantized.stored_int4():
        for strategy in STRATEGIES:
            strategy(ledger, setting)
        if batch is None:
            return _rules_of(ledger, chosen_policy, batch_axis)
        budget = None if memory_budget is None else parse_bytes(memory_budget)
        if optimizer is None:
            optimizer = getattr(model, "optimizer", None)
        below, compiler = chosen_policy.replicate_below, _peak.compiler_of(mesh)
        sizes, reduced = mesh_axis_sizes(mesh), _peak.reduced_gather_bytes_of(mesh)
        again = recomputed_products(model, batch, trace)  # under remat (`_remat`)
        table = cost_units(model, ledger.proposal(), trace, sizes, optimizer, below, compiler, reduced, again)
        table = with_update_wire(table, model, optimizer, sizes, compiler)  # Muon's (`_updates`)
    step = _peak.PeakWalk.of(model, batch, sizes, batch_axis, compiler, _peak.chip_of(mesh), optimizer)
    table, chosen, peak = _search_within_peak(table, budget, step, fully_sharded)
    _apply(ledger, table, chosen, budget is not None)
    rules = _rules_of(ledger, chosen_policy, batch_axis)
    rules.cost = plan_cost(table, chosen, budget, peak)
    _warn_estimated_peaks(model, rules, optimizer, compiler, step is not None and step.convnet)
    _grouped_batch.warn_unpredicted(ledger.batch_everywhere)
    return rules


def _rules_of(ledger: Ledger, policy: LayoutPolicy, batch_axis: str | None) -> LayoutRules:
    """The ledger's rules, carrying the policy and the batch axis they were planned with."""
    rules = LayoutRules(ledger.rules(), suggested=True, keep_split=ledger.kept_split(), policy=policy)
    rules.batch_axis = batch_axis
    return rules


def _warn_estimated_peaks(
    model: keras.Model, rules: LayoutRules, optimizer: Any, compiler: str, convnet: bool
) -> None:
    """Warns where the plan's predicted peak is an estimate: Muon's split matrices, and on XLA:TPU a
    convnet's step."""
    warn_unpredicted_updates(model, rules, optimizer)
    if compiler == "tpu" and convnet:  # `_peak.is_convnet`, decided once for the walk
        warn_convnet_peak()


def _search_within_peak(
    table: CostTable, budget: int | None, step: _peak.PeakWalk | None, fully_sharded: bool = False
) -> tuple[CostTable, tuple[int, ...], _peak.PeakMemory | None]:
    """The search, with the activation reserve set to what the predicted peak needs beyond the state.

    The reserve starts at the smaller non-state part of two peaks: the proposal's own and the
    smallest-state plan's. While the chosen layouts' predicted peak exceeds the budget, the
    reserve grows to that peak's non-state part and the search runs again (a few times at most); failing that,
    the smallest-state plan is taken if its own peak fits. A plan said to fit fits its
    predicted peak with `_headroom.peak_headroom` to spare; `MemoryBudgetError.smallest_bytes` is the
    budget the smallest plan needs. Within that budget (or under it) the smallest-state plan is
    what was asked for: a plan the search chose for its traffic gives way to it unless its own
    predicted peak is lower. (Measured on keras-hub Llama with `enable_lora(4)`, 2×4: its frozen
    kernels split over `data` save state but their gathered copies live from the forward pass
    to the backward, so both plans were predicted at 296,836 bytes, compiled 308,304 and 301,904.)
    `fully_sharded` takes the smallest-state plan at once.
    """
    if step is None:  # a step that cannot be traced: the projections' outputs as the reserve
        if fully_sharded:
            return table, _checked(table, smallest(table), budget), None
        return table, search(table, budget), None
    proposed = tuple(unit.proposed for unit in table.units)
    if budget is None and not fully_sharded:
        peak = step.peak(table, proposed)
        return dataclasses.replace(table, reserve=peak.non_state), proposed, peak
    headroom = peak_headroom(step.compiler, step.convnet)
    given, budget = budget, None if budget is None else headroom.usable(budget)
    least_chosen = smallest(table)
    least = step.peak(table, least_chosen)
    if budget is not None and not fully_sharded:
        reserve = min(step.peak(table, proposed).non_state, least.non_state)
        for _ in range(_ROUNDS):
            try:
                chosen = search(dataclasses.replace(table, reserve=reserve), budget)
            except MemoryBudgetError:
                break
            peak = step.peak(table, chosen)
            if peak.peak <= budget:
                if given <= headroom.needed(least.peak) and peak.peak >= least.peak:
                    break  # the smallest plan's own budget: that plan, unless this one peaks lower
                return dataclasses.replace(table, reserve=peak.non_state), chosen, peak
            reserve = max(reserve + 1, peak.non_state)
    if budget is None or least.peak <= budget:
        return dataclasses.replace(table, reserve=least.non_state), least_chosen, least
    needed = headroom.needed(least.peak)
    raise MemoryBudgetError(
        f"auto_rules: the smallest plan needs {format_bytes(least.peak)} per device at its predicted "
        f"peak ({format_bytes(least.working)} of it the batch, activations and temporaries), "
        f"{format_bytes(needed)} with the {headroom} kept for the prediction's error, "
        f"over the memory budget of {format_bytes(given)}.{filled_by(least.buffers)} Fix: a larger budget, "
        "a mesh with a larger model axis, a smaller batch per device, keras.RematScope around the layers "
        "whose activations fill it, or an optimizer with fewer slots (e.g. Adafactor).",
        smallest_bytes=needed,
        smallest_peak_bytes=least.peak,
    )


def smallest(table: CostTable) -> tuple[int, ...]:
    """Each unit's candidate of least state (then least traffic): the fully sharded plan."""
    return tuple(
        min(range(len(u.candidates)), key=lambda i, u=u: (u.candidates[i].state, u.candidates[i].total))
        for u in table.units
    )


def _checked(table: CostTable, chosen: tuple[int, ...], budget: int | None) -> tuple[int, ...]:
    """`chosen`, when its state and the reserve fit `budget` (an untraced step's fully sharded plan)."""
    state = table.reserve + sum(u.candidates[c].state for u, c in zip(table.units, chosen, strict=True))
    if budget is not None and state > budget:
        raise MemoryBudgetError(
            f"auto_rules: the fully sharded plan needs {format_bytes(state)} per device, over the memory "
            f"budget of {format_bytes(budget)}. Fix: a larger budget, a smaller batch per device, or an "
            "optimizer with fewer slots (e.g. Adafactor).",
            smallest_bytes=state,
        )
    return chosen


#: How often the search runs again with a larger reserve before the budget is declared too small.
_ROUNDS = 8


def _expert_axis(mesh: Any, model_axis: str, batch_axis: str | None) -> str | None:
    """The mesh's `expert` axis, which expert banks are split over, unless it is the model or batch axis."""
    name = _experts.EXPERT_AXIS
    return name if name in mesh.axis_names and name not in (model_axis, batch_axis) else None


def _fully_sharded_model_axis(mesh: Any, model_axis: str, batch_axis: str | None) -> str:
    """The axis a fully sharded plan splits weights over beside the batch axis: the model axis, unless
    it has one device and the mesh has an `expert` axis (`data=2,expert=2,model=1`, which
    `choose_mesh` ranks), whose devices every weight is then split over too, as over a model axis.

    Split over the batch axis alone there, XLA:CPU spread each weight over the free expert axis
    (collective-permutes over both, gathers over `expert`): a small keras-hub Mixtral sent 1.20x
    the predicted bytes, 52,896 of them over both axes, and held 696,920 bytes of state a device.
    With the expert axis as the model axis it sends what is predicted (228,504 bytes, 0.81x) and
    holds 512,344 (`tests/test_experts.py`).
    """
    expert = _expert_axis(mesh, model_axis, batch_axis)
    sizes = mesh_axis_sizes(mesh)
    return expert if expert is not None and sizes[model_axis] == 1 and sizes[expert] > 1 else model_axis


def _trace(model: keras.Model, batch: Any) -> Trace | None:
    """The model's forward pass on `batch`, or on its input spec when no batch is given.

    Layers left unbuilt are built on the batch first (`trace_model`); without a batch, a model
    whose layers still have no weights cannot be planned and is refused.
    """
    if batch is not None:
        return trace_model(model, batch)
    guess = abstract_batch(model)
    trace = None
    if guess is not None:
        try:
            trace = trace_model(model, guess)
        except Exception:  # the spec was a guess (a batch of 2); the layer graph still plans
            trace = None
    unbuilt = [
        layer for layer in _compat.unbuilt_layers(model) if layer is not model
    ] or _compat.unbuilt_layers(model)
    if unbuilt and (trace is None or not model.weights):  # a subclassed model never called
        names = ", ".join(repr(layer.name) for layer in unbuilt[:4]) + (", ..." if len(unbuilt) > 4 else "")
        raise InvalidOptionError(
            f"auto_rules: {len(unbuilt)} layer(s) of model {model.name!r} are not built ({names}), so "
            "their weights do not exist yet and cannot be planned. Fix: pass batch=x (one batch of "
            "inputs; the layers are built on its shapes, as fit would build them), or call the model "
            "on a batch first."
        )
    return trace


def _apply(ledger: Ledger, table: CostTable, chosen: Sequence[int], budgeted: bool) -> None:
    """Rewrites the rules of every unit to the candidate the search chose, with its note."""
    for unit, index in zip(table.units, chosen, strict=True):
        if len(unit.candidates) == 1:
            continue
        candidate = unit.candidates[index]
        why = explain(unit, index, budgeted)
        for path, axes in candidate.axes.items():
            detail = candidate.notes.get(path) or unit.notes.get(path, "")
            note = why if candidate.layout == "replicated" or not detail else f"{why} ({detail})"
            ledger.relayout(path, axes, note)
