"""Named device meshes: parsing a spec, inferring sizes, laying out devices."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import keras
import numpy as np

from ._backend import require_jax_backend
from ._errors import InvalidMeshError

__all__ = ["Mesh"]

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
    expects one.

    Args:
        axes: Optional mapping of axis name to size, for names that are not
            valid Python identifiers or come from a dictionary.
        devices: Devices to arrange, as JAX devices. Defaults to
            `jax.devices()`, the devices of the default backend.
        **axis_sizes: Axis sizes by name, in order.

    Raises:
        InvalidMeshError: an axis size is not a positive integer, more than one
            is `-1`, an axis name is repeated or malformed, or the sizes do not
            multiply to the number of devices.

    Example:
        >>> import keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> mesh.axis_sizes
        {'data': 2, 'model': 4}
        >>> kml.Mesh(data=-1, model=2).shape
        (4, 2)
    """

    def __init__(
        self,
        axes: Mapping[str, int] | None = None,
        /,
        *,
        devices: Sequence[Any] | None = None,
        **axis_sizes: int,
    ) -> None:
        require_jax_backend()
        import jax
        from jax.experimental import mesh_utils

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
        devices = list(jax.devices() if devices is None else devices)
        shape = _infer_sizes(named, len(devices))
        grid = mesh_utils.create_device_mesh(shape, devices=devices, allow_split_physical_axes=True)
        super().__init__(shape=shape, axis_names=tuple(named), devices=grid)
        self._backend_mesh = jax.sharding.Mesh(self.devices, self.axis_names)

    @classmethod
    def parse(cls, spec: str, devices: Sequence[Any] | None = None) -> Mesh:
        """Builds a mesh from a spec string.

        Args:
            spec: `"2x4"` (positional: axes `data` and `model`), `"8"` (a 1-D
                `data` mesh), or `"data=2,model=4"` (named, any number of axes;
                one size may be `-1`).
            devices: As for `Mesh`.

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
        return cls(_parse_spec(spec), devices=devices)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Axis sizes by name, in mesh order."""
        return dict(zip(self.axis_names, self.shape, strict=True))

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

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={size}" for name, size in self.axis_sizes.items())
        return f"Mesh({inner})"

    __str__ = __repr__


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
