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
- what remains (embeddings, norms) is matched by name against
  `transformer_rules`; without a trace (a subclassed model never called), the
  Keras layer graph pairs projections instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from types import MappingProxyType
from typing import Any

import keras

from .. import _compat
from ..core._axes import Axes
from ..core._errors import InvalidOptionError, InvalidRuleError
from ..core._memory import parse_bytes
from ..core._mesh import mesh_axis_sizes
from ..core._policy import LayoutPolicy, resolve_policy
from ..core._rules import LayoutRules
from ._costs import CostTable, Proposal, cost_units
from ._layers import features as _features
from ._layers import heads_dim as _heads_dim
from ._layers import labels as _labels
from ._presets import ffn_role, transformer_rules
from ._search import explain, plan_cost, search
from ._trace import Trace, abstract_batch, trace_model
from ._units import find_added, find_units

__all__ = ["auto_rules"]

#: Layers that act on each element alone: a split feature dimension passes through.
ELEMENTWISE = (
    keras.layers.Activation,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
    keras.layers.ELU,
    keras.layers.Dropout,
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
    keras.layers.Identity,
    keras.layers.ActivityRegularization,
)
ATTENTION = (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)


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
        model_axis: The mesh axis for tensor parallelism.
        batch_axis: The mesh axis the batch is split over (for the layer-output
            rules of grouped-query attention). Defaults to the first other axis.
        replicate_below: Projections whose kernels have fewer elements stay
            replicated; defaults to the policy's (`kml.DEFAULT_REPLICATE_BELOW`).
            The returned rules carry it, so `kml.ModelParallel` applies it too.
        memory_budget: Per-device memory (bytes or `"16GiB"`) that parameters,
            gradients, optimizer slots and the activation reserve must fit.
            Each unit of weights (a projection pair, an attention block, an
            embedding) then gets the layout that fits at the least traffic:
            replicated, tensor-parallel, 2-D (its largest other dimension also
            split over `batch_axis`), for embeddings vocab-parallel, and for
            weights outside every unit (norms, biases, a small head) fully
            sharded (split over `batch_axis`, gathered when used); the note
            of each rule says what it saves and costs. `None` keeps the
            planner's tensor-parallel layout.
        batch: One global batch of inputs (arrays, or anything with `shape`
            and `dtype`). Needed with `memory_budget`; with it, the returned
            rules carry `rules.cost`, a `kml.PlanCost` predicting the bytes
            each device sends per step (as `kml.comm_report` counts them) and
            holds.
        optimizer: The optimizer whose slots count towards the budget;
            defaults to the model's own once compiled.
        policy: A `kml.LayoutPolicy` (`on_indivisible`, `replicate_below`):
            planned with and carried by the returned rules (`rules.policy`),
            so `kml.ModelParallel` applies it without being told again.

    Returns:
        The rules, bound to nothing: hand them to `kml.ModelParallel(mesh, rules)`.

    Raises:
        InvalidRuleError: `model_axis` is not an axis of `mesh`.
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
        >>> tight = kml.auto_rules(model, mesh, memory_budget="150KB", batch=x, optimizer="adam")
        >>> tight.rules[0].pattern, tight.rules[0].axes
        ('(?:mlp/)?up/kernel', ('data', 'model'))
        >>> tight.rules[0].note.split(" (")[0]
        '2-D: saves 451.5 KiB/device, sends 68.6 KiB less per step than replicated'
        >>> tight.cost.wire_bytes, tight.cost.memory_bytes <= 150_000, tight.cost.layouts()
        (64684.0, True, {'2-D': 1, 'replicated': 3})
    """
    if model_axis not in mesh.axis_names:
        raise InvalidRuleError(
            f"auto_rules: model_axis={model_axis!r} is not an axis of the mesh, which has axes "
            f"{tuple(mesh.axis_names)}. Fix: pass model_axis= one of them."
        )
    size = mesh_axis_sizes(mesh)[model_axis]
    if batch_axis is None:
        batch_axis = next((axis for axis in mesh.axis_names if axis != model_axis), None)
    _check_budget_args(memory_budget, batch)
    chosen_policy = resolve_policy("auto_rules()", policy, replicate_below=replicate_below)
    planner = _Planner(model, model_axis, size, chosen_policy.replicate_below, batch_axis)
    planner.plan_attention()
    planner._plan_attention_by_name()
    trace = _trace(model, batch)
    if trace is not None:
        planner.plan_traced(trace)
        planner.plan_final(trace)
    planner.plan_projections(pair=trace is None)
    planner.plan_by_name()
    if trace is not None:
        planner.plan_lone(trace)
    if batch is None:
        return LayoutRules(planner.rules, suggested=True, policy=chosen_policy)
    if trace is None:  # pragma: no cover - a batch always traces (`_trace` raises otherwise)
        trace = trace_model(model, batch)
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    table = cost_units(model, planner.proposal(), trace, mesh_axis_sizes(mesh), optimizer)
    chosen = search(table, budget)
    planner.apply(table, chosen)
    rules = LayoutRules(planner.rules, suggested=True, policy=chosen_policy)
    rules.cost = plan_cost(table, chosen, budget)
    return rules


def _check_budget_args(memory_budget: int | str | None, batch: Any) -> None:
    if memory_budget is not None and batch is None:
        raise InvalidOptionError(
            "auto_rules(memory_budget=...) needs batch=: one global batch of inputs (arrays, or "
            "anything with .shape and .dtype), to size the activations and the traffic they cause. "
            'Fix: auto_rules(model, mesh, memory_budget="16GiB", batch=x).'
        )


def _trace(model: keras.Model, batch: Any) -> Trace | None:
    """The model's forward pass on `batch`, or on its input spec when no batch is given."""
    if batch is not None:
        return trace_model(model, batch)
    guess = abstract_batch(model)
    if guess is None:
        return None  # a subclassed model never called: only its layers and names can be read
    try:
        return trace_model(model, guess)
    except Exception:  # the spec was a guess (a batch of 2); the layer graph still plans
        return None


