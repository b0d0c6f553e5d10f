"""What the peak walk holds at its peak: the largest buffers live then, each named after the JAX operation
that writes it.

`_liveness.transient_peak` finds the node where the most bytes are live and `buffers_at` lists the
buffers live there (`PeakBuffer`), largest first: the answer to "what fills my memory?" before any
compile (`rules.cost.peak_buffers`, `PeakMemory.buffers`, `keras-meshlayout plan --batch-size ...`,
and the three largest in `MemoryBudgetError`'s message: `filled_by`). The names
are JAX's name stacks (`_trace.Node.name`), as XLA's `op_name` metadata has them, so the same buffers
can be found in XLA's own dumps (CONTRIBUTING.md, "Reading a peak miss buffer by buffer").
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from ..core._format import format_bytes
from ._trace import Trace

__all__ = ["AT_PEAK", "PeakBuffer", "buffers_at", "filled_by", "operation_of"]

#: How many buffers `buffers_at` lists.
AT_PEAK = 8

#: What an operation outside every layer's name scope is called: Keras's `train_step` computes the loss
#: there.
OUTSIDE = "outside the layers (the loss)"
#: JAX's wrappers of a name stack in a traced training step: `jvp(...)` (the forward pass, its
#: tangents kept for the backward one) and `transpose(jvp(...))` (the backward pass).
_WRAPPED = re.compile(r"(?:transpose\()?jvp\(([^()]*)\)\)?")


class PeakBuffer(NamedTuple):
    """One buffer live at the step's predicted peak.

    Attributes:
        operation: The JAX operation that writes it: its layer path and primitive, with `(backward)`
            for the backward pass (`"gemma_backbone/decoder_block_0/attention/softmax: exp"`).
        shape: Its global shape.
        dtype: Its dtype, as the walk holds it.
        bytes: Its bytes on each device.
    """

    operation: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int

    def __str__(self) -> str:
        return f"{format_bytes(self.bytes)}  {self.operation}  {self.dtype}{list(self.shape)}"

    def to_dict(self) -> dict[str, object]:
        """The buffer as `plan --json` gives it under `"memory"` → `"peak_buffers"`."""
        return {"operation": self.operation, "shape": [*self.shape], "dtype": self.dtype, "bytes": self.bytes}


def operation_of(name: str, primitive: str) -> str:
    """`name` (a JAX name stack) without JAX's differentiation wrappers, with `primitive` and the pass.

    >>> operation_of("transpose(jvp(gemma_backbone))/decoder_block_1/attention", "dot_general")
    'gemma_backbone/decoder_block_1/attention: dot_general (backward)'
    >>> operation_of("jvp(mlp)/up", "dot_general"), operation_of("transpose(jvp())", "mul")
    ('mlp/up: dot_general', 'outside the layers (the loss): mul (backward)')
    """
    suffix = " (backward)" if name.startswith("transpose(") else ""
    path = _WRAPPED.sub(r"\1", name) or OUTSIDE
    return f"{path}: {primitive}{suffix}"


def buffers_at(
    trace: Trace,
    when: int,
    buffers: Iterable[int],
    sizes: Mapping[int, int],
    written: Mapping[int, int],
    last: Mapping[int, int],
    count: int = AT_PEAK,
    also: Iterable[tuple[int, int, PeakBuffer]] = (),
) -> tuple[PeakBuffer, ...]:
    """The `count` largest of `buffers` (value ids, each written at `written[value]` and read last at
    `last[value]`) live at node `when` of `trace`, as `PeakBuffer`s of `sizes[value]` bytes a device,
    with those of `also` (`(first node, last node, buffer)`: what XLA holds beyond the traced values)
    live there."""
    live = [v for v in buffers if written[v] <= when <= last.get(v, written[v]) and sizes[v] > 0]
    found = []
    for value in live:
        producer = trace.producer.get(value)  # not `written[value]`: a buffer may be written early
        node = None if producer is None else trace.nodes[producer]
        operation = "input" if node is None else operation_of(node.name, node.primitive)
        shape, dtype = tuple(trace.shapes[value]), str(trace.dtypes[value])
        found.append((written[value], PeakBuffer(operation, shape, dtype, int(sizes[value]))))
    found += [(first, buffer) for first, final, buffer in also if first <= when <= final]
    found.sort(key=lambda entry: (-entry[1].bytes, entry[0]))
    return tuple(buffer for _, buffer in found[:count])


def filled_by(buffers: Sequence[PeakBuffer], count: int = 3) -> str:
    """The largest `count` of `buffers` in a sentence for an error message, or `""` with none.

    >>> filled_by([PeakBuffer("lm/head: dot_general", (8, 128, 32000), "float32", 2**20)])
    ' Largest at that peak: 1.0 MiB from lm/head: dot_general (float32[8, 128, 32000]).'
    """
    if not buffers:
        return ""
    said = ", ".join(
        f"{format_bytes(b.bytes)} from {b.operation} ({b.dtype}{list(b.shape)})" for b in buffers[:count]
    )
    return f" Largest at that peak: {said}."
