"""The plan: what every variable of a model got, and why, as a table or as data."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from ._axes import axes_to_json
from ._format import Displayed, format_axes, format_bytes, to_text, unmatched_hint
from ._memory import MemoryEstimate, check_plan, intended_replication, memory_of
from ._plot import plot_plan
from ._resolve import Resolution
from ._rules import Rule

if TYPE_CHECKING:
    from pathlib import Path

    import rich.console

__all__ = ["Plan", "format_bytes", "format_axes", "grouped_conv_message"]


@dataclasses.dataclass(frozen=True)
class Plan(Displayed):
    """The resolved layout of every variable of a model on a mesh.

    Attributes:
        axis_sizes: Mesh axis sizes by name.
        batch_axis: Mesh axis the batch is split over.
        entries: One `Resolution` per variable: model weights first, then
            optimizer variables when the optimizer is built.
        unmatched_rules: Variable rules that matched no variable (likely typos).
        outputs: Each layer-output rule (pattern ending in `output`) with the
            layers whose outputs it lays out.
        layer_outputs: The `<layer path>/output` paths of the model's layers, which
            output rules are matched against (empty where the model has no layers yet).
        device_capacity: Memory of one device in bytes, where JAX reports it.
        on_indivisible: The divisibility policy in force.
        replicate_below: The small-variable threshold in force.
        processes: Which process holds which part of the mesh, one line each
            (`kml.process_layout`); empty in a single process.
        intended: Paths of the variables kept replicated on purpose by a rule
            chosen for the user (`kml.auto_rules` or a preset, with its note),
            and of their optimizer slots: the replication guard does not count
            them as a failure, since it is that rule's honest answer.
        mismatches: Why some variables really hold other layouts than the rules
            give (built outside the distribution, set after the build), one
            message each kind; also in `warnings` and under the table.
        grouped_convs: `(layer path, class name)` of each grouped convolution
            XLA would train wrongly on this mesh (every one, unless the
            planner split its channels with its input); see
            `grouped_conv_warning`.

    `str(plan)` (or `print(plan)`) renders a table; `plan.to_dict()` gives the
    same content as JSON-serialisable data; `plan[path]` looks up one variable.
    In a notebook a plan shows as the coloured table (`_repr_html_`).
    """

    axis_sizes: Mapping[str, int]
    batch_axis: str
    entries: tuple[Resolution, ...]
    unmatched_rules: tuple[Rule, ...] = ()
    outputs: tuple[tuple[Rule, tuple[str, ...]], ...] = ()
    device_capacity: int | None = None
    on_indivisible: str = "replicate"
    replicate_below: int = 0
    processes: tuple[str, ...] = ()
    grouped_convs: tuple[tuple[str, str], ...] = ()
    mismatches: tuple[str, ...] = ()
    intended: frozenset[str] = frozenset()
    layer_outputs: tuple[str, ...] = ()

    @property
    def device_count(self) -> int:
        count = 1
        for size in self.axis_sizes.values():
            count *= size
        return count

    @property
    def bytes_per_device(self) -> int:
        """Bytes of all variables held by each device."""
        return sum(entry.bytes_per_device for entry in self.entries)

    @property
    def replicated_bytes(self) -> int:
        """Bytes per device if every variable were replicated."""
        return sum(entry.nbytes for entry in self.entries)

    @property
    def warnings(self) -> list[str]:
        """Human-readable warnings: `mismatches`, rules that matched nothing, `grouped_conv_warning`."""
        grouped = self.grouped_conv_warning
        return [*self.mismatches, *self._unmatched_messages(), *([grouped] if grouped else [])]

    @property
    def grouped_conv_warning(self) -> str | None:
        """Why this model's grouped convolutions would train wrongly on this mesh, or `None`.

        Set when the model has grouped convolutions, the batch is split and a mesh axis other
        than the batch axis is larger than 1 (see `kml.GroupedConvWarning`, `grouped_conv_axes`).
        """
        others = grouped_conv_axes(self.axis_sizes, self.batch_axis)
        if not self.grouped_convs or not others:
            return None
        return grouped_conv_message(self.grouped_convs, self.axis_sizes, self.batch_axis, others)

    def _unmatched_messages(self) -> list[str]:
        paths = [entry.path for entry in self.entries if entry.role != "optimizer"]
        messages = []
        for rule in self.unmatched_rules:
            hint = unmatched_hint(rule.pattern, paths)
            messages.append(
                f"{rule.describe()} matched no variable: check the pattern for a typo "
                f"(it is matched with re.fullmatch against variable.path).{hint}"
            )
        for rule, layers in self.outputs if self.layer_outputs else ():
            if not layers:
                near = unmatched_hint(rule.pattern, self.layer_outputs)
                near = near.replace("Nearest variable paths", "Nearest layer outputs")
                messages.append(
                    f"{rule.describe()} matched no layer output: check the pattern for a typo (it is "
                    f"matched with re.fullmatch against '<layer path>/output').{near}"
                )
        return messages

    def memory(self, device_memory: int | str | None = None) -> MemoryEstimate:
        """Training-state bytes per device: parameters, gradients, optimizer.

        Args:
            device_memory: Device capacity (`"80GB"`, `"16GiB"` or bytes);
                defaults to what JAX reports for the mesh's devices, if anything.
        """
        return memory_of(self.entries, self.device_capacity if device_memory is None else device_memory)

    def check(self, *, max_replicated_fraction: float = 0.5, device_memory: int | str | None = None) -> None:
        """Raises `MemoryBudgetError` if too much stays replicated or the state does not fit.

        See `kml.check_plan`; `device_memory` defaults as in `memory`.
        """
        check_plan(
            self,
            max_replicated_fraction=max_replicated_fraction,
            device_memory=self.device_capacity if device_memory is None else device_memory,
        )

    def intended_replication(self, max_replicated_fraction: float = 0.5) -> str | None:
        """Why the rules chosen for you keep this much replicated, and what to pass to split more.

        `None` unless the variables kept replicated on purpose (`intended`) exceed
        `max_replicated_fraction` of each device's training state; `check` does not
        fail on them.
        """
        return intended_replication(self, max_replicated_fraction=max_replicated_fraction)

    def plot(self, path: str | os.PathLike, **kw: Any) -> Path:
        """Writes a picture of the plan: memory per device, the mesh, the largest variables.

        Needs matplotlib (`pip install matplotlib`). See
        `kml.plot_plan` for the options (`top`, `mesh`, `device_memory`).

        Returns:
            The path written.
        """
        return plot_plan(self, path, **kw)

    def __getitem__(self, path: str) -> Resolution:
        for entry in self.entries:
            if entry.path == path:
                return entry
        raise KeyError(f"No variable with path {path!r} in this plan.")

    def __iter__(self) -> Iterator[Resolution]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-serialisable data."""
        return {
            "mesh": dict(self.axis_sizes),
            "batch_axis": self.batch_axis,
            "on_indivisible": self.on_indivisible,
            "replicate_below": self.replicate_below,
            "variables": [entry.to_dict() for entry in self.entries],
            "totals": {
                "bytes_per_device": self.bytes_per_device,
                "replicated_bytes_per_device": self.replicated_bytes,
            },
            "memory_per_device": self.memory().to_dict(),
            "unmatched_rules": [
                {"index": r.index, "pattern": r.pattern, "axes": axes_to_json(r.axes)}
                for r in self.unmatched_rules
            ],
            "outputs": [
                {
                    "index": rule.index,
                    "pattern": rule.pattern,
                    "axes": axes_to_json(rule.axes),
                    "layers": list(layers),
                }
                for rule, layers in self.outputs
            ],
            "grouped_convolutions": [{"layer": path, "class": cls} for path, cls in self.grouped_convs],
            "warnings": self.warnings,
            "processes": list(self.processes),
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.table import Table
        from rich.text import Text

        mesh = " × ".join(f"{name}={size}" for name, size in self.axis_sizes.items())
        table = Table(
            title=f"Layout plan on mesh {mesh} ({self.device_count} devices), batch over {self.batch_axis!r}",
            title_justify="left",
        )
        for column, justify in [
            ("variable", "left"),
            ("shape", "left"),
            ("dtype", "left"),
            ("rule", "left"),
            ("layout", "left"),
            ("per device", "right"),
            ("why", "left"),
        ]:
            table.add_column(column, justify=justify, overflow="fold")
        for entry in self.entries:
            table.add_row(
                entry.path,
                format_axes(entry.shape),
                entry.dtype,
                _rule_cell(entry),
                Text(format_axes(entry.axes), style="bold green" if not entry.replicated else ""),
                format_bytes(entry.bytes_per_device),
                _why_cell(entry),
            )
        yield table
        yield from self._totals()

    def summary(self, *, largest: int = 10) -> Any:
        """The plan in a few lines: repeated blocks folded, the largest rows, the totals and warnings.

        Rows alike but for the numbers in their paths (one transformer block's variables in each
        of 32 blocks) fold into one, written `block_{0..31}/attn/kernel` with their count; the
        `largest` rows by bytes per device are listed again first. `keras-meshlayout plan` prints
        this for big plans (`--full` for every row).

        Returns:
            A `rich` renderable (`rich.print(plan.summary())`; `str()` gives the text).

        Example:
            >>> import keras, keras_meshlayout as kml
            >>> layers = [keras.layers.Dense(8, name=f"block_{i}") for i in range(4)]
            >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*kernel", (None, "model"))],
            ...                          replicate_below=0)
            >>> with dist.scope():
            ...     model = keras.Sequential([keras.Input((8,)), *layers], name="m")
            >>> print(str(dist.plan(model).summary()).splitlines()[4])
            │ m/block_{0..3}/kernel │ 4 │ (8, 8) │ float32 │ (None, model) │      256 B │                 │
        """
        from rich.console import Group

        from ._summary import fold, folded_table

        rows = fold(self.entries)
        mesh = " × ".join(f"{name}={size}" for name, size in self.axis_sizes.items())
        title = (
            f"Layout plan on mesh {mesh} ({self.device_count} devices), batch over {self.batch_axis!r}: "
            f"{len(self.entries)} variables in {len(rows)} rows"
        )
        parts = [folded_table(rows, title, _why_cell)]
        top = sorted(rows, key=lambda row: -row.bytes_per_device)[:largest]
        if largest and len(rows) > largest:
            parts.append(folded_table(top, f"The {len(top)} largest rows", _why_cell))
        return _Rendered(Group(*parts, *self._totals()))

    def _totals(self) -> Iterator[Any]:
        from rich.table import Table
        from rich.text import Text

        saved = 1 - self.bytes_per_device / self.replicated_bytes if self.replicated_bytes else 0.0
        yield Text(
            f"Variables per device: {format_bytes(self.bytes_per_device)} "
            f"(fully replicated: {format_bytes(self.replicated_bytes)}, {saved:.0%} saved)"
        )
        memory = self.memory()
        capacity = "" if memory.capacity is None else f" of {format_bytes(memory.capacity)}"
        yield Text(
            f"Training state per device: {format_bytes(memory.total)}{capacity} (parameters "
            f"{format_bytes(memory.parameters)}, gradients {format_bytes(memory.gradients)}, optimizer "
            f"{format_bytes(memory.optimizer)}; activations not counted)"
        )
        for line in self.processes:
            yield Text(line)
        if self.outputs:
            outputs = Table(title="Layer outputs kept in a layout", title_justify="left")
            for column in ("rule", "layout", "layers"):
                outputs.add_column(column, overflow="fold")
            for rule, layers in self.outputs:
                outputs.add_row(
                    f"#{rule.index} {rule.pattern}", format_axes(rule.axes), ", ".join(layers) or "-"
                )
            yield outputs
        for line in self.warnings:
            yield Text(f"warning: {line}", style="yellow")

    def __str__(self) -> str:
        return to_text(self, width=160)

    # IPython prefers a class's own `__repr__` (the dataclass's) to an inherited `_repr_pretty_`.
    _repr_pretty_ = Displayed._repr_pretty_


#: Measured on XLA:CPU, jax/jaxlib 0.10.2 (tests/test_grouped_conv.py pins it).
_GROUPED_CONV_MEASURED = "measured on XLA:CPU with jax 0.10.2: 4x on data=2 x model=4, 2x on data=4 x model=2"


def grouped_conv_axes(axis_sizes: Mapping[str, int], batch_axis: str | None) -> dict[str, int]:
    """The mesh axes XLA sums a grouped convolution's kernel gradient over too: every axis but the batch
    axis larger than 1, when the batch axis splits the batch. Over a batch axis of 1 (or none) nothing
    is summed, and the gradient is exact (measured on 1×8 and 1×2, tests/test_grouped_conv.py)."""
    if batch_axis is None or axis_sizes.get(batch_axis, 1) <= 1:
        return {}
    return {name: size for name, size in axis_sizes.items() if name != batch_axis and size > 1}


def grouped_conv_message(
    layers: Sequence[tuple[str, str]],
    axis_sizes: Mapping[str, int],
    batch_axis: str,
    others: Mapping[str, int],
) -> str:
    factor = 1
    for size in others.values():
        factor *= size
    shown = ", ".join(f"{path!r} ({cls})" for path, cls in layers[:5])
    if len(layers) > 5:
        shown += f" and {len(layers) - 5} more"
    mesh = " x ".join(f"{name}={size}" for name, size in axis_sizes.items())
    other = " x ".join(f"{name}={size}" for name, size in others.items())
    example = f"kml.Mesh({batch_axis}={factor * axis_sizes[batch_axis]})"
    return (
        f"Grouped convolutions in {shown} on mesh {mesh} with the batch over {batch_axis!r}: XLA computes "
        f"their kernel gradients {factor}x too large here ({factor} = {other}, the mesh axes other than "
        f"the batch axis; {_GROUPED_CONV_MEASURED}), because it sums the per-shard kernel gradients over "
        f"every device instead of over the {axis_sizes[batch_axis]} batch shards. Nothing fails; these "
        f"layers train wrongly. Fix: for this model use a mesh whose only axis larger than 1 is the batch "
        f"axis, e.g. {example}; or split each such layer's channels over {', '.join(map(repr, others))}, "
        f"both its input (an '/output' rule on the layer feeding it) and its kernel's channel dimension. "
        f"Custom layers that call keras.ops.depthwise_conv (or a lax convolution with "
        f"feature_group_count > 1) themselves are found by tracing the model on its input spec; one "
        f"that cannot be traced so (a subclassed model never called) cannot be checked."
    )


class _Rendered(Displayed):
    """A rich renderable that prints as plain text and shows in a notebook."""

    def __init__(self, renderable: Any) -> None:
        self.renderable = renderable

    def __rich__(self) -> Any:
        return self.renderable

    def __str__(self) -> str:
        return to_text(self.renderable, width=160)


def _rule_cell(entry: Resolution) -> str:
    if entry.source == "parameter":
        return "(slot)"
    if entry.rule is None:
        return "-"
    return f"#{entry.rule.index} {entry.rule.pattern}"


def _why_cell(entry: Resolution) -> str:
    note = entry.rule.note if entry.rule is not None else ""
    if entry.reasons:
        requested = "" if entry.requested is None else f"asked {format_axes(entry.requested)}: "
        return "; ".join(filter(None, [note, requested + "; ".join(entry.reasons)]))
    if entry.source == "default":
        return "no rule matched"
    return note
