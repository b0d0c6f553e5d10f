"""What changes between a saved plan and the current one: `plan_diff`, `PlanDiff`, `LayoutChange`."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ..core._axes import axes_from_json
from ..core._format import format_bytes, to_text
from ..core._plan import Plan

if TYPE_CHECKING:
    import rich.console

__all__ = ["LayoutChange", "PlanDiff", "plan_diff"]


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """One variable whose layout, or share per device, differs between two plans."""

    path: str
    shape: tuple[int, ...]
    before: tuple
    after: tuple
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What changes between a saved plan and the current one.

    Attributes:
        mesh_before, mesh_after: Mesh axis sizes by name.
        changes: Variables whose layout changes: other mesh axes, or the same
            axes with other sizes (a dimension split 4 ways, then 8 ways).
        memory_before, memory_after: Training-state bytes per device (the
            plans' `memory_per_device`: parameters, gradients, optimizer, total).
    """

    mesh_before: Mapping[str, int]
    mesh_after: Mapping[str, int]
    changes: tuple[LayoutChange, ...]
    memory_before: Mapping[str, Any]
    memory_after: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh_before": dict(self.mesh_before),
            "mesh_after": dict(self.mesh_after),
            "changes": [
                {
                    **dataclasses.asdict(c),
                    "shape": list(c.shape),
                    "before": list(c.before),
                    "after": list(c.after),
                }
                for c in self.changes
            ],
            "memory_before": dict(self.memory_before),
            "memory_after": dict(self.memory_after),
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.table import Table
        from rich.text import Text

        def mesh(sizes: Mapping[str, int]) -> str:
            return " × ".join(f"{k}={v}" for k, v in sizes.items())

        table = Table(
            title=f"Layout changes: {mesh(self.mesh_before)} → {mesh(self.mesh_after)}", title_justify="left"
        )
        for column, justify in [
            ("variable", "left"),
            ("shape", "left"),
            ("before", "left"),
            ("after", "left"),
            ("per device before", "right"),
            ("after", "right"),
        ]:
            table.add_column(column, justify=justify, overflow="fold")
        for c in self.changes:
            table.add_row(
                c.path,
                _format_axes(c.shape, None),
                _format_axes(c.before, self.mesh_before),
                _format_axes(c.after, self.mesh_after),
                format_bytes(c.bytes_before),
                format_bytes(c.bytes_after),
            )
        if self.changes:
            yield table
        else:
            yield Text(f"No layout changes: {mesh(self.mesh_before)} → {mesh(self.mesh_after)}")
        yield Text(
            f"Training state per device: {format_bytes(self.memory_before['total'])} → "
            f"{format_bytes(self.memory_after['total'])}"
        )

    def __str__(self) -> str:
        return to_text(self, width=140)


def plan_diff(before: Plan | Mapping[str, Any], after: Plan | Mapping[str, Any]) -> PlanDiff:
    """Which variables change layout between two plans, and the memory per device of each.

    Variables are matched in order when both plans list the same shapes in
    the same order (the same model, whatever its layers or optimizer were
    named), and by path otherwise, with any leading model-name scope ignored
    (Keras drops it when a Sequential model is reloaded). A variable changes
    when its mesh axes differ, or its share per device does (same axes, other
    sizes).

    Args:
        before: A `Plan` or its `to_dict()` (e.g. a checkpoint's `plan.json`).
        after: The same for the other plan.

    Returns:
        The `PlanDiff`; `print(diff)` shows a table.
    """
    old = before.to_dict() if isinstance(before, Plan) else before
    new = after.to_dict() if isinstance(after, Plan) else after
    old_vars, new_vars = old["variables"], new["variables"]
    if [v["shape"] for v in old_vars] == [v["shape"] for v in new_vars]:
        pairs = list(zip(old_vars, new_vars, strict=True))
    else:
        by_path = {_short(v["path"]): v for v in old_vars}
        pairs = [(by_path[_short(v["path"])], v) for v in new_vars if _short(v["path"]) in by_path]
    changes = tuple(
        LayoutChange(
            v["path"],
            tuple(v["shape"]),
            axes_from_json(was["axes"]),
            axes_from_json(v["axes"]),
            was["bytes_per_device"],
            v["bytes_per_device"],
        )
        for was, v in pairs
        if was["axes"] != v["axes"] or was["bytes_per_device"] != v["bytes_per_device"]
    )
    return PlanDiff(old["mesh"], new["mesh"], changes, old["memory_per_device"], new["memory_per_device"])


def _format_axes(axes: Sequence[Any], sizes: Mapping[str, int] | None) -> str:
    """`(None, 'model')` with sizes `{'model': 4}` → `(None, model=4)`."""
    inner = ", ".join(
        "None"
        if a is None
        else "(" + ",".join(_format_axes((name,), sizes)[1:-2] for name in a) + ")"
        if isinstance(a, (tuple, list))
        else f"{a}={sizes[a]}"
        if sizes and a in sizes
        else str(a)
        for a in axes
    )
    return f"({inner},)" if len(axes) == 1 else f"({inner})"


def _short(path: str) -> str:
    """A variable path without its first scope, the way Keras sometimes drops it."""
    return path.split("/", 1)[1] if path.count("/") >= 2 else path
