"""Look-up tables split over both axes: their costs, and the plan without a budget taking them.

The rule writer proposes a large look-up table vocab-parallel (its rows over
the model axis, `_embeddings`), and the costs (`_one_weight`, with this
module's `BothAxesTables`) also offer it split over both axes. Once the
table's model-axis block is as large as what the batch looks up on a
device, XLA moves the ids and the looked-up rows
instead of the table (`BothAxesTables._moved_rows`): no gradient all-reduce
over the batch axis, whose bytes grow with the vocabulary. There the split
over both axes can send fewer bytes than vocab-parallel *and* hold
`1/batch` of its state: keras-hub's own Gemma and Qwen maps split the table
over both axes, and the plan without a budget, the least traffic, takes such
a layout as soon as it costs no more bytes and no more state than the
proposal's (`no_budget_choice`). Where the batch's rows outweigh the table
(small vocabularies, large batches) vocab-parallel stays.

`tpu_moved_rows` says where XLA:TPU moves the rows of a table over both axes although
the batch's rows outweigh the table (XLA:CPU gathers the table's block there), and
where it sums the gradient in the table's block instead of moving it back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import keras
import numpy as np

from ..report._collectives import wire_bytes
from . import _notes
from ._candidates import Candidate, add_wire, candidate, nbytes, plus_wire
from ._trace import Use

__all__ = ["TPU_MOVED_ROWS_FROM", "BothAxesTables", "MovedRows", "no_budget_choice", "tpu_moved_rows"]

#: The batch-axis size from which XLA:TPU was measured to choose between moving a table's
#: looked-up rows and gathering the table by the memory rule of `tpu_moves_rows` (4, 8, 16 measured;
#: over 2 devices it gathers the table's block once the batch's rows outweigh the table, as XLA:CPU).
TPU_MOVED_ROWS_FROM = 4


def no_budget_choice(candidates: Sequence[Candidate], proposed: int) -> int:
    """The candidate the plan without a budget takes: `proposed`, or one that dominates it.

    A candidate dominates the proposal's when it sends no more bytes per
    step and holds no more state per device, and is smaller on one of the
    two; of those, the one sending the least (then holding the least).
    A proposal that keeps the table replicated (`proposed == 0`, the
    policy's small tables) is kept.

    Args:
        candidates: The unit's candidates, the replicated one first.
        proposed: The index of the proposal's own layout.

    Returns:
        The index of the candidate to take without a budget.
    """
    if proposed == 0:
        return proposed
    base = candidates[proposed]
    better = [
        index
        for index, option in enumerate(candidates)
        if option.total <= base.total
        and option.state <= base.state
        and (option.total, option.state) != (base.total, base.state)
    ]
    return min(better, key=lambda i: (candidates[i].total, candidates[i].state), default=proposed)


class MovedRows(NamedTuple):
    """Where XLA:TPU moves a table's looked-up rows (`tpu_moved_rows`): for the look-up, for its gradient."""

    forward: bool
    backward: bool


def tpu_moved_rows(
    table: Sequence[int], looked_up: Sequence[int], dtype: str, batch: int, model: int
) -> MovedRows:
    """Whether XLA:TPU looks up a table split over both axes, and sums its gradient, by moving rows.

    XLA's partitioner orders its ways to partition a gather (and a scatter) by
    the largest buffer one of their instructions touches (operands and
    result), then by the bytes they communicate, and takes the first. Moving
    the rows touches the whole batch's looked-up rows and their ids, with the
    device's block for the look-up (each device looks up the batch's ids in its
    block, then an all-reduce over both axes) or the device's rows for the
    gradient (an all-gather of the rows' gradient over the batch axis); the
    other way gathers the whole table from the device's model-axis block, and
    for the look-up reads it with the device's ids. Read off libtpu 0.0.42.1's
    own cost log (`TPU_VMODULE=gather_scatter_handler=5`; a tie goes to moving
    the rows, the partitioner's first way) and checked against
    the compiled HLO of a keras-hub Llama 3, hidden 256, 1,024 rows, fully
    sharded (tokens ÷ rows where the look-up moved rows / gathered the table):
    `data=4,model=4` 1.125 / 1.25 (at 1.125 its gradient not moved: summed in
    the block), `8x8` 1.0 / 1.125, `16x4` 1.0-1.125 / 1.25; and Llama-3 8 B
    widths on v5p `data=16,model=4` (131,072 tokens, 128,256 rows: moved, 4.2
    GB over both axes a step that the gather rule did not predict).

    Args:
        table: The table's shape, `(rows, width)`.
        looked_up: The shape of what the whole batch looks up, `(..., width)`.
        dtype: The looked-up rows' dtype.
        batch: Devices on the batch axis.
        model: Devices on the model axis.

    Returns:
        Whether the look-up and its gradient move rows; neither under `TPU_MOVED_ROWS_FROM`
        devices on the batch axis.
    """
    rows, width = table
    row = width * np.dtype(dtype).itemsize
    tokens, whole = math.prod(looked_up[:-1]), rows * row
    if batch < TPU_MOVED_ROWS_FROM:
        return MovedRows(False, False)
    forward = tokens * (row + 4) + whole / (batch * model) <= whole + max(
        whole / model, tokens / batch * (row + 4)
    )
    backward = tokens * row * (1 + 1 / batch) <= whole * (1 + 1 / model)
    return MovedRows(forward, backward)


class BothAxesTables:
    """Look-up tables split on their rows over both axes: a mixin of `_one_weight.OneWeightCosts`, whose
    mesh sizes (`d`, `m`), axes, trace uses, compiler and byte counts of `_candidates.Bytes` it reads."""

    d: int
    m: int
    compiler: str
    batch_axis: str
    model_axis: str
    both: str
    uses: Mapping[str, tuple[Use, ...]]

    _rows_moved: set[str] | None = None

    def rows_moved(self) -> set[str]:
        """The tables offered a split over both axes whose looked-up rows move (`_moved_rows`): each
        device sums its rows' gradient in its own shard (the peak walk's `rows_moved`)."""
        if self._rows_moved is None:
            self._rows_moved = set()
        return self._rows_moved

    def _shared_over_both(self, variable: keras.Variable, lookups: list) -> list[Candidate]:
        """A shared table (look-ups only) split over both axes, larger than what each look-up reads.

        As an untied table's `_moved_rows`, once per look-up (measured on
        XLA:CPU, 2×4 and 4×2, 32K rows read twice).
        """
        d, m, rows = self.d, self.m, variable.shape[0]
        looked_up = max(self._activation(use.output, use.dtype) for use in lookups)
        if d <= 1 or rows % (d * m) or nbytes(variable) / m < looked_up:
            return []
        axes = {variable.path: ((self.model_axis, self.batch_axis), None)}
        return [self._moved_rows(variable, axes, self._state(variable, d * m, variable.trainable))]

    def _both_axes_table(
        self, variable: keras.Variable, vocab_wire: Mapping[str, float], looked_up: float
    ) -> Candidate | None:
        """A look-up table split on its vocabulary over the model axis, then the batch axis.

        Each device holds `1/(model·batch)` of the table. Measured on XLA:CPU
        (2×4 and 4×2) with a model-axis block of 1/32 of the looked-up
        activations on a device: vocab-parallel, plus an all-gather of the
        device's model-axis block over the batch axis before the look-up; the
        gradient is reduced as vocab-parallel's. With a block as large as the
        activations or more (1×, 4× and 8× up to 128K rows measured, in
        `_moved_rows`) XLA moves the activations instead; where between the
        two it switches is not pinned, so neither is offered there, unless the whole batch's
        looked-up rows outweigh the table: then XLA gathers the block (a 2-layer keras-hub Llama,
        128 × 64 table, 8 tokens a row: on `data=4,model=1` its rows moved at 8 rows, the table
        gathered at 32 and 128, where moving the rows was costed at twice the compiled bytes; on
        `4×2` moved at 16 rows, the block gathered at 32, `data×model` costed at 10.8x; on `2×4`
        gathered at 32 and 128 rows, as before). XLA:TPU moves them by its own rule (`tpu_moves_rows`).
        """
        d, m, rows = self.d, self.m, variable.shape[0]
        size = nbytes(variable)
        if d <= 1 or rows % (d * m):
            return None
        axes = {variable.path: ((self.model_axis, self.batch_axis), None)}
        state = self._state(variable, d * m, variable.trainable)
        if looked_up * d <= size:
            if size / m >= looked_up:
                return self._moved_rows(variable, axes, state)
            if 4 * size / m > looked_up:
                return None
        if self.compiler == "tpu":  # XLA:TPU may move the rows all the same
            lookup = self.uses[variable.path][0]
            moved = tpu_moved_rows(variable.shape, lookup.output, lookup.dtype, d, m)
            if moved.forward:
                return self._moved_rows(variable, axes, state, gradient_moved=moved.backward)
        wire = plus_wire(vocab_wire, self.batch_axis, wire_bytes("all-gather", size / m, d))
        note = {
            variable.path: f"embedding: vocabulary split {d * m} ways over {self.model_axis!r} and "
            f"{self.batch_axis!r}, gathered over {self.batch_axis!r} for the look-up"
            + (f", one all-reduce over {self.model_axis!r} forward" if m > 1 else "")
        }
        return candidate("fully sharded", axes, state, wire, note)

    def _moved_rows(
        self, variable: keras.Variable, axes: Mapping[str, tuple], state: int, gradient_moved: bool = True
    ) -> Candidate:
        """A large table split over both axes: the ids and looked-up rows move, never the table.

        Measured on XLA:CPU (2×4 and 4×2, 2K to 128K rows, model-axis blocks
        of 1× to 8× the looked-up activations on a device): the ids of the
        whole batch are all-gathered over the batch axis, each device looks
        up the ones in its rows, and the looked-up rows of the whole batch
        are all-reduced over both axes; backward, their gradient is
        all-gathered over the batch axis and each device sums its own rows'
        gradient: no gradient all-reduce. XLA:TPU gathers the ids again for
        that; where it does not move the gradient (`gradient_moved`, from
        `tpu_moved_rows`) each device sums its rows into its model-axis
        block, all-reduced over the batch axis as vocab-parallel's.
        """
        wire: dict[str, float] = {}
        again = self.compiler == "tpu" and gradient_moved
        for use in self.uses[variable.path]:
            ids = wire_bytes("all-gather", math.prod(use.inputs) * 4, self.d)
            rows = math.prod(use.output) * max(np.dtype(use.dtype).itemsize, 4)
            # The rows' gradient is gathered only for a table that trains (a LoRA model's frozen one: not).
            moved = variable.trainable and gradient_moved
            grad = wire_bytes("all-gather", rows, self.d) + ids * again if moved else 0.0
            add_wire(wire, self.batch_axis, ids + grad)
            add_wire(wire, self.both, wire_bytes("all-reduce", rows, self.d * self.m))
        if not gradient_moved:
            add_wire(wire, self.batch_axis, self._grad_sync(variable, self.m))
        else:
            self.rows_moved().add(variable.path)
        note = {
            variable.path: f"embedding: vocabulary split {self.d * self.m} ways over {self.model_axis!r} and "
            f"{self.batch_axis!r}; the batch's ids gathered and its looked-up vectors all-reduced over both"
            + (f", {_notes.ROWS_MOVED}" if gradient_moved else "")
        }
        return candidate("fully sharded", axes, state, wire, note)
