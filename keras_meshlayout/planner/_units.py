"""Stage 2: units of weights that split together, found in the traced dataflow.

A unit starts at a projection (a `dot_general` reading a weight) whose output
features are split over the model axis. The split is followed forward through
every operation that keeps it whole on each device (element-wise operations,
broadcasts, reshapes and transposes that keep the split dimension's blocks,
reductions over other dimensions, einsums over it as a batch dimension) until
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

import copy
import dataclasses
import math

from ._trace import Trace

__all__ = ["Member", "Unit", "find_added", "find_units"]

ELEMENTWISE = frozenset(
    """add add_any sub mul div rem pow max min exp exp2 log log1p expm1 tanh logistic erf erfc
    erf_inv neg abs sign sqrt rsqrt cbrt integer_pow square sin cos tan atan2 atan asin acos sinh
    cosh asinh acosh atanh convert_element_type copy copy_p reduce_precision select_n clamp eq ne lt
    le gt ge and or not xor is_finite nextafter floor ceil round stop_gradient real imag""".split()
)
REDUCTIONS = frozenset(
    "reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or argmax argmin".split()
)


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


class _Fail(Exception):
    pass


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
    def __init__(self, trace: Trace, size: int, taken: set[str], dynamic: set[int]) -> None:
        self.trace = trace
        self.m = size
        self.taken = taken
        self.dynamic = dynamic
        self.state = _State()

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
        if value in self.trace.outputs:
            raise _Fail("the split reaches the model's output")
        self.state.split[value] = dim
        self.state.pending.append(value)

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
            raise _Fail(f"{name} needs the whole dimension")

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
        try:
            self.require(other, other_b[position])
        except _Fail:
            # Grouped-query key/value heads that do not divide: read whole beside split heads.
            self.state = saved
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
            raise _Fail(f"{name} feeds the split")
        self.set_split(value, dim)

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


def _reshape_dim(before: tuple[int, ...], after: tuple[int, ...], dim: int, size: int) -> int | None:
    """The dimension of `after` whose blocks over `size` devices hold the same elements as `dim`'s."""
    prefix = math.prod(before[:dim])
    for index in range(len(after)):
        here = math.prod(after[:index])
        if here > prefix:
            return None
        if here == prefix and after[index] != 1:
            return index if after[index] % size == 0 and before[dim] % size == 0 else None
    return None


def _dynamic(trace: Trace) -> set[int]:
    """Values computed from the batch or the variables (the rest are constants)."""
    dynamic = set(trace.inputs) | set(trace.variables)
    for node in trace.nodes:
        if any(v in dynamic for v in node.inputs):
            dynamic.update(node.outputs)
    return dynamic


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
        units.append(Unit(_name(members), kind, members, whole, after))
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
    """Whether every read of every member weight is one the unit accounted for."""
    for path in state.members:
        values = [v for v, name in trace.variables.items() if name == path]
        stack = list(values)
        while stack:
            value = stack.pop()
            for index in trace.consumers.get(value, ()):
                node = trace.nodes[index]
                if index in state.visited:
                    continue
                if node.primitive in ("convert_element_type", "copy", "copy_p", "transpose"):
                    stack.extend(node.outputs)
                    continue
                return False
    return True


def _name(members: tuple[Member, ...]) -> str:
    columns = [_short(m.path) for m in members if m.role == "column"]
    rows = [_short(m.path) for m in members if m.role == "row"]
    return f"{' × '.join(dict.fromkeys(columns))} → {' × '.join(dict.fromkeys(rows))}"


def _short(path: str) -> str:
    """A weight's readable name: its layer's path for `.../kernel`, else the path."""
    head, _, tail = path.rpartition("/")
    return head if head and tail in ("kernel", "embeddings", "weight", "w") else path
