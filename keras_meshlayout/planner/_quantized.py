"""Strategy: int8 weights' scales (`model.quantize("int8")`) split with their weight.

An int8 `Dense` or `EinsumDense` keeps its kernel as `int8` (not trainable)
and a float32 `kernel_scale` laid out like its output: `(units,)` for a
`Dense`, the output's shape with 1 for every dimension the kernel lacks for
an `EinsumDense` (`(1, 1, heads, head_dim)` for `btd,dnh->btnh`). An int8
`Embedding` keeps one scale per row of its table (`embeddings_scale`), and
keras-hub's `ReversibleEmbedding` one per logit of its reverse table. Every
other strategy plans the int8 weight as it would a float one; this one gives
the scale the weight's axis on each dimension they share
(`_layers.int8_weights`, read from Keras's own list of what an int8 layer
stores), so each device holds the scales of its own features or rows and
nothing moves. The scale joins the weight's unit.

What the step sends beside (`_costs`): a row-parallel int8 projection
quantizes its input per position over the features it sums, which are
split, so their absolute maximum is all-reduced over the model axis forward
(one float32 per position). A vocab-parallel int8 table all-reduces its
looked-up int8 rows and their looked-up scales (`_one_weight`).
"""

from __future__ import annotations

from .. import _compat
from . import _notes
from ._layers import int8_weights
from ._ledger import Ledger, Setting

__all__ = ["int8_scales"]


def int8_scales(ledger: Ledger, setting: Setting) -> None:
    """Lays out each int8 weight's scale as its weight's features or rows, whoever took the weight."""
    for layer in _compat.sublayers(setting.model):
        for weight, scale, follow in int8_weights(layer):
            weight_axes = ledger.axes(weight.path)
            axes = None if weight_axes is None else follow(weight_axes)
            if axes is None:
                continue
            note = _notes.int8_scale(setting.display(layer.path), axes, weight.name)
            # An earlier strategy may have taken the scale for its layer's other weights (a bias): revised.
            ledger.revise(scale.path, axes, note, unit=ledger.unit(weight.path))
