"""Strategy: convolutions split over their channels, output → input, the conv analogue of column → row.

A convolution (`conv_general_dilated` reading a kernel, one feature group)
whose output channels are split over the model axis starts a unit. The split
is followed forward as `find_units` follows a projection's (element-wise
operations, batch normalisation's scale and shift, activations, pooling over
the spatial dimensions, the squeeze-and-excitation product) until every path
ends in a convolution, or a projection, that sums over the channels: the
row end, whose output is all-reduced. On the way:

- a grouped or depthwise convolution (`feature_group_count` > 1, as many
  groups as divide by the model axis) keeps the split: each device convolves
  its own channels, its kernel split with them. This is also the one layout in
  which XLA computes its kernel gradient right on a mesh that splits more than
  the batch (`kml.GroupedConvWarning`): its input is split over the channels;
- batch normalisation's scale, offset and moving statistics are split with
  the channels they normalise;
- a squeeze-and-excitation gate (pooling, a small convolution summing over the
  split channels, a second one expanding back) is a row end and a second
  column of the same unit.

A convolution no unit takes (between two units, as ResNet's 3 × 3 ones can
be) is split on its input channels alone by `lone_convs`, the next strategy; a
grouped one no unit takes (Qwen 3.5's depthwise conv1d, whose channels are sliced
after it), on its channels alone by `lone_grouped_convs`.
One that reads the model's input and feeds layers that need all its channels
(a vision transformer's patch embedding, reshaped into tokens of the residual
stream) is the convolutions' input projection: `input_convs` splits its output
channels and keeps the layer's output whole, one all-gather forward (as a
token embedding's vocabulary split costs one all-reduce), nothing backward.

Output channels that do not divide and a unit with a kernel smaller than
`replicate_below` (which `kml.ModelParallel` keeps whole) are replicated with
the reason; anything that would need the whole channel dimension leaves the
convolutions to the later strategies. A grouped convolution left whole on a
mesh that splits more than the batch is what `kml.GroupedConvWarning` warns
about, at plan time and when `fit` starts.
"""

from __future__ import annotations

import math

import keras

from .. import _compat
from . import _notes
from ._grouped import CONV, conv_kernel, grouped_forward, kernel_at, must_stay_split
from ._grower import ELEMENTWISE, _dynamic, _Fail, _Grower
from ._ledger import Ledger, Setting
from ._trace import Trace
from ._units import Member, Unit, _uses_inside, find_added, unit_name

__all__ = [
    "CONV",
    "CONV_LAYERS",
    "conv_kernel",
    "conv_units",
    "find_conv_units",
    "input_convs",
    "lone_convs",
    "lone_grouped_convs",
]


class _ConvGrower(_Grower):
    """`find_units`' grower, which also carries a channel split through convolutions."""

    def kernel(self, node, dim: int) -> tuple[str, int]:
        return kernel_at(self, node, dim)

    def seed_conv(self, node) -> None:
        """Starts a unit at a convolution of one feature group: its output channels split."""
        params = node.params
        if params["feature_group_count"] != 1 or params["batch_group_count"] != 1:
            raise _Fail("a grouped convolution does not start a unit")
        numbers = params["dimension_numbers"]
        path, dim = self.kernel(node, numbers.rhs_spec[0])
        self.member(path, dim, "column")
        self.set_split(node.outputs[0], numbers.out_spec[1])
        self.run()

    def forward(self, node, value: int, dim: int) -> None:
        if node.primitive != CONV:
            return super().forward(node, value, dim)
        params = node.params
        numbers = params["dimension_numbers"]
        if value != node.inputs[0] or dim != numbers.lhs_spec[1] or params["batch_group_count"] != 1:
            raise _Fail("a convolution over the split dimension")
        if params["feature_group_count"] != 1:
            return grouped_forward(self, node, value, dim)
        path, kernel_dim = self.kernel(node, numbers.rhs_spec[1])
        self.member(path, kernel_dim, "row")
        self.state.rows.append(node.outputs[0])
        return None  # the row end: its output is summed over the model axis, whole

    def require(self, value: int, dim: int) -> None:
        index = self.trace.producer.get(value)
        if (
            index is None
            or value in self.state.split
            or value not in self.dynamic
            or self.trace.nodes[index].primitive != CONV
        ):
            return super().require(value, dim)
        node = self.trace.nodes[index]
        params = node.params
        numbers = params["dimension_numbers"]
        if params["feature_group_count"] != 1:
            return super().require(value, dim)  # `_grouped.grouped_require`, as in any unit
        if dim != numbers.out_spec[1] or params["batch_group_count"] != 1:
            raise _Fail("a convolution's output split on another dimension")
        path, kernel_dim = self.kernel(node, numbers.rhs_spec[0])
        self.member(path, kernel_dim, "column")
        self.set_split(value, dim)
        return None


