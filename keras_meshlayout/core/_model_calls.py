"""A model's own failure on the inputs kml was given, as one clear error before any compute.

The planner traces the model on `batch=`, `kml.compile_step` traces Keras's training step on
`x` and `y`: a wrong structure or shape fails deep inside Keras or JAX, naming neither. Here
it becomes an `InvalidOptionError` saying what was given, what failed and how to fix it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._errors import InvalidOptionError, MeshLayoutError

__all__ = ["failing_on"]


@contextlib.contextmanager
def failing_on(model: Any, given: dict[str, Any], fix: str) -> Iterator[None]:
    """Turns a non-kml exception raised in the block into `InvalidOptionError`.

    Args:
        model: The model being called (named in the message).
        given: What it was called on, by argument name (`{"batch": x}`): their shapes are shown.
        fix: What to do, after "Fix: ".

    Example:
        >>> import numpy as np
        >>> class Model:
        ...     name = "m"
        >>> try:
        ...     with failing_on(Model(), {"x": np.zeros((4, 3))}, "pass x with 2 features."):
        ...         raise TypeError("incompatible shapes")
        ... except InvalidOptionError as error:
        ...     message = str(error)
        >>> message.startswith("Model 'm' could not be called on what was given (x (4, 3)): TypeError")
        True
        >>> message.endswith("incompatible shapes. Fix: pass x with 2 features.")
        True
    """
    try:
        yield
    except MeshLayoutError:
        raise
    except Exception as error:
        import keras

        shown = ", ".join(
            f"{name} {keras.tree.map_structure(lambda v: tuple(getattr(v, 'shape', ())), value)}"
            for name, value in given.items()
        )
        said = (str(error).strip().splitlines() or [""])[0].rstrip(". ")
        raise InvalidOptionError(
            f"Model {model.name!r} could not be called on what was given ({shown}): "
            f"{type(error).__name__}: {said}. Fix: {fix}"
        ) from error
