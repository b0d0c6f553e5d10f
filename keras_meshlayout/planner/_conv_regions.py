"""Channel-split regions: how far XLA carries a lone grouped convolution's channel split.

A depthwise or grouped convolution whose kernel is split on its channels with no unit
around it (`_convs.lone_grouped_convs`: ConvNeXt's 7 × 7 convolutions, the depthwise
halves of Xception's separable convolutions) computes on its own channels, and XLA's
sharding propagation carries that split, both ways, to every value joined to it by
channel-wise operations: element-wise arithmetic, a bias, a norm's scale and offset,
pooling and padding over the other dimensions. ConvNeXt's residual stream is held split over the
model axis from one stage's first block to its last. A lone convolution split on its input
channels alone (`_convs.lone_convs`: ConvNeXt's downsampling, a ResNet's middle 3 × 3) does the
same to the values its input is computed from. `channel_region` finds those values and where
the region meets the rest of the step; `_conv_costs.ConvCosts.region_traffic` costs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from ._grouped import CONV
from ._grower import ELEMENTWISE, REDUCTIONS
from ._trace import Node, Trace

__all__ = ["Region", "channel_region", "split_kind"]

#: Operations over the other dimensions that keep each channel's values apart: pooling, padding.
_WINDOWED = frozenset({"reduce_window_max", "reduce_window_min", "reduce_window_sum", "reduce_window", "pad"})
#: Operations a weight vector reaches a region value through (`(channels,)` → `(1, 1, 1, channels)`).
_VECTOR_PASS = ("reshape", "broadcast_in_dim", "convert_element_type", "copy", "copy_p")


@dataclasses.dataclass
class Region:
    """The values split on their channels around the seeds, and where the region meets the step.

    Attributes:
        values: Per value id, its channel dimension.
        exits: `(value, node)`: a projection or convolution reading a region value whose kernel
            is not split on its input channels (it needs them all).
        entries: `(value, node)`: a projection or convolution writing a region value whose kernel
            is not split on its output channels (its output is whole).
        reductions: The results of reductions over the channels (a norm's statistics).
        vectors: Channel-wise weights the region's values are combined with.
        kernels: Grouped convolutions with their kernel whole that read a region value: XLA
            computes them on the region's channels.
    """

    values: dict[int, int] = dataclasses.field(default_factory=dict)
    exits: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    entries: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    reductions: list[int] = dataclasses.field(default_factory=list)
    vectors: list[str] = dataclasses.field(default_factory=list)
    kernels: list[int] = dataclasses.field(default_factory=list)


def split_kind(node: Node, kernel_axes: Callable[[Node], tuple[int, int, int] | None]) -> str:
    """`"in"`, `"out"` or `""`: which channels of `node`'s kernel are split (`kernel_axes` gives
    `(split dimension, input-channel dimension, output-channel dimension)` of its kernel variable)."""
    found = kernel_axes(node)
    if found is None or found[0] < 0:
        return ""
    split, inner, outer = found
    if node.primitive == CONV and node.params["feature_group_count"] > 1 and split in (inner, outer):
        return "grouped"
    return "in" if split == inner else "out" if split == outer else ""


def channel_region(
    trace: Trace, seeds: Iterable[int], kind_of: Callable[[Node], str], inputs: Iterable[int] = ()
) -> Region:
    """The region around the convolution nodes `seeds` (their input and output) and `inputs` (their
    input alone: a lone convolution split on its input channels), `kind_of(node)` as `split_kind` says."""
    region = Region()
    seeds = set(seeds)
    queue: list[tuple[int, int]] = []
    for index in seeds:
        node = trace.nodes[index]
        numbers = node.params["dimension_numbers"]
        queue += [(node.outputs[0], numbers.out_spec[1]), (node.inputs[0], numbers.lhs_spec[1])]
    for index in inputs:
        node = trace.nodes[index]
        queue.append((node.inputs[0], node.params["dimension_numbers"].lhs_spec[1]))
    while queue:
        value, dim = queue.pop()
        if value < 0 or value in region.values or trace.from_input(value):
            continue
        region.values[value] = dim
        producer = trace.producer.get(value)
        if producer is not None and producer not in seeds:
            queue += _backward(trace, trace.nodes[producer], value, dim, kind_of, region)
        for index in trace.consumers.get(value, ()):
            if index not in seeds:
                queue += _forward(trace, trace.nodes[index], value, dim, kind_of, region)
    region.vectors = list(dict.fromkeys(region.vectors))
    region.kernels = list(dict.fromkeys(region.kernels))  # met from its input and from its output
    return region


def _backward(trace: Trace, node: Node, value: int, dim: int, kind_of, region: Region) -> list:
    """What `value`'s split reaches through the node writing it."""
    shape = trace.shapes[value]
    if node.primitive in (CONV, "dot_general"):
        kind = kind_of(node)
        if node.primitive == CONV and node.params["feature_group_count"] > 1 and kind in ("grouped", ""):
            if kind == "":  # its kernel whole: computed on the region's channels, updated split
                region.kernels.append(node.index)
            return [(node.inputs[0], node.params["dimension_numbers"].lhs_spec[1])]
        if kind != "out":
            region.entries.append((value, node.index))
        return []
    if node.primitive in REDUCTIONS and node.primitive.startswith("reduce_"):
        axes = tuple(node.params["axes"])
        kept = [i for i in range(len(trace.shapes[node.inputs[0]])) if i not in axes]
        return [(node.inputs[0], kept[dim])]
    if node.primitive in _WINDOWED:
        return [(node.inputs[0], dim)] if trace.shapes[node.inputs[0]][dim] == shape[dim] else []
    if node.primitive not in ELEMENTWISE:
        return []
    reached = []
    for operand in node.inputs:
        if operand < 0:
            continue
        vector = _vector(trace, operand, shape[dim])
        if vector is not None:
            region.vectors.append(vector)
        elif len(trace.shapes[operand]) == len(shape) and trace.shapes[operand][dim] == shape[dim] > 1:
            reached.append((operand, dim))
    return reached


