"""Named device meshes: parsing a spec, inferring sizes, laying out devices.

Across processes the devices are placed by `_placement`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from ._backend import require_jax_backend
from ._errors import InvalidMeshError
from ._format import Displayed, to_text
from ._mesh_spec import AXIS_NAME, DEVICES_HINT, infer_sizes, named_axes, parse_spec
from ._placement import (
    across_axes,
    device_positions,
    hybrid_grid,
    process_layout,
    process_of,
    spanning_axes,
)
from ._target_mesh import AbstractDevice, abstract_grid, check_target_form, target_grid
from ._targets import Target, parse_target

__all__ = [
    "DEVICES_HINT",
    "AbstractDevice",
    "Mesh",
    "device_id_grid",
    "jax_device_grid",
    "mesh_axis_sizes",
    "platform_name",
]


class Mesh(Displayed, keras.distribution.DeviceMesh):
    """A grid of devices with named axes, laid out for the hardware topology.

    Axes keep the order in which they are given. Devices are arranged by JAX's
    mesh utilities (`jax.experimental.mesh_utils.create_device_mesh`), which on
    TPUs and GPUs put the last axes on the fastest links; on CPUs it keeps the
    device order. One axis size may be `-1`: it takes whatever the others leave.

    A `Mesh` is a `keras.distribution.DeviceMesh` and can be used wherever Keras
    expects one. JAX's forms are taken as they are: `kml.Mesh(jax_mesh)` for a
    `jax.sharding.Mesh` (or `jax.make_mesh(...)`), keeping its names and device
    order, and `kml.Mesh(devices, axis_names)` for an array of devices such as
    `mesh_utils.create_device_mesh` returns. It also takes Keras's call form, with Keras's meaning:
    `kml.Mesh(shape, axis_names, devices)` (positional or as keywords) puts
    the devices on the mesh in the order given, reshaped to `shape`, and keeps
    `axis_names` as given; `devices` may be JAX devices or names such as
    `"cpu:0"` (as `keras.distribution.list_devices()` returns), in an array of
    any shape.

    Devices you do not have: `target="tpu-v5e:16x16"` lays the mesh over that TPU
    machine's compile-only devices (libtpu, `pip install ".[tpu-aot]"`), to plan and
    compile for (`kml.compile_step`) with no array ever placed on them; a
    `jax.sharding.AbstractMesh` of any size plans with no devices at all.

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
            `axis_names`; or a `jax.sharding.Mesh`; or an array of JAX devices
            with `axis_names`.
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
        target: A TPU machine to plan and compile for, `"tpu-v5e:16x16"` or a
            `Target` (forms: `core._targets.TARGET_FORMS`), instead of `devices`.
            With several slices (`"tpu-v5e:16x16:slices=2"`) the first axis is laid
            over the slices.
        **axis_sizes: Axis sizes by name, in order.

    Raises:
        InvalidMeshError: an axis size is not a positive integer, more than one
            is `-1`, an axis name is repeated or malformed, the sizes do not
            multiply to the number of devices, `across_processes` names an axis
            the mesh lacks, or the processes cannot be laid over the
            `across_processes` axes.
        InvalidTargetError: `target` names no TPU machine, or the sizes do not
            multiply to its chips (one line, naming the valid forms).
        MissingLibtpuError: `target` is given and libtpu is not installed.

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
        >>> import jax
        >>> kml.Mesh(jax.make_mesh((2, 4), ("data", "model"))).axis_sizes  # JAX's own mesh
        {'data': 2, 'model': 4}
        >>> from jax.experimental import mesh_utils
        >>> kml.Mesh(mesh_utils.create_device_mesh((4, 2)), ("data", "model")).shape
        (4, 2)
        >>> kml.Mesh(jax.sharding.AbstractMesh((16, 16), ("data", "model"))).size  # no devices
        256
        >>> kml.Mesh(data=2, model=4, target="tpu-v5e:2x4").target.device_kind  # libtpu's devices
        'TPU v5 lite'
    """

    def __init__(
        self,
        shape: Mapping[str, int] | Sequence[int] | None = None,
        axis_names: Sequence[str] | None = None,
        devices: Any = None,
        *,
        across_processes: str | Sequence[str] | None = None,
        allow_split_across_processes: bool = False,
        target: str | Target | None = None,
        **axis_sizes: int,
    ) -> None:
        require_jax_backend()
        import jax
        from jax.experimental import mesh_utils

        self._target: Target | None = None
        if isinstance(shape, jax.sharding.AbstractMesh):
            others = {"axis_names": axis_names, "devices": devices, "target": target, **axis_sizes}
            self._init_abstract(shape, others)
            return
        shape, axis_names, devices = _from_jax(shape, axis_names, devices, axis_sizes)
        check_target_form(target, shape, axis_names, devices)
        if axis_names is not None or (shape is not None and not isinstance(shape, Mapping)):
            if axis_sizes:
                raise InvalidMeshError(
                    "Give the mesh either Keras's way, kml.Mesh(shape, axis_names), or ours, "
                    f"kml.Mesh(data=2, model=4), not both. Received: shape={shape!r}, "
                    f"axis_names={axis_names!r}, axis sizes {axis_sizes!r}."
                )
            self._init_keras(shape, axis_names, devices)
            return
        named = named_axes(shape, axis_sizes)
        if target is not None:
            self._init_target(named, parse_target(target))
            return
        devices = jax.devices() if devices is None else to_jax_devices(devices).ravel().tolist()
        shape = infer_sizes(named, len(devices))
        across = across_axes(across_processes, tuple(named))
        if len({process_of(d) for d in devices}) > 1:
            grid = hybrid_grid(
                dict(zip(named, shape, strict=True)), devices, across, allow_split_across_processes
            )
        else:
            grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        super().__init__(shape=shape, axis_names=tuple(named), devices=grid)
        self._backend_mesh = jax.sharding.Mesh(self.devices, self.axis_names)

    def _init_target(self, named: dict[str, int], target: Target) -> None:
        """The mesh over a TPU target's compile-only devices (`_target_mesh.target_grid`)."""
        import jax

        shape, grid = target_grid(named, target)
        self._target = target
        super().__init__(shape=shape, axis_names=tuple(named), devices=grid)
        self._backend_mesh = jax.sharding.Mesh(self.devices, self.axis_names)

    def _init_abstract(self, mesh: Any, others: Mapping[str, Any]) -> None:
        """A mesh of shape and names only (`jax.sharding.AbstractMesh`): planning, no devices."""
        names, shape, grid = abstract_grid(mesh, others)
        super().__init__(shape=shape, axis_names=names, devices=grid)
        self._backend_mesh = mesh

    @property
    def target(self) -> Target | None:
        """The TPU target the mesh is laid over (`target=`), else `None`."""
        return self._target

    @property
    def is_abstract(self) -> bool:
        """Whether the mesh has no devices (made from a `jax.sharding.AbstractMesh`)."""
        return isinstance(self.devices.flat[0], AbstractDevice)

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
            if not isinstance(name, str) or not AXIS_NAME.fullmatch(name):
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
        target: str | Target | None = None,
    ) -> Mesh:
        """Builds a mesh from a spec string.

        Args:
            spec: `"2x4"` (positional: axes `data` and `model`), `"8"` (a 1-D
                `data` mesh), or `"data=2,model=4"` (named, any number of axes;
                one size may be `-1`).
            devices: As for `Mesh`.
            across_processes: As for `Mesh`.
            allow_split_across_processes: As for `Mesh`.
            target: As for `Mesh`: a TPU machine, `"tpu-v5e:16x16"`.

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
            parse_spec(spec),
            devices=devices,
            across_processes=across_processes,
            allow_split_across_processes=allow_split_across_processes,
            target=target,
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
        return np.vectorize(process_of, otypes=[int])(self.devices)

    @property
    def process_count(self) -> int:
        """Number of processes whose devices are in the mesh."""
        return len(np.unique(self.process_ids))

    @property
    def axes_across_processes(self) -> tuple[str, ...]:
        """The axes along which the process changes; `()` in a single process."""
        return spanning_axes(self.process_ids, self.axis_names)

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={size}" for name, size in self.axis_sizes.items())
        return f"Mesh({inner})"

    def __rich__(self) -> Any:
        """The mesh as a grid of device ids, for `rich.print(mesh)` and a notebook cell."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        ids = self.device_ids
        names = tuple(self.axis_names)
        rows = ids.reshape(-1, ids.shape[-1]) if ids.ndim > 1 else ids.reshape(1, -1)
        table = Table(show_header=True, header_style="bold")
        table.add_column(" × ".join(names[:-1]) or "")
        for column in range(rows.shape[1]):
            table.add_column(f"{names[-1]}={column}", justify="center")
        positions = np.ndindex(*ids.shape[:-1]) if ids.ndim > 1 else iter([()])
        for position, row in zip(positions, rows, strict=True):
            label = ", ".join(f"{name}={index}" for name, index in zip(names, position, strict=False))
            table.add_row(label, *(str(device) for device in row))
        title = f"{self!r}: {self.size} {platform_name(self)} devices, {process_layout_line(self)}"
        return Group(Text(title, style="bold"), table, Text("Cells: device ids.", style="dim"))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(repr(self) if cycle else to_text(self.__rich__()))

    __str__ = __repr__


