"""Strategy: LoRA adapters (`layer.enable_lora(rank)`) follow their base kernel's split.

A LoRA layer computes with `kernel + (alpha / rank) · a @ b`, where `a` has
the kernel's shape with its last dimension replaced by the rank and `b` is
`(rank, last dimension)`. The planner traces the model with LoRA off
(`_compat.lora_off`), so every other strategy plans the base kernel as the
projection weight it is; this one then gives the adapters the kernel's
split: `a` takes the kernel's axes on every dimension but the last, `b`
the kernel's axis of its last dimension, so `a @ b` comes out split as the
kernel is and is added without moving anything. Both join the kernel's unit,
so a budget plan lays them out together, and they stay split however small
(`replicate_below`): kept whole beside a split kernel, XLA computes their
gradients split and gathers them and each optimizer slot after every update.

What the step sends for them (`_costs`): XLA sums the gradient of the whole
kernel `kernel + a @ b` (its shard on each device) over the batch axis, not
the adapters' own, and an adapter left whole beside a split kernel (`b`
beside a kernel split on an input or head dimension) has its gradient
summed over the model axis.
"""

from __future__ import annotations

from . import _notes
from ._layers import lora_axes
from ._ledger import Ledger, Setting
from ._unpacking import lora_layers, lora_parts

__all__ = ["lora_adapters"]


def lora_adapters(ledger: Ledger, setting: Setting) -> None:
    """Gives each LoRA layer's adapters the axes of its (already decided) base kernel, whoever took them."""
    for layer in lora_layers(setting.model):
        found = lora_parts(layer)
        if found is None:
            continue
        base, a, b = found
        axes = ledger.axes(base.path)
        if axes is None:
            continue
        if base.path in ledger.packed:  # an int4 kernel stored flattened: its adapters have the float rank
            axes = ledger.packed[base.path].unpacked(axes)
        unit = ledger.unit(base.path)
        name = setting.display(layer.path)
        a_axes, b_axes = lora_axes(axes, "a"), lora_axes(axes, "b")
        # An earlier strategy may have taken the adapters for its layer's other weights (a bias): revised.
        # Split however small (`replicate_below`): whole beside a split kernel, XLA computes their
        # gradients split and gathers them, and each optimizer slot, after every update.
        ledger.revise(a.path, a_axes, _notes.lora(name, "a", a_axes), unit=unit, keep_split=True)
        ledger.revise(b.path, b_axes, _notes.lora(name, "b", b_axes), unit=unit, keep_split=True)
