"""A split carried through `scan`: a loop's body grown like the rest, its carried state split with it.

`lax.scan` (what `lax.fori_loop` with static bounds and `keras.ops.fori_loop` trace to)
reads constants, carried values and its sequences, and writes the final carried values and
the per-step outputs, stacked. A split that reaches one of them is grown through the body,
traced on its own (`_trace.trace_body`), by a grower of the same rules (`_grower`), whose
boundary is the body's inputs and outputs (`Boundary`):

- a split the body needs on an input is required of the scan's operand outside, one
  dimension further out for a sequence (the body sees one step's slice, without the
  scanned leading dimension);
- a split the body writes on an output is set on the scan's result, one dimension further
  out for a stacked output;
- a carried value is split the same way on entry and on exit: the state a recurrence
  carries from step to step (RWKV's `(batch, heads, head_dim, head_dim)`, split on its
  heads) stays on each device's heads for the whole loop, and nothing moves per step.

A split on a sequence's scanned dimension fails: every step would need every device's
slice. The body's own operations are held to the rules outside it (a reduction over the
split dimension inside the body fails the unit as anywhere else).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ._trace import Node, Trace, trace_body

__all__ = ["Boundary", "Fail", "is_zeros", "through_scan"]


class Fail(Exception):
    """The split cannot be carried on (the message says where): the unit is not formed."""


@dataclasses.dataclass
class Boundary:
    """One scan's body as a grower inside it sees its edges, and the splits found on them.

    The body's inputs are its values `0 .. inputs-1`, in order (`trace_body`): `consts`
    constants, then `carry` carried values, then the sequences' slices; its outputs are
    the carried values after one step, then the stacked outputs' slices.

    Attributes:
        trace: The body, traced.
        consts: How many of its inputs are constants.
        carry: How many are carried.
        inputs: How many inputs it has.
        entries: Per input position, the dimension its value is split on.
        exits: Per output position, the dimension its value is split on.
    """

    trace: Trace
    consts: int
    carry: int
    inputs: int
    entries: dict[int, int] = dataclasses.field(default_factory=dict)
    exits: dict[int, int] = dataclasses.field(default_factory=dict)

    def on_split(self, grower: Any, value: int, dim: int) -> None:
        """`value` of the body was just split on `dim`: record it at the edges it is on.

        A carried input's split is required of its value after the step, and a carried
        output's is set on its input: the carried state is split alike across steps.
        """
        if value < self.inputs:
            self.entries[value] = dim
            if self.consts <= value < self.consts + self.carry:
                after = self.trace.outputs[value - self.consts]
                if after >= 0:
                    grower.require(after, dim)
        for position, out in enumerate(self.trace.outputs):
            if out == value:
                self.exits[position] = dim
                if position < self.carry:
                    grower.set_split(self.consts + position, dim)


def through_scan(grower: Any, node: Node, inputs: dict[int, int], outputs: dict[int, int]) -> int:
    """Carries splits of a scan's operands (`inputs`) or results (`outputs`) through its body.

    `inputs` and `outputs` map positions of `node`'s operands and results to the dimension
    split outside. The body is grown from them by `grower.inside`; what it needs split on
    its inputs is required of the operands (`grower.require`), what it writes split is set
    on the results (`grower.set_split`). Returns the einsums over the split heads the body
    holds (the unit's kind).

    Raises:
        Fail: The split is on a sequence's scanned dimension, or the body cannot carry it.
    """
    params = node.params
    consts, carry = params["num_consts"], params["num_carry"]
    body = trace_body(params["jaxpr"])
    boundary = Boundary(body, consts, carry, len(node.inputs))
    inner = grower.inside(body, boundary)
    for position, dim in inputs.items():
        inner.set_split(position, _inner_dim(dim, position >= consts + carry))
    for position, dim in outputs.items():
        out = body.outputs[position]
        if out < 0:
            raise Fail("a scan's constant result split")
        inner.require(out, _inner_dim(dim, position >= carry))
    inner.run()
    for position, dim in boundary.entries.items():
        operand = node.inputs[position]
        if operand >= 0:
            grower.require(operand, dim + (position >= consts + carry))
    for position, dim in boundary.exits.items():
        grower.set_split(node.outputs[position], dim + (position >= carry))
    grower.state.visited.add(node.index)
    return inner.state.heads_dots


def _inner_dim(dim: int, stacked: bool) -> int:
    """The body's dimension for an outside one: a sequence's or a stacked output's is one further in."""
    if not stacked:
        return dim
    if dim == 0:
        raise Fail("split along a scan's scanned dimension")
    return dim - 1


def is_zeros(trace: Trace, value: int) -> bool:
    """Whether `value` is a broadcast of literals alone: a loop state started from zeros, say, which
    XLA lays out as the loop carries it (`_propagate`) and allocates before any loop runs
    (`_fusion.stacked_early`)."""
    node = trace.nodes[trace.producer[value]] if value in trace.producer else None
    return node is not None and node.primitive == "broadcast_in_dim" and all(v < 0 for v in node.inputs)
