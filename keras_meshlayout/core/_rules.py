"""`LayoutRules`: an ordered list of layout rules, the `LayoutMap`-compatible container.

Each rule is checked on its own when added (`_rule.make_rule`) and against each mesh the rules
are bound to here. Matching a path to its rule is
`_matcher`'s job; the layouts themselves (entries, axes, JSON) are `_axes`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import keras

from .. import _compat
from ._axes import named_axes
from ._errors import InvalidOptionError, InvalidRuleError
from ._format import did_you_mean
from ._matcher import Matcher
from ._policy import LayoutPolicy
from ._rule import Rule, make_rule

__all__ = ["LayoutRules", "Origin", "Rule", "same_mesh"]


@dataclasses.dataclass(frozen=True)
class Origin:
    """What rules carry about where they came from, as one frozen value shared by their views.

    Attributes:
        policy: The `kml.LayoutPolicy` the rules were made for, or `None`.
        cost: What the planner predicts a training step of the rules costs (a
            `kml.PlanCost`, set by `kml.auto_rules(..., batch=...)`), or `None`.
        batch_axis: The axis the planner split the batch over (`None`: none).
        planned: Whether `kml.auto_rules` made the rules (then `batch_axis` is its choice).
    """

    policy: LayoutPolicy | None = None
    cost: Any = None
    batch_axis: str | None = None
    planned: bool = False


class _Store:
    """The rules themselves, shared by a `LayoutRules` and every view bound from it.

    One cache: whatever is derived from the rules (the matcher, the layouts made for each
    mesh) is kept under a key until the rules change.
    """

    def __init__(self, origin: Origin) -> None:
        self.rules: list[Rule] = []
        #: The `TensorLayout` given for each pattern, if one was: reading it back returns it.
        self.given: dict[str, keras.distribution.TensorLayout] = {}
        self.meshes: list[keras.distribution.DeviceMesh] = []
        self.origin = origin
        self._cache: dict[Hashable, Any] = {}

    def changed(self) -> None:
        self._cache.clear()

    def cached(self, key: Hashable, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def matcher(self) -> Matcher:
        return self.cached("matcher", lambda: Matcher(self.rules))


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

    Rules whose pattern ends in `output` lay out layer outputs (Keras asks for
    `<layer path>/output`, and honours any key that matches it, such as
    `".*dense.*output"`); all other rules lay out variables. Keras asks for
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
            A `kml.Rule` (another set's, say `kml.auto_rules`' `rules.rules`)
            keeps its note and its `optional`, `suggested` and `keep_split`.
        mesh: Optional mesh to validate against and to build layouts on.
        optional: Mark these rules as optional: matching no variable is
            expected and draws no `UnmatchedRuleWarning` (presets use this).
        suggested: Mark these rules as chosen for the user (presets and the
            planner use this): `replicate_below` keeps their small weight
            matrices whole. Rules added later with `rules[pattern] = axes` are
            the user's own: neither optional nor suggested.
        keep_split: Patterns of these rules whose split `replicate_below` leaves as it is,
            however small the weight (`Rule.keep_split`): the planner names the rules of
            grouped convolutions' units, which XLA trains wrongly kept whole on a 2-D mesh.
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
            axis is unknown, or `keep_split` names a pattern that is not one of `rules`.

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

        Rules of another set join a new one as they are, after your own:

        >>> mine = kml.LayoutRules([(r".*dense_2/kernel", ("model", None)), *rules.rules])
        >>> [rule.pattern for rule in mine.rules]
        ['.*dense_2/kernel', '.*dense_1/kernel', '.*dense_1/.*', 'mlp/dense_1/bias']
    """

    def __init__(
        self,
        rules: Iterable[tuple[str, Sequence[str | None]]]
        | Mapping[str, Sequence[str | None]]
        | keras.distribution.DeviceMesh = (),
        *,
        mesh: keras.distribution.DeviceMesh | None = None,
        optional: bool = False,
        suggested: bool = False,
        keep_split: Collection[str] = (),
        device_mesh: keras.distribution.DeviceMesh | None = None,
        policy: LayoutPolicy | None = None,
    ) -> None:
        _check_policy(policy)
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
        self._store = _Store(Origin(policy=policy))
        if mesh is not None:
            self._store.meshes.append(mesh)
        items = rules.items() if isinstance(rules, Mapping) else rules
        kept = tuple(dict.fromkeys(keep_split))  # in the order given, for the error
        for entry in items:
            if isinstance(entry, Rule):  # another set's rule (`auto.rules`), with its note and flags
                flags = dict(optional=entry.optional or optional, suggested=entry.suggested or suggested)
                keep = entry.keep_split or entry.pattern in kept
                self._append(entry.pattern, entry.axes, entry.note, **flags, keep_split=keep)
                continue
            if not isinstance(entry, (tuple, list)) or len(entry) not in (2, 3):
                raise InvalidRuleError(
                    f"Each layout rule must be a (pattern, axes) pair, e.g. "
                    f"(r'.*dense_1/kernel', (None, 'model')), optionally with a note as a "
                    f"third item. Received: {entry!r}."
                )
            self._append(*entry, optional=optional, suggested=suggested, keep_split=entry[0] in kept)
        _check_keep_split(kept, self._store.rules)

    # -- the rules ------------------------------------------------------------

    @property
    def origin(self) -> Origin:
        """Where these rules came from: the policy and predicted cost they carry (one frozen value)."""
        return self._store.origin

    @property
    def policy(self) -> LayoutPolicy | None:
        """The `kml.LayoutPolicy` these rules carry (see `policy` above), or `None`.

        Shared with every view `bind` returns, as the rules are.
        """
        return self._store.origin.policy

    @policy.setter
    def policy(self, policy: LayoutPolicy | None) -> None:
        _check_policy(policy)
        self._store.origin = dataclasses.replace(self._store.origin, policy=policy)

    @property
    def cost(self) -> Any:
        """What `kml.auto_rules(..., batch=...)` predicts a training step of these rules costs.

        A `kml.PlanCost`; `None` for rules written by hand. Shared with every view `bind`
        returns, as the rules are.
        """
        return self._store.origin.cost

    @cost.setter
    def cost(self, cost: Any) -> None:
        self._store.origin = dataclasses.replace(self._store.origin, cost=cost)

    @property
    def batch_axis(self) -> str | None:
        """The mesh axis `kml.auto_rules` planned the batch over (`None`: none, or rules written by hand).

        `kml.ModelParallel(mesh, rules)` splits the batch over it unless told otherwise, and warns
        when told otherwise: the plan's layouts and costs were chosen for it.
        """
        return self._store.origin.batch_axis

    @batch_axis.setter
    def batch_axis(self, axis: str | None) -> None:
        self._store.origin = dataclasses.replace(self._store.origin, batch_axis=axis, planned=True)

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
        return self._store.matcher().match(path)

    def unmatched(self, paths: Iterable[str]) -> list[Rule]:
        """The variable rules that match none of `paths`: likely typos."""
        matcher = self._store.matcher()
        hit = {rule.index for rule in map(matcher.match, paths) if rule is not None}
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
        bound = self.mesh
        if bound is mesh or (bound is not None and same_mesh(bound, mesh)):
            return self
        if bound is not None:
            raise InvalidRuleError(
                f"These layout rules are bound to {bound!r} and cannot be used "
                f"with {mesh!r}. Fix: build the rules without mesh= and let "
                "kml.ModelParallel bind them, or call bind() on an unbound copy."
            )
        self.validate(mesh)
        view = LayoutRules(mesh=mesh)
        view._store = self._store  # the rules, their policy and cost: shared, never copied
        if not any(m is mesh for m in self._store.meshes):
            self._store.meshes.append(mesh)
        return view

    @property
    def mesh(self) -> keras.distribution.DeviceMesh | None:
        """The mesh these rules are bound to, or `None`."""
        return _compat.layout_map_mesh(self)

    # -- keras.distribution.LayoutMap ---------------------------------------

    @property
    def device_mesh(self) -> keras.distribution.DeviceMesh:
        """The bound mesh, as Keras's `ModelParallel` reads it.

        Raises:
            InvalidRuleError: the rules are not bound to a mesh.
        """
        mesh = self.mesh
        if mesh is None:
            raise InvalidRuleError(
                "These layout rules are not bound to a mesh, so Keras cannot build layouts "
                "from them. Fix: pass them to kml.ModelParallel(mesh, rules), or bind them "
                "first: keras.distribution.ModelParallel(layout_map=rules.bind(mesh)) or "
                "kml.LayoutRules([...], mesh=mesh)."
            )
        return mesh

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
        mesh = self.mesh
        if given is not None and given.device_mesh is mesh:
            return given

        def make() -> keras.distribution.TensorLayout:
            if mesh is not None:
                _check_axes_in_mesh(rule, mesh)
            axes = tuple(axis for axis in rule.axes if axis is not Ellipsis)
            return _compat.tensor_layout(axes, mesh)

        return self._store.cached(("layout", id(mesh), rule.pattern), make)

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
        keep_split: bool = False,
    ) -> None:
        store = self._store
        rule = make_rule(len(store.rules), pattern, axes, store.rules, note)
        rule = dataclasses.replace(rule, optional=optional, suggested=suggested, keep_split=keep_split)
        given = _given_layout(axes)
        for mesh in store.meshes:
            _check_axes_in_mesh(rule, mesh)
            _check_given_mesh(rule, given, mesh)
        if given is not None and given.device_mesh is None and self.mesh is not None:
            _compat.give_layout_mesh(given, self.mesh)  # as Keras's LayoutMap does
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
        return isinstance(pattern, str) and pattern in self._store.matcher().exact

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


