"""Named device meshes: parsing a spec, inferring sizes, laying out devices.

Across processes (several hosts, or `python -m keras_meshlayout.launch` on one
machine) the axes named in `across_processes` are laid over the processes and
the others stay within each process, where the fast links are.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from ._backend import require_jax_backend
from ._errors import InvalidMeshError, MeshLayoutWarning

__all__ = ["Mesh", "ProcessSplitWarning", "process_layout"]


class ProcessSplitWarning(MeshLayoutWarning):
    """A mesh axis meant to stay within a process spans processes.

    Issued when `allow_split_across_processes=True` lets such a mesh be built:
    the collectives of that axis (the all-reduces and all-gathers of
    tensor-parallel layers, every step) then cross the slower links between
    hosts.
    """


#: Axis names given to positional specs such as ``"2x4"``.
POSITIONAL_AXIS_NAMES = ("data", "model")

_AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SPEC_HELP = (
    'Write it as "2x4" (axes data, model), "8" (data only) or '
    '"data=2,model=4" (named; one size may be -1 to use the remaining devices).'
)


class Mesh(keras.distribution.DeviceMesh):
    """A grid of devices with named axes, laid out for the hardware topology.

    Axes keep the order in which they are given. Devices are arranged by JAX's
    mesh utilities (`jax.experimental.mesh_utils.create_device_mesh`), which on
    TPUs and GPUs put the last axes on the fastest links; on CPUs it keeps the
    device order. One axis size may be `-1`: it takes whatever the others leave.

    A `Mesh` is a `keras.distribution.DeviceMesh` and can be used wherever Keras
    expects one. It also takes Keras's call form, with Keras's meaning:
    `kml.Mesh(shape, axis_names, devices)` (positional or as keywords) puts
    the devices on the mesh in the order given, reshaped to `shape`, and keeps
    `axis_names` as given; `devices` may be JAX devices or names such as
    `"cpu:0"` (as `keras.distribution.list_devices()` returns), in an array of
    any shape.

    When the devices belong to several processes (after `kml.initialize()` in
    a multi-process run), the axes named in `across_processes` (by default the
    `data` axis, or the first axis when there is none) are laid over the
    processes and the others stay within each process, with JAX's hybrid mesh
    utilities (`create_hybrid_device_mesh`, processes as the slow-network
    granules). A mesh on which another axis would have to span processes, such
    as a `model` axis larger than one host, is refused unless
    `allow_split_across_processes=True`. `process_ids` shows which process
    holds each position.

    Args:
        shape: Optional mapping of axis name to size, for names that come from
            a dictionary; or, Keras's way, a tuple of axis sizes with
            `axis_names`.
        axis_names: Keras's way: one name per size in `shape`.
        devices: Devices to arrange, as JAX devices or names such as
            `"cpu:0"`, in a list or an array of any shape. Defaults to
            `jax.devices()`, the devices of the default backend (of all
            processes, in a multi-process run).
        across_processes: The axis name, or names, laid over processes.
            Ignored in a single process.
        allow_split_across_processes: Let other axes span processes when the
            `across_processes` axes cannot hold them all (with a
            `ProcessSplitWarning`) instead of raising.
        **axis_sizes: Axis sizes by name, in order.

    Raises:
        InvalidMeshError: an axis size is not a positive integer, more than one
            is `-1`, an axis name is repeated or malformed, the sizes do not
            multiply to the number of devices, `across_processes` names an axis
            the mesh lacks, or the processes cannot be laid over the
            `across_processes` axes.

    Example:
        >>> import keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> mesh.axis_sizes
        {'data': 2, 'model': 4}
        >>> kml.Mesh(data=-1, model=2).shape
        (4, 2)
        >>> import keras
        >>> kml.Mesh((2, 4), ["data", "model"], keras.distribution.list_devices()).axis_sizes
        {'data': 2, 'model': 4}
    """

    def __init__(
        self,
        shape: Mapping[str, int] | Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        devices: Any = None,
        *,
        across_processes: str | Sequence[str] | None = None,
        allow_split_across_processes: bool = False,
        **axis_sizes: int,
    ) -> None:
        require_jax_backend()
        import jax
        from jax.experimental import mesh_utils

        if axis_names is not None or (shape is not None and not isinstance(shape, Mapping)):
            if axis_sizes:
                raise InvalidMeshError(
                    "Give the mesh either Keras's way, kml.Mesh(shape, axis_names), or ours, "
                    f"kml.Mesh(data=2, model=4), not both. Received: shape={shape!r}, "
                    f"axis_names={axis_names!r}, axis sizes {axis_sizes!r}."
                )
            self._init_keras(shape, axis_names, devices)
            return
        axes = shape
        if axes is not None and axis_sizes:
            raise InvalidMeshError(
                "Give the mesh axes either as a mapping or as keyword arguments, not both. "
                f"Received: axes={dict(axes)!r}, axis_sizes={axis_sizes!r}."
            )
        if axes is not None and not isinstance(axes, Mapping):
            raise InvalidMeshError(
                "Mesh axes go in as keywords, kml.Mesh(data=2, model=4), or as a mapping, "
                f'kml.Mesh({{"data": 2, "model": 4}}). Received: {axes!r}. For a spec string use '
                "kml.Mesh.parse."
            )
        named = dict(axes) if axes is not None else axis_sizes
        if not named:
            raise InvalidMeshError(
                "A mesh needs at least one axis. Received no axes. Example: kml.Mesh(data=2, model=4)."
            )
        for name in named:
            if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
                raise InvalidMeshError(
                    f"Mesh axis names must be identifiers such as 'data' or 'model'. "
                    f"Received: {name!r} in axes {named!r}."
                )
        devices = jax.devices() if devices is None else to_jax_devices(devices).ravel().tolist()
        shape = _infer_sizes(named, len(devices))
        across = _across_axes(across_processes, tuple(named))
        if len({_process_of(d) for d in devices}) > 1:
            grid = _hybrid_grid(
                dict(zip(named, shape, strict=True)), devices, across, allow_split_across_processes
            )
        else:
            grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        super().__init__(shape=shape, axis_names=tuple(named), devices=grid)
        self._backend_mesh = jax.sharding.Mesh(self.devices, self.axis_names)

    def _init_keras(self, shape: Any, axis_names: Any, devices: Any) -> None:
        """`keras.distribution.DeviceMesh(shape, axis_names, devices)`, with Keras's meaning."""
        import jax

        received = f"Received: shape={shape!r}, axis_names={axis_names!r}."
        if not shape or not axis_names:
            raise InvalidMeshError(
                f"Shape and axis_names cannot be empty (as Keras's DeviceMesh says). {received} "
                'Fix: kml.Mesh((2, 4), ["data", "model"]) Keras\'s way, or kml.Mesh(data=2, model=4).'
            )
        if isinstance(axis_names, str) or not isinstance(axis_names, Sequence):
            raise InvalidMeshError(
                f"axis_names must be a list of names, one per axis of shape. {received} "
                'Fix: e.g. kml.Mesh((8,), ["data"]).'
            )
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise InvalidMeshError(
                f"shape must be a tuple of axis sizes. {received} Fix: e.g. kml.Mesh((2, 4), "
                '["data", "model"]), or a mapping kml.Mesh({"data": 2, "model": 4}).'
            )
        if len(shape) != len(axis_names):
            raise InvalidMeshError(
                f"Shape and axis_names should have same size (as Keras's DeviceMesh says): "
                f"{len(shape)} sizes, {len(axis_names)} names. {received} Fix: one name per axis."
            )
        for name in axis_names:
            if not isinstance(name, str) or not _AXIS_NAME.fullmatch(name):
                raise InvalidMeshError(
                    f"Mesh axis names must be identifiers such as 'data' or 'model', since rules "
                    f"and mesh specs name them (Keras's DeviceMesh takes any name). "
                    f"Received: {name!r} in axis_names={axis_names!r}."
                )
        if len(set(axis_names)) != len(axis_names):
            raise InvalidMeshError(f"Mesh axis names must differ. {received}")
        for name, size in zip(axis_names, shape, strict=True):
            if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
                raise InvalidMeshError(f"Mesh axis {name!r} needs a positive integer size. {received}")
        grid = np.asarray(jax.devices(), dtype=object) if devices is None else to_jax_devices(devices)
        if math.prod(shape) != grid.size:
            raise InvalidMeshError(
                f"Shape does not match the number of devices (as Keras's DeviceMesh says): shape "
                f"{tuple(shape)} needs {math.prod(shape)} devices, and {grid.size} were given "
                f"(devices.shape={grid.shape}). {received} Fix: pass {math.prod(shape)} devices, "
                "or a shape whose sizes multiply to the number of devices."
            )
        names = list(axis_names) if isinstance(axis_names, list) else tuple(axis_names)
        # Keras's meaning: the devices in the order given, reshaped to the mesh.
        super().__init__(shape=tuple(int(s) for s in shape), axis_names=names, devices=grid.reshape(shape))
        self._backend_mesh = jax.sharding.Mesh(self.devices, tuple(names))

    @classmethod
    def parse(
        cls,
        spec: str,
        devices: Sequence[Any] | None = None,
        *,
        across_processes: str | Sequence[str] | None = None,
        allow_split_across_processes: bool = False,
    ) -> Mesh:
        """Builds a mesh from a spec string.

        Args:
            spec: `"2x4"` (positional: axes `data` and `model`), `"8"` (a 1-D
                `data` mesh), or `"data=2,model=4"` (named, any number of axes;
                one size may be `-1`).
            devices: As for `Mesh`.
            across_processes: As for `Mesh`.
            allow_split_across_processes: As for `Mesh`.

        Returns:
            The mesh.

        Raises:
            InvalidMeshError: the spec is malformed or does not fit the devices.

        Example:
            >>> import keras_meshlayout as kml
            >>> kml.Mesh.parse("2x4")
            Mesh(data=2, model=4)
            >>> kml.Mesh.parse("data=-1,model=2")
            Mesh(data=4, model=2)
            >>> kml.Mesh.parse("8").axis_names
            ('data',)
        """
        return cls(
            _parse_spec(spec),
            devices=devices,
            across_processes=across_processes,
            allow_split_across_processes=allow_split_across_processes,
        )

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Axis sizes by name, in mesh order."""
        return mesh_axis_sizes(self)

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return math.prod(self.shape)

    @property
    def spec(self) -> str:
        """The named spec string that rebuilds this mesh, e.g. `"data=2,model=4"`."""
        return ",".join(f"{name}={size}" for name, size in self.axis_sizes.items())

    @property
    def device_ids(self) -> np.ndarray:
        """The grid of device ids, one entry per mesh position."""
        return np.vectorize(lambda d: d.id, otypes=[int])(self.devices)

    @property
    def process_ids(self) -> np.ndarray:
        """The grid of process indices: which process holds each mesh position.

        Example:
            >>> import keras_meshlayout as kml
            >>> kml.Mesh(data=2, model=4).process_ids.tolist()  # one process
            [[0, 0, 0, 0], [0, 0, 0, 0]]
        """
        return np.vectorize(_process_of, otypes=[int])(self.devices)

    @property
    def process_count(self) -> int:
        """Number of processes whose devices are in the mesh."""
        return len(np.unique(self.process_ids))

    @property
    def axes_across_processes(self) -> tuple[str, ...]:
        """The axes along which the process changes; `()` in a single process."""
        return _spanning_axes(self.process_ids, self.axis_names)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={size}" for name, size in self.axis_sizes.items())
        return f"Mesh({inner})"

    __str__ = __repr__


def to_jax_devices(devices: Any) -> np.ndarray:
    """JAX devices in the array shape given, from JAX devices or strings such as `"cpu:0"`.

    `keras.distribution.list_devices()` returns strings of that kind.

    Raises:
        InvalidMeshError: a string names no device of this process's JAX.
    """
    import jax

    grid = np.empty(np.shape(np.asarray(devices, dtype=object)), dtype=object)
    flat = np.asarray(devices, dtype=object).ravel()
    out = grid.reshape(-1)
    for position, device in enumerate(flat):
        # Objects with a device's id and process_index pass too (tests stand them in for other processes').
        known = isinstance(device, jax.Device) or (hasattr(device, "process_index") and hasattr(device, "id"))
        out[position] = device if known else _device_named(device)
    return grid


def _device_named(name: Any) -> Any:
    import jax

    if not isinstance(name, str):
        raise InvalidMeshError(
            f"Devices must be JAX devices or names such as 'cpu:0' (as keras.distribution."
            f"list_devices() returns). Received: {name!r}."
        )
    platform, _, number = name.partition(":")
    try:
        candidates = jax.devices(platform.lower())
    except RuntimeError:
        candidates = []
    for device in candidates:
        if str(device.id) == (number or "0"):
            return device
    known = ", ".join(f"{d.platform}:{d.id}" for d in jax.devices())
    raise InvalidMeshError(
        f"No device is named {name!r}. The devices are {known}. Fix: use names from "
        "keras.distribution.list_devices(), or JAX devices from jax.devices()."
    )


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
    devices = np.asarray(mesh.backend_mesh.devices)
    names = tuple(mesh.axis_names)
    processes = np.vectorize(_process_of, otypes=[int])(devices)
    ids = np.unique(processes)
    if len(ids) == 1:
        return [f"1 process with {devices.size} devices"]
    across = _spanning_axes(processes, names)
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
        lines.append(f"process {process}: {', '.join(spans)} (devices {_id_ranges(device_ids)})")
    return lines


def _process_of(device: Any) -> int:
    return int(getattr(device, "process_index", 0))


def _spanning_axes(processes: np.ndarray, names: Sequence[str]) -> tuple[str, ...]:
    """The axes along which the process index changes."""
    return tuple(name for axis, name in enumerate(names) if (np.diff(processes, axis=axis) != 0).any())


def mesh_axis_sizes(mesh: Any) -> dict[str, int]:
    """Axis sizes by name, in mesh order, of any mesh the package is given.

    The one place that pairs names with sizes: a `kml.Mesh` or a plain
    `keras.distribution.DeviceMesh` (`shape` a tuple), or a
    `jax.sharding.Mesh` (`shape` already a mapping of name to size).

    Example:
        >>> import keras
        >>> mesh = keras.distribution.DeviceMesh((2, 4), ["data", "model"], keras.distribution.list_devices())
        >>> mesh_axis_sizes(mesh)
        {'data': 2, 'model': 4}
    """
    if isinstance(mesh.shape, Mapping):
        return {str(name): int(size) for name, size in mesh.shape.items()}
    return {name: int(size) for name, size in zip(mesh.axis_names, mesh.shape, strict=True)}


def _id_ranges(ids: Sequence[int]) -> str:
    """Device ids as text, runs collapsed: `[0, 1, 2, 3, 8]` → `'0-3, 8'` (the one format for id lists)."""
    if not ids:
        return ""
    parts: list[str] = []
    start = previous = ids[0]
    for current in [*ids[1:], None]:
        if current is not None and current == previous + 1:
            previous = current
            continue
        parts.append(str(start) if start == previous else f"{start}-{previous}")
        if current is not None:
            start = previous = current
    return ", ".join(parts)


def _across_axes(across: str | Sequence[str] | None, names: tuple[str, ...]) -> tuple[str, ...]:
    """The axes to lay over processes: as given, checked, or the default."""
    if across is None:
        return ("data",) if "data" in names else names[:1]
    chosen = (across,) if isinstance(across, str) else tuple(across)
    for name in chosen:
        if name not in names:
            raise InvalidMeshError(
                f"across_processes names axis {name!r}, which the mesh does not have. The mesh has "
                f"axes {names}. Received: across_processes={across!r}. Fix: name axes of the mesh, "
                'usually the data axis: across_processes=("data",).'
            )
    if len(set(chosen)) != len(chosen):
        raise InvalidMeshError(f"across_processes names an axis twice. Received: {across!r}.")
    return chosen


def _hybrid_grid(
    sizes: dict[str, int], devices: Sequence[Any], across: tuple[str, ...], allow_split: bool
) -> np.ndarray:
    """Lays the `across` axes over processes and the rest within each process."""
    from jax.experimental import mesh_utils

    per_process: dict[int, int] = {}
    for device in devices:
        per_process[_process_of(device)] = per_process.get(_process_of(device), 0) + 1
    count = len(per_process)
    mesh_text = "Mesh(" + ", ".join(f"{n}={s}" for n, s in sizes.items()) + ")"
    if len(set(per_process.values())) > 1:
        raise InvalidMeshError(
            f"{mesh_text} spans {count} processes holding different numbers of devices "
            f"({dict(sorted(per_process.items()))} by process), so no axis can be laid evenly "
            "over processes. Fix: give every process the same number of devices (for "
            "emulated CPUs: the same --devices-per-process), or pass devices= explicitly."
        )
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
                f"{mesh_text} on {count} processes × {per_process[_process_of(devices[0])]} devices: the "
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


def _axis_words(names: Sequence[str]) -> str:
    if len(names) == 1:
        return f"axis {names[0]!r}"
    return "axes " + ", ".join(repr(n) for n in names)


def _parse_spec(spec: str) -> dict[str, int]:
    """Turns a mesh spec string into ordered `{axis: size}`."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidMeshError(f"Mesh spec must be a non-empty string. Received: {spec!r}. {_SPEC_HELP}")
    text = spec.replace(" ", "")
    if "=" in text:
        named: dict[str, int] = {}
        for part in text.split(","):
            name, sep, size = part.partition("=")
            if not sep or not name:
                raise InvalidMeshError(f"Mesh spec {spec!r} has a malformed entry {part!r}. {_SPEC_HELP}")
            if name in named:
                raise InvalidMeshError(
                    f"Mesh spec {spec!r} names axis {name!r} twice. Each axis needs its own name."
                )
            named[name] = _parse_size(size, spec)
        return named
    sizes = [_parse_size(part, spec) for part in text.lower().split("x")]
    if len(sizes) > len(POSITIONAL_AXIS_NAMES):
        raise InvalidMeshError(
            f"Mesh spec {spec!r} has {len(sizes)} positional axes, but only "
            f"{len(POSITIONAL_AXIS_NAMES)} have default names {POSITIONAL_AXIS_NAMES}. "
            'Name them instead, e.g. "data=2,model=2,expert=2".'
        )
    return dict(zip(POSITIONAL_AXIS_NAMES, sizes, strict=False))


