"""Reading Keras layers: which kernel dimension holds attention heads, a projection's features.

Shared by the rule writer (`_auto`) and the costs (`_costs`); it imports no
other planner module.
"""

from __future__ import annotations

from typing import Any

import keras

from .. import _compat

__all__ = ["features", "heads_dim", "labels", "owners"]


def heads_dim(layer: Any) -> tuple[int, str] | None:
    """`(kernel dimension holding the heads, "in" | "out")` of an attention projection.

    An `EinsumDense` projects into heads when its output has one more
    dimension than its input (`btd,dnh->btnh`: the heads are the output's
    second-to-last label) and out of them when its input has one more
    (`btnh,nhd->btd`: the input's second-to-last label). `None` otherwise.
    """
    equation = getattr(layer, "equation", None)
    if not isinstance(layer, keras.layers.EinsumDense) or not equation or "," not in equation:
        return None
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    if len(output) == len(inputs) + 1 and output[-2] in kernel:
        return kernel.index(output[-2]), "in"
    if len(inputs) == len(output) + 1 and inputs[-2] in kernel:
        return kernel.index(inputs[-2]), "out"
    return None


def labels(layer: Any, variable: Any) -> str:
    """The einsum labels of an EinsumDense variable's dimensions."""
    if variable is layer.kernel:
        return layer.equation.split(",")[1].split("->")[0]
    bias_axes = getattr(layer, "bias_axes", None) or ""
    return bias_axes if len(bias_axes) == len(variable.shape) else ""


def features(layer: Any) -> tuple[int, int] | None:
    """`(in, out)` features of a projection with an `(in, out)` kernel, else `None`."""
    if isinstance(layer, keras.layers.Dense) and getattr(layer, "kernel", None) is not None:
        if layer.kernel.shape is not None and len(layer.kernel.shape) == 2:
            return tuple(layer.kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense) and len(layer.kernel.shape) == 2:
        inputs, rest = layer.equation.split(",")
        kernel, output = rest.split("->")
        if (
            kernel[0] in inputs
            and kernel[0] not in output
            and kernel[1] in output
            and kernel[1] not in inputs
        ):
            if output.endswith(kernel[1]):
                return tuple(layer.kernel.shape)
    return None


def owners(model: keras.Model) -> dict[int, Any]:
    """The layer that created each variable of `model`, by the variable's `id`."""
    found = {}
    for layer in _compat.sublayers(model):
        for variable in _compat.own_variables(layer):
            found[id(variable)] = layer
    return found
