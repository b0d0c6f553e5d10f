"""Pictures of a layout in the terminal: the mesh, and a variable's blocks.

The pictures are `rich` renderables (`rich.print(picture)` for colour,
`print(picture)` for plain text). Blocks are worked out here from the mesh and
the layout alone, the way JAX's `NamedSharding` places them, so any rank is
drawn: a rank-1 or rank-2 variable as a grid, anything higher as a table of
index ranges. The plan as a PNG (matplotlib) is `core/_plot.py`'s `plot_plan`.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core._axes import shards_of
from ..core._errors import IndivisibleShapeError, InvalidOptionError, InvalidRuleError, RankMismatchError
from ..core._format import Displayed, format_axes, format_bytes, id_ranges, mesh_text
from ..core._held import held, held_array
from ..core._mesh import device_id_grid, mesh_axis_sizes, platform_name
from ..core._resolve import Resolution

if TYPE_CHECKING:
    import jax
    import keras


__all__ = ["Picture", "ShardBlock", "sharding_blocks", "show_mesh", "show_sharding"]

#: One layout entry: a mesh-axis name, several (the dimension is split over their product,
#: the first major), or `None`.
AxisEntry = str | Sequence[str] | None

#: Light backgrounds for blocks, readable with black text; reused past twelve blocks.
_BLOCK_COLOURS = (
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#dbdb8d",
    "#9edae5",
    "#d9d9d9",
    "#fdd0a2",
    "#c7e9c0",
)


class Picture(Displayed):
    """A terminal picture: a `rich` renderable that also prints as plain text.

    `rich.print(picture)` (or `console.print(picture)`) draws it in colour;
    `print(picture)` or `str(picture)` gives the same drawing without colour; as a
    notebook cell's value it shows in colour (`_repr_html_`).
    """

    def __init__(self, renderable: Any, *, width: int = 160) -> None:
        self.renderable = renderable
        self.width = width

    def __rich__(self) -> Any:
        return self.renderable

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=self.width, force_terminal=False, color_system=None).print(self)
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


@dataclasses.dataclass(frozen=True)
class ShardBlock:
    """One block of a variable and the devices that hold it.

    Attributes:
        ranges: `(start, stop)` of the block in each dimension.
        devices: Ids of the devices holding this block, in mesh order.
    """

    ranges: tuple[tuple[int, int], ...]
    devices: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        """The block's shape."""
        return tuple(stop - start for start, stop in self.ranges)

    @property
    def index(self) -> tuple[slice, ...]:
        """The block as an index into the whole array: `array[block.index]`."""
        return tuple(slice(start, stop) for start, stop in self.ranges)

    def __str__(self) -> str:
        return "[" + ", ".join(f"{start}:{stop}" for start, stop in self.ranges) + "]"


# -- the mesh ---------------------------------------------------------------------


def show_mesh(mesh: keras.distribution.DeviceMesh) -> Picture:
    """Draws the mesh: its axes, and the id of the device at each position.

    A 1-D mesh is one row; a 2-D mesh a grid with the first axis down and the
    second across; a mesh of three or more axes one such grid per index of its
    leading axes, each labelled.

    Args:
        mesh: A `kml.Mesh`, or a `keras.distribution.DeviceMesh` or
            `jax.sharding.Mesh` of JAX devices.

    Returns:
        A `Picture`: `rich.print` it, or `print` it as plain text.

    Example:
        >>> import keras_meshlayout as kml
        >>> print(kml.show_mesh(kml.Mesh(data=2, model=4)))
        Mesh data=2 × model=4: 8 cpu devices (device ids)
        ┏━━━━━━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━┳━━━━━━━━━┓
        ┃ data ╲ model ┃ model 0 ┃ model 1 ┃ model 2 ┃ model 3 ┃
        ┡━━━━━━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━╇━━━━━━━━━┩
        │ data 0       │    0    │    1    │    2    │    3    │
        │ data 1       │    4    │    5    │    6    │    7    │
        └──────────────┴─────────┴─────────┴─────────┴─────────┘
    """
    from rich.columns import Columns
    from rich.console import Group
    from rich.panel import Panel
    from rich.text import Text

    ids = device_id_grid(mesh)
    names = tuple(mesh.axis_names)
    header = Text.assemble(
        ("Mesh ", "bold"),
        (mesh_text(names, ids.shape), "bold"),
        f": {_plural(ids.size, platform_name(mesh) + ' device')} (device ids)",
    )
    if ids.ndim <= 2:
        return Picture(Group(header, _mesh_table(names[-2:], ids.reshape(ids.shape[-2:]))))
    lead_names, lead_shape = names[:-2], ids.shape[:-2]
    panels = []
    for lead in np.ndindex(*lead_shape):
        label = ", ".join(f"{name}={index}" for name, index in zip(lead_names, lead, strict=True))
        panels.append(Panel.fit(_mesh_table(names[-2:], ids[lead]), title=label, border_style="dim"))
    return Picture(Group(header, Columns(panels)))


