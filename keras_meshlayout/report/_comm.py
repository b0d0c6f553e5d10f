"""The communication report: what one compiled training step sends, and where.

`comm_report` compiles the model's own Keras train step for the current
distribution, from abstract shapes only (nothing runs, no buffer is donated),
and reads the partitioned HLO with `_hlo.parse_collectives`.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _compat
from ..core._errors import InvalidOptionError
from ..core._format import Displayed, format_bytes, to_text
from ..core._mesh import jax_device_grid, mesh_axis_sizes
from ._collectives import wire_bytes
from ._hlo import Collective, parse_collectives
from ._megascale import parse_dcn_collectives

if TYPE_CHECKING:
    import keras
    import rich.console

__all__ = ["CommReport", "Transfer", "comm_report", "report_of", "xla_flops"]


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One array moved by one collective (a combined collective moves several).

    Attributes:
        collective: Name of the HLO instruction.
        kind: `all-reduce`, `all-gather`, `reduce-scatter`, `all-to-all` or
            `collective-permute`.
        axes: Mesh axes the collective runs over.
        group_size: Devices per group.
        shape: Shape of the array (the result, per device).
        dtype: HLO element type.
        nbytes: Bytes of the array on each device.
        wire_bytes: Bytes each device sends for it (ring algorithms).
        layer: The Keras layer the metadata names (`"attn/query"`), or `""`.
        phase: `"forward"`, `"backward"` or `"update"` (optimizer and metrics).
        network: `"ici"` within a slice, `"dcn"` between the slices of a multi-slice target.
    """

    collective: str
    kind: str
    axes: tuple[str, ...]
    group_size: int
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    wire_bytes: float
    layer: str
    phase: str
    network: str = "ici"

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "axes": list(self.axes), "shape": list(self.shape)}


