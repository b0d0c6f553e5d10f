"""The one seam to Keras's and JAX's internals: every private module, attribute or patch (this
package: this module and `_quantize`, with _distribution_lib.py, _metrics.py and _steps.py).

No other module of the package imports `keras.src` or `jax._src`, reads a private
attribute of a Keras object, or replaces a Keras function. `tests/test_compat.py` checks
each internal below against the installed versions, so that an upgrade that removes or
renames one fails there with the name of what broke (keras is pinned to the tested
series in `pyproject.toml`).

Keras's JAX trainer (predict/evaluate support, multi-process pacing):

- `keras.src.backend.jax.trainer.JAXTrainer`: the class whose `fit`, `evaluate`, `predict`,
  `train_on_batch`, `test_on_batch` and `predict_on_batch` every `keras.Model` inherits on JAX.
- `Variable._value`: the array a variable holds. Keras's trainer sets it to `None`
  while a loop runs ("purge", to save memory) and puts the values back only when the
  loop ends normally.
- `JAXTrainer._purge_model_variables`: the method that empties them. `kml` records
  the values just before, so that variables built inside the call (compile metrics,
  optimizer slots) can be put back too.
- `JAXTrainer._jax_state` and `_jax_state_synced`: the state produced by the last
  completed step, not yet written back to the variables.
- `Model._initial_epoch`: the epoch `fit` starts from, set by a resuming callback.
- `Model._compile_metrics` (`_user_metrics`, `_user_weighted_metrics`): the metric objects
  given to `compile`, whose variables exist before `fit` builds the rest.
- `JAXTrainer._make_function`: wraps a compiled step into the loop of `steps_per_execution`
  steps; `kml` records the state each step returns (_steps.py).

Keras's global state and distribution backend:

- `keras.src.backend.common.global_state`: the name-scope stack (whose `caller`
  tells an optimizer's or metric's variables), the name counters and uninitialised
  variables a dry build must hand back, and the global seed generator.
- `keras.src.backend.common.stateless_scope.StatelessScope`: builds a model without
  allocating its variables.
- `keras.src.backend.common.variables.Variable.__init__`: patched while a dry build runs,
  so that a variable made from a value (an optimizer's counters) is deferred as well; each
  layer class's `quantize` is traced there, not run (`_compat/_quantize.py` lists what it reaches).
- `keras.src.backend.jax.distribution_lib`: `distribute_data_input`, wrapped to check
  every batch, and `initialize_rng`, the first collective of a multi-process run.
- `keras.src.distribution.distribution_lib.distribute_tensor`: what a layer's output goes
  through under an output rule, wrapped to check the output against the rule.
- `Variable._layout`: the layout Keras gave an optimizer slot (its parameter's).
- `Callback._model`: the model a callback is attached to, read without a state sync.
- `Optimizer._overwrite_variable_with_gradient`: parameters an optimizer keeps no slots for.
- `Muon._should_use_adamw`: the variables Keras's Muon gives its AdamW update, not its own.
- `Layer._flatten_layers`, `Model._symbolic_build`, `Model._get_state_sharding_spec`:
  every sub-layer, a build on symbolic inputs, and the shardings of a model's state.
- `Layer._remat_mode`: the `keras.RematScope` mode a layer was made in (`None` outside one).
- `keras.src.backend.compute_output_spec`: a model called on symbolic inputs, which builds
  the sub-layers a custom `build()` left for the first call (as `fit` does), allocating nothing
  else.
- `Layer._build_shapes_dict`, `Model._inputs_struct`, `Layer._call_has_training_arg`,
  `KerasTensor._keras_history`: the shapes a layer was built with, a functional model's
  input structure, whether `call` takes `training`, and whether a tensor comes from a layer.
- `Layer._inbound_nodes`, `KerasTensor._keras_history.operation`: the layers a layer of a
  functional model is called on, and the layer that made a tensor.
- `Layer._trainable_variables`, `Layer._non_trainable_variables`: a layer's own variables.
- `LayoutMap._device_mesh`: a layout map's mesh, read by `kml.LayoutRules` (`device_mesh` may raise).
- `ModelParallel._layout_map`: rebound when the `LayoutMap` a `kml.ModelParallel` was given changes.
- `Layer.lora_enabled` (`Dense`, `EinsumDense`, `Embedding`): switched off while the planner
  traces a LoRA model, so that the trace reads each base kernel as a projection weight
  (`kernel` adds the adapters' product to it); the adapters follow their kernel's split.
- `Dense._kernel`, `EinsumDense._kernel`, `Embedding._embeddings`: the variable a layer stores; an
  int4 layer's `kernel` (`embeddings`) property unpacks it, replaced while the planner reads layers.
- `TensorLayout._device_mesh`: set directly for a layout that splits one dimension over
  several mesh axes (an entry `("data", "model")`), which JAX's `PartitionSpec` takes but
  Keras 3.15's `TensorLayout` check of axis names refuses.

JAX:

- `jax._src.xla_bridge.backends_are_initialized`: whether the devices exist already.
- `jax._src.hardware_utils.num_available_tpu_chips_and_device_id`: whether this machine
  has TPU chips (if not, libtpu, installed for TPU targets, is kept quiet).
- `jax._src.interpreters.partial_eval.dce_jaxpr`: dead-code elimination of a jaxpr.

Python:

- `threading._register_atexit`: a function run as the interpreter exits, before the
  thread pools of `concurrent.futures` shut down (an `atexit` function runs after, when
  Orbax, which writes through them, can no longer finish a background save).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ._distribution_lib import WRAPPED
from ._distribution_lib import wrap_distribute_data_input as wrap_distribute_data_input
from ._distribution_lib import wrap_distribute_tensor as wrap_distribute_tensor
from ._metrics import compile_metric_variables as compile_metric_variables
from ._quantize import traced_quantize
from ._steps import state_by_key as state_by_key
from ._steps import wrap_steps as wrap_steps

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


def trainer_class() -> type:
    """Keras's JAX trainer class, which `keras.Model` inherits `fit`/`evaluate`/`predict` from."""
    from keras.src.backend.jax.trainer import JAXTrainer

    return JAXTrainer


