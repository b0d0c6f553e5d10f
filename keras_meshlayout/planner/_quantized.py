"""Strategy: quantized weights' scales split with their weight; int4 kernels read as their float shape.

An int8 `Dense` or `EinsumDense` keeps its kernel as `int8` (not trainable)
and a float32 `kernel_scale` laid out like its output: `(units,)` for a
`Dense`, the output's shape with 1 for every dimension the kernel lacks for
an `EinsumDense` (`(1, 1, heads, head_dim)` for `btd,dnh->btnh`). An int8
`Embedding` keeps one scale per row of its table (`embeddings_scale`), and
keras-hub's `ReversibleEmbedding` one per logit of its reverse table. Every
other strategy plans the int8 weight as it would a float one; this one gives
the scale the weight's axis on each dimension they share
(`_layers.quantized_weights`, read from Keras's own list of what an int8 layer
stores), so each device holds the scales of its own features or rows and
nothing moves. The scale joins the weight's unit.

What the step sends beside (`_costs`): a row-parallel int8 projection
quantizes its input per position over the features it sums, which are
split, so their absolute maximum is all-reduced over the model axis forward
(one float32 per position). A vocab-parallel int8 table all-reduces its
looked-up int8 rows and their looked-up scales (`_one_weight`).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import keras

from .. import _compat
from . import _notes
from ._layers import int4_shape, quantized_weights
from ._ledger import Ledger, Setting
from ._unpacking import merges_lora

__all__ = ["Int4Kernel", "int8_scales", "stored_int4"]


class Int4Kernel:
    """An int4 layer's weight as the strategies read it: the packed int8 variable Keras stores, with
    the shape of the float weight it stands for (`(in, units)`, an `EinsumDense`'s equation's).

    Keras stores a `Dense` or `EinsumDense` int4 kernel flattened to 2-D (the dimensions it sums
    over, then the others) and packs two columns into each byte; an `Embedding` table's features
    are packed the same way. The strategies lay out the float shape, the `Ledger` the stored one
    (`packed_axes`).
    """

    def __init__(self, variable: Any, shape: tuple[int, ...]) -> None:
        self.variable = variable
        self.shape = tuple(int(d) for d in shape)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.variable, name)


@contextlib.contextmanager
def stored_int4() -> Iterator[None]:
    """An int4 layer's `kernel` (`embeddings`) is its `Int4Kernel` inside the block.

    Keras computes the unpacked weight from the packed one each time it is read: under
    `kml.dry_build` from a variable with no value (a leaked tracer), and outside it a copy the
    planner has no use for. A quantized LoRA layer's (int8's) `kernel` is the one it stores: Keras
    would add `a @ b` to it, which such a layer never computes with.
    """
    read: dict[int, Int4Kernel] = {}

    def stored(layer: Any, unpacked: Callable[[Any], Any], name: str) -> Any:
        shape = int4_shape(layer)
        if shape is None:  # a quantized LoRA layer's kernel is the one stored, not merged (`merges_lora`)
            lora = getattr(layer, "lora_enabled", False) and not merges_lora(layer)
            return _compat.stored_weight(layer, name) if lora else unpacked(layer)
        if id(layer) not in read:  # one object per layer, however often it is read
            read[id(layer)] = Int4Kernel(_compat.stored_weight(layer, name), shape)
        return read[id(layer)]

    with contextlib.ExitStack() as stack:
        for cls, name in ((keras.layers.Dense, "kernel"), (keras.layers.EinsumDense, "kernel"),
                          (keras.layers.Embedding, "embeddings")):  # fmt: skip
            stack.enter_context(_compat.property_replaced(cls, name, functools.partial(stored, name=name)))
        yield


def int8_scales(ledger: Ledger, setting: Setting) -> None:
    """Lays out each int8 weight's scale as its weight's features or rows, whoever took the weight."""
    for layer in _compat.sublayers(setting.model):
        for weight, scale, follow in quantized_weights(layer):
            weight_axes = ledger.axes(weight.path)
            axes = None if weight_axes is None else follow(weight_axes)
            if axes is None:
                continue
            note = _notes.int8_scale(
                setting.display(layer.path), axes, weight.name, scale.name, layer.quantization_mode
            )
            # An earlier strategy may have taken the scale for its layer's other weights (a bias): revised.
            ledger.revise(scale.path, axes, note, unit=ledger.unit(weight.path))