def _mesh_table(names: tuple[str, ...], ids: np.ndarray) -> Any:
    """One grid of device ids: rows over `names[0]`, columns over `names[1]` (1-D: one row)."""
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=True, header_style="bold")
    if len(names) == 1:
        for index in range(ids.shape[0]):
            table.add_column(f"{names[0]} {index}", justify="center")
        table.add_row(*(Text(str(i), style="bold") for i in ids))
        return table
    rows, columns = names
    table.add_column(f"{rows} ╲ {columns}", style="bold")
    for index in range(ids.shape[1]):
        table.add_column(f"{columns} {index}", justify="center")
    for index, row in enumerate(ids):
        table.add_row(f"{rows} {index}", *(Text(str(i), style="bold") for i in row))
    return table


# -- a variable's blocks -------------------------------------------------------------


def sharding_blocks(
    mesh: keras.distribution.DeviceMesh, shape: Sequence[int], axes: Sequence[AxisEntry]
) -> list[ShardBlock]:
    """Which block of a variable each device holds.

    A dimension split over mesh axis `a` of size `n` is cut into `n` equal
    ranges; the device at coordinate `c` along `a` holds range `c`. A dimension
    split over several axes is cut into the product of their sizes, the first
    axis major (as `jax.sharding.PartitionSpec(("data", "model"))` does).
    Devices along axes the layout does not use hold the same block.

    Args:
        mesh: A `kml.Mesh`, or a `keras.distribution.DeviceMesh` or
            `jax.sharding.Mesh` of JAX devices.
        shape: The variable's shape.
        axes: Its layout: per dimension a mesh-axis name, a tuple of names,
            or `None`, as in `Resolution.axes`.

    Returns:
        The distinct blocks, sorted by their index ranges, each with the ids
        of the devices holding it in mesh order.

    Raises:
        RankMismatchError: `axes` does not have one entry per dimension.
        InvalidRuleError: `axes` names an axis the mesh does not have, or one
            axis twice.
        IndivisibleShapeError: a split dimension does not divide evenly.

    Example:
        >>> import keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> for block in kml.sharding_blocks(mesh, (64, 8, 16), (None, "model", None)):
        ...     print(block, block.devices)
        [0:64, 0:2, 0:16] (0, 4)
        [0:64, 2:4, 0:16] (1, 5)
        [0:64, 4:6, 0:16] (2, 6)
        [0:64, 6:8, 0:16] (3, 7)
    """
    ids = device_id_grid(mesh)
    names = tuple(mesh.axis_names)
    sizes = dict(zip(names, ids.shape, strict=True))
    shape = tuple(int(size) for size in shape)
    splits = _splits(shape, axes, sizes)
    held: dict[tuple[tuple[int, int], ...], list[int]] = {}
    for coords in np.ndindex(*ids.shape):
        at = dict(zip(names, coords, strict=True))
        ranges = []
        for size, split in zip(shape, splits, strict=True):
            index, pieces = 0, 1
            for axis in split:
                index = index * sizes[axis] + at[axis]
                pieces *= sizes[axis]
            step = size // pieces
            ranges.append((index * step, (index + 1) * step))
        held.setdefault(tuple(ranges), []).append(int(ids[coords]))
    return [ShardBlock(ranges, tuple(devices)) for ranges, devices in sorted(held.items())]