def _forward(trace: Trace, node: Node, value: int, dim: int, kind_of, region: Region) -> list:
    """What `value`'s split reaches through a node reading it."""
    if node.primitive in (CONV, "dot_general"):
        kind = kind_of(node)
        if node.inputs[0] != value and node.primitive == CONV:
            return []  # a kernel computed from the region: not seen in these models
        if node.primitive == CONV and node.params["feature_group_count"] > 1 and kind in ("grouped", ""):
            if kind == "":
                region.kernels.append(node.index)
            return [(node.outputs[0], node.params["dimension_numbers"].out_spec[1])]
        if kind != "in":
            region.exits.append((value, node.index))
        return []
    output = node.outputs[0] if node.outputs else -1
    if node.primitive in REDUCTIONS and node.primitive.startswith("reduce_"):
        axes = tuple(node.params["axes"])
        if dim in axes:
            region.reductions.append(output)
            return []
        return [(output, dim - sum(a < dim for a in axes))]
    if node.primitive == "broadcast_in_dim":
        return [(output, tuple(node.params["broadcast_dimensions"])[dim])]
    windowed = node.primitive in _WINDOWED
    if (windowed and node.inputs[0] != value) or not (windowed or node.primitive in ELEMENTWISE):
        return []
    shape = trace.shapes[value]
    if len(trace.shapes[output]) == len(shape) and trace.shapes[output][dim] == shape[dim]:
        return [(output, dim)]
    return []


def _vector(trace: Trace, value: int, channels: int) -> str | None:
    """The path of the weight `value` is, reshaped or broadcast at most, when it has `channels` elements."""
    while value not in trace.variables:
        index = trace.producer.get(value)
        if index is None or trace.nodes[index].primitive not in _VECTOR_PASS:
            return None
        value = trace.nodes[index].inputs[0]
    shape = trace.shapes[value]
    return trace.variables[value] if len(shape) == 1 and shape[0] == channels else None
