"""The hooks in Keras's JAX trainer: the one batch decision, predict/evaluate of any size, errors.

`install(is_ours)` wraps the trainer's methods and Keras's `distribute_data_input` once; the
hooks act only while `is_ours(distribution)` holds for the distribution in force (a
`kml.ModelParallel`), so this module needs nothing from the distribution's module. Every
input batch goes through `batch_decision`: replicate it, split it, or raise.

Under a `kml.ModelParallel`, each batch is split over the batch axis, so a batch
whose size does not divide by that axis (the short last batch of
`model.predict(x)` with 251 samples and `batch_size=32` on `data=2`, say) cannot
be laid out as the others are.

**predict / evaluate.** Such a batch is laid out *replicated over the batch
axis*: every device of the batch axis receives the whole short batch, and the
other mesh axes (tensor parallelism) split the model as in every other step.
This is exact: each sample goes through the same arithmetic as on one device,
and since the batch keeps its real size, Keras's loss reduction, the loss
tracker (weighted by the batch size) and every metric see exactly the samples
the user passed, with nothing to mask. Padding the batch instead would make
`evaluate` count padded rows: Keras divides a `"sum_over_batch_size"` loss by
the padded size and weighs the loss average by it. It is also cheap: Keras
compiles a new step for the short batch's shape anyway, so the layout adds no
compile; only that one batch (per call, or wherever a data set yields one) is
computed whole on each device of the batch axis, which takes at most the time
and activation memory of one full step without data parallelism. A batch that
divides keeps its usual split layout.

**fit** keeps raising `IndivisibleBatchError` for such a batch. The same
layout would train exactly, but a training step keeps every activation for the
backward pass: computing the short batch whole on each device can need up to
the batch axis's size times a normal step's activation memory, which may not
fit at the end of an epoch that did. Choose a `batch_size` that the samples
divide into, or drop the remainder.

In a job of several processes, each process holds only its own part of a
batch, so the short batch cannot be replicated without moving data between
hosts: there, predict and evaluate raise `IndivisibleBatchError` as fit does.

**Errors.** Keras's JAX trainer removes the variables' values while its loop
runs and puts them back only when the loop ends normally, so after an
exception in `fit`, `evaluate` or `predict` (a bad batch, a callback that
raises, Ctrl-C) the model had no weights left. Under a `kml.ModelParallel`,
every such call puts them back before the exception propagates: the state of
the last completed step, which is the model as before the call for `evaluate`
and `predict`, and the weights trained up to the failure for `fit` (with their
optimizer state). Private Keras details used here live in `_compat`.
"""

from __future__ import annotations

import contextvars
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import keras

from .. import _compat as internals
from . import _output_rules
from ._errors import GroupedConvWarning
from ._held import check_on_mesh
from ._plan import grouped_conv_axes, grouped_conv_message
from ._planning import grouped_convs_at_risk

__all__ = [
    "batch_decision",
    "batch_layout",
    "install",
    "replicated_layout",
    "replicates_batch",
    "warn_grouped_convs",
]

#: `True` inside predict/evaluate (and their *_on_batch forms), `False` inside fit.
_INFERENCE: contextvars.ContextVar[bool] = contextvars.ContextVar("kml_inference", default=False)
#: Inside a guarded call: each variable's value (by `id`) just before Keras last emptied it.
_PURGED: contextvars.ContextVar[dict[int, Any] | None] = contextvars.ContextVar("kml_purged", default=None)
#: Inside a guarded call: the state the call's last compiled step returned (`_compat.wrap_steps`).
_STEPPED: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("kml_stepped", default=None)


#: Whether `sys.exit(0)` (or `sys.exit()`) left a `fit`: under the launcher the other processes would
#: wait for this one in their next collective, so its worker reports a failure (`runtime/_worker.py`).
exited_during_fit = False


