"""Rules `kml.auto_rules` planned, under the distribution given them: the batch axis and `replicate_below`.

The planner chooses layouts, and predicts their costs, for one batch axis and one
`replicate_below`; rules carry both (`LayoutRules.batch_axis`, `policy`). `kml.ModelParallel`
splits the batch over the planned axis unless told otherwise, and warns where it is told
otherwise, or where its own `replicate_below` lays out a planned matrix otherwise.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import keras

from ._errors import InvalidMeshError, MeshLayoutWarning
from ._format import did_you_mean
from ._mesh import mesh_axis_sizes
from ._resolve import Resolution
from ._rules import Origin
from ._shape_checks import is_weight_matrix

__all__ = ["laid_out_otherwise", "the_batch_axis", "warn_other_policy"]


def laid_out_otherwise(resolution: Resolution, planned: int, given: int) -> bool:
    """Whether `replicate_below=given` lays out a planned weight matrix otherwise than the planner did
    with `planned`: split by one and whole by the other."""
    size, rule = math.prod(resolution.shape), resolution.rule
    low, high = sorted((planned, given))
    if rule is None or not rule.suggested or rule.keep_split or not low <= size < high:
        return False
    return is_weight_matrix(resolution.path, resolution.shape) and any(a is not None for a in rule.axes)


def warn_other_policy(resolution: Resolution, planned: int, given: int) -> None:
    """Warns that `replicate_below` lays a planned matrix out otherwise than `kml.auto_rules` did."""
    path, size = resolution.path, math.prod(resolution.shape)
    warnings.warn(
        f"ModelParallel(replicate_below={given}) lays out {path!r} ({size} elements) otherwise than "
        f"kml.auto_rules planned it, with replicate_below={planned}: "
        f"{'split' if size >= given else 'whole'} here, {'split' if size >= planned else 'whole'} in the "
        "plan, so its costs (rules.cost) do not hold. Fix: leave replicate_below out (the rules carry "
        "theirs), or plan with the same one.",
        MeshLayoutWarning,
        stacklevel=5,
    )


def _warn_other_batch_axis(mesh: keras.distribution.DeviceMesh, batch_axis: str, planned: str | None) -> None:
    """Warns that the batch goes over another axis than the one `kml.auto_rules` planned it over."""
    if planned:
        was, fix = f"the batch over {planned!r}", f"kml.ModelParallel(mesh, rules, batch_axis={planned!r})"
    else:
        sizes = ", ".join(f"{name}={size}" for name, size in mesh_axis_sizes(mesh).items())
        was = "no batch axis (the mesh had none but the model's): the batch whole on every device"
        fix = f"a batch axis of size 1, which keeps the batch whole, kml.Mesh(data=1, {sizes})"
    warnings.warn(
        f"ModelParallel splits the batch over {batch_axis!r}, but its rules were planned by kml.auto_rules "
        f"with {was}. Their layouts were chosen, and their costs (rules.cost) predicted, for that: "
        f"weights split over {batch_axis!r} are gathered every step. Fix: {fix}.",
        MeshLayoutWarning,
        stacklevel=4,
    )


def the_batch_axis(
    mesh: keras.distribution.DeviceMesh, batch_axis: Any, batch_dim_name: Any, planned: Origin | None = None
) -> str:
    """The batch axis from ours or Keras's name for it; by default the one `kml.auto_rules` planned
    with (`planned`), else the mesh's first axis."""
    if batch_axis is not None and batch_dim_name is not None and batch_axis != batch_dim_name:
        raise InvalidMeshError(
            f"batch_axis={batch_axis!r} and batch_dim_name={batch_dim_name!r} disagree; they are "
            "two names (ours and Keras's) for the same argument. Fix: pass one of them."
        )
    batch_axis = batch_axis if batch_axis is not None else batch_dim_name
    if batch_axis is None and planned is not None and planned.batch_axis in mesh.axis_names:
        batch_axis = planned.batch_axis
    batch_axis = mesh.axis_names[0] if batch_axis is None else batch_axis
    if planned is not None and batch_axis != planned.batch_axis and batch_axis in mesh.axis_names:
        _warn_other_batch_axis(mesh, batch_axis, planned.batch_axis)
    if batch_axis not in mesh.axis_names:
        raise InvalidMeshError(
            f"batch_axis={batch_axis!r} is not an axis of the mesh, which has axes "
            f"{tuple(mesh.axis_names)} (shape {tuple(mesh.shape)})."
            f"{did_you_mean(batch_axis, tuple(mesh.axis_names))} Fix: pass one of them."
        )
    return batch_axis