def wrap_trainer_methods(wrap: Callable[[Callable[..., Any], bool], Callable[..., Any]]) -> None:
    """Replaces each of `TRAINER_METHODS` on the JAX trainer by `wrap(method, is_inference)`, once."""
    trainer = trainer_class()
    for name, inference in TRAINER_METHODS.items():
        method = getattr(trainer, name)
        if getattr(method, WRAPPED, False):
            continue
        wrapped = functools.wraps(method)(wrap(method, inference))
        setattr(wrapped, WRAPPED, True)
        setattr(trainer, name, wrapped)


def wrap_purge(before_purge: Callable[[Any], None]) -> None:
    """Makes the JAX trainer call `before_purge(model)` just before it empties the variables, once."""
    trainer = trainer_class()
    method = trainer._purge_model_variables
    if getattr(method, WRAPPED, False):
        return

    @functools.wraps(method)
    def purge(model: Any, *args: Any, **kwargs: Any) -> Any:
        before_purge(model)
        return method(model, *args, **kwargs)

    setattr(purge, WRAPPED, True)
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
    return None if not state or getattr(model, "_jax_state_synced", True) else state


def state_object(model: Any) -> Any:
    """The trainer's pending-state object itself, to tell a stale one from a new one."""
    return getattr(model, "_jax_state", None)


def clear_pending_state(model: Any) -> None:
    """Marks the trainer as having no state to write back, as a loop that ended normally does."""
    model._jax_state = None
    model._jax_state_synced = True


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Sets the epoch `fit` starts from (read right after `on_train_begin`, as for BackupAndRestore)."""
    model._initial_epoch = epoch


# -- Keras's global state ---------------------------------------------------------------


def name_scope_callers() -> list[Any]:
    """The objects (layers, optimizers, metrics) whose name scopes are open, innermost first."""
    from keras.src.backend.common import global_state

    stack = global_state.get_global_attribute("name_scope_stack") or []
    return [caller for scope in reversed(stack) if (caller := getattr(scope, "caller", None)) is not None]


@contextlib.contextmanager
def global_attribute_kept(name: str, copy: Callable[[Any], Any]) -> Iterator[None]:
    """Restores Keras's global attribute `name` to (a `copy` of) its value on entry, on exit."""
    from keras.src.backend.common import global_state

    saved = copy(global_state.get_global_attribute(name))
    try:
        yield
    finally:
        global_state.set_global_attribute(name, saved)


@contextlib.contextmanager
def lora_off(model: Any) -> Iterator[None]:
    """LoRA layers compute with (`kernel` is) their base kernel inside; quantized ones add `x·a·b` anyway."""
    layers = [
        one
        for one in sublayers(model)
        if getattr(one, "lora_enabled", False) and one.quantization_mode is None
    ]
    for layer in layers:
        layer.lora_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.lora_enabled = True


def stored_weight(layer: Any, name: str) -> Any:
    """`layer._kernel` (`_embeddings`): the variable stored, which an int4 layer's `kernel` unpacks."""
    return getattr(layer, f"_{name}", None)


@contextlib.contextmanager
def property_replaced(cls: type, name: str, read: Callable[[Any, Any], Any]) -> Iterator[None]:
    """Inside the block, `cls`'s property `name` reads `read(instance, Keras's own getter)`."""
    own = cls.__dict__[name]
    setattr(cls, name, property(lambda instance: read(instance, own.fget), own.fset))
    try:
        yield
    finally:
        setattr(cls, name, own)


