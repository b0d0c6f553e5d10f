"""Ordered layout rules: regex patterns over variable paths, first match wins.

Matching runs in time linear in the variables: a rule whose pattern can match
only a few fixed paths (plain text, escaped characters, `(?:prefix/)?` groups
and `(?:a|b)` alternatives of plain text, as the planner writes) is found by a
dictionary lookup, and only the regex rules before it are tried in order.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence

import keras

from .. import _compat
from ._errors import InvalidOptionError, InvalidRuleError
from ._policy import LayoutPolicy

__all__ = ["LayoutRules", "Rule", "Axes", "entry_axes", "entry_size", "shards_of"]

#: One entry per tensor dimension: a mesh-axis name, a tuple of distinct mesh-axis names
#: (the dimension is split over all of them, major to minor, as in JAX's `PartitionSpec`),
#: or `None` to replicate. A rule may also hold one `...`, standing for as many `None`s as
#: the variable's rank needs.
Axes = tuple[str | tuple[str, ...] | None, ...]


def entry_axes(entry: object) -> tuple[str, ...]:
    """The mesh-axis names one layout entry splits over: `None` → `()`, `'model'` → `('model',)`.

    Example:
        >>> from keras_meshlayout.core._rules import entry_axes
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
        >>> from keras_meshlayout.core._rules import entry_size
        >>> entry_size(("data", "model"), {"data": 2, "model": 4}), entry_size(None, {})
        (8, 1)
    """
    return math.prod(axis_sizes[axis] for axis in entry_axes(entry))


def shards_of(axes: Sequence[object], axis_sizes: Mapping[str, int]) -> int:
    """How many pieces a layout splits a tensor into (1: replicated)."""
    return math.prod(entry_size(entry, axis_sizes) for entry in axes)


def named_axes(axes: Sequence[object]) -> list[str]:
    """Every mesh-axis name a layout uses, in order, tuples flattened."""
    return [axis for entry in axes for axis in entry_axes(entry)]


#: Keras asks for the layout of a layer's output under `<layer path>/output`.
OUTPUT_SUFFIX = "/output"

#: Above this many fixed strings a pattern is matched as a regex.
_MAX_LITERALS = 64
_META = set(".^$*+?{}[]|()\\")


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
        suggested: Whether the rule was chosen for the user (by a preset or
            the planner) rather than written by them. `replicate_below` keeps
            the small weight matrices of suggested rules whole; a rule the user
            wrote is honoured whatever the size, with a note in the plan.
    """

    index: int
    pattern: str
    axes: Axes
    regex: re.Pattern = dataclasses.field(repr=False, compare=False)
    note: str = ""
    optional: bool = False
    suggested: bool = False
    #: The only paths the pattern can match, when it is not a real regex (else `None`).
    literals: frozenset[str] | None = dataclasses.field(default=None, repr=False, compare=False)

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


