"""Meshes on devices you do not have: a TPU target's compile-only devices, or none at all.

`target_grid` lays a mesh over the devices libtpu describes for a target (`_targets`);
`abstract_grid` gives a `jax.sharding.AbstractMesh` placeholder positions, so that the plan,
the pictures and the planner read a grid as they do for real devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import InvalidMeshError, InvalidTargetError
from ._mesh_spec import DEVICES_HINT, infer_sizes
from ._targets import TARGET_FORMS, Target, target_devices

__all__ = ["AbstractDevice", "abstract_grid", "check_target_form", "hosts_in_blocks", "target_grid"]


@dataclasses.dataclass(frozen=True)
class AbstractDevice:
    """A position of a mesh without devices (`jax.sharding.AbstractMesh`): an id, no memory."""

    id: int
    process_index: int = 0
    platform: str = "abstract"
    device_kind: str = "abstract"

    def __str__(self) -> str:
        return f"abstract:{self.id}"


def check_target_form(target: Any, shape: Any, axis_names: Any, devices: Any) -> None:
    """Refuses `target=` beside a form that brings its own devices (Keras's, JAX's, `devices=`)."""
    if target is not None and (axis_names is not None or devices is not None):
        raise InvalidMeshError(
            f"A target brings its own devices: give the axes by name with it, kml.Mesh(data=2, "
            f'model=4, target="tpu-v5e:2x4"). Received: target={target!r}, shape={shape!r}, '
            f"axis_names={axis_names!r}, devices={devices!r}."
        )


def target_grid(named: Mapping[str, int], target: Target) -> tuple[tuple[int, ...], np.ndarray]:
    """The mesh shape and device grid over `target`'s chips, laid out by JAX's mesh utilities.

    With several slices the first axis is laid over them (the data-center network) and
    must divide by their number; the other axes stay within a slice (the ICI).

    Raises:
        InvalidTargetError: the sizes do not multiply to the target's chips, or the first
            axis does not divide by its slices (one line, naming the valid forms).
    """
    from jax.experimental import mesh_utils

    spec = ",".join(f"{name}={size}" for name, size in named.items())
    try:
        shape = infer_sizes(named, target.chips)
    except InvalidMeshError as err:
        if DEVICES_HINT not in str(err):
            raise
        raise InvalidTargetError(
            f"Mesh {spec} does not fit target {target.spec}: its sizes must multiply to the "
            f"target's {target.chips} chips (one size may be -1). Valid forms: {TARGET_FORMS}."
        ) from None
    devices = target_devices(target)
    if target.slices == 1:
        grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        return shape, hosts_in_blocks(grid)
    if shape[0] % target.slices:
        raise InvalidTargetError(
            f"Mesh {spec} on target {target.spec}: the first axis, {next(iter(named))}={shape[0]}, is "
            f"laid over the {target.slices} slices and must divide by {target.slices}. "
            f"Valid forms: {TARGET_FORMS}."
        )
    ici = (shape[0] // target.slices, *shape[1:])
    dcn = (target.slices,) + (1,) * (len(shape) - 1)
    grid = mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices=devices, process_is_granule=False, allow_split_physical_axes=True
    )
    return shape, grid


def hosts_in_blocks(grid: np.ndarray) -> np.ndarray:
    """`grid` with its first axis reordered so that each host's chips hold one block of it.

    JAX's mesh utilities order a long first axis along the chips' physical ring: on v5e 16x16,
    `data=256` puts host 0's four chips (a 2x2 square) at positions 0, 1, 16 and 17. Each
    process must feed one contiguous block of every batch (`process_batch_block`), so the
    positions are grouped by the hosts they hold, in the order each group first appears; the
    other axes, and which chips share each position, do not change. A grid on which no such
    order exists (hosts sharing positions unevenly) is returned as it is, and the batch check
    says so.
    """
    hosts = np.vectorize(lambda device: int(getattr(device, "process_index", 0)), otypes=[int])(grid)
    groups: dict[frozenset[int], list[int]] = {}
    for position in range(grid.shape[0]):
        groups.setdefault(frozenset(hosts[position].ravel().tolist()), []).append(position)
    order = [position for positions in groups.values() for position in positions]
    reordered = hosts[order]
    for host in np.unique(hosts):
        held = np.flatnonzero((reordered == host).reshape(len(order), -1).any(axis=1))
        if held[-1] - held[0] + 1 != len(held):
            return grid
    return grid[order]


def abstract_grid(
    mesh: Any, others: Mapping[str, Any]
) -> tuple[tuple[str, ...], tuple[int, ...], np.ndarray]:
    """Names, sizes and a grid of `AbstractDevice`s for a `jax.sharding.AbstractMesh`.

    Raises:
        InvalidMeshError: anything else was given with it (`others` not all empty).
    """
    given = {name: value for name, value in others.items() if value is not None}
    if given:
        raise InvalidMeshError(
            f"A jax.sharding.AbstractMesh brings its own axis names and sizes, and has no devices. "
            f"Received: {mesh!r} with {given!r}. Fix: kml.Mesh(abstract_mesh) alone."
        )
    names = tuple(str(name) for name in mesh.axis_names)
    shape = tuple(int(size) for size in mesh.axis_sizes)
    grid = np.empty(shape, dtype=object)
    for position in range(grid.size):
        grid.flat[position] = AbstractDevice(position)
    return names, shape, grid
