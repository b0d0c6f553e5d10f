"""Every private part of Keras's JAX trainer that `kml`'s predict/evaluate support relies on.

Nothing else in `_inference.py` touches Keras internals; `tests/test_inference.py`
(`test_keras_internal_is_there`) names each one, so an upgrade of Keras that
removes or renames one fails that test with the name of what broke:

- `keras.src.backend.jax.trainer.JAXTrainer`: the class whose `fit`,
  `evaluate`, `predict`, `train_on_batch`, `test_on_batch` and
  `predict_on_batch` every `keras.Model` inherits on JAX. `kml` wraps them.
- `Variable._value`: the array a variable holds. Keras's trainer sets it to
  `None` while a loop runs ("purge", to save memory) and puts the values back
  only when the loop ends normally.
- `JAXTrainer._purge_model_variables`: the method that empties them. `kml`
  records the values just before, so that variables built inside the call
  (compile metrics, optimizer slots) can be put back too.
- `JAXTrainer._jax_state` and `_jax_state_synced`: the state produced by the
  last completed step, not yet written back to the variables.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: The trainer methods `kml` wraps, and whether each runs inference (`True`) or training.
TRAINER_METHODS: dict[str, bool] = {
    "fit": False,
    "train_on_batch": False,
    "evaluate": True,
    "test_on_batch": True,
    "predict": True,
    "predict_on_batch": True,
}

#: Keys of `JAXTrainer._jax_state`, in the order of the variable groups below.
STATE_KEYS = ("trainable_variables", "non_trainable_variables", "optimizer_variables", "metrics_variables")

_WRAPPED = "_kml_guarded"


def trainer_class() -> type:
    """Keras's JAX trainer class, which `keras.Model` inherits `fit`/`evaluate`/`predict` from."""
    from keras.src.backend.jax.trainer import JAXTrainer

    return JAXTrainer


def wrap_trainer_methods(wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]]) -> None:
    """Replaces each of `TRAINER_METHODS` on the JAX trainer by `wrap(method, is_inference)`, once."""
    trainer = trainer_class()
    for name, inference in TRAINER_METHODS.items():
        method = getattr(trainer, name)
        if getattr(method, _WRAPPED, False):
            continue
        wrapped = functools.wraps(method)(wrap(method, inference))
        setattr(wrapped, _WRAPPED, True)
        setattr(trainer, name, wrapped)


def wrap_purge(before_purge: Callable[[Any], None]) -> None:
    """Makes the JAX trainer call `before_purge(model)` just before it empties the variables, once."""
    trainer = trainer_class()
    method = trainer._purge_model_variables
    if getattr(method, _WRAPPED, False):
        return

    @functools.wraps(method)
    def purge(model: Any, *args: Any, **kwargs: Any) -> Any:
        before_purge(model)
        return method(model, *args, **kwargs)

    setattr(purge, _WRAPPED, True)
    trainer._purge_model_variables = purge


def variable_groups(model: Any) -> dict[str, list[Any]]:
    """The model's state variables by `_jax_state` key (an optimizer's only once it is built)."""
    optimizer = getattr(model, "optimizer", None)
    return {
        "trainable_variables": list(model.trainable_variables),
        "non_trainable_variables": list(model.non_trainable_variables),
        "optimizer_variables": list(optimizer.variables) if optimizer is not None else [],
        "metrics_variables": list(model.metrics_variables),
    }


def raw_value(variable: Any) -> Any:
    """The array a variable holds, `None` while Keras's trainer has purged it."""
    return variable._value


def set_raw_value(variable: Any, value: Any) -> None:
    """Puts an array, already laid out as the variable's, back into a variable."""
    variable._value = value


def pending_state(model: Any) -> dict[str, Any] | None:
    """The state of the last completed step that the trainer has not written back, if any."""
    state = getattr(model, "_jax_state", None)
    if not state or getattr(model, "_jax_state_synced", True):
        return None
    return state


def state_object(model: Any) -> Any:
    """The trainer's pending-state object itself, to tell a stale one from a new one."""
    return getattr(model, "_jax_state", None)


def clear_pending_state(model: Any) -> None:
    """Marks the trainer as having no state to write back, as a loop that ended normally does."""
    model._jax_state = None
    model._jax_state_synced = True
