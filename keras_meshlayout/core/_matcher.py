"""The matching engine: which of an ordered list of patterns lays out a path, first match wins.

Pure functions of the patterns and the path; nothing here knows meshes or layouts. Matching
runs in time linear in the variables: a pattern that can match only a few fixed paths (plain
text, escaped characters, `(?:prefix/)?` groups and `(?:a|b)` alternatives of plain text, as
the planner writes) is found by a dictionary lookup, and only the regex patterns before it are
tried, in order, in alternations of up to 64 at a time.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import Protocol, TypeVar

__all__ = ["OUTPUT_SUFFIX", "Matchable", "Matcher", "is_output_pattern", "literal_strings"]

#: Keras asks for the layout of a layer's output under `<layer path>/output`.
OUTPUT_SUFFIX = "/output"

#: Above this many fixed strings a pattern is matched as a regex.
_MAX_LITERALS = 64
_META = set(".^$*+?{}[]|()\\")
#: Regex patterns are tried this many at a time, as one alternation.
_CHUNK = 64
#: Constructs whose meaning depends on group numbers, which an alternation shifts.
_NUMBERED = re.compile(r"\\[1-9]|\(\?P=|\(\?\(")


def is_output_pattern(pattern: str) -> bool:
    """Whether a pattern lays out layer outputs: it ends in `output`, as Keras's keys do.

    Keras asks for `<layer path>/output`, and honours any key that matches it: `"dense/output"`,
    `".*dense.*output"`, `"(?:.*dense.*output)$"` all do. Variable paths end in a variable's
    name (`kernel`, `bias`, ...), so no variable rule needs to end in `output`.

    Example:
        >>> [is_output_pattern(p) for p in (".*dense.*output", "dense/output", ".*dense.*")]
        [True, True, False]
    """
    return pattern.rstrip("$)").endswith("output")


class Matchable(Protocol):
    """What the matcher reads of a rule (`kml.Rule` has all of it)."""

    @property
    def index(self) -> int: ...
    @property
    def pattern(self) -> str: ...
    @property
    def regex(self) -> re.Pattern: ...
    @property
    def literals(self) -> frozenset[str] | None: ...
    @property
    def for_outputs(self) -> bool: ...


R = TypeVar("R", bound=Matchable)


class Matcher:
    """Lookup tables over an ordered list of rules, built once.

    A pattern equal to the path (an exact key, as a Keras `LayoutMap` calls it) wins wherever
    it stands; otherwise the first rule whose pattern fully matches the path. Paths ending in
    `/output` only match output rules, all others only variable rules.

    Example:
        >>> import keras_meshlayout as kml
        >>> from keras_meshlayout.core._matcher import Matcher
        >>> rules = kml.LayoutRules([(r".*kernel", (None, "model")), ("m/d/kernel", ("model", None))])
        >>> Matcher(rules.rules).match("m/d/kernel").index
        1
    """

    def __init__(self, rules: Sequence[R]) -> None:
        self.exact: dict[str, R] = {}
        self._literal: dict[str, R] = {}
        regex: dict[bool, list[R]] = {False: [], True: []}
        for rule in rules:
            self.exact.setdefault(rule.pattern, rule)
            if rule.literals is None:
                regex[rule.for_outputs].append(rule)
                continue
            for text in rule.literals:
                self._literal.setdefault(text, rule)
        self._chunks = {kind: _chunks(rules) for kind, rules in regex.items()}

    def match(self, path: str) -> R | None:
        """The rule that lays out `path`, or `None`."""
        rule = self.exact.get(path)
        if rule is not None:
            return rule
        best = self._literal.get(path)
        limit = math.inf if best is None else best.index
        for combined, by_group, part in self._chunks[path.endswith(OUTPUT_SUFFIX)]:
            if part[0].index >= limit:
                break
            if combined is None:
                found = next((r for r in part if r.index < limit and r.regex.fullmatch(path)), None)
                if found is not None:
                    return found
                continue
            hit = combined.fullmatch(path)
            if hit is not None:
                rule = by_group[hit.lastindex]
                return rule if rule.index < limit else best
        return best


def _chunks(rules: Sequence[R]) -> list[tuple[re.Pattern | None, dict[int, R], Sequence[R]]]:
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


def literal_strings(pattern: str) -> frozenset[str] | None:
    """The only strings `pattern` can fully match, or `None` for a real regex.

    Understands plain text, backslash-escaped punctuation (as `re.escape`
    writes it), and non-capturing groups of plain alternatives, optionally
    optional: `(?:a|b)`, `(?:prefix/)?`.

    Example:
        >>> from keras_meshlayout.core._matcher import literal_strings
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
        if text is None or (i < n and pattern[i] in "*+?{"):
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
