"""`auto_rules`' arguments, checked before any tracing: each wrong one is one clear error.

The mesh and the model must be a mesh and a Keras model or layer; `model_axis` and `batch_axis`
axes of the mesh, and not the same one; a memory budget a positive number of bytes, with the batch
it is planned for, whose samples split over the batch axis.
"""

from __future__ import annotations

from typing import Any

import keras

from ..core._errors import IndivisibleBatchError, InvalidMeshError, InvalidOptionError, InvalidRuleError
from ..core._format import did_you_mean
from ..core._memory import parse_bytes
from ..core._mesh import Mesh

__all__ = ["check_budget_args", "check_mesh_and_model", "checked_axes"]


def check_mesh_and_model(model: Any, mesh: Any) -> keras.distribution.DeviceMesh:
    """The mesh (a JAX one made a `kml.Mesh`, as `kml.ModelParallel` takes it), refused before any
    tracing, with the model, when they are not a model and a mesh."""
    import jax

    if isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
        mesh = Mesh(mesh)
    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise InvalidMeshError(
            f"auto_rules: the mesh must be a kml.Mesh (or keras.distribution.DeviceMesh); received "
            f"{type(mesh).__name__} {mesh!r}. Fix: kml.Mesh(data=2, model=4), or "
            f"kml.Mesh.parse('2x4') for a shape written as text."
        )
    if not isinstance(model, keras.layers.Layer):
        builder = " (a function: call it, or plan it unbuilt with `with kml.dry_build(fn) as model:`)"
        raise InvalidOptionError(
            f"auto_rules: the model must be a built Keras model or layer; received {type(model).__name__}"
            f"{builder if callable(model) else ''}."
        )
    return mesh


def checked_axes(mesh: keras.distribution.DeviceMesh, model_axis: str, batch_axis: str | None) -> str | None:
    """`batch_axis` (the first axis other than `model_axis` by default), both checked against the mesh."""
    names = tuple(mesh.axis_names)
    if model_axis not in names:
        raise InvalidRuleError(
            f"auto_rules: model_axis={model_axis!r} is not an axis of the mesh, which has axes "
            f"{names}.{did_you_mean(model_axis, names)} Fix: pass model_axis= one of them."
        )
    if batch_axis is None:
        return next((axis for axis in names if axis != model_axis), None)
    if batch_axis not in names:
        raise InvalidMeshError(
            f"auto_rules: batch_axis={batch_axis!r} is not an axis of the mesh, which has axes "
            f"{names}.{did_you_mean(batch_axis, names)} Fix: pass batch_axis= one of them (the one "
            "kml.ModelParallel splits the batch over), or leave it out for the first axis other than "
            f"{model_axis!r}."
        )
    if batch_axis == model_axis:
        raise InvalidMeshError(
            f"auto_rules: batch_axis and model_axis are both {model_axis!r}: the batch and the weights "
            "cannot be split over the same axis. Fix: a mesh with a data axis (kml.Mesh(data=2, "
            f"model=4)), or leave batch_axis out{' (no data parallelism)' if len(names) == 1 else ''}."
        )
    return batch_axis


def check_budget_args(
    memory_budget: int | str | None,
    batch: Any,
    fully_sharded: bool = False,
    batch_axis: str | None = None,
    axis_size: int = 1,
) -> None:
    if memory_budget is not None:
        parse_bytes(memory_budget)  # a size that is no positive number of bytes: refused before planning
    if fully_sharded and batch is None:
        raise InvalidOptionError(
            "the fully sharded plan needs batch=: one global batch of inputs, to cost each layout "
            "and its gathers. Fix: pass batch=x."
        )
    if memory_budget is not None and batch is None:
        raise InvalidOptionError(
            "auto_rules(memory_budget=...) needs batch=: one global batch of inputs (arrays, or "
            "anything with .shape and .dtype), to size the activations and the traffic they cause. "
            'Fix: auto_rules(model, mesh, memory_budget="16GiB", batch=x).'
        )
    rows = {int(leaf.shape[0]) for leaf in keras.tree.flatten(batch) if len(getattr(leaf, "shape", ())) > 0}
    if axis_size > 1 and any(count % axis_size for count in rows):
        count = min(count for count in rows if count % axis_size)
        raise IndivisibleBatchError(
            f"auto_rules: a batch of {count} samples cannot be split over batch axis {batch_axis!r} of "
            f"size {axis_size}: {count} is not a multiple of {axis_size}, so fit could not run it. "
            f"Fix: pass batch= with a multiple of {axis_size} samples, the global batch fit will see."
        )
