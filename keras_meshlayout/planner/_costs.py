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
  `_candidates.Bytes.gathers_per_step`); a bias split over the model axis is split over both
  (`(("model", "data"),)`) when it divides, and gathered over the batch axis
  where read;
- `vocab-parallel` (embeddings): the vocabulary split over the model axis,
  one all-reduce of the looked-up activations forward;
- `fully sharded` (ZeRO-3/FSDP): a weight outside every unit (a norm's
  scale, a small head) split over the batch axis, or over the batch and model
  axes together (one dimension in `d × m` pieces) when it divides, and
  gathered when used; a position table looked up with constant ids whose rows
  do not divide, on its width over both axes (`_table_costs`);
- `split, unused`: a trainable weight the step never reads, split over both axes;
- `head_dim split`: a grouped-query key/value kernel whose heads do not
  divide the model axis, split on its head_dim and gathered over the model
  axis once per step.

On a mesh with a TPU target (`compiler="tpu"`) the formulas follow XLA:TPU where it was
measured to send differently: column-parallel projections that read one activation alone
share one all-reduce of its gradient (`Bytes.merged_input_grads`); partial sums move in the
layer's dtype (`Bytes._summed`), and so do narrower matmuls' weight gradients
(`Bytes._gradient_width`); the loss sums three values per position over split logits
(`_loss_reductions`); head_dim-split key/value kernels are gathered in bfloat16 in each pass
(`_kv_costs`); elsewhere they are XLA:CPU's.

Bytes on the wire are counted with the ring formulas of the communication
report (`report._collectives.wire_bytes`, what `kml.comm_report` reads off the
compiled HLO), from the shapes the traced projections see on one batch.
State is counted by the one memory model, `core._memory.SlotModel`
(parameters, gradients, optimizer slots). The activation reserve is the
outputs of every traced projection and look-up at their replicated size, a
deliberately simple upper estimate.

