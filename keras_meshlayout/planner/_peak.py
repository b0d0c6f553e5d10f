"""The per-device peak of a training step: state, then what the traced step keeps alive at its worst.

`peak_memory(trace, layouts, axis_sizes, ...)` walks the traced training step
(`_trace.trace_step`: forward, then backward, as JAX emits them) once:

1. **Per-device shapes.** Each value's layout is propagated from the
   variables' layouts and the batch (split over the batch axis on its first
   dimension) through the operations, a small model of XLA's sharding
   propagation: element-wise operations, broadcasts, reshapes and transposes
   carry each dimension's axes; a `dot_general` or a convolution gives its
   output the batch and free dimensions of its operands (a contracted split is
   summed away); a reduction drops the reduced dimensions; anything else keeps
   the axes of an input dimension of the same size. A weight split over the
   batch axis (2-D, fully sharded) is gathered over it where a projection, a
   convolution or a look-up reads it: that gathered copy is a temporary, alive
   from its first read to its last.
2. **What is materialised.** A value is a buffer unless it is computed by an
   element-wise operation (a cast, a broadcast, a reshape included) whose every
   reader is also element-wise or a reduction: XLA fuses those into their
   readers, which then keep the fused value's own inputs alive instead.
3. **Liveness.** In program order, a buffer lives from the operation that
   writes it to its last reader; the step's outputs (the gradients) live to
   the end. The largest sum over the program is the step's transient peak:
   activations saved for the backward pass, temporaries (attention scores,
   dequantised int8 kernels, a convnet's feature maps, recomputed remat
   blocks) and the gradients written so far. Over a batch axis of more than
   one device, the gradients' sum (one combined all-reduce) is a second copy
   of them at the end of the backward pass.

The peak per device is then the state without its gradients (parameters,
non-trainable variables, optimizer slots: `core._memory`), the batch's shard,
and the transient peak. Nothing is specific to an architecture: everything is
read off the traced computation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from ..core._axes import Axes, entry_axes
from ._trace import Node, Trace, trace_step

__all__ = ["PeakMemory", "PeakWalk", "peak_memory", "plan_peak", "transient_peak"]

Spec = tuple[tuple[str, ...], ...]

#: Operations XLA fuses into their readers: element-wise arithmetic, casts, broadcasts, reshapes.
_ELEMENTWISE = frozenset(
    """abs add add_any and atan2 broadcast_in_dim cbrt ceil clamp convert_element_type copy copy_p cos cosh
    div eq erf erf_inv erfc exp exp2 expand_dims expm1 floor ge gt imag integer_pow is_finite le lgamma
    log log1p logistic lt max min mul ne neg nextafter not or pow real reduce_precision rem round rsqrt
    select_n sign sin sinh sqrt square squeeze stop_gradient sub tan tanh xor iota reshape transpose
    shift_left shift_right_logical shift_right_arithmetic""".split()
)
#: Element-wise operations XLA duplicates into every reader.
_CHEAP = frozenset(
    "broadcast_in_dim convert_element_type reshape squeeze expand_dims iota copy copy_p".split()
)
#: Reductions: they read fused inputs, and write a buffer of their own.
_REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)
#: Readers of a weight that need it whole over the batch axis (XLA all-gathers it first).
_GATHERING = frozenset(("dot_general", "conv_general_dilated", "gather", "dynamic_slice"))


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """The predicted per-device peak of one training step.

    Attributes:
        state: Parameters, non-trainable variables, gradients and optimizer slots.
        gradients: The gradients' share of `state`.
        batch: The batch's shard on each device.
        transient: The most the step holds at once beyond its parameters and slots:
            activations, temporaries and the gradients written so far.
    """

    state: int
    gradients: int
    batch: int
    transient: int

    @property
    def activations(self) -> int:
        """What the step holds at its peak beyond the state and the batch (activations, temporaries)."""
        return max(self.transient - self.gradients, 0)

    @property
    def non_state(self) -> int:
        """What the peak holds beyond the training state: the batch, activations and temporaries."""
        return self.peak - self.state

    @property
    def peak(self) -> int:
        """State without gradients, the batch, and the transient peak (gradients included)."""
        return self.state - self.gradients + self.batch + max(self.transient, self.gradients)


class PeakWalk:
    """One traced training step, walked again for each set of layouts the search tries."""

    def __init__(
        self, model: Any, trace: Trace, axis_sizes: Mapping[str, int], batch_axis: str | None
    ) -> None:
        self.trace = _live_code(trace)
        self.axis_sizes = dict(axis_sizes)
        self.batch_axis = batch_axis
        self.trainable = {v.path: v for v in model.trainable_variables}

    @classmethod
    def of(
        cls, model: Any, batch: Any, axis_sizes: Mapping[str, int], batch_axis: str | None
    ) -> PeakWalk | None:
        """The walk of `model`'s step on `batch`, or `None` when its gradient cannot be traced."""
        try:
            return cls(model, trace_step(model, batch), axis_sizes, batch_axis)
        except Exception:  # a model whose gradient JAX cannot trace still plans, on its reserve
            return None

    def peak(self, table: Any, chosen: Sequence[int]) -> PeakMemory:
        """The `PeakMemory` of candidate `chosen[i]` for each unit `i` of the `CostTable` `table`."""
        layouts: dict[str, Axes] = {}
        state = 0
        for unit, index in zip(table.units, chosen, strict=True):
            layouts.update(unit.candidates[index].axes)
            state += unit.candidates[index].state
        gradients = 0
        for path, variable in self.trainable.items():
            axes = layouts.get(path, ())
            pieces = math.prod(self.axis_sizes.get(a, 1) for entry in axes for a in entry_axes(entry))
            gradients += math.prod(variable.shape) * np.dtype(variable.dtype).itemsize // pieces
        return peak_memory(
            self.trace, layouts, self.axis_sizes, self.batch_axis, state=state, gradients=gradients
        )


