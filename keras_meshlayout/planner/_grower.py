"""The growth of one split over the model axis through the traced dataflow (`find_units`' engine).

A split starts at a projection's output features and is followed forward through
every operation that keeps it whole on each device (element-wise operations,
broadcasts, reshapes and transposes that keep the split dimension's blocks,
reductions over other dimensions, dynamic slices and updates that keep it whole,
einsums over it as a batch dimension, loops over a sequence: `_scan`, grouped and
depthwise convolutions over the split channels: `_grouped`) until every path
ends in a projection that sums over the split dimension. Operands met on the way are
required to be split the same way, back through what computes them (a bias, a second
projection as another column, a per-head reduction of other split values). The growth
fails (`_Fail`) as soon as the split would reach the model's output, a reduction over
it, or anything else that would need the whole dimension.
"""

from __future__ import annotations

import copy
import dataclasses

from . import _grouped, _scan
from ._scan import Fail as _Fail
from ._trace import Trace, _reshape_dim

__all__ = ["ELEMENTWISE", "REDUCTIONS"]

ELEMENTWISE = frozenset(
    """add add_any sub mul div rem pow max min exp exp2 log log1p expm1 tanh logistic erf erfc
    erf_inv neg abs sign sqrt rsqrt cbrt integer_pow square sin cos tan atan2 atan asin acos sinh
    cosh asinh acosh atanh convert_element_type copy copy_p reduce_precision select_n clamp eq ne lt
    le gt ge and or not xor is_finite nextafter floor ceil round stop_gradient real imag""".split()
)
REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)


@dataclasses.dataclass
class _State:
    split: dict[int, int] = dataclasses.field(default_factory=dict)
    members: dict[str, tuple[int, str]] = dataclasses.field(default_factory=dict)
    visited: set[int] = dataclasses.field(default_factory=set)
    pending: list[int] = dataclasses.field(default_factory=list)
    heads_dots: int = 0
    whole: list[str] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)


