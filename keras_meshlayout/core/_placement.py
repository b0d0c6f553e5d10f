"""Meshes across processes: which axes cross hosts, and which process holds which part.

Across processes (several hosts, or `python -m keras_meshlayout.launch` on one machine) the
axes named in `across_processes` are laid over the processes and the others stay within each
process, where the fast links are.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from ._errors import InvalidMeshError, MeshLayoutWarning
from ._format import did_you_mean, id_ranges

__all__ = [
    "device_positions",
    "ProcessSplitWarning",
    "across_axes",
    "hybrid_grid",
    "process_layout",
    "process_of",
    "spanning_axes",
]


class ProcessSplitWarning(MeshLayoutWarning):
    """A mesh axis meant to stay within a process spans processes.

    Issued when `allow_split_across_processes=True` lets such a mesh be built:
    the collectives of that axis (the all-reduces and all-gathers of
    tensor-parallel layers, every step) then cross the slower links between
    hosts.
    """


def process_layout(mesh: keras.distribution.DeviceMesh) -> list[str]:
    """Which process holds which part of a mesh, as lines of text.

    Works for any Keras `DeviceMesh` on JAX. The first line names the axes
    across processes and within them; then one line per process gives its
    positions (an index or an inclusive range per axis) and its device ids.

    Args:
        mesh: The mesh.

    Returns:
        The lines; a single line in a single process.

    Example:
        >>> import keras_meshlayout as kml
        >>> kml.process_layout(kml.Mesh(data=2, model=4))
        ['1 process with 8 devices']
    """
    devices = np.asarray(device_positions(mesh))
    names = tuple(mesh.axis_names)
    processes = np.vectorize(process_of, otypes=[int])(devices)
    ids = np.unique(processes)
    if len(ids) == 1:
        return [f"1 process with {devices.size} devices"]
    across = spanning_axes(processes, names)
    within = [name for name in names if name not in across]
    lines = [
        f"{len(ids)} processes × {devices.size // len(ids)} devices; across processes: "
        f"{', '.join(across)}; within each process: {', '.join(within) or '-'}"
    ]
    for process in ids:
        where = np.argwhere(processes == process)
        spans = []
        for axis, name in enumerate(names):
            low, high = where[:, axis].min(), where[:, axis].max()
            spans.append(f"{name}={low}" if low == high else f"{name}={low}..{high}")
        device_ids = sorted(d.id for d in devices[processes == process])
        lines.append(f"process {process}: {', '.join(spans)} (devices {id_ranges(device_ids)})")
    return lines


def process_of(device: Any) -> int:
    """The index of the process that holds `device` (0 for devices that do not say)."""
    return int(getattr(device, "process_index", 0))


def spanning_axes(processes: np.ndarray, names: Sequence[str]) -> tuple[str, ...]:
    """The axes along which the process index changes."""
    return tuple(name for axis, name in enumerate(names) if (np.diff(processes, axis=axis) != 0).any())


def across_axes(across: str | Sequence[str] | None, names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes to lay over processes: as given, checked, or the default."""
    if across is None:
        return ("data",) if "data" in names else names[:1]
    if isinstance(across, str):
        chosen: tuple = (across,)
    elif isinstance(across, Sequence) and all(isinstance(name, str) for name in across):
        chosen = tuple(across)
    else:
        raise InvalidMeshError(
            "across_processes must name mesh axes: one axis name or a sequence of them, e.g. "
            f'across_processes="data" or across_processes=("data",). Received: across_processes={across!r}. '
            f"The mesh has axes {names}."
        )
    for name in chosen:
        if name not in names:
            raise InvalidMeshError(
                f"across_processes names axis {name!r}, which the mesh does not have. The mesh has "
                f"axes {names}.{did_you_mean(name, names)} Received: across_processes={across!r}. "
                "Fix: name axes of the mesh, "
                'usually the data axis: across_processes=("data",).'
            )
    if len(set(chosen)) != len(chosen):
        raise InvalidMeshError(f"across_processes names an axis twice. Received: {across!r}.")
    return chosen


