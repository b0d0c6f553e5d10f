"""Costs of convolutions split over their channels: the collectives `_convs`' layouts cause.

Measured on XLA:CPU (jax 0.10.2) on keras.applications and keras-hub
convnets on data=2 × model=4 (`tests/test_convs.py` holds them against the
compiled HLO):

- a unit (`_convs.conv_units`): forward, the output of each convolution that
  sums over the split channels (the row end) is all-reduced over the model
  axis; backward, the input gradient of each convolution whose output
  channels are split (a column) is all-reduced over it, unless it reads the
  model's input; a grouped or depthwise convolution inside the unit sends
  nothing;
- a lone convolution split on its input channels: its output all-reduced
  over the model axis forward, its input gradient (split over the channels)
  all-gathered backward; the bias and batch norm before it computed split and
  all-gathered after the update (`ConvCosts._split_before`);
- batch normalisation in training: its batch statistics, per channel, summed
  over the batch axis, twice forward and twice backward, at the size each
  device holds (1/model of the channels in a unit), costed with the unit
  whose channels it normalises (whole when the search leaves that unit
  replicated). Under the 2-D layout XLA was seen to reduce some of them
  whole and some split; the 2-D layout's bytes are not checked yet.

Partial sums travel in float32, as for projections (`Bytes._summed`).
"""

from __future__ import annotations

import math

import keras

from .. import _compat
from ..report._collectives import wire_bytes
from ._candidates import Bytes, Candidate, add_wire, candidate, nbytes, plus_wire
from ._convs import CONV, conv_kernel
from ._grower import ELEMENTWISE

__all__ = ["ConvCosts"]