@dataclasses.dataclass(frozen=True)
class CommReport(Displayed):
    """The collectives, memory and FLOPs of one compiled training step.

    Attributes:
        axis_sizes: Mesh axis sizes by name.
        collectives: Every collective instruction, as parsed.
        transfers: One `Transfer` per array moved.
        memory: Per-device bytes from XLA's `memory_analysis()`: `arguments`,
            `outputs`, `temporaries`, `aliased`, `code`, `live_peak` (XLA's
            `peak_memory_in_bytes`) and `total`.
        flops_per_device: FLOPs of the partitioned program on one device.
        flops_unpartitioned: FLOPs of the whole program before partitioning.
    """

    axis_sizes: Mapping[str, int]
    collectives: tuple[Collective, ...]
    transfers: tuple[Transfer, ...]
    memory: Mapping[str, int]
    flops_per_device: float
    flops_unpartitioned: float

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per step, all collectives together."""
        return sum(t.wire_bytes for t in self.transfers)

    @property
    def wire_bytes_by_axis(self) -> dict[str, float]:
        """Bytes each device sends per step, by the mesh axes of the collective."""
        totals: dict[str, float] = collections.defaultdict(float)
        for t in self.transfers:
            totals["×".join(t.axes) or "-"] += t.wire_bytes
        return dict(totals)

    @property
    def wire_bytes_by_network(self) -> dict[str, float]:
        """Bytes each device sends per step within its slice (`"ici"`) and between slices (`"dcn"`)."""
        totals = {"ici": 0.0, "dcn": 0.0}
        for t in self.transfers:
            totals[t.network] += t.wire_bytes
        return totals

    def count(self, kind: str) -> int:
        """Number of collective instructions of `kind`."""
        return sum(c.kind == kind for c in self.collectives)

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh": dict(self.axis_sizes),
            "wire_bytes_per_device": self.wire_bytes,
            "wire_bytes_by_axis": self.wire_bytes_by_axis,
            "wire_bytes_by_network": self.wire_bytes_by_network,
            "collectives": {kind: self.count(kind) for kind in sorted({c.kind for c in self.collectives})},
            "transfers": [t.to_dict() for t in self.transfers],
            "memory_per_device": dict(self.memory),
            "flops_per_device": self.flops_per_device,
            "flops_unpartitioned": self.flops_unpartitioned,
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.table import Table
        from rich.text import Text

        mesh = " × ".join(f"{name}={size}" for name, size in self.axis_sizes.items())
        table = Table(title=f"Communication per training step on mesh {mesh}", title_justify="left")
        for column, justify in [
            ("layer", "left"),
            ("phase", "left"),
            ("collective", "left"),
            ("over", "left"),
            ("arrays", "right"),
            ("bytes", "right"),
            ("sent per device", "right"),
        ]:
            table.add_column(column, justify=justify)
        grouped: dict[tuple, list[Transfer]] = collections.defaultdict(list)
        for t in self.transfers:
            over = "×".join(t.axes) or "-"
            grouped[(t.layer or "-", t.phase, t.kind, over, t.group_size, t.network)].append(t)
        for (layer, phase, kind, axes, size, network), items in grouped.items():
            table.add_row(
                layer,
                phase,
                kind,
                f"{axes} ({size} slices, DCN)" if network == "dcn" else f"{axes} ({size})",
                str(len(items)),
                format_bytes(sum(t.nbytes for t in items)),
                format_bytes(sum(t.wire_bytes for t in items)),
            )
        yield table
        by_axis = ", ".join(f"{axis}: {format_bytes(b)}" for axis, b in self.wire_bytes_by_axis.items())
        yield Text(f"Sent per device per step: {format_bytes(self.wire_bytes)} ({by_axis or 'nothing'})")
        dcn = self.wire_bytes_by_network["dcn"]
        if dcn:
            yield Text(f"Of which between slices (DCN): {format_bytes(dcn)}")
        yield Text(
            f"Memory per device: {format_bytes(self.memory['total'])} (arguments "
            f"{format_bytes(self.memory['arguments'])}, outputs {format_bytes(self.memory['outputs'])}, "
            f"temporaries {format_bytes(self.memory['temporaries'])})"
        )
        if self.flops_per_device:
            yield Text(
                f"FLOPs per device: {self.flops_per_device:.3g} of {self.flops_unpartitioned:.3g} "
                f"unpartitioned ({self.flops_unpartitioned / self.flops_per_device:.2f}× split)"
            )

    def __str__(self) -> str:
        return to_text(self, width=140)

    # IPython prefers a class's own `__repr__` (the dataclass's) to an inherited `_repr_pretty_`.
    _repr_pretty_ = Displayed._repr_pretty_


def comm_report(model: keras.Model, x: Any, y: Any = None, sample_weight: Any = None) -> CommReport:
    """Compiles one training step of `model` and reports what it communicates.

    The step is Keras's own `train_step`, compiled for the current
    distribution with the shardings Keras gives the model state and the batch.
    Only shapes are used: nothing runs and no buffer is donated, so the model
    is untouched. The model must be compiled (`model.compile(...)`).

    Args:
        model: A compiled Keras model, built under the distribution to study.
        x: One global batch of inputs (arrays or a structure of arrays).
        y: The matching targets, if any.
        sample_weight: Optional sample weights.

    Returns:
        The `CommReport`. `print(report)` shows a table per layer, phase and
        collective; `report.to_dict()` gives data.

    Example:
        >>> import keras, numpy as np, keras_meshlayout as kml
        >>> dist = kml.ModelParallel(kml.Mesh(data=8))
        >>> with dist.scope():
        ...     model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(4, name="out")])
        ...     model.compile(optimizer="sgd", loss="mse")
        ...     report = kml.comm_report(model, np.zeros((32, 16), "float32"), np.zeros((32, 4), "float32"))
        >>> report.wire_bytes_by_axis["data"] == 2 * 7 / 8 * 4 * (16 * 4 + 4 + 1)
        True
    """
    import jax
    import keras

    if not getattr(model, "compiled", False):
        raise InvalidOptionError(
            f"comm_report: model {getattr(model, 'name', model)!r} is not compiled, so it has no training "
            "step to report on. Fix: model.compile(optimizer=..., loss=...) first (under the distribution), "
            "or kml.compile_step(build, dist, x, y), which builds and compiles the model itself."
        )
    distribution = keras.distribution.distribution()
    data = (x, y, sample_weight)
    try:
        _compat.symbolic_build(model, data)
    except (TypeError, ValueError) as error:
        if y is not None or getattr(model, "loss", None) is None:
            raise
        raise InvalidOptionError(
            f"comm_report: model {model.name!r} is compiled with loss={model.loss!r}, which needs targets, "
            f"and y was not given ({type(error).__name__}: {error}). Fix: comm_report(model, x, y)."
        ) from error

    def abstract(variable: keras.Variable) -> jax.ShapeDtypeStruct:
        value = variable.value
        return jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=value.sharding)

    state = (
        [abstract(v) for v in model.trainable_variables],
        [abstract(v) for v in model.non_trainable_variables],
        [abstract(v) for v in model.optimizer.variables],
        [abstract(v) for v in model.metrics_variables],
    )

    def abstract_input(array: Any) -> Any:
        if array is None:
            return None
        array = np.asarray(array)
        sharding = None
        if distribution is not None:
            sharding = distribution.get_data_layout(array.shape).backend_layout
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)

    batch = keras.tree.map_structure(abstract_input, data)
    out_shardings = None if distribution is None else (None, _compat.state_shardings(model))
    lowered = jax.jit(model.train_step, out_shardings=out_shardings).lower(state, batch)
    compiled = lowered.compile()
    return report_of(model, None if distribution is None else distribution.device_mesh, lowered, compiled)


def report_of(model: keras.Model, mesh: Any, lowered: Any, compiled: Any) -> CommReport:
    """The `CommReport` of one lowered and compiled step of `model` over `mesh` (`None`: one device)."""
    axis_sizes = {} if mesh is None else mesh_axis_sizes(mesh)
    device_count = 1 if mesh is None else int(np.prod(mesh.shape)) // _slices(mesh)
    text = compiled.as_text()
    collectives = [*parse_collectives(text, device_count), *parse_dcn_collectives(text)]
    layer_names = {layer.name for layer in _compat.sublayers(model)}
    transfers = tuple(
        transfer for collective in collectives for transfer in _transfers(collective, axis_sizes, layer_names)
    )
    return CommReport(
        axis_sizes=axis_sizes,
        collectives=tuple(collectives),
        transfers=transfers,
        memory=_memory(compiled),
        flops_per_device=xla_flops(compiled),
        flops_unpartitioned=xla_flops(lowered),
    )


def _slices(mesh: Any) -> int:
    """The slices `mesh`'s devices span: XLA:TPU's program for several is one slice's, its groups that
    slice's chips (`replica_groups={}`: all of them)."""
    grid = jax_device_grid(mesh)
    return max(1, len({getattr(device, "slice_index", 0) for device in grid.flat}))