def find_conv_units(
    trace: Trace, size: int, taken: frozenset[str] = frozenset(), seeds_not: frozenset[str] = frozenset()
) -> tuple[Unit, ...]:
    """The units of `trace` that start at a convolution, over a model axis of `size`, in trace order.

    A convolution whose kernel is in `seeds_not` starts no unit (it may still end one).
    """
    if size <= 1:
        return ()
    dynamic = _dynamic(trace)
    claimed = set(taken)
    units: list[Unit] = []
    for node in trace.nodes:
        if node.primitive != CONV or node.params["feature_group_count"] != 1:
            continue
        grower = _ConvGrower(trace, size, claimed, dynamic)
        try:
            grower.seed_conv(node)
        except _Fail:
            continue
        state = grower.state
        if next(iter(state.members), None) in seeds_not:
            continue
        if "row" not in {role for _, role in state.members.values()} or not _uses_inside(trace, state):
            continue
        members = tuple(Member(p, d, r) for p, (d, r) in state.members.items())
        claimed.update(state.members)
        after = tuple(p for p in find_added(trace, state.rows) if p not in state.members)
        units.append(Unit(unit_name(members), "conv", members, (), after))
    return tuple(units)


def conv_units(ledger: Ledger, setting: Setting) -> None:
    """Splits the channels of every convolution unit over the model axis."""
    if setting.trace is None:
        return
    variables = setting.variables
    decided = frozenset(p for p in variables if ledger.decided(p))
    for unit in _units_past_small_seeds(setting, decided):
        members = _members(setting, unit)
        if members is None:
            continue
        name = setting.display(unit.name)
        whole = _whole_note(setting, unit, members)
        if whole is not None:
            for variable, _ in members:
                ledger.record(variable.path, (None,) * len(variable.shape), whole)
            continue
        kept = must_stay_split(setting, unit)
        for variable, member in members:
            axes = tuple(setting.axis if i == member.dim else None for i in range(len(variable.shape)))
            note = _notes.conv(member.role, name, setting.axis)
            ledger.record(variable.path, axes, note, unit=name, keep_split=kept)
        for path in unit.after:
            if path in variables and not ledger.decided(path):
                ledger.record(path, (None,) * len(variables[path].shape), _notes.conv_after(name))
        ledger.conv_units.add(name)


def _units_past_small_seeds(setting: Setting, decided: frozenset[str]) -> tuple[Unit, ...]:
    """The conv units that split the most weights, found again without the seeds too small to split.

    Convolutions pair greedily in trace order: a small first convolution (an RGB stem's 864
    weights) pairs with the second and the unit stays whole (`replicate_below`), and the third
    pairs with a head too small to split. Found again without such small seeds, the second pairs
    with the third. Kept only where that splits more weights: in a ResNet the greedy units run
    along the residual stream and split more.
    """
    variables, trace = setting.variables, setting.trace
    seeds_not: frozenset[str] = frozenset()
    best, best_split = None, -1
    while True:
        units = find_conv_units(trace, setting.size, decided, seeds_not)
        split = sum(_split_weights(setting, unit) for unit in units)
        if split > best_split:
            best, best_split = units, split
        small = {
            unit.members[0].path
            for unit in units
            if unit.members[0].path in variables
            and math.prod(variables[unit.members[0].path].shape) < setting.replicate_below
            and not must_stay_split(setting, unit)
        }
        if small <= seeds_not:
            return best
        seeds_not |= small


def _members(setting: Setting, unit: Unit) -> list[tuple[keras.Variable, Member]] | None:
    """The unit's variables with their roles, or `None` when one is not a variable of the model."""
    members = [(setting.variables[m.path], m) for m in unit.members if m.path in setting.variables]
    return members if len(members) == len(unit.members) else None


def _whole_note(setting: Setting, unit: Unit, members: list[tuple[keras.Variable, Member]]) -> str | None:
    """Why `unit` stays whole (channels that do not divide, a kernel too small to split), or `None`."""
    name = setting.display(unit.name)
    indivisible = [(v, m) for v, m in members if v.shape[m.dim] % setting.size]
    if indivisible:
        variable, member = indivisible[0]
        return _notes.conv_indivisible(name, variable.shape[member.dim], setting.axis, setting.size)
    small = [(v, m) for v, m in members if m.role != "bias" and math.prod(v.shape) < setting.replicate_below]
    if small and not must_stay_split(setting, unit):
        # `kml.ModelParallel` keeps a suggested kernel this small whole: the unit would not be one.
        label = setting.display(small[0][0].path)
        return _notes.too_small(label, math.prod(small[0][0].shape), setting.replicate_below)
    return None


