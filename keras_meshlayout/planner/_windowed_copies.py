"""XLA:TPU's bfloat16 copies of the inputs of projections whose kernel gradient is a windowed einsum.

Where XLA:TPU computes a batch-split kernel's gradient as a windowed einsum over the batch axis
(`_batch_gathers.windowed_on_tpu`), it reads the projection's input in bfloat16 and keeps that
copy from the forward pass to the loop: `windowed_operands` gives the peak walk (`_liveness`)
each copy's life and bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

from ..core._axes import Axes, entry_axes
from ._batch_gathers import windowed_on_tpu
from ._propagate import Specs, itemsize
from ._trace import Node, Trace

__all__ = ["windowed_operands"]


def windowed_operands(
    trace: Trace, specs: Specs, layouts: Mapping[str, Axes], batch_axis: str | None, buffers: set[int]
) -> Iterator[tuple[int, int, int]]:
    """`(first, last node, bytes)` of the bfloat16 copies XLA:TPU keeps of windowed projections' inputs.

    Where XLA:TPU computes a batch-split kernel's gradient as a windowed einsum over the batch axis
    (`_batch_gathers.windowed_on_tpu`), the loop reads the projection's input in bfloat16, whole
    on its last (contracted) dimension: XLA writes that copy once, where the input is computed in
    the forward pass, and keeps it to the loop, beside the input's own buffer, if any. Measured on
    the Mixtral 8×7 B row of `benchmarks/targets.py` (v5e `data=32, model=8`, fully sharded, 16,384
    tokens a chip): the attention norm's output (`bf16[8,2048,4096]`, read by the query, key and
    value kernels, itself fused into them), the expert block's input (`bf16[16384,4096]`, beside its
    float32 buffer) and the SwiGLU's output (`bf16[1,16384,14336]`), one copy each per layer. The
    input is the kernel gradient's operand computed first (the other is the output's cotangent);
    one copy per input, none for an input already a bfloat16 buffer.
    """
    batch_devices = specs.sizes.get(batch_axis or "", 1)
    paths = list(trace.variables.values())
    seen: set[int] = set()
    for index, gradient in enumerate(trace.outputs):
        split = any(batch_axis in entry_axes(e) for e in layouts.get(paths[index], ()))
        if gradient < 0 or not split:
            continue
        for node in _products_of(trace, gradient):
            operands = sorted((v for v in node.inputs if v >= 0), key=lambda v: trace.producer.get(v, -1))
            value = operands[0]
            size = itemsize(trace.dtypes[value])
            rows = math.prod(trace.shapes[value][:-1])  # contracted over its last dimension
            if value in seen or (size <= 2 and value in buffers):
                continue
            if not windowed_on_tpu("tpu", batch_devices, rows):
                continue
            seen.add(value)
            spec = specs.spec.get(value, ())
            whole = math.prod(specs.sizes[a] for a in spec[-1]) if spec else 1
            yield trace.producer.get(value, 0), node.index, specs.bytes(value) * whole * 2 // max(size, 2)


#: Operations between a kernel gradient's matmuls and the gradient the step returns.
_GRADIENT_PLUMBING = frozenset("transpose reshape convert_element_type add_any squeeze expand_dims".split())


def _products_of(trace: Trace, gradient: int) -> list[Node]:
    """The `dot_general` nodes whose results make up `gradient`, through transposes, casts and sums."""
    found, pending, seen = [], [gradient], set()
    while pending:
        value = pending.pop()
        if value in seen or value not in trace.producer:
            continue
        seen.add(value)
        node = trace.nodes[trace.producer[value]]
        if node.primitive == "dot_general":
            found.append(node)
        elif node.primitive in _GRADIENT_PLUMBING:
            pending.extend(v for v in node.inputs if v >= 0)
    return found