def plan_peak(model: Any, plan: Any, batch: Any, batch_axis: str | None) -> PeakMemory:
    """The predicted per-device peak of one training step of `model` on `batch` under `plan`.

    `plan` is a `kml.Plan` of `model` (its entries give each variable's layout and its
    `memory()` the training state); `model` may be a `kml.dry_build` model.
    """
    memory = plan.memory()
    layouts = {entry.path: entry.axes for entry in plan.entries}
    return peak_memory(
        _live_code(trace_step(model, batch)),
        layouts,
        plan.axis_sizes,
        batch_axis,
        state=memory.total,
        gradients=memory.gradients,
    )


def peak_memory(
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
    *,
    state: int,
    gradients: int,
) -> PeakMemory:
    """The `PeakMemory` of the traced step `trace` (`_trace.trace_step`) under `layouts`.

    `state` and `gradients` are the per-device training-state bytes and their gradients' share
    (`core._memory`: a plan's `memory()`, or the planner's candidates).
    """
    transient, batch = transient_peak(trace, layouts, axis_sizes, batch_axis)
    return PeakMemory(state=state, gradients=gradients, batch=batch, transient=transient)


def transient_peak(
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
) -> tuple[int, int]:
    """`(transient peak, batch bytes)` per device of the traced step `trace` (see the module docstring).

    `layouts` gives each variable path its axes (missing: replicated).
    """
    specs = _Specs(trace, layouts, axis_sizes, batch_axis)
    sizes = {value: specs.bytes(value) for value in trace.shapes}
    fused = _fused(trace)
    last = _last_reads(trace, fused)
    end = len(trace.nodes)
    for value in trace.outputs:
        if value >= 0:
            last[value] = end
    written = _written(trace)
    starts: dict[int, int] = {}
    frees: dict[int, int] = {}
    buffers = [v for v in written if v not in fused]
    for value in buffers:
        starts[written[value]] = starts.get(written[value], 0) + sizes[value]
        free = last.get(value, written[value])
        frees[free] = frees.get(free, 0) + sizes[value]
    for value, (first, final) in specs.gathered.items():
        starts[first] = starts.get(first, 0) + specs.bytes(value)
        frees[final] = frees.get(final, 0) + specs.bytes(value)
    if axis_sizes.get(batch_axis or "", 1) > 1:
        # The gradients are summed over the batch axis into buffers of their own (one combined
        # all-reduce at the end of the backward pass, measured on XLA:CPU), before the update.
        summed = sum(sizes[value] for value in set(trace.outputs) if value >= 0)
        specs.scratch[end] = specs.scratch.get(end, 0) + summed
    for when, extra in specs.scratch.items():
        starts[when] = starts.get(when, 0) + extra
        frees[when] = frees.get(when, 0) + extra
    live = peak = 0
    for when in range(end + 1):
        live += starts.get(when, 0)
        peak = max(peak, live)
        live -= frees.get(when, 0)
    batch = sum(sizes[value] for value in trace.inputs)
    return peak, batch