def install(is_ours: Callable[[Any], bool]) -> None:
    """Wraps Keras's JAX trainer methods and `distribute_data_input`, once.

    They change nothing unless `is_ours(keras.distribution.distribution())` holds. Keras's JAX
    trainer derives the input sharding from the first batch of an epoch and applies it to all
    later ones, so a short last batch that does not divide by the batch axis would otherwise
    fail inside JAX with an `IndivisibleError` naming neither the batch size nor the axis.
    Keras looks `distribute_data_input` up on its backend module for every batch; wrapping it
    there puts every batch through `batch_layout`.
    """
    internals.wrap_trainer_methods(lambda method, inference: _guard(method, inference, is_ours))
    internals.wrap_purge(_record_before_purge)
    internals.wrap_steps(_record_step)

    def checked(original: Callable[..., Any]) -> Callable[..., Any]:
        def distribute_data_input(per_process_batch: Any, layout: Any, batch_dim_name: str) -> Any:
            current = keras.distribution.distribution()
            if is_ours(current) and getattr(per_process_batch, "ndim", 0) > 0:
                layout = batch_layout(current, per_process_batch.shape, layout)  # checks it
            return original(per_process_batch, layout, batch_dim_name)

        return distribute_data_input

    internals.wrap_distribute_data_input(checked)

    def output_checked(original: Callable[..., Any]) -> Callable[..., Any]:
        def distribute_tensor(tensor: Any, layout: Any) -> Any:
            if is_ours(keras.distribution.distribution()):
                _output_rules.check(tensor, layout)  # a layer's output, against the rule that gave `layout`
            return original(tensor, layout)

        return distribute_tensor

    internals.wrap_distribute_tensor(output_checked)


def in_inference() -> bool:
    """Whether the running Keras call is a predict or an evaluate (not a fit)."""
    return _INFERENCE.get()


def replicates_batch(distribution: Any, data_shape: Sequence[int | None]) -> bool:
    """Whether a batch of this shape is laid out replicated over the batch axis.

    True only inside `predict`/`evaluate`, for a batch whose size does not
    divide by the batch axis, when this process holds the whole batch (a
    single-process job).
    """
    if not in_inference() or not data_shape or data_shape[0] is None:
        return False
    size = distribution.axis_sizes[distribution.batch_axis]
    if int(data_shape[0]) % size == 0:
        return False
    return _single_process(distribution)


def batch_decision(distribution: Any, data_shape: Sequence[int | None]) -> Literal["replicate", "split"]:
    """The one decision for an input batch: replicate it (see `replicates_batch`), split it, or raise.

    Raises:
        IndivisibleBatchError: the batch can be neither split over the batch
            axis nor replicated (`distribution.check_batch` says why).
    """
    if replicates_batch(distribution, data_shape):
        return "replicate"
    distribution.check_batch(data_shape)
    return "split"


def batch_layout(distribution: Any, data_shape: Sequence[int], layout: Any) -> Any:
    """The backend layout for one input batch, by `batch_decision`.

    `layout` is what Keras derived from the first batch of the loop; a batch
    that divides after a replicated first batch gets its split layout back.
    """
    if batch_decision(distribution, data_shape) == "replicate":
        return replicated_layout(distribution, len(data_shape)).backend_layout
    if in_inference() and _is_replicated(layout):
        return distribution.get_data_layout(data_shape).backend_layout
    return layout


def replicated_layout(distribution: Any, rank: int) -> keras.distribution.TensorLayout:
    """A data layout replicated over every mesh axis."""
    return keras.distribution.TensorLayout((None,) * rank, distribution.device_mesh)


def _is_replicated(layout: Any) -> bool:
    if isinstance(layout, keras.distribution.TensorLayout):
        axes = layout.axes
    else:
        axes = tuple(getattr(layout, "spec", ("batch",)))
    return not axes or axes[0] is None


def _single_process(distribution: Any) -> bool:
    devices = distribution.device_mesh.backend_mesh.devices  # JAX devices, whatever the mesh was given
    return len({device.process_index for device in devices.flat}) == 1