class _Grower:
    def __init__(
        self,
        trace: Trace,
        size: int,
        taken: set[str],
        dynamic: set[int],
        boundary: _scan.Boundary | None = None,
    ) -> None:
        self.trace = trace
        self.m = size
        self.taken = taken
        self.dynamic = dynamic
        #: A loop body's edges (`_scan`): its inputs and outputs are recorded there, not failed on.
        self.boundary = boundary
        self.state = _State()

    def inside(self, body: Trace, boundary: _scan.Boundary) -> _Grower:
        """A grower of the same rules over a loop's body (`_scan.through_scan`)."""
        return _Grower(body, self.m, self.taken, _dynamic(body), boundary)

    # -- bookkeeping ---------------------------------------------------------------

    def member(self, path: str, dim: int, role: str) -> None:
        if path in self.taken:
            raise _Fail(f"{path} is in another unit")
        known = self.state.members.get(path)
        if known is not None and known[0] != dim:
            raise _Fail(f"{path} split two ways")
        if known is None or (known[1] == "bias" and role != "bias"):
            self.state.members[path] = (dim, role)

    def _variable_shape(self, path: str) -> tuple[int, ...]:
        for value, name in self.trace.variables.items():
            if name == path:
                return self.trace.shapes[value]
        raise _Fail(path)  # pragma: no cover - every member comes from the trace

    def set_split(self, value: int, dim: int) -> None:
        known = self.state.split.get(value)
        if known is not None:
            if known != dim:
                raise _Fail("a value split on two dimensions")
            return
        if self.boundary is None and value in self.trace.outputs:
            raise _Fail("the split reaches the model's output")
        self.state.split[value] = dim
        self.state.pending.append(value)
        if self.boundary is not None:
            self.boundary.on_split(self, value, dim)

    # -- growing ---------------------------------------------------------------------

    def seed(self, path: str) -> None:
        """Starts a unit at every projection reading `path`, its first free dimension split."""
        uses = [u for u in self.trace.uses.get(path, ()) if u.kind == "matmul"]
        if not uses or len(uses) != len(self.trace.uses[path]):
            raise _Fail("not only a projection weight")
        rank = len(self._variable_shape(path))
        free = [d for d in range(rank) if d not in uses[0].contracted and d not in uses[0].batch]
        if not free or rank < 2:
            raise _Fail("no output feature")
        dim = free[0]
        for use in uses:
            self._column(self.trace.nodes[use.node], path, dim)
        self.run()

    def _column(self, node, path: str, dim: int) -> None:
        """A projection reading `path`, its kernel dimension `dim` split: its output is split."""
        (lhs_c, rhs_c), (lhs_b, rhs_b) = node.params["dimension_numbers"]
        for side in (0, 1):
            weight = self.trace.weight_of(node.inputs[side])
            if weight is not None and weight[0] == path:
                break
        else:  # pragma: no cover
            raise _Fail("not a use")
        perm = weight[1]
        operand_dim = perm.index(dim)
        contracted, batch = (lhs_c, lhs_b) if side == 0 else (rhs_c, rhs_b)
        if operand_dim in contracted or operand_dim in batch:
            raise _Fail("the dimension is summed over")
        self.member(path, dim, "column")
        self.state.visited.add(node.index)
        self.set_split(node.outputs[0], _output_position(node, side, operand_dim, self.trace))

    def run(self) -> None:
        while self.state.pending:
            value = self.state.pending.pop()
            dim = self.state.split[value]
            for index in self.trace.consumers.get(value, ()):
                self.forward(self.trace.nodes[index], value, dim)

    def _reduction(self, node, value: int, dim: int) -> None:
        """`value`, split on `dim`, reduced: split on over other dimensions, else the unit fails.

        But an absolute maximum over the split features (an int8 projection's
        input quantizer): XLA all-reduces it over the model axis (`_costs`) and
        the path ends there, whole.
        """
        axes = tuple(node.params["axes"])
        if dim not in axes:
            self.set_split(node.outputs[0], dim - sum(a < dim for a in axes))
            return
        producer = self.trace.producer.get(value)
        absolute = producer is not None and self.trace.nodes[producer].primitive == "abs"
        if node.primitive != "reduce_max" or not absolute:
            raise _Fail("reduced over the split dimension")

    def forward(self, node, value: int, dim: int) -> None:
        """`value`, split on `dim`, is read by `node`: carry the split through it or end there."""
        self.state.visited.add(node.index)
        name, params, trace = node.primitive, node.params, self.trace
        if name == "dot_general":
            self._dot_forward(node, value, dim)
        elif name in ELEMENTWISE:
            for other in node.inputs:
                if other != value and self._operand_split(other, trace.shapes[node.outputs[0]], dim):
                    self.require(other, dim)
            self.set_split(node.outputs[0], dim)
        elif name == "broadcast_in_dim":
            self.set_split(node.outputs[0], params["broadcast_dimensions"][dim])
        elif name == "transpose":
            self.set_split(node.outputs[0], tuple(params["permutation"]).index(dim))
        elif name == "reshape":
            out = _reshape_dim(trace.shapes[value], trace.shapes[node.outputs[0]], dim, self.m)
            if out is None:
                raise _Fail("reshape cuts across the split")
            self.set_split(node.outputs[0], out)
        elif name in REDUCTIONS:
            self._reduction(node, value, dim)
        elif name == "squeeze":
            axes = tuple(params["dimensions"])
            self.set_split(node.outputs[0], dim - sum(a < dim for a in axes))
        elif name in ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"):
            if params["axis"] == dim:
                raise _Fail("accumulated over the split dimension")
            self.set_split(node.outputs[0], dim)
        elif name == "slice":
            shape = trace.shapes[value]
            strides = params.get("strides") or (1,) * len(shape)
            start, limit = params["start_indices"][dim], params["limit_indices"][dim]
            if start != 0 or limit != shape[dim] or strides[dim] != 1:
                raise _Fail("sliced along the split dimension")
            self.set_split(node.outputs[0], dim)
        elif name == "rev":
            if dim in tuple(params["dimensions"]):
                raise _Fail("reversed along the split dimension")
            self.set_split(node.outputs[0], dim)
        elif name == "pad":
            if tuple(params["padding_config"][dim]) != (0, 0, 0):
                raise _Fail("padded along the split dimension")
            self.require_all(node, dim)
            self.set_split(node.outputs[0], dim)
        elif name == "concatenate":
            if params["dimension"] == dim:
                raise _Fail("concatenated along the split dimension")
            self.require_all(node, dim)
            self.set_split(node.outputs[0], dim)
        elif name == "split":
            if params["axis"] == dim:
                raise _Fail("split along the split dimension")
            for out in node.outputs:
                self.set_split(out, dim)
        else:
            self._forward_more(node, value, dim)

    def _forward_more(self, node, value: int, dim: int) -> None:
        """`forward`'s dynamic slices and loops (`_scan`); anything else needs the whole dimension."""
        name, shape = node.primitive, self.trace.shapes[value]
        if name == "dynamic_slice" and value == node.inputs[0]:
            if node.params["slice_sizes"][dim] != shape[dim]:
                raise _Fail("sliced along the split dimension")
            self.set_split(node.outputs[0], dim)
        elif name == "dynamic_update_slice" and value in node.inputs[:2]:
            self._update(node, dim)
        elif name == "scan":
            positions = {p: dim for p, v in enumerate(node.inputs) if v == value}
            self.state.heads_dots += _scan.through_scan(self, node, positions, {})
        elif name == _grouped.CONV:
            _grouped.grouped_forward(self, node, value, dim)
        else:
            raise _Fail(f"{name} needs the whole dimension")

    def _update(self, node, dim: int) -> None:
        """A dynamic update of a value split on `dim` (or by one): both, and the result, split there.

        Only where the update covers the whole dimension (a step's output written into a
        sequence along another one): each device writes its own slice.
        """
        operand, update = node.inputs[:2]
        if self.trace.shapes[update][dim] != self.trace.shapes[operand][dim]:
            raise _Fail("updated along the split dimension")
        self.require(operand, dim)
        self.require(update, dim)
        self.set_split(node.outputs[0], dim)

    def _operand_split(self, operand: int, shape: tuple[int, ...], dim: int) -> bool:
        """Whether an element-wise operand must be split too (not a scalar, nor size 1 there)."""
        if operand < 0 or not self.trace.shapes[operand]:
            return False
        theirs = self.trace.shapes[operand]
        if len(theirs) != len(shape):
            raise _Fail("element-wise operands of different ranks")
        return theirs[dim] != 1

    def require_all(self, node, dim: int) -> None:
        for other in node.inputs:
            if other >= 0 and self.trace.shapes[other]:
                self.require(other, dim)

    def _dot_forward(self, node, value: int, dim: int) -> None:
        (lhs_c, rhs_c), (lhs_b, rhs_b) = node.params["dimension_numbers"]
        if node.inputs[0] == node.inputs[1]:
            raise _Fail("a value multiplied by itself")
        side = 0 if node.inputs[0] == value else 1
        other = node.inputs[1 - side]
        mine_c, mine_b = (lhs_c, lhs_b) if side == 0 else (rhs_c, rhs_b)
        other_c, other_b = (rhs_c, rhs_b) if side == 0 else (lhs_c, lhs_b)
        weight = self.trace.weight_of(other)
        if weight is not None:
            if dim not in mine_c:
                raise _Fail("a projection keeps the split dimension")
            path, perm = weight
            self.member(path, perm[other_c[tuple(mine_c).index(dim)]], "row")
            self.state.rows.append(node.outputs[0])
            return  # the row-parallel end: its output is summed over the model axis, whole
        if dim not in mine_b:
            raise _Fail("an einsum sums over or keeps a split free dimension")
        position = tuple(mine_b).index(dim)
        saved = copy.deepcopy(self.state)
        edges = None if self.boundary is None else (dict(self.boundary.entries), dict(self.boundary.exits))
        try:
            self.require(other, other_b[position])
        except _Fail:
            # Grouped-query key/value heads that do not divide: read whole beside split heads.
            self.state = saved
            if edges is not None:  # a loop body's edges as they were, too
                self.boundary.entries, self.boundary.exits = edges
            self.state.whole.extend(self._projections_into(other))
            self.state.visited.add(node.index)
        self.state.heads_dots += 1
        self.set_split(node.outputs[0], position)

    def _projections_into(self, value: int) -> list[str]:
        """The weights of the projections `value` is computed from, within a few operations."""
        found: list[str] = []
        stack, seen = [value], set()
        while stack and len(seen) < 64:
            current = stack.pop()
            if current in seen or current < 0:
                continue
            seen.add(current)
            node = self.trace.producer.get(current)
            if node is None:
                continue
            op = self.trace.nodes[node]
            if op.primitive == "dot_general":
                for operand in op.inputs:
                    weight = self.trace.weight_of(operand)
                    if weight is not None:
                        found.append(weight[0])
                continue
            stack.extend(op.inputs)
        return found

    def require(self, value: int, dim: int) -> None:
        """`value` is combined with a value split on `dim`: it must be split the same way."""
        state, trace = self.state, self.trace
        if value in state.split:
            if state.split[value] != dim:
                raise _Fail("an operand split another way")
            return
        if value not in self.dynamic:
            return  # a constant (a mask, a rotary table): each device slices its part
        if value in trace.variables:
            self.member(trace.variables[value], dim, "bias")
            self.set_split(value, dim)
            return
        index = trace.producer.get(value)
        if index is None and self.boundary is not None:
            self.set_split(value, dim)  # a loop body's input: required of the scan's operand outside
            return
        if index is None:
            raise _Fail("a model input would have to be split")
        node = trace.nodes[index]
        state.visited.add(index)
        name, params = node.primitive, node.params
        if name == "broadcast_in_dim":
            dims = tuple(params["broadcast_dimensions"])
            if dim in dims and trace.shapes[node.inputs[0]][dims.index(dim)] != 1:
                self.require(node.inputs[0], dims.index(dim))
                self.set_split(value, dim)
            return  # broadcast along the split: each device takes its slice
        if name in ELEMENTWISE:
            for operand in node.inputs:
                if self._operand_split(operand, trace.shapes[value], dim):
                    self.require(operand, dim)
        elif name == "transpose":
            self.require(node.inputs[0], tuple(params["permutation"])[dim])
        elif name == "reshape":
            inner = _reshape_dim(trace.shapes[value], trace.shapes[node.inputs[0]], dim, self.m)
            if inner is None:
                raise _Fail("reshape cuts across the split")
            self.require(node.inputs[0], inner)
        elif name == "dot_general":
            self._dot_backward(node, dim)
        else:
            self._require_more(node, value, dim)
        self.set_split(value, dim)

    def _require_more(self, node, value: int, dim: int) -> None:
        """`require` through reductions, squeezes, dynamic slices and updates, and loops (`_scan`)."""
        name, params, inner = node.primitive, node.params, node.inputs[0] if node.inputs else -1
        if (name in REDUCTIONS and name not in ("argmax", "argmin")) or name == "squeeze":
            # A reduction over other dimensions (a per-head sum), a squeeze: the input split the same.
            dropped = sorted(params["axes"] if name in REDUCTIONS else params["dimensions"])
            kept = [d for d in range(len(self.trace.shapes[inner])) if d not in dropped]
            self.require(inner, kept[dim])
        elif name == "dynamic_slice":
            if params["slice_sizes"][dim] != self.trace.shapes[inner][dim]:
                raise _Fail("sliced along the split dimension")
            self.require(inner, dim)
        elif name == "dynamic_update_slice":
            self._update(node, dim)
        elif name == "scan":
            positions = {p: dim for p, v in enumerate(node.outputs) if v == value}
            self.state.heads_dots += _scan.through_scan(self, node, {}, positions)
        elif name == _grouped.CONV:
            _grouped.grouped_require(self, node, dim)
        else:
            raise _Fail(f"{name} feeds the split")

    def _dot_backward(self, node, dim: int) -> None:
        (lhs_c, rhs_c), (lhs_b, rhs_b) = node.params["dimension_numbers"]
        for side in (0, 1):
            weight = self.trace.weight_of(node.inputs[side])
            if weight is None:
                continue
            path, perm = weight
            contracted, batch = (lhs_c, lhs_b) if side == 0 else (rhs_c, rhs_b)
            rank = len(self.trace.shapes[node.inputs[side]])
            free = [d for d in range(rank) if d not in contracted and d not in batch]
            for operand_dim in free:
                if _output_position(node, side, operand_dim, self.trace) == dim:
                    self.member(path, perm[operand_dim], "column")
                    self.state.visited.add(node.index)
                    return  # the caller marks the output split
            raise _Fail("the split would come from the activation side of a projection")
        if dim >= len(lhs_b):
            raise _Fail("the split would be a free dimension of an einsum")
        self.require(node.inputs[0], lhs_b[dim])
        self.require(node.inputs[1], rhs_b[dim])
        self.state.heads_dots += 1


def _output_position(node, side: int, operand_dim: int, trace: Trace) -> int:
    """Where a free dimension of a `dot_general` operand lands in its output."""
    (lhs_c, rhs_c), (lhs_b, rhs_b) = node.params["dimension_numbers"]
    lhs_rank = len(trace.shapes[node.inputs[0]])
    lhs_free = [d for d in range(lhs_rank) if d not in lhs_c and d not in lhs_b]
    rhs_rank = len(trace.shapes[node.inputs[1]])
    rhs_free = [d for d in range(rhs_rank) if d not in rhs_c and d not in rhs_b]
    if side == 0:
        return len(lhs_b) + lhs_free.index(operand_dim)
    return len(lhs_b) + len(lhs_free) + rhs_free.index(operand_dim)


def _dynamic(trace: Trace) -> set[int]:
    """Values computed from the batch or the variables (the rest are constants)."""
    dynamic = set(trace.inputs) | set(trace.variables)
    for node in trace.nodes:
        if any(v in dynamic for v in node.inputs):
            dynamic.update(node.outputs)
    return dynamic
