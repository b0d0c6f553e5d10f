"""Output rules checked against the tensor they lay out, when Keras applies them to a layer's output.

Keras asks the distribution for the layout of `<layer path>/output` after each layer call
(`get_tensor_layout`) and hands it, with the output, to `distribute_tensor`. A rule of another
rank failed inside JAX's `with_sharding_constraint` naming neither the rule nor the layer, and a
rule on a layer that returns several tensors (an `LSTM(return_state=True)`) failed while the
functional model was being built, in `jax.device_put`. `ModelParallel.get_tensor_layout` notes
which rule it answered with (`asked`), and Keras's `distribute_tensor`, wrapped
(`_compat.wrap_distribute_tensor`), checks the output against it (`check`) first.
"""

from __future__ import annotations

import contextvars
from typing import Any

import keras

from ._errors import InvalidRuleError, RankMismatchError
from ._rule import Rule

__all__ = ["asked", "check"]

#: The output path, rule and layout `get_tensor_layout` last answered with, until `distribute_tensor`
#: is given that layout.
_ASKED: contextvars.ContextVar[tuple[str, Rule, Any] | None] = contextvars.ContextVar(
    "kml_output", default=None
)


def asked(path: str, rule: Rule | None, layout: Any) -> None:
    """Notes that the layout of `path` (a `<layer>/output`) was asked for, and `rule` gave `layout`."""
    _ASKED.set(None if rule is None else (path, rule, layout))


def check(tensor: Any, layout: Any) -> None:
    """Raises if the output rule noted by `asked` cannot lay out `tensor`, when `layout` is the one it
    gave (a layer's output, not a tensor laid out by other code); then forgets the rule.

    Raises:
        InvalidRuleError: the layer returns several tensors, where an output rule lays out one.
        RankMismatchError: the rule has another rank than the output.
    """
    noted = _ASKED.get()
    _ASKED.set(None)
    if noted is None or noted[2] is not layout:
        return
    path, rule, _ = noted
    layer = path.removesuffix("/output")
    leaves = keras.tree.flatten(tensor)
    if len(leaves) != 1:
        shapes = ", ".join(str(tuple(getattr(leaf, "shape", ()))) for leaf in leaves)
        raise InvalidRuleError(
            f"{rule.describe()} lays out the output of layer {layer!r}, which returns {len(leaves)} "
            f"tensors ({shapes}): an output rule lays out one tensor. Fix: narrow the pattern to the "
            "layers that return one tensor, or lay the tensor out inside the layer's call with "
            "keras.distribution.distribute_tensor."
        )
    shape = tuple(getattr(leaves[0], "shape", ()))
    axes = tuple(rule.axes)
    fits = len(shape) >= len(axes) - 1 if Ellipsis in axes else len(shape) == len(axes)
    if not fits:
        raise RankMismatchError(
            f"{rule.describe()} gives the output of layer {layer!r} {len(axes)} entries, but that "
            f"output has rank {len(shape)} (shape {shape}). Fix: one entry per dimension, e.g. "
            f"{(axes[0], *(None,) * (len(shape) - 1)) if shape else ()!r} for its batch dimension, or "
            "a pattern that matches only the layers whose output has that rank."
        )
