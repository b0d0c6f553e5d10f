"""The costs' values and byte counts: `Candidate`, `UnitCosts`, `CostTable`, and the per-device bytes.

`Bytes` holds what every cost formula reads (the axis sizes, the traced uses,
the memory model) and counts the bytes of one variable's state, of an
activation, of a gradient all-reduce, of a kernel split over the batch axis
gathered for its compute (`_batch_gathers`, on XLA:CPU and XLA:TPU);
`_one_weight` and `_costs` build the candidates on top of it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._axes import Axes
from ..core._memory import slot_model
from ..core._shape_checks import is_weight_matrix
from ..report._collectives import wire_bytes
from ._batch_gathers import BatchGathers, nbytes
from ._batch_sums import batch_sums
from ._expert_gathers import ExpertGathers
from ._layers import followers, int4_shape, packed_axes
from ._ledger import Proposal
from ._trace import _PASS, Trace
from ._unpacking import lora_layers, lora_parts, merges_lora, scaled_input

__all__ = ["Bytes", "Candidate", "CostTable", "UnitCosts"]


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One layout a unit can take, and what it costs per device.

    Attributes:
        layout: `"replicated"`, `"tensor-parallel"`, `"expert-parallel"`, `"2-D"`, `"vocab-parallel"`,
            `"fully sharded"`, `"head_dim split"` or `"split, unused"`.
        axes: Per variable path of the unit, its axes under this layout.
        state: Per-device bytes of its parameters, gradients and optimizer slots.
        wire: Bytes each device sends per step for it, by mesh axis.
        notes: Per variable path, how this layout splits it, where that differs
            from the unit's own note.
        cast: Of `wire`, by axis, the all-gathers of float32 kernels that XLA:TPU casts to
            bfloat16 first (`gathered_share`); between the slices of a multi-slice target it
            sends them in float32 (`_mesh_splits.network_bytes`).
    """

    layout: str
    axes: Mapping[str, Axes]
    state: int
    wire: Mapping[str, float]
    notes: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    cast: Mapping[str, float] = dataclasses.field(default_factory=lambda: MappingProxyType({}))

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
        proposed: The index of the layout the plan without a budget takes: the proposal's own, or
            for a look-up table one that sends no more and holds less (`_tables_2d`).
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
        whole_after: Kernels of input convolutions whose layer output a rule keeps whole over
            the model axis (the peak walk gathers it there).
        gathered: Key/value kernels that, split on head_dim, XLA all-gathers whole once per step
            where they are read (`_kv_costs.KeyValueCosts.gathered_kernels`; the peak walk holds
            the gathered copy from the forward read to the backward one).
        rows_moved: Tables whose split over both axes moves their looked-up rows, each device
            summing its rows' gradient in its shard (`_tables_2d.BothAxesTables.rows_moved`; the
            peak walk sums no whole copy of it).
    """

    units: tuple[UnitCosts, ...]
    reserve: int
    whole_after: frozenset[str] = frozenset()
    gathered: frozenset[str] = frozenset()
    rows_moved: frozenset[str] = frozenset()


def frozen(mapping: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping))


def candidate(
    layout: str,
    axes: Mapping[str, Axes],
    state: int,
    wire: Mapping[str, float],
    notes: Mapping[str, str] | None = None,
    cast: Mapping[str, float] | None = None,
) -> Candidate:
    frozen_axes = frozen({p: tuple(a) for p, a in axes.items()})
    kept = {axis: amount for axis, amount in (cast or {}).items() if amount}
    return Candidate(layout, frozen_axes, int(state), frozen(wire), frozen(notes or {}), frozen(kept))


class Bytes(BatchGathers, ExpertGathers):
    """The byte counts every cost reads: the mesh, the traced uses, the memory model."""

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
        self.axis_sizes = dict(axis_sizes)
        self.trace = trace
        self.used = dict(trace.read)
        self.uses = trace.uses
        #: Per weight, how often its gradient is summed over the batch axis; other values summed there.
        self.sums = batch_sums(trace)
        self.memory = slot_model(optimizer)
        self.tp_axes = proposal.axes
        #: LoRA adapters by path, and their base kernel's path: XLA sums the merged kernel's gradient.
        #: A quantized layer adds its adapters' product to its output: their own gradients are summed.
        self.lora_base = {
            adapter.path: parts[0].path
            for layer in lora_layers(model)
            if (parts := lora_parts(layer)) is not None and merges_lora(layer)
            for adapter in parts[1:]
        }
        #: Every LoRA adapter's path, merged into its kernel or not.
        self.adapters = frozenset(
            adapter.path
            for layer in lora_layers(model)
            if (parts := lora_parts(layer)) is not None
            for adapter in parts[1:]
        )
        #: int4 kernels stored flattened, and how their float axes are stored (`_layers.Packing`).
        self.packing = packed_axes(model)
        #: Every int4 kernel's path, and the bytes of its float kernel's element once dequantized.
        self.int4 = {
            kernel.path: np.dtype(layer.compute_dtype).itemsize
            for layer in _compat.sublayers(model)
            if int4_shape(layer) is not None
            and (kernel := _compat.stored_weight(layer, "kernel")) is not None
        }
        #: LoRA kernels by path, and their adapters `(a, b)`.
        self.lora_pairs = {
            parts[0].path: parts[1:] for parts in map(lora_parts, lora_layers(model)) if parts is not None
        }
        #: Kernels whose layer quantizes its input per position (int8's `inputs_quantizer`; int4
        #: and float8 have none): a row-parallel one all-reduces the input's absolute maximum.
        self.quantized_inputs = frozenset(
            kernel.path
            for layer in _compat.sublayers(model)
            if getattr(layer, "inputs_quantizer", None) is not None
            and (kernel := _compat.stored_weight(layer, "kernel")) is not None
        )
        #: Per weight path, the weights laid out as it (int8 scales, LoRA adapters) and how.
        self.followers = followers(model)
        self.following = frozenset(f.path for items in self.followers.values() for f, _ in items)
        #: The label `kml.comm_report` gives a collective over both axes (`"data×model"`): the
        #: axes its devices differ along, so on `model=1` just the batch axis.
        pair = [a for a in axis_sizes if a in (self.batch_axis, self.model_axis)]
        self.both = "×".join([a for a in pair if axis_sizes[a] > 1] or pair)
        #: Each expert bank's routers, by the bank's paths (`_expert_costs.ExpertCosts._routers`).
        self.routers_of: dict[tuple[str, ...], list[keras.Variable]] = {}

    #: Weight matrices with fewer elements are kept whole by the policy when the rules run.
    replicate_below: int = 0
    #: The compiler the traffic follows: `"tpu"` on a TPU target (`_peak.compiler_of`), else `"cpu"`.
    compiler: str = "cpu"
    #: The largest copy XLA:TPU gathers over `_batch_gathers.REDUCED_GROUP` devices or more as an
    #: all-reduce (`core._targets.Generation.reduced_gather_bytes`); 0: none (no TPU target).
    reduced_gathers: float = 0.0
    #: Per `(weight path, "matmul" or "gather")`, the forward products (look-ups) a rematerialised
    #: step computes again (`_remat`).
    recomputed: Mapping[tuple[str, str], int] = MappingProxyType({})
    #: XLA:TPU's router kernels of split expert banks, by path, and how many shards of the bank's axis
    #: their gradients are summed in over the batch axis (`_expert_costs.ExpertCosts.tpu_router_shards`).
    router_shards: Mapping[str, int] = MappingProxyType({})

    def merged_input_grads(self, uses: Sequence[Any]) -> set[int]:
        """The nodes of `uses` whose input-gradient all-reduce XLA:TPU folds into another's.

        `uses` are a unit's column-parallel projections, each of which all-reduces the
        gradient of the activation it reads over the model axis. JAX adds the gradients of
        one activation in reverse order of its readers; XLA:TPU rewrites the sum of two
        all-reduces into one all-reduce of the sum (XLA:CPU does not), so the readers that
        give the first gradients, while each is such a projection, share one all-reduce
        (measured with libtpu 0.0.42.1, v5e 2×4 and 4×2: keras-hub Llama 3's query, key and
        value read their norm's output alone, one all-reduce; Mixtral's expert gate and up,
        one; a Keras `MultiHeadAttention` whose input also feeds the residual `Add`, read
        last, gives that gradient first: three). Empty on XLA:CPU.
        """
        if self.compiler != "tpu":
            return set()
        nodes = {use.node for use in uses}
        roots = {self._activation_value(use) for use in uses} - {None}
        return {reader for root in roots for reader in self.folded_readers(root, nodes.__contains__)}

    def folded_readers(self, value: int, sums: Callable[[int], bool]) -> list[int]:
        """Of the readers of `value` giving its first gradients (the last in forward order), while each
        `sums` (all-reduces that gradient), all but the first: XLA:TPU folds theirs into its all-reduce."""
        run = []
        for reader in reversed(self._readers(value)):
            if not sums(reader):
                break
            run.append(reader)
        return run[1:]

    def _readers(self, value: int) -> list[int]:
        """The nodes reading `value`, in forward order; a cast or copy stands for the nodes reading it.

        Under `bfloat16` a norm computed in float32 is cast once for all its projections: the cast
        read by two stood for neither, and XLA:TPU's one all-reduce of their summed input gradients
        was predicted as two (keras-hub Llama, v5e 2×4: the gate and up projections').
        """
        readers = []
        for node in sorted(self.trace.consumers.get(value, ())):
            op = self.trace.nodes[node]
            if op.primitive in _PASS or scaled_input(self.trace, op) == value:  # or float8's quantizing
                readers.extend(self._readers(op.outputs[0]))
            else:
                readers.append(op.index)
        return readers

    def _activation_value(self, use: Any) -> int | None:
        """The value id of the activation a traced projection reads, through casts and copies (and float8's
        quantize-dequantize, which each projection applies to it on its own)."""
        node = self.trace.nodes[use.node]
        values = [v for v in node.inputs if v >= 0 and self.trace.weight_of(v) is None]
        if len(values) != 1:
            return None
        value = values[0]
        while (producer := self.trace.producer.get(value)) is not None:
            op = self.trace.nodes[producer]
            if op.primitive not in _PASS and scaled_input(self.trace, op) is None:
                break
            value = op.inputs[0] if op.primitive in _PASS else scaled_input(self.trace, op)
        return value

    def _kept_whole(self, variable: keras.Variable) -> bool:
        """Whether the policy keeps `variable` whole, however a rule splits it (a small weight matrix)."""
        shape = tuple(variable.shape)
        if variable.path in self.proposal.kept_split:  # a grouped conv's unit: `Rule.keep_split`
            return False
        return is_weight_matrix(variable.path, shape) and math.prod(shape) < self.replicate_below

    # -- bytes ---------------------------------------------------------------------

    def _grad_sync(self, variable: keras.Variable, shards: int) -> float:
        # Only what the step reads gets a gradient to sum: nothing, a slice, or all of it, once per
        # read that meets the batch (`_batch_sums`). A LoRA adapter's gradient is computed from its
        # kernel's, which is the one summed (measured on XLA:CPU).
        if variable.path in self.lora_base or variable.path not in self.used:
            return 0.0
        read = nbytes(variable) * self.sums.reads.get(variable.path, 0.0) * self._gradient_width(variable)
        if shards == 1:  # a replicated router's gradient, which XLA:TPU sums in its bank's shards
            shards = self.router_shards.get(variable.path, 1)
        return wire_bytes("all-reduce", read / shards, self.d)

    def _gradient_width(self, variable: keras.Variable) -> float:
        """The share of a weight's bytes its gradient's all-reduce moves: 1, but narrower matmuls' on XLA:TPU.

        Under `mixed_bfloat16` a float32 kernel's gradient is a bfloat16 matmul's output, cast to
        float32 after XLA:TPU's all-reduce over the batch axis (XLA:CPU casts before): per read,
        the matmul's dtype over the weight's (a tied table: its look-up's gradient in float32, its
        projection's in bfloat16; measured on keras-hub Llama 3, v5e 2×4).
        """
        uses = self.uses.get(variable.path, ())
        if self.compiler != "tpu" or not uses:
            return 1.0
        own = np.dtype(variable.dtype).itemsize
        widths = [
            min(np.dtype(use.dtype).itemsize, own) / own if use.kind == "matmul" else 1.0 for use in uses
        ]
        return sum(widths) / len(widths)

    def lora_wire(self, axes: Mapping[str, Axes]) -> dict[str, float]:
        """The all-reduces of the LoRA adapters' gradients, for the kernels and adapters laid out in `axes`.

        Measured on XLA:CPU (keras-hub Llama with `enable_lora(4)` and a functional Dense pair, 2×4,
        tensor-parallel, 2-D and with `a` split further than its kernel): XLA sums the merged
        kernel's gradient `dM` (`_grad_sync` of the kernel), then computes `da = dM · bᵀ` and
        `db = aᵀ · dM` on each device's shards. `da` contracts the kernel's last dimension: it is
        all-reduced over each axis that dimension is split over, in `a`'s shards along the other
        axes; `db` contracts `a`'s other dimensions: it is all-reduced over each axis they are
        split over, in `b`'s shards along the other axes.
        """
        wire: dict[str, float] = {}
        for base, (a, b) in self.lora_pairs.items():
            if base not in axes or a.path not in axes or b.path not in axes or not a.trainable:
                continue
            if a.path not in self.lora_base:  # a quantized layer's: not merged
                self._added_lora_wire(a, b, axes, wire)
                continue
            base_axes = self.packing[base].unpacked(axes[base]) if base in self.packing else axes[base]
            last, inner = axis_names(base_axes[-1:]), axis_names(axes[a.path][:-1])
            a_names, b_names = axis_names(axes[a.path]), axis_names(axes[b.path])
            for axis in sorted(last):
                shard = nbytes(a) / self._shards(tuple(a_names - {axis}))
                add_wire(wire, axis, wire_bytes("all-reduce", shard, self.axis_sizes[axis]))
            for axis in sorted(inner):
                shard = nbytes(b) / self._shards(tuple(b_names - {axis}))
                add_wire(wire, axis, wire_bytes("all-reduce", shard, self.axis_sizes[axis]))
        return wire

    def _added_lora_wire(self, a: Any, b: Any, axes: Mapping[str, Axes], wire: dict[str, float]) -> None:
        """Adds to `wire` the all-reduces of `b`'s gradient in a quantized layer's LoRA path.

        Such a layer adds `(x · a) · b` to its output (`merges_lora`): `a` and `b` are projections
        of their own, their activations' all-reduces costed as any (`_activation_traffic`: `x · a`
        summed forward where `a`'s contracted dimensions are split, its gradient where `b`'s
        columns are). `db = (x · a)ᵀ · dy` also sums over `a`'s other dimensions (query heads):
        all-reduced over each axis splitting them, in `b`'s shards. Measured on XLA:CPU (Dense
        and EinsumDense, int8 and int4, keras-hub Gemma and Llama, 2×4).
        """
        use = next((u for u in self.uses.get(a.path, ()) if u.kind == "matmul"), None)
        if use is None:
            return
        a_axes = axes[a.path]
        heads = axis_names(tuple(e for i, e in enumerate(a_axes[:-1]) if i not in use.contracted))
        b_names = axis_names(axes[b.path])
        for axis in sorted(heads):
            shard = nbytes(b) / self._shards(tuple(b_names - {axis}))
            add_wire(wire, axis, wire_bytes("all-reduce", shard, self.axis_sizes[axis]))

    def _state(self, variable: keras.Variable, shards: int, trainable: bool) -> int:
        slots = not getattr(variable, "overwrite_with_gradient", False)  # float8's scales and histories
        return self.memory.variable_bytes(variable, shards, trainable, slots)  # Muon's AdamW slots too

    def _activation(self, shape: Sequence[int], dtype: str) -> float:
        """Per-device bytes of an activation whose first dimension is the batch."""
        return math.prod(shape) / self.d * np.dtype(dtype).itemsize

    def _summed(self, shape: Sequence[int], dtype: str) -> float:
        """Per-device bytes of an activation a collective moves.

        On XLA:CPU partial sums travel in float32 even when the layer computes in
        bfloat16 or float16 (measured under `mixed_bfloat16`: the matmul accumulates
        in float32 and the all-reduce comes before the cast). XLA:TPU's matmuls write
        the layer's dtype, and that is what its all-reduces move (measured on a
        keras-hub Llama under `bfloat16` and `mixed_bfloat16`, v5e 2×4: every
        activation all-reduce over the model axis in bfloat16).
        """
        itemsize = np.dtype(dtype).itemsize
        return math.prod(shape) / self.d * (itemsize if self.compiler == "tpu" else max(itemsize, 4))

    def head_input_grad(self, use: Any, rounded: bool) -> float:
        """Per-device bytes of a split head's input gradient, summed over the model axis.

        Where the head rounds its input to int8 with no custom gradient (`rounded`: Keras's int8
        `ReversibleEmbedding` read in reverse, tied or not) only the input's per-position scale has
        a gradient: one float32 per position (measured on XLA:CPU, 2×4); else the input's bytes.
        """
        if rounded:
            return math.prod(use.output[:-1]) / self.d * 4
        return self._summed(use.inputs, use.dtype)

    def cast_dtype(self, use: Any) -> str:
        """The dtype a look-up's output is cast to before anything reads it, on XLA:TPU; else its own.

        Under `mixed_bfloat16` a table is looked up in float32 and cast to bfloat16: XLA:TPU
        casts before the vocab-parallel all-reduce (exact: one device holds each row), so it
        moves bfloat16 (measured on keras-hub Llama, v5e 2×4); XLA:CPU moves float32.
        """
        if self.compiler != "tpu":
            return use.dtype
        output = self.trace.nodes[use.node].outputs[0]
        readers = [self.trace.nodes[n] for n in self.trace.consumers.get(output, ())]
        casts = {self.trace.dtypes[r.outputs[0]] for r in readers if r.primitive == "convert_element_type"}
        if readers and len(casts) == 1 and all(r.primitive == "convert_element_type" for r in readers):
            return casts.pop()
        return use.dtype

    def calls(self, path: str) -> list[tuple[tuple, tuple, bool, str]]:
        """`(activation shape, output shape, reads a model input, dtype)` of each projection by `path`."""
        return [
            (use.inputs, use.output, use.from_input, use.dtype)
            for use in self.uses.get(path, ())
            if use.kind == "matmul"
        ]

    def side(self, path: str, axes: Axes) -> str:
        """`"column"` when a kernel's split dimension is an output one, `"row"` when it is summed over.

        `""` when it is not split, not a projection's, or split on a batch dimension of the matmul
        outside an expert bank (a per-head table contracted with split heads: nothing moves).
        """
        if self.model_axis not in axes:
            return ""
        uses = [use for use in self.uses.get(path, ()) if use.kind == "matmul"]
        if not uses:
            return ""
        split = axes.index(self.model_axis)
        if split in uses[0].batch and self.proposal.units.get(path) not in self.proposal.expert_units:
            return ""
        return "row" if split in uses[0].contracted else "column"

    def _shards(self, axes: Axes) -> int:
        """How many pieces a layout cuts a variable into on this mesh."""
        names = [n for entry in axes if entry for n in ((entry,) if isinstance(entry, str) else entry)]
        return math.prod(self.axis_sizes.get(n, 1) for n in names)

    def _with_followers(self, unit: UnitCosts) -> UnitCosts:
        """`unit` with its weights' followers (int8 scales, LoRA adapters) laid out as those per candidate.

        A follower's state counts at its own split (a table's scale split with
        its rows); its traffic, where it has any, is its weight's candidate's.
        """
        candidates = []
        for option in unit.candidates:
            axes, state, notes = dict(option.axes), option.state, dict(option.notes)
            for path, weight_axes in option.axes.items():
                for follower, follow in self.followers.get(path, ()):
                    if follower.path in axes:
                        continue
                    got = follow(weight_axes)
                    got = (None,) * len(follower.shape) if got is None else got
                    axes[follower.path] = got
                    state += self._state(follower, self._shards(got), follower.trainable)
                    if tuple(self.tp_axes.get(follower.path, ())) == got:  # the rule writer's own note
                        notes[follower.path] = self.proposal.notes.get(follower.path, "")
            wire = dict(option.wire)
            for axis, amount in self.lora_wire(axes).items():
                add_wire(wire, axis, amount)
            changed = dict(axes=frozen(axes), state=int(state), notes=frozen(notes), wire=frozen(wire))
            candidates.append(dataclasses.replace(option, **changed))
        return dataclasses.replace(unit, candidates=tuple(candidates))

    def _replicated(self, variables: Sequence[keras.Variable]) -> Candidate:
        wire: dict[str, float] = {}
        for variable in variables:
            add_wire(wire, self.batch_axis, self._grad_sync(variable, 1))
        return candidate(
            "replicated",
            {v.path: (None,) * len(v.shape) for v in variables},
            sum(self._state(v, 1, v.trainable) for v in variables),
            wire,
        )


# -- helpers shared by the costs ----------------------------------------------------------------------------


def second_axis(axes: Axes, shape: Sequence[int], batch_axis: str | None, size: int) -> Axes:
    """`axes` with the largest whole dimension also split over the batch axis, when one divides."""
    if batch_axis is None or size <= 1 or len(shape) < 2 or batch_axis in axes or not any(axes):
        return tuple(axes)
    free = [i for i, a in enumerate(axes) if a is None and shape[i] % size == 0]
    if not free:
        return tuple(axes)
    widest = max(free, key=lambda i: shape[i])
    return tuple(batch_axis if i == widest else a for i, a in enumerate(axes))


def add_wire(wire: dict[str, float], axis: str | None, amount: float) -> None:
    if axis is not None and amount:
        wire[axis] = wire.get(axis, 0.0) + amount


def plus_wire(wire: Mapping[str, float], axis: str | None, amount: float) -> dict[str, float]:
    out = dict(wire)
    add_wire(out, axis, amount)
    return out


def axis_names(axes: Axes) -> set[str]:
    """The mesh axes a layout names, in any entry (`("data", "model")` included)."""
    return {n for entry in axes if entry for n in ((entry,) if isinstance(entry, str) else entry)}
