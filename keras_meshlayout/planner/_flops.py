"""FLOPs of one training step: XLA's count of the whole step, and each device's share under a layout.

`step_flops` is XLA's `cost_analysis` of the unsharded step (forward and backward, lowered,
never compiled). `device_flops` splits it over a mesh: each matmul and convolution of the
traced step (`_trace.trace_step`) is divided by the mesh axes its output and its contracted
dimensions are split over (`_propagate.Specs`), so a layer kept replicated on a model axis
counts in full on every device of that axis; the step's other FLOPs (element-wise work, XLA's
count minus the traced matmuls') are taken as evenly split over all devices.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..core._axes import Axes, entry_axes
from ._propagate import Specs
from ._trace import Node, Trace

__all__ = ["device_flops", "matmul_flops", "step_flops"]


def step_flops(model: Any, batch: Any) -> float:
    """FLOPs of one unsharded training step: XLA's cost analysis of the lowered forward and backward.

    The loss is the sum of the outputs (its own FLOPs are negligible); nothing is compiled and
    no weight is allocated (the variables enter as `jax.ShapeDtypeStruct`s).
    """
    import jax
    import jax.numpy as jnp

    from ..report._comm import xla_flops

    def abstract(array: Any) -> Any:
        return jax.ShapeDtypeStruct(tuple(array.shape), array.dtype)

    trainable = [abstract(v) for v in model.trainable_variables]
    frozen = [abstract(v) for v in model.non_trainable_variables]

    def loss(weights: Any, others: Any, x: Any) -> Any:
        outputs, _ = model.stateless_call(weights, others, x, training=True)
        return sum(jnp.sum(out.astype("float32")) for out in jax.tree_util.tree_leaves(outputs))

    lowered = jax.jit(jax.grad(loss)).lower(trainable, frozen, jax.tree_util.tree_map(abstract, batch))
    return xla_flops(lowered)


def matmul_flops(trace: Trace, specs: Specs | None = None) -> float:
    """FLOPs of the traced step's matmuls and convolutions: whole, or one device's under `specs`."""
    total = 0.0
    for node in trace.nodes:
        if node.primitive in ("dot_general", "conv_general_dilated"):
            flops, split = _node_flops(trace, node, specs)
            total += flops / split
    return total


def device_flops(
    total: float,
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
) -> float:
    """One device's FLOPs of a step of `total` FLOPs (`step_flops`), under `layouts` (see the module)."""
    devices = math.prod(axis_sizes.values())
    specs = Specs(trace, layouts, axis_sizes, batch_axis)
    rest = max(total - matmul_flops(trace), 0.0)
    return rest / devices + matmul_flops(trace, specs)


def _node_flops(trace: Trace, node: Node, specs: Specs | None) -> tuple[float, int]:
    """A matmul's or convolution's FLOPs, and over how many devices `specs` splits them (1 without)."""
    out = node.outputs[0]
    lhs, rhs = node.inputs[0], node.inputs[1]
    shape = trace.shapes[out]
    if node.primitive == "dot_general":
        (lc, rc), _ = node.params["dimension_numbers"]
        per_output = math.prod(trace.shapes[lhs][i] for i in lc) if lhs >= 0 else 1
        contracted = [(lhs, lc), (rhs, rc)]
    else:
        numbers = node.params.get("dimension_numbers")
        kernel = trace.shapes[rhs] if rhs >= 0 else ()
        if getattr(numbers, "rhs_spec", None) is None or not kernel:
            return 0.0, 1
        per_output = math.prod(kernel) // max(kernel[numbers.rhs_spec[0]], 1)
        contracted = [(rhs, (numbers.rhs_spec[1],)), (lhs, (numbers.lhs_spec[1],))]
    flops = 2.0 * math.prod(shape) * per_output
    if specs is None:
        return flops, 1
    axes = {a for entry in specs.spec.get(out, ()) for a in entry_axes(entry)}
    for value, dims in contracted:
        spec = specs.spec.get(value, ()) if value >= 0 else ()
        gathered = value in trace.variables  # a weight split over the batch axis is gathered first
        axes |= {
            a
            for i in dims
            if i < len(spec)
            for a in entry_axes(spec[i])
            if not (gathered and a == specs.batch_axis)
        }
    return flops, math.prod(specs.sizes.get(a, 1) for a in axes)
