"""What XLA sums over the batch axis: where the batch's dimension runs through a traced step.

`batch_sums(trace)` reads the forward `Trace` and says, per trainable weight, how
many times its gradient is all-reduced over the batch axis, and which other
values' gradients are. Measured on XLA:CPU (2×4, keras-hub ALBERT, DeBERTaV3,
FNet, XLNet, RWKV-7, T5 and the zoo's other rows, `tests/test_zoo.py`): the
partitioner sums a gradient over the batch axis where the batch's dimension
first meets a value that has none, once per such meeting, and never adds two
partial sums before their all-reduce:

- a weight read by an operation whose output carries the batch (a projection,
  a norm's scale, a look-up, a position table broadcast over the batch) has its
  gradient all-reduced once per read: a layer called several times (ALBERT's one
  shared block) or a table read in several places (T5's shared embedding) sends
  its gradient once per call; a read through a slice sends the rows read;
- a weight read only where the batch is not yet (a norm over a relative-position
  table before it is repeated over the batch, as DeBERTa's) sends nothing; the
  value that then meets the batch is all-reduced instead, once per meeting. When
  that value is computed from one weight of its size (a batch norm's scale times
  its moving statistics, traced for inference; Gemma's one plus a scale), it
  counts as that weight's read, so the weight's split shrinks it. Otherwise it is
  counted where it meets the batch (`met`: the value and the node), and the costs
  divide it by the model-axis split it meets there: T5's relative-position bias,
  added to the attention scores split over their heads, is summed in the scores'
  shards (256 bytes per bias on 2×4, not its 1,024);
- a fast Fourier transform of a batch-split value (FNet's token mixing) is
  computed on the whole batch: its operand is all-gathered over the batch axis
  forward and again backward;
- a `top_k` of a batch-split value (a mixture-of-experts router choosing each
  token's experts) is computed on the whole batch too: its operand (the router's
  `(tokens, experts)` probabilities) is all-gathered over the batch axis forward,
  once per `top_k`, and nothing is sent for it backward;
- a product of two batch-split values whose batch dimensions both stay free (a
  contrastive head's image × text similarity, `text @ imageᵀ`, batch × batch): its
  second operand is gathered whole and its gradient summed (`crossed`); on a batch axis
  at least as large as the model axis, over the batch axis (all-gather forward, all-reduce
  backward); on a smaller one XLA:CPU spreads it over the model axis too (measured: a
  two-tower model, 8 to 64 rows, 2×4, 4×2 and 8×1; keras-hub CLIP);
- an auxiliary loss that reduces over the batch (`add_loss` of a router's
  load-balancing loss: the fraction of tokens sent to each expert, the mean
  router probability, a padding mask's count) has each reduction's partial sums
  all-reduced over the batch axis forward; its own `top_k` gathers as above.
  Keras adds these losses only when training, so they are read off a second,
  training-mode trace (`Trace.auxiliary`), from the operations only the losses
  need (measured on keras-hub Mixtral, QwenMoe, Qwen3Moe and GPT-OSS, 2×4).

The batch's dimension starts at the first dimension of every input and follows
the dataflow (element-wise operations, broadcasts, reshapes, a merged batch split
again, transposes, stacks and unstacks, dot products' batch and free dimensions),
and back from a value that carries it to the operands whose dimension lines up
with it (XLA's propagation runs both ways: a relative-position table repeated over
the batch carries it from the repeat on); a reduction over it ends it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType

import numpy as np

from ._trace import Node, Trace, trace_body

__all__ = ["BatchSums", "batch_sums"]

#: Operations that move a weight into place without computing from it: its reads are what follows.
_MOVES = frozenset(
    "convert_element_type copy copy_p reduce_precision reshape transpose squeeze expand_dims "
    "broadcast_in_dim slice dynamic_slice".split()
)
_SLICES = frozenset(("slice", "dynamic_slice"))


@dataclasses.dataclass(frozen=True)
class BatchSums:
    """Gradient all-reduces over the batch axis, read off a forward trace.

    Attributes:
        reads: Per trained variable path, how many of its gradients are summed over
            the batch axis (one per read that meets the batch; a read through a slice
            counts the fraction of the variable it reads).
        meetings: Bytes (whole, before any split over the model axis) of each
            weight-computed value whose gradient is summed over the batch axis where it
            meets the batch, in float32 at least.
        gathered: Bytes of each value XLA all-gathers over the batch axis, whole (the
            operands of Fourier transforms), once forward and once backward.
        routed: Bytes of each value all-gathered over the batch axis, whole, forward only
            (the operands of `top_k`s of batch-split values: a router's choices).
        reduced: Bytes of each auxiliary loss's reduction over the batch, all-reduced over
            the batch axis forward.
        met: Per entry of `meetings`, the value and the node where it meets the batch.
        crossed: Bytes (whole) and item size of the second operand of each product of two
            batch-split values whose batch dimensions both stay free (batch × batch).
    """

    reads: Mapping[str, float]
    meetings: tuple[float, ...]
    gathered: tuple[float, ...]
    routed: tuple[float, ...] = ()
    reduced: tuple[float, ...] = ()
    met: tuple[tuple[int, int], ...] = ()
    crossed: tuple[tuple[float, int], ...] = ()


def batch_sums(trace: Trace) -> BatchSums:
    """Where `trace`'s gradients are summed over the batch axis (see the module docstring)."""
    live, fed, batch = _live(trace), _fed(trace), _batch_dims(trace)
    reads, moved = _reads(trace, live, batch)
    meetings, gathered, met = [], [], []
    for node in trace.nodes:
        if not live[node.index] or not any(out in batch for out in node.outputs):
            continue
        if node.primitive == "fft" and node.inputs[0] in batch:
            gathered.append(_size(trace, node.inputs[0]) * np.dtype(trace.dtypes[node.inputs[0]]).itemsize)
        for value in node.inputs:
            if value < 0 or value not in trace.trained or value in batch or value in fed or value in moved:
                continue
            source = _source(trace, value)
            if source is not None:  # a weight computed on (a norm's scale times its statistics): its read
                reads[source] += 1.0
            else:
                itemsize = max(np.dtype(trace.dtypes[value]).itemsize, 4)
                meetings.append(float(_size(trace, value) * itemsize))
                met.append((value, node.index))
    # Variables sharing a path (two layers of one name) share its count.
    shared = collections.Counter(trace.variables.values())
    counts = {path: count / shared[path] for path, count in reads.items()}
    routed = _routed(trace, live, batch)
    reduced: list[float] = []
    if trace.auxiliary is not None:
        more, reduced = _auxiliary(trace.auxiliary)
        routed += more
    return BatchSums(
        MappingProxyType(counts),
        tuple(meetings),
        tuple(gathered),
        tuple(routed),
        tuple(reduced),
        tuple(met),
        _crossed(trace, live, batch),
    )


def _crossed(trace: Trace, live: list[bool], batch: Mapping[int, int]) -> tuple[tuple[float, int], ...]:
    """Bytes and item size of the second operand of each live product of two batch-split values."""
    crossed = []
    for node in trace.nodes:
        if not live[node.index] or node.primitive != "dot_general" or len(node.inputs) != 2:
            continue
        lhs, rhs = node.inputs
        (lc, rc), (lb, rb) = node.params["dimension_numbers"]
        if lhs in batch and rhs in batch and batch[lhs] not in (*lc, *lb) and batch[rhs] not in (*rc, *rb):
            item = np.dtype(trace.dtypes[rhs]).itemsize
            crossed.append((float(_size(trace, rhs) * item), item))
    return tuple(crossed)


def _routed(trace: Trace, live: list[bool], batch: Mapping[int, int]) -> list[float]:
    """Bytes of the operand of each live `top_k` of a batch-split value: gathered over the batch axis."""
    return [
        float(_size(trace, node.inputs[0]) * np.dtype(trace.dtypes[node.inputs[0]]).itemsize)
        for node in trace.nodes
        if live[node.index] and node.primitive == "top_k" and node.inputs[0] in batch
    ]


def _auxiliary(trace: Trace) -> tuple[list[float], list[float]]:
    """The `top_k` gathers and the reductions over the batch that only the auxiliary losses need.

    What the model's outputs need too is the inference trace's, counted there.
    """
    for_losses = _live(dataclasses.replace(trace, outputs=trace.losses))
    model_outputs = tuple(v for v in trace.outputs if v not in set(trace.losses))
    for_outputs = _live(dataclasses.replace(trace, outputs=model_outputs))
    only = [a and not b for a, b in zip(for_losses, for_outputs, strict=True)]
    batch = _batch_dims(trace)
    reduced = []
    for node in trace.nodes:
        value = node.inputs[0] if node.inputs else -1
        if not only[node.index] or not node.primitive.startswith("reduce_") or value not in batch:
            continue
        if batch[value] in tuple(node.params.get("axes", ())):
            out = node.outputs[0]
            reduced.append(float(max(_size(trace, out), 1) * np.dtype(trace.dtypes[out]).itemsize))
    return _routed(trace, only, batch), reduced


def _reads(trace: Trace, live: list[bool], batch: Mapping[int, int]) -> tuple[dict[str, float], set[int]]:
    """Per trained variable, its reads that meet the batch; and the values that only move a weight."""
    reads: dict[str, float] = collections.defaultdict(float)
    moved: set[int] = set()
    for value, path in trace.variables.items():
        if value not in trace.trained:
            continue
        stack = [(value, 1.0)]
        while stack:
            current, fraction = stack.pop()
            moved.add(current)
            for index in trace.consumers.get(current, ()):
                node = trace.nodes[index]
                if not live[index]:
                    continue
                out = node.outputs[0]
                if any(o in batch for o in node.outputs):  # a loop's carried counter comes first
                    reads[path] += fraction
                elif node.primitive in _MOVES and len(node.outputs) == 1:
                    shrink = min(_size(trace, out) / max(_size(trace, current), 1), 1.0)
                    stack.append((out, fraction * shrink if node.primitive in _SLICES else fraction))
    return reads, moved


def _source(trace: Trace, value: int) -> str | None:
    """The nearest trained variable `value` is computed from that has as many elements, if any.

    A norm's scale times its moving statistics (a batch norm traced for inference), one plus
    a scale (Gemma's norms): the gradient summed is that variable's.
    """
    size, seen, frontier = _size(trace, value), {value}, [value]
    while frontier:
        following = []
        for current in frontier:
            if current in trace.variables:
                if _size(trace, current) == size:
                    return trace.variables[current]
                continue
            producer = trace.producer.get(current)
            for operand in trace.nodes[producer].inputs if producer is not None else ():
                if operand >= 0 and operand in trace.trained and operand not in seen:
                    seen.add(operand)
                    following.append(operand)
        frontier = following
    return None


def _size(trace: Trace, value: int) -> int:
    return math.prod(trace.shapes[value])


def _live(trace: Trace) -> list[bool]:
    """Per node, whether the forward pass's outputs depend on what it writes."""
    needed = set(trace.outputs)
    live = [False] * len(trace.nodes)
    for node in reversed(trace.nodes):
        if any(out in needed for out in node.outputs):
            live[node.index] = True
            needed.update(v for v in node.inputs if v >= 0)
    return live


def _fed(trace: Trace) -> set[int]:
    """The values computed from the batch."""
    fed = set(trace.inputs)
    for node in trace.nodes:
        if any(v in fed for v in node.inputs):
            fed.update(node.outputs)
    return fed


def _batch_dims(trace: Trace, initial: Mapping[int, int] | None = None) -> dict[int, int]:
    """Per value that carries the batch, the index of its batch dimension.

    Forward from the inputs (or from `initial`: a loop body's), then backward from each value
    that carries it to the operands that line up with it (XLA's propagation both ways: a
    relative-position table broadcast to the batch's size carries the batch where it meets the
    batch), until nothing changes. A `scan` (a Keras RNN) is followed through its body
    (`_scanned`).
    """
    batch = dict(initial) if initial is not None else {v: 0 for v in trace.inputs if trace.shapes[v]}
    for _ in range(4):
        before = len(batch)
        for node in trace.nodes:
            carried = [(i, v) for i, v in enumerate(node.inputs) if v in batch]
            if carried and node.primitive == "scan":
                batch.update({v: d for v, d in _scanned(trace, node, batch).items() if v not in batch})
            elif carried and node.outputs[0] not in batch:
                position, value = carried[0]
                dim = _carried(trace, node, position, value, batch)
                extent = trace.shapes[value][batch[value]]
                split = node.primitive == "reshape"  # the batch taken apart from what it was merged with
                for out in node.outputs:
                    shape = trace.shapes[out]
                    if (
                        dim is not None
                        and dim < len(shape)
                        and shape[dim]
                        and (shape[dim] % extent == 0 or (split and extent % shape[dim] == 0))
                    ):
                        batch[out] = dim
        for node in reversed(trace.nodes):
            if node.primitive == "scan":  # a carried value's initial state is laid out as the carry
                first = node.params["num_consts"]
                carried = zip(node.inputs[first:], node.outputs[: node.params["num_carry"]], strict=False)
                for value, out in carried:
                    if out in batch and value >= 0 and value not in batch and value not in trace.variables:
                        batch[value] = batch[out]
            elif node.outputs[0] in batch:
                for position, value in enumerate(node.inputs):
                    if value >= 0 and value not in batch and value not in trace.variables:
                        dim = _operand_dim(trace, node, position, batch[node.outputs[0]])
                        if dim is not None:
                            batch[value] = dim
        if len(batch) == before:
            break
    return batch


def _scanned(trace: Trace, node: Node, batch: Mapping[int, int]) -> dict[int, int]:
    """The batch dimension of each output of a `scan` that carries it, read through its body.

    The body sees each sequence's per-step slice (its leading, stepped dimension dropped) and the
    carried values; what it carries out is carried in again, until the carry's layout settles. A
    carried output keeps the body's dimension, a stacked one gains the leading steps.
    """
    body = trace_body(node.params["jaxpr"])
    consts, carry = node.params["num_consts"], node.params["num_carry"]
    ins = sorted(body.inputs)  # the body's inputs, in order (`trace_body`)
    initial: dict[int, int] = {}
    for position, (inner, outer) in enumerate(zip(ins, node.inputs, strict=True)):
        stepped = position >= consts + carry
        if outer in batch and batch[outer] - stepped >= 0:
            initial[inner] = batch[outer] - stepped
    inside = _batch_dims(body, initial)
    for _ in range(carry):
        more = {
            ins[consts + i]: inside[out]
            for i, out in enumerate(body.outputs[:carry])
            if out in inside and ins[consts + i] not in initial
        }
        if not more:
            break
        initial.update(more)
        inside = _batch_dims(body, initial)
    return {
        outer: inside[inner] + (position >= carry)
        for position, (inner, outer) in enumerate(zip(body.outputs, node.outputs, strict=True))
        if inner in inside
    }


def _operand_dim(trace: Trace, node: Node, position: int, dim: int) -> int | None:
    """The dimension of operand `position` that lines up with `node`'s output dimension `dim`, if any."""
    out, shape = trace.shapes[node.outputs[0]], trace.shapes[node.inputs[position]]
    name, params = node.primitive, node.params
    found: int | None = None
    if name == "broadcast_in_dim":
        found = next((i for i, d in enumerate(params["broadcast_dimensions"]) if d == dim), None)
    elif name == "transpose":
        found = tuple(params["permutation"])[dim]
    elif name == "reshape":
        found = _lined_up(out, dim, shape)
    elif name == "stack":
        found = None if dim == params["axis"] else dim - (dim > params["axis"])
    elif name == "unstack":
        found = dim + (dim >= params["axis"])
    elif name == "dot_general":
        found = _dot_operand(trace, node, position, dim)
    elif len(shape) == len(out):
        found = dim
    if found is None or found >= len(shape) or (shape[found] != out[dim] and name != "reshape"):
        return None
    return found


def _lined_up(shape: tuple[int, ...], dim: int, other: tuple[int, ...]) -> int | None:
    """The dimension of `other` (a reshape of `shape`) that `shape`'s `dim` is, or leads (merged).

    The same size with as many elements before it, or else a dimension that starts there and
    holds it whole (the batch merged with the sequence, `(B, T, C)` as `(B·T, C)`).
    """
    before = math.prod(shape[:dim])
    for index, extent in enumerate(other):
        if math.prod(other[:index]) == before and extent == shape[dim]:
            return index
    for index, extent in enumerate(other):  # merged with the dimensions after it: still the major one
        if math.prod(other[:index]) == before and extent % shape[dim] == 0 and extent > shape[dim]:
            return index
    for index, extent in enumerate(other):  # split (a merged batch taken apart again): the major part
        if math.prod(other[:index]) == before and shape[dim] % extent == 0 and 1 < extent < shape[dim]:
            return index
    return None


def _dot_operand(trace: Trace, node: Node, position: int, dim: int) -> int | None:
    """The operand dimension of a `dot_general` that becomes its output dimension `dim`."""
    for candidate in range(len(trace.shapes[node.inputs[position]])):
        if _dot_dim(trace, node, position, candidate) == dim:
            return candidate
    return None


def _carried(trace: Trace, node: Node, position: int, value: int, batch: Mapping[int, int]) -> int | None:
    """Where `node` puts the batch dimension of its input `value` (at `position`); `None`: summed away."""
    dim, name, params = batch[value], node.primitive, node.params
    out = trace.shapes[node.outputs[0]]
    if name == "broadcast_in_dim":
        return params["broadcast_dimensions"][dim]
    if name == "transpose":
        return tuple(params["permutation"]).index(dim)
    if name == "squeeze":
        return dim - sum(d < dim for d in params["dimensions"])
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        axes = tuple(params.get("axes", ()))
        return None if dim in axes else dim - sum(a < dim for a in axes)
    if name == "dot_general":
        return _dot_dim(trace, node, position, dim)
    if name == "reshape":
        return _lined_up(trace.shapes[value], dim, out)
    if name == "stack":  # a new dimension at `axis` (`ops.stack`, Keras's `TimeDistributed`)
        return dim + (dim >= params["axis"])
    if name == "unstack":  # `axis` taken apart: each output without it
        return None if dim == params["axis"] else dim - (dim > params["axis"])
    return dim  # element-wise, and anything else: the same dimension, where an output has it


def _dot_dim(trace: Trace, node: Node, position: int, dim: int) -> int | None:
    """The output dimension of a `dot_general` that input `position`'s dimension `dim` becomes."""
    (contract_l, contract_r), (batch_l, batch_r) = node.params["dimension_numbers"]
    contracted, batched = (contract_l, batch_l) if position == 0 else (contract_r, batch_r)
    if dim in contracted:
        return None
    if dim in batched:
        return tuple(batched).index(dim)
    rank_l = len(trace.shapes[node.inputs[0]])
    free_l = [d for d in range(rank_l) if d not in contract_l and d not in batch_l]
    if position == 0:
        return len(batch_l) + free_l.index(dim)
    rank_r = len(trace.shapes[node.inputs[1]])
    free_r = [d for d in range(rank_r) if d not in contract_r and d not in batch_r]
    return len(batch_l) + len(free_l) + free_r.index(dim)
