"""Planning a model: what every variable of it (and of its optimizer) gets under a distribution.

`plan_model` re-runs the resolution that `kml.ModelParallel.get_variable_layout` runs when Keras
creates each variable, reads a layout already fixed on a variable where there is one, and
returns the value `Plan` (`_plan`). It sits beside the distribution, which it reads through
the small `Distributes` protocol, so that neither module imports the other's caller.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .. import _compat
from . import _grouped_scan
from ._axes import Axes, shards_of
from ._errors import GroupedConvWarning, LayoutMismatchWarning, MeshLayoutWarning, UnmatchedRuleWarning
from ._format import format_axes
from ._held import Held, held, off_mesh_message
from ._placement import process_layout
from ._plan import Plan, grouped_conv_axes
from ._resolve import Resolution

if TYPE_CHECKING:
    import keras

    from ._rules import LayoutRules

__all__ = ["Distributes", "grouped_convs_at_risk", "plan_model"]


class Distributes(Protocol):
    """What planning reads of a distribution (`kml.ModelParallel` has all of it)."""

    rules: LayoutRules
    axis_sizes: dict[str, int]
    batch_dim_name: str
    on_indivisible: str
    replicate_below: int
    device_mesh: keras.distribution.DeviceMesh

    def resolve(
        self, path: str, shape: Sequence[int], dtype: Any = ..., *, warn: bool = ..., rules: bool = ...
    ) -> Resolution: ...


def plan_model(
    distribution: Distributes,
    model: keras.Model,
    optimizer: keras.optimizers.Optimizer | None = None,
    optimizer_variables: Sequence[Any] | None = None,
) -> Plan:
    """Builds the plan of `model` under `distribution` (see `ModelParallel.plan`).

    `optimizer` defaults to the model's own, once built. `optimizer_variables`
    (anything with `path`, `name`, `shape` and `dtype`) stands in for the
    variables of an optimizer that cannot be built without allocating.
    """
    params = {w.path.replace("/", "_"): w for w in model.weights}
    trainable, weights = {id(w) for w in model.trainable_weights}, {id(w) for w in model.weights}
    entries, mismatched, off_devices = [], [], 0
    for weight in _state_of(model):
        entry, found = _model_entry(distribution, weight)
        role = "parameter" if id(weight) in trainable else "state" if id(weight) in weights else "rng"
        entries.append(dataclasses.replace(entry, role=role))
        if found is not None:
            mismatched.append((weight.path, found))
            off_devices = off_devices or (found.devices if not found.on_mesh else 0)
    optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
    if optimizer_variables is None and optimizer is not None and getattr(optimizer, "built", False):
        optimizer_variables = optimizer.variables
    for variable in optimizer_variables or ():
        parent = _slot_parent(variable, params)
        if parent is None:
            entry = _optimizer_entry(distribution, variable)
        else:
            entry = _slot_entry(distribution, variable, parent)
        entries.append(dataclasses.replace(entry, role="optimizer"))
    unmatched = distribution.rules.unmatched(w.path for w in _state_of(model))
    layer_paths = _layer_output_paths(model)
    outputs = tuple(
        (rule, tuple(path for path in layer_paths if rule.regex.fullmatch(path + "/output")))
        for rule in distribution.rules.rules
        if rule.for_outputs
    )
    plan = Plan(
        axis_sizes=distribution.axis_sizes,
        batch_axis=distribution.batch_dim_name,
        entries=tuple(entries),
        unmatched_rules=tuple(unmatched),
        outputs=outputs,
        device_capacity=_device_capacity(distribution.device_mesh),
        on_indivisible=distribution.on_indivisible,
        replicate_below=distribution.replicate_below,
        processes=_processes(distribution.device_mesh),
        grouped_convs=grouped_convs_at_risk(distribution, model),
        mismatches=_mismatch_messages(distribution, mismatched, off_devices),
        intended=_intended(entries),
        layer_outputs=tuple(f"{path}/output" for path in layer_paths) if model.built else (),
    )
    for message in plan.mismatches:
        warnings.warn(message, LayoutMismatchWarning, stacklevel=3)
    for message in plan._unmatched_messages():
        warnings.warn(message, UnmatchedRuleWarning, stacklevel=3)
    if plan.grouped_conv_warning:
        warnings.warn(plan.grouped_conv_warning, GroupedConvWarning, stacklevel=3)
    _warn_awaiting_a_call(model)
    return plan


def _warn_awaiting_a_call(model: keras.Model) -> None:
    """Warns when layers of a subclassed model await its first call: their weights are not planned."""
    awaiting = _awaiting_a_call(model)
    if awaiting:
        names = ", ".join(repr(layer.name) for layer in awaiting[:4]) + (", ..." if len(awaiting) > 4 else "")
        warnings.warn(
            f"{len(awaiting)} layer(s) of model {model.name!r} are not built yet ({names}): the weights "
            "they make at the model's first call are not in this plan. Fix: call the model on a batch "
            "(in `build()` for kml.dry_plan) before planning.",
            MeshLayoutWarning,
            stacklevel=4,
        )


def _awaiting_a_call(model: keras.Model) -> list[Any]:
    """Layers of a subclassed model left unbuilt by its `build()`, which make weights when called.

    A functional model builds every layer it calls; an unbuilt layer there is never called.
    """
    import keras

    if _compat.input_structure(model) is not None:
        return []
    unbuilt = [layer for layer in _compat.unbuilt_layers(model) if layer is not model]
    return [layer for layer in unbuilt if type(layer).build is not keras.layers.Layer.build]


def _intended(entries: Sequence[Resolution]) -> frozenset[str]:
    """Variables a suggested rule keeps replicated on purpose (its note says why), with their slots."""
    chosen = {
        entry.path
        for entry in entries
        if entry.replicated and entry.rule is not None and entry.rule.suggested and entry.source == "rule"
    }
    slots = {
        entry.path
        for entry in entries
        if entry.source == "parameter"
        and any(reason[len("follows ") :] in chosen for reason in entry.reasons)
    }
    return frozenset(chosen | slots)


def _mismatch_messages(
    distribution: Distributes, mismatched: list[tuple[str, Held]], off_devices: int
) -> tuple[str, ...]:
    """What the plan says when variables really hold other layouts than the rules give."""
    off = [path for path, found in mismatched if not found.on_mesh]
    other = [path for path, found in mismatched if found.on_mesh]
    messages = []
    if off:
        messages.append(off_mesh_message(distribution, off, off_devices))
    if other:
        shown = ", ".join(repr(path) for path in other[:3]) + (
            f" and {len(other) - 3} more" if len(other) > 3 else ""
        )
        messages.append(
            f"{len(other)} variable(s) ({shown}) hold arrays sharded otherwise than the rules give (their "
            "values were placed by other code, e.g. jax.device_put or a checkpoint loaded with other "
            "layouts); the plan shows what they hold. Fix: place them as the rules say, or build and load "
            "the model under this distribution."
        )
    return tuple(messages)


def grouped_convs_at_risk(distribution: Distributes, model: keras.Model) -> tuple[tuple[str, str], ...]:
    """`(path, class name)` of each layer running a grouped convolution that XLA would train wrongly.

    That is every such layer (see `kml.GroupedConvWarning`) when the batch is split and a
    mesh axis other than the batch axis is larger than 1 (`_plan.grouped_conv_axes`), except
    the ones the planner (`kml.auto_rules`, a suggested rule) split over their channels with their
    input, as part of a convolution unit: there each device convolves its own
    channels and XLA computes the kernel gradient right; and the ones whose
    layer's output the planner laid out over the batch on every axis
    (`planner/_grouped_batch.py`), a custom layer's too. A rule of the
    user's own that splits such a kernel is not trusted: a kernel split
    alone, with its input whole, still gets the wrong gradient (measured).
    Keras's conv layers are found by their class; a model with custom layers is also
    traced (`_grouped_scan`), for the convolutions those run themselves.
    """
    others = set(grouped_conv_axes(distribution.axis_sizes, distribution.batch_dim_name))
    found = []
    layers = _grouped_convs(model)
    for path, cls, kernel, dim in layers:
        if others and kernel is not None and _split_by_planner(distribution, kernel, others, dim):
            continue
        if others and _batch_split_by_planner(distribution, path, others):
            continue
        found.append((path, cls))
    if others and _has_custom_layers(model):
        seen = {kernel.path for _, _, kernel, _ in layers if kernel is not None}
        by_path = {v.path: v for v in model.weights}
        for kernel_path in sorted(_grouped_scan.grouped_kernels(model) - seen):
            kernel, owner = by_path.get(kernel_path), _owner(model, kernel_path)
            if kernel is not None and (
                _split_by_planner(distribution, kernel, others, None)
                or _batch_split_by_planner(distribution, owner[0], others)
            ):
                continue
            found.append(owner)
    return tuple(found)


def _state_of(model: keras.Model) -> list[Any]:
    """The model's weights and its other state (`SeedGenerator`s': Keras lays them out by the rules too)."""
    seen: set[int] = set()
    return [v for v in model.variables if not (id(v) in seen or seen.add(id(v)))]


def _split_by_planner(distribution: Distributes, kernel: Any, others: set[str], dim: int | None) -> bool:
    """Whether a suggested rule splits `kernel` over every axis of `others`, on `dim` (any for `None`)."""
    entry = distribution.resolve(kernel.path, tuple(kernel.shape), kernel.dtype, warn=False)
    if entry.rule is None or not entry.rule.suggested:
        return False
    dims = range(len(entry.axes)) if dim is None else [dim] if dim < len(entry.axes) else []
    return any(others <= set(_axis_names(entry.axes[d])) for d in dims)


def _batch_split_by_planner(distribution: Distributes, layer_path: str, others: set[str]) -> bool:
    """Whether a suggested rule lays out the layer's output over the batch on the batch axis and on
    every axis of `others` (`planner/_grouped_batch.py`): XLA then sums the kernel gradient over
    the batch's shards, the whole mesh."""
    rules = getattr(distribution, "rules", None)
    rule = None if rules is None else rules.match(f"{layer_path}/output")
    if rule is None or not rule.suggested or not rule.axes:
        return False
    return {distribution.batch_dim_name, *others} <= set(_axis_names(rule.axes[0]))


