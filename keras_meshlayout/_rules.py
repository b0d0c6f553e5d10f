"""Ordered layout rules: regex patterns over variable paths, first match wins."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import keras

from ._errors import InvalidRuleError

__all__ = ["LayoutRules", "Rule", "Axes"]

#: One entry per tensor dimension: a mesh-axis name, or `None` to replicate. A rule
#: may also hold one `...`, standing for as many `None`s as the variable's rank needs.
Axes = tuple[str | None, ...]

#: Keras asks for the layout of a layer's output under `<layer path>/output`.
OUTPUT_SUFFIX = "/output"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One layout rule.

    Attributes:
        index: Position of the rule in its `LayoutRules`, from 0.
        pattern: The regular expression, matched with `re.fullmatch`.
        axes: One mesh-axis name or `None` per tensor dimension; may hold one
            `...` for "as many `None`s as needed".
        note: Why the rule exists (presets and the planner explain themselves
            here); shown in the plan.
        optional: Whether matching nothing is expected (preset rules cover
            layers a model may not have), so no `UnmatchedRuleWarning`.
    """

    index: int
    pattern: str
    axes: Axes
    regex: re.Pattern = dataclasses.field(repr=False, compare=False)
    note: str = ""
    optional: bool = False

    def expand(self, rank: int) -> Axes | None:
        """The layout for a variable of `rank`, or `None` if the rule cannot fit it.

        Example:
            >>> import keras_meshlayout as kml
            >>> rule = kml.LayoutRules([(r".*conv.*/kernel", (..., "model"))]).rules[0]
            >>> rule.expand(4), rule.expand(3), rule.expand(0)
            ((None, None, None, 'model'), (None, None, 'model'), None)
        """
        if Ellipsis not in self.axes:
            return self.axes if len(self.axes) == rank else None
        fill = rank - (len(self.axes) - 1)
        if fill < 0:
            return None
        at = self.axes.index(Ellipsis)
        return self.axes[:at] + (None,) * fill + self.axes[at + 1 :]

    @property
    def for_outputs(self) -> bool:
        """Whether the rule lays out layer outputs (its pattern ends in `/output`)."""
        return self.pattern.endswith(OUTPUT_SUFFIX)

    def describe(self) -> str:
        return f"rule #{self.index} {self.pattern!r} -> {self.axes!r}"


