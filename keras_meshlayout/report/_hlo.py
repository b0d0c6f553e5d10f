"""Reading collectives out of compiled, partitioned HLO text.

Pure text processing, no JAX: each collective instruction (all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute, and their
asynchronous `-start` forms) becomes a `Collective` with its payload, its device
groups and the op name its metadata gives. Combined collectives return tuples;
each array's own op name comes from the `get-tuple-element` that reads it.
Three replica-group formats are understood:

- explicit groups: `replica_groups={{0,1,2,3},{4,5,6,7}}`; an empty
  `replica_groups={}` (or none at all) means one group of every device;
- iota groups: `replica_groups=[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`: the iota
  reshaped to the bracketed dimensions, transposed, then cut into rows;
- mesh groups: `replica_groups=mesh['x'=2,'y'=4] {'x'}`, optionally with the
  device order between the mesh and the axes, as an iota
  (`device_ids=([2,4]T(1,0))`) or a list (`device_ids=(0,4,1,5,2,6,3,7)`), and
  with sub-axes (`{'y':(2)2}`: the minor half of `y`).

A collective inside a loop body or another computation appears once in the
text, however often it runs: inside the body of a loop whose trip count the text
gives (`_loops.loop_runs`: XLA:TPU's windowed einsums) it is listed once per run,
elsewhere once. XLA:TPU's asynchronous collective fusions print one
collective several times: a copy in the fusion that starts it (its root a
`custom-call` to `AsyncCollectiveStart`), one in each fusion that computes while it
moves, and one in the fusion that ends it (`AsyncCollectiveDone`), all with its
`channel_id`; it counts once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

from ..core._errors import HloFormatError
from ._collectives import wire_bytes
from ._loops import COMPUTATION, loop_runs

__all__ = ["Collective", "Payload", "parse_collectives", "wire_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {
    "pred": 1, "s1": 1, "u1": 1, "s2": 1, "u2": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1,
    "f4e2m1fn": 1, "f8e8m0fnu": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

#: `%name = shape op(...)`: the shape is one token (`f32[4,8]{1,0:T(8,128)}`) or a
#: parenthesised tuple, which may hold `/*index=5*/` comments.
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|[^\s(]\S*)\s+"
    r"(?P<op>(?:" + "|".join(KINDS) + r")(?:-start)?)\((?P<rest>.*)$"
)
#: The `-done` half of an asynchronous pair, and the `-start` it completes. An
#: operand is `%name`, or `f32[8]{0} %name` when operand shapes are printed.
_DONE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=.*?\s(?:" + "|".join(KINDS) + r")-done\("
    r"(?:[^%]*?%)?(?P<start>[\w.\-]+)\)"
)
#: An array shape; bounded dynamic dimensions (`<=8`) count at their bound.
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,<=]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_GTE = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=.*?\sget-tuple-element\((?:[^%]*?%)?(?P<source>[\w.\-]+)\),"
    r"\s*index=(?P<index>\d+)"
)
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_CHANNEL = re.compile(r"\bchannel_id=(?P<id>\d+)")
_IOTA = re.compile(r"\[(?P<groups>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
#: `mesh['x'=2,'y'=4] {'x'}`, the device order optionally given between the two as
#: an iota (`device_ids=([2,4]T(1,0))`) or a list (`device_ids=(0,4,1,5,2,6,3,7)`).
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\]"
    r"(?:,\s*device_ids=\((?:\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?|(?P<ids>[\d,\s]+))\))?"
    r"\s*\{(?P<over>[^}]*)\}"
)
#: One grouped axis: a whole mesh axis (`'x'`) or a sub-axis (`'x':(2)4`: size 4,
#: after a major part of size 2), quoted or not.
_AXIS_REF = re.compile(r"^'?(?P<name>[^':]+?)'?(?::\((?P<pre>\d+)\)(?P<size>\d+))?$")


@dataclasses.dataclass(frozen=True)
class Payload:
    """One array a collective moves (a combined collective moves several).

    Attributes:
        dtype: HLO element type, e.g. `"f32"`.
        shape: Array shape.
        op_name: The JAX op name from the metadata, if any.
    """

    dtype: str
    shape: tuple[int, ...]
    op_name: str = ""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * element_bytes(self.dtype)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program.

    Attributes:
        name: The HLO instruction name.
        kind: One of `KINDS` (an asynchronous `-start` counts as its kind).
        payloads: The arrays of its result (for all-gather the gathered
            arrays, for reduce-scatter the scattered shards).
        groups: Device groups (logical device ids); `None` for
            collective-permute, which has `pairs` instead.
        pairs: Source-target pairs of a collective-permute.
        op_name: The JAX op name from the instruction's own metadata.
        network: `"ici"` for a collective within a slice; `"dcn"` for a transfer between
            slices of a multi-slice program (`_megascale`), whose `groups` hold slice indices.
    """

    name: str
    kind: str
    payloads: tuple[Payload, ...]
    groups: tuple[tuple[int, ...], ...] | None
    pairs: tuple[tuple[int, int], ...] = ()
    op_name: str = ""
    network: str = "ici"

    @property
    def group_size(self) -> int:
        if self.groups:
            return len(self.groups[0])
        return 2 if self.pairs else 1

    @property
    def nbytes(self) -> int:
        """Bytes of the result on each device."""
        return sum(p.nbytes for p in self.payloads)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per execution (ring algorithms)."""
        return wire_bytes(self.kind, self.nbytes, self.group_size)


def parse_collectives(hlo_text: str, device_count: int) -> list[Collective]:
    """Every collective in `hlo_text`, in program order.

    Args:
        hlo_text: HLO module text, e.g. `compiled.as_text()`.
        device_count: Number of devices of the program, for `replica_groups={}`.

    Returns:
        The collectives; `-done` halves of asynchronous pairs are skipped, and so are
        the copies of a collective XLA:TPU prints in each fusion of one asynchronous
        collective (the same `channel_id`, kind, devices and arrays as an earlier
        one). A collective inside the body of a loop whose trip count the text gives
        (`_loops.loop_runs`) is listed once per run; in other loops, once.

    Raises:
        HloFormatError: a `replica_groups` attribute in a format not understood, or
            an element type of unknown size.

    Example:
        >>> text = ("%ar = f32[32,128]{1,0} all-reduce(%x), replica_groups={{0,1},{2,3}}, "
        ...         'to_apply=%add, metadata={op_name="jit(f)/dense/dot_general"}')
        >>> [c] = parse_collectives(text, 4)
        >>> c.kind, c.groups, c.nbytes, c.wire_bytes, c.op_name
        ('all-reduce', ((0, 1), (2, 3)), 16384, 16384.0, 'jit(f)/dense/dot_general')
    """
    lines = hlo_text.splitlines()
    element_names = _tuple_element_op_names(lines)
    runs = loop_runs(lines)
    found, seen, computation = [], set(), ""
    for line in lines:
        header = COMPUTATION.match(line)
        if header:
            computation = header["name"]
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        op, rest = match["op"], match["rest"]
        kind = op.removesuffix("-start")
        arrays = _result_arrays(kind, op.endswith("-start"), match["shape"])
        names = element_names.get(match["name"], {})
        op_name = _first(_OP_NAME.findall(rest))
        payloads = tuple(
            Payload(dtype, shape, names.get(i, op_name)) for i, (dtype, shape) in enumerate(arrays)
        )
        if kind == "collective-permute":
            collective = Collective(match["name"], kind, payloads, None, _pairs(rest), op_name)
        else:
            groups = _replica_groups(rest, device_count)
            collective = Collective(match["name"], kind, payloads, groups, (), op_name)
        channel = _CHANNEL.search(rest)
        key = (channel and channel["id"], kind, tuple(arrays), collective.groups, collective.pairs)
        if channel and key in seen:
            continue  # a copy in another fusion of one asynchronous collective (XLA:TPU)
        seen.add(key)
        found.extend([collective] * runs.get(computation, 1))
    return found


def element_bytes(dtype: str) -> int:
    """Bytes of one element of an HLO element type (`"f32"` → 4, `"pred"` → 1).

    Raises:
        HloFormatError: an element type whose size is not known.

    Example:
        >>> element_bytes("bf16"), element_bytes("pred")
        (2, 1)
    """
    size = _BYTES.get(dtype)
    if size is None:
        raise HloFormatError(
            f"Unknown HLO element type {dtype!r}: its size in bytes is not known, so the traffic of "
            f"the collectives that move it cannot be counted. Known types: {', '.join(sorted(_BYTES))}. "
            "Fix: report it with your JAX version; until then, leave that program out of comm_report."
        )
    return size


def _unreadable(what: str, text: str) -> HloFormatError:
    import jax

    return HloFormatError(
        f"Unrecognised {what} in compiled HLO (JAX {jax.__version__}): {text[:80]!r}. The "
        "communication report reads replica_groups written as {{0,1},...}, [n,m]<=[...] (iota) or "
        "mesh[...]; it refuses to guess the device groups of another form. Fix: report the text "
        "above with your JAX version; kml.comm_report cannot count this program's collectives."
    )


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d.removeprefix("<=")) for d in text.split(",") if d.strip())


def _first(items: Sequence[str]) -> str:
    return items[0] if items else ""


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """`(dtype, dims)` of every array in a shape, tuples flattened in order."""
    return [(m["dtype"], _dims(m["dims"])) for m in _ARRAY.finditer(_COMMENT.sub("", shape))]


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of a tuple shape (`[]` if `shape` is not a tuple)."""
    shape = _COMMENT.sub("", shape).strip()
    if not shape.startswith("("):
        return []
    elements, depth, start = [], 0, 1
    for i, char in enumerate(shape):
        if char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        if (char == "," and depth == 1) or depth == 0:
            elements.append(shape[start:i].strip())
            start = i + 1
        if depth == 0:
            break
    return [element for element in elements if element]


