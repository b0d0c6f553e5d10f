"""The gradients in the peak walk (`_liveness`): which XLA never writes, which it sums, at what size.

A weight the step does not read has zeros for its gradient, which XLA neither writes nor sums;
a table whose looked-up rows move (`_tables_2d`) has each device sum its rows' gradient in its
own shard; every other gradient is summed over the batch axis in XLA:CPU's one combined
all-reduce, a batch-split weight's written whole until then (`summed_whole`).
"""

from __future__ import annotations

import math

from ._propagate import Specs, itemsize
from ._trace import Trace

__all__ = ["summed_whole", "walked_gradients", "zero_gradients"]


def walked_gradients(
    trace: Trace, specs: Specs, sizes: dict[int, int], held: bool, rows_moved: frozenset[str]
) -> tuple[set[int], set[int]]:
    """`(zeros, summed)`: the gradients XLA never writes (`zero_gradients`), and those it sums over the
    batch axis: all others but the `rows_moved` tables'. On XLA:CPU (`held`) the summed gradients of
    batch-split weights take their whole bytes in `sizes` (`summed_whole`)."""
    zeros = zero_gradients(trace)
    paths = dict(zip(trace.outputs, (trace.variables[v] for v in sorted(trace.variables)), strict=False))
    summed = {v for v in trace.outputs if v >= 0 and v not in zeros and paths.get(v) not in rows_moved}
    if held and specs.sizes.get(specs.batch_axis or "", 1) > 1:
        sizes.update(summed_whole(trace, specs, specs.batch_axis, summed))
        _summed_at_the_end(trace, specs, summed)
    return zeros, summed


def _summed_at_the_end(trace: Trace, specs: Specs, summed: set[int]) -> None:
    """Drops the partial-sum buffer of each product of a `summed` gradient summed over the batch axis alone.

    XLA:CPU sums such a product (a weight's gradient, contracted over the batch's rows) in the
    combined all-reduce at the end of the backward pass, into the second copy `transient_peak`
    counts there, not at the product. Measured (jax 0.10.2) on keras-hub RWKV-7 on 2×4: the walk's
    peak was at its output head's gradient, the product (64 KiB a device) counted twice.
    """
    stack, seen = list(summed), set()
    while stack:
        value = stack.pop()
        if value in seen or value not in trace.producer:
            continue
        seen.add(value)
        node = trace.nodes[trace.producer[value]]
        if node.primitive == "dot_general":
            if _summed_axes(node, specs) == {specs.batch_axis}:
                specs.partial_sums.pop(node.index, None)
        elif node.primitive in _PASSED:
            stack.extend(v for v in node.inputs if v >= 0)


#: What a product reaches a gradient through: its layout changes and the sum of a weight's uses.
_PASSED = frozenset(("transpose", "reshape", "convert_element_type", "add", "add_any"))


def _summed_axes(node, specs: Specs) -> set[str]:
    """The mesh axes a `dot_general`'s contraction is split over in both operands (summed across)."""
    (left, right), _ = node.params["dimension_numbers"]
    ins = [specs.spec.get(v, ()) for v in node.inputs[:2]]
    if any(len(spec) == 0 for spec in ins):
        return set()
    return {axis for a, b in zip(left, right, strict=True) for axis in set(ins[0][a]) & set(ins[1][b])}


def zero_gradients(trace: Trace) -> set[int]:
    """The gradients of weights the step does not read: zeros broadcast from a literal, which XLA
    never writes (the update reads the constant) nor sums (an untied output table under a pooled
    head: 64 KiB a device counted twice at the walk's peak on a small keras-hub Llama, 2×4)."""
    zeros = set()
    for value in trace.outputs:
        node = trace.nodes[trace.producer[value]] if value in trace.producer else None
        if node is not None and node.primitive == "broadcast_in_dim" and all(v < 0 for v in node.inputs):
            zeros.add(value)
    return zeros


def summed_whole(trace: Trace, specs: Specs, batch_axis: str | None, summed: set[int]) -> dict[int, int]:
    """The bytes of each gradient of a batch-split weight, whole over the batch axis (XLA:CPU).

    XLA:CPU writes such a gradient whole on each device (the product's partial sum over the
    batch), sums every gradient in the one combined all-reduce at the end of the backward pass
    (the second copy `transient_peak` counts there), and slices each device's shard only then;
    the partial sum is not all-reduced at its product (its `partial_sums` entry is dropped).
    Measured (jax 0.10.2) on Keras's `MultiHeadAttention` over 8 tokens of 64 features, fully
    sharded over `data=8`: its four 32 KiB kernels' gradients and their sums, 256 KiB, live together
    at the all-reduce, where the walk had counted 4 KiB shards (0.605 of the compiled peak).
    Only the `summed` gradients are.
    """
    whole: dict[int, int] = {}
    for value in summed:
        spec = specs.spec.get(value, ())
        if not any(batch_axis in entry for entry in spec):
            continue
        pieces = math.prod(specs.sizes[a] for entry in spec for a in entry if a != batch_axis)
        whole[value] = math.prod(trace.shapes[value]) * itemsize(trace.dtypes[value]) // pieces
        node = trace.nodes[trace.producer[value]]
        while node.primitive in ("transpose", "reshape", "convert_element_type") and node.inputs[0] >= 0:
            if node.inputs[0] not in trace.producer:
                break
            node = trace.nodes[trace.producer[node.inputs[0]]]
        specs.partial_sums.pop(node.index, None)
    return whole
