"""The JAX trainer's compiled steps, seen one at a time: the state each step returns.

With `steps_per_execution=N` Keras runs N compiled steps in one Python loop (`_make_function`'s
`iterator_step`), each donating the state it is given, and keeps the state between them in a
local variable: an error after the first step of a group (the next batch fails to load, or does
not divide by the batch axis) lost every variable, and a later `fit` crashed the process.
`wrap_steps` hands each step's returned state to a recorder, so that it can be put back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ._distribution_lib import WRAPPED

__all__ = ["state_by_key", "wrap_steps"]

#: Which variable groups (as `STATE_KEYS` names them) a step's state tuple holds, by its length:
#: `train_step`'s four, `test_step`'s three (no optimizer), `predict`'s two.
_GROUPS = {
    4: ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables"),
    3: ("trainable_variables", "non_trainable_variables", "metrics_variables"),
    2: ("trainable_variables", "non_trainable_variables"),
}


def wrap_steps(record: Callable[[Any], None]) -> None:
    """Makes every step function the JAX trainer builds call `record(state)` with the state it returns."""
    from keras.src.backend.jax.trainer import JAXTrainer

    method = JAXTrainer._make_function
    if getattr(method, WRAPPED, False):
        return

    @functools.wraps(method)
    def make_function(model: Any, step_function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        def recorded(state: Any, data: Any) -> Any:
            outputs, state = step_function(state, data)
            record(state)
            return outputs, state

        return method(model, recorded, *args, **kwargs)

    setattr(make_function, WRAPPED, True)
    JAXTrainer._make_function = make_function


def state_by_key(state: Any) -> dict[str, Any]:
    """A step's returned state as `{group name: values}` (`_GROUPS`); `{}` for another shape."""
    if not isinstance(state, (tuple, list)) or len(state) not in _GROUPS:
        return {}
    return dict(zip(_GROUPS[len(state)], state, strict=True))