def _parse_size(text: str, spec: str) -> int:
    if not re.fullmatch(r"-?[0-9]+", text):
        raise InvalidMeshError(
            f"Mesh spec {spec!r} has axis size {text!r}, which is not an integer. {_SPEC_HELP}"
        )
    return int(text)


def _infer_sizes(named: Mapping[str, int], device_count: int) -> tuple[int, ...]:
    """Checks the sizes and fills in a `-1` from the device count."""
    for name, size in named.items():
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise InvalidMeshError(f"Mesh axis {name!r} needs an integer size. Received: {name}={size!r}.")
        if size < 1 and size != -1:
            raise InvalidMeshError(
                f"Mesh axis {name!r} has size {size}; sizes must be positive, or -1 "
                f"to use the remaining devices. Received: {dict(named)!r}."
            )
    inferred = [name for name, size in named.items() if size == -1]
    if len(inferred) > 1:
        raise InvalidMeshError(
            f"Only one mesh axis can have size -1, but {inferred} do. "
            f"Received: {dict(named)!r}. Give all but one axis an explicit size."
        )
    known = math.prod(size for size in named.values() if size != -1)
    if inferred:
        if device_count % known:
            raise InvalidMeshError(
                f"Cannot infer the size of mesh axis {inferred[0]!r}: the other axes use "
                f"{known} devices, which does not divide the {device_count} available. "
                f"Received: {dict(named)!r}. Choose sizes whose product divides {device_count}."
            )
        return tuple(device_count // known if size == -1 else int(size) for size in named.values())
    if known != device_count:
        raise InvalidMeshError(
            f"Mesh {dict(named)!r} needs {known} devices, but {device_count} are available. "
            f"The axis sizes must multiply to the device count ({device_count}); "
            "use -1 for one axis to infer it, or pass devices= explicitly."
        )
    return tuple(int(size) for size in named.values())


def jax_device_grid(mesh: Any) -> np.ndarray:
    """The grid of JAX devices (a Keras `DeviceMesh` may hold names such as `"cpu:0"`)."""
    backend = getattr(mesh, "backend_mesh", None)
    return np.asarray((backend if backend is not None else mesh).devices)


def device_id_grid(mesh: Any) -> np.ndarray:
    """The grid of device ids of any mesh (ours, Keras's, or JAX's), one per mesh position."""
    devices = jax_device_grid(mesh)
    return np.vectorize(lambda device: int(device.id), otypes=[int])(devices).reshape(devices.shape)


def platform_name(mesh: Any) -> str:
    """The mesh's platform, with the device kind when it says more (`"gpu (H100)"`)."""
    device = jax_device_grid(mesh).flat[0]
    platform = str(getattr(device, "platform", "")) or "unknown"
    kind = str(getattr(device, "device_kind", "") or "")
    return platform if not kind or kind.lower() == platform.lower() else f"{platform} ({kind})"


def mesh_text(names: Sequence[str], shape: Sequence[int]) -> str:
    """`"data=2 × model=4"`."""
    return " × ".join(f"{name}={size}" for name, size in zip(names, shape, strict=True))
