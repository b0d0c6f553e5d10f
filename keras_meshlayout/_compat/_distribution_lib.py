"""Keras's distribution functions, wrapped where a layer's output or a batch goes through them."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["WRAPPED", "wrap_distribute_data_input", "wrap_distribute_tensor"]

#: The attribute that marks a function of Keras's as wrapped by us (once).
WRAPPED = "_kml_guarded"


def wrap_distribute_data_input(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces Keras's `distribute_data_input` (looked up for every batch) by `wrap(original)`, once."""
    from keras.src.backend.jax import distribution_lib

    _wrap_once(distribution_lib, "distribute_data_input", wrap)


def wrap_distribute_tensor(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replaces `keras.src.distribution.distribution_lib.distribute_tensor` (what a layer's output goes
    through, looked up at each call) by `wrap(original)`, once."""
    from keras.src.distribution import distribution_lib

    _wrap_once(distribution_lib, "distribute_tensor", wrap)


def _wrap_once(module: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(module, name)
    if not getattr(original, WRAPPED, False):
        wrapped = functools.wraps(original)(wrap(original))
        setattr(wrapped, WRAPPED, True)
        setattr(module, name, wrapped)