class _Index:
    """Lookup tables over a list of rules, built once per change."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.exact: dict[str, Rule] = {}
        self.literal: dict[str, Rule] = {}
        self.regex: dict[bool, list[Rule]] = {False: [], True: []}
        for rule in rules:
            self.exact.setdefault(rule.pattern, rule)
            if rule.literals is None:
                self.regex[rule.for_outputs].append(rule)
                continue
            for text in rule.literals:
                self.literal.setdefault(text, rule)
        self.chunks = {kind: _chunks(regex) for kind, regex in self.regex.items()}

    def match(self, path: str) -> Rule | None:
        rule = self.exact.get(path)
        if rule is not None:
            return rule  # a key equal to the path wins, as in a Keras LayoutMap
        best = self.literal.get(path)
        limit = math.inf if best is None else best.index
        for combined, by_group, part in self.chunks[path.endswith(OUTPUT_SUFFIX)]:
            if part[0].index >= limit:
                break
            if combined is None:
                for rule in part:
                    if rule.index >= limit:
                        break
                    if rule.regex.fullmatch(path):
                        return rule
                continue
            found = combined.fullmatch(path)
            if found is not None:
                rule = by_group[found.lastindex]
                return rule if rule.index < limit else best
        return best


#: Regex rules are tried this many at a time, as one alternation.
_CHUNK = 64
#: Constructs whose meaning depends on group numbers, which an alternation shifts.
_NUMBERED = re.compile(r"\\[1-9]|\(\?P=|\(\?\(")


def _chunks(rules: Sequence[Rule]) -> list[tuple[re.Pattern | None, dict[int, Rule], Sequence[Rule]]]:
    """Regex rules in order, in alternations of up to `_CHUNK`: `(a)|(b)|...`.

    A full match of an alternation takes the first alternative that can match
    the whole path, so it finds the first matching rule in one call. The outer
    group of each alternative closes last, so `lastindex` names the rule.
    Rules an alternation could change (back-references, inline flags) are
    tried one by one.
    """
    chunks = []
    for start in range(0, len(rules), _CHUNK):
        part = rules[start : start + _CHUNK]
        combined, by_group = None, {}
        if not any(_NUMBERED.search(rule.pattern) for rule in part):
            try:
                combined = re.compile("|".join(f"({rule.pattern})" for rule in part))
            except (re.error, OverflowError, RecursionError):
                combined = None
            group = 1
            for rule in part:
                by_group[group] = rule
                group += 1 + rule.regex.groups
        chunks.append((combined, by_group, part))
    return chunks


class _Store:
    """The rules themselves, shared by a `LayoutRules` and every view bound from it."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []
        #: The `TensorLayout` given for each pattern, if one was: reading it back returns it.
        self.given: dict[str, keras.distribution.TensorLayout] = {}
        self.meshes: list[keras.distribution.DeviceMesh] = []
        self.version = 0
        self._index: _Index | None = None

    def changed(self) -> None:
        self.version += 1
        self._index = None

    @property
    def index(self) -> _Index:
        if self._index is None:
            self._index = _Index(self.rules)
        return self._index