def _result_arrays(kind: str, is_start: bool, shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays a collective delivers, from its result shape.

    An asynchronous all-gather or collective-permute start returns the tuple
    `(operands, results)`, a permute followed by scalar context words
    (`(f32[8]{0}, f32[8]{0}, u32[], u32[])`): the payload is its second element.
    Every other form (an all-reduce start included) returns just its results.
    """
    if is_start and kind in ("all-gather", "collective-permute"):
        elements = _tuple_elements(shape)
        if len(elements) >= 2:
            return _arrays(elements[1])
    return _arrays(shape)


def _tuple_element_op_names(lines: Iterable[str]) -> dict[str, dict[int, str]]:
    """`{collective name: {tuple index: op_name}}` from get-tuple-element users.

    A combined collective carries one merged op_name; the get-tuple-element that
    takes each array out keeps the op_name of the op it came from. For an
    asynchronous pair the get-tuple-elements read the `-done`, which stands for
    its `-start`.
    """
    lines = list(lines)
    started_by = {m["name"]: m["start"] for m in map(_DONE.match, lines) if m}
    names: dict[str, dict[int, str]] = {}
    for line in lines:
        match = _GTE.match(line)
        if match:
            op_name = _first(_OP_NAME.findall(line))
            if op_name:
                source = started_by.get(match["source"], match["source"])
                names.setdefault(source, {})[int(match["index"])] = op_name
    return names


def _replica_groups(rest: str, device_count: int) -> tuple[tuple[int, ...], ...]:
    """Device groups from the `replica_groups=` attribute; absent or `{}`: all devices."""
    start = rest.find("replica_groups=")
    if start < 0:
        return (tuple(range(device_count)),)
    text = rest[start + len("replica_groups=") :]
    if text.startswith("{"):
        groups = tuple(_dims(g) for g in re.findall(r"\{([^{}]*)\}", _balanced(text)))
        groups = tuple(group for group in groups if group)
        return groups or (tuple(range(device_count)),)
    if text.startswith("mesh"):
        return _mesh_groups(text)
    match = _IOTA.match(text)
    if match:
        ids = _iota(match["dims"], match["perm"])
        return _rows(ids.reshape(int(match["groups"]), int(match["size"])))
    raise _unreadable("replica_groups format", text)


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    """Groups of `mesh[axes](, device_ids=(...)) {grouped axes}`.

    The device ids, laid out over the mesh shape, are split wherever a grouped
    sub-axis cuts a mesh axis (`'x':(2)4` is the 4 after the major 2, major to
    minor); a group holds the devices that differ only along the grouped axes,
    taken in the order written.
    """
    match = _MESH.match(text)
    if not match:
        raise _unreadable("mesh replica_groups format", text)
    axes = re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", match["axes"])
    names = [name for name, _ in axes]
    sizes = [int(size) for _, size in axes]
    if match["dims"] is not None:
        ids = _iota(match["dims"], match["perm"])
    elif match["ids"] is not None:
        ids = np.array(_dims(match["ids"]))
    else:
        ids = np.arange(math.prod(sizes))
    if ids.size != math.prod(sizes):
        raise _unreadable(f"mesh replica_groups: {ids.size} device ids for a mesh of shape {sizes}", text)
    refs = []  # (mesh axis index, pre-size or None for the whole axis, size)
    for item in filter(None, map(str.strip, match["over"].split(","))):  # none: groups of one
        ref = _AXIS_REF.match(item)
        if not ref or ref["name"] not in names:
            raise _unreadable(f"axis {item!r} in mesh replica_groups (the mesh has {names})", text)
        axis = names.index(ref["name"])
        if ref["pre"] is None:
            refs.append((axis, None, sizes[axis]))
        else:
            refs.append((axis, int(ref["pre"]), int(ref["size"])))
    pieces: list[int] = []  # sizes of the mesh axes, split at the sub-axes, major to minor
    position: dict[tuple[int, int | None], int] = {}  # (axis, pre-size) -> index in pieces
    for axis, full in enumerate(sizes):
        cuts = sorted((pre, size) for a, pre, size in refs if a == axis and pre is not None)
        if not cuts:
            position[(axis, None)] = len(pieces)
            pieces.append(full)
            continue
        covered = 1
        for pre, size in cuts:
            if pre != covered:
                pieces.append(pre // covered)
            position[(axis, pre)] = len(pieces)
            pieces.append(size)
            covered = pre * size
        if covered != full:
            pieces.append(full // covered)
    over = [position[(axis, pre)] for axis, pre, _ in refs]
    kept = [i for i in range(len(pieces)) if i not in over]
    grid = np.transpose(ids.reshape(pieces), kept + over)
    return _rows(grid.reshape(-1, math.prod(pieces[i] for i in over)))


def _iota(dims: str, perm: str | None) -> np.ndarray:
    """The flat device ids of `[dims]T(perm)`: an iota reshaped, then transposed."""
    shape = _dims(dims)
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = np.transpose(ids, _dims(perm))
    return ids.reshape(-1)


def _rows(ids: np.ndarray) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(int(i) for i in row) for row in ids)


def _pairs(rest: str) -> tuple[tuple[int, int], ...]:
    start = rest.find("source_target_pairs=")
    if start < 0:
        return ()
    body = _balanced(rest[start + len("source_target_pairs=") :])
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", body))


def _balanced(text: str) -> str:
    """The leading `{...}` block of `text`, braces balanced."""
    depth = 0
    for i, char in enumerate(text):
        depth += char == "{"
        depth -= char == "}"
        if depth == 0:
            return text[: i + 1]
    return text
