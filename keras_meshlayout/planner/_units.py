"""Stage 2: units of weights that split together, found in the traced dataflow.

A unit starts at a projection (a `dot_general` reading a weight) whose output
features are split over the model axis. The split is followed forward through
every operation that keeps it whole on each device (element-wise operations,
broadcasts, reshapes and transposes that keep the split dimension's blocks,
reductions over other dimensions, einsums over it as a batch dimension, loops
whose carried state keeps it: `_grower`, `_scan`) until
every path ends in a projection that sums over the split dimension: the
row-parallel end, whose output is all-reduced. Operands met on the way must be
split the same way: a bias is split with it, a second projection (the gate of
SwiGLU, the key and value of attention) joins the unit as another column, and
constants (masks, rotary tables) are sliced locally. The unit is rejected as
soon as the split would reach the model's output, a reduction over it (but an
absolute maximum: an int8 projection's input quantizer, whose maximum XLA
all-reduces), or anything else that would need the whole dimension.

It does not matter how the model wrote the computation: a `Dense` layer, a
custom layer's `ops.matmul`, the `*` operator or `ops.einsum` all trace to the
same primitives, so they give the same units.
"""

from __future__ import annotations

import dataclasses

from ._grower import _dynamic, _Fail, _Grower, _State
from ._trace import Trace

__all__ = ["Member", "Unit", "find_added", "find_units", "unit_name"]


@dataclasses.dataclass(frozen=True)
class Member:
    """One weight of a unit: the dimension split over the model axis and its role.

    Attributes:
        path: The variable path.
        dim: The dimension split over the model axis.
        role: `"column"` (output features split), `"row"` (input features split,
            output all-reduced) or `"bias"` (added to a split activation).
    """

    path: str
    dim: int
    role: str


@dataclasses.dataclass(frozen=True)
class Unit:
    """Weights that split over the model axis together.

    Attributes:
        name: `"gate × up → down"`, from the weights' paths.
        kind: `"pair"` (column → row projections) or `"attention"` (split over heads).
        members: The weights and how each splits.
        whole: Projections read beside the split heads but kept whole (grouped-query
            key/value heads too few to divide).
        after: Weights added to the row-parallel output after its all-reduce (biases).
    """

    name: str
    kind: str
    members: tuple[Member, ...]
    whole: tuple[str, ...] = ()
    after: tuple[str, ...] = ()


def find_units(trace: Trace, size: int) -> tuple[Unit, ...]:
    """The units of `trace` that split over a model axis of `size` devices, in trace order."""
    if size <= 1:
        return ()
    dynamic = _dynamic(trace)
    taken: set[str] = set()
    units: list[Unit] = []
    seeds = []
    for node in trace.nodes:
        if node.primitive != "dot_general":
            continue
        for operand in node.inputs:
            weight = trace.weight_of(operand)
            if weight is not None and weight[0] not in seeds:
                seeds.append(weight[0])
    for path in seeds:
        if path in taken:
            continue
        grower = _Grower(trace, size, taken, dynamic)
        try:
            grower.seed(path)
        except _Fail:
            continue
        state = grower.state
        roles = {role for _, role in state.members.values()}
        if "row" not in roles or not _uses_inside(trace, state):
            continue
        members = tuple(Member(p, d, r) for p, (d, r) in state.members.items())
        taken.update(state.members)
        kind = "attention" if state.heads_dots else "pair"
        whole = tuple(dict.fromkeys(p for p in state.whole if p not in state.members))
        after = tuple(p for p in find_added(trace, state.rows) if p not in state.members)
        units.append(Unit(unit_name(members), kind, members, whole, after))
    return tuple(units)


def find_added(trace: Trace, rows: list[int]) -> list[str]:
    """Variables added (broadcast, cast) to these outputs of projections: their biases."""
    found = []
    for value in rows:
        for index in trace.consumers.get(value, ()):
            node = trace.nodes[index]
            if node.primitive not in ("add", "add_any"):
                continue
            for operand in node.inputs:
                while operand >= 0 and operand not in trace.variables and operand in trace.producer:
                    producer = trace.nodes[trace.producer[operand]]
                    if producer.primitive not in ("broadcast_in_dim", "convert_element_type", "reshape"):
                        break
                    operand = producer.inputs[0]
                if operand in trace.variables:
                    found.append(trace.variables[operand])
    return found


def _uses_inside(trace: Trace, state: _State) -> bool:
    """Whether every read of every member weight is one the unit accounted for.

    On its way to them a weight may be cast, transposed, scaled and clipped by scalars (float8's
    quantize-dequantize) or unpacked and dequantized (int4: `Trace.weight_of`), and its absolute
    maximum taken (float8's amax history: all-reduced over the split, one float32).
    """
    for path in state.members:
        values = [v for v, name in trace.variables.items() if name == path]
        stack = list(values)
        while stack:
            value = stack.pop()
            for index in trace.consumers.get(value, ()):
                node = trace.nodes[index]
                if index in state.visited or _absolute_maximum(trace, node):
                    continue
                if node.primitive in ("convert_element_type", "copy", "copy_p", "transpose"):
                    stack.extend(node.outputs)
                    continue
                read = trace.weight_of(node.outputs[0]) if len(node.outputs) == 1 else None
                if read is not None and read[0] == path:  # scaled, or an int4 kernel unpacked
                    stack.extend(node.outputs)
                    continue
                return False
    return True


def _absolute_maximum(trace: Trace, node) -> bool:
    """Whether `node` takes an absolute value only read by maxima to a scalar."""
    readers = [trace.nodes[i] for v in node.outputs for i in trace.consumers.get(v, ())]
    return (
        node.primitive == "abs"
        and bool(readers)
        and all(r.primitive == "reduce_max" and not trace.shapes[r.outputs[0]] for r in readers)
    )


def unit_name(members: tuple[Member, ...]) -> str:
    """`"gate × up → down"`: the members' short paths, columns then rows."""
    columns = [_short(m.path) for m in members if m.role == "column"]
    rows = [_short(m.path) for m in members if m.role == "row"]
    return f"{' × '.join(dict.fromkeys(columns))} → {' × '.join(dict.fromkeys(rows))}"


def _short(path: str) -> str:
    """A weight's readable name: its layer's path for `.../kernel`, else the path."""
    head, _, tail = path.rpartition("/")
    return head if head and tail in ("kernel", "embeddings", "weight", "w") else path