class LayoutRules(keras.distribution.LayoutMap):
    """An ordered list of `(pattern, axes)` rules mapping variable paths to layouts.

    Each pattern is matched with `re.fullmatch` against `variable.path` (e.g.
    `"sequential/dense_1/kernel"`); the first rule that matches wins, whatever
    the Keras version, except that a pattern equal to the path itself (an
    exact key, as Keras's `LayoutMap` calls it) wins wherever it stands. Each
    layout has one entry per tensor dimension: the name of the mesh axis that
    dimension is split over, a tuple of distinct axis names to split it over
    all of them (`("data", "model")`: 8 pieces on a 2×4 mesh, as JAX's
    `PartitionSpec` writes it), or `None` to keep it whole. Variables that no
    rule matches are replicated.

    Rules whose pattern ends in `/output` lay out layer outputs (Keras asks for
    `<layer path>/output`); all other rules lay out variables. Keras asks for
    an output's layout before it knows the output's rank, so an output rule
    can hold `...` only as its last entry (the dimensions it covers are
    replicated).

    `LayoutRules` is a `keras.distribution.LayoutMap` and takes Keras's call
    forms too: `kml.LayoutRules(device_mesh)`, then `rules[pattern] = axes`
    (a tuple or a `TensorLayout`; reading the pattern back returns the very
    `TensorLayout` stored). Bound to a mesh (pass it, or call `bind`) it also
    works with Keras's own `ModelParallel`; `kml.ModelParallel` binds it for
    you, without copying: rules added later take effect.

    Resolution takes time linear in the number of variables: patterns that
    match only fixed paths (plain text, escaped characters, `(?:prefix/)?`
    groups) are looked up in a dictionary.

    Args:
        rules: `(pattern, axes)` pairs in priority order (optionally with a
            note as a third item), or a mapping of pattern to axes (kept in
            its order). Axes may be a `keras.distribution.TensorLayout`. A
            `DeviceMesh` here is taken as `mesh`, as `LayoutMap(device_mesh)`.
        mesh: Optional mesh to validate against and to build layouts on.
        optional: Mark these rules as optional: matching no variable is
            expected and draws no `UnmatchedRuleWarning` (presets use this).
        suggested: Mark these rules as chosen for the user (presets and the
            planner use this): `replicate_below` keeps their small weight
            matrices whole. Rules added later with `rules[pattern] = axes` are
            the user's own: neither optional nor suggested.
        device_mesh: Keras's name for `mesh`.
        policy: The `kml.LayoutPolicy` these rules were made for (`on_indivisible`,
            `replicate_below`), kept as `rules.policy`: `kml.ModelParallel` given
            these rules applies it unless given a policy itself. `kml.auto_rules`
            sets it. `None`: no policy of their own.

    Raises:
        InvalidOptionError: `policy` is not a `kml.LayoutPolicy`.
        InvalidRuleError: a pattern is not a valid regular expression or is
            repeated, a layout entry is not a string, a tuple of strings or
            `None`, a mesh axis appears twice in one layout, an output rule holds `...` before its
            end, a `TensorLayout` carries another mesh, or (with `mesh`) an
            axis is unknown.

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
        >>> rules["mlp/dense_1/bias"] = (None,)  # an exact key wins, as in Keras
        >>> rules.match("mlp/dense_1/bias").index
        2
    """

    #: What `kml.auto_rules(..., batch=...)` predicts a training step of these rules
    #: costs (a `kml.PlanCost`); `None` for rules written by hand.
    cost = None

    #: The `kml.LayoutPolicy` these rules carry (see `policy` above), or `None`.
    policy: LayoutPolicy | None = None

    def __init__(
        self,
        rules: Iterable[tuple[str, Sequence[str | None]]]
        | Mapping[str, Sequence[str | None]]
        | keras.distribution.DeviceMesh = (),
        *,
        mesh: keras.distribution.DeviceMesh | None = None,
        optional: bool = False,
        suggested: bool = False,
        device_mesh: keras.distribution.DeviceMesh | None = None,
        policy: LayoutPolicy | None = None,
    ) -> None:
        if policy is not None and not isinstance(policy, LayoutPolicy):
            raise InvalidOptionError(
                f"LayoutRules: policy must be a kml.LayoutPolicy. Received: policy={policy!r}. "
                "Fix: policy=kml.LayoutPolicy(replicate_below=...), or leave it out."
            )
        if isinstance(rules, keras.distribution.DeviceMesh):  # Keras: LayoutMap(device_mesh)
            if mesh is not None or device_mesh is not None:
                raise InvalidRuleError(
                    f"The mesh is given twice: as the first argument ({rules!r}) and as a keyword. "
                    "Fix: kml.LayoutRules(mesh) or kml.LayoutRules(rules, mesh=mesh)."
                )
            rules, mesh = (), rules
        if device_mesh is not None:
            if mesh is not None and mesh is not device_mesh:
                raise InvalidRuleError(
                    f"mesh={mesh!r} and device_mesh={device_mesh!r} disagree; they are two names "
                    "for the same argument. Fix: pass one of them."
                )
            mesh = device_mesh
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
        self.policy = policy
        self._store = _Store()
        self._made: dict[str, keras.distribution.TensorLayout] = {}
        self._made_version = -1
        if mesh is not None:
            self._store.meshes.append(mesh)
        items = rules.items() if isinstance(rules, Mapping) else rules
        for entry in items:
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise InvalidRuleError(
                    f"Each layout rule must be a (pattern, axes) pair, e.g. "
                    f"(r'.*dense_1/kernel', (None, 'model')), optionally with a note as a "
                    f"third item. Received: {entry!r}."
                )
            self._append(*entry, optional=optional, suggested=suggested)

    # -- the rules ------------------------------------------------------------

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules, in priority order."""
        return tuple(self._store.rules)

    def match(self, path: str) -> Rule | None:
        """Returns the rule that lays out `path`, or `None`.

        A rule whose pattern equals `path` (an exact key) wins; otherwise the
        first rule whose pattern fully matches `path`. Paths ending in
        `/output` (layer outputs) only match output rules; all other paths
        only match variable rules.
        """
        return self._store.index.match(path)

    def unmatched(self, paths: Iterable[str]) -> list[Rule]:
        """The variable rules that match none of `paths`: likely typos."""
        index = self._store.index
        hit = {rule.index for rule in map(index.match, paths) if rule is not None}
        return [r for r in self._store.rules if not r.for_outputs and not r.optional and r.index not in hit]

    def validate(self, mesh: keras.distribution.DeviceMesh) -> None:
        """Checks every rule against `mesh`.

        Raises:
            InvalidRuleError: a rule names an axis that `mesh` does not have,
                or holds a `TensorLayout` on another mesh.
        """
        for rule in self._store.rules:
            _check_axes_in_mesh(rule, mesh)
            _check_given_mesh(rule, self._store.given.get(rule.pattern), mesh)

    def bind(self, mesh: keras.distribution.DeviceMesh) -> LayoutRules:
        """Returns these rules bound to `mesh`, sharing them (not a copy).

        Returns `self` when already bound to `mesh`. Otherwise returns a view
        bound to `mesh` that shares the rules with `self`: a rule added to
        either, later, takes effect in both.

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
        self.validate(mesh)
        view = LayoutRules(mesh=mesh)
        view._store = self._store
        view.cost = self.cost
        view.policy = self.policy
        if not any(m is mesh for m in self._store.meshes):
            self._store.meshes.append(mesh)
        return view

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
        """The layout of the rule that lays out `key` (see `match`), or `None`.

        A `TensorLayout` stored for that rule is returned itself.
        """
        rule = self.match(key)
        if rule is None:
            return None
        if Ellipsis in rule.axes and not (rule.for_outputs and rule.axes[-1] is Ellipsis):
            raise InvalidRuleError(
                f"Layout {rule.describe()} matches {key!r} but uses '...', which needs the "
                "variable's rank, and Keras's own keras.distribution.ModelParallel asks by path "
                "alone. Fix: use kml.ModelParallel, which resolves '...' from each variable's "
                "shape, or spell out one entry per dimension."
            )
        return self._layout_of(rule)

    def _layout_of(self, rule: Rule) -> keras.distribution.TensorLayout:
        given = self._store.given.get(rule.pattern)
        mesh = self._device_mesh
        if given is not None and given.device_mesh is mesh:
            return given
        if self._made_version != self._store.version:
            self._made, self._made_version = {}, self._store.version
        layout = self._made.get(rule.pattern)
        if layout is None:
            if mesh is not None:
                _check_axes_in_mesh(rule, mesh)
            axes = tuple(axis for axis in rule.axes if axis is not Ellipsis)
            layout = self._made[rule.pattern] = _compat.tensor_layout(axes, mesh)
        return layout

    def __setitem__(self, pattern: str, axes: Sequence[str | None] | keras.distribution.TensorLayout) -> None:
        """Appends a rule of the user's own; it has the lowest priority so far."""
        self._append(pattern, axes)

    def _append(
        self,
        pattern: str,
        axes: Sequence[str | None] | keras.distribution.TensorLayout,
        note: str = "",
        *,
        optional: bool = False,
        suggested: bool = False,
    ) -> None:
        store = self._store
        rule = _make_rule(len(store.rules), pattern, axes, store.rules, note)
        rule = dataclasses.replace(rule, optional=optional, suggested=suggested)
        given = axes if isinstance(axes, keras.distribution.TensorLayout) else None
        for mesh in store.meshes:
            _check_axes_in_mesh(rule, mesh)
            _check_given_mesh(rule, given, mesh)
        if given is not None and given.device_mesh is None and self._device_mesh is not None:
            _compat.give_layout_mesh(given, self._device_mesh)  # as Keras's LayoutMap does
        store.rules.append(rule)
        if given is not None:
            store.given[rule.pattern] = given
        store.changed()

    def __delitem__(self, pattern: str) -> None:
        store = self._store
        kept = [r for r in store.rules if r.pattern != pattern]
        if len(kept) == len(store.rules):
            raise KeyError(pattern)
        store.rules[:] = [dataclasses.replace(r, index=i) for i, r in enumerate(kept)]
        store.given.pop(pattern, None)
        store.changed()

    def __contains__(self, pattern: object) -> bool:
        """Whether `pattern` is one of the rules' patterns (not whether it matches one)."""
        return isinstance(pattern, str) and pattern in self._store.index.exact

    def __iter__(self) -> Iterator[str]:
        return (rule.pattern for rule in list(self._store.rules))

    def __len__(self) -> int:
        return len(self._store.rules)

    def __repr__(self) -> str:
        inner = ", ".join(f"({r.pattern!r}, {r.axes!r})" for r in self._store.rules)
        return f"LayoutRules([{inner}])"

    __str__ = __repr__


