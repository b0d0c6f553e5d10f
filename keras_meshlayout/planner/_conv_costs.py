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
  over the model axis forward; XLA holds the values its input is computed from
  channel-wise split too, a region (`_conv_regions`) costed with the lone
  convolution's split: its input gradient gathered where the region begins, the
  bias and batch norm before it updated split and gathered after;
- a lone grouped convolution's region, the same way, costed with every plan
  (`_convs.lone_grouped_convs` leaves none whole); measured on keras.applications
  ConvNeXtTiny (32 × 32) and Xception (71 × 71): see `ConvCosts.region_traffic`;
- batch normalisation in training: its batch statistics, per channel, summed
  over the batch axis, twice forward and twice backward, at the size each
  device holds (1/model of the channels in a unit), costed with the unit
  whose channels it normalises (whole when the search leaves that unit
  replicated). Under the 2-D layout XLA was seen to reduce some of them
  whole and some split; the 2-D layout's bytes are not checked yet.

Partial sums travel in float32, as for projections (`Bytes._summed`).
"""

from __future__ import annotations

import functools
import math

import keras
import numpy as np

from .. import _compat
from ..report._collectives import wire_bytes
from ._candidates import Bytes, Candidate, add_wire, candidate, nbytes, plus_wire
from ._conv_regions import Region, channel_region, split_kind
from ._convs import CONV, conv_kernel

__all__ = ["ConvCosts"]

#: XLA:TPU gathers a float32 region value in float32, not bfloat16, at this many rows a device or
#: fewer (ConvNeXtTiny's last stage at 32 × 32: one position, 8 images a device), unless each device's
#: channels fill whole rows of `TPU_LANES` (ResNet50's last stage at 32 × 32, the same 8 rows of 512
#: channels over 4, goes in bfloat16; 768 over 4 and 128 over 4 in float32).
TPU_F32_ROWS = 8
#: XLA:TPU gathers the output gradient of the grouped convolutions' region's first entries (in the
#: forward pass; the backward pass's last) once, of the others twice, whatever their size (a
#: ConvNeXt-like stack of 4 and 6 blocks, 8 to 64 images, 32 or 64 channels, 4 × 4 or 8 × 8, v5e 2×4:
#: the first two blocks'; ConvNeXtTiny too, and Xception's bytes are 1.004 of the compiled ones with
#: it). A lone convolution's region has its one entry gathered twice, the first too (ResNet50's 3 × 3
#: and 1 × 1 convolutions split alone, 32 × 32, v5e 2×4: every stage's).
TPU_ONCE_ENTRIES = 2
#: XLA:TPU all-gathers a channel-wise weight after the update where each device's shard fills whole
#: rows of this many lanes, and all-reduces it otherwise (ResNet50's 512 channels over `model=4` are
#: gathered as `f32[4,1,128]`; its 64 to 256 channels, ConvNeXtTiny's 96 to 768 and Xception's are
#: all-reduced, v5e 2×4).
TPU_LANES = 128


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
                    if self._summed_with_an_earlier_row_end(node):
                        continue
                    add_wire(
                        wire,
                        self.model_axis,
                        wire_bytes("all-reduce", self._summed(self.trace.shapes[out], dtype), self.m),
                    )
                    if lone:  # the channel-split region its input seeds, when it is that region's owner
                        self.region_traffic(wire, owner=self.proposal.units.get(variable.path))
                elif not self._no_gradient(lhs) and not self._merged_conv_grad(node.index, lhs):
                    summed = self._summed(self._moved_shape(lhs), dtype) * self._cast_for_a_conv(lhs)
                    add_wire(wire, self.model_axis, wire_bytes("all-reduce", summed, self.m))

    def _summed_with_an_earlier_row_end(self, node: object) -> bool:
        """Whether XLA:TPU adds the partial sums of row end `node` to an earlier row end's before their
        one all-reduce: both convolutions' outputs read only by the one addition (a pre-activation
        ResNet's shortcut and last 1 × 1 convolution, added with no norm between: keras-hub's
        `use_pre_activation=True`, v5e 2×4; XLA:CPU all-reduces each)."""
        readers = self.trace.consumers.get(node.outputs[0], ())
        if self.compiler != "tpu" or len(readers) != 1:
            return False
        add = self.trace.nodes[readers[0]]
        if add.primitive not in ("add", "add_any"):
            return False
        for other in (v for v in add.inputs if v >= 0 and v != node.outputs[0]):
            producer = self.trace.producer.get(other)
            if producer is None or producer >= node.index or self.trace.consumers.get(other) != (add.index,):
                continue
            if self._split_conv(producer, channels=1):  # a row end too
                return True
        return False

    def _moved_shape(self, value: int) -> tuple[int, ...]:
        """The shape at which `value`, a convolution's input, or its gradient moves between devices: its
        own, but on XLA:TPU that of what a zero padding pads into it, padded after the gather and the
        gradient sliced before the all-reduce (keras-hub ResNet's strided 3 × 3 convolution reads its
        input padded to 10 × 10: XLA:TPU gathers it and all-reduces its gradient at 8 × 8, XLA:CPU at
        10 × 10; v5e 2×4)."""
        producer = self.trace.producer.get(value)
        node = self.trace.nodes[producer] if producer is not None else None
        if self.compiler != "tpu" or node is None or node.primitive != "pad" or node.inputs[0] < 0:
            return self.trace.shapes[value]
        if any(low < 0 or high < 0 or inner for low, high, inner in node.params["padding_config"]):
            return self.trace.shapes[value]  # a crop or an interior padding: not a border of zeros
        return self.trace.shapes[node.inputs[0]]

    def _merged_conv_grad(self, index: int, value: int) -> bool:
        """Whether XLA:TPU folds the input-gradient all-reduce of convolution `index`, split on its output
        channels, into another's: as for projections (`merged_input_grads`), the readers of `value` that
        give its first gradients, while each is such a convolution, share one (ResNet50's first block
        of a stage, its shortcut and its first 1 × 1 convolution reading one input, v5e 2×4)."""
        if self.compiler != "tpu":
            return False
        return index in self.folded_readers(value, self._column_conv)

    def _column_conv(self, index: int) -> bool:
        """Whether node `index` is a convolution (not grouped) split on its output channels."""
        return self._split_conv(index, channels=2)

    def _split_conv(self, index: int, channels: int) -> bool:
        """Whether node `index` is a convolution (not grouped) whose kernel is split over the model axis
        on its input (`channels=1`) or output (`channels=2`) channels (`_kernel_axes`' order)."""
        node = self.trace.nodes[index]
        if node.primitive != CONV or node.params["feature_group_count"] != 1:
            return False
        axes = self._kernel_axes(node)
        return axes is not None and axes[0] == axes[channels]

    def _cast_for_a_conv(self, value: int) -> float:
        """The share of a float32 gradient of `value` XLA:TPU sums: half, in bfloat16, when a convolution
        wrote `value` and its transposes read the gradient (Xception's separable convolutions: the
        pointwise half's input gradient, measured on v5e 2×4); the whole of it else, and on XLA:CPU."""
        producer = self.trace.producer.get(value)
        by_a_conv = producer is not None and self.trace.nodes[producer].primitive == CONV
        return 0.5 if self.compiler == "tpu" and by_a_conv and self.trace.dtypes[value] == "float32" else 1.0

    def _input_conv_traffic(self, variables: list[keras.Variable], wire: dict[str, float]) -> None:
        """An input convolution's output channels split (`_convs.input_convs`), added to `wire`.

        Measured on XLA:CPU (keras-hub ViT's patch embedding, 2×4): its output,
        kept whole by the layer-output rule, is all-gathered over the model
        axis forward; nothing moves backward (each device slices its channels
        of the output gradient). The bias's gradient is computed from that
        whole gradient and all-reduced over the batch axis whole, not split.
        Where the kernel is the smaller, XLA gathers it instead and convolves
        whole (keras-hub DenseNet's 7 × 7 stem over 32 × 32 images, 2×4: its
        37,632-byte kernel, where its output is 262,144 bytes a device).
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
                gathered = min(gathered, nbytes(variable))
                add_wire(wire, self.model_axis, wire_bytes("all-gather", gathered, self.m))

    def _no_gradient(self, value: int) -> bool:
        """Whether no gradient flows back to `value`: the batch, or computed from no trainable weight.

        A stem convolution reading preprocessed images (EfficientNet's rescaling, normalisation and
        padding) gets no input gradient, as one reading the batch itself.
        """
        return self.trace.from_input(value) or value not in self.trace.trained

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

    # -- channel-split regions (`_conv_regions`) ---------------------------------------------

    @functools.cached_property
    def regions(self) -> tuple[tuple[Region, str | None], ...]:
        """The channel-split regions (`_conv_regions`) and the unit each is costed with.

        The lone grouped convolutions' region together, costed with every plan (no plan leaves
        them whole); then, for each lone convolution whose input no earlier region holds, the
        region its input seeds, costed with its unit's split (whole, it has none).
        """
        grouped, lone = [], []
        for node in self.trace.nodes:
            if node.primitive != CONV:
                continue
            found = conv_kernel(self.trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[0], 1)
            if found is None or self.model_axis not in self.tp_axes.get(found[0], ()):
                continue
            unit = self.proposal.units.get(found[0])
            if unit in self.proposal.lone_grouped:
                grouped.append(node.index)
            elif unit in self.proposal.lone_convs and not self._no_gradient(node.inputs[0]):
                lone.append((node.index, unit))
        kind = functools.partial(split_kind, kernel_axes=self._kernel_axes)
        found: list[tuple[Region, str | None]] = []
        held: set[int] = set()
        if grouped:
            found.append((channel_region(self.trace, grouped, kind), None))
            held.update(found[-1][0].values)
        for index, unit in lone:
            if self.trace.nodes[index].inputs[0] not in held:
                found.append((channel_region(self.trace, (), kind, inputs=(index,)), unit))
                held.update(found[-1][0].values)
        return tuple(found)

    @functools.cached_property
    def _by_path(self) -> dict[str, keras.Variable]:
        return {v.path: v for v in self.model.weights}

    @functools.cached_property
    def _trainable_ids(self) -> frozenset[int]:
        return frozenset(id(v) for v in self.model.trainable_weights)

    def _kernel_axes(self, node: object) -> tuple[int, int, int] | None:
        """`(split, input-channel, output-channel)` dimensions of the kernel variable `node` reads."""
        found = self._kernel_of(node)
        if found is None:
            return None
        path, inner, outer = found
        axes = self.tp_axes.get(path, ())
        return (axes.index(self.model_axis) if self.model_axis in axes else -1), inner, outer

    def _kernel_of(self, node: object) -> tuple[str, int, int] | None:
        """`(path, input-channel dimension, output-channel dimension)` of the kernel `node` reads."""
        if node.primitive == CONV:
            rhs, spec = node.inputs[1], node.params["dimension_numbers"].rhs_spec
            outer = conv_kernel(self.trace, rhs, spec[0], self.m)
            inner = conv_kernel(self.trace, rhs, spec[1], self.m)
            if outer is None:
                return None
            return outer[0], (inner[1] if inner is not None else -2), outer[1]
        (_, rhs_contracted), (_, rhs_batch) = node.params["dimension_numbers"]
        found = self.trace.weight_of(node.inputs[1])
        if found is None or len(rhs_contracted) != 1:
            return None
        path, perm = found
        rank = len(self.trace.shapes[node.inputs[1]])
        free = [i for i in range(rank) if i not in rhs_contracted and i not in rhs_batch]
        if len(free) != 1:
            return None
        mapped = (lambda d: perm[d]) if perm is not None else (lambda d: d)
        return path, mapped(rhs_contracted[0]), mapped(free[0])

    def region_traffic(self, wire: dict[str, float], owner: str | None = None) -> None:
        """The collectives of the channel-split regions costed with `owner` (`regions`), added to `wire`.

        Measured on XLA:CPU (jax 0.10.2; keras.applications ConvNeXtTiny at 32 × 32 and Xception
        at 71 × 71 on data=2 × model=4, `tests/test_conv_regions.py`):

        - leaving it, a column (a kernel split on its output channels) all-gathers its input
          forward; a whole kernel computes on the split input as a row end, its output
          all-reduced and its kernel's gradient split, updated split and all-gathered after;
        - entering it, the output gradient of a row end is all-gathered backward; a whole kernel
          has its gradient computed split from the split output gradient, updated split and
          all-gathered after the update (ConvNeXt's stem), its output gradient gathered once
          for its input gradient unless it reads the model's input (keras-hub ViTDet's neck, a
          1 × 1 convolution before a norm and a 3 × 3 one split on its input channels: `model`
          1.032 and `data` 1.021 of the compiled bytes when gathered twice and updated whole);
        - a gathered activation is gathered once more, for the kernel gradient, when it holds more
          than twice the elements of the kernel's shard (ConvNeXt's first stage, 512 rows of 96
          channels a device against a 96 × 384 kernel over 4; not its second, 128 of 192 against
          192 × 768; Xception's entry blocks, not its middle ones; probed before on a 1 × 1
          convolution of 16 to 512 channels over 16 to 1,024 rows a device, twice at 64 rows of 96
          or 112 channels, once at 64 of 128 and 256 of 512), on a mesh splitting the batch:
          on `data=1` never (ConvNeXtTiny on 1×8, 21 times its shard);
        - each reduction over the channels (a layer norm's two means and its variance) is
          all-reduced forward, and once backward;
        - each channel-wise weight the region meets (a bias, a norm's scale and offset, a layer
          scale, a batch norm's, whose batch statistics are then summed over the batch axis on
          1/model of the channels) is updated split and all-gathered after the update with its
          optimizer slots (its gradient summed over the batch axis in those shards), a batch
          norm's moving statistics once.

        XLA:TPU (v5e 2×4, the same models, libtpu 0.0.42.1) moves the same values otherwise: a
        float32 activation gathered as bfloat16, cast for the products that read it (in float32 at
        `TPU_F32_ROWS` rows a device or fewer where each device's channels do not fill `TPU_LANES`,
        ConvNeXt's last stage at 32 × 32), unpadded where a zero padding follows (`_moved_shape`); an
        exit's input gathered forward and again backward whatever its size; an entry's output
        gradient gathered twice, but once for the grouped convolutions' region's first
        `TPU_ONCE_ENTRIES` entries; a norm's three reductions summed once each (two forward, one
        backward); each channel-wise weight all-reduced after the update (twice the bytes of a
        gather), gathered where its shard fills `TPU_LANES`. `model` bytes of keras.applications
        ConvNeXtTiny 1.084 → 1.001 of the compiled ones (1.007 at 64 × 64 on 4×2), Xception
        1.314 → 1.004, ResNet50 (32 × 32) 0.975 → 1.000.
        """
        for region, unit in self.regions:
            if unit == owner:
                self._region_traffic(region, wire, once=TPU_ONCE_ENTRIES if unit is None else 0)

    def _region_traffic(self, region: Region, wire: dict[str, float], once: int) -> None:
        gathered: set[int] = set()
        for value, index in region.exits:
            node = self.trace.nodes[index]
            if value in gathered:
                continue
            gathered.add(value)
            found = self._kernel_of(node)
            if found is not None and split_kind(node, self._kernel_axes) == "":
                out = node.outputs[0]
                summed = self._summed(self.trace.shapes[out], self.trace.dtypes[out])
                add_wire(wire, self.model_axis, wire_bytes("all-reduce", summed, self.m))
                self._updated_split(found[0], wire)
                continue
            self._gather_activation(region, value, node, wire)
        gathered_entries = 0
        for value, index in sorted(region.entries, key=lambda entry: entry[1]):
            node = self.trace.nodes[index]
            found = self._kernel_of(node)
            whole = found is not None and split_kind(node, self._kernel_axes) == ""
            if whole:  # its kernel's gradient computed split, from the split output gradient
                self._updated_split(found[0], wire)
            if whole and not self._no_gradient(node.inputs[0]):  # gathered for the input gradient
                self._gather_activation(region, value, node, wire, times=1)
            elif not whole and not self._no_gradient(value):
                last = gathered_entries < once  # among the backward pass's last
                self._gather_activation(
                    region, value, node, wire, times=1 if last and self.compiler == "tpu" else 0
                )
                gathered_entries += 1
        passes = 1 if self.compiler == "tpu" else 2  # XLA:TPU: a norm's three, two forward and one backward
        for reduced in region.reductions:
            summed = self._summed(self.trace.shapes[reduced], self.trace.dtypes[reduced])
            add_wire(wire, self.model_axis, passes * wire_bytes("all-reduce", summed, self.m))
        for index in region.kernels:
            found = self._kernel_of(self.trace.nodes[index])
            if found is not None:
                self._updated_split(found[0], wire)
        vectors = [p for p in region.vectors if not any(self.tp_axes.get(p, ()))]
        for path in vectors:
            self._updated_split(path, wire, vector=True)
        for layer in self.batch_norms():  # its moving statistics are among `vectors` (their update)
            if any(v.path in vectors for v in (layer.gamma, layer.beta) if v is not None):
                whole, split = self.batch_norm_stats(layer, 1), self.batch_norm_stats(layer, self.m)
                add_wire(wire, self.batch_axis, split - whole)

    def _gather_activation(
        self, region: Region, value: int, node: object, wire: dict[str, float], times: int = 0
    ) -> None:
        """A region value all-gathered for `node` (an exit's input, an entry's output gradient), `times`
        times, else twice on XLA:TPU and on XLA:CPU once or twice by the size of the gathered
        activation against the kernel's shard (`region_traffic`)."""
        shape, dtype = self._moved_shape(value), self.trace.dtypes[value]
        gathered = wire_bytes("all-gather", self._activation(shape, dtype), self.m)
        if self.compiler == "tpu":
            channels = shape[region.values[value]]
            rows = math.prod(shape) / channels / self.d
            few = rows <= TPU_F32_ROWS and channels / self.m % TPU_LANES != 0
            if np.dtype(dtype).itemsize > 2 and not few:  # cast to bfloat16 for the products reading it
                gathered *= 2 / np.dtype(dtype).itemsize
            add_wire(wire, self.model_axis, (times or 2) * gathered)
            return
        found = self._kernel_of(node)
        kernel = self._by_path.get(found[0]) if found else None
        shard = math.prod(kernel.shape) / self.m if kernel is not None else math.inf
        times = times or (2 if self.d > 1 and math.prod(shape) / self.d > 2 * shard else 1)
        add_wire(wire, self.model_axis, times * gathered)

    def _updated_split(self, path: str, wire: dict[str, float], vector: bool = False) -> None:
        """A whole weight updated in model-axis shards and all-gathered after, with its slots if trained
        (a channel-wise `vector` all-reduced instead on XLA:TPU, as measured on ConvNeXtTiny, Xception
        and ResNet50, v5e 2×4, unless its shard fills whole rows of `TPU_LANES`)."""
        variable = self._by_path.get(path)
        if variable is None:
            return
        trainable = id(variable) in self._trainable_ids
        copies = 1 + self.memory.like_parameter if trainable else 1
        lanes = math.prod(variable.shape) / self.m % TPU_LANES == 0
        kind = "all-reduce" if vector and self.compiler == "tpu" and not lanes else "all-gather"
        add_wire(wire, self.model_axis, copies * wire_bytes(kind, nbytes(variable), self.m))
        if trainable:  # its gradient summed over the batch axis in the same shards
            add_wire(wire, self.batch_axis, self._grad_sync(variable, self.m) - self._grad_sync(variable, 1))
