"""The memory-budget planner: per unit of weights, the layout that fits at the least traffic.

`auto_rules(model, mesh, memory_budget=..., batch=...)` starts from the
automatic planner's units (a column → row projection pair, an attention
block, an embedding) and gives each a few candidate layouts:

- `replicated`: every device holds the unit; its gradients are all-reduced
  over the batch axis;
- `tensor-parallel`: the planner's split over the model axis; the gradient
  all-reduce shrinks by the model-axis size, and activations are all-reduced
  over the model axis (forward after a row-parallel projection, backward
  before each column-parallel one);
- `2-D`: tensor-parallel, with each split kernel's largest other dimension
  also split over the batch axis; XLA all-gathers those kernels over the batch
  axis before use, once per step;
- `vocab-parallel` (embeddings): the vocabulary split over the model axis,
  one all-reduce of the looked-up activations forward.

Costs are counted with the ring formulas of the communication report
(`kml.comm_report`), from the shapes the model's projections see on one
batch (traced with `jax.eval_shape`: nothing runs). Memory is per device:
parameters, gradients and optimizer slots, plus an activation reserve (the
outputs of every projection and embedding at their replicated size, a
deliberately simple upper estimate that ignores attention scores and
element-wise temporaries). The search starts from each unit's cheapest
layout; while the total exceeds the budget it takes the move that saves the
most memory per byte of extra traffic; then it walks back any move the
budget no longer needs.

This is where a memory budget is met: the costs (`Costs`), the search
(`choose`) and the notes that explain each choice.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._errors import InvalidOptionError, MemoryBudgetError
from ..core._format import format_bytes
from ..core._memory import parse_bytes, slot_model
from ..core._mesh import mesh_axis_sizes
from ..core._rules import Axes, LayoutRules
from ..report._hlo import wire_bytes
from ._trace import Trace, trace_model

__all__ = ["PlanCost", "UnitChoice"]


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    """The layout chosen for one unit of weights, and what it costs.

    Attributes:
        unit: The unit: a layer path, a projection pair or an attention block.
        layout: `"replicated"`, `"tensor-parallel"`, `"2-D"` or `"vocab-parallel"`.
        state_bytes: Per-device bytes of its parameters, gradients and optimizer slots.
        wire_bytes: Bytes each device sends for it per training step.
        note: Why, against keeping the unit replicated.
    """

    unit: str
    layout: str
    state_bytes: int
    wire_bytes: float
    note: str


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """What the planner predicts one training step of its plan costs, per device.

    Attributes:
        wire_bytes_by_axis: Bytes each device sends per step, by mesh axis, as
            `kml.comm_report` counts them (ring formulas).
        state_bytes: Parameters, gradients, optimizer slots and non-trainable
            state held by each device.
        activation_bytes: The activation reserve (see `kml.auto_rules`).
        budget: The memory budget per device, or `None`.
        choices: One `UnitChoice` per unit of weights with more than one layout.
    """

    wire_bytes_by_axis: Mapping[str, float]
    state_bytes: int
    activation_bytes: int
    budget: int | None
    choices: tuple[UnitChoice, ...]

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per step, over every axis."""
        return float(sum(self.wire_bytes_by_axis.values()))

    @property
    def memory_bytes(self) -> int:
        """State plus the activation reserve: what the budget is compared with."""
        return self.state_bytes + self.activation_bytes

    def layouts(self) -> dict[str, int]:
        """How many units took each layout: `{"tensor-parallel": 4, "2-D": 2}`."""
        counts: dict[str, int] = {}
        for choice in self.choices:
            counts[choice.layout] = counts.get(choice.layout, 0) + 1
        return counts

    def __str__(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {format_bytes(self.budget)}"
        layouts = ", ".join(f"{n} {name}" for name, n in sorted(self.layouts().items()))
        return (
            f"{format_bytes(self.wire_bytes)} sent per device per step; "
            f"{format_bytes(self.state_bytes)} state + {format_bytes(self.activation_bytes)} "
            f"activations per device ({budget}); units: {layouts or 'none'}"
        )


@dataclasses.dataclass
class _Option:
    layout: str
    axes: dict[str, Axes]
    state: int
    wire: dict[str, float]

    @property
    def total(self) -> float:
        return sum(self.wire.values())


@dataclasses.dataclass
class _Unit:
    name: str
    options: list[_Option]
    note: dict[str, str]
    chosen: int = 0


class Costs:
    """Per-unit layouts, their per-device state bytes and wire bytes, for one batch."""

    def __init__(
        self,
        model: keras.Model,
        planner: Any,
        batch: Any,
        *,
        model_axis: str,
        batch_axis: str | None,
        axis_sizes: Mapping[str, int],
        optimizer: Any,
        trace: Trace | None = None,
    ) -> None:
        self.model = model
        self.planner = planner
        self.model_axis = model_axis
        self.batch_axis = batch_axis
        self.m = axis_sizes[model_axis]
        self.d = axis_sizes.get(batch_axis, 1) if batch_axis else 1
        self.trace = trace if trace is not None else trace_model(model, batch)
        self.used = dict(self.trace.read)
        self.uses = self.trace.uses
        self.memory = slot_model(optimizer)
        self.tp_axes = dict(planner.axes_of)

    # -- bytes ---------------------------------------------------------------------

    def _grad_sync(self, variable: Any, shards: int) -> float:
        # Only what the step reads gets a gradient to sum: nothing, a slice, or all of it.
        read = _nbytes(variable) * self.used.get(variable.path, 0.0)
        return wire_bytes("all-reduce", read / shards, self.d)

    def _state(self, variable: Any, shards: int, trainable: bool) -> int:
        return self.memory.state_bytes(tuple(variable.shape), str(variable.dtype), shards, trainable)

    def _activation(self, shape: Sequence[int], dtype: str) -> float:
        """Per-device bytes of an activation whose first dimension is the batch."""
        return math.prod(shape) / self.d * np.dtype(dtype).itemsize

    def _summed(self, shape: Sequence[int], dtype: str) -> float:
        """Per-device bytes of an activation a collective moves.

        Partial sums travel in float32 even when the layer computes in
        bfloat16 or float16 (measured under `mixed_bfloat16` on XLA:CPU: the
        matmul accumulates in float32 and the all-reduce comes before the cast).
        """
        return math.prod(shape) / self.d * max(np.dtype(dtype).itemsize, 4)

    def calls(self, path: str) -> list[tuple[tuple, tuple, bool, str]]:
        """`(activation shape, output shape, reads a model input, dtype)` of each projection by `path`."""
        return [
            (use.inputs, use.output, use.from_input, use.dtype)
            for use in self.uses.get(path, ())
            if use.kind == "matmul"
        ]

    def side(self, path: str, axes: Axes) -> str:
        """`"column"` when a kernel's split dimension is an output one, `"row"` when it is summed over."""
        if self.model_axis not in axes:
            return ""
        uses = [use for use in self.uses.get(path, ()) if use.kind == "matmul"]
        if not uses:
            return ""
        return "row" if axes.index(self.model_axis) in uses[0].contracted else "column"

    # -- units -----------------------------------------------------------------------

    def units(self) -> list[_Unit]:
        """One unit per group of weights that split together; the rest as one fixed unit."""
        trainable = {id(v) for v in self.model.trainable_weights}
        owners = _owners(self.model)
        by_unit: dict[str, list[Any]] = {}
        for variable in self.model.weights:
            unit = self.planner.units.get(variable.path)
            if unit is not None:
                by_unit.setdefault(unit, []).append(variable)
        in_units = {id(v) for variables in by_unit.values() for v in variables}
        units = [self._tensor_parallel_unit(name, variables, owners) for name, variables in by_unit.items()]
        fixed_state, fixed_wire = self.memory.scalar_bytes, {}
        for variable in self.model.weights:
            if id(variable) in in_units:
                continue
            owner = owners.get(id(variable))
            embedding = self._embedding_unit(owner, variable) if owner is not None else None
            if embedding is not None:
                units.append(embedding)
                continue
            if id(variable) in trainable and variable.path not in self.used:
                idle = self._idle_unit(variable)
                if idle is not None:
                    units.append(idle)
                    continue
            fixed_state += self._state(variable, 1, id(variable) in trainable)
            if id(variable) in trainable:
                # A table looked up more than once (T5's shared encoder/decoder embedding)
                # has its gradient summed once per lookup: XLA does not add them first.
                lookups = (
                    len(self.uses.get(variable.path, ())) if isinstance(owner, keras.layers.Embedding) else 1
                )
                _add(fixed_wire, self.batch_axis, max(lookups, 1) * self._grad_sync(variable, 1))
        # The loss is averaged over the batch axis: one scalar all-reduce.
        _add(fixed_wire, self.batch_axis, wire_bytes("all-reduce", 4, self.d))
        units.append(_Unit("(everything else)", [_Option("replicated", {}, fixed_state, fixed_wire)], {}))
        return units

    def _replicated(self, variables: Sequence[Any]) -> _Option:
        wire: dict[str, float] = {}
        for variable in variables:
            _add(wire, self.batch_axis, self._grad_sync(variable, 1))
        return _Option(
            "replicated",
            {v.path: (None,) * len(v.shape) for v in variables},
            sum(self._state(v, 1, v.trainable) for v in variables),
            wire,
        )

    def _tensor_parallel_unit(self, name: str, variables: list[Any], owners: Mapping[int, Any]) -> _Unit:
        replicated = self._replicated(variables)
        tp_wire: dict[str, float] = {}
        tp_axes: dict[str, Axes] = {}
        two_d_axes: dict[str, Axes] = {}
        tp_state = two_d_state = 0
        gathers = 0.0
        kernels: list[Any] = []
        for variable in variables:
            axes = self.tp_axes[variable.path]
            shards = self.m if self.model_axis in axes else 1
            tp_axes[variable.path] = axes
            tp_state += self._state(variable, shards, variable.trainable)
            _add(tp_wire, self.batch_axis, self._grad_sync(variable, shards))
            spread = _second_axis(axes, variable.shape, self.batch_axis, self.d)
            two_d_axes[variable.path] = spread
            owner = owners.get(id(variable))
            if spread != axes:
                gathered = _nbytes(variable) / shards
                count = self._gathers_per_step(owner, variable, gathered, axes)
                gathers += count * wire_bytes("all-gather", gathered, self.d)
                two_d_state += self._state(variable, shards * self.d, variable.trainable)
            else:
                two_d_state += self._state(variable, shards, variable.trainable)
            if self.side(variable.path, axes):
                kernels.append(variable)
        final = name in getattr(self.planner, "final_units", ())
        for kernel in kernels:
            side = self.side(kernel.path, self.tp_axes[kernel.path])
            for inputs, output, from_input, dtype in self.calls(kernel.path):
                if final:
                    # The loss reduces split logits: four float32 all-reduces of one value per position
                    # (measured with sparse categorical cross-entropy on XLA:CPU).
                    per_position = math.prod(output[:-1]) / self.d * 4
                    _add(tp_wire, self.model_axis, 4 * wire_bytes("all-reduce", per_position, self.m))
                if side == "row":
                    _add(
                        tp_wire,
                        self.model_axis,
                        wire_bytes("all-reduce", self._summed(output, dtype), self.m),
                    )
                elif side == "column" and not from_input:
                    _add(
                        tp_wire,
                        self.model_axis,
                        wire_bytes("all-reduce", self._summed(inputs, dtype), self.m),
                    )
        layers = {id(owners[id(k)]): owners[id(k)] for k in kernels if id(k) in owners}
        for kv in self._grouped_kv(name, layers):
            _add(tp_wire, self.model_axis, kv)
        self._traced_kv(name, tp_wire)
        options = [replicated, _Option("tensor-parallel", tp_axes, tp_state, tp_wire)]
        if self.d > 1 and two_d_axes != tp_axes:
            options.append(_Option("2-D", two_d_axes, two_d_state, _plus(tp_wire, self.batch_axis, gathers)))
        notes = {path: self.planner.rules[self.planner.index_of[path]][2] for path in tp_axes}
        return _Unit(name, options, notes)

    def _gathers_per_step(self, layer: Any, kernel: Any, gathered: float, axes: Axes) -> int:
        """How often XLA all-gathers a 2-D kernel over the batch axis in one step.

        Measured on XLA:CPU (jaxlib 0.10) on MLPs and on the Llama, Gemma,
        Mistral, Falcon, Qwen, SmolLM3, GPT-2, BERT and T5 backbones of the
        tests: the kernel gathered for the forward pass is kept for the
        backward one, except over a batch axis of 4 or more devices when it is
        larger than both the projection's input and output on one device (at
        least as large, for a `Dense` kernel); then it is gathered again,
        unless the projection reads the model's input (no input gradient, so
        the backward pass needs no kernel).
        `tests/test_budget.py` holds this against the compiled HLO.
        """
        side = self.side(kernel.path, self.tp_axes[kernel.path])
        if not side or self.d < 4:
            return 1
        largest = 0.0
        for inputs, output, from_input, dtype in self.calls(kernel.path):
            if from_input:
                return 1
            local_in = self._activation(inputs, dtype) / (self.m if side == "row" else 1)
            local_out = self._activation(output, dtype) / (self.m if side == "column" else 1)
            largest = max(largest, local_in, local_out)
        if isinstance(layer, keras.layers.EinsumDense):
            return 2 if gathered > largest else 1
        return 2 if gathered >= largest else 1  # a Dense layer, or a custom layer's matmul

    def _grouped_kv(self, unit: str, layers: Mapping[int, Any]) -> list[float]:
        """The traffic of key/value projections kept whole beside split query heads.

        Their gradients are summed over the devices whose query heads share a
        key/value head, and gathered back to all heads: per projection one
        all-reduce of one head's activations over those devices, and (with
        more than one key/value head) one all-gather of all of them.
        """
        from ._auto import _heads_dim

        extra: list[float] = []
        if not layers:
            return extra
        for layer in _compat.sublayers(self.model):
            path = getattr(layer, "path", None) or ""
            if path.rpartition("/")[0] != unit or id(layer) in layers:
                continue  # only the key/value projections of this very attention block
            heads = _heads_dim(layer)
            if id(layer) in self.planner.kv_heads:  # a Dense key/value projection
                count = self.planner.kv_heads[id(layer)]
            elif heads is not None and heads[1] == "in" and self.planner.kept_whole(layer.path):
                count = layer.kernel.shape[heads[0]]
            else:
                continue
            if count == 0 or self.m % count:
                continue
            group = self.m // count
            for _, output, _, dtype in self.calls(layer.kernel.path):
                all_heads = self._summed(output, dtype)
                extra.append(wire_bytes("all-reduce", all_heads / count, group))
                if count > 1:
                    extra.append(wire_bytes("all-gather", all_heads, count))
        return extra

    def _traced_kv(self, unit: str, wire: dict[str, float]) -> None:
        """Key/value weights of a custom layer kept whole beside this unit's split query heads.

        No layer output can be kept whole there (the projections are
        `ops.matmul` calls inside a layer), so, measured on XLA:CPU, each
        weight's gradient is summed only over the devices sharing a
        key/value head (group = model axis ÷ key/value heads), and every step
        the weight and its optimizer slots are all-gathered over that group;
        the activations cost as for `_grouped_kv`.
        """
        for path, owner in getattr(self.planner, "whole_kv", {}).items():
            if owner != unit:
                continue
            count = self._kv_heads(path)
            if count is None or self.m % count:
                continue
            group = self.m // count
            variable = next(v for v in self.model.weights if v.path == path)
            size = _nbytes(variable)
            _add(wire, self.batch_axis, self._grad_sync(variable, group) - self._grad_sync(variable, 1))
            gathered = (1 + self.memory.like_parameter) * wire_bytes("all-gather", size, group)
            _add(wire, self.model_axis, gathered)
            for _, output, _, dtype in self.calls(path):
                all_heads = self._summed(output, dtype)
                _add(wire, self.model_axis, wire_bytes("all-reduce", all_heads / count, group))
                if count > 1:
                    _add(wire, self.model_axis, wire_bytes("all-gather", all_heads, count))

    def _kv_heads(self, path: str) -> int | None:
        """The key/value heads a projection's output is reshaped into (`(..., heads, head_dim)`)."""
        for use in self.uses.get(path, ()):
            output = self.trace.nodes[use.node].outputs[0]
            for index in self.trace.consumers.get(output, ()):
                node = self.trace.nodes[index]
                shape = self.trace.shapes[node.outputs[0]]
                if node.primitive == "reshape" and len(shape) == len(use.output) + 1:
                    return int(shape[-2])
        return None

    def _embedding_unit(self, owner: Any, variable: Any) -> _Unit | None:
        """A look-up table: a Keras `Embedding`, or a custom layer's weight read only by one `take`."""
        if isinstance(owner, keras.layers.Embedding):
            if variable is not owner.embeddings:
                return None
        elif type(owner).__module__.startswith(("keras.", "keras_hub.")):
            return None  # Keras and keras-hub tables other than embeddings (relative position biases)
        calls = self.uses.get(variable.path, ())
        if (
            len(calls) != 1
            or calls[0].kind != "gather"
            or len(variable.shape) != 2
            or variable.shape[0] % self.m
            or not variable.trainable
        ):
            return None  # a tied embedding used twice, or one that does not divide: kept whole
        output, dtype = calls[0].output, calls[0].dtype
        wire: dict[str, float] = {}
        _add(wire, self.batch_axis, self._grad_sync(variable, self.m))
        _add(wire, self.model_axis, wire_bytes("all-reduce", self._summed(output, dtype), self.m))
        split = _Option(
            "vocab-parallel",
            {variable.path: (self.model_axis, None)},
            self._state(variable, self.m, True),
            wire,
        )
        note = {
            variable.path: f"embedding: vocabulary split over {self.model_axis!r}, one all-reduce forward"
        }
        return _Unit(getattr(owner, "path", variable.path), [self._replicated([variable]), split], note)

    def _idle_unit(self, variable: Any) -> _Unit | None:
        """A trainable weight the step never reads (an untied output embedding, say).

        It gets no gradient, so splitting it over both axes costs no traffic.
        """
        shape = tuple(variable.shape)
        dims = sorted(range(len(shape)), key=lambda i: -shape[i])
        axes: list[str | None] = [None] * len(shape)
        shards = 1
        for axis, size in ((self.model_axis, self.m), (self.batch_axis, self.d)):
            free = [i for i in dims if axes[i] is None and size > 1 and shape[i] % size == 0]
            if axis is not None and free:
                axes[free[0]] = axis
                shards *= size
        if shards == 1:
            return None
        split = _Option(
            "split, unused", {variable.path: tuple(axes)}, self._state(variable, shards, True), {}
        )
        note = {variable.path: "the training step never reads it: no gradient, so no traffic"}
        return _Unit(variable.path, [self._replicated([variable]), split], note)

    def activation_reserve(self) -> int:
        total = 0.0
        for uses in self.uses.values():
            for use in uses:
                total += self._activation(use.output, use.dtype)
        return int(total)


def within_budget(
    planner: Any,
    model: keras.Model,
    mesh: keras.distribution.DeviceMesh,
    memory_budget: int | str | None,
    batch: Any,
    optimizer: Any,
    trace: Trace | None = None,
) -> LayoutRules:
    """The auto planner's rules, each unit laid out to fit `memory_budget` at the least traffic.

    Without a budget every unit keeps the planner's own layout; either way the
    rules carry `rules.cost`.
    """
    axis_sizes = mesh_axis_sizes(mesh)
    budget = None if memory_budget is None else parse_bytes(memory_budget)
    costs = Costs(
        model,
        planner,
        batch,
        model_axis=planner.axis,
        batch_axis=planner.batch_axis,
        axis_sizes=axis_sizes,
        optimizer=optimizer if optimizer is not None else getattr(model, "optimizer", None),
        trace=trace,
    )
    units = costs.units()
    reserve = costs.activation_reserve()
    if budget is None:
        for unit in units:  # today's plan: the planner's own layout for every unit
            unit.chosen = 1 if len(unit.options) > 1 and unit.options[1].layout == "tensor-parallel" else 0
    else:
        choose(units, budget, reserve)
    owners = {v.path: v for v in model.weights}
    choices = []
    wire: dict[str, float] = {}
    for unit in units:
        option = unit.options[unit.chosen]
        for axis, amount in option.wire.items():
            wire[axis] = wire.get(axis, 0.0) + amount
        if len(unit.options) == 1:
            continue
        why = explain(unit)
        choices.append(UnitChoice(unit.name, option.layout, option.state, option.total, why))
        for path, axes in option.axes.items():
            detail = unit.note.get(path, "")
            note = why if option.layout == "replicated" or not detail else f"{why} ({detail})"
            planner.relayout(owners[path], axes, note)
    rules = LayoutRules(planner.rules, suggested=True)
    rules.cost = PlanCost(
        wire_bytes_by_axis=wire,
        state_bytes=sum(unit.options[unit.chosen].state for unit in units),
        activation_bytes=reserve,
        budget=budget,
        choices=tuple(choices),
    )
    return rules


def choose(units: list[_Unit], budget: int | None, reserve: int) -> None:
    """Picks one option per unit: the least traffic whose memory fits `budget`."""
    for unit in units:
        unit.chosen = min(
            range(len(unit.options)), key=lambda i: (unit.options[i].total, unit.options[i].state)
        )
    if budget is None:
        return

    def memory() -> int:
        return reserve + sum(u.options[u.chosen].state for u in units)

    while memory() > budget:
        best, best_score = None, -math.inf
        for unit in units:
            current = unit.options[unit.chosen]
            for index, option in enumerate(unit.options):
                saved = current.state - option.state
                if saved <= 0:
                    continue
                added = option.total - current.total
                score = math.inf if added <= 0 else saved / added
                if score > best_score or (score == best_score and saved > best[2]):
                    best, best_score = (unit, index, saved), score
        if best is None:
            error = MemoryBudgetError(
                f"auto_rules: the smallest plan needs {format_bytes(memory())} per device "
                f"({format_bytes(reserve)} of it the activation reserve), over the memory budget of "
                f"{format_bytes(budget)}. Fix: a larger budget, a mesh with a larger model axis, a "
                "smaller batch per device, or an optimizer with fewer slots (e.g. Adafactor)."
            )
            error.smallest_bytes = memory()  # what the smallest plan needs, for callers that search
            raise error
        best[0].chosen = best[1]
    # Walk back: any unit whose cheaper-traffic option still fits takes it.
    improved = True
    while improved:
        improved = False
        for unit in sorted(units, key=lambda u: -u.options[u.chosen].total):
            current = unit.options[unit.chosen]
            for index, option in enumerate(unit.options):
                if option.total < current.total and memory() - current.state + option.state <= budget:
                    unit.chosen, current, improved = index, option, True


def explain(unit: _Unit) -> str:
    option, base = unit.options[unit.chosen], unit.options[0]
    saved = base.state - option.state
    added = option.total - base.total
    if option.layout == "replicated":
        if len(unit.options) == 1:
            return "replicated"
        cheapest = min(unit.options[1:], key=lambda o: o.state)
        return (
            f"replicated: the budget allows it; splitting ({cheapest.layout}) would save "
            f"{format_bytes(base.state - cheapest.state)}/device but cost "
            f"{format_bytes(cheapest.total - base.total)} more per step"
        )
    if added > 0:
        traffic = f"costs {format_bytes(added)} more per step than replicated"
    elif added < 0:
        traffic = f"sends {format_bytes(-added)} less per step than replicated"
    else:
        traffic = "sends as much per step as replicated"
    return f"{option.layout}: saves {format_bytes(saved)}/device, {traffic}"


# -- helpers ----------------------------------------------------------------------------


def _owners(model: keras.Model) -> dict[int, Any]:
    owners = {}
    for layer in _compat.sublayers(model):
        for variable in layer._trainable_variables + layer._non_trainable_variables:
            owners[id(variable)] = layer
    return owners


def _second_axis(axes: Axes, shape: Sequence[int], batch_axis: str | None, size: int) -> Axes:
    """`axes` with the largest whole dimension also split over the batch axis, when one divides."""
    if batch_axis is None or size <= 1 or len(shape) < 2 or batch_axis in axes or not any(axes):
        return tuple(axes)
    free = [i for i, a in enumerate(axes) if a is None and shape[i] % size == 0]
    if not free:
        return tuple(axes)
    widest = max(free, key=lambda i: shape[i])
    return tuple(batch_axis if i == widest else a for i, a in enumerate(axes))


def _nbytes(variable: Any) -> int:
    return math.prod(variable.shape) * np.dtype(variable.dtype).itemsize


def _add(wire: dict[str, float], axis: str | None, amount: float) -> None:
    if axis is not None and amount:
        wire[axis] = wire.get(axis, 0.0) + amount


def _plus(wire: Mapping[str, float], axis: str | None, amount: float) -> dict[str, float]:
    out = dict(wire)
    _add(out, axis, amount)
    return out


def check_budget_args(memory_budget: Any, batch: Any) -> None:
    if memory_budget is not None and batch is None:
        raise InvalidOptionError(
            "auto_rules(memory_budget=...) needs batch=: one global batch of inputs (arrays, or "
            "anything with .shape and .dtype), to size the activations and the traffic they cause. "
            'Fix: auto_rules(model, mesh, memory_budget="16GiB", batch=x).'
        )
