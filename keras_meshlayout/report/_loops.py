"""How often the body of each counted loop of compiled HLO text runs.

XLA:TPU computes some sharded matmuls as windowed einsums: a `while` loop whose body passes
one shard to each neighbour (`collective-permute`) and multiplies while it moves, in place
of one all-gather or reduce-scatter (measured with libtpu 0.0.42.1: the weights' gradients of
fully sharded kernels reduce-scattered over `data=8` on v5e 2×4 and v5p 4×4×4 from about 4,096
tokens per device, a bidirectional loop of 4 permutes run twice, beside one outside it). Its
collectives are printed once in the text; `loop_runs` reads how often each body runs from the
loop's counter: a `get-tuple-element` compared (`LT`) with a constant in the condition, a
constant start in the loop's initial tuple (through `copy`), and a constant step added in the
body (to the counter or a `copy` of it). Loops of another form are not counted (one run).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

__all__ = ["COMPUTATION", "loop_runs"]

_NAME = r"[\w.\-]+"
#: A computation's first line: `%name (params) -> result {` (`ENTRY %name ...` for the entry).
COMPUTATION = re.compile(rf"^(?:ENTRY )?%(?P<name>{_NAME}) \(.*\{{\s*$")
_DEFINITION = re.compile(
    rf"^\s*(?P<root>ROOT )?%(?P<name>{_NAME}) = .*? (?P<op>[a-z\-]+)\((?P<args>[^)]*)\)(?P<rest>.*)$"
)
_ROOT = ""  # the key of a computation's root instruction's name
_WHILE = re.compile(rf"while\(%(?P<init>{_NAME})\), condition=%(?P<cond>{_NAME}), body=%(?P<body>{_NAME})")
_INDEX = re.compile(r"index=(\d+)")
_COMMENT = re.compile(r"/\*.*?\*/")


def loop_runs(lines: Sequence[str]) -> dict[str, int]:
    """Per computation that is a counted loop's body, how often it runs (nested loops multiplied).

    Example:
        >>> text = '''%cond (p: (u32[])) -> pred[] {
        ...   %p = (u32[]) parameter(0)
        ...   %i = u32[] get-tuple-element(%p), index=0
        ...   %n = u32[] constant(4)
        ...   ROOT %lt = pred[] compare(%i, %n), direction=LT
        ... }
        ... %body (q: (u32[])) -> (u32[]) {
        ...   %q = (u32[]) parameter(0)
        ...   %j = u32[] get-tuple-element(%q), index=0
        ...   %two = u32[] constant(2)
        ...   %next = u32[] add(%j, %two)
        ...   ROOT %t = (u32[]) tuple(%next)
        ... }
        ... ENTRY %main () -> (u32[]) {
        ...   %zero = u32[] constant(0)
        ...   %start = u32[] copy(%zero)
        ...   %init = (u32[]) tuple(%start)
        ...   ROOT %w = (u32[]) while(%init), condition=%cond, body=%body
        ... }'''
        >>> loop_runs(text.splitlines())
        {'body': 2}
    """
    computations = _computations(lines)
    runs: dict[str, int] = {}
    parents: dict[str, str] = {}
    for name, definitions in computations.items():
        for name_of, (operation, rest) in definitions.items():
            op, _, args = operation.partition("|")
            loop = _WHILE.search(f"while({args}){rest}") if op == "while" and name_of != _ROOT else None
            if loop is None:
                continue
            parents[loop["body"]] = name
            count = _trip_count(definitions, computations, loop)
            if count is not None:
                runs[loop["body"]] = count
    for body in list(runs):  # a loop inside another loop's body runs once per run of that body
        parent = parents.get(body)
        while parent is not None:
            runs[body] *= runs.get(parent, 1)
            parent = parents.get(parent)
    return runs


def _computations(lines: Sequence[str]) -> dict[str, dict[str, tuple[str, str]]]:
    """Per computation, its instructions by name: `(operands, what follows them)`."""
    computations: dict[str, dict[str, tuple[str, str]]] = {}
    current: dict[str, tuple[str, str]] | None = None
    for line in lines:
        header = COMPUTATION.match(line)
        if header:
            current = computations.setdefault(header["name"], {})
            continue
        definition = _DEFINITION.match(line) if current is not None else None
        if definition:
            args = _COMMENT.sub("", definition["args"])
            current[definition["name"]] = (f"{definition['op']}|{args}", definition["rest"])
            if definition["root"]:
                current[_ROOT] = (definition["name"], "")
    return computations


def _operands(definitions: dict[str, tuple[str, str]], name: str, op: str) -> list[str] | None:
    """The operand names of instruction `name` when it is an `op`, else `None`."""
    found = definitions.get(name)
    if found is None or not found[0].startswith(op + "|"):
        return None
    return [a.strip().lstrip("%") for a in found[0].partition("|")[2].split(",") if a.strip()]


def _constant(definitions: dict[str, tuple[str, str]], name: str) -> int | None:
    """The integer value of a `constant`, seen through `copy`."""
    copied = _operands(definitions, name, "copy")
    if copied:
        return _constant(definitions, copied[0])
    value = _operands(definitions, name, "constant")
    return int(value[0]) if value and value[0].lstrip("-").isdigit() else None


def _trip_count(definitions: dict, computations: dict, loop: re.Match) -> int | None:
    """How often one loop's body runs, from its counter (see the module docstring), or `None`."""
    cond, body = computations.get(loop["cond"], {}), computations.get(loop["body"], {})
    compared = _operands(cond, cond.get(_ROOT, ("", ""))[0], "compare")
    if not compared or len(compared) != 2 or "direction=LT" not in cond[cond[_ROOT][0]][1]:
        return None
    counter, limit = compared
    index, end = _tuple_index(cond, counter), _constant(cond, limit)
    elements = _operands(definitions, loop["init"], "tuple")
    if index is None or end is None or not elements or index >= len(elements):
        return None
    start = _constant(definitions, elements[index])
    step = _step(body, index)
    if start is None or not step:
        return None
    return max(math.ceil((end - start) / step), 0)


def _tuple_index(definitions: dict[str, tuple[str, str]], name: str) -> int | None:
    """The tuple index a `get-tuple-element` reads, seen through `copy` (XLA:TPU copies the counter of
    a windowed einsum's loop over 32 devices before adding to it)."""
    copied = _operands(definitions, name, "copy")
    if copied:
        return _tuple_index(definitions, copied[0])
    found = definitions.get(name)
    if found is None or not found[0].startswith("get-tuple-element|"):
        return None
    index = _INDEX.search(found[1])
    return int(index[1]) if index else None


def _step(body: dict[str, tuple[str, str]], index: int) -> int | None:
    """What the body adds to the counter at tuple `index`: its root's element there, `counter + constant`."""
    root = _operands(body, body.get(_ROOT, ("", ""))[0], "tuple")
    if root is None or len(root) <= index:
        return None
    added = _operands(body, root[index], "add")
    if not added or len(added) != 2:
        return None
    first, second = added
    if _tuple_index(body, first) == index:
        return _constant(body, second)
    if _tuple_index(body, second) == index:
        return _constant(body, first)
    return None
