"""A model's traces, once per state: planning the same model again does not trace it again.

`memoised(kind, model, batch, make)` keeps, per model (weakly, as long as it lives), the last few
results of `make()` by what a trace depends on beyond the model's code (`_state_key`): every
variable's path, shape, dtype and trainability, each layer's dtype policy and LoRA switch, the
batch's structure, shapes and dtypes, and the global settings a layer reads when called. Enabling
LoRA, quantizing, freezing a layer or changing a policy traces afresh.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import keras
import numpy as np

from .. import _compat

__all__ = ["memoised"]

T = TypeVar("T")

#: Per model, its latest traces by `_state_key` (`memoised`): planning a model again (a budget retried
#: after a `MemoryBudgetError`, the budget search then its plan) does not trace it again.
_TRACES: weakref.WeakKeyDictionary[Any, dict[Hashable, Any]] = weakref.WeakKeyDictionary()
_TRACES_PER_MODEL = 4


def _state_key(model: keras.Model, batch: Any) -> Hashable:
    """What a trace of `model` on `batch` depends on beyond the model's code: every variable's path, shape,
    dtype and trainability, each layer's dtype policy and LoRA switch, the batch's shapes and dtypes, and
    the global settings a layer reads when called (float type, distribution, matmul precision)."""
    import jax

    variables = tuple((v.path, tuple(v.shape), str(v.dtype), v.trainable) for v in model.variables)
    layers = tuple(
        (
            layer.name,
            getattr(getattr(layer, "dtype_policy", None), "name", None),
            getattr(layer, "lora_enabled", None),
        )
        for layer in _compat.sublayers(model)
    )
    arrays = tuple(
        (tuple(leaf.shape), str(np.dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype)))
        for leaf in keras.tree.flatten(batch)
    )
    settings = (
        keras.config.floatx(),
        keras.config.dtype_policy().name,
        id(keras.distribution.distribution()),
        str(jax.config.jax_default_matmul_precision),
    )
    return variables, layers, keras.tree.map_structure(lambda _: None, batch).__repr__(), arrays, settings


def memoised(kind: str, model: keras.Model, batch: Any, make: Callable[[], T]) -> T:
    """`make()`, or what it gave for the same `model` in the same state (`_state_key`) on a batch of the
    same shapes: `kind` names what `make` computes. What it returns is shared, so must be immutable (a
    `Trace` is)."""
    try:
        memo = _TRACES.setdefault(model, {})
        key = (kind, _state_key(model, batch))
    except (TypeError, AttributeError):  # a model that cannot be weakly referenced, a batch without shapes
        return make()
    if key not in memo:
        if len(memo) >= _TRACES_PER_MODEL:
            memo.pop(next(iter(memo)))
        memo[key] = make()
    return memo[key]