class LayoutRules(keras.distribution.LayoutMap):
    """An ordered list of `(pattern, axes)` rules mapping variable paths to layouts.

    Each pattern is matched with `re.fullmatch` against `variable.path` (e.g.
    `"sequential/dense_1/kernel"`); the first rule that matches wins, whatever
    the Keras version. Each layout has one entry per tensor dimension: the name
    of the mesh axis that dimension is split over, or `None` to keep it whole.
    Variables that no rule matches are replicated.

    Rules whose pattern ends in `/output` lay out layer outputs (Keras asks for
    `<layer path>/output`); all other rules lay out variables.

    `LayoutRules` is a `keras.distribution.LayoutMap`. Bound to a mesh (pass
    `mesh=` or call `bind`) it also works with Keras's own `ModelParallel`;
    `kml.ModelParallel` binds it for you and adds shape checks.

    Args:
        rules: `(pattern, axes)` pairs in priority order, or a mapping of
            pattern to axes (kept in its order).
        mesh: Optional mesh to validate against and to build layouts on.
        optional: Mark every rule as optional: matching no variable is
            expected and draws no `UnmatchedRuleWarning` (presets use this).

    Raises:
        InvalidRuleError: a pattern is not a valid regular expression or is
            repeated, a layout entry is not a string or `None`, a mesh axis
            appears twice in one layout, or (with `mesh`) an axis is unknown.

    Example:
        >>> import keras_meshlayout as kml
        >>> rules = kml.LayoutRules([
        ...     (r".*dense_1/kernel", (None, "model")),
        ...     (r".*dense_1/.*", ("model",)),
        ... ])
        >>> rules.match("mlp/dense_1/kernel").index
        0
        >>> rules.match("mlp/dense_1/bias").axes
        ('model',)
        >>> rules.match("mlp/dense_2/kernel") is None
        True
    """

    #: What `kml.auto_rules(..., batch=...)` predicts a training step of these rules
    #: costs (a `kml.PlanCost`); `None` for rules written by hand.
    cost = None

    def __init__(
        self,
        rules: Iterable[tuple[str, Sequence[str | None]]] | Mapping[str, Sequence[str | None]] = (),
        *,
        mesh: keras.distribution.DeviceMesh | None = None,
        optional: bool = False,
    ) -> None:
        if mesh is not None and not isinstance(mesh, keras.distribution.DeviceMesh):
            raise InvalidRuleError(
                f"mesh= must be a kml.Mesh or keras.distribution.DeviceMesh. Received: mesh={mesh!r}. "
                'For a spec string, use mesh=kml.Mesh.parse("2x4").'
            )
        if isinstance(rules, (str, bytes)) or not isinstance(rules, (Iterable, Mapping)):
            raise InvalidRuleError(
                "Layout rules must be a list of (pattern, axes) pairs or a mapping of pattern to "
                f"axes. Received: {rules!r}."
            )
        super().__init__(mesh)
        self._optional = optional
        self._rules: list[Rule] = []
        self._layouts: dict[int, keras.distribution.TensorLayout] = {}
        items = rules.items() if isinstance(rules, Mapping) else rules
        for entry in items:
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise InvalidRuleError(
                    f"Each layout rule must be a (pattern, axes) pair, e.g. "
                    f"(r'.*dense_1/kernel', (None, 'model')), optionally with a note as a "
                    f"third item. Received: {entry!r}."
                )
            self._append(*entry)
        if mesh is not None:
            self.validate(mesh)

    # -- the rules ------------------------------------------------------------

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules, in priority order."""
        return tuple(self._rules)

    def match(self, path: str) -> Rule | None:
        """Returns the first rule whose pattern fully matches `path`, or `None`.

        Paths ending in `/output` (layer outputs) only match output rules; all
        other paths only match variable rules.
        """
        for_outputs = path.endswith(OUTPUT_SUFFIX)
        for rule in self._rules:
            if rule.for_outputs == for_outputs and rule.regex.fullmatch(path):
                return rule
        return None

    def unmatched(self, paths: Iterable[str]) -> list[Rule]:
        """The variable rules that match none of `paths`: likely typos."""
        hit = {rule.index for rule in map(self.match, paths) if rule is not None}
        return [r for r in self._rules if not r.for_outputs and not r.optional and r.index not in hit]

    def validate(self, mesh: keras.distribution.DeviceMesh) -> None:
        """Checks every rule against `mesh`.

        Raises:
            InvalidRuleError: a rule names an axis that `mesh` does not have.
        """
        for rule in self._rules:
            _check_axes_in_mesh(rule, mesh)

    def bind(self, mesh: keras.distribution.DeviceMesh) -> LayoutRules:
        """Returns these rules validated and bound to `mesh`.

        Returns `self` when already bound to `mesh`.

        Raises:
            InvalidRuleError: a rule does not fit the mesh, or these rules are
                already bound to a different mesh.
        """
        if self._device_mesh is mesh or (
            self._device_mesh is not None and same_mesh(self._device_mesh, mesh)
        ):
            return self
        if self._device_mesh is not None:
            raise InvalidRuleError(
                f"These layout rules are bound to {self._device_mesh!r} and cannot be used "
                f"with {mesh!r}. Fix: build the rules without mesh= and let "
                "kml.ModelParallel bind them, or call bind() on an unbound copy."
            )
        bound = LayoutRules([(r.pattern, r.axes, r.note) for r in self._rules], mesh=mesh)
        bound._rules = [
            dataclasses.replace(b, optional=r.optional)
            for b, r in zip(bound._rules, self._rules, strict=True)
        ]
        return bound

    @property
    def mesh(self) -> keras.distribution.DeviceMesh | None:
        """The mesh these rules are bound to, or `None`."""
        return self._device_mesh

    # -- keras.distribution.LayoutMap ---------------------------------------

    @property
    def device_mesh(self) -> keras.distribution.DeviceMesh:
        """The bound mesh, as Keras's `ModelParallel` reads it.

        Raises:
            InvalidRuleError: the rules are not bound to a mesh.
        """
        if self._device_mesh is None:
            raise InvalidRuleError(
                "These layout rules are not bound to a mesh, so Keras cannot build layouts "
                "from them. Fix: pass them to kml.ModelParallel(mesh, rules), or bind them "
                "first: keras.distribution.ModelParallel(layout_map=rules.bind(mesh)) or "
                "kml.LayoutRules([...], mesh=mesh)."
            )
        return self._device_mesh

    def __getitem__(self, key: str) -> keras.distribution.TensorLayout | None:
        """The layout of the first rule matching `key`, or `None`."""
        rule = self.match(key)
        if rule is None:
            return None
        if Ellipsis in rule.axes:
            raise InvalidRuleError(
                f"Layout {rule.describe()} matches {key!r} but uses '...', which needs the "
                "variable's rank; Keras's own ModelParallel asks by path alone. Fix: use "
                "kml.ModelParallel, or spell out one entry per dimension."
            )
        if self._device_mesh is None:
            return keras.distribution.TensorLayout(rule.axes)
        if rule.index not in self._layouts:
            self._layouts[rule.index] = keras.distribution.TensorLayout(rule.axes, self._device_mesh)
        return self._layouts[rule.index]

    def __setitem__(self, pattern: str, axes: Sequence[str | None]) -> None:
        """Appends a rule; it has the lowest priority so far."""
        self._append(pattern, axes)

    def _append(self, pattern: str, axes: Sequence[str | None], note: str = "") -> None:
        rule = dataclasses.replace(
            _make_rule(len(self._rules), pattern, axes, self._rules, note), optional=self._optional
        )
        if self._device_mesh is not None:
            _check_axes_in_mesh(rule, self._device_mesh)
        self._rules.append(rule)

    def __delitem__(self, pattern: str) -> None:
        kept = [r for r in self._rules if r.pattern != pattern]
        if len(kept) == len(self._rules):
            raise KeyError(pattern)
        self._rules = [dataclasses.replace(r, index=i) for i, r in enumerate(kept)]
        self._layouts.clear()

    def __iter__(self) -> Iterator[str]:
        return (rule.pattern for rule in self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __repr__(self) -> str:
        inner = ", ".join(f"({r.pattern!r}, {r.axes!r})" for r in self._rules)
        return f"LayoutRules([{inner}])"

    __str__ = __repr__


def same_mesh(a: keras.distribution.DeviceMesh, b: keras.distribution.DeviceMesh) -> bool:
    """Whether two meshes have the same axes, sizes and device placement."""
    if tuple(a.axis_names) != tuple(b.axis_names) or tuple(a.shape) != tuple(b.shape):
        return False
    return [str(d) for d in a.devices.flat] == [str(d) for d in b.devices.flat]


def _check_axes_in_mesh(rule: Rule, mesh: keras.distribution.DeviceMesh) -> None:
    known = tuple(mesh.axis_names)
    unknown = [axis for axis in rule.axes if isinstance(axis, str) and axis not in known]
    if unknown:
        raise InvalidRuleError(
            f"Layout {rule.describe()} names mesh axis {unknown[0]!r}, but the mesh "
            f"has axes {known} (shape {tuple(mesh.shape)}). Fix: use one of "
            f"{known} or None for each dimension, or add the axis to the mesh."
        )


def _make_rule(index: int, pattern: str, axes: object, earlier: Sequence[Rule], note: str = "") -> Rule:
    """Validates one `(pattern, axes)` pair on its own, with no mesh at hand."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRuleError(
            f"Layout rule #{index} needs a non-empty regex string as its pattern. "
            f"Received: pattern={pattern!r}."
        )
    try:
        regex = re.compile(pattern)
    except re.error as err:
        raise InvalidRuleError(
            f"Layout rule #{index} pattern {pattern!r} is not a valid regular expression: "
            f"{err}. Fix the pattern; to match a literal character such as '[' or '(', "
            "escape it with a backslash."
        ) from None
    for rule in earlier:
        if rule.pattern == pattern:
            raise InvalidRuleError(
                f"Layout rule #{index} repeats the pattern {pattern!r} of rule #{rule.index}; "
                "since the first match wins it could never apply. Remove one of them."
            )
    if isinstance(axes, keras.distribution.TensorLayout):
        axes = axes.axes
    if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} needs a tuple of axes, one mesh-axis name or "
            f"None per tensor dimension, e.g. (None, 'model'). Received: axes={axes!r}."
        )
    axes = tuple(axes)
    for axis in axes:
        if axis is not None and axis is not Ellipsis and not isinstance(axis, str):
            raise InvalidRuleError(
                f"Layout rule #{index} {pattern!r} has entry {axis!r} in axes {axes!r}; each "
                "entry must be a mesh-axis name (a string), None, or a single '...'."
            )
    if axes.count(Ellipsis) > 1:
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} has more than one '...' in axes {axes!r}; "
            "'...' stands for the leftover dimensions and can appear once."
        )
    if not isinstance(note, str):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r}: the note must be a string. Received: {note!r}."
        )
    named = [axis for axis in axes if isinstance(axis, str)]
    for axis in named:
        if named.count(axis) > 1:
            raise InvalidRuleError(
                f"Layout rule #{index} {pattern!r} uses mesh axis {axis!r} on more than one "
                f"dimension in axes {axes!r}. A mesh axis can split only one dimension of a "
                f"tensor. Fix: keep {axis!r} on one dimension and put None on the others."
            )
    return Rule(index=index, pattern=pattern, axes=axes, regex=regex, note=note)
