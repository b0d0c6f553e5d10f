"""What XLA fuses into its readers instead of writing out: the values of a traced step that are not buffers.

The peak walk (`_liveness.transient_peak`) counts a value as a buffer unless one of these
rules fuses it. `fused` fuses a cast, broadcast or reshape into element-wise and
reduction readers, any other element-wise result into its one reader, and a function of the
weights alone into the projections that read it. XLA:CPU (`cpu_fusion`) also computes a large
float reduction in a library kernel (YNNPACK) that fuses its operand's element-wise chain but
reads that chain's other operands, and the operands it broadcasts, as buffers; a cheap result
it reads so is recomputed in its other readers when all of them can fuse it (its inputs then
live to its last reader). XLA:TPU (`fused_on_tpu`, `laid_out`) also computes element-wise operands
inside matmuls, duplicates cheap ones into every reader, and writes a result read only by a
transpose in the transposed layout. Each rule is measured against the compiler's buffer
assignment (`XLA_FLAGS=--xla_dump_to=DIR`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence

from ._propagate import REDUCTIONS, itemsize
from ._trace import Node, Trace

__all__ = ["ELEMENTWISE", "CpuFusion", "cpu_fusion", "fused", "fused_on_tpu", "laid_out"]


#: Operations XLA fuses into their readers: element-wise arithmetic, casts, broadcasts, reshapes.
ELEMENTWISE = frozenset(
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
#: Reductions XLA:CPU hands to its library (YNNPACK) when their operand is large: float sums, maxima, minima.
_LIBRARY_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min"))
#: Elements (per device) from which XLA:CPU computes such a reduction in the library (measured on
#: jax 0.10.2: a sum of 4,095 elements is a loop, of 4,096 a YNNPACK fusion).
_LIBRARY_ELEMENTS = 4096
#: Operand producers that keep a reduction out of the library (the sum of a broadcast is a loop).
_LOOP_REDUCED = frozenset(("broadcast_in_dim",))
#: Element-wise operations the library fuses into a reduction: arithmetic, not layout, casts or selections.
_LIBRARY_ELEMENTWISE = ELEMENTWISE - frozenset(
    """broadcast_in_dim convert_element_type reshape squeeze expand_dims transpose iota copy copy_p select_n
    eq ne lt le gt ge and or not xor clamp is_finite stop_gradient reduce_precision""".split()
)
#: Operations that update their first operand in place: XLA writes the result into that buffer.
_IN_PLACE = frozenset("scatter scatter-add scatter-mul scatter-min scatter-max dynamic_update_slice".split())


def _elementwise_reads(trace: Trace) -> Iterator[tuple[Node, int, tuple[int, ...], list[str]]]:
    """Each element-wise result that is read and is not a step output: `(node, value, readers, primitives)`.

    `readers` are the indices of the nodes that read `value` (once per read), `primitives` theirs.
    """
    outputs = set(trace.outputs)
    for node in trace.nodes:
        if node.primitive not in ELEMENTWISE:
            continue
        for value in node.outputs:
            readers = tuple(trace.consumers.get(value, ()))
            if value not in outputs and readers:
                yield node, value, readers, [trace.nodes[r].primitive for r in readers]


def _from_weights(trace: Trace) -> set[int]:
    """The variables and the values computed element-wise from them alone (a cast, an int8 kernel × scale)."""
    weights = set(trace.variables)
    for node in trace.nodes:
        if node.primitive in ELEMENTWISE and all(v < 0 or v in weights for v in node.inputs):
            weights.update(node.outputs)
    return weights


def fused(trace: Trace) -> set[int]:
    """Values XLA fuses into their readers instead of writing them out.

    A cast, broadcast or reshape read only by element-wise operations or
    reductions; any other element-wise result read by exactly one of them (XLA
    duplicates only cheap operations into several readers); and an element-wise
    function of the weights alone (a cast, an int8 kernel times its scale) that
    projections read: XLA:CPU computes it inside the projection (measured on
    `model.quantize("int8")` Dense layers: the float kernel is never written out).
    """
    weights = _from_weights(trace)
    found = set()
    for node, value, readers, primitives in _elementwise_reads(trace):
        if all(v < 0 or v in weights for v in node.inputs) and all(
            _fusing(p) or p == "dot_general" for p in primitives
        ):
            found.add(value)  # a weight cast or dequantised where a projection reads it
        elif node.primitive in _CHEAP and _updated_only(trace, value, readers):
            found.add(value)  # the zeros a scatter-add starts from: written into its result
        elif all(_fusing(p) for p in primitives) and (node.primitive in _CHEAP or len(set(readers)) == 1):
            found.add(value)
    return found


def fused_on_tpu(trace: Trace) -> set[int]:
    """Values XLA:TPU fuses where XLA:CPU writes them: into matmuls, and duplicated into readers.

    XLA:TPU fuses an element-wise producer into the `dot_general`s that read it (each
    recomputes it as it loads its operand), and duplicates a cheap element-wise result
    (`_EXPENSIVE` excluded) into every element-wise, reduction or matmul reader. Measured on a
    Llama-3-style block (v5e 2x4, libtpu 0.0.42.1): the softmax's probabilities (read by the
    two backward matmuls) and the normalised hidden states (read by the projections) are not
    buffers; the attention mask is kept before its broadcast over the heads (4 MiB, where the
    walk counted the broadcast and of the causal and padding masks, 32 MiB).
    """
    found = set()
    for node, value, _, primitives in _elementwise_reads(trace):
        into_matmuls = all(p == "dot_general" for p in primitives)
        readable = all(_fusing(p) or p == "dot_general" for p in primitives)
        duplicated = node.primitive not in _EXPENSIVE and readable
        if into_matmuls or duplicated:
            found.add(value)
    return found


def laid_out(trace: Trace) -> set[int]:
    """Values XLA:TPU writes in their one reader's layout: a result read only by a transpose.

    XLA:TPU's layout assignment turns such a transpose into a change of layout of its operand
    (measured: a weight's gradient, `dot_general` then `transpose`, is written once, not twice).
    """
    outputs = set(trace.outputs)
    found = set()
    for node in trace.nodes:
        for value in node.outputs:
            readers = set(trace.consumers.get(value, ()))
            if value not in outputs and len(readers) == 1:
                if trace.nodes[next(iter(readers))].primitive == "transpose":
                    found.add(value)
    return found


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


def _fusing(primitive: str) -> bool:
    return primitive in ELEMENTWISE or primitive in REDUCTIONS


@dataclasses.dataclass(frozen=True)
class CpuFusion:
    """What XLA:CPU fuses in one traced step, under one set of layouts (`cpu_fusion`).

    Attributes:
        recomputed: Per element-wise value, the nodes reading it that compute it again from its
            inputs (a fused value's every reader; a duplicated one's element-wise readers).
        written: The values among those still written out, as a buffer for their other readers.
        broadcasts: The buffers of operands broadcast for a library reduction, each as
            `(node writing it, the reduction's node, the value whose shape it takes)`.
    """

    recomputed: Mapping[int, frozenset[int]]
    written: frozenset[int]
    broadcasts: tuple[tuple[int, int, int], ...]

    @property
    def fused(self) -> frozenset[int]:
        """The values never written out: every reader computes them."""
        return frozenset(self.recomputed) - self.written


def cpu_fusion(trace: Trace, sizes: Mapping[int, int]) -> CpuFusion:
    """What XLA:CPU fuses in `trace`, each value's bytes per device being `sizes[value]`.

    As `fused`, and two rules measured on a convnet whose channels are split over 'model'
    (2x4, XLA:CPU's buffer assignment): a cheap element-wise result read by a library reduction's
    chain and by other operations that can all fuse it (`_duplicated`) is written for the chain
    and recomputed in the others: the bias add after a convolution is written for the pooling's
    sum and recomputed in the backward pass from the convolution's output, which stays live until
    then. And a large float reduction (`_library_reductions`) fuses the element-wise
    chain read by it alone, but reads every other operand of that chain as a buffer, and the
    operands it broadcasts (the relu's zeros at the feature map's shape).
    """
    reductions, chains, broadcasts = _library_reductions(trace, sizes)
    library = reductions | {trace.producer[value] for value in chains}
    base = fused(trace)
    recomputed: dict[int, frozenset[int]] = {}
    written = set()
    for node, value, readers, primitives in _elementwise_reads(trace):
        if value in chains or (value in base and library.isdisjoint(readers)):
            recomputed[value] = frozenset(readers)
        elif _duplicated(node, readers, primitives, reductions):
            fusing = set(readers) - library  # a library chain reads it as a buffer
            if fusing and fusing != set(readers):
                recomputed[value] = frozenset(fusing)
                written.add(value)
    return CpuFusion(recomputed, frozenset(written), broadcasts)


def _duplicated(node: Node, readers: Sequence[int], primitives: Sequence[str], reductions: set[int]) -> bool:
    """Whether XLA:CPU may recompute `node`'s result in each of its several `readers`.

    A cheap result (not `_EXPENSIVE`) may, when every reader can fuse it: an element-wise
    operation, or a reduction XLA:CPU computes in a loop (not one of the library's `reductions`).
    Read by a matmul, a convolution or a library reduction as well, it is written once and read
    by all (keras' layer normalisation: the residual sum its mean reads is a buffer). `cpu_fusion`
    applies it where a library reduction's chain reads the result (written for it anyway); applied
    to every such result it put keras-hub Gemma's and Qwen's budget plans past their budgets
    (the walk 0.93x their compiled peaks), so elsewhere the result stays a buffer.
    """
    return (
        node.primitive not in _EXPENSIVE
        and len(set(readers)) > 1
        and all(_fusing(p) for p in primitives)
        and reductions.isdisjoint(readers)
    )


def _library_reductions(
    trace: Trace, sizes: Mapping[int, int]
) -> tuple[set[int], dict[int, int], tuple[tuple[int, int, int], ...]]:
    """XLA:CPU's library reductions: `(nodes, {value fused into one: its node}, broadcasts)`.

    A float32 `reduce_sum`, `reduce_max` or `reduce_min` of at least `_LIBRARY_ELEMENTS` elements
    per device, whose operand is not a broadcast (`_LOOP_REDUCED`), is computed by YNNPACK. It
    fuses the element-wise arithmetic (`_LIBRARY_ELEMENTWISE`) its operand is computed by, through
    values it alone reads; any other value that chain reads is a buffer. An operand smaller than
    the value it meets is broadcast to that value's shape, a buffer read by the reduction: a
    per-token scale or a bias from where it is computed (measured on a Keras layer normalisation:
    XLA:CPU writes the broadcast inverse deviation in the forward pass, for the sum of its
    scale's gradient), a literal (a relu's zeros) where the reduction runs. `broadcasts` holds
    `(written at, read at, value of that shape)`.
    """
    reductions = {node.index for node in trace.nodes if _in_library(trace, node, sizes)}
    chains: dict[int, int] = {}
    broadcasts: list[tuple[int, int, int]] = []
    for index in sorted(reductions):
        pending = [trace.nodes[index].inputs[0]]
        while pending:
            value = pending.pop()
            if value in chains or not _grows(trace, value):
                continue
            chains[value] = index
            size = math.prod(trace.shapes[value])
            for operand in trace.nodes[trace.producer[value]].inputs:
                if operand < 0:  # a literal: broadcast where the reduction runs
                    broadcasts.append((index, index, value))
                elif math.prod(trace.shapes[operand]) < size:  # broadcast once computed
                    broadcasts.append((trace.producer.get(operand, 0), index, value))
                else:
                    pending.append(operand)
    return reductions, chains, tuple(broadcasts)


def _in_library(trace: Trace, node: Node, sizes: Mapping[int, int]) -> bool:
    """Whether XLA:CPU computes the reduction `node` in its library (`_library_reductions`)."""
    operand = node.inputs[0] if node.inputs else -1
    if node.primitive not in _LIBRARY_REDUCTIONS or operand < 0:
        return False
    if {trace.dtypes[operand], trace.dtypes[node.outputs[0]]} != {"float32"}:
        return False
    producer = trace.producer.get(operand)
    loop = producer is not None and trace.nodes[producer].primitive in _LOOP_REDUCED
    return not loop and sizes[operand] // itemsize("float32") >= _LIBRARY_ELEMENTS


def _grows(trace: Trace, value: int) -> bool:
    """Whether a library reduction's chain fuses `value`: library arithmetic, read by the chain alone."""
    writer = trace.producer.get(value)
    if writer is None or value in trace.outputs or trace.nodes[writer].primitive not in _LIBRARY_ELEMENTWISE:
        return False
    return len(set(trace.consumers.get(value, ()))) == 1
