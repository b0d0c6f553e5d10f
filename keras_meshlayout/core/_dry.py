"""Dry planning: the plan of a model that is never allocated.

The model is built inside Keras's `StatelessScope` with variable
initialisation turned off, so every variable has its path, shape and dtype but
no value. The plan then goes through `plan_model`, the same code the real
`ModelParallel.plan` uses, so the two cannot disagree.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import keras

from .. import _compat
from ._memory import optimizer_of, slot_model
from ._plan import Plan
from ._planning import plan_model

if TYPE_CHECKING:
    from ._distribution import ModelParallel

__all__ = ["dry_build", "dry_plan", "names_handed_back", "new_optimizer"]


def dry_plan(
    build: Callable[[], keras.Model],
    distribution: ModelParallel,
    *,
    optimizer: str | keras.optimizers.Optimizer | None = None,
) -> Plan:
    """The plan of the model `build()` returns, without allocating any weight.

    `build` runs once with Keras's variable initialisation deferred, so a
    7-billion-parameter model plans in seconds with a few hundred MB of host
    memory. Layer names Keras invents (`dense_3`) are handed out again
    afterwards, so a real build that follows gets the same paths. With
    `optimizer`, its slot variables (Adam's moments, Adafactor's factored
    statistics...) are planned too, from the optimizer's own `build`.

    Args:
        build: A function that builds and returns the Keras model.
        distribution: The `kml.ModelParallel` to plan for.
        optimizer: An optimizer, or a name Keras knows (`"adam"`), or `None`: the
            optimizer of a model `build` compiles (a keras-hub task compiles itself),
            else none.

    Returns:
        The same `Plan` as `distribution.plan(model)` gives once the model
        exists (and, with `optimizer`, once it is compiled and built).

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*up/kernel", (None, "model"))])
        >>> def build():
        ...     return keras.Sequential([keras.Input((1024,)), keras.layers.Dense(4096, name="up")], name="m")
        >>> plan = kml.dry_plan(build, dist, optimizer="adam")
        >>> plan["m/up/kernel"].axes, plan["m/up/kernel"].bytes_per_device
        ((None, 'model'), 4194304)
        >>> plan.memory().optimizer == 2 * plan.memory().gradients + 8
        True
    """
    with names_handed_back(), _deferred_variables():
        optimizer = new_optimizer(optimizer)
    with names_handed_back(), _deferred_variables(), distribution.scope():
        slots = None
        with _compat.stateless_scope():
            model = build()
            if optimizer is None and getattr(model, "compiled", False):
                optimizer = model.optimizer  # `build` compiled it (a keras-hub task compiles itself)
            if isinstance(optimizer, keras.optimizers.Adafactor):
                slots = _adafactor_variables(optimizer, model.trainable_variables)
            elif optimizer is not None:
                optimizer.build(model.trainable_variables)
        return plan_model(distribution, model, optimizer=optimizer, optimizer_variables=slots)


def new_optimizer(optimizer: str | keras.optimizers.Optimizer | None) -> keras.optimizers.Optimizer | None:
    """The optimizer for a name, made outside every scope: its counters are small eager arrays.

    Made outside the distribution, they land on this machine's default device, not on a
    mesh of devices that hold no array (a TPU target); the plan resolves their layouts anyway.
    """
    if optimizer is None or isinstance(optimizer, keras.optimizers.Optimizer):
        return optimizer
    return optimizer_of(optimizer)


@contextlib.contextmanager
def dry_build(build: Callable[[], keras.Model]) -> Iterator[keras.Model]:
    """The model `build()` returns, with no variable allocated, for reading its structure.

    Inside the block the model's layers, graph and variable shapes can be read
    (`kml.auto_rules` does); nothing may run it. Names are handed back after.
    """
    with names_handed_back(), _deferred_variables():
        with _compat.stateless_scope():
            model = build()
        yield model


@dataclasses.dataclass(frozen=True)
class _AbstractVariable:
    path: str
    name: str
    shape: tuple[int, ...]
    dtype: str
    _layout: None = None


def _adafactor_variables(
    optimizer: keras.optimizers.Adafactor, params: Sequence[Any]
) -> list[_AbstractVariable]:
    """The variables `Adafactor.build` would create, without creating them.

    Its `build` makes eager scalar placeholders, which Keras refuses inside a
    stateless scope. Per parameter it keeps a velocity shaped like the
    parameter and, for matrices, the row and column statistics of the last
    two dimensions, for vectors two scalar placeholders (nothing at all for a
    parameter overwritten by its gradient).
    """
    prefix = optimizer.name
    model = slot_model(optimizer)  # the one description of optimizer memory (`_memory.SlotModel`)
    variables = [_AbstractVariable(v.path, v.name, tuple(v.shape), v.dtype) for v in optimizer.variables]
    for param in params:
        if _compat.keeps_no_slots(optimizer, param):
            continue
        # Adafactor's build order: the statistics (or placeholders) first, then the velocity.
        slots = sorted(model.slot_shapes(tuple(param.shape), param.dtype), key=lambda slot: slot[2])
        for shape, dtype, follows in slots:
            if follows:
                name = f"{param.path.replace('/', '_')}_velocity"
                variables.append(_AbstractVariable(f"{prefix}/{name}", name, shape, dtype))
            elif shape:  # row and column statistics, scoped by the optimizer
                variables.append(_AbstractVariable(f"{prefix}/{param.name}", param.name, shape, dtype))
            else:  # two unscoped int32 placeholders, named after the parameter
                variables.append(_AbstractVariable(param.name, param.name, (), "int32"))
    return variables


@contextlib.contextmanager
def names_handed_back() -> Iterator[None]:
    """Undoes Keras's name counters, so the next real build reuses the names."""
    with _compat.global_attribute_kept("object_name_uids", _counters):
        yield


def _counters(uids: Any) -> collections.defaultdict:
    return collections.defaultdict(int, uids or {})


@contextlib.contextmanager
def _deferred_variables() -> Iterator[None]:
    """Forgets the uninitialised variables the dry build registers.

    Keras initialises every registered variable when a later stateless scope
    closes; those of a dry build must never be.
    """
    with _compat.global_attribute_kept("uninitialized_variables", lambda variables: list(variables or [])):
        yield
