"""Costs of a look-up table of constant ids whose rows do not divide: split on its width over both axes.

A vision transformer's position table is looked up with the same ids every
step (`arange(num_positions)`, not the batch's), and its rows, one per patch
plus the class token (17 in keras-hub's ViT at 16 patches), rarely divide by
the model axis, so it cannot be split vocab-parallel. Its width (the hidden
size) can be split over the batch and model axes together (`d × m` pieces).
Measured on XLA:CPU (keras-hub ViT, 2×4, in the smallest budget plan): the
table is all-gathered over both axes before the look-up, once per step, and
its gradient is all-reduced whole over the batch axis, as when it is
replicated. A table looked up with the batch's ids is not offered this (not
measured: XLA may move the looked-up rows instead, as `_moved_rows`).
"""

from __future__ import annotations

import keras

from ..report._collectives import wire_bytes
from ._candidates import Bytes, UnitCosts, add_wire, candidate, nbytes

__all__ = ["TableCosts"]


class TableCosts(Bytes):
    """The candidates of a constant-id table whose rows do not divide, over the byte counts of `Bytes`."""

    def _width_sharded_table(self, owner: keras.layers.Layer, variable: keras.Variable) -> UnitCosts | None:
        """A Keras `Embedding`'s table read by one look-up of constant ids: replicated, or its width split."""
        d, m = self.d, self.m
        uses = self.uses.get(variable.path, ())
        shape = tuple(variable.shape)
        if (
            not isinstance(owner, keras.layers.Embedding)
            or variable.path != owner.embeddings.path
            or not variable.trainable
            or len(uses) != 1
            or uses[0].kind != "gather"
            or len(shape) != 2
            or d <= 1
            or m <= 1
            or shape[0] % m == 0  # vocab-parallel's (`OneWeightCosts._embedding_unit`)
            or shape[1] % (d * m)
            or self._batch_ids(uses[0].node)
        ):
            return None
        wire: dict[str, float] = {}
        add_wire(wire, self.batch_axis, self._grad_sync(variable, 1))
        add_wire(wire, self.both, wire_bytes("all-gather", nbytes(variable), d * m))
        axes = {variable.path: (None, (self.batch_axis, self.model_axis))}
        note = (
            f"width split {d * m} ways over {self.batch_axis!r} and {self.model_axis!r} ({shape[0]} rows "
            "do not divide), gathered over both before its look-up; its gradient reduced over "
            f"{self.batch_axis!r}"
        )
        state = self._state(variable, d * m, variable.trainable)
        split = candidate("fully sharded", axes, state, wire, {variable.path: note})
        return UnitCosts(variable.path, (self._replicated([variable]), split))

    def _batch_ids(self, node: int) -> bool:
        """Whether the ids of the look-up `node` are computed from the batch (not constants)."""
        stack, seen = [self.trace.nodes[node].inputs[1]], set()
        while stack:
            value = stack.pop()
            if value < 0 or value in seen:
                continue
            seen.add(value)
            if value in self.trace.inputs:
                return True
            index = self.trace.producer.get(value)
            if index is not None:
                stack.extend(self.trace.nodes[index].inputs)
        return False
