"""The batch-axis traffic of a 2-D expert bank whose tokens XLA gathers instead of its kernels.

`ExpertGathers` is the part of `_candidates.Bytes` that says, for an expert bank split on its
experts over the model (or expert) axis and on one more dimension over the batch axis (the
`2-D` candidate), whether XLA gathers the kernels (`_batch_gathers`) or the tokens, and
what the second sends: measured on XLA:TPU and XLA:CPU, which differ in the dtype and in how
often they gather.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from ..core._axes import Axes
from ..report._collectives import wire_bytes
from ._batch_gathers import nbytes

__all__ = ["ExpertGathers"]


class ExpertGathers:
    """A mixin of `_candidates.Bytes`, whose mesh (`d`, `m`, the axes), `proposal`, `compiler`, traced
    `uses`, `_activation_value`, `_grad_sync` and `_kept_for_backward` it reads."""

    d: int
    m: int
    model_axis: str
    proposal: Any
    tp_axes: Mapping[str, Axes]
    axis_sizes: Mapping[str, int]
    compiler: str
    batch_axis: str | None
    uses: Mapping[str, tuple[Any, ...]]

    def bank_gathers(
        self,
        name: str,
        variables: Sequence[keras.Variable],
        axes: Mapping[str, Axes],
        gathers: Mapping[str, float],
    ) -> float:
        """A 2-D candidate's gathers over the batch axis: of its kernels (`gathers`), or a bank's tokens.

        XLA gathers the tokens of an expert bank instead of its kernels where `token_gathers` says.
        """
        tokens = None
        if name in self.proposal.expert_units:
            shards = {v.path: self._unit_shards(self.tp_axes[v.path]) for v in variables}
            tokens = self.token_gathers(variables, axes, shards)
        if tokens is None:
            return sum(gathers.values())
        wire, kernels = tokens
        return wire + sum(amount for path, amount in gathers.items() if path not in kernels)

    def token_gathers(
        self, variables: Sequence[keras.Variable], axes: Mapping[str, Axes], shards: Mapping[str, int]
    ) -> tuple[float, frozenset[str]] | None:
        """What a 2-D expert bank sends over the batch axis where XLA gathers its tokens; which kernels.

        `None` where XLA gathers the kernels.

        A bank kernel split over the batch axis on an output dimension (a column: `th,ehm->etm`
        with `m` split) whose shard on one device (`shards`: its split over the experts) is at
        least as large as the projection's input for the whole batch is not gathered: XLA:TPU
        gathers the tokens instead (the smaller operand), so the projection's output is split on
        `m`, and the bank's row kernels (split on what they contract, `eti,eih->eth`) sum partial
        products. Per step: each distinct input gathered once forward and once per column
        projection backward (in bfloat16 from float32), its gradient all-reduced once over the
        whole batch (the columns' partial sums added first), each row projection's output
        all-reduced forward over the whole batch (and sliced to each device's tokens) and its
        gradient gathered backward (in bfloat16; twice, for each of the two products that read it,
        where the forward pass reads the kernel after its last attention, `_kept_for_backward`:
        the last layer's bank); no kernel is gathered and no kernel gradient
        is summed (each device computes its shard's from all tokens). The bytes are net of the
        kernels' gradient all-reduces, which the tensor-parallel wire holds; they replace those
        kernels' gathers. Measured with libtpu
        0.0.42.1 on a 2-layer keras-hub Mixtral (hidden 256, intermediate 512, 4 experts, 512
        tokens) fully sharded on v5e `data=8` and `data=2,model=4`; at intermediate 256 the
        column kernels are split on their contracted hidden dimension and the kernels are
        gathered (`_batch_gathers`), as for a Llama 3 whose kernels are smaller than its tokens.

        XLA:CPU (jax 0.10.2; the small keras-hub Mixtral of `tests/hub_models.py` fully sharded on
        `data=2,model=2` and `data=4,model=1`, one and two layers) gathers the tokens too, but in
        float32 and once (kept for the backward pass), sums each column projection's input
        gradient on its own, and gathers a row projection's output gradient once.
        """
        if self.batch_axis is None or self.d < 2:
            return None
        columns, rows = self._bank_sides(variables, axes)
        if not any(nbytes(v) / shards[v.path] >= self._whole(use.inputs, use.dtype) for v, use in columns):
            return None
        tpu = self.compiler == "tpu"
        kernels = {v.path: v for v, _ in columns + rows}
        wire = -sum(self._grad_sync(v, shards[path]) for path, v in kernels.items())
        inputs = {self._activation_value(use): use for _, use in columns}
        for use in inputs.values():
            wire += self._gather(use.inputs, use.dtype)  # forward, shared by the projections reading it
        # The input's gradient: XLA:TPU adds the columns' partial sums first, XLA:CPU sums each.
        for use in inputs.values() if tpu else [use for _, use in columns]:
            if not use.from_input:
                wire += wire_bytes("all-reduce", self._whole(use.inputs, use.dtype), self.d)
        if tpu:  # XLA:TPU gathers the tokens again for each projection backward; XLA:CPU keeps them
            wire += sum(self._gather(use.inputs, use.dtype) for _, use in columns)
        for variable, use in rows:
            output = self._whole(use.output, use.dtype) / shards[variable.path]
            again = 2 if tpu and self._kept_for_backward(variable) else 1
            wire += wire_bytes("all-reduce", output, self.d)
            wire += again * self._gather(use.output, use.dtype, shards[variable.path])
        return wire, frozenset(kernels)

    def _unit_shards(self, axes: Axes) -> int:
        """How many ways a bank weight is split over the model axis, or else the mesh's expert axis."""
        if self.model_axis in axes:
            return self.m
        axis = self.proposal.expert_axis
        return self.axis_sizes.get(axis, 1) if axis is not None and axis in axes else 1

    def _bank_sides(
        self, variables: Sequence[keras.Variable], axes: Mapping[str, Axes]
    ) -> tuple[list[tuple[keras.Variable, Any]], list[tuple[keras.Variable, Any]]]:
        """The bank's projections whose kernel the batch axis splits on an output, on a summed dimension."""
        columns, rows = [], []
        for variable in variables:
            layout = tuple(axes.get(variable.path, ()))
            if self.batch_axis not in layout:
                continue
            split = layout.index(self.batch_axis)
            for use in self.uses.get(variable.path, ()):
                if use.kind == "matmul":
                    (rows if split in use.contracted else columns).append((variable, use))
        return columns, rows

    def _whole(self, shape: Sequence[int], dtype: str) -> float:
        """Bytes of an activation of the whole batch."""
        return math.prod(shape) * np.dtype(dtype).itemsize

    def _gather(self, shape: Sequence[int], dtype: str, shards: int = 1) -> float:
        """An all-gather over the batch axis of an activation of the whole batch (XLA:TPU: float32 sent as
        bfloat16)."""
        itemsize = np.dtype(dtype).itemsize
        share = 2 / itemsize if itemsize > 2 and self.compiler == "tpu" else 1.0
        return wire_bytes("all-gather", self._whole(shape, dtype) * share / shards, self.d)