@contextlib.contextmanager
def stateless_scope() -> Iterator[Any]:
    """A Keras scope in which variables are created without being allocated.

    Keras defers a variable made from an initializer there but refuses one made
    from a value: an optimizer's step counter and learning rate, which the
    `compile` that keras-hub's tasks run on construction creates. Inside this
    scope those are deferred too, their value kept as a constant initializer,
    and `quantize` is traced, not run (`_quantize.traced_quantize`).
    """
    from keras.src.backend.common import variables
    from keras.src.backend.common.stateless_scope import StatelessScope

    init = variables.Variable.__init__

    def deferring(self: Any, initializer: Any, shape: Any = None, dtype: Any = None, **kwargs: Any) -> None:
        if initializer is not None and not isinstance(initializer, str) and not callable(initializer):
            value = np.asarray(initializer)
            dtype = dtype or value.dtype.name
            shape, initializer = value.shape, functools.partial(_constant, value)
        elif callable(initializer):  # Keras reads a deferred variable as its initializer's output
            initializer = functools.partial(_as_array, initializer)
        init(self, initializer, shape=shape, dtype=dtype, **kwargs)

    variables.Variable.__init__ = deferring
    try:
        with StatelessScope(initialize_variables=False) as scope, traced_quantize(scope):
            yield scope
    finally:
        variables.Variable.__init__ = init


def _as_array(initializer: Callable[..., Any], shape: Any = None, dtype: Any = None) -> Any:
    """`initializer`'s value with a dtype: keras-hub's CLIP head initialises its scale to a float."""
    value = initializer(shape, dtype=dtype)
    return value if hasattr(value, "dtype") else np.asarray(value, dtype=dtype)


def _constant(value: Any, shape: Any = None, dtype: Any = None) -> Any:
    return value.astype(dtype) if dtype is not None else value


def in_stateless_scope() -> bool:
    """Whether a variable made now is deferred (a dry build), not allocated."""
    from keras.src.backend.common.stateless_scope import in_stateless_scope as inside

    return bool(inside())


def global_seed_generator(create: bool = False) -> Any:
    """Keras's process-wide seed generator (used by random ops given no seed), if there is one."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    if create:
        return seed_generator.global_seed_generator()
    return global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)


# -- Keras's JAX distribution backend -----------------------------------------------------


def initialize_rng() -> None:
    """Keras's agreement on one random seed across processes (a collective over all of them)."""
    from keras.src.backend.jax.distribution_lib import initialize_rng

    initialize_rng()


def variable_layout(variable: Any) -> Any:
    """The layout Keras set on a variable itself (an optimizer slot: its parameter's), or `None`."""
    return getattr(variable, "_layout", None)


def tensor_layout(axes: tuple[Any, ...], mesh: Any) -> Any:
    """A `keras.distribution.TensorLayout` on `mesh`, whose entries may be tuples of axis names.

    Keras refuses an entry `("data", "model")` that JAX's `PartitionSpec` takes: such a layout is
    made without a mesh and given it after. The caller has checked the names.
    """
    import keras

    if mesh is None or not any(isinstance(entry, tuple) for entry in axes):
        return keras.distribution.TensorLayout(axes, mesh)
    layout = keras.distribution.TensorLayout(axes, None)
    layout._device_mesh = mesh
    return layout


def give_layout_mesh(layout: Any, mesh: Any) -> None:
    """Sets the mesh of a `TensorLayout` made without one, as Keras's `LayoutMap` does."""
    setattr(layout, "_device_mesh" if any(isinstance(e, tuple) for e in layout.axes) else "device_mesh", mesh)


def keeps_no_slots(optimizer: Any, variable: Any) -> bool:
    """Whether `optimizer` overwrites `variable` with its gradient, keeping no state for it."""
    return bool(optimizer._overwrite_variable_with_gradient(variable))


def updated_as_adamw(optimizer: Any, variable: Any) -> bool:
    """Whether Keras's Muon `optimizer` gives `variable` AdamW's update (and keeps its velocity)."""
    return bool(optimizer._should_use_adamw(variable)) and not keeps_no_slots(optimizer, variable)


def orthogonalised(optimizer: Any, variable: Any) -> bool:
    """Whether Keras's Muon `optimizer` gives `variable` its Newton-Schulz update (not AdamW's)."""
    return not optimizer._should_use_adamw(variable) and not keeps_no_slots(optimizer, variable)


def sublayers(model: Any, recursive: bool = True) -> list[Any]:
    """Every layer inside `model` (nested ones too unless `recursive=False`), not `model` itself."""
    return list(model._flatten_layers(include_self=False, recursive=recursive))


def build_shapes(layer: Any) -> dict[str, Any]:
    """The input shapes `layer` was built with, by `build` argument name (empty if unknown)."""
    return dict(getattr(layer, "_build_shapes_dict", None) or {})


