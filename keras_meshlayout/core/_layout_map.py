"""Keras `LayoutMap`s (keras-hub's `get_layout_map` among them) as checked `LayoutRules`.

A `keras.distribution.LayoutMap` finds a variable's layout in its own way: a
key equal to the path wins; otherwise every key is a regular expression, and
a path that several keys match is an error. Which regex match counts depends
on the Keras version: `re.search` (anywhere in the path) before Keras 3.14,
`re.fullmatch` since. `kml.LayoutRules` always use `re.fullmatch`, first
match wins. `rules_from_layout_map` rewrites a map's keys so that our rules
match exactly the paths the map does, and gives them to our resolution, where
a dimension that does not divide by its mesh axis is replicated with a
recorded reason or refused, rather than crash inside JAX.
"""

from __future__ import annotations

import inspect
import re
from typing import Literal

import keras

from ._errors import InvalidOptionError, InvalidRuleError
from ._matcher import is_output_pattern
from ._rules import LayoutRules

__all__ = ["rules_from_layout_map"]

Matching = Literal["search", "fullmatch"]


def rules_from_layout_map(
    layout_map: keras.distribution.LayoutMap, *, matching: Matching | None = None
) -> LayoutRules:
    """Turns a Keras `LayoutMap` into `LayoutRules` that match the same paths.

    Pass the result to `kml.ModelParallel(mesh, rules, on_indivisible=...)`:
    a layout that would crash in plain Keras (for instance keras-hub's Gemma
    map on a 2×4 mesh, which splits 2 key/value heads over a `model` axis of
    4, and fails in JAX with an `IndivisibleError` naming no variable) is then
    replicated on that dimension with the reason recorded in `dist.plan(model)`
    (`"replicate"`), or refused with an `IndivisibleShapeError` naming the
    variable, the axis and the sizes (`"error"`).

    Keys are matched as the map's own Keras would: keys that are plain paths
    come first (Keras prefers a key equal to the path), then the others in the
    map's order; each becomes a full-match pattern equivalent to the Keras
    match (`matching="search"` turns `key` into `.*(?:key).*`). Where Keras
    raises because a path matches several keys, the first rule wins here. The
    rules are not bound to the map's mesh: `kml.ModelParallel` binds them to
    its own, whose axis names must include those the map uses.

    Args:
        layout_map: A `keras.distribution.LayoutMap` (a `kml.LayoutRules` is
            returned unchanged).
        matching: How the map's keys match paths: `"search"` (Keras before
            3.14, and what keras-hub's maps were written for) or
            `"fullmatch"` (Keras 3.14 and later). Defaults to what the
            installed Keras does.

    Returns:
        The rules, one per key, each noting the key it came from.

    Raises:
        InvalidOptionError: `matching` is not `"search"`, `"fullmatch"` or `None`.
        InvalidRuleError: `layout_map` is not a `LayoutMap`, or a key is not a
            valid regular expression.

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> layout_map = keras.distribution.LayoutMap(mesh)
        >>> layout_map["dense.*kernel"] = (None, "model")
        >>> layout_map["head/kernel"] = ("model", None)
        >>> rules = kml.rules_from_layout_map(layout_map, matching="search")
        >>> [(rule.pattern, rule.axes) for rule in rules.rules]
        [('.*(?:head/kernel).*', ('model', None)), ('.*(?:dense.*kernel).*', (None, 'model'))]
        >>> rules.match("mlp/dense_1/kernel").note
        "from LayoutMap key 'dense.*kernel' (re.search)"
        >>> dist = kml.ModelParallel(mesh, rules, on_indivisible="replicate")
        >>> dist.resolve("mlp/dense_1/kernel", (512, 10), warn=False).reasons
        ("dimension 1 (size 10) does not divide by mesh axis 'model' (size 4)",)
    """
    if isinstance(layout_map, LayoutRules):
        return layout_map
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise InvalidRuleError(
            "rules_from_layout_map needs a keras.distribution.LayoutMap, e.g. "
            f"keras_hub.models.GemmaBackbone.get_layout_map(mesh). Received: {layout_map!r}."
        )
    if matching is None:
        matching = keras_matching()
    if matching not in ("search", "fullmatch"):
        raise InvalidOptionError(
            f"matching must be 'search', 'fullmatch' or None (as the installed Keras does). "
            f"Received: matching={matching!r}."
        )
    keys = list(layout_map)
    plain = [key for key in keys if re.escape(key) == key]
    ordered = plain + [key for key in keys if key not in plain]
    rules = []
    for key in ordered:
        try:
            re.compile(key)
        except re.error as err:
            raise InvalidRuleError(
                f"LayoutMap key {key!r} is not a valid regular expression: {err}. Fix the key; "
                "Keras would fail on it too."
            ) from None
        layout = layout_map[key]
        axes = tuple(layout.axes) if isinstance(layout, keras.distribution.TensorLayout) else tuple(layout)
        rules.append((_pattern(key, matching), axes, f"from LayoutMap key {key!r} (re.{matching})"))
    return LayoutRules(rules)


def keras_matching() -> Matching:
    """How the installed Keras matches `LayoutMap` keys: `"search"` or `"fullmatch"`."""
    try:
        source = inspect.getsource(keras.distribution.LayoutMap.__getitem__)
    except (OSError, TypeError):  # no source shipped: go by the version that changed it
        major, minor = (int(part) for part in keras.version().split(".")[:2])
        return "fullmatch" if (major, minor) >= (3, 14) else "search"
    return "search" if "re.search" in source else "fullmatch"


def _pattern(key: str, matching: Matching) -> str:
    """A full-match pattern for what `key` matches under `matching`.

    Output keys (ending in `output`, as `<layer path>/output` and `.*dense.*output`) keep it at
    the end, where `LayoutRules` looks for it.
    """
    if matching == "fullmatch":
        return key
    if is_output_pattern(key):
        return f".*(?:{key})"
    return f".*(?:{key}).*"
