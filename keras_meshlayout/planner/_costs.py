"""Stage 3: costs. Per unit of weights and per candidate layout, bytes per device and on the wire.

`cost_units(model, proposal, trace, axis_sizes, optimizer)` takes the rule
writer's tensor-parallel `Proposal` (which weights split together, and how)
and gives every unit its candidate layouts, each a `Candidate` with its
per-device state and the bytes each device sends per training step:

- `replicated`: every device holds the unit; its gradients are all-reduced
  over the batch axis;
- `tensor-parallel`: the proposal's split over the model axis; the gradient
  all-reduce shrinks by the model-axis size, and activations are all-reduced
  over the model axis (forward after a row-parallel projection, backward
  before each column-parallel one);
- `2-D`: tensor-parallel, with each split kernel's largest other dimension
  also split over the batch axis; XLA all-gathers those kernels over the batch
  axis before use, once per step (twice for large kernels, see
  `_gathers_per_step`); a bias split over the model axis is split over both
  (`(("model", "data"),)`) when it divides, and gathered over the batch axis
  where read;
- `vocab-parallel` (embeddings): the vocabulary split over the model axis,
  one all-reduce of the looked-up activations forward;
- `fully sharded` (ZeRO-3/FSDP): a weight outside every unit (a norm's
  scale, a small head) split over the batch axis, or over the batch and model
  axes together (one dimension in `d × m` pieces) when it divides, and
  gathered when used;
- `split, unused`: a trainable weight the step never reads, split over both axes.

Bytes on the wire are counted with the ring formulas of the communication
report (`report._hlo.wire_bytes`, what `kml.comm_report` reads off the
compiled HLO), from the shapes the traced projections see on one batch.
State is counted by the one memory model, `core._memory.SlotModel`
(parameters, gradients, optimizer slots). The activation reserve is the
outputs of every traced projection and look-up at their replicated size, a
deliberately simple upper estimate.

Everything handed on is immutable: the `CostTable` goes to the search (`_search`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._axes import Axes
from ..core._memory import slot_model
from ..report._hlo import wire_bytes
from ._layers import heads_dim
from ._layers import owners as layer_owners
from ._trace import Trace

__all__ = ["Candidate", "CostTable", "Proposal", "UnitCosts", "cost_units"]


@dataclasses.dataclass(frozen=True)
class Proposal:
    """The rule writer's tensor-parallel layouts, before any budget (stage 2 → 3).

    Attributes:
        model_axis: The tensor-parallel mesh axis.
        batch_axis: The mesh axis the batch is split over, or `None`.
        axes: Per variable path, its proposed axes (every variable the rules decide).
        notes: Per variable path, why it has those axes.
        units: Per split variable path, the unit it splits with (weights of
            one unit are laid out together).
        final_units: Units that are a final layer split over the model axis
            (the loss reduces their split outputs).
        kv_heads: Per Dense key/value projection kept whole (layer path), its
            key/value head count.
        whole_outputs: Layer paths whose output a rule keeps whole over the model axis.
        whole_kv: Key/value weights kept whole beside a traced attention
            unit's split query heads: weight path → unit.
    """

    model_axis: str
    batch_axis: str | None
    axes: Mapping[str, Axes]
    notes: Mapping[str, str]
    units: Mapping[str, str]
    final_units: frozenset[str] = frozenset()
    kv_heads: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    whole_outputs: frozenset[str] = frozenset()
    whole_kv: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout a unit can take, and what it costs per device.

    Attributes:
        layout: `"replicated"`, `"tensor-parallel"`, `"2-D"`, `"vocab-parallel"`,
            `"fully sharded"` or `"split, unused"`.
        axes: Per variable path of the unit, its axes under this layout.
        state: Per-device bytes of its parameters, gradients and optimizer slots.
        wire: Bytes each device sends per step for it, by mesh axis.
        notes: Per variable path, how this layout splits it, where that differs
            from the unit's own note.
    """

    layout: str
    axes: Mapping[str, Axes]
    state: int
    wire: Mapping[str, float]
    notes: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

    @property
    def total(self) -> float:
        """Bytes each device sends per step, over every axis."""
        return float(sum(self.wire.values()))


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    """A unit of weights and its candidate layouts.

    Attributes:
        name: The unit: a layer path, a projection pair or an attention block.
        candidates: Its layouts; the first is always `replicated`.
        notes: Per variable path, the proposal's note for its split (shown
            beside the layout the search picks).
        proposed: The index of the proposal's own layout (the plan without a budget).
    """

    name: str
    candidates: tuple[Candidate, ...]
    notes: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    proposed: int = 0


