"""Reading collectives out of compiled, partitioned HLO text.

Pure text processing, no JAX: each collective instruction (all-reduce,
all-gather, reduce-scatter, all-to-all, collective-permute, and their
asynchronous `-start` forms) becomes a `Collective` with its payload, its device
groups and the Keras layer its metadata names. Three replica-group formats are
understood:

- explicit groups: `replica_groups={{0,1,2,3},{4,5,6,7}}`;
- iota groups: `replica_groups=[2,4]<=[8]` or `[4,2]<=[2,4]T(1,0)`;
- mesh groups: `replica_groups=mesh['x'=2,'y'=4] {'x'}`, optionally with
  `device_ids=([2,4]T(1,0))` between the mesh and the axes.

An empty `replica_groups={}` means one group of every device.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

import numpy as np

__all__ = ["Collective", "Payload", "parse_collectives", "wire_bytes"]

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1,
    "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e4m3b11fnuz": 1, "f8e3m4": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s+"
    r"(?P<op>(?:" + "|".join(KINDS) + r")(?:-start)?)\((?P<rest>.*)$"
)
_ARRAY = re.compile(r"\b(?P<dtype>[a-z][a-z0-9]*)\[(?P<dims>[0-9,]*)\]")
_GTE = re.compile(
    r"^\s*%?[\w.\-]+\s*=\s*(?P<shape>\S+)\s+get-tuple-element\(%?(?P<source>[\w.\-]+)\),\s*index=(?P<index>\d+)"
)
_OP_NAME = re.compile(r'op_name="(?P<op_name>[^"]*)"')
_IOTA = re.compile(r"\[(?P<groups>\d+),(?P<size>\d+)\]<=\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?")
_MESH = re.compile(
    r"mesh\[(?P<axes>[^\]]*)\](?:,\s*device_ids=\(\[(?P<dims>[\d,]+)\](?:T\((?P<perm>[\d,]+)\))?\))?"
    r"\s*\{(?P<over>[^}]*)\}"
)


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
        return math.prod(self.shape) * _BYTES.get(self.dtype, 4)


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
    """

    name: str
    kind: str
    payloads: tuple[Payload, ...]
    groups: tuple[tuple[int, ...], ...] | None
    pairs: tuple[tuple[int, int], ...] = ()
    op_name: str = ""

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


def wire_bytes(kind: str, result_bytes: float, group_size: int) -> float:
    """Bytes sent per device by one collective, by its kind and result size.

    Ring all-reduce sends 2(n-1)/n of its bytes; all-gather (n-1)/n of the
    gathered result; reduce-scatter (n-1)/n of its input, which is n times the
    scattered result; all-to-all (n-1)/n; a collective-permute sends its
    buffer once.

    Example:
        >>> wire_bytes("all-reduce", 1024, 4)
        1536.0
        >>> wire_bytes("reduce-scatter", 256, 4)
        768.0
    """
    n = group_size
    if kind == "collective-permute":
        return float(result_bytes) if n > 1 else 0.0
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result_bytes
    if kind == "reduce-scatter":
        return float((n - 1) * result_bytes)
    return (n - 1) / n * result_bytes  # all-gather, all-to-all