def input_structure(model: Any) -> Any:
    """A functional model's inputs in the structure it was called with, or `None`."""
    return getattr(model, "_inputs_struct", None)


def takes_training(layer: Any) -> bool:
    """Whether `layer.call` takes a `training` argument (`True` when Keras does not say)."""
    return bool(getattr(layer, "_call_has_training_arg", True))


def made_by_a_layer(tensor: Any) -> bool:
    """Whether a symbolic tensor was produced by a Keras layer (it has a history)."""
    return hasattr(tensor, "_keras_history")


def producing_layer(tensor: Any) -> Any:
    """The layer (Keras operation) that produced a symbolic tensor of a functional model."""
    return tensor._keras_history.operation


def input_layers(layer: Any) -> list[Any]:
    """The layers whose outputs `layer` is called on in a functional model, in call order."""
    return [producing_layer(tensor) for node in layer._inbound_nodes for tensor in node.input_tensors]


def own_variables(layer: Any) -> list[Any]:
    """The variables `layer` created itself (trainable first), not those of its sub-layers."""
    return [*layer._trainable_variables, *layer._non_trainable_variables]


def symbolic_build(model: Any, data: Any) -> None:
    """Builds `model`, its optimizer and metrics on symbolic data as `fit` would."""
    model._symbolic_build(data_batch=data)


def rematerialised(model: Any) -> bool:
    """Whether a layer of `model` (itself included) was made in a `keras.RematScope`."""
    return any(getattr(layer, "_remat_mode", None) is not None for layer in model._flatten_layers())


def unbuilt_layers(model: Any) -> list[Any]:
    """The layers of `model` (itself included) not built yet: their weights do not exist."""
    return [layer for layer in model._flatten_layers() if not layer.built]


def build_layers(model: Any, batch: Any) -> None:
    """Builds the layers of `model` left unbuilt by calling it on `batch`'s shapes, as `fit` would
    (a subclassed model's `build()` may leave them to its first call): the planner reads their weights.
    """
    if not unbuilt_layers(model):
        return
    from keras.src import backend, tree

    symbolic = tree.map_structure(
        lambda v: backend.KerasTensor(tuple(v.shape), backend.standardize_dtype(v.dtype)), batch
    )
    kwargs = {"training": False} if takes_training(model) else {}
    backend.compute_output_spec(model, symbolic, **kwargs)


def state_shardings(model: Any) -> Any:
    """The shardings Keras's trainer gives the model's state (weights, optimizer, metrics)."""
    return model._get_state_sharding_spec()


# -- JAX ------------------------------------------------------------------------------------


def tpu_chips_attached() -> int:
    """TPU chips attached to this machine, by JAX's own PCI scan (0 on a machine without)."""
    from jax._src import hardware_utils

    return int(hardware_utils.num_available_tpu_chips_and_device_id()[0])


def at_exit_before_thread_pools(function: Callable[[], Any]) -> None:
    """Runs `function` as the interpreter exits, while `concurrent.futures` still takes work."""
    import threading

    threading._register_atexit(function)


def backends_started() -> bool:
    """Whether JAX has already created its backends (and so its devices)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def dce_jaxpr(jaxpr: Any) -> tuple[Any, list[bool]]:
    """`jaxpr` without the equations its outputs do not need, and which inputs it still reads."""
    from jax._src.interpreters import partial_eval

    return partial_eval.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars))


# -- Keras's distribution objects -------------------------------------------------------------


def layout_map_mesh(layout_map: Any) -> Any:
    """The mesh a `keras.distribution.LayoutMap` was made with, or `None` (without raising).

    Keras's public `LayoutMap.device_mesh` is what `kml.LayoutRules` overrides to explain an
    unbound map; the mesh itself sits in `LayoutMap._device_mesh`.
    """
    return layout_map._device_mesh


def callback_model(callback: Any) -> Any:
    """The model a `keras.callbacks.Callback` is attached to (`Callback._model`), or `None`.

    Keras's public `Callback.model` syncs the JAX trainer's state into the variables on
    every read; a callback that asks after every step (for a preemption notice) reads
    the attribute itself.
    """
    return callback._model


def distribution_layout_map(distribution: Any) -> Any:
    """The layout map a `keras.distribution.ModelParallel` reads (`ModelParallel._layout_map`)."""
    return distribution._layout_map


def set_distribution_layout_map(distribution: Any, layout_map: Any) -> None:
    """Rebinds the layout map of a `keras.distribution.ModelParallel` (`ModelParallel._layout_map`).

    Keras reads it on every variable created; `kml.ModelParallel` replaces it when the Keras
    `LayoutMap` it was given has changed since.
    """
    distribution._layout_map = layout_map