Everything handed on is immutable: the `CostTable` goes to the search (`_search`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import keras
import numpy as np

from ..core._axes import Axes
from ..report._collectives import wire_bytes
from ._candidates import (
    Candidate,
    CostTable,
    UnitCosts,
    add_wire,
    candidate,
    frozen,
    nbytes,
    plus_wire,
    second_axis,
)
from ._conv_costs import ConvCosts
from ._expert_costs import ExpertCosts
from ._grouped import grouped_kernels
from ._kv_costs import KeyValueCosts
from ._layers import owners as layer_owners
from ._layers import stored_weight
from ._ledger import Proposal
from ._propagate import Specs, itemsize
from ._table_costs import TableCosts
from ._trace import Trace

__all__ = ["Candidate", "CostTable", "Proposal", "UnitCosts", "cost_units"]


def cost_units(
    model: keras.Model,
    proposal: Proposal,
    trace: Trace,
    axis_sizes: Mapping[str, int],
    optimizer: str | keras.optimizers.Optimizer | None,
    replicate_below: int = 0,
    compiler: str = "cpu",
    reduced_gathers: float = 0.0,
    recomputed: Mapping[tuple[str, str], int] | None = None,
) -> CostTable:
    """Every unit of `proposal` with its candidate layouts, costed on `trace`'s batch.

    A weight matrix with fewer than `replicate_below` elements gets no layout
    but replicated: the policy keeps it whole when the rules run. `compiler`
    (`"tpu"` on a TPU target, `_peak.compiler_of`) picks the formulas that differ
    between XLA:CPU and XLA:TPU (`Bytes.merged_input_grads`); `reduced_gathers` is the target
    generation's `Generation.reduced_gather_bytes` (`Bytes.reduced_gathers`); `recomputed`, per
    weight, the forward products a rematerialised step computes again (`_remat`).
    """
    coster = _Coster(model, proposal, trace, axis_sizes, optimizer)
    coster.grouped = grouped_kernels(trace)
    coster.replicate_below = replicate_below
    coster.compiler = compiler
    coster.reduced_gathers = reduced_gathers
    coster.recomputed = dict(recomputed or {})
    coster.router_shards = coster.tpu_router_shards()
    whole_after = frozenset(path for path, unit in proposal.units.items() if unit in proposal.input_convs)
    units = tuple(coster.units())
    gathered, rows_moved = frozenset(coster.gathered_kernels()), frozenset(coster.rows_moved())
    return CostTable(units, coster.activation_reserve(), whole_after, gathered, rows_moved)


class _Coster(ConvCosts, ExpertCosts, KeyValueCosts, TableCosts):
    """Builds the `CostTable` of one `Proposal` (private: only `cost_units` uses it)."""

    #: The kernels grouped convolutions read (`_grouped.grouped_kernels`): never replicated on a 2-D mesh.
    grouped: frozenset[str] = frozenset()

    # -- units -----------------------------------------------------------------------

    def units(self) -> list[UnitCosts]:
        """One unit per group of weights that split together; the rest as one fixed unit."""
        trainable = {id(v) for v in self.model.trainable_weights}
        merged = {base for adapter, base in self.lora_base.items() if adapter in self.used}
        owners = layer_owners(self.model)
        by_unit: dict[str, list[keras.Variable]] = {}
        for variable in self.model.weights:
            unit = self.proposal.units.get(variable.path)
            if unit is not None:
                by_unit.setdefault(unit, []).append(variable)
        self._adapters_with_kernel(by_unit)
        in_units = {id(v) for variables in by_unit.values() for v in variables}
        units = [self._tensor_parallel_unit(name, variables, owners) for name, variables in by_unit.items()]
        fixed_state = self.memory.scalar_bytes
        fixed_wire: dict[str, float] = {}
        claimed: set[str] = set()  # followers (int8 scales, LoRA adapters) in their weight's unit
        # Followers last, so that each finds its weight's unit built.
        ordered = sorted(self.model.weights, key=lambda v: v.path in self.following)
        for variable in ordered:
            if id(variable) in in_units or variable.path in claimed:
                continue
            owner = owners.get(id(variable))
            one = self._one_weight_unit(owner, variable, id(variable) in trainable)
            if one is not None:
                units.append(one)
                claimed.update(path for c in one.candidates for path in c.axes)
                continue
            if id(variable) in trainable and variable.path in self.used and not self._kept_whole(variable):
                sharded = self._fully_sharded_unit(variable, owner)
                if sharded is not None:
                    units.append(sharded)
                    continue
            fixed_state += self._state(variable, 1, id(variable) in trainable)
            if id(variable) in trainable or variable.path in merged:  # a LoRA kernel's merged gradient
                add_wire(fixed_wire, self.batch_axis, self._grad_sync(variable, 1))
        # The loss is averaged over the batch axis: one scalar all-reduce.
        add_wire(fixed_wire, self.batch_axis, wire_bytes("all-reduce", 4, self.d))
        # Weight-computed values meeting the batch (DeBERTa's normed relative table, repeated over
        # it) have their gradients summed there; a Fourier transform gathers the batch (`_batch_sums`).
        self._meeting_wire(fixed_wire)
        for gathered in self.sums.gathered:
            add_wire(fixed_wire, self.batch_axis, 2 * wire_bytes("all-gather", gathered, self.d))
        # A router's `top_k` gathers its operand over the batch axis; an auxiliary loss all-reduces
        # its reductions over the batch (`_batch_sums`).
        # XLA:TPU routes each expert bank's tokens in the bank's shards: no gather (`_expert_costs`).
        for routed in () if self.router_shards else self.sums.routed:
            add_wire(fixed_wire, self.batch_axis, wire_bytes("all-gather", routed, self.d))
        for reduced in self.sums.reduced:
            add_wire(fixed_wire, self.batch_axis, wire_bytes("all-reduce", reduced, self.d))
        for crossed, item in self.sums.crossed:
            self._crossed_wire(crossed, item, fixed_wire)
        add_wire(fixed_wire, self.batch_axis, self.batch_norm_traffic())
        self.region_traffic(fixed_wire)
        units.append(UnitCosts("(everything else)", (candidate("replicated", {}, fixed_state, fixed_wire),)))
        return units

    def _crossed_wire(self, size: float, item: int, wire: dict[str, float]) -> None:
        """A batch × batch product's second operand (`size` bytes, whole) gathered, its gradient summed.

        Measured on XLA:CPU (a two-tower model, 8 to 64 rows; keras-hub CLIP): with the batch axis
        at least as large as the model axis, all-gathered over it forward and its gradient
        all-reduced there backward; with a smaller one, each device's share is moved over both
        axes (1/model of it forward, 1/batch backward), gathered over the model axis forward, and
        its gradient all-reduced in batch-axis shards over the model axis, then over the batch axis.
        XLA:TPU does the same, its forward moves of a float32 operand in bfloat16 (measured with
        libtpu 0.0.42.1, v5e 2×4, 4×2 and 8×1, 32 and 256 rows).
        """
        d, m = self.d, self.m
        forward = size / 2 if self.compiler == "tpu" and item == 4 else size
        if d >= m:
            gathered = wire_bytes("all-gather", forward, d) + wire_bytes("all-reduce", size, d)
            add_wire(wire, self.batch_axis, gathered)
            return
        spread = wire_bytes("all-gather", forward, m) + wire_bytes("all-reduce", size / d, m)
        add_wire(wire, self.model_axis, spread)
        add_wire(wire, self.both, forward / m + size / d)
        add_wire(wire, self.batch_axis, wire_bytes("all-reduce", size / d, d))

    def _meeting_wire(self, wire: dict[str, float]) -> None:
        """The all-reduces of weight-computed values where they meet the batch, in the shards they meet.

        Measured on XLA:CPU (keras-hub T5, 2×4, no budget): the relative-position bias, looked up
        from a replicated table and added to the attention scores split over their heads, has its
        gradient summed over the batch axis in the scores' model-axis shards (256 bytes per bias,
        not 1,024); the table's gradient then stays split over the model axis, so the optimizer
        updates its shards and XLA all-gathers the new value and each slot there (Adam: three
        all-gathers of the table per step). Split as the proposal lays the step out.
        """
        specs = None
        for meeting, (value, node) in zip(self.sums.meetings, self.sums.met, strict=True):
            shards = 1
            if self.m > 1:
                specs = specs or Specs(self.trace, self.tp_axes, self.axis_sizes, self.batch_axis)
                shards = self._meeting_shards(specs, value, node)
            add_wire(wire, self.batch_axis, wire_bytes("all-reduce", meeting / shards, self.d))
            if shards > 1:
                gathers = 1 + self.memory.like_parameter
                for size in self._computed_from(value):
                    add_wire(wire, self.model_axis, gathers * wire_bytes("all-gather", size, shards))

    def _meeting_shards(self, specs: Specs, value: int, node: int) -> int:
        """The model-axis split `value` meets at `node`: the output's, or the next element-wise reader's."""
        trace, shape = self.trace, self.trace.shapes[value]
        out = trace.nodes[node].outputs[0]
        seen = [out] + [
            trace.nodes[c].outputs[0]
            for c in trace.consumers.get(out, ())
            if trace.shapes[trace.nodes[c].outputs[0]] == trace.shapes[out]
        ]
        for met in seen:
            dims = [
                i
                for i, axes in enumerate(specs.spec.get(met, ()))
                if self.model_axis in axes and i < len(shape) and shape[i] == trace.shapes[met][i]
            ]
            if dims and len(shape) == len(trace.shapes[met]):
                return self.m
        return 1

    def _computed_from(self, value: int) -> list[int]:
        """Bytes of each trained weight `value` is computed from that the proposal keeps whole."""
        found, stack, seen = [], [value], {value}
        while stack:
            current = stack.pop()
            if current in self.trace.variables:
                if not any(a for a in self.tp_axes.get(self.trace.variables[current], ()) if a):
                    found.append(math.prod(self.trace.shapes[current]) * itemsize(self.trace.dtypes[current]))
                continue
            producer = self.trace.producer.get(current)
            for operand in self.trace.nodes[producer].inputs if producer is not None else ():
                if operand >= 0 and operand in self.trace.trained and operand not in seen:
                    seen.add(operand)
                    stack.append(operand)
        return found

    def _adapters_with_kernel(self, by_unit: dict[str, list[keras.Variable]]) -> None:
        """Adds to each unit the LoRA adapters of its kernels that no unit holds (those whole beside it).

        `b` of a kernel split on its input, `a` of one split on its output: whole under tensor
        parallelism, but split with the kernel in its 2-D layout (`_two_d`), so they move with it.
        """
        held = {v.path for variables in by_unit.values() for v in variables}
        for variables in by_unit.values():
            for variable in list(variables):
                for follower, _ in self.followers.get(variable.path, ()):
                    if follower.path in self.adapters and follower.path not in held:
                        variables.append(follower)
                        held.add(follower.path)

    def _one_weight_unit(self, owner, variable: keras.Variable, trainable: bool) -> UnitCosts | None:
        """A weight outside every unit as a unit of its own (a table, an unread or a head_dim-split weight).

        With its followers (int8 scales, LoRA adapters) laid out as it is in each candidate.
        """
        if self._kept_whole(variable) or variable.path in self.following:
            return None  # the policy keeps it whole, or it follows its weight: in the fixed unit
        one = None
        if owner is not None:
            one = (
                self._embedding_unit(owner, variable)
                or self._tied_unit(owner, variable)
                or self._head_dim_unit(owner, variable)
                or self._width_sharded_table(owner, variable)
            )
        read = variable.path in self.used if trainable else not self.trace.unread(variable.path)
        if one is None and (trainable or stored_weight(variable, self.following)) and not read:
            one = self._idle_unit(variable)
        return None if one is None else self._with_followers(one)

    def _tensor_parallel_unit(
        self, name: str, variables: list[keras.Variable], owners: Mapping[int, keras.layers.Layer]
    ) -> UnitCosts:
        replicated = self._replicated(variables)
        tp_wire: dict[str, float] = {}
        tp_axes: dict[str, Axes] = {}
        two_d_axes: dict[str, Axes] = {}
        tp_state = two_d_state = 0
        gathers: dict[str, float] = {}
        cast = 0.0  # of `gathers`, those XLA:TPU casts to bfloat16 (`Candidate.cast`)
        kernels: list[keras.Variable] = []
        by_path = {v.path: v for v in variables}
        for variable in variables:
            axes = self.tp_axes[variable.path]
            shards = self.m if self.model_axis in axes else self._expert_shards(axes)
            tp_axes[variable.path] = axes
            tp_state += self._state(variable, shards, variable.trainable)
            add_wire(tp_wire, self.batch_axis, self._grad_sync(variable, shards))
            spread = self._two_d(variable, axes, by_path)
            spread, count, gathered, cast_here = self._two_d_gathers_of(
                variable, axes, spread, owners.get(id(variable)), shards
            )
            if name not in self.proposal.expert_units:  # a bank's: `bank_gathers`
                cast += cast_here
            two_d_axes[variable.path] = spread
            if spread != axes:
                gathers[variable.path] = self.two_d_gathers(variable, shards, count, gathered)
                two_d_state += self._state(variable, shards * self.d, variable.trainable)
            else:
                two_d_state += self._state(variable, shards, variable.trainable)
            if self.side(variable.path, axes):
                kernels.append(variable)
        if name in self.proposal.expert_units:
            self._expert_traffic(variables, tp_wire)
        elif name in self.proposal.input_convs:
            self._input_conv_traffic(variables, tp_wire)
        elif name in self.proposal.conv_units or name in self.proposal.lone_convs:
            self._conv_traffic(variables, tp_wire, lone=name in self.proposal.lone_convs)
            self._activation_traffic(kernels, False, tp_wire)  # a projection ending the unit (a head)
        else:
            self._activation_traffic(kernels, name in self.proposal.final_units, tp_wire)
        layers = {id(owners[id(k)]): owners[id(k)] for k in kernels if id(k) in owners}
        for kv in self._grouped_kv(name, layers):
            add_wire(tp_wire, self.model_axis, kv)
        self._traced_kv(name, tp_wire)
        replicated = self.unit_batch_norm_traffic(variables, replicated, tp_wire)
        layout = "expert-parallel" if name in self.proposal.expert_units else "tensor-parallel"
        tp_total = self._lora_traffic(by_path, tp_axes, tp_wire)
        options = [replicated, candidate(layout, tp_axes, tp_state, tp_total)]
        if self.d > 1 and two_d_axes != tp_axes:
            batch = self.bank_gathers(name, variables, two_d_axes, gathers)
            two_d_wire = self._lora_traffic(by_path, two_d_axes, plus_wire(tp_wire, self.batch_axis, batch))
            cast_by_axis = {self.batch_axis: cast}
            options.append(candidate("2-D", two_d_axes, two_d_state, two_d_wire, cast=cast_by_axis))
        return self._offered(name, options, {p: self.proposal.notes[p] for p in tp_axes}, by_path)

    def _two_d_gathers_of(
        self,
        variable: keras.Variable,
        axes: Axes,
        spread: Axes,
        owner: keras.layers.Layer | None,
        shards: int,
    ) -> tuple[Axes, int, float, float]:
        """One weight of a unit in its 2-D candidate: its axes there, how often it is gathered over the
        batch axis, the bytes of one gather's copy, and of the gathers' bytes those cast to bfloat16
        first (`Candidate.cast`)."""
        gathered, count, cast = nbytes(variable) / shards, 0, 0.0
        if spread != axes and variable.path not in self.lora_base:  # an adapter's: `_lora_traffic`
            side = self.side(variable.path, self.tp_axes[variable.path])
            count = self.gathers_per_step(owner, variable, gathered, side) if side else 1
            share = self.gathered_share(variable)
            gathered *= share
            if share < 1:
                cast = count * wire_bytes("all-gather", gathered, self.d)
        elif self._splits_further(variable, axes):
            # A column bias beside its 2-D kernel: its model-axis shards split again over the
            # batch axis, gathered over it where read (measured on XLA:CPU, 2×4 and 4×2; XLA:TPU
            # sends none for it, measured on v5e 2×4 and 4×2).
            count = self._elementwise_gathers(variable.path)
            if count:
                spread = ((self.model_axis, self.batch_axis),)
                count = 0 if self.compiler == "tpu" else count
        return spread, count, gathered, cast

    def _offered(self, name: str, options: list[Candidate], notes: dict, paths: Mapping) -> UnitCosts:
        """The unit and its candidates, replicated first; without it for a grouped conv's on a 2-D mesh.

        With a grouped convolution's channels whole on each device XLA sums its kernel gradient
        over the whole mesh (`_grouped`): no budget may take such a unit back to replicated.
        """
        if self.d > 1 and not self.grouped.isdisjoint(paths):
            return UnitCosts(name, tuple(options[1:]), frozen(notes), proposed=0)
        return UnitCosts(name, tuple(options), frozen(notes), proposed=1)

    def _activation_traffic(self, kernels: list[keras.Variable], final: bool, wire: dict[str, float]) -> None:
        """The model-axis all-reduces of a tensor-parallel unit's activations, added to `wire`.

        Forward after a row-parallel projection, backward before a
        column-parallel one that does not read the model's input, and, for a
        final layer, the loss's reductions of its split logits. Kernels that
        share one path (keras-hub SmolLM3 builds every layer's `o_proj` outside
        its scope: `o_proj/kernel` twice) count once, since `calls` already
        gives every projection by that path (counted twice, SmolLM3's 'model'
        axis was predicted 1.162× the compiled step).
        """
        kernels = list({kernel.path: kernel for kernel in kernels}.values())
        columns = [
            use
            for kernel in kernels
            if self.side(kernel.path, self.tp_axes[kernel.path]) == "column"
            for use in self.uses.get(kernel.path, ())
            if use.kind == "matmul" and not use.from_input
        ]
        merged = self.merged_input_grads(columns)  # XLA:TPU: one all-reduce for some shared inputs
        for kernel in kernels:
            side = self.side(kernel.path, self.tp_axes[kernel.path])
            products = [use for use in self.uses.get(kernel.path, ()) if use.kind == "matmul"]
            # A row projection recomputed under remat all-reduces its output again (`_remat`).
            times = 1 + self.recomputed.get((kernel.path, "matmul"), 0) / max(len(products), 1)
            for use in products:
                output, from_input, dtype = use.output, use.from_input, use.dtype
                if final:
                    add_wire(wire, self.model_axis, self._loss_reductions(output, dtype))
                if side == "row":
                    summed = wire_bytes("all-reduce", self._summed(output, dtype), self.m)
                    add_wire(wire, self.model_axis, times * summed)
                    if kernel.path in self.quantized_inputs:
                        # Its input quantized per position over the split features: their absolute
                        # maximum all-reduced forward, one float32 per position (measured on XLA:CPU).
                        per_position = math.prod(output[:-1]) / self.d * 4
                        add_wire(
                            wire, self.model_axis, times * wire_bytes("all-reduce", per_position, self.m)
                        )
                elif side == "column" and not from_input and use.node not in merged:
                    rounded = str(kernel.dtype) == "int8" and kernel.path.endswith("/reverse_embeddings")
                    summed = self.head_input_grad(use, rounded)
                    add_wire(wire, self.model_axis, wire_bytes("all-reduce", summed, self.m))

    def _loss_reductions(self, logits: tuple[int, ...], dtype: str) -> float:
        """The loss's all-reduces of one value per position over a final layer's split logits.

        Sparse categorical cross-entropy, measured on XLA:CPU: four, in float32. XLA:TPU sends
        three, two forward and one backward, the first (the logits' maximum) in the layer's
        dtype (measured on a Dense head and keras-hub Llama's tied table, v5e 2×4 and 4×2,
        float32, `bfloat16` and `mixed_bfloat16`).
        """
        positions = math.prod(logits[:-1]) / self.d
        if self.compiler != "tpu":
            return 4 * wire_bytes("all-reduce", positions * 4, self.m)
        first = positions * np.dtype(dtype).itemsize
        return wire_bytes("all-reduce", first, self.m) + 2 * wire_bytes("all-reduce", positions * 4, self.m)

    def _two_d(self, variable: keras.Variable, axes: Axes, unit: Mapping[str, keras.Variable]) -> Axes:
        """A weight's 2-D axes: its largest whole dimension also over the batch axis (`second_axis`).

        A LoRA adapter whose kernel is in the unit follows the kernel's 2-D axes instead (`lora_axes`),
        so that `a @ b` still adds in place: spread on its own, `b`'s rank went over the batch axis.
        """
        base = unit.get(self.lora_base.get(variable.path, ""))
        if base is None:
            return second_axis(axes, variable.shape, self.batch_axis, self.d)
        base_axes = second_axis(self.tp_axes[base.path], base.shape, self.batch_axis, self.d)
        follow = next(f for follower, f in self.followers[base.path] if follower.path == variable.path)
        return follow(base_axes)

    def _lora_traffic(
        self, unit: Mapping[str, keras.Variable], axes: Mapping[str, Axes], wire: Mapping[str, float]
    ) -> dict[str, float]:
        """`wire` plus the all-reduces of the unit's LoRA adapters' gradients under `axes` (`lora_wire`)."""
        out = dict(wire)
        for axis, amount in self.lora_wire({path: axes[path] for path in unit if path in axes}).items():
            add_wire(out, axis, amount)
        return out

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