def _split_weights(setting: Setting, unit: Unit) -> int:
    """The weights `conv_units` splits in `unit`: none when it stays whole (`_whole_note`)."""
    members = _members(setting, unit)
    if members is None or _whole_note(setting, unit, members) is not None:
        return 0
    return sum(math.prod(v.shape) for v, _ in members)


def lone_conv_reads(trace: Trace, path: str, size: int) -> list[tuple[object, int]]:
    """`(node, kernel input-channel dimension)` of each convolution of one group reading kernel `path`."""
    reads = []
    for node in trace.nodes:
        if node.primitive != CONV or node.params["feature_group_count"] != 1:
            continue
        found = conv_kernel(trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[1], size)
        if found is not None and found[0] == path:
            reads.append((node, found[1]))
    return reads


def lone_convs(ledger: Ledger, setting: Setting) -> None:
    """Splits a convolution no unit took, reading an activation (not the input), on its input channels.

    Each device convolves its slice of the (whole) input's channels with its
    slice of the kernel, and the partial outputs are all-reduced; backward,
    the input gradient comes out split over the channels and is gathered.

    Not one whose input a concatenation assembles (through channel-wise operations: a
    DenseNet's transition convolution after its dense block's batch norm). XLA carries the
    split back through the concatenation into every feature map it joins, which it then
    reshuffles each layer with all-to-alls and permutes (measured, keras.applications
    DenseNet121 at 32 × 32 on 2×4: 21.5 MB a step over `model` compiled for 11.4 MB predicted,
    28.9 MB in all; with its three transition convolutions whole 19.8 MB in all, predicted
    to the byte on both axes).
    """
    trace = setting.trace
    if trace is None:
        return
    for variable in setting.model.trainable_weights:
        if ledger.decided(variable.path) or len(variable.shape) < 3:
            continue
        reads = lone_conv_reads(trace, variable.path, setting.size)
        if len(reads) != 1 or trace.from_input(reads[0][0].inputs[0]):
            continue
        _, dim = reads[0]
        if variable.shape[dim] % setting.size or math.prod(variable.shape) < setting.replicate_below:
            continue
        name = setting.display(variable.path)
        assembled = _assembled(trace, reads[0][0].inputs[0])
        if assembled:
            note = _notes.conv_lone_assembled(name, setting.axis, assembled)
            ledger.record(variable.path, (None,) * len(variable.shape), note)
            continue
        axes = tuple(setting.axis if i == dim else None for i in range(len(variable.shape)))
        ledger.record(variable.path, axes, _notes.conv_lone(name, setting.axis), unit=name)
        ledger.lone_convs.add(name)


def _assembled(trace: Trace, value: int) -> str:
    """How `value` is assembled, through channel-wise operations (a norm, an activation): `"concatenate"`
    (feature maps joined), `"reshape"` (a token sequence laid out as an image), else `""`."""
    stack, seen = [value], set()
    while stack:
        current = stack.pop()
        index = trace.producer.get(current)
        if current in seen or index is None:
            continue
        seen.add(current)
        node = trace.nodes[index]
        if node.primitive == "concatenate":
            return "concatenate"
        if node.primitive == "reshape" and len(trace.shapes[node.inputs[0]]) < len(trace.shapes[current]):
            return "reshape"
        if node.primitive == "pad":  # a convolution's own padding, spatial
            stack.append(node.inputs[0])
        elif node.primitive in ELEMENTWISE:
            stack.extend(v for v in node.inputs if v >= 0 and trace.shapes[v] == trace.shapes[current])
    return ""


#: The Keras layers whose output `input_convs` can keep whole with a layer-output rule.
CONV_LAYERS = (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D)


