"""What an optimizer's update sends on split variables (`update_wire`): Muon's, Adafactor's, Lamb's.

An element-wise update (SGD, Adam, AdamW, Lion...) runs on each device's shards and sends nothing.
Adafactor sums and gathers a matrix's row and column statistics (`adafactor_wire`), Lamb sums its
norms (`lamb_wire`). Keras's Muon orthogonalises each split matrix's update whole (`muon_wire`).

Muon's update of a 2-D weight runs Newton-Schulz iterations (`ns_steps`, five by default) on its
momentum `x`, transposed first when it is taller than wide so that `x` is `(s, l)`, `s ≤ l`:
`a = x @ xᵀ` (`s × s`), `x = α x + (β a + γ a @ a) @ x`, after dividing `x` by its norm. On a
matrix split over mesh axes XLA partitions those products, and every iteration sends (one
all-reduce of one float for the norm besides, over each split axis). With `s` split `a` ways
and `l` split `b` ways, measured on XLA:CPU (2×4, 4×2, 2×8, 8×2, 4×4, 2×16, 4×8, 8×4; Dense
kernels 64 × 256, 256 × 64, 128 × 128, 256 × 256 and 256 × 1,024; the step under SGD as the
baseline):

- `l` split alone (`a = 1`): `x @ xᵀ`'s partial sums, one all-reduce of `s × s` over `l`'s axes;
- `s` split alone, over fewer devices than the mesh's other axes hold (`f ≥ a`): XLA spreads the
  products over those axes too: over them one all-gather of `x` and all-reduces of `s/a × s` and
  `s/a × l`, and over them and `s`'s axes collective-permutes of `s/f × s` and `s/f × l` (twice:
  `x` and `xᵀ`);
- else `s` split, `a > b`: two all-gathers of `x`'s block `s × l/b` over `s`'s axes (`x` and
  `xᵀ`) and one of `a`, `s × s`; over `l`'s axes (`b > 1`) one all-reduce of `s/a × s`;
- `1 < a ≤ b`: two all-gathers of `s × l/b` over `s`'s axes, two all-reduces of `s/a × s` over
  `l`'s, and one collective-permute of `s/b × s` over both.

XLA:TPU (v5e 2×4, libtpu 0.0.42.1, the same kernels) sends the same all-reduces and gathers each
operand once, in bfloat16 (its default precision rounds a dot's float32 operands), the
permutes too (one of `s/f × l`), and sums the norm's float once over all the split axes.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._axes import Axes, entry_axes, entry_size, shards_of
from ..core._errors import MeshLayoutWarning
from ..core._memory import optimizer_of
from ..core._rules import LayoutRules
from ..report._collectives import wire_bytes
from ._candidates import Candidate, CostTable, frozen
from ._update_memory import muon_matrices

__all__ = [
    "adafactor_wire",
    "lamb_wire",
    "muon_wire",
    "update_wire",
    "warn_unpredicted_updates",
    "with_update_wire",
]

#: XLA:TPU's dots read float32 operands as bfloat16 (its default precision): what it gathers for them.
_TPU_OPERAND_BYTES = 2


def muon_wire(
    shape: Sequence[int],
    axes: Axes,
    axis_sizes: Mapping[str, int],
    itemsize: int = 4,
    steps: int = 5,
    compiler: str = "cpu",
) -> dict[str, float]:
    """Bytes each device sends per step in Muon's update of one matrix laid out as `axes`, by axis.

    Example:
        >>> muon_wire((64, 256), (None, "model"), {"data": 2, "model": 4})  # 5 × 64 × 64 floats summed
        {'model': 122886.0}
    """
    tall = shape[0] > shape[1]  # Keras transposes a tall matrix: its rows are the long side
    s, long = (shape[1], shape[0]) if tall else (shape[0], shape[1])
    s_entry, l_entry = (axes[1], axes[0]) if tall else (axes[0], axes[1])
    a, b = entry_size(s_entry, axis_sizes), entry_size(l_entry, axis_sizes)
    on_s, on_l = _label(s_entry, axis_sizes), _label(l_entry, axis_sizes)
    on_both = _label((*entry_axes(s_entry), *entry_axes(l_entry)), axis_sizes)
    tpu = compiler == "tpu"
    gathered = min(itemsize, _TPU_OPERAND_BYTES) if tpu else itemsize
    x_gathers = 1 if tpu else 2  # `x` and `xᵀ`; XLA:TPU gathers the one copy
    wire: dict[str, float] = {}

    def add(label: str, amount: float) -> None:
        if amount:
            wire[label] = wire.get(label, 0.0) + steps * amount

    used = {*entry_axes(s_entry), *entry_axes(l_entry)}
    free = tuple(axis for axis in axis_sizes if axis not in used)
    f, on_free = entry_size(free, axis_sizes), _label(free, axis_sizes)
    if a == 1:
        add(on_l, wire_bytes("all-reduce", s * s * itemsize, b))
    elif b == 1 and f >= a:  # the products spread over the axes the matrix is whole on
        add(on_free, wire_bytes("all-gather", s * long * gathered, f))
        add(on_free, wire_bytes("all-reduce", s // a * (s + long) * itemsize, f))
        add(_label((*free, *entry_axes(s_entry)), axis_sizes), s // f * (s + x_gathers * long) * gathered)
    elif a > b:
        add(on_s, x_gathers * wire_bytes("all-gather", s * long // b * gathered, a))
        add(on_s, wire_bytes("all-gather", s * s * gathered, a))
        add(on_l, wire_bytes("all-reduce", s // a * s * itemsize, b))
    else:
        add(on_s, x_gathers * wire_bytes("all-gather", s * long // b * gathered, a))
        add(on_l, 2 * wire_bytes("all-reduce", s // a * s * itemsize, b))
        add(on_both, s // b * s * gathered)  # a collective-permute
    for label, size in [(on_both, a * b)] if tpu else [(on_s, a), (on_l, b)]:
        if size > 1:
            wire[label] = wire.get(label, 0.0) + wire_bytes("all-reduce", itemsize, size)
    return wire


def _label(entry: object, axis_sizes: Mapping[str, int]) -> str:
    """The label `kml.comm_report` gives a collective over `entry`'s axes: mesh order, joined by `×`."""
    named = set(entry_axes(entry))
    return "×".join(axis for axis in axis_sizes if axis in named and axis_sizes[axis] > 1)


