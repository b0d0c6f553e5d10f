"""Per-device shapes of a traced step: each value's layout, propagated from the weights and the batch.

A small model of XLA's sharding propagation, read by the peak-memory walk (`_peak`):
element-wise operations, broadcasts, reshapes and transposes carry each dimension's
axes; a `dot_general` or a convolution gives its output the batch and free
dimensions of its operands (a contracted split is summed away); a reduction drops
the reduced dimensions; anything else keeps the axes of an input dimension of the
same size. A weight split over the batch axis (2-D, fully sharded) is gathered over
it where a projection, a convolution or a look-up reads it: that gathered copy is
a temporary, alive from its first read to its last. Buffers XLA writes only while
one operation runs (partial sums before their all-reduce, convolution operands
copied into XLA's layout) are `scratch`. The output of a convolution whose kernel is
in `whole_after` (an input convolution, `_convs.input_convs`, whose layer output a
rule keeps whole) is split over the batch axis only, as is the element-wise chain
after it (its bias, its activation): the layer's output, all-gathered there. A kernel in
`gathered` (a key/value kernel split on head_dim, `_kv_costs`) is all-gathered whole where it is
read, as XLA does once per step: its gathered copy is a temporary from its first read to its last,
and the projections read it whole. With `xla_cpu`, the buffers are XLA:CPU's: a bfloat16 or
float16 value takes four bytes an element (it has no half-precision arithmetic of its own: it
converts such operands to float32, computes in float32 and writes most results so), and a
depthwise kernel's gradient is computed densely, channel by channel, into two scratch buffers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from ..core._axes import Axes, entry_axes
from ._grower import ELEMENTWISE
from ._scan import is_zeros
from ._trace import Node, Trace, trace_body

__all__ = ["HALF_PRECISION", "REDUCTIONS", "Specs", "copied_operands", "itemsize"]

Spec = tuple[tuple[str, ...], ...]

#: The floating-point types XLA:CPU computes in float32 (`Specs(xla_cpu=True)`).
HALF_PRECISION = frozenset(("bfloat16", "float16"))
#: Reductions: they read fused inputs, and write a buffer of their own.
REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)
#: Operations that only lay their one input out anew.
_REARRANGING = frozenset(("broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims"))
#: Readers of a weight that need it whole over the batch axis (XLA all-gathers it first).
_GATHERING = frozenset(("dot_general", "conv_general_dilated", "gather", "dynamic_slice"))


class Specs:
    """Per value, the mesh axes over which each of its dimensions is split (see the module docstring)."""

    def __init__(
        self,
        trace: Trace,
        layouts: Mapping[str, Axes],
        axis_sizes: Mapping[str, int],
        batch_axis: str | None,
        whole_after: frozenset[str] = frozenset(),
        inputs: Sequence[Spec] | None = None,
        gathered: frozenset[str] = frozenset(),
        xla_cpu: bool = False,
    ) -> None:
        self.trace = trace
        self.xla_cpu = xla_cpu
        #: Per convolution, the bytes of the batch it reads copied into its layout, which XLA:CPU writes
        #: as soon as the step starts (the batch is there) and holds to the convolution: a kernel
        #: gradient's input, from the forward pass to the backward (keras-hub ViT's patches: 48 KiB a
        #: device on 2×4 from its 135th instruction to its 434th of 607).
        self.early_copies: dict[int, int] = {}
        #: Per grouped convolution `(groups, kernel shape)`, the pieces its kernel's channels are split in.
        self._grouped_splits: dict[tuple[int, tuple[int, ...]], int] = {}
        self.whole_after = whole_after
        #: Variables read whole, gathered over every axis they are split over.
        self._read_whole = {value for value, path in trace.variables.items() if path in gathered}
        #: Values a layer-output rule keeps whole over every axis but the batch's.
        self._whole: set[int] = set()
        self.sizes = dict(axis_sizes)
        self.batch_axis = batch_axis
        self.spec: dict[int, Spec] = {}
        #: Gathered copies of batch-split weights: a synthetic value id → (first read, last read).
        self.gathered: dict[int, tuple[int, int]] = {}
        self._gathered_bytes: dict[int, int] = {}
        #: Per node, bytes of buffers alive only while it runs (copies of operands, partial sums).
        self.scratch: dict[int, int] = {}
        #: Per node, bytes of partial sums it writes before their all-reduce (XLA:CPU's second buffer).
        self.partial_sums: dict[int, int] = {}
        #: The weights, the constants and what element-wise operations make of them alone (a broadcast
        #: scale, `1 + scale`, a kernel clipped to float8's range).
        self._of_weights: set[int] = set(trace.variables) | {
            value for value in trace.shapes if value not in trace.producer and value not in trace.inputs
        }  # and the constants (float8's bounds), read as the weights are
        weights: dict[int, Spec] = {}
        for value, path in trace.variables.items():
            axes = layouts.get(path)
            shape = trace.shapes[value]
            spec = _none(shape) if axes is None else tuple(entry_axes(a) for a in axes)
            self.spec[value] = self._valid(spec if len(spec) == len(shape) else _none(shape), shape)
            if value in self._read_whole and any(self.spec[value]):
                weights[value] = self.spec[value]
            elif batch_axis is not None and any(batch_axis in entry for entry in self.spec[value]):
                weights[value] = self.spec[value]
        for value in trace.inputs:
            shape = trace.shapes[value]
            first = (batch_axis,) if batch_axis and shape else ()
            spec = (first, *_none(shape)[1:]) if shape else ()
            if inputs is not None:  # a loop's body (`_scan`): its inputs, in order, laid out as given
                spec = inputs[value] if len(inputs[value]) == len(shape) else _none(shape)
            self.spec[value] = self._valid(spec, shape)
        for node in trace.nodes:
            self._propagate(node)
        # The step's outputs are the gradients, in the trainable variables' order: each is laid
        # out as its variable (XLA reduce-scatters a split weight's gradient onto its shards).
        for output, variable in zip(trace.outputs, sorted(trace.variables), strict=False):
            if output >= 0 and trace.shapes[output] == trace.shapes[variable]:
                self.spec[output] = self.spec[variable]
                self._lay_out_summands(output)
        self._gathers(weights)

    def _lay_out_summands(self, gradient: int) -> None:
        """The pieces a gradient is summed from (`add_any`, a look-up's `scatter-add`), laid out as it.

        A table read twice (T5's token table, shared by its encoder and decoder) has its gradient
        summed from one scatter per read; XLA writes each in the table's layout, where propagating
        forward from the zeros it scatters into leaves them whole (T5 on 2×4: two 256 KiB pieces
        at the walk's peak where XLA:CPU holds 32 KiB shards).
        """
        pending = [gradient]
        while pending:
            value = pending.pop()
            producer = self.trace.producer.get(value)
            node = None if producer is None else self.trace.nodes[producer]
            if node is None or node.primitive not in ("add_any", "scatter-add"):
                continue
            for operand in node.inputs:
                same = operand >= 0 and self.trace.shapes[operand] == self.trace.shapes[value]
                if same and operand not in self.trace.variables and not any(self.spec.get(operand, ())):
                    self.spec[operand] = self.spec[value]
                    pending.append(operand)

    def bytes(self, value: int) -> int:
        if value in self._gathered_bytes:
            return self._gathered_bytes[value]
        shape, dtype = self.trace.shapes[value], self.trace.dtypes[value]
        whole = math.prod(shape) * self._width(dtype)
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
        if not any(v >= 0 for v in node.inputs):
            self._of_weights.update(node.outputs)  # a constant (`iota`, a literal broadcast)
        if name in ELEMENTWISE or name in _REARRANGING:
            ins = self._activations_first(node, ins, in_shapes)
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
        elif name == "scan":
            result = self._scan(node, ins)
        elif name in REDUCTIONS or name.startswith("reduce_") or name in ("argmax", "argmin"):
            dropped = set(node.params.get("axes", ()))
            kept = tuple(entry for i, entry in enumerate(ins[0]) if i not in dropped)
            result = [kept if len(kept) == len(outs[0]) else _none(outs[0])]
        else:
            result = [_like(out, ins, in_shapes) for out in outs]
        if name in ELEMENTWISE:
            whole = any(v in self._whole for v in node.inputs)
        else:
            whole = name == "conv_general_dilated" and self._kernel_path(node.inputs[1]) in self.whole_after
        if whole:
            batch = (self.batch_axis,) if self.batch_axis else ()
            result = [tuple(tuple(a for a in e if a in batch) for e in spec) for spec in result]
            self._whole.update(node.outputs)
        for value, spec, shape in zip(node.outputs, result, outs, strict=True):
            self.spec[value] = self._valid(spec, shape)
        if name == "dot_general" and self._summed_over_axis(node, ins):
            # Partial sums over a mesh axis: XLA all-reduces them into a second buffer.
            self.partial_sums[node.index] = self.partial_sums.get(node.index, 0) + self.bytes(node.outputs[0])
        elif name == "conv_general_dilated":
            scratch = self._conv_copies(node) + (self._depthwise_gradient(node) if self.xla_cpu else 0)
            self.scratch[node.index] = self.scratch.get(node.index, 0) + scratch
            early = sum(self.bytes(v) for v in copied_operands(node) if self._early(v))
            if early:
                self.early_copies[node.index] = early

    def _activations_first(self, node: Node, ins: list[Spec], in_shapes: list[tuple[int, ...]]) -> list[Spec]:
        """An element-wise operation of activations and weights is laid out as its activations: XLA
        gathers the weights' other splits (a norm's scale split over the model axis in a fully sharded
        plan leaves the normalised activations whole over it: measured on XLA:CPU, Keras's attention
        layer fully sharded on 2x4, 16 KiB buffers the walk had taken as 4 KiB); an operation of
        weights alone is one too (`_of_weights`)."""
        read = [v for v in node.inputs if v >= 0]
        if all(v in self._of_weights for v in read):
            self._of_weights.update(node.outputs)
            return ins
        if not any(v in self._of_weights for v in read):
            return ins
        return [
            _none(shape) if v in self._of_weights else spec
            for v, spec, shape in zip(node.inputs, ins, in_shapes, strict=True)
        ]

    def _scan(self, node: Node, ins: list[Spec]) -> list[Spec]:
        """A loop's results, from its body propagated on its operands' layouts (see `_scan`).

        A sequence's slice is laid out as the sequence without its scanned dimension, and a
        stacked output as its slice, the scanned dimension whole. A carried value enters as its
        initial value, then as one step leaves it (a state built from zeros is split as the
        step splits it, and so are those zeros, as XLA lays them out), until it no longer
        changes; a dimension the body leaves whole takes the axes of an operand's dimension of
        the same size, as any other operation's (`_like`).
        """
        body = trace_body(node.params["jaxpr"])
        consts, carry = node.params["num_consts"], node.params["num_carry"]
        carried = list(ins[consts : consts + carry])
        sequences = [spec[1:] for spec in ins[consts + carry :]]
        for _ in range(carry + 1):
            inner = Specs(body, {}, self.sizes, self.batch_axis, inputs=[*ins[:consts], *carried, *sequences])
            outs = [inner.spec.get(v, _none(body.shapes[v])) if v >= 0 else () for v in body.outputs]
            steps = zip(carried, outs[:carry], strict=True)
            after = [tuple(a or b for a, b in zip(c, o, strict=False)) for c, o in steps]
            if after == carried:
                break
            carried = after
        shapes = [self.trace.shapes[v] if v >= 0 else () for v in node.inputs]
        guesses = [_like(self.trace.shapes[v], ins, shapes) for v in node.outputs[:carry]]
        carried = [
            tuple(a or b for a, b in zip(c, g, strict=False)) for c, g in zip(carried, guesses, strict=True)
        ]
        for value, spec in zip(node.inputs[consts : consts + carry], carried, strict=True):
            if is_zeros(self.trace, value):  # laid out as carried (RWKV-7's backward zeros: 2 KiB, not 16)
                self.spec[value] = self._valid(spec, self.trace.shapes[value])
        return [*carried, *(((), *spec) for spec in outs[carry:])]

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

    def _kernel_path(self, value: int) -> str | None:
        """The variable `value` is (cast, transposed or reshaped at most), or `None`."""
        found = self._variable_of(value, ("convert_element_type", "transpose", "reshape", "copy"))
        return None if found is None else self.trace.variables[found]

    def _variable_of(self, value: int, passes: tuple[str, ...]) -> int | None:
        """The variable's value id `value` is, through the operations `passes` at most, or `None`."""
        while value not in self.trace.variables:
            index = self.trace.producer.get(value)
            node = None if index is None else self.trace.nodes[index]
            if node is None or node.primitive not in passes:
                return None
            value = node.inputs[0]
        return value

    def _summed_over_axis(self, node: Node, ins: list[Spec]) -> bool:
        (lc, rc), _ = node.params["dimension_numbers"]
        return any(ins[0][a] and set(ins[0][a]) & set(ins[1][b]) for a, b in zip(lc, rc, strict=True))

    def _conv_copies(self, node: Node) -> int:
        """Bytes of the operands XLA copies into its own layout before a convolution.

        The forward convolution reads its input batch-first, features last, and
        its kernel output-features last; the backward ones (JAX's transposes)
        read them in other orders, and XLA copies each such operand first. On XLA:CPU
        the batch's copy is not one of them: it lives from the step's start (`early_copies`).
        """
        numbers = node.params.get("dimension_numbers")
        if getattr(numbers, "lhs_spec", None) is None:
            return 0
        rank = len(numbers.lhs_spec)
        copies = sum(self.bytes(v) for v in copied_operands(node) if not self._early(v))
        if tuple(numbers.out_spec[:2]) != (0, rank - 1):
            copies += self.bytes(node.outputs[0])
        return copies

    def _width(self, dtype: str) -> int:
        """Bytes an element of `dtype` takes in a buffer: four for half precision on XLA:CPU."""
        return 4 if self.xla_cpu and dtype in HALF_PRECISION else itemsize(dtype)

    def _early(self, value: int) -> bool:
        """Whether XLA:CPU copies `value`, read by a convolution, early and holds the copy to it.

        The batch (it is there when the step starts), and a pointwise (1 × 1) kernel an input
        gradient reads transposed: a copy of the weights alone, which XLA:CPU computes during the
        forward pass and holds to the backward one (measured: keras.applications Xception on 4x2, 38
        pointwise kernels' copies, 35 MB a device live at the compiled peak, made from the 585th
        instruction of 3,199 on; the walk had each briefly at its convolution, 0.840 of the compiled
        peak, 0.976 since). XLA:CPU holds a 3 × 3 kernel's reversed copy so too (Xception's second
        convolution, the test convnet's), but on the test convnet (8x1) the walk, which already
        over-counts its kernel gradient's moment, then reads 1.17 of the compiled peak: left brief.
        """
        return self.xla_cpu and (value in self.trace.inputs or self._pointwise_kernel(value))

    def _pointwise_kernel(self, value: int) -> bool:
        """Whether `value` is a variable of a 1 × 1 convolution's kernel, reversed or transposed at most."""
        found = self._variable_of(value, ("rev", "convert_element_type", "transpose", "reshape"))
        shape = () if found is None else self.trace.shapes[found]
        return len(shape) > 2 and math.prod(shape[:-2]) == 1

    def _depthwise_gradient(self, node: Node) -> int:
        """Bytes of XLA:CPU's scratch for a depthwise kernel's gradient, 0 for any other convolution.

        XLA:CPU convolves densely, every channel of the device with every other (`C × kh × kw × C`),
        then keeps the diagonal in a copy of as many bytes (MobileNetV2 on 2×4: two 2 MB buffers
        for a 3×3 kernel of 240 channels a device; the walk had 0.71 of the compiled peak). The
        device's C is the forward convolution's kernel's (`_grouped_splits`, recorded here): XLA
        slices the gradient's operands there where the walk may see them whole.
        """
        numbers = node.params["dimension_numbers"]
        out = self.trace.shapes[node.outputs[0]]
        groups = node.params.get("batch_group_count", 1)
        if groups > 1 and out[numbers.out_spec[1]] == groups:
            pieces = self._grouped_splits.get((groups, out), 1)
            whole = math.prod(out) * self._width(self.trace.dtypes[node.outputs[0]])
            return 2 * (whole // pieces) * (groups // pieces)
        if node.params.get("feature_group_count", 1) > 1 and node.inputs[1] >= 0:
            kernel = self.spec.get(node.inputs[1]) or _none(self.trace.shapes[node.inputs[1]])
            pieces = math.prod(self.sizes[a] for a in kernel[numbers.rhs_spec[0]])
            key = (node.params["feature_group_count"], self.trace.shapes[node.inputs[1]])
            self._grouped_splits[key] = max(self._grouped_splits.get(key, 1), pieces)
        return 0

    def _valid(self, spec: Spec, shape: tuple[int, ...]) -> Spec:
        """`spec` with each axis used once, only where it divides its dimension or is split over it whole.

        A dimension smaller than its pieces (`size > 1` dividing them) holds the major part of a
        split a reshape spread over it and the dimensions after it (`_reshape`).
        """
        seen: set[str] = set()
        out = []
        for entry, size in zip(spec, shape, strict=False):
            kept = []
            for axis in entry:
                if axis in seen or axis not in self.sizes:
                    continue
                pieces = math.prod(self.sizes[a] for a in kept) * self.sizes[axis]
                if size % pieces == 0 or (size > 1 and pieces % size == 0):
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
            whole = math.prod(shape) * itemsize(self.trace.dtypes[value])
            spec = _none(shape) if value in self._read_whole else self._input(value)
            pieces = math.prod(self.sizes[a] for entry in spec for a in entry)
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


def copied_operands(node: Node) -> list[int]:
    """The operands XLA:CPU copies into its own layout before the convolution `node` (`Specs`)."""
    numbers = node.params.get("dimension_numbers")
    if node.primitive != "conv_general_dilated" or getattr(numbers, "lhs_spec", None) is None:
        return []
    rank = len(numbers.lhs_spec)
    copied = []
    if tuple(numbers.lhs_spec[:2]) != (0, rank - 1) and node.inputs[0] >= 0:
        copied.append(node.inputs[0])
    if tuple(numbers.rhs_spec[:2]) != (rank - 1, rank - 2) and node.inputs[1] >= 0:
        copied.append(node.inputs[1])
    return copied


def itemsize(dtype: str) -> int:
    """Bytes per element; a random key (`key<fry>`) holds two uint32 words."""
    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        return 8


def _none(shape: Sequence[int]) -> Spec:
    return tuple(() for _ in shape)


def _like(out: tuple[int, ...], ins: list[Spec], in_shapes: list[tuple[int, ...]]) -> Spec:
    """Each dimension's axes from the first input of the same rank whose dimension has the same size.

    With no input of the same rank (`unstack`, `squeeze`, `expand_dims`, a split), the
    dimensions are matched in order by size (`_aligned`): measured on keras-hub's rotary
    embedding, whose backward `unstack` was taken as replicated, 8 GiB per chip too many.
    """
    spec = list(_none(out))
    same_rank = False
    for spec_in, shape in zip(ins, in_shapes, strict=True):
        if len(shape) != len(out):
            continue
        same_rank = True
        for d, (size, entry) in enumerate(zip(shape, spec_in, strict=True)):
            if not spec[d] and size == out[d] and entry:
                spec[d] = entry
    if not same_rank:
        for spec_in, shape in zip(ins, in_shapes, strict=True):
            if shape and any(spec_in):
                return _aligned(out, spec_in, shape)
    return tuple(spec)


def _aligned(out: tuple[int, ...], spec: Spec, shape: tuple[int, ...]) -> Spec:
    """The input's axes carried to the output's dimensions matched in order by size."""
    result = list(_none(out))
    d = 0
    for o, size in enumerate(out):
        match = next((i for i in range(d, len(shape)) if shape[i] == size), None)
        if match is not None:  # an output dimension no input dimension matches (a new 1) stays whole
            result[o] = spec[match]
            d = match + 1
    return tuple(result)


def _reshape(spec: Spec, shape: tuple[int, ...], out: tuple[int, ...]) -> Spec:
    """Axes carried to the output dimension (not a new 1) that starts where the input dimension starts.

    A split dimension reshaped into several keeps its axes on the first of them, however many
    pieces that one holds: splitting 8 query heads 4 ways, then reshaping them into 2 key/value
    heads × 4 (grouped-query attention), splits the 2 fully and the 4 in two on each device, whose
    bytes are the whole's ÷ 4 (measured on Gemma's attention scores: the walk had kept them whole
    over `model`, 3.4x XLA:TPU's peak).
    """
    starts_out: dict[int, int] = {}
    position = 1
    for d, size in enumerate(out):
        if size != 1:
            starts_out.setdefault(position, d)
        position *= size
    result = list(_none(out))
    position = 1
    for d, size in enumerate(shape):
        if spec[d] and position in starts_out:
            result[starts_out[position]] = spec[d]
        position *= size
    return tuple(result)
