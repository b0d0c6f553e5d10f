"""Mesh specs: `"2x4"` and `"data=2,model=4"` parsed, axis sizes checked, a `-1` inferred."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from ._errors import InvalidMeshError

__all__ = [
    "AXIS_NAME",
    "DEVICES_HINT",
    "POSITIONAL_AXIS_NAMES",
    "SPEC_HELP",
    "infer_sizes",
    "named_axes",
    "parse_spec",
]

#: Axis names given to positional specs such as ``"2x4"``.
POSITIONAL_AXIS_NAMES = ("data", "model")

#: How the device-count message says to give other devices; the command line says it its way.
DEVICES_HINT = "pass devices= explicitly"

AXIS_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SPEC_HELP = (
    'Write it as "2x4" (axes data, model), "8" (data only) or '
    '"data=2,model=4" (named; one size may be -1 to use the remaining devices).'
)


def parse_spec(spec: str) -> dict[str, int]:
    """Turns a mesh spec string into ordered `{axis: size}`."""
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidMeshError(f"Mesh spec must be a non-empty string. Received: {spec!r}. {SPEC_HELP}")
    text = spec.replace(" ", "")
    if "=" in text:
        named: dict[str, int] = {}
        for part in text.split(","):
            name, sep, size = part.partition("=")
            if not sep or not name:
                raise InvalidMeshError(f"Mesh spec {spec!r} has a malformed entry {part!r}. {SPEC_HELP}")
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
            f"Mesh spec {spec!r} has axis size {text!r}, which is not an integer. {SPEC_HELP}"
        )
    return int(text)


def infer_sizes(named: Mapping[str, int], device_count: int) -> tuple[int, ...]:
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
            f"use -1 for one axis to infer it, or {DEVICES_HINT}."
        )
    return tuple(int(size) for size in named.values())


def named_axes(axes: Any, axis_sizes: Mapping[str, int]) -> dict[str, int]:
    """Our form's axes, from a mapping or keywords, with their names checked."""
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
        if not isinstance(name, str) or not AXIS_NAME.fullmatch(name):
            raise InvalidMeshError(
                f"Mesh axis names must be identifiers such as 'data' or 'model'. "
                f"Received: {name!r} in axes {named!r}."
            )
    return named
