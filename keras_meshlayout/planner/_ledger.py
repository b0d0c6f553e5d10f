"""The rule writer's ledger: one decision per variable, from which the rules and the proposal follow.

Each strategy (`_by_layers`, `_by_name`, `_by_trace`) reads the model and
writes into one `Ledger`: `record(path, axes, note, unit)` decides a variable
that no earlier strategy decided (the first decision wins), `revise` replaces
one (a traced unit re-deciding a weight an earlier pass left whole). What
the costs need besides the axes (which units are final layers, which
key/value projections stay whole) is recorded as facts beside the
decisions. `rules()` and `proposal()` are derived from it, never kept apart.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from types import MappingProxyType

import keras

from ..core._axes import Axes
from ..core._shape_checks import is_weight_matrix
from . import _notes
from ._layers import Packing
from ._trace import Trace

__all__ = ["Decision", "Ledger", "Proposal", "Setting"]


@dataclasses.dataclass(frozen=True)
class Proposal:
    """The rule writer's tensor-parallel layouts, before any budget (stage 2 → 3).

    Attributes:
        model_axis: The tensor-parallel mesh axis.
        batch_axis: The mesh axis the batch is split over, or `None`.
        axes: Per variable path, its proposed axes (every variable the rules decide).
        notes: Per variable path, why it has those axes.
        units: Per split variable path, the unit it splits with (weights of
            one unit are laid out together).
        final_units: Units that are a final layer split over the model axis
            (the loss reduces their split outputs).
        kv_heads: Per Dense key/value projection kept whole (layer path), its
            key/value head count.
        whole_outputs: Layer paths whose output a rule keeps whole over the model axis.
        whole_kv: Key/value weights kept whole beside a traced attention
            unit's split query heads: weight path → unit.
        expert_units: Units that are expert banks split on their expert dimension.
        conv_units: Units of convolutions split over their channels (`_convs`).
        lone_convs: Units of one convolution kernel split on its input channels alone (`_convs`).
        lone_grouped: Units of one grouped convolution's kernel split on its channels alone
            (`_convs.lone_grouped_convs`): the seeds of `_conv_regions`.
        input_convs: Units of one convolution reading the model's input, its output channels split
            and its output gathered (`_convs.input_convs`).
        expert_axis: The axis expert banks are split over when it is not the model axis (a mesh
            with an `expert` axis), or `None`.
        kept_split: Paths whose split `replicate_below` does not undo (`Rule.keep_split`): the
            weights of grouped convolutions' units on a mesh that splits the batch too.
    """

    model_axis: str
    batch_axis: str | None
    axes: Mapping[str, Axes]
    notes: Mapping[str, str]
    units: Mapping[str, str]
    final_units: frozenset[str] = frozenset()
    kv_heads: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    whole_outputs: frozenset[str] = frozenset()
    whole_kv: Mapping[str, str] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    expert_units: frozenset[str] = frozenset()
    conv_units: frozenset[str] = frozenset()
    lone_convs: frozenset[str] = frozenset()
    lone_grouped: frozenset[str] = frozenset()
    input_convs: frozenset[str] = frozenset()
    expert_axis: str | None = None
    kept_split: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class Setting:
    """What every strategy reads: the model, the mesh axis, the policy and the trace.

    Attributes:
        model: The built model.
        axis: The model (tensor-parallel) axis.
        size: Its size.
        replicate_below: Kernels with fewer elements stay replicated.
        batch_axis: The axis the batch is split over, or `None`.
        trace: The traced forward pass, or `None` (a subclassed model never called).
        batch_size: The size of `batch_axis` (1 without one).
        expert_axis: The mesh's `expert` axis, which expert banks are split over, or `None`
            (they are split over the model axis).
        expert_size: Its size (1 without one).
    """

    model: keras.Model
    axis: str
    size: int
    replicate_below: int
    batch_axis: str | None
    trace: Trace | None = None
    batch_size: int = 1
    expert_axis: str | None = None
    expert_size: int = 1

    @functools.cached_property
    def variables(self) -> Mapping[str, keras.Variable]:
        """The model's variables by path, read once: planning adds none, and `model.weights` walks
        every layer (1,800 walks were an eighth of planning five zoo models)."""
        return MappingProxyType({v.path: v for v in self.model.weights})

    def display(self, name: str) -> str:
        """A path without the model's name in front, as notes show it."""
        return name.replace(self.model.name + "/", "")


@dataclasses.dataclass(frozen=True)
class Decision:
    """One rule: the axes of a variable (or of a layer's output), why, and its unit.

    `keep_split`: the split stands however small the weight (`Rule.keep_split`).
    """

    pattern: str
    axes: Axes
    note: str
    unit: str | None = None
    keep_split: bool = False