def _given_layout(axes: object) -> keras.distribution.TensorLayout | None:
    """A `TensorLayout` given as a rule's layout, or one standing for a `NamedSharding`'s mesh."""
    from jax.sharding import NamedSharding

    if isinstance(axes, keras.distribution.TensorLayout):
        return axes
    if isinstance(axes, NamedSharding):
        mesh = keras.distribution.DeviceMesh(
            tuple(axes.mesh.devices.shape), list(axes.mesh.axis_names), axes.mesh.devices
        )
        return keras.distribution.TensorLayout((None,) * len(mesh.shape), mesh)
    return None


def _check_keep_split(keep_split: Collection[str], rules: Sequence[Rule]) -> None:
    patterns = {rule.pattern for rule in rules}
    unknown = [pattern for pattern in keep_split if pattern not in patterns]
    if unknown:
        raise InvalidRuleError(
            f"LayoutRules: keep_split names {len(unknown)} pattern(s) that are none of these rules' "
            f"({len(patterns)} rules), e.g. {unknown[0]!r}. Received: keep_split={list(keep_split)!r}. "
            "Fix: name the patterns exactly as given in the rules."
        )


def _check_policy(policy: object) -> None:
    if policy is not None and not isinstance(policy, LayoutPolicy):
        raise InvalidOptionError(
            f"LayoutRules: policy must be a kml.LayoutPolicy. Received: policy={policy!r}. "
            "Fix: policy=kml.LayoutPolicy(replicate_below=...), or leave it out."
        )


def _check_axes_in_mesh(rule: Rule, mesh: keras.distribution.DeviceMesh) -> None:
    known = tuple(mesh.axis_names)
    unknown = [axis for axis in named_axes(rule.axes) if axis not in known]
    if unknown:
        raise InvalidRuleError(
            f"Layout {rule.describe()} names mesh axis {unknown[0]!r}, but the mesh "
            f"has axes {known} (shape {tuple(mesh.shape)}).{did_you_mean(unknown[0], known)} Fix: use one of "
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
