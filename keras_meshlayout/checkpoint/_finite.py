"""The finite-state guard: which variable of the training state, if any, holds NaN or infinity."""

from __future__ import annotations

import functools
from typing import Any

import keras
import numpy as np

from . import _manifest

__all__ = ["first_nonfinite"]


@functools.cache
def _check() -> Any:
    """One jitted check of a list of arrays (compiled by `jax.jit` once per list of shapes)."""
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda values: jnp.stack([jnp.all(jnp.isfinite(v)) for v in values]))


def first_nonfinite(model: keras.Model) -> str | None:
    """The path of the first variable (model, then optimizer) holding NaN or inf, or `None`.

    Only floating-point variables are read, on their devices (one compiled reduction for all
    of them); every process of a multi-process run must call it, as it is a collective there.
    """
    variables = [v for v in _manifest.model_variables(model) if keras.backend.is_float_dtype(v.dtype)]
    if not variables:
        return None
    flags = _check()([v.value for v in variables])
    if not getattr(flags, "is_fully_addressable", True):
        flags = flags.addressable_data(0)  # replicated: every device holds all of it
    for variable, finite in zip(variables, np.asarray(flags), strict=True):
        if not finite:
            return variable.path
    return None
