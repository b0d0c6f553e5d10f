"""Max pooling's gradient as XLA:CPU compiles it: the window's argmax found in the forward pass.

JAX differentiates `reduce_window_max` into a `select_and_scatter_add` in the backward pass, which
reads the pooling's input again to find each window's maximum. XLA:CPU expands it
(`select-and-scatter` into a `reduce-window` of value and position, then a `scatter`) and runs that
`reduce-window` with the forward pooling (one operation, the same operand and window), so:

- the pooling's input is not read in the backward pass: it dies with its forward readers;
- the `reduce-window` reads one int32 position array per dimension of the input, as large as the
  input (iotas and a broadcast, materialised before the first convolution), and writes the
  maximum's position in each window, one int32 per dimension of the pooled output, which lives
  from the forward pooling to the backward `scatter`;
- the `scatter` adds the cotangent into zeros the size of the input, allocated with those
  positions before the forward pass and written in place.

Read off XLA:CPU's buffer assignment (jax 0.10.2) on four 3 × 3 convolutions with a 2 × 2 max
pooling between them (8 images of 32 × 32, data-parallel on 8 devices): the three iotas and the
broadcast (`s32[1,32,32,32]` each) from instruction 42 to the `reduce-window` at 66, its positions
concatenated (`s32[...,4]`) to the `scatter` at 103, the zeros from 46 to 103; the pooling's input
(`add_maximum_fusion`) from 64 to 66. keras.applications ResNet50 at 224 × 224 keeps the same
positions of its one max pooling (`s32[1605632,4]`, docs/status.md). XLA:TPU pools on its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from ._at_peak import PeakBuffer, operation_of
from ._propagate import Specs, itemsize
from ._trace import Node, Trace

__all__ = ["PoolGradient", "pool_gradients"]

#: The bytes of one position (XLA's `s32`).
_POSITION = 4
#: The window's parameters that tell a pooling's gradient which forward pooling it belongs to.
_WINDOW = ("window_dimensions", "window_strides", "padding")


class PoolGradient(NamedTuple):
    """One max pooling's gradient, as XLA:CPU holds it.

    Attributes:
        backward: The node of the `select_and_scatter_add`.
        operand: The pooling's input, which `backward` does not read.
        held: `(first node, last node, buffer)` of what XLA:CPU holds for it beyond the traced
            values: the position arrays the forward pooling reads (one per input dimension, each
            as large as the input), from the step's start to the forward pooling, and the maxima's
            positions, from there to `backward`.
    """

    backward: int
    operand: int
    held: tuple[tuple[int, int, PeakBuffer], ...]


def pool_gradients(trace: Trace, specs: Specs) -> Iterator[PoolGradient]:
    """Each `select_and_scatter_add` of `trace` whose forward `reduce_window_max` is found."""
    for node in trace.nodes:
        if node.primitive != "select_and_scatter_add" or len(node.inputs) < 2:
            continue
        operand = node.inputs[1]
        forward = next((f for f in _readers(trace, operand) if _window(f) == _window(node)), None)
        if forward is None:
            continue
        pooled = forward.outputs[0]
        rank = len(trace.shapes[operand])
        operation = operation_of(forward.name, forward.primitive)
        positions = PeakBuffer(
            f"{operation} (the windows' positions)",
            (rank, *trace.shapes[operand]),
            "int32",
            rank * _as_positions(trace, specs, operand),
        )
        argmax = PeakBuffer(
            f"{operation} (the maxima's positions)",
            (*trace.shapes[pooled], rank),
            "int32",
            rank * _as_positions(trace, specs, pooled),
        )
        held = ((0, forward.index, positions), (forward.index, node.index, argmax))
        yield PoolGradient(node.index, operand, held)


def _readers(trace: Trace, value: int) -> Iterator[Node]:
    for index in trace.consumers.get(value, ()):
        if trace.nodes[index].primitive == "reduce_window_max":
            yield trace.nodes[index]


def _window(node: Node) -> tuple:
    return tuple(node.params.get(key) for key in _WINDOW)


def _as_positions(trace: Trace, specs: Specs, value: int) -> int:
    """Per-device bytes of an int32 array shaped and split as `value` (XLA:CPU writes half precision
    in four bytes, `Specs.bytes`)."""
    return specs.bytes(value) * _POSITION // max(itemsize(trace.dtypes[value]), _POSITION)
