"""Strategy: int8 kernels' scales (`model.quantize("int8")`) split with their kernel.

An int8 `Dense` or `EinsumDense` keeps its kernel as `int8` (not trainable)
and a float32 `kernel_scale` laid out like its output: `(units,)` for a
`Dense`, the output's shape with 1 for every dimension the kernel lacks for
an `EinsumDense` (`(1, 1, heads, head_dim)` for `btd,dnh->btnh`). Every
other strategy plans the int8 kernel as it would a float one; this one gives
the scale the kernel's axis on each output dimension it shares with the
kernel, so each device holds the scales of its own output features and
nothing moves. The scale joins the kernel's unit.

What the step sends beside (`_costs`): a row-parallel int8 projection
quantizes its input per position over the features it sums, which are
split, so their absolute maximum is all-reduced over the model axis forward
(one float32 per position).
"""

from __future__ import annotations

from typing import Any

import keras

from .. import _compat
from ..core._axes import Axes
from . import _notes
from ._ledger import Ledger, Setting

__all__ = ["int8_scales", "scale_axes"]


def scale_axes(layer: Any, kernel_axes: Axes) -> Axes | None:
    """The axes of an int8 layer's `kernel_scale` given its kernel's, or `None` when unreadable."""
    scale = getattr(layer, "kernel_scale", None)
    if scale is None:
        return None
    if isinstance(layer, keras.layers.Dense) and len(scale.shape) == 1 and len(kernel_axes) == 2:
        return (kernel_axes[1],)
    equation = getattr(layer, "equation", None)
    if not equation or "->" not in equation or "," not in equation:
        return None
    kernel, output = equation.split(",")[1].split("->")
    if len(output) != len(scale.shape) or len(kernel) != len(kernel_axes):
        return None
    axes = []
    for label, size in zip(output, scale.shape, strict=True):
        where = kernel.find(label)
        axes.append(kernel_axes[where] if where >= 0 and size > 1 else None)
    return tuple(axes)


def int8_scales(ledger: Ledger, setting: Setting) -> None:
    """Lays out each int8 layer's `kernel_scale` as its kernel's output features, whoever took it."""
    for layer in _compat.sublayers(setting.model):
        if getattr(layer, "quantization_mode", None) != "int8":
            continue
        kernel = next((v for v in _compat.own_variables(layer) if v.path.endswith("/kernel")), None)
        scale = getattr(layer, "kernel_scale", None)
        kernel_axes = None if kernel is None else ledger.axes(kernel.path)
        if kernel_axes is None or scale is None:
            continue
        axes = scale_axes(layer, kernel_axes)
        if axes is None:
            continue
        note = _notes.int8_scale(setting.display(layer.path), axes)
        # An earlier strategy may have taken the scale for its layer's other weights (a bias): revised.
        ledger.revise(scale.path, axes, note, unit=ledger.unit(kernel.path))
