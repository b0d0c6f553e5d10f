"""How a quantized weight reaches the projection that reads it: the steps `Trace.weight_of` walks back.

float8 (`quantize("float8")`): a kernel divided by its scale, clipped to float8's range, cast
to float8 and back and multiplied by its scale, element-wise operations with scalars.

int4: Keras (`quantize("int4")`) stores a kernel packed, two columns a byte, and in each call
unpacks its two nibbles (bitwise operations with literals), stacks and reshapes them into
the columns, slices off padding, subtracts each column's zero point and multiplies by its
scale (looked up by each row's group, `g_idx`, or broadcast), and reshapes the result to
the float kernel's shape. The projection reads that kernel: each step maps the value's
dimensions to those of the operand it came from, so that a dimension of the float kernel
is known as the stored dimension it was merged into.

With LoRA (`enable_lora(rank)`), a float layer computes with `kernel + (alpha / rank) · a @ b`,
one merged kernel; a quantized one (int8, int4) adds `(alpha / rank) · x · a · b` to its
output instead, so its adapters are projections of their own (`merges_lora`).
"""

from __future__ import annotations

import math
from typing import Any

from .. import _compat

__all__ = ["lora_layers", "lora_parts", "merges_lora", "scaled_input", "unpacked"]

#: Element-wise operations that scale or clip a weight by scalars (float8's quantize-dequantize).
_SCALED = ("mul", "div", "max", "min", "clamp", "round")
#: Bitwise operations on a kernel's nibbles (with literals), and the arithmetic dequantizing it.
_NIBBLES = ("and", "or", "xor", "not", "shift_right_arithmetic", "shift_right_logical", "shift_left", "sub")
_DEQUANTIZING = ("sub", "mul", "div")
_PASS = ("convert_element_type", "copy", "copy_p", "reduce_precision")


def lora_layers(model: Any) -> list[Any]:
    """The layers of `model` with LoRA adapters (`layer.enable_lora(rank)`), on or off."""
    return [layer for layer in _compat.sublayers(model) if getattr(layer, "lora_kernel_a", None) is not None]


def lora_parts(layer: Any) -> tuple[Any, Any, Any] | None:
    """`(base kernel, a, b)` of a LoRA layer (`layer.enable_lora(rank)`), or `None`.

    `a` has the kernel's shape (an int4 one's float shape) with its last dimension replaced by the
    rank, `b` is `(rank, its last one)`: merged (`kernel + (alpha / rank) · a @ b`) or added to the
    output (`merges_lora`), `x · a · b` comes out as `x · kernel` does.
    """
    a, b = getattr(layer, "lora_kernel_a", None), getattr(layer, "lora_kernel_b", None)
    base = next((v for v in _compat.own_variables(layer) if v.path.endswith("/kernel")), None)
    if a is None or b is None or base is None or len(b.shape) != 2:
        return None
    shape = getattr(layer, "original_kernel_shape", None) or (*base.shape[:-1], getattr(layer, "units", 0))
    shape = shape if getattr(layer, "quantization_mode", None) == "int4" else base.shape
    if tuple(a.shape[:-1]) != tuple(shape[:-1]) or b.shape[1] != shape[-1]:
        return None
    return base, a, b


def merges_lora(layer: Any) -> bool:
    """Whether a LoRA layer merges its adapters into its kernel (a float one) rather than adding `x·a·b`."""
    return getattr(layer, "quantization_mode", None) is None


def scaled_input(trace: Any, op: Any) -> int | None:
    """The one array `op` scales or clips by scalars (float8's quantize-dequantize), else `None`."""
    arrays = [v for v in op.inputs if v >= 0 and trace.shapes[v]]
    return arrays[0] if op.primitive in _SCALED and len(arrays) == 1 else None


def unpacked(trace: Any, op: Any, value: int) -> tuple[int, list[int | None]] | None:
    """One step back from `value`, written by `op`: `(the operand followed, value's dimensions → its)`.

    `None` where `op` is not a step of a float8 kernel's scaling or an int4 one's unpacking.
    """
    name, shape = op.primitive, trace.shapes[value]
    arrays = [v for v in op.inputs if v >= 0 and trace.shapes[v]]
    if scaled_input(trace, op) is not None:
        return arrays[0], list(range(len(shape)))
    if name in _NIBBLES or name in _DEQUANTIZING:
        followed = [v for v in arrays if trace.shapes[v] == shape and _packed_int(trace, v)]
        if len(followed) != 1 or not all(v in followed or _quantization(trace, v) for v in arrays):
            return None
        return followed[0], list(range(len(shape)))
    if not op.inputs or not _packed_int(trace, op.inputs[0]):
        return None
    if name == "stack":
        axis = int(op.params["axis"])
        return op.inputs[0], [None if d == axis else d - (d > axis) for d in range(len(shape))]
    if name == "reshape":
        return op.inputs[0], _merged_dims(trace.shapes[op.inputs[0]], shape)
    if name == "slice":
        return op.inputs[0], list(range(len(shape)))
    return None


def _packed_int(trace: Any, value: int) -> bool:
    """Whether `value` is computed from one int8 variable alone (its nibbles, unpacked or dequantized)."""
    for _ in range(64):
        if value in trace.variables:
            return trace.dtypes[value] == "int8"
        node = trace.producer.get(value)
        if node is None:
            return False
        op = trace.nodes[node]
        arrays = [v for v in op.inputs if v >= 0 and trace.shapes[v]]
        if not arrays or op.primitive in ("gather", "broadcast_in_dim"):
            return False  # a look-up of zero points or scales, not the kernel
        value = arrays[0]
    return False


def _quantization(trace: Any, value: int) -> bool:
    """Whether `value` is a kernel's scales or zero points, looked up or broadcast from their variable."""
    while value not in trace.variables:
        node = trace.producer.get(value)
        if node is None:
            return False
        op = trace.nodes[node]
        if op.primitive not in (*_PASS, "broadcast_in_dim", "reshape", "transpose", "gather"):
            return False
        value = op.inputs[0]
    return True


def _merged_dims(before: tuple[int, ...], after: tuple[int, ...]) -> list[int | None]:
    """Per dimension of `after` (a row-major reshape of `before`), the dimension of `before` holding it.

    A dimension of `after` starting one of `before` merges it with the next (an int4 kernel's
    nibbles into its columns); one starting inside is part of it, if it ends there too. `None`
    where it starts inside one and ends in another: Gemma's `(heads, hidden, head_dim)` kernel
    is stored as `(hidden, heads × head_dim)` elements, its heads in the stored rows, its
    head_dim in the columns, its hidden dimension in both (`_layers.Packing`).
    """
    found: list[int | None] = []
    for index in range(len(after)):
        low = math.prod(after[:index])
        high = low * after[index]
        inside = [d for d in range(len(before)) if math.prod(before[:d]) <= low < math.prod(before[: d + 1])]
        whole = inside and (
            low == math.prod(before[: inside[0]]) or high <= math.prod(before[: inside[0] + 1])
        )
        found.append(inside[0] if whole and after[index] != 1 else None)
    return found
