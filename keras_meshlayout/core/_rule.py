"""One layout rule: the `Rule` value, and the named checks a `(pattern, axes)` pair passes on its own.

`make_rule` runs them in order, one per way a rule can be malformed, with no mesh at hand (the
checks against a mesh are the container's, `_rules`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import keras

from ._axes import Axes, named_axes
from ._errors import InvalidRuleError
from ._matcher import OUTPUT_SUFFIX, is_output_pattern, literal_strings

__all__ = ["Rule", "make_rule"]


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
        keep_split: Whether `replicate_below` must leave the rule's split as it is,
            however small the weight: the planner sets it where the weight kept
            whole would train wrongly (a grouped convolution's unit on a mesh that
            splits the batch and the model axis, `kml.GroupedConvWarning`).
    """

    index: int
    pattern: str
    axes: Axes
    regex: re.Pattern = dataclasses.field(repr=False, compare=False)
    note: str = ""
    optional: bool = False
    suggested: bool = False
    keep_split: bool = False
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
        """Whether the rule lays out layer outputs (its pattern ends in `output`, see `is_output_pattern`)."""
        return is_output_pattern(self.pattern)

    def describe(self) -> str:
        return f"rule #{self.index} {self.pattern!r} -> {self.axes!r}"


def make_rule(index: int, pattern: str, axes: object, earlier: Sequence[Rule], note: str = "") -> Rule:
    """Validates one `(pattern, axes)` pair on its own, with no mesh at hand."""
    regex = _compiled(index, pattern)
    _check_not_repeated(index, pattern, earlier)
    axes = _as_axes(index, pattern, axes)
    for entry in axes:
        _check_entry(index, pattern, entry, axes)
    _check_ellipsis(index, pattern, axes)
    _check_note(index, pattern, note)
    _check_axes_distinct(index, pattern, axes)
    literals = literal_strings(pattern)
    if literals is not None:  # an output rule never lays out a variable, nor a variable rule an output
        output = is_output_pattern(pattern)
        literals = frozenset(text for text in literals if text.endswith(OUTPUT_SUFFIX) == output)
    return Rule(index=index, pattern=pattern, axes=axes, regex=regex, note=note, literals=literals)


def _compiled(index: int, pattern: object) -> re.Pattern:
    if not isinstance(pattern, str) or not pattern:
        raise InvalidRuleError(
            f"Layout rule #{index} needs a non-empty regex string as its pattern. "
            f"Received: pattern={pattern!r}."
        )
    try:
        return re.compile(pattern)
    except re.error as err:
        raise InvalidRuleError(
            f"Layout rule #{index} pattern {pattern!r} is not a valid regular expression: "
            f"{err}. Fix the pattern; to match a literal character such as '[' or '(', "
            "escape it with a backslash."
        ) from None


def _check_not_repeated(index: int, pattern: str, earlier: Sequence[Rule]) -> None:
    for rule in earlier:
        if rule.pattern == pattern:
            raise InvalidRuleError(
                f"Layout rule #{index} repeats the pattern {pattern!r} of rule #{rule.index}: "
                f"{pattern} already exists in these rules (Keras's LayoutMap refuses it too). "
                "Since the first match wins it could never apply. Remove one of them, or "
                "delete the old one first (del rules[pattern])."
            )


def _as_axes(index: int, pattern: str, axes: object) -> tuple:
    """The layout as a tuple, multi-axis entries as tuples (a `TensorLayout` gives its axes).

    A JAX `PartitionSpec` (or a `NamedSharding`'s spec) is read as JAX reads it: one entry
    per leading dimension, the others replicated (a trailing `...`).
    """
    from jax.sharding import NamedSharding, PartitionSpec

    if isinstance(axes, NamedSharding):
        axes = axes.spec
    if isinstance(axes, PartitionSpec):
        return (*(_spec_entry(entry) for entry in axes), ...)
    if isinstance(axes, keras.distribution.TensorLayout):
        axes = axes.axes
    if isinstance(axes, str) or not isinstance(axes, (tuple, list)):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} needs a tuple of axes, one mesh-axis name or "
            f"None per tensor dimension, e.g. (None, 'model'): the layout should be a TensorLayout "
            f"or such a tuple. Received: axes={axes!r}."
        )
    return tuple(tuple(axis) if isinstance(axis, list) else axis for axis in axes)


def _spec_entry(entry: object) -> object:
    """A `PartitionSpec` entry as ours: `('model',)` → `'model'`, `()` → `None`, a tuple kept."""
    if isinstance(entry, (tuple, list)):
        return None if not entry else entry[0] if len(entry) == 1 else tuple(entry)
    return entry


def _check_entry(index: int, pattern: str, entry: object, axes: tuple) -> None:
    if isinstance(entry, tuple):
        if not entry or not all(isinstance(name, str) for name in entry):
            raise InvalidRuleError(
                f"Layout rule #{index} {pattern!r} has entry {entry!r} in axes {axes!r}; an entry "
                "that splits one dimension over several mesh axes must be a non-empty tuple of "
                "mesh-axis names, e.g. ('data', 'model')."
            )
    elif entry is not None and entry is not Ellipsis and not isinstance(entry, str):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} has entry {entry!r} in axes {axes!r}; each "
            "entry must be a mesh-axis name (a string), None, a tuple of mesh-axis names (split "
            "over all of them), or a single '...'."
        )


def _check_ellipsis(index: int, pattern: str, axes: tuple) -> None:
    if axes.count(Ellipsis) > 1:
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} has more than one '...' in axes {axes!r}; "
            "'...' stands for the leftover dimensions and can appear once."
        )
    if is_output_pattern(pattern) and Ellipsis in axes[:-1]:
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} -> {axes!r} lays out a layer output with '...' "
            "before its last entry. Keras asks for an output's layout by path alone, before it "
            "knows the output's rank, so '...' can stand only at the end of an output rule "
            "(the dimensions it covers stay whole). Fix: spell out one entry per dimension of "
            "the output, e.g. (None, None, 'model') for a (batch, sequence, features) output, or "
            "put '...' last, e.g. ('data', ...)."
        )


def _check_note(index: int, pattern: str, note: object) -> None:
    if not isinstance(note, str):
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r}: the note must be a string. Received: {note!r}."
        )


def _check_axes_distinct(index: int, pattern: str, axes: tuple) -> None:
    """A mesh axis splits at most one dimension, once: one check, worded for the case at hand
    (`('model', 'model')`: two dimensions; `(('data', 'model'), 'model')`: twice in the layout)."""
    named = named_axes(axes)
    axis = next((axis for axis in named if named.count(axis) > 1), None)
    if axis is None:
        return
    plain = [entry for entry in axes if isinstance(entry, str)]
    axis = next((name for name in plain if plain.count(name) > 1), None)
    if axis is not None:
        raise InvalidRuleError(
            f"Layout rule #{index} {pattern!r} uses mesh axis {axis!r} on more than one "
            f"dimension in axes {axes!r}. A mesh axis can split only one dimension of a "
            f"tensor. Fix: keep {axis!r} on one dimension and put None on the others."
        )
    axis = next(axis for axis in named if named.count(axis) > 1)
    raise InvalidRuleError(
        f"Layout rule #{index} {pattern!r} uses mesh axis {axis!r} more than once in axes "
        f"{axes!r}. A mesh axis can split only one dimension of a tensor, once. Fix: keep "
        f"{axis!r} in one entry only and put None (or the other axes) elsewhere."
    )