def _has_custom_layers(model: keras.Model) -> bool:
    """Whether a layer of `model` is not one of Keras's own (a custom one may convolve by itself)."""
    return any(not type(layer).__module__.startswith("keras.") for layer in _compat.sublayers(model))


def _owner(model: keras.Model, kernel_path: str) -> tuple[str, str]:
    """`(path, class name)` of the innermost layer holding the variable `kernel_path`."""
    holders = [
        layer
        for layer in _compat.sublayers(model)
        if kernel_path.startswith((getattr(layer, "path", None) or layer.name) + "/")
    ]
    if not holders:
        return kernel_path.rpartition("/")[0] or kernel_path, "custom layer"
    layer = max(holders, key=lambda layer: len(getattr(layer, "path", None) or layer.name))
    return getattr(layer, "path", None) or layer.name, type(layer).__name__


def _axis_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _grouped_convs(model: keras.Model) -> list[tuple[str, str, Any, int]]:
    """`(path, class name, grouped kernel, its channel dimension)` of each Keras layer running one."""
    import keras

    layers = keras.layers
    depthwise = (layers.DepthwiseConv1D, layers.DepthwiseConv2D)
    separable = (layers.SeparableConv1D, layers.SeparableConv2D)
    plain = (layers.Conv1D, layers.Conv2D, layers.Conv3D)
    found: list[tuple[str, str, Any, int]] = []
    for layer in _compat.sublayers(model):
        if isinstance(layer, depthwise):
            kernel, dim = getattr(layer, "kernel", None), -2
        elif isinstance(layer, separable):
            kernel, dim = getattr(layer, "depthwise_kernel", None), -2
        elif isinstance(layer, plain) and getattr(layer, "groups", 1) > 1:
            kernel, dim = getattr(layer, "kernel", None), -1
        else:
            continue
        path = getattr(layer, "path", None) or f"{model.name}/{layer.name}"
        if all(path != seen for seen, *_ in found):
            found.append(
                (path, type(layer).__name__, kernel, dim % len(kernel.shape) if kernel is not None else 0)
            )
    return found