class _Planner:
    def __init__(
        self, model: keras.Model, axis: str, size: int, replicate_below: int, batch_axis: str | None
    ) -> None:
        self.model = model
        self.batch_axis = batch_axis
        self.axis = axis
        self.size = size
        self.replicate_below = replicate_below
        self.rules: list[tuple[str, Axes, str]] = []
        self.decided: set[str] = set()
        #: variable path → the tensor-parallel unit it belongs to (a projection pair, an
        #: attention block, a by-name scope): units split or stay whole together.
        self.units: dict[str, str] = {}
        self.index_of: dict[str, int] = {}
        #: Dense key/value projections kept whole (by layer path): their head counts.
        self.kv_heads: dict[str, int] = {}
        #: Layers whose output an `/output` rule keeps whole over the model axis (by path).
        self.whole_outputs: set[str] = set()
        #: Units that are a final layer split over the model axis (their loss reductions cost traffic).
        self.final_units: set[str] = set()
        #: Key/value weights kept whole beside a traced attention unit's split heads: path → unit.
        self.whole_kv: dict[str, str] = {}
        self.axes_of: dict[str, Axes] = {}
        self.layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        self.consumers: dict[int, list[Any]] = {id(layer): [] for layer in self.layers}
        self.producers: dict[int, list[Any]] = {id(layer): [] for layer in self.layers}
        for layer in self.layers:
            for producer in _producers(layer, self.consumers):
                self.producers[id(layer)].append(producer)
                self.consumers[id(producer)].append(layer)
        self.outputs = {id(_compat.producing_layer(t)) for t in _model_outputs(model)}

    # -- recording --------------------------------------------------------------

    def decide(self, variable: keras.Variable, axes: Axes, note: str, unit: str | None = None) -> None:
        if variable.path not in self.decided:
            self.decided.add(variable.path)
            self.index_of[variable.path] = len(self.rules)
            self.axes_of[variable.path] = tuple(axes)
            self.rules.append((self._pattern(variable.path), tuple(axes), note))
            if unit is not None and any(axes):
                self.units[variable.path] = unit

    def proposal(self) -> Proposal:
        """The decisions so far, frozen: what the costs (`_costs`) read."""
        return Proposal(
            model_axis=self.axis,
            batch_axis=self.batch_axis,
            axes=MappingProxyType(dict(self.axes_of)),
            notes=MappingProxyType({path: self.rules[i][2] for path, i in self.index_of.items()}),
            units=MappingProxyType(dict(self.units)),
            final_units=frozenset(self.final_units),
            kv_heads=MappingProxyType(dict(self.kv_heads)),
            whole_outputs=frozenset(self.whole_outputs),
            whole_kv=MappingProxyType(dict(self.whole_kv)),
        )

    def apply(self, table: CostTable, chosen: Sequence[int]) -> None:
        """Rewrites the rules of every unit to the candidate the search chose, with its note."""
        variables = {v.path: v for v in self.model.weights}
        for unit, index in zip(table.units, chosen, strict=True):
            if len(unit.candidates) == 1:
                continue
            candidate = unit.candidates[index]
            why = explain(unit, index)
            for path, axes in candidate.axes.items():
                detail = candidate.notes.get(path) or unit.notes.get(path, "")
                note = why if candidate.layout == "replicated" or not detail else f"{why} ({detail})"
                self.relayout(variables[path], axes, note)

    def relayout(self, variable: keras.Variable, axes: Axes, note: str) -> None:
        """Replaces the decision for `variable` (the search's choice)."""
        entry = (self._pattern(variable.path), tuple(axes), note)
        if variable.path in self.index_of:
            self.rules[self.index_of[variable.path]] = entry
        else:
            self.decide(variable, axes, note)
        self.axes_of[variable.path] = tuple(axes)

    def _pattern(self, path: str) -> str:
        """The variable's path, tolerant of the model-name scope.

        A Sequential model built in code puts its name first (`mlp/fc1/kernel`);
        the same model loaded from a `.keras` file does not (`fc1/kernel`).
        """
        prefix = self.model.name + "/"
        if path.startswith(prefix):
            return f"(?:{re.escape(prefix)})?{re.escape(path[len(prefix) :])}"
        return re.escape(path)

    # -- attention ----------------------------------------------------------------

    def plan_attention(self) -> None:
        for layer in _compat.sublayers(self.model):
            if isinstance(layer, ATTENTION):
                self._attention(layer)

    def _attention(self, layer: Any) -> None:
        """Splits an attention layer's projections over heads, read off their einsum equations."""
        projections = [
            sub for sub in _compat.sublayers(layer) if _heads_dim(sub) is not None
        ]
        query_like = [sub for sub in projections if _heads_dim(sub)[1] == "in"]
        heads = max((sub.kernel.shape[_heads_dim(sub)[0]] for sub in query_like), default=0)
        for sub in projections:
            self._heads_projection(sub, heads)
        for variable in layer.weights:
            self.decide(variable, (None,) * len(variable.shape), "attention: not a projection over heads")

    def _heads_projection(self, layer: Any, heads: int) -> None:
        """One EinsumDense projecting into heads (query/key/value) or out of them."""
        index, side = _heads_dim(layer)
        count = layer.kernel.shape[index]
        if heads % self.size or count % self.size:
            if side == "in" and not heads % self.size:
                note = (
                    f"grouped-query attention: {count} key/value heads do not divide by "
                    f"{self.axis!r} ({self.size}), so every device keeps them all"
                )
                self._keep_output_whole(layer.path, rank=len(layer.equation.split("->")[1]))
            else:
                note = f"attention replicated: {heads} heads do not divide by {self.axis!r} ({self.size})"
            for variable in layer.weights:
                self.decide(variable, (None,) * len(variable.shape), note)
            return
        for variable in layer.weights:
            labels = _labels(layer, variable)
            head_label = layer.equation.split(",")[1].split("->")[0][index]
            if head_label in labels:
                axes = tuple(self.axis if label == head_label else None for label in labels)
                if side == "in":
                    note = f"attention {layer.name}: heads split ({count} heads)"
                else:
                    note = "attention output: heads split on its input side; one all-reduce each way"
            else:
                axes, note = (
                    (None,) * len(variable.shape),
                    "attention output bias: added after the all-reduce",
                )
            self.decide(variable, axes, note, unit=layer.path.rsplit("/", 1)[0])

    def _keep_output_whole(self, layer_path: str, rank: int = 4) -> None:
        """Keeps a replicated key/value projection's output whole over the model axis.

        Otherwise XLA splits the replicated projection's gradient over the
        devices that share a key/value head and all-gathers the weights (and
        their optimizer slots) every step.
        """
        pattern = self._pattern(layer_path) + "/output"
        self.whole_outputs.add(layer_path)
        if pattern not in {rule[0] for rule in self.rules}:
            note = "grouped-query attention: key/value output kept whole over the model axis"
            self.rules.append((pattern, (self.batch_axis,) + (None,) * (rank - 1), note))

    # -- projection pairs -------------------------------------------------------------

    def plan_projections(self, pair: bool = True) -> None:
        """Pairs projections along the layer graph (without a trace); notes the ones left whole."""
        paired: set[int] = set()
        for layer in self.layers if pair else ():
            if id(layer) in paired or _features(layer) is None:
                continue
            columns, row = self._pair_from(layer)
            if row is None or id(row) in paired or any(id(c) in paired for c in columns):
                continue
            if not self._splittable(columns, row):
                continue
            pair = f"{' × '.join(c.name for c in columns)} → {row.name}"
            for column in columns:
                paired.add(id(column))
                self.decide(
                    column.kernel,
                    (None, self.axis),
                    f"column-parallel: {pair}, output features split",
                    unit=pair,
                )
                if column.bias is not None:
                    note = f"column-parallel: {pair}, output features split"
                    self.decide(column.bias, (self.axis,), note, unit=pair)
            paired.add(id(row))
            self.decide(
                row.kernel,
                (self.axis, None),
                f"row-parallel: {pair}, input features split; one all-reduce forward, one backward",
                unit=pair,
            )
            if row.bias is not None:
                self.decide(row.bias, (None,), f"row-parallel: {pair}, bias added after the all-reduce")
        for layer in self.layers:
            if _features(layer) is not None and id(layer) not in paired:
                if not any(v.path in self.decided for v in layer.weights):
                    self._replicate_projection(layer)

    def _pair_from(self, layer: Any) -> tuple[list[Any], Any]:
        """`([column, ...], row)` when `layer` starts a pair, else `([], None)`."""
        after = self._follow(layer)
        if after is not None and _features(after) is not None:
            return [layer], after
        if isinstance(after, keras.layers.Multiply):
            columns = [self._trace_back(p) for p in self.producers[id(after)]]
            row = self._follow(after)
            if (
                all(c is not None and _features(c) is not None for c in columns)
                and _features(row) is not None
            ):
                if len({_features(c)[1] for c in columns}) == 1:
                    return columns, row
        return [], None

    def _follow(self, layer: Any) -> Any:
        """The next non-element-wise layer after `layer`, if its output goes nowhere else."""
        while True:
            if id(layer) in self.outputs or len(self.consumers[id(layer)]) != 1:
                return None
            (layer,) = self.consumers[id(layer)]
            if not isinstance(layer, ELEMENTWISE):
                return layer

    def _trace_back(self, layer: Any) -> Any:
        while isinstance(layer, ELEMENTWISE) and len(self.producers[id(layer)]) == 1:
            (layer,) = self.producers[id(layer)]
        return layer if len(self.consumers[id(layer)]) == 1 else None

    def _splittable(self, columns: Sequence[Any], row: Any) -> bool:
        width = _features(columns[0])[1]
        for layer in [*columns, row]:
            if _softmax(layer):
                return False
        if width % self.size:
            pair = f"{' × '.join(c.name for c in columns)} → {row.name}"
            for layer in [*columns, row]:
                self._replicate(
                    layer, f"pair {pair}: {width} features do not divide by {self.axis!r} ({self.size})"
                )
            return False
        small = [layer for layer in [*columns, row] if math.prod(layer.kernel.shape) < self.replicate_below]
        if small:
            for layer in [*columns, row]:
                self._replicate(
                    layer,
                    f"too small to split: {small[0].name} has {math.prod(small[0].kernel.shape)} "
                    f"weights < replicate_below={self.replicate_below}",
                )
            return False
        return True

    def _replicate_projection(self, layer: Any) -> None:
        if id(layer) in self.outputs:
            reason = "final layer: replicated, so its output needs no gathering"
        else:
            reason = "no row-parallel partner follows: replicated, so no activation has to be gathered"
        self._replicate(layer, reason)

    def _replicate(self, layer: Any, reason: str) -> None:
        for variable in layer.weights:
            self.decide(variable, (None,) * len(variable.shape), reason)

    # -- the traced computation ---------------------------------------------------------

    def plan_traced(self, trace: Trace) -> None:
        """Units read off the traced computation: column → row pairs and attention heads.

        A weight an earlier pass decided (an attention layer split over its
        heads, grouped-query key/value projections kept whole) keeps that
        decision, and a unit that holds one is left whole.
        """
        variables = {v.path: v for v in self.model.weights}
        for unit in find_units(trace, self.size):
            members = [(variables[m.path], m) for m in unit.members if m.path in variables]
            if len(members) != len(unit.members) or not all(self._open(v.path) for v, _ in members):
                continue
            name = self._display(unit.name)
            reason = self._traced_reason(members, name)
            if reason is not None:
                for variable, _ in members:
                    self.assign(variable, (None,) * len(variable.shape), reason)
                continue
            for variable, member in members:
                axes = tuple(self.axis if i == member.dim else None for i in range(len(variable.shape)))
                self.assign(variable, axes, _traced_note(unit.kind, member.role, name), unit=name)
            for path in unit.after:
                if path in variables and self._open(path):
                    after = "row-parallel" if unit.kind == "pair" else "attention output"
                    note = f"{after}: {name}, bias added after the all-reduce"
                    self.assign(variables[path], (None,) * len(variables[path].shape), note)
            for path in unit.whole:
                if path in variables and self._open(path):
                    note = (
                        f"grouped-query attention: key/value heads too few to divide by {self.axis!r} "
                        f"({self.size}); kept whole beside the split query heads of {name}"
                    )
                    self.assign(variables[path], (None,) * len(variables[path].shape), note)
                    self.whole_kv[path] = name

    def plan_final(self, trace: Trace) -> None:
        """Final projections: size decides whether they split, not their position.

        A final layer whose kernel is at least as large as the largest kernel
        the plan splits (a language model's head over its vocabulary) has its
        output features split over the model axis like any unit: the loss
        reduces the split logits with a few small all-reduces, and its input
        gradient is all-reduced. A smaller one stays whole, so its output
        needs no gathering.
        """
        variables = {v.path: v for v in self.model.weights}
        split = [math.prod(variables[p].shape) for p, axes in self.axes_of.items() if self.axis in axes]
        largest = max(split, default=0)
        for path, uses in trace.uses.items():
            variable = variables.get(path)
            if variable is None or path in self.decided or len(variable.shape) != 2 or len(uses) != 1:
                continue
            (use,) = uses
            output = trace.nodes[use.node].outputs[0]
            if use.kind != "matmul" or use.contracted != (0,) or not _reaches_output(trace, output):
                continue
            count = math.prod(variable.shape)
            name = self._display(_weight_name(path))
            if largest and count >= largest and count >= self.replicate_below and not (
                variable.shape[1] % self.size
            ):
                note = (
                    f"final layer {name}, vocab-parallel: {count:,} weights, at least the {largest:,} of "
                    f"the largest split kernel, so its output features split over {self.axis!r}; the loss "
                    "reduces the split outputs with small all-reduces, its input gradient is all-reduced"
                )
                unit = f"{name} (final layer)"
                self.assign(variable, (None, self.axis), note, unit=unit)
                self.final_units.add(unit)
                for bias in find_added(trace, [output]):
                    if bias in variables and len(variables[bias].shape) == 1 and bias not in self.decided:
                        self.assign(variables[bias], (self.axis,), note, unit=unit)
                continue
            why = (
                f"{count:,} weights, fewer than the {largest:,} of the largest split kernel"
                if largest
                else "the plan splits no other kernel"
            )
            note = f"final layer: replicated, so its output needs no gathering ({why})"
            self.decide(variable, (None,) * 2, note)
            for bias in find_added(trace, [output]):
                if bias in variables and bias not in self.decided:
                    self.decide(variables[bias], (None,) * len(variables[bias].shape), note)

    def plan_lone(self, trace: Trace) -> None:
        """Notes the projection weights no unit took, in custom layers as in Keras ones."""
        variables = {v.path: v for v in self.model.weights}
        for path, uses in trace.uses.items():
            if path in self.decided or path not in variables or any(u.kind != "matmul" for u in uses):
                continue
            final = any(_reaches_output(trace, trace.nodes[u.node].outputs[0]) for u in uses)
            reason = (
                "final layer: replicated, so its output needs no gathering"
                if final
                else "no row-parallel partner follows: replicated, so no activation has to be gathered"
            )
            self.decide(variables[path], (None,) * len(variables[path].shape), reason)

    def _traced_reason(self, members: list[tuple[Any, Any]], name: str) -> str | None:
        """Why a traced unit stays whole (a split that does not divide, a kernel too small), or `None`."""
        for variable, member in members:
            if variable.shape[member.dim] % self.size:
                return (
                    f"pair {name}: {variable.shape[member.dim]} features do not divide by "
                    f"{self.axis!r} ({self.size})"
                )
        for variable, member in members:
            if member.role != "bias" and math.prod(variable.shape) < self.replicate_below:
                return (
                    f"too small to split: {self._display(_weight_name(variable.path))} has "
                    f"{math.prod(variable.shape)} weights < replicate_below={self.replicate_below}"
                )
        return None

    def _open(self, path: str) -> bool:
        """Whether a variable is still undecided."""
        return path not in self.decided

    def assign(self, variable: keras.Variable, axes: Axes, note: str, unit: str | None = None) -> None:
        """Records or replaces the decision for `variable`, and its unit."""
        self.relayout(variable, axes, note)
        self.units.pop(variable.path, None)
        if unit is not None and any(axes):
            self.units[variable.path] = unit

    def _display(self, name: str) -> str:
        return name.replace(self.model.name + "/", "")

    # -- custom layers, by name --------------------------------------------------------

    def plan_by_name(self) -> None:
        """Variables of layers the graph does not show: attention blocks, then `transformer_rules`."""
        presets = transformer_rules(model_axis=self.axis)
        matched: list[tuple[Any, Axes, str]] = []
        for variable in self.model.weights:
            if variable.path in self.decided:
                continue
            rule = presets.match(variable.path)
            if rule is None:
                continue
            axes = rule.expand(len(variable.shape))
            if axes is None or any(a and d % self.size for a, d in zip(axes, variable.shape, strict=True)):
                matched.append(
                    (
                        variable,
                        (None,) * len(variable.shape),
                        f"by name ({rule.note}), but its shape does not fit: replicated",
                    )
                )
            else:
                matched.append((variable, axes, f"by name: {rule.note}"))
        self._pair_by_scope(matched)

    def _pair_by_scope(self, matched: list[tuple[Any, Axes, str]]) -> None:
        """Keeps by-name column- and row-parallel layers only as a pair in one scope.

        A column layer alone leaves its output split, and whatever reads it
        must gather it; a row layer alone all-reduces its output for a weight
        no column layer prepared. So without a partner in the same scope each
        stays whole.
        """
        roles = {id(v): ffn_role(v.path) if any(axes) else None for v, axes, _ in matched}
        rows = {_scope(v.path) for v, _, _ in matched if roles[id(v)] == "row"}
        columns = {_scope(v.path) for v, _, _ in matched if roles[id(v)] == "column"}
        for variable, axes, note in matched:
            role = roles[id(variable)]
            if role == "column" and _scope(variable.path) not in rows:
                axes = (None,) * len(variable.shape)
                note = f"{note}; no row-parallel partner beside it, so replicated"
            elif role == "row" and _scope(variable.path) not in columns:
                axes = (None,) * len(variable.shape)
                note = f"{note}; no column-parallel partner beside it, so replicated"
            self.decide(variable, axes, note, unit=_scope(variable.path))

    def _plan_attention_by_name(self) -> None:
        """Attention blocks in custom layers, found by their projections' names.

        A block is a layer with a query projection (or a fused query/key/value
        one) and an output projection among its direct sublayers, named as in
        Keras and keras-hub code (`_HEAD_PROJECTIONS`). A layer's direct
        sublayers are read off the layer objects, not the variable paths, since
        some layers are built outside their parent's name scope (SmolLM's
        `o_proj/kernel`).
        """
        for block in _compat.sublayers(self.model):
            if isinstance(block, ATTENTION):
                continue  # planned from its own structure by plan_attention
            roles: dict[str, Any] = {}
            for child in _compat.sublayers(block, recursive=False):
                role = _HEAD_PROJECTIONS.get(child.name)
                if role is not None and getattr(child, "kernel", None) is not None:
                    roles.setdefault(role, child)
            if not ({"query", "fused"} & roles.keys()):
                continue
            query = roles.get("query", roles.get("fused"))
            if any(v.path in self.decided for v in query.weights):
                continue  # the graph planner has it (an output projection's path may be shared)
            self._attention_block(block, roles)

    def _attention_block(self, block: Any, roles: dict[str, Any]) -> None:
        """Splits one by-name attention block over heads, or replicates it with the reason."""
        unit = block.path
        heads = _head_count(block, roles)
        head_dim = None
        reason = None
        query = roles.get("query", roles.get("fused"))
        if heads is None:
            reason = f"attention {block.name}: its head count is unknown, so replicated"
        elif "output" not in roles:
            reason = f"attention {block.name}: no output projection beside it, so replicated"
        elif heads % self.size:
            reason = f"attention replicated: {heads} heads do not divide by {self.axis!r} ({self.size})"
        elif _heads_dim(query) is None:
            width = query.kernel.shape[-1]
            if "query" in roles and len(query.kernel.shape) == 2 and width % heads == 0:
                head_dim = width // heads
            else:
                reason = (
                    f"attention {block.name}: a fused query/key/value kernel of shape "
                    f"{tuple(query.kernel.shape)} holds its heads inside one feature axis, so a split "
                    "would cut across query, key and value: replicated"
                    if "fused" in roles
                    else f"attention {block.name}: {width} query features do not make {heads} heads"
                )
        if reason is not None:
            for layer in roles.values():
                self._by_name_replicate(layer, reason, unit)
            return
        for role, layer in roles.items():
            if _heads_dim(layer) is not None:
                self._heads_projection(layer, heads)
                for variable in layer.weights:
                    if variable.path in self.units:
                        self.units[variable.path] = unit
            elif role == "output" and _features(layer) is not None and _features(layer)[0] % heads == 0:
                note = "attention output: heads split on its input side; one all-reduce each way"
                self.decide(layer.kernel, (self.axis, None), note, unit=unit)
                if layer.bias is not None:
                    self.decide(layer.bias, (None,), "attention output bias: added after the all-reduce")
            elif role in ("query", "key", "value") and head_dim and _features(layer) is not None:
                self._dense_heads(layer, layer.kernel.shape[1] // head_dim, head_dim, heads, unit)
            else:
                self._by_name_replicate(
                    layer,
                    f"attention {block.name}: {layer.name} of kernel shape {tuple(layer.kernel.shape)} "
                    "is not a projection over heads the planner can read",
                    unit,
                )

    def _dense_heads(self, layer: Any, count: int, head_dim: int, heads: int, unit: str) -> None:
        """A Dense query/key/value projection with an `(hidden, heads × head_dim)` kernel.

        Its output features hold the heads one after another, so splitting
        them over the model axis gives each device whole heads, provided the
        head count divides.
        """
        if count * head_dim != layer.kernel.shape[1]:
            self._by_name_replicate(
                layer, f"attention: {layer.kernel.shape[1]} features are not whole heads of {head_dim}", unit
            )
        elif count % self.size:
            note = (
                f"grouped-query attention: {count} key/value heads do not divide by "
                f"{self.axis!r} ({self.size}), so every device keeps them all"
            )
            self._by_name_replicate(layer, note, unit)
            self._keep_output_whole(layer.path, rank=_input_rank(layer))
            self.kv_heads[layer.path] = count
        else:
            note = f"attention {layer.name}: heads split ({count} heads of {head_dim}, output features)"
            self.decide(layer.kernel, (None, self.axis), note, unit=unit)
            if layer.bias is not None:
                self.decide(layer.bias, (self.axis,), note, unit=unit)

    def _by_name_replicate(self, layer: Any, reason: str, unit: str) -> None:
        for variable in layer.weights:
            self.decide(variable, (None,) * len(variable.shape), reason, unit=unit)


def _reaches_output(trace: Trace, value: int) -> bool:
    """Whether `value` is a model output, a bias add or cast at most away."""
    for _ in range(4):
        if value in trace.outputs:
            return True
        readers = trace.consumers.get(value, ())
        if len(readers) != 1 or trace.nodes[readers[0]].primitive not in ("add", "convert_element_type"):
            return False
        value = trace.nodes[readers[0]].outputs[0]
    return value in trace.outputs


def _weight_name(path: str) -> str:
    """A weight's readable name: its layer's path for `.../kernel`, else the path."""
    head, _, tail = path.rpartition("/")
    return head if head and tail in ("kernel", "embeddings") else path


def _traced_note(kind: str, role: str, name: str) -> str:
    """The note of a weight in a unit found in the traced computation."""
    if kind == "attention":
        if role == "row":
            return f"attention output: {name}, heads split on its input side; one all-reduce each way"
        return f"attention {name}: heads split (output features)"
    if role == "row":
        return f"row-parallel: {name}, input features split; one all-reduce forward, one backward"
    return f"column-parallel: {name}, output features split"


#: Attention projections by name, as Keras and keras-hub write them, and their role.
_HEAD_PROJECTIONS = {
    **dict.fromkeys(("query", "q_proj", "query_dense", "query_projector", "q_dense_layer"), "query"),
    **dict.fromkeys(("key", "k_proj", "key_dense", "key_projector", "k_dense_layer"), "key"),
    **dict.fromkeys(("value", "v_proj", "value_dense", "value_projector", "v_dense_layer"), "value"),
    **dict.fromkeys(("query_key_value",), "fused"),
    **dict.fromkeys(
        ("attention_output", "o_proj", "output_dense", "output_projector", "o_dense_layer"), "output"
    ),
}

#: Attributes attention layers keep their query head count in (keras-hub, Keras, common code).
_HEAD_COUNT_ATTRIBUTES = ("num_query_heads", "num_attention_heads", "num_heads", "heads", "_num_heads")


def _head_count(block: Any, roles: dict[str, Any]) -> int | None:
    """The query head count of an attention block, read off an einsum kernel or the layer."""
    for role, side in (("query", "in"), ("fused", "in"), ("output", "out")):
        layer = roles.get(role)
        if layer is not None and _heads_dim(layer) is not None and _heads_dim(layer)[1] == side:
            return int(layer.kernel.shape[_heads_dim(layer)[0]])
    for name in _HEAD_COUNT_ATTRIBUTES:
        value = getattr(block, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _input_rank(layer: Any) -> int:
    """The rank of a built layer's input (and so of a Dense layer's output); 3 if unknown."""
    shapes = _compat.build_shapes(layer)
    shape = next(iter(shapes.values()), None)
    return len(shape) if isinstance(shape, (tuple, list)) else 3


def _scope(path: str) -> str:
    """The scope a variable's layer sits in: `block_0/ffn_up/kernel` → `block_0`."""
    return path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""


def _softmax(layer: Any) -> bool:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", "") in ("softmax", "log_softmax")


def _producers(layer: Any, known: dict[int, Any]) -> Iterator[Any]:
    seen = set()
    for producer in _compat.input_layers(layer):
        if id(producer) in known and id(producer) not in seen:
            seen.add(id(producer))
            yield producer


def _model_outputs(model: keras.Model) -> list[Any]:
    outputs = getattr(model, "outputs", None) or []
    return [t for t in keras.tree.flatten(outputs) if _compat.made_by_a_layer(t)]