def show_sharding(
    mesh: keras.distribution.DeviceMesh,
    variable: Resolution | Sequence[int] | keras.Variable | jax.Array,
    axes: Sequence[AxisEntry] | None = None,
) -> Picture:
    """Draws which block of a variable each device holds.

    Given a live `keras.Variable` or `jax.Array`, it draws what the array really
    holds (its sharding), and, for a variable under a `kml.ModelParallel` in force,
    what the rules give beside it, so a picture confirms what a variable got.

    A rank-1 or rank-2 variable is drawn as a grid of its blocks, labelled by
    their index ranges, with the devices holding each; a variable of rank 3 or
    more (an attention kernel `(hidden, heads, head_dim)`, a convolution
    kernel) as a table of blocks: index ranges, shape, devices.

    Args:
        mesh: The mesh the variable lives on (see `sharding_blocks`).
        variable: A `kml.Resolution`, such as `plan["model/dense/kernel"]`,
            a shape, or a live `keras.Variable` or `jax.Array` on the mesh.
        axes: The layout, when `variable` is a shape (see `sharding_blocks`).

    Returns:
        A `Picture`: `rich.print` it, or `print` it as plain text.

    Raises:
        InvalidOptionError: `axes` missing with a shape, or given with a
            `Resolution` or a live array (which have their own); a live array not
            on `mesh`.
        RankMismatchError, InvalidRuleError, IndivisibleShapeError: as in
            `sharding_blocks`.

    Example:
        >>> import keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> print(kml.show_sharding(mesh, (8, 16), (None, "model")))
        shape (8, 16) · layout (None, model) · mesh data=2 × model=4
        4 blocks of shape (8, 4), each on 2 devices: dim 1 split over model (4), replicated over data (2)
        ┏━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━┳━━━━━━━━━━━┳━━━━━━━━━━━━┓
        ┃          ┃ [:, 0:4] ┃ [:, 4:8] ┃ [:, 8:12] ┃ [:, 12:16] ┃
        ┡━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━╇━━━━━━━━━━━╇━━━━━━━━━━━━┩
        │ [0:8, :] │   0, 4   │   1, 5   │   2, 6    │    3, 7    │
        └──────────┴──────────┴──────────┴───────────┴────────────┘
        Cells: the ids of the devices holding each block.
    """
    from rich.console import Group
    from rich.text import Text

    extra: list[str] = []
    if _is_live(variable):
        variable, axes, extra = _live(mesh, variable, axes)
    if isinstance(variable, Resolution):
        if axes is not None:
            raise InvalidOptionError(
                f"show_sharding takes the layout of {variable.path!r} from its Resolution "
                f"({format_axes(variable.axes)}); pass axes only with a shape. Received: axes={axes!r}."
            )
        shape, axes = variable.shape, variable.axes
        title = f"{variable.path} {format_axes(shape)} {variable.dtype}"
    else:
        if axes is None:
            raise InvalidOptionError(
                f"show_sharding needs the layout of a shape: pass axes, one mesh-axis name or None per "
                f"dimension. Received: shape {tuple(variable)!r}, axes=None. Example: "
                f"show_sharding(mesh, {tuple(variable)!r}, {format_axes((None,) * len(tuple(variable)))})."
            )
        shape = tuple(int(size) for size in variable)
        title = f"shape {format_axes(shape)}"
    blocks = sharding_blocks(mesh, shape, axes)
    ids = device_id_grid(mesh)
    sizes = mesh_axis_sizes(mesh)
    layout = tuple(entry if entry is None or isinstance(entry, str) else "×".join(entry) for entry in axes)
    lines = [
        Text(f"{title} · layout {format_axes(layout)} · mesh {mesh_text(tuple(sizes), ids.shape)}", "bold"),
        *(Text(line) for line in extra),
        Text(_summary(blocks, _splits(shape, axes, sizes), sizes, variable)),
    ]
    colours = {block.ranges: _BLOCK_COLOURS[i % len(_BLOCK_COLOURS)] for i, block in enumerate(blocks)}
    if 1 <= len(shape) <= 2:
        grid = _block_grid(blocks, len(shape), colours)
        return Picture(Group(*lines, grid, Text("Cells: the ids of the devices holding each block.", "dim")))
    return Picture(Group(*lines, _block_table(blocks, shape, colours)))


def _is_live(value: Any) -> bool:
    import jax
    import keras

    return isinstance(value, (keras.Variable, jax.Array))


def _live(mesh: Any, value: Any, axes: Any) -> tuple[Resolution, Any, list[str]]:
    """A live variable or array as the `Resolution` of what it holds, and what the rules give."""
    import keras

    from ..core._distribution import ModelParallel

    is_variable = isinstance(value, keras.Variable)
    name = value.path if is_variable else "array"
    if axes is not None:
        raise InvalidOptionError(
            f"show_sharding reads the layout of {name} from its array; pass axes only with a shape. "
            f"Received: axes={axes!r}."
        )
    shape = tuple(int(size) for size in value.shape)
    dtype = str(keras.backend.standardize_dtype(value.dtype))
    found = held(value, mesh) if is_variable else held_array(value, mesh, len(shape))
    if found is None or not found.on_mesh or found.axes is None:
        where = "holds no array" if found is None else f"lives on {found.devices} device(s), not on this mesh"
        raise InvalidOptionError(
            f"show_sharding: {name} {format_axes(shape)} {where} ({mesh!r}), so it has no blocks here to "
            "draw. Fix: pass the mesh it lives on, or build the model under the distribution "
            "(`with dist.scope(): ...`)."
        )
    array = value.value if is_variable else value
    entry = Resolution(
        path=name,
        shape=shape,
        dtype=dtype,
        rule=None,
        requested=None,
        axes=found.axes,
        shards=shards_of(found.axes, mesh_axis_sizes(mesh)),
        nbytes=math.prod(shape) * array.dtype.itemsize,
    )
    lines = [f"holds {format_axes(found.axes)} (read from its array)"]
    current = keras.distribution.distribution()
    if is_variable and isinstance(current, ModelParallel):
        given = current.resolve(value.path, shape, dtype, warn=False).axes
        same = "the same" if given == found.axes else "it differs: see dist.plan(model)"
        lines.append(f"the rules give {format_axes(given)}: {same}")
    return entry, None, lines