def _processes(mesh: keras.distribution.DeviceMesh) -> tuple[str, ...]:
    """`process_layout` lines when the mesh spans processes; none in a single process."""
    lines = process_layout(mesh)
    return tuple(lines) if len(lines) > 1 else ()


def _device_capacity(mesh: keras.distribution.DeviceMesh) -> int | None:
    """Bytes of memory of the mesh's first device, if JAX reports them (not on CPU).

    On a TPU target, the published HBM per chip; on an abstract mesh, none.
    """
    import jax

    target = getattr(mesh, "target", None)
    if target is not None:
        return target.hbm_bytes
    if getattr(mesh, "is_abstract", False):
        return None
    # One of this process's devices: another process's cannot report its memory (JaxRuntimeError).
    here = [d for d in mesh.devices.flat if getattr(d, "process_index", 0) == jax.process_index()]
    device = here[0] if here else mesh.devices.flat[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    return int(limit) if limit else None


def _layer_output_paths(model: keras.Model) -> list[str]:
    """The paths under which Keras asks for each layer's output layout."""
    paths = []
    for layer in _compat.sublayers(model):
        path = getattr(layer, "path", None) or f"{model.name}/{layer.name}"
        if path not in paths:
            paths.append(path)
    return paths


def _model_entry(distribution: Distributes, variable: keras.Variable) -> tuple[Resolution, Held | None]:
    """The variable's entry (what it really holds, where it holds an array), and where it lives."""
    resolution = distribution.resolve(variable.path, variable.shape, variable.dtype, warn=False)
    found = held(variable, distribution.device_mesh)
    if found is not None and not found.on_mesh:
        rank = len(variable.shape)
        off = dataclasses.replace(
            resolution,
            axes=(None,) * rank,
            shards=1,
            source="preset",
            reasons=(f"lives on {found.devices} device(s) outside the mesh (see the warning below)",),
        )
        return off, found
    if found is not None and found.other_mesh is not None:
        array = _compat.raw_value(variable)
        shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
        reason = f"its array is laid out on another mesh of these devices ({found.other_mesh}) (see below)"
        return dataclasses.replace(
            resolution, shards=max(1, resolution.nbytes // max(1, shard)), source="preset", reasons=(reason,)
        ), found
    actual = _actual_axes(variable)
    if actual is not None and actual != resolution.axes:
        fixed = _with_axes(
            resolution,
            actual,
            source="preset",
            reason="layout fixed on the variable before this distribution resolved it",
            axis_sizes=distribution.axis_sizes,
        )
        return fixed, None
    if found is not None and found.axes is not None and found.axes != resolution.axes:
        real = _with_axes(
            resolution,
            found.axes,
            source="preset",
            reason=f"its array is sharded {format_axes(found.axes)}, not as the rules give",
            axis_sizes=distribution.axis_sizes,
        )
        return real, found
    return resolution, None


def _optimizer_entry(distribution: Distributes, variable: keras.Variable) -> Resolution:
    """An optimizer variable made from no parameter: replicated, like `get_variable_layout` does."""
    base = distribution.resolve(variable.path, variable.shape, variable.dtype, warn=False, rules=False)
    return dataclasses.replace(base, source="optimizer")


def _slot_entry(distribution: Distributes, variable: keras.Variable, parent: keras.Variable) -> Resolution:
    axes = _actual_axes(variable)
    if axes is None:
        axes = (
            _actual_axes(parent)
            or distribution.resolve(parent.path, parent.shape, parent.dtype, warn=False).axes
        )
    base = distribution.resolve(variable.path, variable.shape, variable.dtype, warn=False, rules=False)
    return _with_axes(
        base, axes, source="parameter", reason=f"follows {parent.path}", axis_sizes=distribution.axis_sizes
    )


def _with_axes(
    resolution: Resolution, axes: Axes, *, source: str, reason: str, axis_sizes: Mapping[str, int]
) -> Resolution:
    shards = shards_of(axes, axis_sizes)
    return dataclasses.replace(resolution, axes=axes, shards=shards, source=source, reasons=(reason,))


def _actual_axes(variable: keras.Variable) -> Axes | None:
    layout = _compat.variable_layout(variable)
    axes = getattr(layout, "axes", None)
    return None if axes is None else tuple(axes)


def _slot_parent(variable: keras.Variable, params: Mapping[str, keras.Variable]) -> keras.Variable | None:
    """The model weight an optimizer slot was made from (Keras names it `<path>_<slot>`)."""
    best = None
    for prefix, param in params.items():
        if variable.name.startswith(prefix + "_") and tuple(param.shape) == tuple(variable.shape):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, param)
    return None if best is None else best[1]