def _live_code(trace: Trace) -> Trace:
    """`trace` without the operations its outputs do not need (XLA removes them too)."""
    needed = {v for v in trace.outputs if v >= 0}
    kept = []
    for node in reversed(trace.nodes):
        if any(v in needed for v in node.outputs):
            kept.append(node)
            needed.update(v for v in node.inputs if v >= 0)
    nodes = tuple(dataclasses.replace(node, index=i) for i, node in enumerate(reversed(kept)))
    consumers: dict[int, list[int]] = {}
    producer: dict[int, int] = {}
    for node in nodes:
        for value in node.inputs:
            if value >= 0:
                consumers.setdefault(value, []).append(node.index)
        for value in node.outputs:
            producer[value] = node.index
    return dataclasses.replace(
        trace,
        nodes=nodes,
        producer=MappingProxyType(producer),
        consumers=MappingProxyType({k: tuple(v) for k, v in consumers.items()}),
    )


def _written(trace: Trace) -> dict[int, int]:
    return {value: node.index for node in trace.nodes for value in node.outputs}


def _fused(trace: Trace) -> set[int]:
    """Values XLA fuses into their readers instead of writing them out.

    A cast, broadcast or reshape read only by element-wise operations or
    reductions; any other element-wise result read by exactly one of them (XLA
    duplicates only cheap operations into several readers); and an element-wise
    function of the weights alone (a cast, an int8 kernel times its scale) that
    projections read: XLA:CPU computes it inside the projection (measured on
    `model.quantize("int8")` Dense layers: the float kernel is never written out).
    """
    outputs = set(trace.outputs)
    fused = set()
    weights = set(trace.variables)  # values computed from the weights alone
    for node in trace.nodes:
        from_weights = all(v < 0 or v in weights for v in node.inputs)
        if from_weights and node.primitive in _ELEMENTWISE:
            weights.update(node.outputs)
        if node.primitive not in _ELEMENTWISE:
            continue
        for value in node.outputs:
            readers = trace.consumers.get(value, ())
            if value in outputs or not readers:
                continue
            primitives = [trace.nodes[r].primitive for r in readers]
            if from_weights and all(_fusing(p) or p == "dot_general" for p in primitives):
                fused.add(value)  # a weight cast or dequantised where a projection reads it
            elif all(_fusing(p) for p in primitives) and (node.primitive in _CHEAP or len(set(readers)) == 1):
                fused.add(value)
    return fused


def _fusing(primitive: str) -> bool:
    return primitive in _ELEMENTWISE or primitive in _REDUCTIONS


def _last_reads(trace: Trace, fused: set[int]) -> dict[int, int]:
    """Per value, the last node that reads it, where reading a fused value reads its inputs too."""
    last: dict[int, int] = {}
    for node in reversed(trace.nodes):
        when = max((last.get(v, node.index) for v in node.outputs if v in fused), default=node.index)
        when = max(when, node.index)
        for value in node.inputs:
            if value >= 0 and last.get(value, -1) < when:
                last[value] = when
    return last


