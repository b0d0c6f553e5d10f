"""The per-device peak of a training step: state, then what the traced step keeps alive at its worst.

`peak_memory(trace, layouts, axis_sizes, ...)` walks the traced training step
(`_trace.trace_step`: forward, then backward, as JAX emits them) once:

1. **Per-device shapes** (`_propagate.Specs`): each value's layout, propagated
   from the variables' layouts and the batch (split over the batch axis on its
   first dimension) through the operations, with the gathered copies of
   batch-split weights and the buffers one operation writes while it runs.
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

On a TPU target (`compiler_of(mesh) == "tpu"`) the walk follows what XLA:TPU's
buffer assignment was measured to do instead (libtpu 0.0.42.1): each gradient is
applied by the optimizer as soon as it is written, so the gradients are neither
held to the end nor summed into a second copy, and partial sums are all-reduced in
place; a result read only by a transpose is written once, in the transposed layout;
an element-wise result takes the buffer of an operand that dies there; an element-wise
result read only by matmuls is computed inside them, and a cheap one is recomputed in
each of its readers (`_fused_on_tpu`). A transient peak small enough to stay in the chip's
vector memory is not counted in HBM, and the parameters, slots and batch take XLA:TPU's tiled
layouts (`_tpu_memory`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np

from .. import _compat
from ..core._axes import Axes, entry_axes
from . import _tpu_memory
from ._convs import CONV_LAYERS
from ._propagate import REDUCTIONS, Specs, itemsize
from ._trace import Trace, trace_step

__all__ = ["PeakMemory", "PeakWalk", "compiler_of", "peak_memory", "plan_peak", "transient_peak"]


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
#: Element-wise operations XLA counts expensive (transcendental, division): never duplicated into readers.
_EXPENSIVE = frozenset(
    """atan2 cbrt cos cosh div erf erf_inv erfc exp exp2 expm1 lgamma log log1p logistic pow rem rsqrt
    sin sinh sqrt tan tanh""".split()
)
#: Operations that update their first operand in place: XLA writes the result into that buffer.
_IN_PLACE = frozenset("scatter scatter-add scatter-mul scatter-min scatter-max dynamic_update_slice".split())


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """The predicted per-device peak of one training step.

    Attributes:
        state: Parameters, non-trainable variables, gradients and optimizer slots.
        gradients: The gradients' share of `state`.
        batch: The batch's shard on each device.
        transient: The most the step holds at once beyond its parameters and slots:
            activations, temporaries and the gradients written so far.
        held: Whether every gradient is held until the update (XLA:CPU); on XLA:TPU each is
            applied as it is written, so the peak may hold fewer than all of them.
        tiles: What XLA:TPU's tiled layouts add to the parameters and slots (`_tpu_memory`); 0
            on XLA:CPU.
    """

    state: int
    gradients: int
    batch: int
    transient: int
    held: bool = True
    tiles: int = 0

    @property
    def non_state(self) -> int:
        """What the peak holds beyond the training state: the batch, activations and temporaries."""
        return self.peak - self.state

    @property
    def peak(self) -> int:
        """State without gradients, the batch, and the transient peak (gradients included)."""
        transient = max(self.transient, self.gradients) if self.held else self.transient
        return self.state - self.gradients + self.tiles + self.batch + transient


class PeakWalk:
    """One traced training step, walked again for each set of layouts the search tries."""

    def __init__(
        self,
        model: Any,
        trace: Trace,
        axis_sizes: Mapping[str, int],
        batch_axis: str | None,
        compiler: str = "cpu",
    ) -> None:
        self.trace = _live_code(trace)
        self.axis_sizes = dict(axis_sizes)
        self.batch_axis = batch_axis
        self.compiler = compiler
        self.trainable = {v.path: v for v in model.trainable_variables}
        self.variables = tuple(model.variables)

    @classmethod
    def of(
        cls,
        model: Any,
        batch: Any,
        axis_sizes: Mapping[str, int],
        batch_axis: str | None,
        compiler: str = "cpu",
    ) -> PeakWalk | None:
        """The walk of `model`'s step on `batch`, or `None` when its gradient cannot be traced."""
        try:
            return cls(model, trace_step(model, batch), axis_sizes, batch_axis, compiler)
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
            self.trace,
            layouts,
            self.axis_sizes,
            self.batch_axis,
            state=state,
            gradients=gradients,
            compiler=self.compiler,
            whole_after=getattr(table, "whole_after", frozenset()),
            tiles=_tiles(self.compiler, self.variables, layouts, self.axis_sizes),
        )


def compiler_of(mesh: Any) -> str:
    """The compiler whose buffers the walk follows for `mesh`: `"tpu"` on a TPU target, else `"cpu"`."""
    return "tpu" if getattr(mesh, "target", None) is not None else "cpu"


