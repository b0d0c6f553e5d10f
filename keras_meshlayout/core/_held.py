"""What the variables really hold: the sharding of each one's array, read in mesh-axis terms.

The plan shows this where a model exists (its variables are allocated), and says when it
differs from what the rules give; the trainer hooks refuse, before any compute, a model whose
variables sit on devices outside the distribution's mesh (built before the distribution was
set), which JAX would otherwise reject mid-step with an "incompatible devices" traceback.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .. import _compat
from ._axes import Axes
from ._errors import LayoutMismatchError

__all__ = ["Held", "check_on_mesh", "held", "held_array", "mismatch_cause", "off_mesh_message"]


@dataclasses.dataclass(frozen=True)
class Held:
    """Where one variable's array lives.

    Attributes:
        axes: Its layout in the mesh's axes; `None` when it is not on the mesh
            (or its sharding has no such form).
        devices: How many devices hold a piece of it.
        on_mesh: Whether it lives on exactly the mesh's devices.
        other_mesh: Where those devices are arranged in another mesh (`"data=2 x model=4"`), that
            mesh: its spec means other shards than on this one.
    """

    axes: Axes | None
    devices: int
    on_mesh: bool
    other_mesh: str | None = None


def held(variable: Any, mesh: Any) -> Held | None:
    """What `variable` holds on `mesh`, or `None` when it holds no array (a dry build, a purge).

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> with kml.ModelParallel(mesh, [(r".*kernel", (None, "model"))]).scope():
        ...     layer = keras.layers.Dense(8)
        ...     layer.build((None, 4))
        >>> held(layer.kernel, mesh)
        Held(axes=(None, 'model'), devices=8, on_mesh=True, other_mesh=None)
    """
    return held_array(_compat.raw_value(variable), mesh, len(variable.shape))


def held_array(array: Any, mesh: Any, rank: int) -> Held | None:
    """What a `jax.Array` holds on `mesh` (see `held`), or `None` for anything without a sharding."""
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        return None
    backend = mesh.backend_mesh
    devices = set(sharding.device_set)
    if devices != set(backend.devices.flat):
        return Held(axes=None, devices=len(devices), on_mesh=False)
    spec = getattr(sharding, "spec", None)
    same_mesh = _same_mesh(getattr(sharding, "mesh", None), backend)
    if spec is not None and same_mesh and len(spec) <= rank:
        padded = (*spec, *(None,) * (rank - len(spec)))
        return Held(axes=tuple(_entry(entry) for entry in padded), devices=len(devices), on_mesh=True)
    if sharding.is_fully_replicated:
        return Held(axes=(None,) * rank, devices=len(devices), on_mesh=True)
    other = getattr(sharding, "mesh", None)
    shape = getattr(other, "shape", None)
    where = None if not shape else " x ".join(f"{name}={size}" for name, size in dict(shape).items())
    return Held(axes=None, devices=len(devices), on_mesh=True, other_mesh=where)


def _same_mesh(mesh: Any, backend: Any) -> bool:
    """Whether an array's mesh is `backend`: the same axes, sizes and devices in the same places (a
    2×4 and a 4×2 mesh of the same devices and axis names are not: a spec means other shards)."""
    if getattr(mesh, "axis_names", None) != backend.axis_names:
        return False
    devices = getattr(mesh, "devices", None)
    if devices is None or devices.shape != backend.devices.shape:
        return False
    return bool((devices == backend.devices).all())


def _entry(entry: Any) -> str | tuple[str, ...] | None:
    """A `PartitionSpec` entry as a layout entry: `('model',)` → `'model'`, `()` → `None`."""
    if isinstance(entry, (tuple, list)):
        return None if not entry else entry[0] if len(entry) == 1 else tuple(entry)
    return entry


def mismatch_cause(distribution: Any, devices: int = 1, owners: tuple[str, ...] = ("model",)) -> str:
    """Why variables are off the mesh: made outside the distribution (on `devices` devices), by whom."""
    import keras

    if devices > 1:
        return (
            f"they were laid out for another mesh of {devices} devices (built under another "
            "distribution), and Keras does not move variables between meshes"
        )
    if "model" not in owners:  # the model's own on the mesh: only what compile was given is off it
        made = " and ".join(f"the {owner} object" for owner in owners)
        return (
            f"{made} was created before the distribution was set, so Keras made its variables on one device"
        )
    if keras.distribution.distribution() is distribution:
        return (
            "the distribution was set after the model was built, so Keras created its variables on one device"
        )
    return "the model was built outside the distribution, so Keras created its variables on one device"


_FIX = (
    "Fix: build the model (and load its weights) under the distribution: "
    "keras.distribution.set_distribution(dist) before creating any Keras object, or "
    "`with dist.scope(): model = build()`."
)
_FIX_OBJECTS = (
    "Fix: create the optimizer and metrics after set_distribution(dist) (or inside dist.scope()), or "
    "pass them by name: compile(optimizer='adam', metrics=['mae'])."
)
_FIX_MESH = (
    "Fix: build the model under this distribution and move its weights with a checkpoint, which loads "
    "onto any mesh: kml.save_checkpoint(model, path) under the old one, kml.load_checkpoint(new, path) here."
)


def off_mesh_message(
    distribution: Any, paths: list[str], devices: int, owners: tuple[str, ...] = ("model",)
) -> str:
    """One message for the variables that live outside the mesh, naming the cause and the fix."""
    shown = ", ".join(repr(path) for path in paths[:3]) + (
        f" and {len(paths) - 3} more" if len(paths) > 3 else ""
    )
    mesh = " x ".join(f"{name}={size}" for name, size in distribution.axis_sizes.items())
    fix = _FIX_MESH if devices > 1 else _FIX if "model" in owners else _FIX_OBJECTS
    return (
        f"{len(paths)} variable(s) ({shown}) live on {devices} device(s), not on the mesh {mesh} "
        f"({_mesh_size(distribution)} devices): {mismatch_cause(distribution, devices, owners)}. Their "
        f"layouts are not the rules'. {fix}"
    )


def _mesh_size(distribution: Any) -> int:
    size = 1
    for value in distribution.axis_sizes.values():
        size *= value
    return size


def check_on_mesh(model: Any, distribution: Any) -> None:
    """Raises `LayoutMismatchError` before any compute when a variable of `model` is off the mesh: its
    own, its optimizer's, or those of the metric objects given to `compile`."""
    off, devices, owners = [], 0, []
    mesh = distribution.device_mesh
    groups = _compat.variable_groups(model)
    groups["metrics_variables"] = [*groups["metrics_variables"], *_compat.compile_metric_variables(model)]
    for key, group in groups.items():
        for variable in group:
            found = held(variable, mesh)
            if found is not None and not found.on_mesh:
                off.append(variable.path)
                devices = found.devices
                owner = _OWNERS.get(key, "model")
                owners += [owner] if owner not in owners else []
    if off:
        raise LayoutMismatchError(
            off_mesh_message(distribution, off, devices, tuple(sorted(owners)))
            + " (JAX would otherwise refuse the step with 'Received incompatible devices'.)"
        )


_OWNERS = {"optimizer_variables": "optimizer", "metrics_variables": "metric"}