class _Specs:
    """Per value, the mesh axes over which each of its dimensions is split (see the module docstring)."""

    def __init__(
        self, trace: Trace, layouts: Mapping[str, Axes], axis_sizes: Mapping[str, int], batch_axis: str | None
    ) -> None:
        self.trace = trace
        self.sizes = dict(axis_sizes)
        self.batch_axis = batch_axis
        self.spec: dict[int, Spec] = {}
        #: Gathered copies of batch-split weights: a synthetic value id → (first read, last read).
        self.gathered: dict[int, tuple[int, int]] = {}
        self._gathered_bytes: dict[int, int] = {}
        #: Per node, bytes of buffers alive only while it runs (copies of operands, partial sums).
        self.scratch: dict[int, int] = {}
        weights: dict[int, Spec] = {}
        for value, path in trace.variables.items():
            axes = layouts.get(path)
            shape = trace.shapes[value]
            spec = _none(shape) if axes is None else tuple(entry_axes(a) for a in axes)
            self.spec[value] = self._valid(spec if len(spec) == len(shape) else _none(shape), shape)
            if batch_axis is not None and any(batch_axis in entry for entry in self.spec[value]):
                weights[value] = self.spec[value]
        for value in trace.inputs:
            shape = trace.shapes[value]
            first = (batch_axis,) if batch_axis and shape else ()
            self.spec[value] = self._valid((first, *_none(shape)[1:]) if shape else (), shape)
        for node in trace.nodes:
            self._propagate(node)
        # The step's outputs are the gradients, in the trainable variables' order: each is laid
        # out as its variable (XLA reduce-scatters a split weight's gradient onto its shards).
        for output, variable in zip(trace.outputs, sorted(trace.variables), strict=False):
            if output >= 0 and trace.shapes[output] == trace.shapes[variable]:
                self.spec[output] = self.spec[variable]
        self._gathers(weights)

    def bytes(self, value: int) -> int:
        if value in self._gathered_bytes:
            return self._gathered_bytes[value]
        shape = self.trace.shapes[value]
        whole = math.prod(shape) * _itemsize(self.trace.dtypes[value])
        pieces = math.prod(self.sizes[a] for entry in self.spec.get(value, ()) for a in entry)
        return whole // max(pieces, 1)

    # -- propagation -----------------------------------------------------------------------------------

    def _input(self, value: int) -> Spec:
        if value < 0:
            return ()
        spec = self.spec.get(value, _none(self.trace.shapes[value]))
        if value in self.trace.variables and self.batch_axis is not None:
            # A weight split over the batch axis is gathered over it before it is read.
            spec = tuple(tuple(a for a in entry if a != self.batch_axis) for entry in spec)
        return spec

    def _propagate(self, node: Node) -> None:
        shapes = self.trace.shapes
        outs = [shapes[v] for v in node.outputs]
        ins = [self._input(v) for v in node.inputs]
        in_shapes = [shapes[v] if v >= 0 else () for v in node.inputs]
        name = node.primitive
        if name == "dot_general":
            result = [self._dot(node, ins, outs[0])]
        elif name == "conv_general_dilated":
            result = [self._conv(node, ins, outs[0])]
        elif name == "broadcast_in_dim":
            spec = list(_none(outs[0]))
            for i, d in enumerate(node.params["broadcast_dimensions"]):
                if in_shapes[0][i] == outs[0][d]:
                    spec[d] = ins[0][i]
            result = [tuple(spec)]
        elif name == "transpose":
            result = [tuple(ins[0][p] for p in node.params["permutation"])]
        elif name == "reshape":
            result = [_reshape(ins[0], in_shapes[0], outs[0])]
        elif name in _REDUCTIONS or name.startswith("reduce_") or name in ("argmax", "argmin"):
            dropped = set(node.params.get("axes", ()))
            kept = tuple(entry for i, entry in enumerate(ins[0]) if i not in dropped)
            result = [kept if len(kept) == len(outs[0]) else _none(outs[0])]
        else:
            result = [_like(out, ins, in_shapes) for out in outs]
        for value, spec, shape in zip(node.outputs, result, outs, strict=True):
            self.spec[value] = self._valid(spec, shape)
        if name == "dot_general" and self._summed_over_axis(node, ins):
            # Partial sums over a mesh axis: XLA all-reduces them into a second buffer.
            self.scratch[node.index] = self.scratch.get(node.index, 0) + self.bytes(node.outputs[0])
        elif name == "conv_general_dilated":
            self.scratch[node.index] = self.scratch.get(node.index, 0) + self._conv_copies(node)

    def _dot(self, node: Node, ins: list[Spec], out: tuple[int, ...]) -> Spec:
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        lhs, rhs = ins
        lhs_free = [i for i in range(len(lhs)) if i not in lc and i not in lb]
        rhs_free = [i for i in range(len(rhs)) if i not in rc and i not in rb]
        spec = [lhs[a] or rhs[b] for a, b in zip(lb, rb, strict=True)]
        spec += [lhs[i] for i in lhs_free] + [rhs[i] for i in rhs_free]
        return tuple(spec) if len(spec) == len(out) else _none(out)

    def _conv(self, node: Node, ins: list[Spec], out: tuple[int, ...]) -> Spec:
        numbers = node.params.get("dimension_numbers")
        lhs_spec, rhs_spec, out_spec = getattr(numbers, "lhs_spec", None), None, None
        if lhs_spec is None:
            return _none(out)
        rhs_spec, out_spec = numbers.rhs_spec, numbers.out_spec
        spec = list(_none(out))
        spec[out_spec[0]] = ins[0][lhs_spec[0]]
        spec[out_spec[1]] = ins[1][rhs_spec[0]]
        return tuple(spec)

    def _summed_over_axis(self, node: Node, ins: list[Spec]) -> bool:
        (lc, rc), _ = node.params["dimension_numbers"]
        return any(ins[0][a] and set(ins[0][a]) & set(ins[1][b]) for a, b in zip(lc, rc, strict=True))

    def _conv_copies(self, node: Node) -> int:
        """Bytes of the operands XLA copies into its own layout before a convolution.

        The forward convolution reads its input batch-first, features last, and
        its kernel output-features last; the backward ones (JAX's transposes)
        read them in other orders, and XLA copies each such operand first.
        """
        numbers = node.params.get("dimension_numbers")
        if getattr(numbers, "lhs_spec", None) is None:
            return 0
        rank = len(numbers.lhs_spec)
        copies = 0
        if tuple(numbers.lhs_spec[:2]) != (0, rank - 1):
            copies += self.bytes(node.inputs[0]) if node.inputs[0] >= 0 else 0
        if tuple(numbers.rhs_spec[:2]) != (rank - 1, rank - 2):
            copies += self.bytes(node.inputs[1]) if node.inputs[1] >= 0 else 0
        if tuple(numbers.out_spec[:2]) != (0, rank - 1):
            copies += self.bytes(node.outputs[0])
        return copies

    def _valid(self, spec: Spec, shape: tuple[int, ...]) -> Spec:
        """`spec` with each axis used once, only where it divides its dimension."""
        seen: set[str] = set()
        out = []
        for entry, size in zip(spec, shape, strict=False):
            kept = []
            for axis in entry:
                if axis in seen or axis not in self.sizes:
                    continue
                pieces = math.prod(self.sizes[a] for a in kept) * self.sizes[axis]
                if size % pieces == 0:
                    kept.append(axis)
                    seen.add(axis)
            out.append(tuple(kept))
        out += [()] * (len(shape) - len(out))
        return tuple(out)

    def _gathers(self, weights: Mapping[int, Spec]) -> None:
        """The gathered copy of each batch-split weight a projection, a convolution or a look-up reads."""
        for value in weights:
            reads = self._reads(value)
            if not reads:
                continue
            synthetic = -(len(self.gathered) + 2)
            shape = self.trace.shapes[value]
            whole = math.prod(shape) * _itemsize(self.trace.dtypes[value])
            pieces = math.prod(self.sizes[a] for entry in self._input(value) for a in entry)
            self._gathered_bytes[synthetic] = whole // max(pieces, 1)
            self.gathered[synthetic] = (min(reads), max(reads))

    def _reads(self, value: int) -> list[int]:
        """The nodes that read `value` (through casts and transposes) as a projection, conv or look-up."""
        found, stack = [], [value]
        while stack:
            current = stack.pop()
            for index in self.trace.consumers.get(current, ()):
                node = self.trace.nodes[index]
                if node.primitive in _GATHERING:
                    found.append(index)
                elif node.primitive in ("convert_element_type", "transpose", "reshape", "copy"):
                    stack.extend(node.outputs)
        return found


def _itemsize(dtype: str) -> int:
    """Bytes per element; a random key (`key<fry>`) holds two uint32 words."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8


def _none(shape: Sequence[int]) -> Spec:
    return tuple(() for _ in shape)


def _like(out: tuple[int, ...], ins: list[Spec], in_shapes: list[tuple[int, ...]]) -> Spec:
    """Each dimension's axes from the first input of the same rank whose dimension has the same size."""
    spec = list(_none(out))
    for spec_in, shape in zip(ins, in_shapes, strict=True):
        if len(shape) != len(out):
            continue
        for d, (size, entry) in enumerate(zip(shape, spec_in, strict=True)):
            if not spec[d] and size == out[d] and entry:
                spec[d] = entry
    return tuple(spec)


def _reshape(spec: Spec, shape: tuple[int, ...], out: tuple[int, ...]) -> Spec:
    """Axes carried to the output dimension that starts where the input dimension starts."""
    starts_out: dict[int, int] = {}
    position = 1
    for d, size in enumerate(out):
        starts_out.setdefault(position, d)
        position *= size
    result = list(_none(out))
    position = 1
    for d, size in enumerate(shape):
        if spec[d] and position in starts_out:
            result[starts_out[position]] = spec[d]
        position *= size
    return tuple(result)
