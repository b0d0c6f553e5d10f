"""Layouts as data: one entry per tensor dimension, the axes each entry names, and their JSON form.

An entry is a mesh-axis name, a tuple of distinct mesh-axis names (the dimension is split over
all of them, major to minor, as in JAX's `PartitionSpec`), or `None` to replicate. A rule's
layout may also hold one `...`, standing for as many `None`s as the variable's rank needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Axes", "axes_from_json", "axes_to_json", "entry_axes", "entry_size", "named_axes", "shards_of"]

#: One entry per tensor dimension (see the module docstring).
Axes = tuple[str | tuple[str, ...] | None, ...]


def entry_axes(entry: object) -> tuple[str, ...]:
    """The mesh-axis names one layout entry splits over: `None` → `()`, `'model'` → `('model',)`.

    Example:
        >>> from keras_meshlayout.core._axes import entry_axes
        >>> entry_axes(None), entry_axes("model"), entry_axes(("data", "model"))
        ((), ('model',), ('data', 'model'))
    """
    if entry is None or entry is Ellipsis:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)  # type: ignore[arg-type]


def entry_size(entry: object, axis_sizes: Mapping[str, int]) -> int:
    """How many pieces one layout entry splits its dimension into: the product of its axis sizes.

    Example:
        >>> from keras_meshlayout.core._axes import entry_size
        >>> entry_size(("data", "model"), {"data": 2, "model": 4}), entry_size(None, {})
        (8, 1)
    """
    return math.prod(axis_sizes[axis] for axis in entry_axes(entry))


def shards_of(axes: Sequence[object], axis_sizes: Mapping[str, int]) -> int:
    """How many pieces a layout splits a tensor into (1: replicated).

    Example:
        >>> from keras_meshlayout.core._axes import shards_of
        >>> shards_of((None, ("data", "model")), {"data": 2, "model": 4})
        8
    """
    return math.prod(entry_size(entry, axis_sizes) for entry in axes)


def named_axes(axes: Sequence[object]) -> list[str]:
    """Every mesh-axis name a layout uses, in order, tuples flattened.

    Example:
        >>> from keras_meshlayout.core._axes import named_axes
        >>> named_axes((None, ("data", "model"), ...))
        ['data', 'model']
    """
    return [axis for entry in axes for axis in entry_axes(entry)]


def axes_to_json(axes: Sequence[Any]) -> list[Any]:
    """A layout as JSON data: a multi-axis entry `('data', 'model')` becomes a list.

    Example:
        >>> from keras_meshlayout.core._axes import axes_to_json
        >>> axes_to_json((("data", "model"), None))
        [['data', 'model'], None]
    """
    return [list(entry) if isinstance(entry, tuple) else entry for entry in axes]


def axes_from_json(axes: Sequence[Any]) -> Axes:
    """The inverse of `axes_to_json`: lists back to tuples.

    Example:
        >>> from keras_meshlayout.core._axes import axes_from_json
        >>> axes_from_json([["data", "model"], None])
        (('data', 'model'), None)
    """
    return tuple(tuple(entry) if isinstance(entry, list) else entry for entry in axes)