def adafactor_wire(
    shape: Sequence[int], axes: Axes, axis_sizes: Mapping[str, int], itemsize: int = 4, compiler: str = "cpu"
) -> dict[str, float]:
    """Bytes each device sends per step in Adafactor's update of one variable laid out as `axes`, by axis.

    A matrix's row statistic (the mean of the squared gradient over its columns) is summed over
    the columns' axes and gathered over the rows' (Keras keeps it whole), its column statistic
    the other way round, and the row statistic's mean summed over the rows' axes; the variable's
    and the update's root-mean-squares are one float summed over each split entry (a vector's
    too). Measured on XLA:CPU (2×4 and 4×2; Dense kernels and biases split on either side, on
    both, one side over both axes). XLA:TPU (v5e 2×4) sums each root-mean-square once over all
    the variable's axes, and gathers the statistics only on some layouts (not followed: it sends
    up to 900 bytes a matrix fewer, or 192 more, than this).

    Example:
        >>> adafactor_wire((64, 256), (None, "model"), {"data": 2, "model": 4})  # 64 summed, 256 gathered
        {'model': 1164.0}
    """
    wire: dict[str, float] = {}

    def add(entry: object, kind: str, size: float) -> None:
        if (label := _label(entry, axis_sizes)) and (
            amount := wire_bytes(kind, size, entry_size(entry, axis_sizes))
        ):
            wire[label] = wire.get(label, 0.0) + amount

    for entry in _norm_entries(axes, compiler):  # the variable's root-mean-square and the update's
        add(entry, "all-reduce", itemsize)
        add(entry, "all-reduce", itemsize)
    if len(shape) < 2:
        return wire
    rows, columns = axes[-2], axes[-1]
    lead = (*(a for e in axes[:-2] for a in entry_axes(e)),)
    whole = math.prod(shape[:-2]) // shards_of(axes[:-2], axis_sizes)
    add(columns, "all-reduce", whole * shape[-2] // entry_size(rows, axis_sizes) * itemsize)
    add((*lead, *entry_axes(rows)), "all-gather", math.prod(shape[:-1]) * itemsize)
    add(rows, "all-reduce", whole * shape[-1] // entry_size(columns, axis_sizes) * itemsize)
    add((*lead, *entry_axes(columns)), "all-gather", math.prod(shape[:-2]) * shape[-1] * itemsize)
    add(rows, "all-reduce", whole * itemsize)  # the row statistic's mean
    return wire


def lamb_wire(
    axes: Axes, axis_sizes: Mapping[str, int], itemsize: int = 4, compiler: str = "cpu"
) -> dict[str, float]:
    """Bytes each device sends per step in Lamb's update of one variable: its norm and its update's,
    one float summed over each split entry (XLA:CPU, 2×4 and 4×2), over all of them at once on
    XLA:TPU (v5e 2×4).

    Example:
        >>> lamb_wire(("data", "model"), {"data": 2, "model": 4})
        {'data': 8.0, 'model': 12.0}
    """
    wire: dict[str, float] = {}
    for entry in _norm_entries(axes, compiler):
        if label := _label(entry, axis_sizes):
            wire[label] = wire.get(label, 0.0) + 2 * wire_bytes(
                "all-reduce", itemsize, entry_size(entry, axis_sizes)
            )
    return wire


def update_wire(
    optimizer: Any, variable: keras.Variable, axes: Axes, axis_sizes: Mapping[str, int], compiler: str = "cpu"
) -> dict[str, float]:
    """What `optimizer`'s update of `variable` laid out as `axes` sends per step, by axis label.

    Muon's matrices (`muon_wire`), Adafactor's statistics (`adafactor_wire`) and Lamb's norms
    (`lamb_wire`); an element-wise update (SGD, Adam, AdamW, Lion...) sends nothing.
    """
    if not any(axes):
        return {}
    item = np.dtype(variable.dtype).itemsize
    if isinstance(optimizer, keras.optimizers.Muon):
        if not _compat.orthogonalised(optimizer, variable):
            return {}  # its AdamW update
        return muon_wire(variable.shape, axes, axis_sizes, item, optimizer.ns_steps, compiler)
    if isinstance(optimizer, keras.optimizers.Adafactor):
        return adafactor_wire(variable.shape, axes, axis_sizes, item, compiler)
    if isinstance(optimizer, keras.optimizers.Lamb):
        return lamb_wire(axes, axis_sizes, item, compiler)
    return {}


def _norm_entries(axes: Axes, compiler: str) -> list[object]:
    """The entries a sum over a whole variable is all-reduced over: each split one on XLA:CPU, all
    of them as one on XLA:TPU."""
    if compiler != "tpu":
        return list(axes)
    return [tuple(axis for entry in axes for axis in entry_axes(entry))]


def with_update_wire(
    table: CostTable,
    model: keras.Model,
    optimizer: Any,
    axis_sizes: Mapping[str, int],
    compiler: str = "cpu",
) -> CostTable:
    """`table` with what each candidate's layouts send in `optimizer`'s update added to its wire."""
    optimizer = None if optimizer is None else optimizer_of(optimizer)
    if not isinstance(optimizer, (keras.optimizers.Muon, keras.optimizers.Adafactor, keras.optimizers.Lamb)):
        return table
    trainable = {v.path: v for v in model.trainable_weights}

    def updated(option: Candidate) -> Candidate:
        wire = dict(option.wire)
        for path, axes in option.axes.items():
            if path in trainable:
                for label, amount in update_wire(
                    optimizer, trainable[path], axes, axis_sizes, compiler
                ).items():
                    wire[label] = wire.get(label, 0.0) + amount
        return dataclasses.replace(option, wire=frozen(wire))

    units = tuple(
        dataclasses.replace(unit, candidates=tuple(updated(c) for c in unit.candidates))
        for unit in table.units
    )
    return dataclasses.replace(table, units=units)


def warn_unpredicted_updates(model: keras.Model, rules: LayoutRules, optimizer: Any) -> None:
    """Warns when the plan splits a matrix that Muon orthogonalises (its update's peak is estimated)."""
    split = [
        path
        for path in muon_matrices(model, optimizer)
        if (rule := rules.match(path)) is not None and any(rule.expand(2))
    ]
    if split:
        warnings.warn(
            f"Muon orthogonalises each matrix's update whole (Newton-Schulz iterations): for the "
            f"{len(split)} kernel(s) this plan splits ({split[0]!r}...), XLA holds the iterations' "
            "products, which rules.cost.peak_bytes only estimates (0.93-1.12 of XLA:CPU's compiled "
            "peak on the plans measured; not at all on XLA:TPU). The bytes they send are "
            "predicted. Compile the plan for the real peak: kml.compile_step, or plan --compile.",
            MeshLayoutWarning,
            stacklevel=5,
        )