def parse_collectives(hlo_text: str, device_count: int) -> list[Collective]:
    """Every collective in `hlo_text`, in program order.

    Args:
        hlo_text: HLO module text, e.g. `compiled.as_text()`.
        device_count: Number of devices of the program, for `replica_groups={}`.

    Returns:
        The collectives; `-done` halves of asynchronous pairs are skipped.

    Example:
        >>> text = ("%ar = f32[32,128]{1,0} all-reduce(%x), replica_groups={{0,1},{2,3}}, "
        ...         'to_apply=%add, metadata={op_name="jit(f)/dense/dot_general"}')
        >>> [c] = parse_collectives(text, 4)
        >>> c.kind, c.groups, c.nbytes, c.wire_bytes, c.op_name
        ('all-reduce', ((0, 1), (2, 3)), 16384, 16384.0, 'jit(f)/dense/dot_general')
    """
    lines = hlo_text.splitlines()
    element_names = _tuple_element_op_names(lines)
    found = []
    for line in lines:
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        op, rest = match["op"], match["rest"]
        kind = op.removesuffix("-start")
        arrays = [(m["dtype"], _dims(m["dims"])) for m in _ARRAY.finditer(match["shape"])]
        arrays = _result_arrays(kind, op.endswith("-start"), arrays)
        names = element_names.get(match["name"], {})
        op_name = _first(_OP_NAME.findall(rest))
        payloads = tuple(
            Payload(dtype, shape, names.get(i, op_name)) for i, (dtype, shape) in enumerate(arrays)
        )
        if kind == "collective-permute":
            pairs = _pairs(rest)
            found.append(Collective(match["name"], kind, payloads, None, pairs, op_name))
        else:
            groups = _replica_groups(rest, device_count)
            found.append(Collective(match["name"], kind, payloads, groups, (), op_name))
    return found


def _dims(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.split(",") if d)


def _first(items: Sequence[str]) -> str:
    return items[0] if items else ""


def _result_arrays(kind: str, is_start: bool, arrays: list) -> list:
    """The result arrays of a collective, from the arrays in its result shape.

    An asynchronous all-gather or collective-permute start returns its operands
    and its results (and, for a permute, scalar context words): keep the results.
    """
    if not is_start or kind not in ("all-gather", "collective-permute"):
        return arrays
    data = [a for a in arrays if a[1]] if kind == "collective-permute" else arrays
    return data[len(data) // 2 :]


def _tuple_element_op_names(lines: Iterable[str]) -> dict[str, dict[int, str]]:
    """`{collective name: {tuple index: op_name}}` from get-tuple-element users."""
    names: dict[str, dict[int, str]] = {}
    for line in lines:
        match = _GTE.match(line)
        if match:
            op_name = _first(_OP_NAME.findall(line))
            if op_name:
                names.setdefault(match["source"], {})[int(match["index"])] = op_name
    return names


def _replica_groups(rest: str, device_count: int) -> tuple[tuple[int, ...], ...]:
    start = rest.find("replica_groups=")
    if start < 0:
        return (tuple(range(device_count)),)
    text = rest[start + len("replica_groups=") :]
    if text.startswith("{"):
        body = _balanced(text)
        groups = tuple(
            tuple(int(i) for i in g.split(",") if i.strip()) for g in re.findall(r"\{([^{}]*)\}", body)
        )
        return groups or (tuple(range(device_count)),)
    if text.startswith("mesh"):
        return _mesh_groups(text)
    match = _IOTA.match(text)
    if match:
        ids = _iota(match["dims"], match["perm"])
        return tuple(
            tuple(int(i) for i in row) for row in ids.reshape(int(match["groups"]), int(match["size"]))
        )
    raise ValueError(f"Unrecognised replica_groups format: {text[:80]!r}")


def _mesh_groups(text: str) -> tuple[tuple[int, ...], ...]:
    match = _MESH.match(text)
    if not match:
        raise ValueError(f"Unrecognised mesh replica_groups format: {text[:80]!r}")
    axes = re.findall(r"'?([\w.]+)'?\s*=\s*(\d+)", match["axes"])
    names = [name for name, _ in axes]
    shape = [int(size) for _, size in axes]
    ids = np.arange(math.prod(shape)) if match["dims"] is None else _iota(match["dims"], match["perm"])
    grid = ids.reshape(shape)
    over = [names.index(a.strip().strip("'")) for a in match["over"].split(",") if a.strip()]
    rest = [i for i in range(len(shape)) if i not in over]
    grid = np.transpose(grid, rest + over).reshape(-1, math.prod(shape[i] for i in over))
    return tuple(tuple(int(i) for i in row) for row in grid)


def _iota(dims: str, perm: str | None) -> np.ndarray:
    shape = _dims(dims)
    ids = np.arange(math.prod(shape)).reshape(shape)
    if perm:
        ids = np.transpose(ids, _dims(perm))
    return ids.reshape(-1)


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
