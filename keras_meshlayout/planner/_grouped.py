"""Grouped and depthwise convolutions inside a split: each device convolves its own channels.

A grouped convolution (`conv_general_dilated` with `feature_group_count` > 1,
as many groups as divide by the model axis: a depthwise conv has one group per
channel) mixes no channels across groups, so an input split over its channels
keeps the split: each device convolves its channels with its slice of the
kernel, and the output is split the same way. Both growers carry a split
through one (`_grower` for projection pairs, such as keras-hub's Qwen 3.5
gated delta-net: a column projection, a depthwise causal conv1d, a row
projection; `_convs` for convolution units), and a grouped convolution whose
output a split needs has its input required split the same way.

This is also the one layout in which XLA computes the kernel gradient of a
grouped convolution right on a mesh that splits more than the batch
(`kml.GroupedConvWarning`): with the channels whole on each device, XLA:CPU
(jax 0.10.2) sums that gradient over every device instead of the batch shards.
"""

from __future__ import annotations

from typing import Any

from ._scan import Fail
from ._trace import Trace, _reshape_dim

__all__ = ["CONV", "conv_kernel", "grouped_forward", "grouped_kernels", "grouped_require", "must_stay_split"]

CONV = "conv_general_dilated"


def conv_kernel(trace: Trace, value: int, dim: int, size: int) -> tuple[str, int, tuple[int, ...]] | None:
    """`(path, dimension, nodes passed)` of the kernel variable `value` reads, `dim` of `value` mapped back.

    A kernel reaches a convolution cast, transposed, reshaped or expanded (a depthwise
    kernel `(h, w, channels, multiplier)` becomes `(h, w, 1, channels·multiplier)`; a
    `(channels, taps)` weight is transposed and given a dimension of 1); `None` when
    `value` is no variable's, or a reshape would cut `dim`'s blocks over `size`.
    """
    passed: list[int] = []
    while value not in trace.variables:
        index = trace.producer.get(value)
        if index is None:
            return None
        node = trace.nodes[index]
        if node.primitive == "transpose":
            dim = tuple(node.params["permutation"])[dim]
        elif node.primitive == "reshape":
            inner = _reshape_dim(trace.shapes[value], trace.shapes[node.inputs[0]], dim, size)
            if inner is None:
                return None
            dim = inner
        elif node.primitive == "broadcast_in_dim":
            dims = tuple(node.params["broadcast_dimensions"])
            if dim not in dims or trace.shapes[node.inputs[0]][dims.index(dim)] != trace.shapes[value][dim]:
                return None
            dim = dims.index(dim)
        elif node.primitive not in ("convert_element_type", "copy", "copy_p", "reduce_precision"):
            return None
        passed.append(index)
        value = node.inputs[0]
    return trace.variables[value], dim, tuple(passed)


def kernel_at(grower: Any, node: Any, dim: int) -> tuple[str, int]:
    """A convolution's kernel path and the dimension its `dim` is there; the nodes it passed, visited."""
    found = conv_kernel(grower.trace, node.inputs[1], dim, grower.m)
    if found is None or grower.trace.weight_of(node.inputs[0]) is not None:
        raise Fail("not a convolution of an activation by a kernel")
    path, kernel_dim, passed = found
    grower.state.visited.update(passed)
    grower.state.visited.add(node.index)
    return path, kernel_dim


def _groups(node: Any, size: int) -> None:
    params = node.params
    if params["batch_group_count"] != 1:
        raise Fail("a convolution over the batch's groups")
    if params["feature_group_count"] == 1:
        raise Fail("a convolution summing over the split channels")
    if params["feature_group_count"] % size:
        raise Fail("groups that do not divide")


def grouped_forward(grower: Any, node: Any, value: int, dim: int) -> None:
    """`value`, split on `dim`, is the input of grouped convolution `node`: its output split alike."""
    numbers = node.params["dimension_numbers"]
    if value != node.inputs[0] or dim != numbers.lhs_spec[1]:
        raise Fail("a convolution over the split dimension")
    _groups(node, grower.m)
    path, kernel_dim = kernel_at(grower, node, node.params["dimension_numbers"].rhs_spec[0])
    grower.member(path, kernel_dim, "grouped")
    grower.set_split(node.outputs[0], numbers.out_spec[1])


def grouped_require(grower: Any, node: Any, dim: int) -> None:
    """The output of grouped convolution `node` must be split on `dim`: its kernel and input are."""
    numbers = node.params["dimension_numbers"]
    if dim != numbers.out_spec[1]:
        raise Fail("a convolution's output split on another dimension")
    _groups(node, grower.m)
    path, kernel_dim = kernel_at(grower, node, node.params["dimension_numbers"].rhs_spec[0])
    grower.member(path, kernel_dim, "grouped")
    grower.require(node.inputs[0], numbers.lhs_spec[1])


def grouped_kernels(trace: Trace) -> frozenset[str]:
    """The paths of the kernels grouped or depthwise convolutions of `trace` read.

    On a mesh that splits the batch and the model axis, no unit holding one is
    offered replicated (`_costs`): with its channels whole on each device, XLA
    computes its kernel gradient wrongly.
    """
    found = set()
    for node in trace.nodes:
        if node.primitive == CONV and node.params["feature_group_count"] > 1:
            kernel = conv_kernel(trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[0], 1)
            if kernel is not None:
                found.add(kernel[0])
    return frozenset(found)


def must_stay_split(setting: Any, unit: Any) -> bool:
    """Whether `unit` (a `_units.Unit`) holds a grouped conv on a mesh (`setting`) splitting batch and model.

    Kept whole, its channels would be whole on each device, where XLA sums the kernel gradient
    over the whole mesh (`kml.GroupedConvWarning`): `replicate_below` must not undo its split
    (`Rule.keep_split`), however small its kernels (MobileNetV3Small's are all under 4,096).
    """
    return setting.size > 1 and setting.batch_size > 1 and any(m.role == "grouped" for m in unit.members)