def input_convs(ledger: Ledger, setting: Setting) -> None:
    """Splits the output channels of a convolution layer reading the model's input that no unit took.

    A vision transformer's patch embedding (stride = kernel, output channels =
    the hidden size, reshaped into tokens) is the commonest: a Keras `Conv1D`,
    `Conv2D` or `Conv3D` of one feature group, called once on the batch (or
    on what no trainable weight computes from it: rescaled, normalised), whose
    output channels divide by the model axis and whose kernel is at least as
    large as the largest kernel the plan splits (as a final layer's,
    `_by_trace.final_layers`) and `replicate_below`. Its
    kernel and bias are split on the output channels and a layer-output rule
    keeps its output whole over the model axis: XLA all-gathers the output
    there (otherwise it carries the split into the layers after, which it
    then computes split on their features). Backward, each device takes its
    channels of the output gradient: no traffic; the kernel's gradient is
    all-reduced over the batch axis at `1/model` of its size. A smaller one (a
    ResNet's stem, a ViT-B/16's patch conv beside its 768 × 3,072 MLP kernels)
    stays replicated: its gathered output would cost more than it saves. A budget
    can still split its kernel over the batch axis (or both), gathered once forward
    (`_one_weight.OneWeightCosts._reads_the_input`).
    """
    trace = setting.trace
    if trace is None or setting.size <= 1:
        return
    variables = setting.variables
    largest = max((math.prod(variables[p].shape) for p in ledger.split_paths()), default=0)
    layers = [layer for layer in _compat.sublayers(setting.model) if isinstance(layer, CONV_LAYERS)]
    for layer in layers:
        kernel = layer.kernel
        if ledger.decided(kernel.path) or not kernel.trainable or layer.groups != 1:
            continue
        reads = [
            (node, found[1])
            for node in trace.nodes
            if node.primitive == CONV
            and (found := conv_kernel(trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[0], 1))
            and found[0] == kernel.path
        ]
        if len(reads) != 1 or reads[0][0].inputs[0] in trace.trained:  # its input gets a gradient
            continue
        (node, dim), channels = reads[0], kernel.shape[reads[0][1]]
        count = math.prod(kernel.shape)
        if count < setting.replicate_below:
            note = _notes.too_small(setting.display(kernel.path), count, setting.replicate_below)
            ledger.record(kernel.path, (None,) * len(kernel.shape), note)
            continue
        if channels % setting.size or not count:
            continue
        if count < largest or not largest:
            ledger.record(
                kernel.path, (None,) * len(kernel.shape), _notes.conv_input_replicated(count, largest)
            )
            continue
        name = setting.display(kernel.path)
        axes = tuple(setting.axis if i == dim else None for i in range(len(kernel.shape)))
        ledger.record(kernel.path, axes, _notes.conv_input(name, setting.axis), unit=name)
        if layer.bias is not None and not ledger.decided(layer.bias.path):
            ledger.record(layer.bias.path, (setting.axis,), _notes.conv_input(name, setting.axis), unit=name)
        ledger.output_whole(layer.path, len(trace.shapes[node.outputs[0]]), _notes.INPUT_CONV_OUTPUT)
        ledger.input_convs.add(name)


def lone_grouped_convs(ledger: Ledger, setting: Setting) -> None:
    """Splits the channels of a grouped convolution's kernel that no unit took, on a mesh splitting the batch.

    keras-hub's Qwen 3.5 gated delta-net convolves a projection's output depthwise and
    then slices its query, key and value out of the channels, so no unit runs through it.
    With the channels whole on each device XLA sums the kernel gradient over the whole
    mesh (`kml.GroupedConvWarning`); with the kernel split on its channels, XLA carries
    the split back into the projection writing the convolution's input and on into what
    reads its output, and computes the gradient right (measured, jax 0.10.2: `fit` equals
    one device on 2x4 and 4x2). The traffic of that propagation is not predicted: the unit
    costs its gradient's all-reduce alone (docs/status.md). A convolution of the model's
    input keeps the warning: XLA cannot split a batch it is given (`tests/test_convs.py`).
    """
    trace = setting.trace
    if trace is None or setting.size <= 1 or setting.batch_size <= 1:
        return
    variables = setting.variables
    for node in trace.nodes:
        groups = node.params.get("feature_group_count", 1) if node.primitive == CONV else 1
        if groups == 1 or groups % setting.size or trace.from_input(node.inputs[0]):
            continue
        found = conv_kernel(trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[0], setting.size)
        if found is None or found[0] not in variables or ledger.decided(found[0]):
            continue
        path, dim, _ = found
        if variables[path].shape[dim] % setting.size:
            continue
        name = setting.display(path)
        axes = tuple(setting.axis if i == dim else None for i in range(len(variables[path].shape)))
        ledger.record(path, axes, _notes.conv_grouped_lone(name, setting.axis), unit=name, keep_split=True)
        ledger.lone_grouped.add(name)
