"""Costs of grouped-query key/value projections with too few heads to split over the model axis.

A kernel split on its head_dim (or a `Dense` one on its output features), gathered where
used, against replicated and fully sharded; and the traffic of such projections kept whole
beside split query heads (their heads' gradients summed and gathered). Measured on XLA:CPU
against the compiled HLO (`tests/test_grouped_kv.py`, `tests/test_budget.py`) and, where a
TPU target's compiler sends differently (bfloat16 gathers in each pass), on XLA:TPU
(`tests/test_targets.py`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import keras
import numpy as np

from .. import _compat
from ..report._collectives import wire_bytes
from . import _notes
from ._by_layers import ATTENTION
from ._candidates import Candidate, UnitCosts, add_wire, candidate, frozen, nbytes
from ._layers import head_dim_index, heads_dim, kv_head_count
from ._one_weight import OneWeightCosts
from ._trace import _PASS, Use

__all__ = ["KeyValueCosts"]

#: Primitives that change an array's layout, not its values: a value read through them alone
#: reaches a matmul as it was written.
_RESHAPES = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", *_PASS})


class KeyValueCosts(OneWeightCosts):
    """The candidates of a key/value kernel split on head_dim, over those of units of one weight."""

    def _head_dim_unit(self, owner: keras.layers.Layer, variable: keras.Variable) -> UnitCosts | None:
        """A grouped-query key/value kernel whose heads do not divide the model axis: split on head_dim.

        The kernel of an `EinsumDense` key or value projection (`(hidden, kv_heads, head_dim)`), or a
        `Dense` one's on its output features (`(hidden, kv_heads × head_dim)`), whose output the rules
        keep whole. Split over the model axis, each device holds `1/model` of it; measured on XLA:CPU
        (keras-hub Llama and SmolLM3, 2 key/value heads on 2×4, exact both), the kernel is all-gathered
        over the model axis once per step (the forward gather serves the backward pass too) and its
        gradient is all-reduced over the batch axis in model-axis shards. XLA:TPU gathers it in
        bfloat16 in each pass (`_kernel_gathers`): as many bytes for a float32 kernel, and as
        many per step as replicated there too (keras-hub Llama 3, v5e 2×4, both compiled). The
        activations move as when it is replicated (`_grouped_kv`). With a batch axis of 2 that
        sends as many bytes as replicated, at `1/model` of the state (less over a larger one), so
        the rule writer takes it there (`_by_layers.kv_head_dim`), and the plan without a budget
        with it.

        Split on its hidden dimension instead, XLA splits the block's norm
        and gathers the query projection's input (337,468 bytes per step
        against 261,932 on the same model, at the same state; SmolLM3's Dense
        ones: 394,812 against 319,276), and split
        over the batch axis it permutes the kernel (319,276 bytes, more state
        than head_dim): neither is offered. Split on head_dim and on hidden
        over the batch axis (266,028 bytes, state 343,208 on that model) is
        not offered either: it is predicted exactly there, but in the budget
        plans of `tests/test_budget.py` (Llama and Gemma, 2×4) the compiled
        step sent 2.0–2.6× the predicted bytes over both axes together, for a
        reason not yet pinned. Nor is the split offered to the projections of
        Keras's own `GroupQueryAttention`: in the smallest plan of a Keras
        encoder (2×4) the compiled step sent 8% more than predicted.

        With a bias (Qwen's; kept replicated: split too, its gradient is still all-reduced whole and
        the bytes are the same), XLA all-gathers the projection's output forward and the kernel only
        backward, for the input gradient: none where the projection reads the model's input (a
        user's Dense block, 2×4, exact). The costs take it without a budget where that sends no more
        than replicated, not on Qwen (2×4: 6,144 + 3,072 bytes per kernel over 'model', 332,204 per
        step against 319,916), where the rule writer, which sees no activations, keeps it whole.

        A kernel read by more than one projection (T5Gemma 2's merged
        self/cross attention: the decoder's and the encoder's keys) has its
        gradient all-reduced over the batch axis once per read, split or
        not, and is gathered once per step (measured on keras-hub T5Gemma 2,
        2×4, without a budget and at its smallest plan).
        """
        uses = self.uses.get(variable.path, ())
        whole = self.proposal.whole_outputs
        kv_heads = self.proposal.kv_heads
        index = head_dim_index(owner, variable, uses, self.m, whole, with_bias=True, kv_heads=kv_heads)
        if index is None or id(owner) in self._keras_attention_projections():
            return None
        size = nbytes(variable)
        wire: dict[str, float] = {}
        biased = owner.bias is not None
        if not biased and variable.trainable:  # gathered where read, the forward copy kept for the backward
            self.gathered_kernels().add(variable.path)
        add_wire(wire, self.batch_axis, self._grad_sync(variable, self.m))
        if not biased:
            add_wire(wire, self.model_axis, self._kernel_gathers(variable, uses))
        elif not all(use.from_input for use in uses):
            add_wire(wire, self.model_axis, wire_bytes("all-gather", size, self.m))
        for use in uses if biased else ():
            gathered = self._activation(use.output, use.dtype)
            add_wire(wire, self.model_axis, wire_bytes("all-gather", gathered, self.m))
        axes = tuple(self.model_axis if i == index else None for i in range(len(variable.shape)))
        state = self._state(variable, self.m, variable.trainable)
        split = candidate("head_dim split", {variable.path: axes}, state, wire)
        replicated = self._replicated([variable])
        count, width = kv_head_count(owner, variable, kv_heads), variable.shape[index]
        dense = len(variable.shape) == 2
        note = {variable.path: _notes.kv_head_dim_split(count, width, self.model_axis, self.m, dense)}
        cheaper = biased and split.total <= replicated.total
        proposed = 1 if self.tp_axes.get(variable.path) == axes or cheaper else 0
        further = (*self._sharded_too(variable), *self._sharded_adapter(variable, split))
        candidates = (replicated, split, *further)
        return UnitCosts(owner.path, candidates, frozen(note), proposed=proposed)

    def _kernel_gathers(self, variable: keras.Variable, uses: Sequence[Use]) -> float:
        """The all-gathers over the model axis of a head_dim-split kernel without a bias, per step.

        XLA:CPU gathers it once, forward, and keeps it for the backward pass. XLA:TPU gathers it
        as its dots read it (bfloat16 for a float32 kernel) forward, and again backward for the
        input gradient, none there where the projection reads the model's input: for a float32
        kernel as many bytes (measured on keras-hub Llama and Mixtral, v5e 2×4, `data=2,
        model=4`: one bfloat16 gather per pass, overlapped with the query projection's matmul).
        """
        if self.compiler != "tpu":
            return wire_bytes("all-gather", nbytes(variable), self.m)
        passes = 1 + any(not use.from_input for use in uses)
        read = math.prod(variable.shape) * min(np.dtype(variable.dtype).itemsize, 2)
        return passes * wire_bytes("all-gather", read, self.m)

    def _sharded_too(self, variable: keras.Variable) -> tuple[Candidate, ...]:
        """A `Dense` key/value kernel's fully sharded layouts, as when replicated (SmolLM3's smallest)."""
        sharded = self._fully_sharded_unit(variable) if len(variable.shape) == 2 else None
        if sharded is None:
            return ()
        return tuple(
            c if c.notes else dataclasses.replace(c, notes=sharded.notes) for c in sharded.candidates[1:]
        )

    def _sharded_adapter(self, variable: keras.Variable, split: Candidate) -> tuple[Candidate, ...]:
        """The head_dim split with the kernel's LoRA `a` split `batch × model` ways too, where they divide.

        Following the kernel, `a` (`(hidden, kv_heads, rank)`) stays whole: in the smallest plan of a
        LoRA Llama (2 key/value heads, 2×4) it was 0.14 of the fully sharded floor's excess. Split
        on its input dimension over the batch axis and on its rank over the model axis, measured on
        XLA:CPU (that model, exact): `a` is all-gathered over the model axis forward and again
        backward (from its batch-axis shard) and over the batch axis forward; the adapters'
        gradients are reduced as `lora_wire` says (added by `_with_followers`). Split on its input
        dimension over the model axis instead, XLA moves the projection's activations (all-to-alls,
        1.42× the bytes over 'model'): not offered.
        """
        adapters = self.lora_pairs.get(variable.path)
        if adapters is None or self.d <= 1 or not adapters[0].trainable:
            return ()
        a, b = adapters
        if a.shape[0] % self.d or a.shape[-1] % self.m or self._kept_whole(a):
            return ()  # it does not divide, or the policy keeps it whole (`replicate_below`)
        size = nbytes(a)
        a_axes = (self.batch_axis, *(None,) * (len(a.shape) - 2), self.model_axis)
        b_axes = (None, split.axes[variable.path][-1])
        wire = dict(split.wire)
        add_wire(wire, self.model_axis, 2 * wire_bytes("all-gather", size / self.d, self.m))
        add_wire(wire, self.batch_axis, wire_bytes("all-gather", size, self.d))
        state = split.state + self._state(a, self.d * self.m, True)
        state += self._state(b, self._shards(b_axes), True)
        axes = {**split.axes, a.path: a_axes, b.path: b_axes}
        note = {a.path: _notes.lora_sharded(self.batch_axis, self.model_axis, self.d * self.m)}
        return (candidate("head_dim split", axes, state, wire, note),)

    def _keras_attention_projections(self) -> set[int]:
        """The ids of the projections inside Keras's own attention layers (`MultiHeadAttention`, ...)."""
        if self._keras_attention is None:
            self._keras_attention = {
                id(sub)
                for layer in _compat.sublayers(self.model)
                if isinstance(layer, ATTENTION)
                for sub in _compat.sublayers(layer)
            }
        return self._keras_attention

    def gathered_kernels(self) -> set[str]:
        """The kernels offered a head_dim split whose gathered copy XLA holds for the backward pass.

        Trainable and without a bias: a biased one is gathered only backward (above), and counting
        a frozen one's copy (a LoRA base kernel) put LoRA-Llama's smallest plan at a compiled peak
        of 318,660 bytes (predicted 0.950×) where it was 301,904 without (0.983×), 2×4.
        """
        if self._gathered is None:
            self._gathered = set()
        return self._gathered

    _keras_attention: set[int] | None = None

    def _grouped_kv(self, unit: str, layers: Mapping[int, keras.layers.Layer]) -> list[float]:
        """The traffic of key/value projections kept whole beside split query heads.

        Their gradients are summed over the devices whose query heads share a
        key/value head, and gathered back to all heads: per projection one
        all-reduce of one head's activations over those devices, and (with
        more than one key/value head) one all-gather of all of them. None for a frozen projection
        (no LoRA adapters training) whose input needs no gradient (measured on XLA:CPU, keras-hub
        Llama with `enable_lora(4)`: its first block's key projection).
        """
        extra: list[float] = []
        if not layers:
            return extra
        for layer in _compat.sublayers(self.model):
            path = getattr(layer, "path", None) or ""
            if path.rpartition("/")[0] != unit or id(layer) in layers:
                continue  # only the key/value projections of this very attention block
            heads = heads_dim(layer)
            if layer.path in self.proposal.kv_heads:  # a Dense key/value projection
                count = self.proposal.kv_heads[layer.path]
            elif heads is not None and heads[1] == "in" and layer.path in self.proposal.whole_outputs:
                count = layer.kernel.shape[heads[0]]
            else:
                continue
            if count == 0 or self.m % count:
                continue
            group = self.m // count
            adapters = self.lora_pairs.get(layer.kernel.path)
            trains = layer.kernel.trainable or (adapters is not None and adapters[0].trainable)
            for use in self.uses.get(layer.kernel.path, ()):
                if use.kind != "matmul" or (use.from_input and not trains):
                    continue  # a frozen projection of an input needing no gradient: none to sum
                extra.extend(
                    self._head_gradient_moves(
                        use, count, group, biased=getattr(layer, "bias", None) is not None
                    )
                )
        return extra

    def _head_gradient_moves(self, use: Use, count: int, group: int, biased: bool) -> tuple[float, ...]:
        """A whole key/value projection's gradient: summed over `group` devices, gathered over `count`.

        On XLA:CPU both move the gradient as the layer computes it (float32 at least). XLA:TPU moves
        what its dots read, bfloat16 for float32 operands (its default precision rounds them):
        the gather, before the projection's own backward dots, unless a bias's gradient reads it
        too; the sum where the projection's output reaches the attention's dot through reshapes
        and broadcasts alone (a value), not through a rotary embedding's arithmetic or a bias (a
        key: its gradient is summed in float32). Measured on keras-hub Llama (1 layer, hidden
        128; float32, `bfloat16`, `mixed_bfloat16`) and Mixtral (the hub row), exact, and Qwen
        (biased, 1.001), 2 key/value heads on v5e 2×4 (`data=2, model=4`).
        """
        all_heads = self._summed(use.output, use.dtype)
        if self.compiler != "tpu":
            summed = gathered = all_heads
        else:
            gathered = all_heads if biased else self._dot_operand(use.output, use.dtype)
            summed = (
                self._dot_operand(use.output, use.dtype) if self._reaches_dot_reshaped(use) else all_heads
            )
        moves = (wire_bytes("all-reduce", summed / count, group),)
        return (*moves, wire_bytes("all-gather", gathered, count)) if count > 1 else moves

    def _dot_operand(self, shape: Sequence[int], dtype: str) -> float:
        """Per-device bytes of an activation as an XLA:TPU dot reads it (floats over 16 bits in bfloat16)."""
        return math.prod(shape) / self.d * min(np.dtype(dtype).itemsize, 2)

    def _reaches_dot_reshaped(self, use: Use) -> bool:
        """Whether every path from a projection's output to a matmul goes through layout changes alone."""
        frontier = list(self.trace.nodes[use.node].outputs)
        while frontier:
            for index in self.trace.consumers.get(frontier.pop(), ()):
                node = self.trace.nodes[index]
                if node.primitive in _RESHAPES:
                    frontier.extend(node.outputs)
                elif node.primitive != "dot_general":
                    return False
        return True

    def _traced_kv(self, unit: str, wire: dict[str, float]) -> None:
        """Key/value weights of a custom layer kept whole beside this unit's split query heads.

        No layer output can be kept whole there (the projections are
        `ops.matmul` calls inside a layer), so, measured on XLA:CPU, each
        weight's gradient is summed only over the devices sharing a
        key/value head (group = model axis ÷ key/value heads), and every step
        the weight and its optimizer slots are all-gathered over that group;
        the activations cost as for `_grouped_kv`.
        """
        for path, owner in self.proposal.whole_kv.items():
            if owner != unit:
                continue
            count = self._kv_heads(path)
            if count is None or self.m % count:
                continue
            group = self.m // count
            variable = next(v for v in self.model.weights if v.path == path)
            size = nbytes(variable)
            add_wire(wire, self.batch_axis, self._grad_sync(variable, group) - self._grad_sync(variable, 1))
            gathered = (1 + self.memory.like_parameter) * wire_bytes("all-gather", size, group)
            add_wire(wire, self.model_axis, gathered)
            for _, output, _, dtype in self.calls(path):
                all_heads = self._summed(output, dtype)
                add_wire(wire, self.model_axis, wire_bytes("all-reduce", all_heads / count, group))
                if count > 1:
                    add_wire(wire, self.model_axis, wire_bytes("all-gather", all_heads, count))

    def _kv_heads(self, path: str) -> int | None:
        """The key/value heads a projection's output is reshaped into (`(..., heads, head_dim)`)."""
        for use in self.uses.get(path, ()):
            output = self.trace.nodes[use.node].outputs[0]
            for index in self.trace.consumers.get(output, ()):
                node = self.trace.nodes[index]
                shape = self.trace.shapes[node.outputs[0]]
                if node.primitive == "reshape" and len(shape) == len(use.output) + 1:
                    return int(shape[-2])
        return None

    _gathered: set[str] | None = None