def plan_peak(model: Any, plan: Any, batch: Any, batch_axis: str | None, compiler: str = "cpu") -> PeakMemory:
    """The predicted per-device peak of one training step of `model` on `batch` under `plan`.

    `plan` is a `kml.Plan` of `model` (its entries give each variable's layout and its
    `memory()` the training state); `model` may be a `kml.dry_build` model. `compiler`
    (`compiler_of(mesh)`) is the XLA whose buffers the walk follows.
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
        compiler=compiler,
        whole_after=_whole_conv_outputs(model, plan, batch_axis),
        tiles=_tiles(compiler, model.variables, layouts, plan.axis_sizes),
    )


def _tiles(
    compiler: str, variables: Any, layouts: Mapping[str, Axes], axis_sizes: Mapping[str, int]
) -> float:
    """The state's padding factor on `compiler`: XLA:TPU's tiles (`_tpu_memory.tiled_state`), else 1."""
    return _tpu_memory.tiled_state(variables, layouts, axis_sizes) if compiler == "tpu" else 1.0


def _whole_conv_outputs(model: Any, plan: Any, batch_axis: str | None) -> frozenset[str]:
    """The kernels of the convolution layers whose output a layer-output rule splits over the batch only."""
    kept = {
        layer
        for rule, layers in plan.outputs
        if all(axis == batch_axis for entry in rule.axes for axis in entry_axes(entry))
        for layer in layers
    }
    return frozenset(
        layer.kernel.path
        for layer in _compat.sublayers(model)
        if isinstance(layer, CONV_LAYERS) and getattr(layer, "path", None) in kept
    )


def peak_memory(
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
    *,
    state: int,
    gradients: int,
    compiler: str = "cpu",
    whole_after: frozenset[str] = frozenset(),
    tiles: float = 1.0,
) -> PeakMemory:
    """The `PeakMemory` of the traced step `trace` (`_trace.trace_step`) under `layouts`.

    `state` and `gradients` are the per-device training-state bytes and their gradients' share
    (`core._memory`: a plan's `memory()`, or the planner's candidates); `whole_after` the kernels
    whose convolution's layer output a rule keeps whole (`_propagate.Specs`); `tiles` the
    factor by which the parameters and slots are padded in the compiler's layouts.
    """
    transient, batch = transient_peak(trace, layouts, axis_sizes, batch_axis, compiler, whole_after)
    if compiler == "tpu":  # each gradient is applied as it is written: none is held to the end
        padding = round((state - gradients) * (tiles - 1))
        return PeakMemory(state, gradients, batch, transient, held=False, tiles=padding)
    return PeakMemory(state=state, gradients=gradients, batch=batch, transient=transient)


def transient_peak(
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
    compiler: str = "cpu",
    whole_after: frozenset[str] = frozenset(),
) -> tuple[int, int]:
    """`(transient peak, batch bytes)` per device of the traced step `trace` (see the module docstring).

    `layouts` gives each variable path its axes (missing: replicated).
    """
    held = compiler != "tpu"
    specs = Specs(trace, layouts, axis_sizes, batch_axis, whole_after)
    sizes = {value: specs.bytes(value) for value in trace.shapes}
    fused = _fused(trace) | (_laid_out(trace) | _fused_on_tpu(trace) if not held else set())
    last = _last_reads(trace, fused)
    end = len(trace.nodes)
    for value in trace.outputs:
        if value >= 0 and held:
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
    if held and axis_sizes.get(batch_axis or "", 1) > 1:
        # The gradients are summed over the batch axis into buffers of their own (one combined
        # all-reduce at the end of the backward pass, measured on XLA:CPU), before the update.
        summed = sum(sizes[value] for value in set(trace.outputs) if value >= 0)
        specs.scratch[end] = specs.scratch.get(end, 0) + summed
    if not held:
        for when, reused in _in_place(trace, set(buffers), sizes, last).items():
            starts[when] -= reused
            frees[when] -= reused
    extras = [specs.scratch, specs.partial_sums] if held else [specs.scratch]
    for when, extra in ((w, e) for scratch in extras for w, e in scratch.items()):
        starts[when] = starts.get(when, 0) + extra
        frees[when] = frees.get(when, 0) + extra
    batch = sum(sizes[value] if held else _tiled(trace, specs, value) for value in trace.inputs)
    peak = _sweep(starts, frees, end)
    if not held:  # XLA:TPU keeps a step whose temporaries are small in on-chip memory, not HBM
        peak = _tpu_memory.in_hbm(peak)
    return peak, batch


def _tiled(trace: Trace, specs: Specs, value: int) -> int:
    """The bytes of `value`'s shard in XLA:TPU's tiled layout (`_tpu_memory.tiled_bytes`)."""
    shard = list(trace.shapes[value])
    for dim, entry in enumerate(specs.spec.get(value, ())[: len(shard)]):
        shard[dim] = -(-shard[dim] // math.prod(specs.sizes[a] for a in entry))
    return _tpu_memory.tiled_bytes(shard, itemsize(trace.dtypes[value]))


def _sweep(starts: Mapping[int, int], frees: Mapping[int, int], end: int) -> int:
    """The largest sum of live bytes over the program."""
    live = peak = 0
    for when in range(end + 1):
        live += starts.get(when, 0)
        peak = max(peak, live)
        live -= frees.get(when, 0)
    return peak


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
            elif node.primitive in _CHEAP and _updated_only(trace, value, readers):
                fused.add(value)  # the zeros a scatter-add starts from: written into its result
            elif all(_fusing(p) for p in primitives) and (node.primitive in _CHEAP or len(set(readers)) == 1):
                fused.add(value)
    return fused


def _fused_on_tpu(trace: Trace) -> set[int]:
    """Values XLA:TPU fuses where XLA:CPU writes them: into matmuls, and duplicated into readers.

    XLA:TPU fuses an element-wise producer into the `dot_general`s that read it (each
    recomputes it as it loads its operand), and duplicates a cheap element-wise result
    (`_EXPENSIVE` excluded) into every element-wise, reduction or matmul reader. Measured on a
    Llama-3-style block (v5e 2x4, libtpu 0.0.42.1): the softmax's probabilities (read by the
    two backward matmuls) and the normalised hidden states (read by the projections) are not
    buffers; the attention mask is kept before its broadcast over the heads (4 MiB, where the
    walk counted the broadcast and of the causal and padding masks, 32 MiB).
    """
    outputs = set(trace.outputs)
    fused = set()
    for node in trace.nodes:
        if node.primitive not in _ELEMENTWISE:
            continue
        for value in node.outputs:
            readers = trace.consumers.get(value, ())
            if value in outputs or not readers:
                continue
            primitives = [trace.nodes[r].primitive for r in readers]
            into_matmuls = all(p == "dot_general" for p in primitives)
            duplicated = node.primitive not in _EXPENSIVE and all(
                _fusing(p) or p == "dot_general" for p in primitives
            )
            if into_matmuls or duplicated:
                fused.add(value)
    return fused


def _updated_only(trace: Trace, value: int, readers: Sequence[int]) -> bool:
    """Whether `value` is read once, as the operand an in-place update (`_IN_PLACE`) writes into.

    Measured on keras-hub Gemma (a token table split over both axes): the gradient of a
    look-up is a `scatter-add` into a broadcast of zeros, which XLA writes as one buffer of the
    gradient's own shard; the walk counted the zeros whole (262,144 bytes where XLA:CPU holds 32,768).
    """
    if len(readers) != 1:
        return False
    node = trace.nodes[readers[0]]
    return node.primitive in _IN_PLACE and node.inputs[:1] == (value,) and value not in node.inputs[1:]


def _in_place(
    trace: Trace, buffers: set[int], sizes: Mapping[int, int], last: Mapping[int, int]
) -> dict[int, int]:
    """Per node, the bytes of element-wise results XLA:TPU writes over an operand that dies there.

    The operands are the node's inputs and, through values fused into it, theirs. Measured on a
    language-model head: the logits' gradient takes the logits' own buffer, so one (tokens ×
    vocabulary) buffer is live where the walk counted two.
    """
    reused: dict[int, int] = {}
    for node in trace.nodes:
        if node.primitive not in _ELEMENTWISE:
            continue
        taken: set[int] = set()
        for value in (v for v in node.outputs if v in buffers):
            for operand in _operands(trace, node.inputs, buffers):
                if operand in buffers and operand not in taken and last.get(operand) == node.index:
                    if sizes[operand] == sizes[value]:
                        taken.add(operand)
                        reused[node.index] = reused.get(node.index, 0) + sizes[value]
                        break
    return reused


def _operands(trace: Trace, inputs: Sequence[int], buffers: set[int]) -> list[int]:
    """The buffers `inputs` read: each input that is one, else (fused) those its producer reads."""
    found: list[int] = []
    seen: set[int] = set()
    pending = [v for v in inputs if v >= 0]
    while pending:
        value = pending.pop(0)
        if value in seen:
            continue
        seen.add(value)
        if value in buffers:
            found.append(value)
        elif value in trace.producer:
            pending.extend(v for v in trace.nodes[trace.producer[value]].inputs if v >= 0)
    return found


def _laid_out(trace: Trace) -> set[int]:
    """Values XLA:TPU writes in their one reader's layout: a result read only by a transpose.

    XLA:TPU's layout assignment turns such a transpose into a change of layout of its operand
    (measured: a weight's gradient, `dot_general` then `transpose`, is written once, not twice).
    """
    outputs = set(trace.outputs)
    laid_out = set()
    for node in trace.nodes:
        for value in node.outputs:
            readers = set(trace.consumers.get(value, ()))
            if value not in outputs and len(readers) == 1:
                if trace.nodes[next(iter(readers))].primitive == "transpose":
                    laid_out.add(value)
    return laid_out


def _fusing(primitive: str) -> bool:
    return primitive in _ELEMENTWISE or primitive in REDUCTIONS


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