def _from_jax(shape: Any, axis_names: Any, devices: Any, axis_sizes: Mapping[str, int]) -> tuple:
    """`(shape, axis_names, devices)` for JAX's own forms: a `jax.sharding.Mesh`, or an array of devices.

    A `jax.sharding.Mesh` (from `jax.make_mesh` too) brings its names and devices, kept in its
    order; an array of JAX devices (as `mesh_utils.create_device_mesh` returns) its shape and
    order, with `axis_names` given beside it. Anything else is returned as it came.
    """
    import jax

    if isinstance(shape, jax.sharding.Mesh):
        if axis_names is not None or devices is not None or axis_sizes:
            raise InvalidMeshError(
                f"A jax.sharding.Mesh brings its own axis names and devices. Received: {shape!r} with "
                f"axis_names={axis_names!r}, devices={devices!r}, axis sizes {dict(axis_sizes)!r}. "
                "Fix: kml.Mesh(jax_mesh) alone."
            )
        return tuple(shape.devices.shape), tuple(shape.axis_names), shape.devices
    if isinstance(shape, np.ndarray) and shape.dtype == object:
        if axis_names is None:
            raise InvalidMeshError(
                f"An array of devices (shape {shape.shape}) needs one axis name per dimension. "
                'Fix: kml.Mesh(devices, ("data", "model")), or kml.Mesh(jax.make_mesh(...)).'
            )
        if devices is not None:
            raise InvalidMeshError("The devices are given twice: as the array and as devices=. Pass one.")
        return shape.shape, axis_names, shape
    return shape, axis_names, devices


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
    _refuse_repeats(out)
    return grid


def _refuse_repeats(devices: np.ndarray) -> None:
    """Raises `InvalidMeshError` when a device is given twice: a mesh holds each device once."""
    seen: dict[Any, int] = {}
    for position, device in enumerate(devices):
        key = (getattr(device, "process_index", 0), getattr(device, "platform", ""), device.id)
        if key in seen:
            raise InvalidMeshError(
                f"Device {device} is given twice, at positions {seen[key]} and {position} of the "
                f"{devices.size} devices: a mesh holds each device once. Fix: pass distinct devices, "
                "e.g. jax.devices()[:N], or kml.emulate_devices(N) for N CPU devices."
            )
        seen[key] = position


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


def process_layout_line(mesh: Any) -> str:
    """The first line of `process_layout`: `"1 process with 8 devices"`, or the split over processes."""
    return process_layout(mesh)[0]


def jax_device_grid(mesh: Any) -> np.ndarray:
    """The grid of JAX devices (a Keras `DeviceMesh` may hold names such as `"cpu:0"`)."""
    if getattr(mesh, "backend_mesh", None) is None:
        return np.asarray(mesh.devices)
    return np.asarray(device_positions(mesh))


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