class ConvCosts(Bytes):
    """The traffic of convolution units, over the byte counts of `Bytes`."""

    def conv_reads(self, path: str) -> list[tuple[object, int]]:
        """`(node, kernel dimension of the output channels)` of each convolution reading kernel `path`."""
        reads = []
        for node in self.trace.nodes:
            if node.primitive != CONV:
                continue
            found = conv_kernel(
                self.trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[0], self.m
            )
            if found is not None and found[0] == path:
                reads.append((node, found[1]))
        return reads

    def _conv_traffic(self, variables: list[keras.Variable], wire: dict[str, float], lone: bool) -> None:
        """The model-axis collectives of a conv unit's activations (or a lone conv's), added to `wire`."""
        for variable in variables:
            axes = self.tp_axes.get(variable.path, ())
            if self.model_axis not in axes:
                continue
            split = axes.index(self.model_axis)
            for node, out_dim in self.conv_reads(variable.path):
                if node.params["feature_group_count"] != 1:
                    continue  # each device convolves its own channels
                lhs, out = node.inputs[0], node.outputs[0]
                dtype = self.trace.dtypes[out]
                if split != out_dim:  # the row end: partial sums over the split input channels
                    add_wire(
                        wire,
                        self.model_axis,
                        wire_bytes("all-reduce", self._summed(self.trace.shapes[out], dtype), self.m),
                    )
                    if lone and not self._no_gradient(lhs):
                        gathered = self._activation(self.trace.shapes[lhs], dtype)
                        add_wire(wire, self.model_axis, wire_bytes("all-gather", gathered, self.m))
                        self._split_before(lhs, wire)
                elif not self._no_gradient(lhs):
                    summed = self._summed(self.trace.shapes[lhs], dtype)
                    add_wire(wire, self.model_axis, wire_bytes("all-reduce", summed, self.m))

    def _input_conv_traffic(self, variables: list[keras.Variable], wire: dict[str, float]) -> None:
        """An input convolution's output channels split (`_convs.input_convs`), added to `wire`.

        Measured on XLA:CPU (keras-hub ViT's patch embedding, 2×4): its output,
        kept whole by the layer-output rule, is all-gathered over the model
        axis forward; nothing moves backward (each device slices its channels
        of the output gradient). The bias's gradient is computed from that
        whole gradient and all-reduced over the batch axis whole, not split.
        """
        for variable in variables:
            axes = self.tp_axes.get(variable.path, ())
            if self.model_axis not in axes:
                continue
            if len(variable.shape) == 1:
                extra = self._grad_sync(variable, 1) - self._grad_sync(variable, self.m)
                add_wire(wire, self.batch_axis, extra)
                continue
            for node, _ in self.conv_reads(variable.path):
                out = node.outputs[0]
                gathered = self._activation(self.trace.shapes[out], self.trace.dtypes[out])
                add_wire(wire, self.model_axis, wire_bytes("all-gather", gathered, self.m))

    def _no_gradient(self, value: int) -> bool:
        """Whether no gradient flows back to `value`: the batch, or computed from no trainable weight.

        A stem convolution reading preprocessed images (EfficientNet's rescaling, normalisation and
        padding) gets no input gradient, as one reading the batch itself.
        """
        return self.trace.from_input(value) or value not in self.trace.trained

    def _split_before(self, lhs: int, wire: dict[str, float]) -> None:
        """What a lone convolution's input-channel split does to the layer before it.

        Measured on XLA:CPU (ResNet50, keras-hub ResNet, probes of conv → batch norm →
        ReLU → lone conv): XLA computes the channel-wise weights between the
        convolution that writes the lone convolution's input and the lone convolution
        (a bias, a batch norm) split over the model axis, as the lone convolution
        reads that input, and all-gathers each of them (with its optimizer slots, a
        batch norm's moving statistics once) after the update. The weights after the
        lone convolution's own all-reduce stay whole and send nothing.

        When a convolution not reading the model's input writes that input, its
        output gradient (gathered for it) is gathered twice, once for its input
        gradient and once for its kernel's, when the rows each device holds
        (batch × spatial positions) outnumber half the channels: probed with a 1 × 1
        convolution of 16 to 512 channels over 16 to 1,024 rows per device (twice at
        64 rows of 96 or 112 channels, once at 64 of 128 and 256 of 512); the two
        gathers differ only in how their device groups are written, so XLA keeps both.
        """
        found, ends = self._channelwise_before(lhs)
        if found and any(self._gathered_twice(node, lhs) for node in ends):
            gathered = self._activation(self.trace.shapes[lhs], self.trace.dtypes[lhs])
            add_wire(wire, self.model_axis, wire_bytes("all-gather", gathered, self.m))
        variables = {v.path: v for v in self.model.weights}
        for layer in self.batch_norms():
            if any(v.path in found for v in layer.weights):
                found.extend(v.path for v in layer.weights if v.path not in found)
        trainable = {v.path for v in self.model.trainable_weights}
        for path in found:
            variable = variables.get(path)
            if variable is None or any(self.tp_axes.get(path, ())):
                continue
            copies = 1 + self.memory.like_parameter if path in trainable else 1
            add_wire(wire, self.model_axis, copies * wire_bytes("all-gather", nbytes(variable), self.m))

    def _gathered_twice(self, node: object, lhs: int) -> bool:
        """Whether convolution `node`'s output gradient is gathered twice (see `_split_before`)."""
        if node.primitive != CONV or self._no_gradient(node.inputs[0]):
            return False
        shape = self.trace.shapes[lhs]
        channels = shape[node.params["dimension_numbers"].out_spec[1]]
        return 2 * math.prod(shape) / channels / self.d > channels

    def _channelwise_before(self, value: int) -> tuple[list[str], list[object]]:
        """The variables combined element-wise into `value`, and the operations before that are not."""
        found: list[str] = []
        ends: list[object] = []
        stack, seen = [value], set()
        while stack:
            current = stack.pop()
            index = self.trace.producer.get(current)
            if current in seen or index is None:
                continue
            if self.trace.nodes[index].primitive not in ELEMENTWISE:
                ends.append(self.trace.nodes[index])
                continue
            seen.add(current)
            for operand in self.trace.nodes[index].inputs:
                if operand < 0:
                    continue
                leaves = self._weights_of(operand)
                if leaves:
                    found.extend(p for p in leaves if p not in found)
                else:
                    stack.append(operand)
        return found, ends

    def _weights_of(self, value: int, limit: int = 64) -> list[str]:
        """Variables `value` is computed from with no activation (none if it reads one, or past `limit`)."""
        leaves: list[str] = []
        stack, seen = [value], set()
        while stack and len(seen) < limit:
            current = stack.pop()
            if current < 0 or current in seen:
                continue
            seen.add(current)
            if current in self.trace.variables:
                leaves.append(self.trace.variables[current])
                continue
            index = self.trace.producer.get(current)
            if index is None:
                return []  # a model input: an activation, not a weight
            node = self.trace.nodes[index]
            if node.primitive not in ELEMENTWISE and node.primitive not in ("broadcast_in_dim", "reshape"):
                return []
            stack.extend(node.inputs)
        return [] if stack else leaves

    def batch_norms(self) -> list[keras.layers.BatchNormalization]:
        """The model's trainable batch norms (their statistics are summed over the batch axis in training)."""
        return [
            layer
            for layer in _compat.sublayers(self.model)
            if isinstance(layer, keras.layers.BatchNormalization)
            and layer.trainable
            and getattr(layer, "moving_mean", None) is not None
        ]

    def batch_norm_stats(self, layer: keras.layers.BatchNormalization, shards: int) -> float:
        """Bytes each device sends over the batch axis for one batch norm's statistics, in `shards`."""
        channels = math.prod(layer.moving_mean.shape) / shards * 4
        return 4 * wire_bytes("all-reduce", channels, self.d)

    def batch_norm_traffic(self) -> float:
        """The statistics of every batch norm outside the units (those inside cost with their unit)."""
        units = self.proposal.units
        return sum(
            self.batch_norm_stats(layer, 1)
            for layer in self.batch_norms()
            if layer.moving_mean.path not in units
        )

    def unit_batch_norm_traffic(
        self, variables: list[keras.Variable], replicated: Candidate, split: dict[str, float]
    ) -> Candidate:
        """A unit's batch norms: their statistics whole on `replicated` (returned anew), split on `split`."""
        paths = {v.path for v in variables}
        norms = [layer for layer in self.batch_norms() if layer.moving_mean.path in paths]
        if not norms:
            return replicated
        add_wire(split, self.batch_axis, sum(self.batch_norm_stats(layer, self.m) for layer in norms))
        whole = sum(self.batch_norm_stats(layer, 1) for layer in norms)
        wire = plus_wire(replicated.wire, self.batch_axis, whole)
        return candidate("replicated", replicated.axes, replicated.state, wire)