def _guard(method: Callable[..., Any], inference: bool, is_ours: Callable[[Any], bool]) -> Callable[..., Any]:
    def guarded(model: Any, *args: Any, **kwargs: Any) -> Any:
        distribution = keras.distribution.distribution()
        if not is_ours(distribution):
            return method(model, *args, **kwargs)
        check_on_mesh(model, distribution)  # built before the distribution was set: say so, before compute
        if getattr(method, "__name__", "") == "fit":
            warn_grouped_convs(model, distribution)
        token = _INFERENCE.set(inference)
        purged, stepped = {}, [None]
        purged_token, stepped_token = _PURGED.set(purged), _STEPPED.set(stepped)
        before = _snapshot(model)
        empty = _empty(model)  # emptied by an enclosing loop (a callback's call): not ours to fill
        stale = internals.state_object(model)
        try:
            return method(model, *args, **kwargs)
        except BaseException as error:
            _restore(model, {**before, **purged}, empty, stale, error, stepped[0])
            if isinstance(error, SystemExit) and error.code in (None, 0) and method.__name__ == "fit":
                global exited_during_fit  # read by the launcher's worker (`runtime/_worker.py`)
                exited_during_fit = True
            raise
        finally:
            _STEPPED.reset(stepped_token)
            _PURGED.reset(purged_token)
            _INFERENCE.reset(token)

    return guarded


def warn_grouped_convs(model: Any, distribution: Any) -> None:
    """Warns (`GroupedConvWarning`) when `fit` starts on grouped convolutions XLA would train wrongly.

    The same check as `dist.plan(model)`'s (`grouped_convs_at_risk`): a rule of
    the user's own gets the warning where the model trains, not only where it is planned.
    """
    layers = grouped_convs_at_risk(distribution, model)
    batch_axis = distribution.batch_dim_name
    others = grouped_conv_axes(distribution.axis_sizes, batch_axis)
    if layers and others:
        message = grouped_conv_message(layers, distribution.axis_sizes, batch_axis, others)
        warnings.warn(f"fit: {message}", GroupedConvWarning, stacklevel=4)


def _record_step(state: Any) -> None:
    stepped = _STEPPED.get()
    if stepped is not None:
        stepped[0] = state


def _record_before_purge(model: Any) -> None:
    purged = _PURGED.get()
    if purged is not None:
        purged.update(_snapshot(model))


def _snapshot(model: Any) -> dict[int, Any]:
    return {
        id(variable): value
        for variables in internals.variable_groups(model).values()
        for variable in variables
        if _alive(value := internals.raw_value(variable))
    }


def _empty(model: Any) -> set[int]:
    return {
        id(variable)
        for variables in internals.variable_groups(model).values()
        for variable in variables
        if not _alive(internals.raw_value(variable))
    }


def _alive(value: Any) -> bool:
    if value is None:
        return False
    is_deleted = getattr(value, "is_deleted", None)
    return not (callable(is_deleted) and is_deleted())


def _restore(
    model: Any, before: dict[int, Any], empty: set[int], stale: Any, error: BaseException, stepped: Any = None
) -> None:
    """Puts a value back into every variable the failed call left empty.

    First the state the call's last compiled step returned (`stepped`: with
    `steps_per_execution` > 1, newer than any Keras holds), then the state of the
    call's last completed step group (what Keras would have written back had the
    loop ended), then, for a variable still empty, the value it held when the
    call's loop began (alive unless a step consumed it).
    Variables already empty when the call began, and a pending state the call
    did not make, belong to an enclosing loop (a `fit` whose callback called
    `predict`): that loop writes them back itself.
    """
    groups = internals.variable_groups(model)
    state = internals.pending_state(model)
    ours = internals.state_object(model) is not stale
    newest = set()
    for key, values in internals.state_by_key(stepped).items():
        for variable, value in zip(groups[key], values or (), strict=False):
            if _alive(value) and not _alive(internals.raw_value(variable)):
                internals.set_raw_value(variable, value)
                newest.add(id(variable))
    if state is not None and ours:
        for key in internals.STATE_KEYS:
            values = state.get(key) or ()
            for variable, value in zip(groups[key], values, strict=False):
                if _alive(value) and id(variable) not in newest:
                    internals.set_raw_value(variable, value)
    lost = []
    for variables in groups.values():
        for variable in variables:
            if _alive(internals.raw_value(variable)):
                continue
            value = before.get(id(variable))
            if _alive(value):
                internals.set_raw_value(variable, value)
            elif id(variable) not in empty:
                lost.append(variable.path)
    if ours:
        internals.clear_pending_state(model)
    if lost:
        error.add_note(
            f"keras_meshlayout could not restore {len(lost)} variable(s) after this error, "
            f"because the failed step had consumed their values: {', '.join(lost[:5])}"
            f"{' ...' if len(lost) > 5 else ''}. Rebuild the model or load a checkpoint."
        )
