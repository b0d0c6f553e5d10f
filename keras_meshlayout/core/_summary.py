"""Big plans in a few lines: repeated blocks folded (`block{0..31}/attn/kernel`), largest first.

A 7 B model's plan has thousands of rows, most of them one transformer block's variables
again with another index. Rows that differ only in the numbers of their path, and agree on
shape, dtype, role and layout, fold into one row with the numbers as a range.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ._format import format_axes, format_bytes
from ._resolve import Resolution

__all__ = ["Folded", "fold", "folded_table"]

_NUMBER = re.compile(r"\d+")


@dataclasses.dataclass(frozen=True)
class Folded:
    """One row of a summary: `count` variables alike but for the numbers in their paths.

    Attributes:
        path: The shared path, each varying number written as a set (`{0..31}`, `{1,3}`).
        first: The first variable of the row (its shape, dtype, layout, why).
        count: How many variables the row stands for.
    """

    path: str
    first: Resolution
    count: int

    @property
    def bytes_per_device(self) -> int:
        """Bytes per device of all the row's variables."""
        return self.first.bytes_per_device * self.count


def fold(entries: Sequence[Resolution]) -> list[Folded]:
    """Entries alike but for the numbers in their paths, as one row each, in plan order.

    Example:
        >>> from keras_meshlayout.core._resolve import Resolution
        >>> def entry(path):
        ...     return Resolution(path, (4, 4), "float32", None, None, (None, "model"), nbytes=64, shards=4)
        >>> [f"{row.path} x{row.count}" for row in fold([entry(f"m/block_{i}/kernel") for i in range(32)])]
        ['m/block_{0..31}/kernel x32']
    """
    groups: dict[tuple, list[tuple[list[int], Resolution]]] = {}
    for entry in entries:
        numbers = [int(found) for found in _NUMBER.findall(entry.path)]
        key = (_NUMBER.sub("#", entry.path), entry.shape, entry.dtype, entry.axes, entry.role, entry.source)
        groups.setdefault(key, []).append((numbers, entry))
    rows = []
    for (template, *_), members in groups.items():
        slots = list(zip(*(numbers for numbers, _ in members), strict=True))
        pieces = template.split("#")
        path = pieces[0] + "".join(
            _slot(values) + piece for values, piece in zip(slots, pieces[1:], strict=True)
        )
        rows.append(Folded(path=path, first=members[0][1], count=len(members)))
    return rows


def _slot(values: Sequence[int]) -> str:
    distinct = sorted(set(values))
    if len(distinct) == 1:
        return str(distinct[0])
    if distinct == list(range(distinct[0], distinct[-1] + 1)):
        return f"{{{distinct[0]}..{distinct[-1]}}}"
    return "{" + ",".join(map(str, distinct)) + "}"


def folded_table(rows: Sequence[Folded], title: str, why: Any) -> Any:
    """The summary's table: one row per folded group, with its count and bytes per device."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for column, justify in [
        ("variable", "left"),
        ("×", "right"),
        ("shape", "left"),
        ("dtype", "left"),
        ("layout", "left"),
        ("per device", "right"),
        ("why", "left"),
    ]:
        table.add_column(column, justify=justify, overflow="fold")
    for row in rows:
        entry = row.first
        table.add_row(
            row.path,
            str(row.count),
            format_axes(entry.shape),
            entry.dtype,
            Text(format_axes(entry.axes), style="bold green" if not entry.replicated else ""),
            format_bytes(row.bytes_per_device),
            why(entry),
        )
    return table