def hybrid_grid(
    sizes: dict[str, int], devices: Sequence[Any], across: tuple[str, ...], allow_split: bool
) -> np.ndarray:
    """Lays the `across` axes over processes and the rest within each process."""
    from jax.experimental import mesh_utils

    per_process: dict[int, int] = {}
    for device in devices:
        per_process[process_of(device)] = per_process.get(process_of(device), 0) + 1
    count = len(per_process)
    mesh_text = "Mesh(" + ", ".join(f"{n}={s}" for n, s in sizes.items()) + ")"
    _check_even(mesh_text, per_process)
    outer = dict.fromkeys(sizes, 1)  # positions of each axis that change process
    remaining = count
    for name in (n for n in sizes if n in across):
        outer[name] = math.gcd(sizes[name], remaining)
        remaining //= outer[name]
    if remaining > 1:
        placed = math.prod(outer.values())
        others = [name for name in sizes if name not in across and sizes[name] > 1]
        if not allow_split:
            raise InvalidMeshError(
                f"{mesh_text} on {count} processes × {per_process[process_of(devices[0])]} devices: the "
                f"axes across processes {across} can hold only {placed} of the {count} processes, so "
                f"{_axis_words(others)} would also span processes and every collective of "
                "it (the all-reduces and all-gathers of tensor-parallel layers, every step) would "
                "cross the slow links between hosts. Fix: make the sizes of the across_processes "
                f"axes multiply to a multiple of {count} (e.g. a larger data axis and a smaller "
                "model axis), name more axes in across_processes=, or pass "
                "allow_split_across_processes=True to accept it."
            )
        # The sizes multiply to a multiple of the process count, so the other axes take the rest.
        for name in others:
            outer[name] = math.gcd(sizes[name], remaining)
            remaining //= outer[name]
        split = [name for name in others if outer[name] > 1]
        warnings.warn(
            f"{mesh_text}: {_axis_words(split)} {'spans' if len(split) == 1 else 'span'} processes "
            f"({', '.join(f'{n}: {outer[n]} processes' for n in split)}), as "
            "allow_split_across_processes=True permits; collectives over "
            f"{'it' if len(split) == 1 else 'them'} cross the links between hosts every step.",
            ProcessSplitWarning,
            stacklevel=3,
        )
    inner = [sizes[name] // outer[name] for name in sizes]
    try:
        return mesh_utils.create_hybrid_device_mesh(
            inner,
            list(outer.values()),
            devices,
            process_is_granule=True,
            allow_split_physical_axes=True,
        )
    except ValueError as err:
        raise InvalidMeshError(
            f"JAX could not lay {mesh_text} over {count} processes (within each process "
            f"{dict(zip(sizes, inner, strict=True))}, across processes {outer}): {err}"
        ) from None


def _check_even(mesh_text: str, per_process: dict[int, int]) -> None:
    """Every process must hold as many of the mesh's devices as the others."""
    if len(set(per_process.values())) > 1:
        raise InvalidMeshError(
            f"{mesh_text} spans {len(per_process)} processes holding different numbers of devices "
            f"({dict(sorted(per_process.items()))} by process), so no axis can be laid evenly "
            "over processes. Fix: give every process the same number of devices (for "
            "emulated CPUs: the same --devices-per-process), or pass devices= explicitly."
        )


def _axis_words(names: Sequence[str]) -> str:
    if len(names) == 1:
        return f"axis {names[0]!r}"
    return "axes " + ", ".join(repr(n) for n in names)


def device_positions(mesh: Any) -> Any:
    """The JAX devices of a mesh's backend mesh; the placeholders of a mesh without devices.

    A `jax.sharding.AbstractMesh` has no devices: a `kml.Mesh` made from one holds an
    `AbstractDevice` (process 0) at each position.
    """
    import jax

    backend = mesh.backend_mesh
    return mesh.devices if isinstance(backend, jax.sharding.AbstractMesh) else backend.devices