class Ledger:
    """The decisions of one `auto_rules` call, in the order they were first made."""

    def __init__(
        self,
        model_name: str,
        axis: str,
        batch_axis: str | None,
        auto_named: frozenset[str] = frozenset(),
        paths: tuple[str, ...] = (),
        *,
        replicate_below: int = 0,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
        packed: Mapping[str, Packing] | None = None,
    ) -> None:
        self.model_name = model_name
        self.axis = axis
        self.batch_axis = batch_axis
        #: Paths of the layers whose names Keras generated, and every variable path of the model:
        #: a rule's numbered segment is relaxed where that still matches one variable only.
        self.auto_named = auto_named
        self.paths = paths
        #: The policy's threshold and every variable's shape: a weight matrix with fewer elements
        #: is kept whole by `kml.ModelParallel` (suggested rules), so the ledger records it whole too.
        self.replicate_below = replicate_below
        self.shapes = dict(shapes or {})
        #: Per int4 kernel Keras stores flattened, how its float kernel's axes are stored (`None` where
        #: the packing cannot split as asked) and back (`_layers.packed_axes`).
        self.packed = dict(packed or {})
        #: Per variable path (or `("output", layer path)`), its decision, in first-decided order.
        self._entries: dict[object, Decision] = {}
        #: Facts the costs read beside the axes.
        self.final_units: set[str] = set()
        self.kv_heads: dict[str, int] = {}
        self.whole_outputs: set[str] = set()
        self.whole_kv: dict[str, str] = {}
        self.expert_units: set[str] = set()
        self.expert_axis: str | None = None
        self.conv_units: set[str] = set()
        self.lone_convs: set[str] = set()
        self.lone_grouped: set[str] = set()
        self.batch_everywhere: list[str] = []  # grouped convs' layers, outputs over every axis
        self.input_convs: set[str] = set()

    # -- writing --------------------------------------------------------------------------

    def record(
        self, path: str, axes: Axes, note: str, unit: str | None = None, *, keep_split: bool = False
    ) -> None:
        """Decides `path` unless a decision exists; `unit` only binds a split variable.

        `keep_split`: `replicate_below` leaves the split as it is (a grouped convolution's unit
        on a mesh that splits the batch too, which XLA trains wrongly kept whole).
        """
        if path not in self._entries and self._ranked(path, axes):
            self._entries[path] = self._decision(path, axes, note, unit, keep_split)

    def revise(
        self, path: str, axes: Axes, note: str, unit: str | None = None, *, keep_split: bool = False
    ) -> None:
        """Decides `path` again, in the place of its first decision, with `unit` (or none)."""
        if self._ranked(path, axes):
            self._entries[path] = self._decision(path, axes, note, unit, keep_split)

    def _ranked(self, path: str, axes: Axes) -> bool:
        """Whether `axes` has the variable's rank, or an int4 weight's float one (`packed`)."""
        shape = self.shapes.get(path)
        return shape is None or len(tuple(axes)) == len(shape) or path in self.packed

    def relayout(self, path: str, axes: Axes, note: str) -> None:
        """Changes the axes and note of `path`, keeping its unit and `keep_split` (the search's choice)."""
        known = self._entries.get(path)
        kept = known is not None and known.keep_split
        self._entries[path] = dataclasses.replace(
            self._decision(path, axes, note, None, kept), unit=None if known is None else known.unit
        )

    def regroup(self, path: str, unit: str) -> None:
        """Moves a split variable into `unit`."""
        known = self._entries.get(path)
        if known is not None and known.unit is not None:
            self._entries[path] = dataclasses.replace(known, unit=unit)

    def replicate(self, weights: list[keras.Variable], note: str, unit: str | None = None) -> None:
        """Records every variable of `weights` as replicated."""
        for variable in weights:
            self.record(variable.path, (None,) * len(variable.shape), note, unit)

    def keep_output_whole(self, layer_path: str, rank: int = 4) -> None:
        """Keeps a replicated key/value projection's output whole over the model axis.

        Otherwise XLA splits the replicated projection's gradient over the
        devices that share a key/value head and all-gathers the weights (and
        their optimizer slots) every step.
        """
        self.whole_outputs.add(layer_path)
        self.output_whole(layer_path, rank, _notes.KV_OUTPUT_WHOLE)

    def output_whole(self, layer_path: str, rank: int, note: str) -> None:
        """A rule keeping a layer's output whole over the model axis (split over the batch axis only)."""
        self.output_split(layer_path, (self.batch_axis,) + (None,) * (rank - 1), note)

    def output_split(self, layer_path: str, axes: Axes, note: str) -> None:
        """A rule laying out a layer's output (`<layer>/output`), unless one already does."""
        key = ("output", layer_path)
        if key not in self._entries:
            self._entries[key] = Decision(self.pattern(layer_path) + "/output", axes, note)

    # -- reading --------------------------------------------------------------------------

    def decided(self, path: str) -> bool:
        return path in self._entries

    def axes(self, path: str) -> Axes | None:
        known = self._entries.get(path)
        return None if known is None else known.axes

    def unit(self, path: str) -> str | None:
        known = self._entries.get(path)
        return None if known is None else known.unit

    def split_paths(self) -> list[str]:
        """The variables split over the model axis so far."""
        return [p for p, d in self._decided() if self.axis in d.axes]

    def rules(self) -> list[tuple[str, Axes, str]]:
        r"""`(pattern, axes, note)` per decision, in the order they were first made.

        A path through a layer Keras named (`mixtral_sparse_moe_block_2`) gets
        a pattern that takes any number there (`mixtral_sparse_moe_block(?:_\d+)?`),
        so the rules still match the model rebuilt in the same session, as
        long as the relaxed pattern matches no other variable of this model.
        """
        return [(self._tolerant(key, d.pattern), d.axes, d.note) for key, d in self._entries.items()]

    def kept_split(self) -> frozenset[str]:
        """The patterns of `rules()` whose split `replicate_below` must leave (`Rule.keep_split`)."""
        return frozenset(self._tolerant(k, d.pattern) for k, d in self._entries.items() if d.keep_split)

    def _tolerant(self, key: object, pattern: str) -> str:
        path = key if isinstance(key, str) else f"{key[1]}/output"
        parts = path.split("/")
        relaxed = [
            re.escape(re.sub(r"_\d+$", "", part)) + r"(?:_\d+)?"
            if "/".join(parts[: i + 1]) in self.auto_named
            else re.escape(part)
            for i, part in enumerate(parts)
        ]
        if relaxed == [re.escape(part) for part in parts]:
            return pattern
        candidate = self._prefixed(path, "/".join(relaxed))
        others = [p for p in self.paths if p != path and re.fullmatch(candidate, p)]
        return pattern if others else candidate

    def proposal(self) -> Proposal:
        """The decisions, frozen: what the costs (`_costs`) read."""
        variables = list(self._decided())
        return Proposal(
            model_axis=self.axis,
            batch_axis=self.batch_axis,
            axes=MappingProxyType({p: d.axes for p, d in variables}),
            notes=MappingProxyType({p: d.note for p, d in variables}),
            units=MappingProxyType({p: d.unit for p, d in variables if d.unit is not None}),
            final_units=frozenset(self.final_units),
            kv_heads=MappingProxyType(dict(self.kv_heads)),
            whole_outputs=frozenset(self.whole_outputs),
            whole_kv=MappingProxyType(dict(self.whole_kv)),
            expert_units=frozenset(self.expert_units),
            conv_units=frozenset(self.conv_units),
            lone_convs=frozenset(self.lone_convs),
            lone_grouped=frozenset(self.lone_grouped),
            input_convs=frozenset(self.input_convs),
            expert_axis=self.expert_axis,
            kept_split=frozenset(p for p, d in variables if d.keep_split),
        )

    def pattern(self, path: str) -> str:
        """The variable's path, tolerant of the model-name scope.

        A Sequential model built in code puts its name first (`mlp/fc1/kernel`);
        the same model loaded from a `.keras` file does not (`fc1/kernel`).
        """
        return self._prefixed(path, re.escape(path))

    def _prefixed(self, path: str, escaped: str) -> str:
        """`escaped` (a pattern for `path`) with the model-name scope made optional."""
        prefix = re.escape(self.model_name + "/")
        if path.startswith(self.model_name + "/") and escaped.startswith(prefix):
            return f"(?:{prefix})?{escaped[len(prefix) :]}"
        return escaped

    def _decided(self):
        return ((p, d) for p, d in self._entries.items() if isinstance(p, str))

    def _decision(self, path: str, axes: Axes, note: str, unit: str | None, keep_split: bool) -> Decision:
        axes = tuple(axes)
        shape = self.shapes.get(path)
        if path in self.packed and shape is not None and len(axes) != len(shape):
            stored = self.packed[path](axes)
            axes, note = (
                (stored, note) if stored is not None else ((None,) * len(shape), _notes.int4_whole(note))
            )
        keep_split = keep_split and any(axes)
        if any(axes) and not keep_split and shape is not None and is_weight_matrix(path, shape):
            size = math.prod(shape)
            if size < self.replicate_below:  # what the policy does with it at run time
                axes, note = (None,) * len(axes), _notes.small_matrix(note, size, self.replicate_below)
        unit = unit if unit is not None and any(axes) else None
        return Decision(self.pattern(path), axes, note, unit, keep_split)
