"""Costs of units of one weight: look-up tables, weights outside every unit, weights never read.

- a look-up table (`Embedding`, or a custom layer's weight read by one
  `take`): vocab-parallel, or fully sharded over the batch axis or both;
- a tied table (looked up, and read again as the language-model head):
  vocab-parallel;
- a weight outside every unit (a norm's scale, a small head): fully
  sharded (ZeRO-3), gathered when used;
- a trainable weight the step never reads: split over both axes, no traffic.

Each candidate's traffic is what XLA:CPU's partitioner was measured to emit
(`tests/test_budget.py` holds them against the compiled HLO).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import keras
import numpy as np

from ..report._collectives import wire_bytes
from . import _notes
from ._candidates import Bytes, Candidate, UnitCosts, add_wire, candidate, frozen, nbytes
from ._convs import lone_conv_reads
from ._layers import idle_axes, int4_shape, lookup_table, tied_table
from ._tables_2d import BothAxesTables, no_budget_choice

__all__ = ["OneWeightCosts"]

#: What leads a weight read element-wise on to its reader, changing only its shape or type.
_PASSED_ON = ("broadcast_in_dim", "reshape", "convert_element_type", "squeeze", "slice", "dynamic_slice")
_ADDS = ("add", "add_any", "sub")


class OneWeightCosts(BothAxesTables, Bytes):
    """The candidates of units of one weight, over the byte counts of `Bytes`."""

    def _embedding_unit(self, owner: keras.layers.Layer, variable: keras.Variable) -> UnitCosts | None:
        """A look-up table: a Keras `Embedding`, or a custom layer's weight read only by one `take`."""
        calls = self.uses.get(variable.path, ())
        if not lookup_table(owner, variable, calls, self.m):
            return None  # a tied embedding used twice, or one that does not divide: kept whole
        output, dtype = calls[0].output, calls[0].dtype
        wire: dict[str, float] = {}
        # Ids shared by the whole batch (positions): the gradient is summed over the batch axis whole.
        add_wire(wire, self.batch_axis, self._grad_sync(variable, 1 if _shared_ids(calls[0]) else self.m))
        int8 = str(variable.dtype) == "int8"
        self._lookup_wire(variable, calls[0], wire)
        split = candidate(
            "vocab-parallel",
            {variable.path: (self.model_axis, None)},
            self._state(variable, self.m, variable.trainable),
            wire,
        )
        note = {
            variable.path: f"embedding: vocabulary split over {self.model_axis!r}, one all-reduce forward"
        }
        candidates = [self._replicated([variable]), split]
        looked_up = self._activation(output, dtype)
        # Splitting an int8 table over the batch axis too is not measured: not offered. Nor where the
        # split over the batch axis would be the table's only one while another axis is free.
        both = () if int8 or self._free_axis() else (self._sharded_table, self._both_axes_table)
        for sharded in (offer(variable, wire, looked_up) for offer in both):
            if sharded is not None:
                candidates.append(sharded)
        split_rows = self.tp_axes.get(variable.path) == (self.model_axis, None)
        proposed = no_budget_choice(candidates, int(split_rows))
        name = getattr(owner, "path", variable.path)
        return UnitCosts(name, tuple(candidates), frozen(note), proposed=proposed)

    def _free_axis(self) -> bool:
        """Whether the mesh has an axis beside the batch and model axes (`expert`) of more than one device.

        A table split over the batch axis there is not looked up as costed: XLA spreads the
        look-up over the free axis (collective-permutes of the looked-up rows over both, forward
        and backward, and the table's gradient all-reduced over the free one; measured on XLA:CPU
        and XLA:TPU, a keras-hub Mixtral on `data=2,expert=4,model=1`, and on XLA:CPU a dense
        keras-hub Llama on `data=2,expert=2,model=2`, its table over both axes: 'expert' 65,536
        bytes and 'data×expert' 16,512 not predicted, 'data×model' 2.0×, before it was kept
        vocab-parallel there).
        """
        named = (self.batch_axis, self.model_axis)
        return any(n > 1 and a not in named for a, n in self.axis_sizes.items())

    def _lookup_wire(self, variable: keras.Variable, lookup, wire: dict[str, float]) -> None:
        """A vocab-parallel look-up's forward all-reduce over the model axis; an int8 table's rows as int8,
        its looked-up scales beside (measured on XLA:CPU, 2×4, keras-hub Llama and a functional model)."""
        int8 = str(variable.dtype) == "int8"
        rows = lookup.output, self.cast_dtype(lookup)
        looked = self._activation(*rows) if int8 else self._summed(*rows)
        if _shared_ids(lookup):  # the rows of the whole batch: not in batch shards
            looked *= self.d
        lookups = sum(use.kind == "gather" for use in self.uses.get(variable.path, ()))
        again = self.recomputed.get((variable.path, "gather"), 0) / max(lookups, 1)  # under remat
        add_wire(wire, self.model_axis, (1 + again) * wire_bytes("all-reduce", looked, self.m))
        for follower, _ in self.followers.get(variable.path, ()) if int8 else ():
            # Its scales looked up by the same ids (not an int4 head's, by each row's group); an int4
            # table's int8 zero points as int8.
            for use in (u for u in self.uses.get(follower.path, ()) if u.inputs == lookup.inputs):
                scales = (self._activation if "int" in use.dtype else self._summed)(use.output, use.dtype)
                add_wire(wire, self.model_axis, wire_bytes("all-reduce", scales, self.m))

    def _tied_unit(self, owner: keras.layers.Layer, variable: keras.Variable) -> UnitCosts | None:
        """A tied or shared table: look-ups, and any projections `x @ table.T` (a language model's head).

        Measured on XLA:CPU (2×4 and 4×2, 4K to 32K rows): its gradient is
        all-reduced over the batch axis once per read, replicated or split.
        Vocab-parallel, the look-up is all-reduced over the model axis
        forward, as an untied table's; the head's logits stay split over the
        vocabulary, so the loss reduces them with four all-reduces of one
        float32 per position (as a split final layer's), and the head's input
        gradient is all-reduced over the model axis backward: for an int8
        table one float32 per position (measured on XLA:CPU, 2×4, a tied
        `ReversibleEmbedding`), its look-ups as an untied one's.
        """
        calls = self.uses.get(variable.path, ())
        if not tied_table(owner, variable, calls, self.m):
            return None
        lookups = [u for u in calls if u.kind == "gather"]
        heads = [u for u in calls if u.kind == "matmul"]
        replicated = self._replicated([variable])
        wire: dict[str, float] = {}
        add_wire(wire, self.batch_axis, self._grad_sync(variable, self.m))
        for lookup in lookups:
            self._lookup_wire(variable, lookup, wire)
        for head in heads:
            per_position = math.prod(head.output[:-1]) / self.d * 4
            add_wire(wire, self.model_axis, 4 * wire_bytes("all-reduce", per_position, self.m))
            if not head.from_input:
                # An int8 head rounds its input (no gradient but its scale's); an int4 one does not.
                rounded = str(variable.dtype) == "int8" and int4_shape(owner) is None
                summed = self.head_input_grad(head, rounded=rounded)
                add_wire(wire, self.model_axis, wire_bytes("all-reduce", summed, self.m))
        split = candidate(
            "vocab-parallel",
            {variable.path: (self.model_axis, None)},
            self._state(variable, self.m, variable.trainable),
            wire,
        )
        rows, width = variable.shape
        note = {
            variable.path: _notes.tied_vocab_parallel(rows, width, self.model_axis, len(lookups), len(heads))
        }
        # Split over both axes as well, XLA:CPU rematerialises the head's operands (an "involuntary
        # full rematerialization" warning) and sends 1.5-2.6x what the look-up and head would need
        # (measured on 2x4 and 4x2, 4K to 32K rows): not offered.
        candidates = [replicated, split]
        if not heads:
            candidates.extend(self._shared_over_both(variable, lookups))
        split_rows = self.tp_axes.get(variable.path) == (self.model_axis, None)
        proposed = no_budget_choice(candidates, int(split_rows))
        return UnitCosts(getattr(owner, "path", variable.path), tuple(candidates), frozen(note), proposed)

    def _sharded_table(
        self, variable: keras.Variable, vocab_wire: Mapping[str, float], looked_up: float
    ) -> Candidate | None:
        """A look-up table split over the batch axis on its vocabulary (fully sharded).

        Offered only with a batch axis larger than the model axis, where it
        holds less than vocab-parallel, and only while one model-axis block
        of the table is no larger than the looked-up activations on a device
        (`looked_up`): there XLA:CPU was measured to move each device's rows
        to the vocab-parallel layout (a collective-permute of its shard over
        both axes, then an all-gather over the batch-axis devices that hold
        one model-axis block), look up vocab-parallel, and move the gradient
        back the same way (a second permute). A larger table makes XLA move
        the activations instead, which no formula here predicts.
        `tests/test_budget.py` holds this against the compiled HLO on 4×2.
        """
        d, m, rows = self.d, self.m, variable.shape[0]
        size = nbytes(variable)
        if d <= m or d % m or rows % d or size / m > looked_up:
            return None
        wire = dict(vocab_wire)
        add_wire(wire, self.batch_axis, wire_bytes("all-gather", size / m, d // m))
        add_wire(wire, self.both, 2 * size / d)
        note = {
            variable.path: f"embedding: vocabulary split over {self.batch_axis!r}, moved to a split over "
            f"{self.model_axis!r} for the look-up"
        }
        axes = {variable.path: (self.batch_axis, None)}
        return candidate("fully sharded", axes, self._state(variable, d, variable.trainable), wire, note)

    def _idle_unit(self, variable: keras.Variable) -> UnitCosts | None:
        """A weight the step never reads (an untied output embedding, trainable or frozen: LoRA, int8).

        It gets no gradient, so splitting it over both axes costs no traffic.
        """
        axes, shards = idle_axes(
            tuple(variable.shape), ((self.model_axis, self.m), (self.batch_axis, self.d))
        )
        if shards == 1:
            return None
        state = self._state(variable, shards, variable.trainable)
        split = candidate("split, unused", {variable.path: axes}, state, {})
        note = {variable.path: "the training step never reads it: no gradient, so no traffic"}
        proposed = 1 if self.tp_axes.get(variable.path) == axes else 0
        return UnitCosts(
            variable.path, (self._replicated([variable]), split), frozen(note), proposed=proposed
        )

    def _fully_sharded_unit(
        self, variable: keras.Variable, owner: keras.layers.Layer | None = None
    ) -> UnitCosts | None:
        """A weight outside every unit, split over the batch axis and gathered when used (ZeRO-3).

        Two kinds of weight get the candidate, each with what XLA:CPU's
        partitioner was measured to do with it (`tests/test_budget.py` holds
        these against the compiled HLO on 2×4 and 4×2):

        - a weight read only element-wise (a norm's scale or offset, 1-D):
          all-gathered over the batch axis forward, and once more backward
          when it multiplies (the input gradient needs it); its gradient is
          all-reduced as if replicated;
        - a projection kernel `x @ w` read once, split on its input features:
          with a batch axis at least as large as the model axis, all-gathered
          over the batch axis forward (its input gradient's traffic in `_input_gradient`), its
          gradient all-reduced whole. With a
          smaller batch axis XLA moves each device's shard to the model-axis
          layout (a collective-permute over both axes of 1/model of the
          kernel), then either all-gathers it over the model axis or, when
          that sends no less, all-reduces the projection's output over the
          model axis forward and gathers the kernel backward; its gradient is
          all-reduced over the batch axis in batch-axis shards, then permuted
          back.

        Either kind whose first dimension divides by both axes' product also
        gets a split over the batch and model axes together, `d × m` pieces:
        XLA all-gathers it over both axes at each read (as often as above)
        and all-reduces its gradient whole over the batch axis. The search
        takes whichever of the two fits the budget at the least traffic.
        """
        shape, d, m = tuple(variable.shape), self.d, self.m
        if d <= 1 or not shape or shape[0] % d:
            return None
        size = nbytes(variable)
        wire: dict[str, float] | None = {}
        add_wire(wire, self.batch_axis, self._grad_sync(variable, 1))
        uses = self.uses.get(variable.path, ())
        both = dict(wire)  # split over every axis: the same gradient all-reduce, gathers over both
        if not uses and len(shape) > 1 and self._sliced(variable.path):
            return self._sliced_unit(variable)
        if not uses and (len(shape) == 1 or self._reads_the_input(variable.path)):
            # A scale read element-wise; or the kernel of a convolution of the input, gathered once.
            read = self._gathered_where_read(variable, wire, both)
            if read is None:
                return None
            how, when = read
        elif (
            len(uses) == 1
            and uses[0].kind == "matmul"
            and len(shape) == 2
            and uses[0].contracted == (0,)
            and not uses[0].batch
        ):
            (use,) = uses
            add_wire(both, self.both, self._gathers_over_both(owner, variable, size))
            for axis, amount in self._input_gradient_gathers(variable, use).items():
                add_wire(both, axis, amount)
            when = "before its projection"
            if d >= m:
                add_wire(wire, self.batch_axis, self._whole_kernel_gathers(owner, variable, use))
            else:
                wire = None if shape[0] % m else self._permuted_kernel(size, use)
            how = f"gathered over {self.batch_axis!r} {when}"
        else:
            return None
        rest = (None,) * (len(shape) - 1)
        candidates = [self._replicated([variable])]
        notes: dict[str, str] = {}
        if wire is not None:
            axes = {variable.path: (self.batch_axis, *rest)}
            state = self._state(variable, d, variable.trainable)
            cast = {self.batch_axis: self.cast_gathers(owner, variable, d)}
            candidates.append(candidate("fully sharded", axes, state, wire, cast=cast))
            notes[variable.path] = _notes.fully_sharded(self.batch_axis, how)
        if m > 1 and shape[0] % (d * m) == 0:
            # Measured on XLA:CPU (2×4 and 4×2): one all-gather over both axes per read, the
            # gradient all-reduced whole over the batch axis, as replicated.
            axes = {variable.path: ((self.batch_axis, self.model_axis), *rest)}
            note = _notes.fully_sharded_over_both(d * m, self.batch_axis, self.model_axis, when)
            state = self._state(variable, d * m, variable.trainable)
            cast = {self.both: self.cast_gathers(owner, variable, d * m, over_both=True)}
            candidates.append(candidate("fully sharded", axes, state, both, {variable.path: note}, cast))
        if len(candidates) == 1:
            return None
        return UnitCosts(variable.path, tuple(candidates), frozen(notes))

    def _gathered_where_read(
        self, variable: keras.Variable, wire: dict[str, float], both: dict[str, float]
    ) -> tuple[str, str] | None:
        """A weight read element-wise (or a convolution's of the input) split over the batch axis, or
        over both: its gathers added to `wire` and `both`, and `(how, when)` it is gathered (notes).

        float8's amax histories, rewritten each step from maxima, XLA computes in their shards.
        """
        size, d, m, rank = nbytes(variable), self.d, self.m, len(variable.shape)
        gathers = self._elementwise_gathers(variable.path) if rank == 1 else 1
        rewritten = getattr(variable, "overwrite_with_gradient", False)
        if not gathers and not rewritten:
            return None
        gathers = 0 if rewritten else gathers
        add_wire(wire, self.batch_axis, gathers * wire_bytes("all-gather", size, d))
        add_wire(both, self.both, gathers * wire_bytes("all-gather", size, d * m))
        when = "forward" + (" and backward" if gathers > 1 else "") if rank == 1 else "forward"
        if rewritten:
            return "rewritten in its shards each step", when
        return f"gathered over {self.batch_axis!r} {when}", when

    def _reads_the_input(self, path: str) -> bool:
        """Whether `path` is the kernel of one convolution of the model's input (a patch embedding).

        Its kernel split over the batch axis (or both) is gathered once, forward: the input needs no
        gradient, and the kernel's is computed from the input and the output gradient; the gradient
        is all-reduced whole over the batch axis, as replicated.
        """
        reads = lone_conv_reads(self.trace, path, 1)
        return len(reads) == 1 and self.trace.from_input(reads[0][0].inputs[0])

    def _gathers_over_both(
        self, owner: keras.layers.Layer | None, variable: keras.Variable, size: int
    ) -> float:
        """The all-gathers over both axes of a kernel split `d × m` ways on its input features.

        XLA:CPU: one, of the kernel (measured on 2×4 and 4×2). XLA:TPU gathers it in bfloat16, and
        again for the backward pass unless `_kept_for_backward` (`gathers_per_step`): measured with
        libtpu 0.0.42.1 on a keras-hub Mixtral's output table on v5e `data=2,model=4`, gathered
        once (predicted in float32 it was 1.33 of the compiled `data×model` bytes). Over
        `_batch_gathers.REDUCED_GROUP` devices or more, a bfloat16 copy of at most the generation's
        `reduced_gathers` bytes is not all-gathered: each device writes its shard into zeros and
        the copy is all-reduced over both axes (twice the bytes). Measured with a Dense head
        split over both axes, 512 × 1024 to 4096 × 131072: on v5p 4×4×4 (`data=8,model=8`,
        `16×4`, `4×16`, `32×2`) always, and Mixtral 8×7 B's output table there (predicted as an
        all-gather it was 0.500 of the compiled `data×model` bytes); on v5e 8×8 and 16×16 up to
        8 MiB, not from 16 MiB (Mixtral's 262 MB table on `data=32,model=8`); over 32 devices
        or fewer (v5e 4×8, v5p 4×4×2, 2×2×2) all-gathered.
        """
        shards = self.d * self.m
        if self.compiler != "tpu":
            return wire_bytes("all-gather", size, shards)
        count = self.gathers_per_step(owner, variable, size, "whole")
        gathered = size * self.gathered_share(variable)
        reduced = self.gathered_as_all_reduce(variable)
        return count * wire_bytes("all-reduce" if reduced else "all-gather", gathered, shards)

    def _input_gradient_gathers(self, variable: keras.Variable, use) -> dict[str, float]:
        """What a kernel split over both axes on its input features sends for its input gradient.

        Measured on XLA:CPU (batch 8: a functional LoRA Dense pair and keras-hub Llama under a
        pooled head on 2×4, with or without LoRA, a norm before or after the pooling; a pooled
        table on 2×4 and 4×2): when the output gradient `dy` holds fewer elements than the
        kernel, XLA computes `dy @ wᵀ` on the kernel's shards instead of the kernel gathered
        forward. It all-gathers `dy` over the batch axis, and the input gradient that comes out,
        split on its features over both axes, is gathered whole over both (a full
        rematerialisation) to return to batch shards. With `dy` as large as the kernel or larger
        (the pair at batch 32 and 64, tests/styles.py's block) the kernel's gathered copy is used
        and nothing more is sent. Over the batch axis alone: `_input_gradient`.
        """
        if use.from_input or math.prod(use.output) >= math.prod(variable.shape):
            return {}
        item = np.dtype(use.dtype).itemsize
        return {
            self.batch_axis: wire_bytes("all-gather", math.prod(use.output) * item, self.d),
            self.both: wire_bytes("all-gather", math.prod(use.inputs) * item, self.d * self.m),
        }

    def _permuted_kernel(self, size: float, use) -> dict[str, float]:
        """The traffic of a kernel split over a batch axis smaller than the model axis (see above)."""
        d, m = self.d, self.m
        wire: dict[str, float] = {}
        add_wire(wire, self.batch_axis, wire_bytes("all-reduce", size / d, d))
        add_wire(wire, self.both, size / m + size / d)
        gather = wire_bytes("all-gather", size, m)
        reduce = wire_bytes("all-reduce", self._summed(use.output, use.dtype), m)
        if gather < reduce:
            add_wire(wire, self.model_axis, gather)
        else:
            add_wire(wire, self.model_axis, reduce + (0.0 if use.from_input else gather))
        return wire

    def _sliced_unit(self, variable: keras.Variable) -> UnitCosts | None:
        """A table read only through a slice (a position table cut to the sequence), over both axes.

        Split `d × m` ways over the batch and model axes, on its rows or on its
        width. Measured on XLA:CPU (keras-hub BERT's 32-row position table read
        8 rows at a time, 2×4 and 4×2; ALBERT's, 2×4): split on its rows, the
        rows read are moved into place over both axes (collective-permutes) and
        all-gathered over both, each about an all-gather of the slice; split on
        its width, the slice is cut locally and all-gathered over both once.
        Either way the slice's gradient is all-reduced over the batch axis as
        when replicated. Not offered over the batch axis alone (not measured).
        """
        shape, d, m = tuple(variable.shape), self.d, self.m
        if d <= 1 or m <= 1 or self._elementwise_gathers(variable.path) != 1:
            return None
        read = nbytes(variable) * self.used.get(variable.path, 0.0)
        both = (self.batch_axis, self.model_axis)
        state = self._state(variable, d * m, variable.trainable)
        candidates = [self._replicated([variable])]
        for dim, gathers, how in ((0, 2, "the rows read moved and"), (len(shape) - 1, 1, "the slice")):
            if shape[dim] % (d * m):
                continue
            wire: dict[str, float] = {}
            add_wire(wire, self.batch_axis, self._grad_sync(variable, 1))
            add_wire(wire, self.both, gathers * wire_bytes("all-gather", read, d * m))
            axes = tuple(both if i == dim else None for i in range(len(shape)))
            note = (
                f"{'rows' if dim == 0 else 'width'} split {d * m} ways over {self.batch_axis!r} and "
                f"{self.model_axis!r}; {how} gathered over both; its gradient reduced over "
                f"{self.batch_axis!r}"
            )
            candidates.append(
                candidate("fully sharded", {variable.path: axes}, state, wire, {variable.path: note})
            )
        if len(candidates) == 1:
            return None
        return UnitCosts(variable.path, tuple(candidates))

    def _sliced(self, path: str) -> bool:
        """Whether the step reads `path` only through a slice (a position table cut to the sequence)."""
        values = [v for v, name in self.trace.variables.items() if name == path]
        readers = [self.trace.nodes[i].primitive for v in values for i in self.trace.consumers.get(v, ())]
        return bool(readers) and all(p in ("slice", "dynamic_slice") for p in readers)

    def _elementwise_gathers(self, path: str) -> int:
        """How often a weight read only element-wise is gathered per step: 2 if it multiplies what a
        gradient flows back to (not a frozen table's looked-up rows, say), else 1.

        0 when something other than a broadcast, reshape or cast leads it to
        anything but an add, subtract, multiply or divide. An add whose result has
        the weight's own shape (Gemma's `x * (1 + scale)`, not a broadcast added to
        activations) is followed to what it leads to: there the scale multiplies,
        and XLA:CPU gathers it forward and backward.
        """
        values = [v for v, name in self.trace.variables.items() if name == path]
        own = {self.trace.shapes[v] for v in values}  # an add to the weight alone keeps its shape
        multiplies = False
        while values:
            value = values.pop()
            for index in self.trace.consumers.get(value, ()):
                node = self.trace.nodes[index]
                if node.primitive in _PASSED_ON or (
                    node.primitive in _ADDS and self.trace.shapes[node.outputs[0]] in own
                ):
                    values.extend(node.outputs)
                elif node.primitive in ("mul", "div"):  # backward too, if a gradient flows to the other
                    multiplies |= any(v in self.trace.trained for v in node.inputs if v >= 0 and v != value)
                elif node.primitive not in _ADDS:
                    return 0
        return 2 if multiplies else 1

    def activation_reserve(self) -> int:
        total = 0.0
        for uses in self.uses.values():
            for use in uses:
                total += self._activation(use.output, use.dtype)
        return int(total)


def _shared_ids(lookup) -> bool:
    """Whether a look-up's ids are one row the whole batch shares (SigLIP's position ids, `(1, L)`)."""
    return lookup.inputs[:1] == (1,)