def _summary(
    blocks: list[ShardBlock], splits: list[tuple[str, ...]], sizes: dict[str, int], variable: Any
) -> str:
    block = blocks[0]
    holders = _plural(len(block.devices), "device")
    if len(blocks) == 1:
        text = f"1 block of shape {format_axes(block.shape)}, on all {holders}"
    else:
        text = f"{len(blocks)} blocks of shape {format_axes(block.shape)}, each on {holders}"
    parts = [
        f"dim {dim} split over {' × '.join(f'{axis} ({sizes[axis]})' for axis in axes)}"
        for dim, axes in enumerate(splits)
        if axes
    ]
    used = {axis for axes in splits for axis in axes}
    copies = [f"{axis} ({size})" for axis, size in sizes.items() if axis not in used and size > 1]
    if parts and copies:
        parts.append(f"replicated over {', '.join(copies)}")
    text += ": " + (", ".join(parts) or "not split")
    if isinstance(variable, Resolution):
        text += f"; {format_bytes(variable.bytes_per_device)} per device"
    return text


def _block_grid(blocks: list[ShardBlock], rank: int, colours: dict) -> Any:
    """Rank 1 or 2: rows are the ranges of dimension 0 (rank 2), columns those of the last."""
    from rich.table import Table
    from rich.text import Text

    rows = sorted({block.ranges[0] for block in blocks}) if rank == 2 else [None]
    columns = sorted({block.ranges[-1] for block in blocks})
    at = {(block.ranges[0] if rank == 2 else None, block.ranges[-1]): block for block in blocks}
    table = Table(show_header=True, header_style="bold")
    if rank == 2:
        table.add_column("", style="bold")
    for start, stop in columns:
        table.add_column(f"[:, {start}:{stop}]" if rank == 2 else f"[{start}:{stop}]", justify="center")
    for row in rows:
        cells = []
        for column in columns:
            block = at[(row, column)]
            cells.append(Text(id_ranges(block.devices), style=f"black on {colours[block.ranges]}"))
        table.add_row(*([f"[{row[0]}:{row[1]}, :]"] if row is not None else []), *cells)
    return table


def _block_table(blocks: list[ShardBlock], shape: tuple[int, ...], colours: dict) -> Any:
    """Any rank: one row per block, with its index ranges, shape and devices."""
    from rich.table import Table
    from rich.text import Text

    table = Table(show_header=True, header_style="bold")
    table.add_column("block", justify="right")
    table.add_column("index" if shape else "index (scalar)")
    table.add_column("shape")
    table.add_column("devices", overflow="fold")
    for number, block in enumerate(blocks):
        table.add_row(
            Text(f" {number} ", style=f"black on {colours[block.ranges]}"),
            str(block),
            format_axes(block.shape),
            id_ranges(block.devices),
        )
    return table


def _splits(
    shape: tuple[int, ...], axes: Sequence[AxisEntry], sizes: dict[str, int]
) -> list[tuple[str, ...]]:
    """Per dimension, the mesh axes splitting it; checks rank, names and divisibility."""
    axes = tuple(axes)
    if len(axes) != len(shape):
        raise RankMismatchError(
            f"Layout {format_axes(axes)} has {len(axes)} entries but the shape {shape} has rank "
            f"{len(shape)}. A layout needs one entry per dimension: a mesh-axis name or None."
        )
    splits: list[tuple[str, ...]] = []
    seen: set[str] = set()
    for dim, entry in enumerate(axes):
        split = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        for axis in split:
            if axis not in sizes:
                raise InvalidRuleError(
                    f"Layout {format_axes(axes)} names mesh axis {axis!r}, but the mesh has axes "
                    f"{tuple(sizes)}. Fix: use one of those or None."
                )
            if axis in seen:
                raise InvalidRuleError(
                    f"Layout {format_axes(axes)} uses mesh axis {axis!r} twice; a mesh axis can split "
                    "one dimension only."
                )
            seen.add(axis)
        pieces = math.prod(sizes[axis] for axis in split)
        if shape[dim] % pieces:
            raise IndivisibleShapeError(
                f"Layout {format_axes(axes)} splits dimension {dim} (size {shape[dim]}) of shape {shape} "
                f"over {' × '.join(f'{a} ({sizes[a]})' for a in split)}, and {shape[dim]} is not a "
                f"multiple of {pieces}: the blocks would be uneven. Fix: put None on dimension {dim}."
            )
        splits.append(split)
    return splits


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
