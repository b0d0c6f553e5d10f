"""What XLA fuses into its readers instead of writing out: the values of a traced step that are not buffers.

The peak walk (`_liveness.transient_peak`) counts a value as a buffer unless one of these
rules fuses it. XLA:CPU (`fused`) fuses a cast, broadcast or reshape into element-wise and
reduction readers, any other element-wise result into its one reader, and a function of the
weights alone into the projections that read it. XLA:TPU (`fused_on_tpu`, `laid_out`) also
computes element-wise operands inside matmuls, duplicates cheap ones into every reader, and
writes a result read only by a transpose in the transposed layout. Each rule is measured
against the compiler's buffer assignment (`XLA_FLAGS=--xla_dump_to=DIR`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from ._propagate import REDUCTIONS
from ._scan import is_zeros
from ._trace import LITERALS, Node, Trace

__all__ = [
    "ELEMENTWISE",
    "EXPENSIVE",
    "fused",
    "fused_on_tpu",
    "laid_out",
    "laid_out_gradients",
    "shared_constants",
]


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
EXPENSIVE = frozenset(
    """atan2 cbrt cos cosh div erf erf_inv erfc exp exp2 expm1 lgamma log log1p logistic pow rem rsqrt
    sin sinh sqrt tan tanh""".split()
)
#: The operations XLA:TPU computes an element-wise operand inside of (`fused_on_tpu`).
_MATMULS = frozenset(("dot_general", "conv_general_dilated"))
#: Non-element-wise operations XLA:CPU fuses into an element-wise reader when they read weights alone.
_OF_WEIGHTS = frozenset(("gather", "stack", "concatenate", "slice"))
#: Operations that only spread an operand over a larger shape.
_BROADCASTS = frozenset(("broadcast_in_dim", "iota"))
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
    """The variables and the values computed element-wise from them alone (a cast, an int8 kernel × scale),
    or gathered, stacked or sliced from them alone (an int4 kernel's nibbles, its scales by group)."""
    weights = set(trace.variables)
    for node in trace.nodes:
        if (node.primitive in ELEMENTWISE or node.primitive in _OF_WEIGHTS) and all(
            v < 0 or v in weights for v in node.inputs
        ):
            weights.update(node.outputs)
    return weights


def _weights_rearranged(trace: Trace, weights: set[int], found: set[int]) -> set[int]:
    """Look-ups, stacks and slices of the weights alone that XLA:CPU computes inside their element-wise
    readers: an int4 kernel's nibbles stacked into columns, its scales and zero points looked up by
    each row's group, all in the one fusion that writes the dequantized kernel (measured on a
    `quantize("int4")` Dense MLP on 2×4: the walk had written a whole (64, 256) float32 scale map)."""
    fused_here = set()
    for node in trace.nodes:
        if node.primitive not in _OF_WEIGHTS or not all(v < 0 or v in weights for v in node.inputs):
            continue
        for value in node.outputs:
            readers = [trace.nodes[r].primitive for r in trace.consumers.get(value, ())]
            if readers and all(_fusing(p) for p in readers) and value not in trace.outputs:
                fused_here.add(value)
    return fused_here - found


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
    written = _written_dequantised(trace, weights)
    found = set()
    for node, value, readers, primitives in _elementwise_reads(trace):
        if value in written:
            continue  # a dequantised kernel XLA:CPU writes out for a matmul it cannot fuse it into
        if all(v < 0 or v in weights for v in node.inputs) and all(
            _fusing(p) or p == "dot_general" for p in primitives
        ):
            found.add(value)  # a weight cast or dequantised where a projection reads it
        elif node.primitive in _CHEAP and _updated_only(trace, value, readers):
            found.add(value)  # the zeros a scatter-add starts from: written into its result
        elif all(_fusing(p) for p in primitives) and (node.primitive in _CHEAP or len(set(readers)) == 1):
            found.add(value)
    found |= _weights_rearranged(trace, weights, found)
    return found - _reduced_across_broadcast(trace, found)


def _reduced_across_broadcast(trace: Trace, fused_values: set[int]) -> set[int]:
    """The fused inputs of reductions XLA:CPU writes out: a broadcast in them varies along a reduced dim.

    XLA:CPU's reduction fusions do not broadcast an operand along the dimensions they sum
    over, so the element-wise input of such a reduction is a buffer the reduction reads.
    Measured on a Keras encoder block (2x4): a layer norm's backward sums the cotangent times
    its scale (which varies along the normalised features) over the features, and the pooled
    cotangent broadcast over the tokens is summed over the batch for the bias gradient; each is
    written as a full-size buffer (the walk had fused them: 0.880 of the compiled peak).
    """
    found = set()
    for node in trace.nodes:
        if node.primitive not in REDUCTIONS or not node.inputs or node.inputs[0] not in fused_values:
            continue
        axes = set(node.params.get("axes", ()))
        if _broadcast_along(trace, node.inputs[0], axes, fused_values):
            found.add(node.inputs[0])
    return found


def _broadcast_along(trace: Trace, value: int, axes: set[int], fused_values: set[int]) -> bool:
    """Whether `value`'s fused expression broadcasts an operand that varies along one of `axes`."""
    shape = trace.shapes[value]
    pending, seen = [value], set()
    while pending:
        current = pending.pop()
        if current in seen or current not in trace.producer:
            continue
        seen.add(current)
        node = trace.nodes[trace.producer[current]]
        if node.primitive == "broadcast_in_dim":
            operand = trace.shapes[node.inputs[0]] if node.inputs[0] >= 0 else ()
            dims = node.params["broadcast_dimensions"]
            if any(size > 1 and d in axes for size, d in zip(operand, dims, strict=False)):
                return True
            continue
        if node.primitive not in ELEMENTWISE or trace.shapes[current] != shape:
            continue
        for operand in (v for v in node.inputs if v >= 0):
            small = trace.shapes[operand]
            if len(small) == len(shape) and small != shape:  # broadcast implicitly over its 1s
                if any(small[d] > 1 for d in axes if d < len(small)):
                    return True
            elif operand in fused_values:
                pending.append(operand)
    return False


def _written_dequantised(trace: Trace, weights: set[int]) -> set[int]:
    """The dequantised kernels (functions of the weights that read an integer one) XLA:CPU writes out.

    XLA:CPU computes a dequantised kernel (an int8 kernel times or over its scale) inside the
    matmul that reads it only where that matmul is fused with its readers into one reduction
    (`_reduced_only`): a backward matmul whose input gradient only feeds a bias gradient.
    Any other matmul reads it from a buffer of the float kernel's shard, written just before.
    Measured on `quantize("int8")` Dense layers (MLP 256 -> 1024 -> 1024 -> 256, 8x1): the
    input gradient of the 1024 -> 256 kernel reads a written float32 [1024, 256] (1 MiB, the
    step's largest temporary); that of the 1024 x 1024 kernel, read only by the first layer's
    bias gradient, is one fusion with the int8 kernel and its scale as operands.
    """
    quantised = {v for v in trace.variables if not trace.dtypes[v].startswith(("float", "bfloat"))}
    for node in trace.nodes:
        if any(v in quantised for v in node.inputs) and all(v < 0 or v in weights for v in node.inputs):
            quantised.update(node.outputs)
    reduced: dict[int, bool] = {}
    found = set()
    for node in trace.nodes:
        if node.primitive != "dot_general":
            continue
        if not all(_reduced_only(trace, v, reduced) for v in node.outputs):
            found.update(v for v in node.inputs if v in quantised and v not in trace.variables)
    return found


def _reduced_only(trace: Trace, value: int, memo: dict[int, bool]) -> bool:
    """Whether `value` is read, through element-wise operations alone, only by reductions (not an output)."""
    if value not in memo:
        memo[value] = False  # a cycle cannot happen in a trace; this only stops a revisit
        readers = trace.consumers.get(value, ())
        memo[value] = (
            bool(readers)
            and value not in trace.outputs
            and all(
                trace.nodes[r].primitive in REDUCTIONS
                or (
                    trace.nodes[r].primitive in ELEMENTWISE
                    and all(_reduced_only(trace, out, memo) for out in trace.nodes[r].outputs)
                )
                for r in readers
            )
        )
    return memo[value]


def shared_constants(trace: Trace, fused_values: set[int]) -> list[tuple[int, int, int]]:
    """The broadcast constants XLA:CPU writes out for reductions: `(first read, last read, value)` each.

    XLA merges equal constants broadcast to one shape into one broadcast. Where a reduction's
    fused input (the element-wise values `fused_values` it reads, `_fused_tree`) multiplies by a
    constant that an operation outside it also uses at that shape (a GELU's 0.5 and 1/sqrt(2), in
    its forward pass and again in its backward one), the reduction reads that broadcast from a
    buffer of the shape (`value`'s), alive from the constant's first use. Measured on
    `quantize("int8")` Dense layers (MLP 256 -> 1024 -> 256, 2x4): the first layer's bias gradient
    sums the GELU's backward expression (its kernel is int8: no kernel gradient), and XLA:CPU
    writes the broadcast 0.5 and 0.707 as two f32[16, 256] buffers, from the forward GELU on.
    """
    uses: dict[tuple[float, tuple[int, ...]], list[int]] = {}
    for node in trace.nodes:
        for key in _constants(trace, node):
            uses.setdefault(key, []).append(node.index)
    found: dict[tuple[float, tuple[int, ...]], tuple[int, int, int]] = {}
    for node in trace.nodes:
        if node.primitive not in REDUCTIONS or not node.inputs or node.inputs[0] not in fused_values:
            continue
        tree = _fused_tree(trace, node.inputs[0], fused_values)
        for inner in tree:
            for key in _constants(trace, trace.nodes[inner]):
                if any(use not in tree for use in uses[key]):
                    first, last, _ = found.get(key, (min(uses[key]), node.index, 0))
                    found[key] = (first, max(last, node.index), trace.nodes[inner].outputs[0])
    return list(found.values())


def _constants(trace: Trace, node: Node) -> list[tuple[float, tuple[int, ...]]]:
    """An element-wise node's scalar literal operands, each with the node's output shape."""
    if node.primitive not in ELEMENTWISE or not node.outputs or not trace.shapes[node.outputs[0]]:
        return []
    literals = node.params.get(LITERALS, ())
    return [(value, trace.shapes[node.outputs[0]]) for value in literals if value is not None]


def _fused_tree(trace: Trace, value: int, fused_values: set[int]) -> set[int]:
    """The nodes that compute `value` within one fusion: its producer and those of its fused operands."""
    tree: set[int] = set()
    pending = [value]
    while pending:
        current = pending.pop()
        index = trace.producer.get(current)
        if index is None or index in tree:
            continue
        tree.add(index)
        pending.extend(v for v in trace.nodes[index].inputs if v in fused_values)
    return tree


def fused_on_tpu(trace: Trace) -> set[int]:
    """Values XLA:TPU fuses where XLA:CPU writes them: into matmuls, and duplicated into readers.

    XLA:TPU fuses an element-wise producer into the `dot_general`s that read it (each
    recomputes it as it loads its operand), and duplicates a cheap element-wise result
    (`EXPENSIVE` excluded) into every element-wise, reduction or matmul reader. Measured on a
    Llama-3-style block (v5e 2x4, libtpu 0.0.42.1): the softmax's probabilities (read by the
    two backward matmuls) and the normalised hidden states (read by the projections) are not
    buffers; the attention mask is kept before its broadcast over the heads (4 MiB, where the
    walk counted the broadcast and of the causal and padding masks, 32 MiB). A result read more than
    once is duplicated only where it reads at most one buffer of its size (`_at_most_unary`): a
    residual connection's sum, read by the next norm, the next sum and the backward pass, is written
    (2-layer keras-hub Llama 3 and Gemma, 16 × 1,024 tokens on v5e 2x4: the walk had kept every
    addend alive instead, five more 16 MiB buffers than XLA:TPU's four); a SwiGLU's `gate *
    sigmoid(gate)` reads only the gate, and is recomputed.
    """
    found = set()
    memo: dict[int, frozenset[int]] = {}
    for node, value, readers, primitives in _elementwise_reads(trace):
        into_matmuls = all(p in _MATMULS for p in primitives)
        readable = all(_fusing(p) or p in _MATMULS for p in primitives)
        unary = len(set(readers)) == 1 or _at_most_unary(trace, node, memo)
        duplicated = node.primitive not in EXPENSIVE and unary and readable
        if into_matmuls or duplicated:
            found.add(value)
    return found


def _at_most_unary(trace: Trace, node: Node, memo: dict[int, frozenset[int]]) -> bool:
    """Whether `node` reads at most one buffer of its result's size (a broadcast of something smaller is
    not of its size): through element-wise producers, one value not computed element-wise, or one
    computed element-wise from several such and read more than once (written, as `node`'s would be)."""
    size = math.prod(trace.shapes[node.outputs[0]])
    roots: set[int] = set()
    for value in node.inputs:
        roots |= _roots(trace, value, size, memo)
    return len(roots) <= 1


def _roots(trace: Trace, value: int, size: int, memo: dict[int, frozenset[int]]) -> frozenset[int]:
    if value < 0 or math.prod(trace.shapes[value]) != size or size <= 1:
        return frozenset()
    if value not in memo:
        producer = trace.producer.get(value)
        node = None if producer is None else trace.nodes[producer]
        if node is None or node.primitive not in ELEMENTWISE:
            memo[value] = frozenset((value,))
        elif node.primitive in _BROADCASTS:
            memo[value] = frozenset()
        else:
            roots = frozenset().union(*(_roots(trace, v, size, memo) for v in node.inputs))
            shared = len(set(trace.consumers.get(value, ()))) > 1
            memo[value] = frozenset((value,)) if shared and len(roots) > 1 else roots
    return memo[value]


def laid_out(trace: Trace, unwritten: set[int] = frozenset()) -> set[int]:
    """Values XLA:TPU writes in their one reader's layout: a result read only by a transpose.

    XLA:TPU's layout assignment turns such a transpose into a change of layout of its operand
    (measured: a weight's gradient, `dot_general` then `transpose`, is written once, not twice).
    Where the transpose's own result is not written either (`unwritten`: fused into its readers,
    `fused_on_tpu`), the operand is the one buffer. Measured on keras-hub Mixtral's expert banks
    (hidden 4096, intermediate 14336, one expert a chip over 16,384 tokens, v5e data=32,model=8):
    the gate and up projections' results, einsums written `(experts, intermediate, tokens)` and
    transposed, are kept for the backward pass as four 896 MiB buffers in their own layout
    (`f32[14336,16384]`); the walk, dropping both the products and their transposes, held none
    of them (its peak 0.65 of XLA:TPU's).
    """
    outputs = set(trace.outputs)
    found = set()
    for node in trace.nodes:
        for value in node.outputs:
            readers = set(trace.consumers.get(value, ()))
            if value not in outputs and len(readers) == 1:
                reader = trace.nodes[next(iter(readers))]
                if reader.primitive == "transpose" and not set(reader.outputs) & unwritten:
                    found.add(value)
    return found


def laid_out_gradients(trace: Trace) -> set[int]:
    """Products XLA:CPU writes in their gradient's layout: a `dot_general` read only by the transpose
    that is a weight's gradient (a step output).

    Measured (jax 0.10.2) on keras-hub RWKV-7's untied head on 2×4: its kernel's gradient is one
    buffer (`f32[256,64]`, the product's layout) from its product to the update, where the walk
    held the product and its transpose together at its peak.
    """
    outputs = set(trace.outputs)
    found = set()
    for node in trace.nodes:
        if node.primitive != "dot_general":
            continue
        readers = set(trace.consumers.get(node.outputs[0], ()))
        if len(readers) == 1 and node.outputs[0] not in outputs:
            reader = trace.nodes[next(iter(readers))]
            if reader.primitive == "transpose" and set(reader.outputs) <= outputs:
                found.add(node.outputs[0])
    return found


def stacked_early(trace: Trace) -> dict[int, int]:
    """Each loop's stacked outputs, written from the step's start: XLA:CPU allocates the buffer a
    `scan` writes its steps' outputs into (zeros, then each step's slice) before the first loop runs,
    and the state it carries from zeros (a backward loop's gradient sums) too.

    Measured (jax 0.10.2) on two stacked Keras GRU layers on 2×4: the second layer's nine
    `(6, 8, 32)` output buffers and the backward loops' are live while the first layer's loop
    runs, XLA's peak, where the walk had held none of them until their loops (0.857 of the
    compiled peak); on two LSTM layers the backward loops' `(32, 128)` kernel gradient sums too.
    """
    early = {}
    for node in trace.nodes:
        if node.primitive != "scan":
            continue
        consts, carry = node.params["num_consts"], node.params["num_carry"]
        inits = node.inputs[consts : consts + carry]
        early.update((value, 0) for value in node.outputs[carry:])
        early.update(
            (value, 0) for value, init in zip(node.outputs, inits, strict=False) if is_zeros(trace, init)
        )
    return early


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