def _transfers(
    collective: Collective, axis_sizes: Mapping[str, int], layer_names: set[str]
) -> Iterator[Transfer]:
    axes = _axes_of(collective, axis_sizes)
    for payload in collective.payloads:
        yield Transfer(
            collective=collective.name,
            kind=collective.kind,
            axes=axes,
            group_size=collective.group_size,
            shape=payload.shape,
            dtype=payload.dtype,
            nbytes=payload.nbytes,
            wire_bytes=wire_bytes(collective.kind, payload.nbytes, collective.group_size),
            layer=_layer_of(payload.op_name, layer_names),
            phase=_phase_of(payload.op_name),
            network=collective.network,
        )


def _axes_of(collective: Collective, axis_sizes: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes along which the devices of one group (or pair) differ; between slices, the first
    axis (`core/_target_mesh.py` lays it over the slices).

    A multi-slice program's groups hold one slice's devices: their ids are positions in the first
    slice, the mesh's first block along its first axis, and unravel in the mesh's shape alike.
    """
    if not axis_sizes:
        return ()
    if collective.network == "dcn":
        return (next(iter(axis_sizes)),)
    shape = tuple(axis_sizes.values())
    if collective.groups is not None:
        members = [collective.groups[0]]
    else:
        members = [list(pair) for pair in collective.pairs]
    varying = set()
    for ids in members:
        coords = np.array(np.unravel_index(np.asarray(ids), shape))
        varying |= {i for i in range(len(shape)) if len(set(coords[i])) > 1}
    return tuple(name for i, name in enumerate(axis_sizes) if i in varying)


_TOKEN = re.compile(r"[A-Za-z_][\w.\-]*")


def _layer_of(op_name: str, layer_names: set[str]) -> str:
    """`jit(train_step)/transpose(jvp(attn))/query/einsum` → `attn/query`."""
    layer = "/".join(token for token in _TOKEN.findall(op_name) if token in layer_names)
    if not layer and "compile_loss" in op_name:
        return "(loss)"
    return layer


def _phase_of(op_name: str) -> str:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "update"


def _memory(compiled: Any) -> dict[str, int]:
    stats = compiled.memory_analysis()
    fields = {
        "arguments": "argument_size_in_bytes",
        "outputs": "output_size_in_bytes",
        "temporaries": "temp_size_in_bytes",
        "aliased": "alias_size_in_bytes",
        "code": "generated_code_size_in_bytes",
        "live_peak": "peak_memory_in_bytes",
    }
    memory = (
        {key: int(getattr(stats, attr, 0) or 0) for key, attr in fields.items()}
        if stats
        else dict.fromkeys(fields, 0)
    )
    memory["total"] = memory["arguments"] + memory["outputs"] + memory["temporaries"] - memory["aliased"]
    return memory


def xla_flops(stage: Any) -> float:
    """XLA's FLOP count of a lowered or compiled stage (`cost_analysis`), 0 where it gives none."""
    costs = stage.cost_analysis()
    if isinstance(costs, Sequence):  # older JAX: one dict per program
        costs = costs[0] if costs else {}
    return float((costs or {}).get("flops", 0.0))