def same_mesh(a: keras.distribution.DeviceMesh, b: keras.distribution.DeviceMesh) -> bool:
    """Whether two meshes have the same axes, sizes and device placement."""
    if tuple(a.axis_names) != tuple(b.axis_names) or tuple(a.shape) != tuple(b.shape):
        return False
    return [str(d) for d in a.devices.flat] == [str(d) for d in b.devices.flat]


def literal_strings(pattern: str) -> frozenset[str] | None:
    """The only strings `pattern` can fully match, or `None` for a real regex.

    Understands plain text, backslash-escaped punctuation (as `re.escape`
    writes it), and non-capturing groups of plain alternatives, optionally
    optional: `(?:a|b)`, `(?:prefix/)?`.

    Example:
        >>> from keras_meshlayout.core._rules import literal_strings
        >>> sorted(literal_strings(r"(?:mlp/)?fc1/kernel"))
        ['fc1/kernel', 'mlp/fc1/kernel']
        >>> literal_strings(r".*fc1/kernel") is None
        True
    """
    options = [""]
    i, n = 0, len(pattern)
    while i < n:
        if pattern.startswith("(?:", i):
            end, alternatives = _literal_group(pattern, i + 3)
            if alternatives is None:
                return None
            i = end + 1
            if i < n and pattern[i] == "?":
                alternatives = [*alternatives, ""]
                i += 1
            if i < n and pattern[i] in "*+?{":
                return None
            options = [o + a for o, a in itertools.product(options, alternatives)]
            if len(options) > _MAX_LITERALS:
                return None
            continue
        text, i = _literal_char(pattern, i)
        if text is None:
            return None
        if i < n and pattern[i] in "*+?{":
            return None
        options = [o + text for o in options]
    return frozenset(options)