@dataclasses.dataclass(frozen=True)
class CostTable:
    """Every unit's candidates and the activation reserve: what the search chooses from.

    Attributes:
        units: One `UnitCosts` per unit; the last holds everything that has one layout.
        reserve: The activation reserve per device, in bytes.
    """

    units: tuple[UnitCosts, ...]
    reserve: int


def cost_units(
    model: keras.Model,
    proposal: Proposal,
    trace: Trace,
    axis_sizes: Mapping[str, int],
    optimizer: str | keras.optimizers.Optimizer | None,
) -> CostTable:
    """Every unit of `proposal` with its candidate layouts, costed on `trace`'s batch."""
    coster = _Coster(model, proposal, trace, axis_sizes, optimizer)
    return CostTable(tuple(coster.units()), coster.activation_reserve())


def _frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


def _candidate(
    layout: str,
    axes: Mapping[str, Axes],
    state: int,
    wire: Mapping[str, float],
    notes: Mapping[str, str] | None = None,
) -> Candidate:
    frozen_axes = _frozen({p: tuple(a) for p, a in axes.items()})
    return Candidate(layout, frozen_axes, int(state), _frozen(wire), _frozen(notes or {}))


class _Coster:
    """Builds the `CostTable` of one `Proposal` (private: only `cost_units` uses it)."""

    def __init__(
        self,
        model: keras.Model,
        proposal: Proposal,
        trace: Trace,
        axis_sizes: Mapping[str, int],
        optimizer: str | keras.optimizers.Optimizer | None,
    ) -> None:
        self.model = model
        self.proposal = proposal
        self.model_axis = proposal.model_axis
        self.batch_axis = proposal.batch_axis
        self.m = axis_sizes[self.model_axis]
        self.d = axis_sizes.get(self.batch_axis, 1) if self.batch_axis else 1
        self.trace = trace
        self.used = dict(trace.read)
        self.uses = trace.uses
        self.memory = slot_model(optimizer)
        self.tp_axes = proposal.axes
        #: The label `kml.comm_report` gives a collective over both axes (`"data×model"`).
        self.both = "×".join(a for a in axis_sizes if a in (self.batch_axis, self.model_axis))

    # -- bytes ---------------------------------------------------------------------

    def _grad_sync(self, variable: keras.Variable, shards: int) -> float:
        # Only what the step reads gets a gradient to sum: nothing, a slice, or all of it.
        read = _nbytes(variable) * self.used.get(variable.path, 0.0)
        return wire_bytes("all-reduce", read / shards, self.d)

    def _state(self, variable: keras.Variable, shards: int, trainable: bool) -> int:
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

    def units(self) -> list[UnitCosts]:
        """One unit per group of weights that split together; the rest as one fixed unit."""
        trainable = {id(v) for v in self.model.trainable_weights}
        owners = layer_owners(self.model)
        by_unit: dict[str, list[keras.Variable]] = {}
        for variable in self.model.weights:
            unit = self.proposal.units.get(variable.path)
            if unit is not None:
                by_unit.setdefault(unit, []).append(variable)
        in_units = {id(v) for variables in by_unit.values() for v in variables}
        units = [self._tensor_parallel_unit(name, variables, owners) for name, variables in by_unit.items()]
        fixed_state = self.memory.scalar_bytes
        fixed_wire: dict[str, float] = {}
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
            if id(variable) in trainable and variable.path in self.used:
                sharded = self._fully_sharded_unit(variable)
                if sharded is not None:
                    units.append(sharded)
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
        units.append(UnitCosts("(everything else)", (_candidate("replicated", {}, fixed_state, fixed_wire),)))
        return units

    def _replicated(self, variables: Sequence[keras.Variable]) -> Candidate:
        wire: dict[str, float] = {}
        for variable in variables:
            _add(wire, self.batch_axis, self._grad_sync(variable, 1))
        return _candidate(
            "replicated",
            {v.path: (None,) * len(v.shape) for v in variables},
            sum(self._state(v, 1, v.trainable) for v in variables),
            wire,
        )

    def _tensor_parallel_unit(
        self, name: str, variables: list[keras.Variable], owners: Mapping[int, keras.layers.Layer]
    ) -> UnitCosts:
        replicated = self._replicated(variables)
        tp_wire: dict[str, float] = {}
        tp_axes: dict[str, Axes] = {}
        two_d_axes: dict[str, Axes] = {}
        tp_state = two_d_state = 0
        gathers = 0.0
        kernels: list[keras.Variable] = []
        for variable in variables:
            axes = self.tp_axes[variable.path]
            shards = self.m if self.model_axis in axes else 1
            tp_axes[variable.path] = axes
            tp_state += self._state(variable, shards, variable.trainable)
            _add(tp_wire, self.batch_axis, self._grad_sync(variable, shards))
            spread = _second_axis(axes, variable.shape, self.batch_axis, self.d)
            owner = owners.get(id(variable))
            gathered = _nbytes(variable) / shards
            count = 0
            if spread != axes:
                count = self._gathers_per_step(owner, variable, gathered, axes)
            elif self._splits_further(variable, axes):
                # A column bias beside its 2-D kernel: its model-axis shards split again over the
                # batch axis, gathered over it where read (measured on XLA:CPU, 2×4 and 4×2).
                count = self._elementwise_gathers(variable.path)
                if count:
                    spread = ((self.model_axis, self.batch_axis),)
            two_d_axes[variable.path] = spread
            if spread != axes:
                gathers += count * wire_bytes("all-gather", gathered, self.d)
                two_d_state += self._state(variable, shards * self.d, variable.trainable)
            else:
                two_d_state += self._state(variable, shards, variable.trainable)
            if self.side(variable.path, axes):
                kernels.append(variable)
        final = name in self.proposal.final_units
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
        options = [replicated, _candidate("tensor-parallel", tp_axes, tp_state, tp_wire)]
        if self.d > 1 and two_d_axes != tp_axes:
            two_d_wire = _plus(tp_wire, self.batch_axis, gathers)
            options.append(_candidate("2-D", two_d_axes, two_d_state, two_d_wire))
        notes = {path: self.proposal.notes[path] for path in tp_axes}
        return UnitCosts(name, tuple(options), _frozen(notes), proposed=1)

    def _splits_further(self, variable: keras.Variable, axes: Axes) -> bool:
        """Whether a 1-D weight split over the model axis alone divides over both axes too."""
        shape = tuple(variable.shape)
        return (
            len(shape) == 1
            and self.batch_axis is not None
            and self.d > 1
            and tuple(axes) == (self.model_axis,)
            and shape[0] % (self.m * self.d) == 0
            and not self.uses.get(variable.path)
        )

    def _gathers_per_step(
        self, layer: keras.layers.Layer | None, kernel: keras.Variable, gathered: float, axes: Axes
    ) -> int:
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

    def _grouped_kv(self, unit: str, layers: Mapping[int, keras.layers.Layer]) -> list[float]:
        """The traffic of key/value projections kept whole beside split query heads.

        Their gradients are summed over the devices whose query heads share a
        key/value head, and gathered back to all heads: per projection one
        all-reduce of one head's activations over those devices, and (with
        more than one key/value head) one all-gather of all of them.
        """
        extra: list[float] = []
        if not layers:
            return extra
        for layer in _compat.sublayers(self.model):
            path = getattr(layer, "path", None) or ""
            if path.rpartition("/")[0] != unit or id(layer) in layers:
                continue  # only the key/value projections of this very attention block
            heads = heads_dim(layer)
            if layer.path in self.proposal.kv_heads:  # a Dense key/value projection
                count = self.proposal.kv_heads[layer.path]
            elif heads is not None and heads[1] == "in" and layer.path in self.proposal.whole_outputs:
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
        for path, owner in self.proposal.whole_kv.items():
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

    def _embedding_unit(self, owner: keras.layers.Layer, variable: keras.Variable) -> UnitCosts | None:
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
        split = _candidate(
            "vocab-parallel",
            {variable.path: (self.model_axis, None)},
            self._state(variable, self.m, True),
            wire,
        )
        note = {
            variable.path: f"embedding: vocabulary split over {self.model_axis!r}, one all-reduce forward"
        }
        candidates = [self._replicated([variable]), split]
        looked_up = self._activation(output, dtype)
        for sharded in (
            self._sharded_table(variable, wire, looked_up),
            self._both_axes_table(variable, wire, looked_up),
        ):
            if sharded is not None:
                candidates.append(sharded)
        return UnitCosts(getattr(owner, "path", variable.path), tuple(candidates), _frozen(note))

    def _sharded_table(
        self, variable: keras.Variable, vocab_wire: Mapping[str, float], looked_up: float
    ) -> Candidate | None:
        """A look-up table split over the batch axis on its vocabulary (fully sharded).

        Offered only with a batch axis larger than the model axis, where it
        holds less than vocab-parallel, and only while one model-axis block
        of the table is no larger than the looked-up activations on a device
        (`looked_up`): there XLA:CPU was measured to move each device's rows
        to the vocab-parallel layout (a collective-permute of its shard over
        both axes, then an all-gather over the batch-axis devices that hold
        one model-axis block), look up vocab-parallel, and move the gradient
        back the same way (a second permute). A larger table makes XLA move
        the activations instead, which no formula here predicts.
        `tests/test_budget.py` holds this against the compiled HLO on 4×2.
        """
        d, m, rows = self.d, self.m, variable.shape[0]
        size = _nbytes(variable)
        if d <= m or d % m or rows % d or size / m > looked_up:
            return None
        wire = dict(vocab_wire)
        _add(wire, self.batch_axis, wire_bytes("all-gather", size / m, d // m))
        _add(wire, self.both, 2 * size / d)
        note = {
            variable.path: f"embedding: vocabulary split over {self.batch_axis!r}, moved to a split over "
            f"{self.model_axis!r} for the look-up"
        }
        axes = {variable.path: (self.batch_axis, None)}
        return _candidate("fully sharded", axes, self._state(variable, d, True), wire, note)

    def _both_axes_table(
        self, variable: keras.Variable, vocab_wire: Mapping[str, float], looked_up: float
    ) -> Candidate | None:
        """A look-up table split on its vocabulary over the model axis, then the batch axis.

        Each device holds `1/(model·batch)` of the table. Measured on XLA:CPU
        (2×4 and 4×2) with a model-axis block of 1/32 of the looked-up
        activations on a device: vocab-parallel, plus an all-gather of the
        device's model-axis block over the batch axis before the look-up; the
        gradient is reduced as vocab-parallel's. With a block as large as the
        activations (1× and 4× measured) XLA moves the activations instead
        (the ids gathered, the looked-up rows all-reduced over both axes),
        which no formula here predicts; where between the two it switches is
        not pinned, so the layout is offered only up to a quarter.
        """
        d, m, rows = self.d, self.m, variable.shape[0]
        size = _nbytes(variable)
        if d <= 1 or rows % (d * m) or 4 * size / m > looked_up:
            return None
        wire = _plus(vocab_wire, self.batch_axis, wire_bytes("all-gather", size / m, d))
        note = {
            variable.path: f"embedding: vocabulary split {d * m} ways over {self.model_axis!r} and "
            f"{self.batch_axis!r}, gathered over {self.batch_axis!r} for the look-up, one all-reduce "
            f"over {self.model_axis!r} forward"
        }
        axes = {variable.path: ((self.model_axis, self.batch_axis), None)}
        return _candidate("fully sharded", axes, self._state(variable, d * m, True), wire, note)

    def _idle_unit(self, variable: keras.Variable) -> UnitCosts | None:
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
        split = _candidate(
            "split, unused", {variable.path: tuple(axes)}, self._state(variable, shards, True), {}
        )
        note = {variable.path: "the training step never reads it: no gradient, so no traffic"}
        return UnitCosts(variable.path, (self._replicated([variable]), split), _frozen(note))

    def _fully_sharded_unit(self, variable: keras.Variable) -> UnitCosts | None:
        """A weight outside every unit, split over the batch axis and gathered when used (ZeRO-3).

        Two kinds of weight get the candidate, each with what XLA:CPU's
        partitioner was measured to do with it (`tests/test_budget.py` holds
        these against the compiled HLO on 2×4 and 4×2):

        - a weight read only element-wise (a norm's scale or offset, 1-D):
          all-gathered over the batch axis forward, and once more backward
          when it multiplies (the input gradient needs it); its gradient is
          all-reduced as if replicated;
        - a projection kernel `x @ w` read once, split on its input features:
          with a batch axis at least as large as the model axis, all-gathered
          over the batch axis forward, its gradient all-reduced whole. With a
          smaller batch axis XLA moves each device's shard to the model-axis
          layout (a collective-permute over both axes of 1/model of the
          kernel), then either all-gathers it over the model axis or, when
          that sends no less, all-reduces the projection's output over the
          model axis forward and gathers the kernel backward; its gradient is
          all-reduced over the batch axis in batch-axis shards, then permuted
          back.

        Either kind whose first dimension divides by both axes' product also
        gets a split over the batch and model axes together, `d × m` pieces:
        XLA all-gathers it over both axes at each read (as often as above)
        and all-reduces its gradient whole over the batch axis. The search
        takes whichever of the two fits the budget at the least traffic.
        """
        shape, d, m = tuple(variable.shape), self.d, self.m
        if d <= 1 or not shape or shape[0] % d:
            return None
        size = _nbytes(variable)
        wire: dict[str, float] | None = {}
        _add(wire, self.batch_axis, self._grad_sync(variable, 1))
        uses = self.uses.get(variable.path, ())
        both = dict(wire)  # split over every axis: the same gradient all-reduce, gathers over both
        if not uses and len(shape) == 1:
            gathers = self._elementwise_gathers(variable.path)
            if not gathers:
                return None
            _add(wire, self.batch_axis, gathers * wire_bytes("all-gather", size, d))
            _add(both, self.both, gathers * wire_bytes("all-gather", size, d * m))
            when = "forward" + (" and backward" if gathers > 1 else "")
            how = f"gathered over {self.batch_axis!r} {when}"
        elif (
            len(uses) == 1
            and uses[0].kind == "matmul"
            and len(shape) == 2
            and uses[0].contracted == (0,)
            and not uses[0].batch
        ):
            (use,) = uses
            _add(both, self.both, wire_bytes("all-gather", size, d * m))
            when = "before its projection"
            if d >= m:
                _add(wire, self.batch_axis, wire_bytes("all-gather", size, d))
            elif shape[0] % m:
                wire = None  # no split over the batch axis alone
            else:
                wire = {}
                _add(wire, self.batch_axis, wire_bytes("all-reduce", size / d, d))
                _add(wire, self.both, size / m + size / d)
                gather = wire_bytes("all-gather", size, m)
                reduce = wire_bytes("all-reduce", self._summed(use.output, use.dtype), m)
                if gather < reduce:
                    _add(wire, self.model_axis, gather)
                else:
                    _add(wire, self.model_axis, reduce + (0.0 if use.from_input else gather))
            how = f"gathered over {self.batch_axis!r} {when}"
        else:
            return None
        rest = (None,) * (len(shape) - 1)
        candidates = [self._replicated([variable])]
        notes: dict[str, str] = {}
        if wire is not None:
            axes = {variable.path: (self.batch_axis, *rest)}
            candidates.append(_candidate("fully sharded", axes, self._state(variable, d, True), wire))
            notes[variable.path] = f"split over {self.batch_axis!r}, {how}; its gradient reduced over it"
        if m > 1 and shape[0] % (d * m) == 0:
            # Measured on XLA:CPU (2×4 and 4×2): one all-gather over both axes per read, the
            # gradient all-reduced whole over the batch axis, as replicated.
            axes = {variable.path: ((self.batch_axis, self.model_axis), *rest)}
            note = (
                f"split {d * m} ways over {self.batch_axis!r} and {self.model_axis!r}, gathered over "
                f"both {when}; its gradient reduced over {self.batch_axis!r}"
            )
            state = self._state(variable, d * m, True)
            candidates.append(_candidate("fully sharded", axes, state, both, {variable.path: note}))
        if len(candidates) == 1:
            return None
        return UnitCosts(variable.path, tuple(candidates), _frozen(notes))

    def _elementwise_gathers(self, path: str) -> int:
        """How often a weight read only element-wise is gathered per step: 2 if it multiplies, else 1.

        0 when something other than a broadcast, reshape or cast leads it to
        anything but an add, subtract, multiply or divide.
        """
        values = [v for v, name in self.trace.variables.items() if name == path]
        multiplies = False
        while values:
            value = values.pop()
            for index in self.trace.consumers.get(value, ()):
                node = self.trace.nodes[index]
                if node.primitive in ("broadcast_in_dim", "reshape", "convert_element_type", "squeeze"):
                    values.extend(node.outputs)
                elif node.primitive in ("mul", "div"):
                    multiplies = True
                elif node.primitive not in ("add", "add_any", "sub"):
                    return 0
        return 2 if multiplies else 1

    def activation_reserve(self) -> int:
        total = 0.0
        for uses in self.uses.values():
            for use in uses:
                total += self._activation(use.output, use.dtype)
        return int(total)


# -- helpers ----------------------------------------------------------------------------


def _second_axis(axes: Axes, shape: Sequence[int], batch_axis: str | None, size: int) -> Axes:
    """`axes` with the largest whole dimension also split over the batch axis, when one divides."""
    if batch_axis is None or size <= 1 or len(shape) < 2 or batch_axis in axes or not any(axes):
        return tuple(axes)
    free = [i for i, a in enumerate(axes) if a is None and shape[i] % size == 0]
    if not free:
        return tuple(axes)
    widest = max(free, key=lambda i: shape[i])
    return tuple(batch_axis if i == widest else a for i, a in enumerate(axes))


def _nbytes(variable: keras.Variable) -> int:
    return math.prod(variable.shape) * np.dtype(variable.dtype).itemsize


def _add(wire: dict[str, float], axis: str | None, amount: float) -> None:
    if axis is not None and amount:
        wire[axis] = wire.get(axis, 0.0) + amount


def _plus(wire: Mapping[str, float], axis: str | None, amount: float) -> dict[str, float]:
    out = dict(wire)
    _add(out, axis, amount)
    return out
