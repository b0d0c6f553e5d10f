"""The plan as a picture (PNG, SVG, PDF): memory per device, the mesh, the largest variables.

Drawn with matplotlib, an optional extra, imported only when a plot is asked for,
with the Agg renderer and without `matplotlib.pyplot`. It lives in core, beside the
`Plan` it draws, so that `Plan.plot` needs nothing from a higher layer; the
terminal pictures are in `report/_pictures.py`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ._errors import InvalidOptionError
from ._format import format_axes, format_bytes, mesh_text
from ._memory import MemoryEstimate, memory_of
from ._mesh import device_id_grid, platform_name

if TYPE_CHECKING:
    import keras

    from ._resolve import Resolution


class PlottedPlan(Protocol):
    """What the picture reads of a plan (`kml.Plan` has it): its entries, mesh and capacity."""

    @property
    def entries(self) -> Sequence[Resolution]: ...
    @property
    def axis_sizes(self) -> Mapping[str, int]: ...
    @property
    def batch_axis(self) -> str: ...
    @property
    def device_capacity(self) -> int | None: ...


__all__ = ["plot_plan"]

_PLOT_INSTALL_HINT = (
    "Plotting a plan needs matplotlib, which is not installed. "
    'Install it with: pip install matplotlib (or, from the keras_meshlayout checkout, pip install ".[plot]")'
)

# The PNG: 12 × 5 inches at 100 dpi, i.e. 1200 × 500 pixels.
FIGURE_SIZE = (12.0, 5.0)
FIGURE_DPI = 100


def plot_plan(
    plan: PlottedPlan,
    path: str | os.PathLike,
    *,
    top: int = 8,
    mesh: keras.distribution.DeviceMesh | None = None,
    device_memory: int | str | None = None,
) -> Path:
    """Writes a picture of the plan: memory per device, and the mesh with the largest variables.

    Left: one bar per device, split into parameters, gradients and optimizer
    state, against the device capacity when it is known. Right: the mesh grid
    with each device's id, and the `top` largest model variables with their
    layouts and bytes per device. The figure is 12 × 5 inches at 100 dpi
    (a PNG of 1200 × 500 pixels), drawn with matplotlib's Agg renderer without
    touching `matplotlib.pyplot`.

    Args:
        plan: The plan, from `dist.plan(model)` or `kml.dry_plan`.
        path: Where to write; the extension picks the format (`.png`, `.svg`,
            `.pdf`, ...).
        top: How many of the largest model variables to list.
        mesh: The mesh, to label devices by their ids; without it they are
            labelled by mesh position (row-major), which is the device id on
            meshes of emulated CPU devices.
        device_memory: Device capacity, as in `Plan.memory`.

    Returns:
        The path written.

    Raises:
        ImportError: matplotlib is not installed (`pip install matplotlib`).
        InvalidOptionError: `top` is negative, or `mesh` does not match the plan's axes.
    """
    figure_class, canvas_class = _matplotlib()
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise InvalidOptionError(f"top must be a non-negative integer. Received: top={top!r}.")
    names, shape = tuple(plan.axis_sizes), tuple(plan.axis_sizes.values())
    if mesh is None:
        ids, platform = np.arange(math.prod(shape)).reshape(shape), None
    else:
        ids, platform = device_id_grid(mesh), platform_name(mesh)
        if tuple(mesh.axis_names) != names or ids.shape != shape:
            raise InvalidOptionError(
                f"plot_plan got the mesh {mesh_text(tuple(mesh.axis_names), ids.shape)}, but the plan "
                f"was made on {mesh_text(names, shape)}. Pass the mesh the plan was made on, or none."
            )
    memory = memory_of(plan.entries, plan.device_capacity if device_memory is None else device_memory)

    figure = figure_class(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
    canvas_class(figure)
    figure.text(
        0.5,
        0.965,
        f"Layout plan on mesh {mesh_text(names, shape)}, batch over {plan.batch_axis!r}",
        ha="center",
        va="center",
        fontsize=13,
        weight="bold",
    )
    labelled = mesh is not None
    _memory_bars(figure.add_axes((0.065, 0.12, 0.4, 0.72)), memory, ids.ravel(), labelled=labelled)
    _mesh_grid(figure.add_axes((0.575, 0.56, 0.36, 0.27)), names, ids, plan.batch_axis, platform, labelled)
    _variable_table(figure.add_axes((0.52, 0.03, 0.465, 0.43)), plan, top)
    path = Path(path)
    figure.savefig(path, dpi=FIGURE_DPI)
    return path


def _matplotlib() -> tuple[Any, Any]:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(_PLOT_INSTALL_HINT) from err
    return Figure, FigureCanvasAgg


_ROLE_COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer": "#55a868"}


def _memory_bars(ax: Any, memory: MemoryEstimate, ids: np.ndarray, *, labelled: bool) -> None:
    """Stacked bars, one per device (under even splits every device holds the same bytes)."""
    capacity = memory.capacity if _capacity_in_view(memory) else None
    scale, unit = _unit(max(memory.total, capacity or 0))
    positions = np.arange(len(ids))
    bottom = np.zeros(len(ids))
    for role in ("parameters", "gradients", "optimizer"):
        values = np.full(len(ids), getattr(memory, role) / scale)
        ax.bar(positions, values, bottom=bottom, color=_ROLE_COLOURS[role], width=0.7, label=role)
        bottom += values
    ceiling = float(bottom.max(initial=0.0))
    if capacity is not None:
        ax.axhline(capacity / scale, color="#c44e52", linestyle="--", linewidth=1.5, label="capacity")
        ceiling = max(ceiling, capacity / scale)
    ax.set_ylim(0, ceiling * 1.25 or 1.0)
    every = math.ceil(len(ids) / 16)  # at most 16 labels
    ax.set_xticks(positions[::every], [str(i) for i in ids[::every]], fontsize=8)
    ax.set_xlabel("device id" if labelled else "device (mesh position, row-major)", fontsize=9)
    ax.set_ylabel(f"training state, activations not counted ({unit})", fontsize=9)
    title = f"Memory per device: {format_bytes(memory.total)}"
    if memory.capacity is not None:
        title += f" of {format_bytes(memory.capacity)} ({memory.total / memory.capacity:.0%})"
    if memory.fits is False:
        title += ": does not fit"
    ax.set_title(
        title,
        fontsize=10,
        color="#c44e52" if memory.fits is False else "black",
    )
    ax.legend(loc="upper center", ncols=4, fontsize=8, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    ax.set_axisbelow(True)
    ax.spines[["top", "right"]].set_visible(False)


def _capacity_in_view(memory: MemoryEstimate) -> bool:
    """The capacity line is drawn only where it does not squash the bars to nothing."""
    return memory.capacity is not None and memory.capacity <= 5 * max(memory.total, 1)


def _unit(count: float) -> tuple[float, str]:
    scale, unit = 1.0, "B"
    for name in ("KiB", "MiB", "GiB", "TiB"):
        if count < scale * 1024:
            break
        scale, unit = scale * 1024, name
    return scale, unit


#: Cell colours of the mesh grid, one per index along the batch axis.
_SHARD_COLOURS = ("#dbe6f4", "#fde3c8", "#dcefd5", "#f6d6d6", "#e6dff0", "#ece0da", "#f8e1ef", "#eeeed2")


def _mesh_grid(
    ax: Any, names: tuple[str, ...], ids: np.ndarray, batch_axis: str, platform: str | None, labelled: bool
) -> None:
    """The device grid: the last axis across, the leading axes down; colour by batch shard."""
    from matplotlib.patches import Rectangle

    columns = ids.shape[-1]
    rows = ids.size // columns
    batch = list(names).index(batch_axis) if batch_axis in names else None
    # Ids are written in the cells while they fit: up to 8 rows and 16 columns.
    fontsize = 10 if rows <= 4 and columns <= 8 else 7 if rows <= 8 and columns <= 16 else None
    for row, lead in enumerate(np.ndindex(*ids.shape[:-1])):
        for column in range(columns):
            coords = (*lead, column)
            shard = coords[batch] if batch is not None else 0
            ax.add_patch(
                Rectangle(
                    (column, rows - 1 - row),
                    1,
                    1,
                    facecolor=_SHARD_COLOURS[shard % len(_SHARD_COLOURS)],
                    edgecolor="#4c72b0",
                    linewidth=1.0,
                )
            )
            if fontsize is None:
                continue
            ax.text(
                column + 0.5,
                rows - 0.5 - row,
                str(ids[coords]),
                ha="center",
                va="center",
                fontsize=fontsize,
                weight="bold",
            )
    row_labels = [
        ", ".join(f"{name}={i}" for name, i in zip(names[:-1], lead, strict=True))
        for lead in np.ndindex(*ids.shape[:-1])
    ]
    ax.set_xlim(0, columns)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal" if rows <= 4 else "auto", adjustable="box")
    every = math.ceil(columns / 16)
    ax.set_xticks(np.arange(0, columns, every) + 0.5, [str(i) for i in range(0, columns, every)], fontsize=8)
    ax.set_xlabel(f"{names[-1]} →", fontsize=9)
    ax.xaxis.set_label_position("top")
    ax.xaxis.tick_top()
    every = math.ceil(rows / 8)
    labels = row_labels[::every] if len(names) > 1 else [""]
    ax.set_yticks([rows - 0.5 - row for row in range(0, rows, every)], labels, fontsize=8)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    title = [f"Mesh: {ids.size}{' ' + platform if platform else ''} devices"]
    if fontsize is not None:
        title.append("cells: " + ("device ids" if labelled else "mesh positions"))
    if batch is not None and ids.shape[batch] > 1:
        title.append(f"colour: {batch_axis} index")
    ax.set_title("; ".join(title), fontsize=10, pad=4)


def _variable_table(ax: Any, plan: PlottedPlan, top: int) -> None:
    """The `top` model variables largest per device: path, shape, layout, bytes per device."""
    ax.axis("off")
    model = [entry for entry in plan.entries if entry.role != "optimizer"] or list(plan.entries)
    largest = sorted(model, key=lambda entry: (-entry.bytes_per_device, -entry.nbytes))[:top]
    more = len(model) - len(largest)
    title = f"Largest variables per device ({len(largest)} of {len(model)}"
    ax.set_title(title + "; optimizer slots follow their parameter)", fontsize=10, pad=4)
    if not largest:
        ax.text(0.5, 0.5, "no variables", ha="center", va="center")
        return
    rows = [
        [
            _short(entry.path, 40),
            format_axes(entry.shape),
            format_axes(entry.axes),
            format_bytes(entry.bytes_per_device),
        ]
        for entry in largest
    ]
    if more:
        rows.append([f"… {more} more", "", "", ""])
    height = min(1.0, 0.1 * (len(rows) + 1))
    table = ax.table(
        cellText=rows,
        colLabels=["variable", "shape", "layout", "per device"],
        colWidths=[0.45, 0.16, 0.25, 0.14],
        cellLoc="left",
        colLoc="left",
        bbox=(0.0, 1.0 - height, 1.0, height),
    )
    table.auto_set_font_size(False)
    table.set_fontsize(7.5)
    for (row, column), cell in table.get_celld().items():
        cell.set_edgecolor("#cccccc")
        cell.set_linewidth(0.6)
        cell.PAD = 0.03
        if row == 0:
            cell.set_text_props(weight="bold")
            cell.set_facecolor("#e8e8e8")
        elif column == 2 and row <= len(largest) and not largest[row - 1].replicated:
            cell.set_text_props(weight="bold", color="#2a7a2a")


def _short(text: str, width: int) -> str:
    """Keeps the end of a long path, where the layer and variable names are."""
    return text if len(text) <= width else "…" + text[-(width - 1) :]