def _literal_char(pattern: str, i: int) -> tuple[str | None, int]:
    char = pattern[i]
    if char == "\\":
        if i + 1 < len(pattern) and not (pattern[i + 1].isascii() and pattern[i + 1].isalnum()):
            return pattern[i + 1], i + 2
        return None, i
    if char in _META:
        return None, i
    return char, i + 1


def _literal_group(pattern: str, i: int) -> tuple[int, list[str] | None]:
    """Plain alternatives from `i` to the closing parenthesis: (its index, the alternatives)."""
    alternatives, current = [], ""
    while i < len(pattern):
        char = pattern[i]
        if char == ")":
            return i, [*alternatives, current]
        if char == "|":
            alternatives.append(current)
            current = ""
            i += 1
            continue
        text, after = _literal_char(pattern, i)
        if text is None or (after < len(pattern) and pattern[after] in "*+?{"):
            return i, None
        current += text
        i = after
    return i, None


def _check_axes_in_mesh(rule: Rule, mesh: keras.distribution.DeviceMesh) -> None:
    known = tuple(mesh.axis_names)
    unknown = [axis for axis in named_axes(rule.axes) if axis not in known]
    if unknown:
        raise InvalidRuleError(
            f"Layout {rule.describe()} names mesh axis {unknown[0]!r}, but the mesh "
            f"has axes {known} (shape {tuple(mesh.shape)}). Fix: use one of "
            f"{known} or None for each dimension, or add the axis to the mesh: the layout should "
            "be a TensorLayout or a tuple of those names and None."
        )


def _check_given_mesh(
    rule: Rule, given: keras.distribution.TensorLayout | None, mesh: keras.distribution.DeviceMesh
) -> None:
    """A `TensorLayout` given with a mesh must carry the mesh of the rules (or an equal one)."""
    if given is None or given.device_mesh is None or given.device_mesh is mesh:
        return
    if same_mesh(given.device_mesh, mesh):
        return
    raise InvalidRuleError(
        f"Layout {rule.describe()} is a TensorLayout on {given.device_mesh!r}, but these rules "
        f"lay out variables on {mesh!r}. Keras's LayoutMap would keep it, and the variable "
        "would then live on the other mesh, apart from the rest of the model. Fix: give the "
        "axes alone, e.g. rules[pattern] = (None, 'model'), or a TensorLayout without a mesh."
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
                f"Layout rule #{index} repeats the pattern {pattern!r} of rule #{rule.index}: "
                f"{pattern} already exists in these rules (Keras's LayoutMap refuses it too). "
                "Since the first match wins it could never apply. Remove one of them, or "
                "delete the old one first (del rules[pattern])."
            )
    if isinstance(axes, keras.distribution.TensorLayout):
        axes = axes.axes
    if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} needs a tuple of axes, one mesh-axis name or "
            f"None per tensor dimension, e.g. (None, 'model'): the layout should be a TensorLayout "
            f"or such a tuple. Received: axes={axes!r}."
        )
    axes = tuple(tuple(axis) if isinstance(axis, list) else axis for axis in axes)
    for axis in axes:
        if isinstance(axis, tuple):
            if not axis or not all(isinstance(name, str) for name in axis):
                raise InvalidRuleError(
                    f"Layout rule #{index} {pattern!r} has entry {axis!r} in axes {axes!r}; an entry "
                    "that splits one dimension over several mesh axes must be a non-empty tuple of "
                    "mesh-axis names, e.g. ('data', 'model')."
                )
            continue
        if axis is not None and axis is not Ellipsis and not isinstance(axis, str):
            raise InvalidRuleError(
                f"Layout rule #{index} {pattern!r} has entry {axis!r} in axes {axes!r}; each "
                "entry must be a mesh-axis name (a string), None, a tuple of mesh-axis names (split "
                "over all of them), or a single '...'."
            )
    if axes.count(Ellipsis) > 1:
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} has more than one '...' in axes {axes!r}; "
            "'...' stands for the leftover dimensions and can appear once."
        )
    if pattern.endswith(OUTPUT_SUFFIX) and Ellipsis in axes[:-1]:
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} -> {axes!r} lays out a layer output with '...' "
            "before its last entry. Keras asks for an output's layout by path alone, before it "
            "knows the output's rank, so '...' can stand only at the end of an output rule "
            "(the dimensions it covers stay whole). Fix: spell out one entry per dimension of "
            "the output, e.g. (None, None, 'model') for a (batch, sequence, features) output, or "
            "put '...' last, e.g. ('data', ...)."
        )
    if not isinstance(note, str):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r}: the note must be a string. Received: {note!r}."
        )
    single = [axis for axis in axes if isinstance(axis, str)]
    for axis in single:
        if single.count(axis) > 1:
            raise InvalidRuleError(
                f"Layout rule #{index} {pattern!r} uses mesh axis {axis!r} on more than one "
                f"dimension in axes {axes!r}. A mesh axis can split only one dimension of a "
                f"tensor. Fix: keep {axis!r} on one dimension and put None on the others."
            )
    named = named_axes(axes)
    for axis in named:
        if named.count(axis) > 1:
            raise InvalidRuleError(
                f"Layout rule #{index} {pattern!r} uses mesh axis {axis!r} more than once in axes "
                f"{axes!r}. A mesh axis can split only one dimension of a tensor, once. Fix: keep "
                f"{axis!r} in one entry only and put None (or the other axes) elsewhere."
            )
    literals = literal_strings(pattern)
    if literals is not None:
        suffix = pattern.endswith(OUTPUT_SUFFIX)
        literals = frozenset(text for text in literals if text.endswith(OUTPUT_SUFFIX) == suffix)
    return Rule(index=index, pattern=pattern, axes=axes, regex=regex, note=note, literals=literals)
