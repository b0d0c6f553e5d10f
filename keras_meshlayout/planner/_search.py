"""Stage 4: the search. Per unit, the candidate layout at the least traffic within the budget.

`search(table, budget)` reads a `CostTable` (`_costs`) and returns the index
of the chosen candidate of every unit, nothing else: it starts from each
unit's least-traffic candidate; while the total exceeds the budget it takes
the move that saves the most memory per byte of extra traffic; then it walks
back any move the budget no longer needs. Without a budget every unit keeps
the proposal's own layout. `plan_cost` turns the choice into the public
`kml.PlanCost` with one `kml.UnitChoice` (and its note) per unit.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from ..core._errors import MemoryBudgetError
from ..core._format import format_bytes
from ._at_peak import PeakBuffer
from ._costs import CostTable, UnitCosts
from ._peak import PeakMemory

__all__ = ["PlanCost", "UnitChoice", "explain", "plan_cost", "search"]


@dataclasses.dataclass(frozen=True)
class UnitChoice:
    """The layout chosen for one unit of weights, and what it costs.

    Attributes:
        unit: The unit: a layer path, a projection pair or an attention block.
        layout: `"replicated"`, `"tensor-parallel"`, `"expert-parallel"`, `"2-D"`, `"vocab-parallel"`,
            `"fully sharded"`, `"head_dim split"` or `"split, unused"`.
        state_bytes: Per-device bytes of its parameters, gradients and optimizer slots.
        wire_bytes: Bytes each device sends for it per training step.
        note: Why, against keeping the unit replicated.
    """

    unit: str
    layout: str
    state_bytes: int
    wire_bytes: float
    note: str


@dataclasses.dataclass(frozen=True)
class PlanCost:
    """What the planner predicts one training step of its plan costs, per device.

    Attributes:
        wire_bytes_by_axis: Bytes each device sends per step, by mesh axis, as
            `kml.comm_report` counts them (ring formulas).
        state_bytes: Parameters, gradients, optimizer slots and non-trainable
            state held by each device.
        activation_bytes: What each device holds at the step's predicted peak beyond its
            state: the batch's shard, activations kept for the backward pass and
            temporaries (see `kml.auto_rules`).
        budget: The memory budget per device, or `None`.
        choices: One `UnitChoice` per unit of weights with more than one layout.
        peak_bytes: The predicted per-device peak of one training step (`memory_bytes`), or
            `None` when the step's gradient could not be traced (then `activation_bytes` is
            only the outputs of the traced projections and look-ups).
        cast_gather_bytes_by_axis: Of `wire_bytes_by_axis`, the all-gathers of float32 weights
            that XLA:TPU casts to bfloat16 first (on a TPU target); between the slices of a
            multi-slice target they go in float32, twice these bytes (`kml.choose_mesh`).
        peak_buffers: The largest buffers live at the predicted peak, each named after the JAX
            operation that writes it (`PeakBuffer`: operation, shape, dtype, bytes a device).
    """

    wire_bytes_by_axis: Mapping[str, float]
    state_bytes: int
    activation_bytes: int
    budget: int | None
    choices: tuple[UnitChoice, ...]
    peak_bytes: int | None = None
    cast_gather_bytes_by_axis: Mapping[str, float] = dataclasses.field(default_factory=dict)
    peak_buffers: tuple[PeakBuffer, ...] = ()

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per step, over every axis."""
        return float(sum(self.wire_bytes_by_axis.values()))

    @property
    def memory_bytes(self) -> int:
        """State plus activations and temporaries: the predicted peak the budget is compared with."""
        return self.state_bytes + self.activation_bytes

    def layouts(self) -> dict[str, int]:
        """How many units took each layout: `{"tensor-parallel": 4, "2-D": 2}`."""
        counts: dict[str, int] = {}
        for choice in self.choices:
            counts[choice.layout] = counts.get(choice.layout, 0) + 1
        return counts

    def __str__(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {format_bytes(self.budget)}"
        layouts = ", ".join(f"{n} {name}" for name, n in sorted(self.layouts().items()))
        memory = f"{format_bytes(self.state_bytes)} state + {format_bytes(self.activation_bytes)} activations"
        if self.activation_bytes < 0:  # XLA:TPU applies each gradient as it is written: never all held
            memory = f"{format_bytes(self.state_bytes)} state, a peak of {format_bytes(self.memory_bytes)}"
        return (
            f"{format_bytes(self.wire_bytes)} sent per device per step; {memory} per device ({budget}); "
            f"units: {layouts or 'none'}"
        )


def search(table: CostTable, budget: int | None) -> tuple[int, ...]:
    """The index of the chosen candidate of each unit of `table`.

    Raises:
        MemoryBudgetError: Even the smallest candidates do not fit `budget`;
            `error.smallest_bytes` is what the smallest plan needs.
    """
    units = table.units
    if budget is None:
        return tuple(unit.proposed for unit in units)
    chosen = [
        min(range(len(u.candidates)), key=lambda i, u=u: (u.candidates[i].total, u.candidates[i].state))
        for u in units
    ]

    def memory() -> int:
        return table.reserve + sum(u.candidates[c].state for u, c in zip(units, chosen, strict=True))

    while memory() > budget:
        best, best_score, best_saved = None, -math.inf, 0
        for position, unit in enumerate(units):
            current = unit.candidates[chosen[position]]
            for index, candidate in enumerate(unit.candidates):
                saved = current.state - candidate.state
                if saved <= 0:
                    continue
                added = candidate.total - current.total
                score = math.inf if added <= 0 else saved / added
                if score > best_score or (score == best_score and saved > best_saved):
                    best, best_score, best_saved = (position, index), score, saved
        if best is None:
            raise MemoryBudgetError(
                f"auto_rules: the smallest plan needs {format_bytes(memory())} per device "
                f"({format_bytes(table.reserve)} of it the batch, activations and temporaries), over the "
                f"memory budget of {format_bytes(budget)}. Fix: a larger budget, a mesh with a larger "
                "model axis, a smaller batch per device, or an optimizer with fewer slots (e.g. Adafactor).",
                smallest_bytes=memory(),
            )
        chosen[best[0]] = best[1]
    # Walk back: any unit whose cheaper-traffic candidate still fits takes it.
    improved = True
    while improved:
        improved = False
        order = sorted(range(len(units)), key=lambda p: -units[p].candidates[chosen[p]].total)
        for position in order:
            unit = units[position]
            current = unit.candidates[chosen[position]]
            for index, candidate in enumerate(unit.candidates):
                if candidate.total < current.total and memory() - current.state + candidate.state <= budget:
                    chosen[position], current, improved = index, candidate, True
    return tuple(chosen)


def explain(unit: UnitCosts, index: int, budgeted: bool = True) -> str:
    """Why `unit` takes its candidate `index`, against keeping it replicated (`budgeted`: under a budget)."""
    option, base = unit.candidates[index], unit.candidates[0]
    if base.layout != "replicated":  # a grouped conv's unit on a 2-D mesh (`_costs`)
        return f"{option.layout}: never replicated, which XLA trains wrongly (a grouped conv's channels)"
    saved = base.state - option.state
    added = option.total - base.total
    if option.layout == "replicated":
        if len(unit.candidates) == 1:
            return "replicated"
        cheapest = min(unit.candidates[1:], key=lambda o: o.state)
        return (
            f"replicated: {'the budget allows it' if budgeted else 'no memory budget asks for it'}; "
            f"splitting ({cheapest.layout}) would save "
            f"{format_bytes(base.state - cheapest.state)}/device but cost "
            f"{format_bytes(cheapest.total - base.total)} more per step"
        )
    if added > 0:
        traffic = f"costs {format_bytes(added)} more per step than replicated"
    elif added < 0:
        traffic = f"sends {format_bytes(-added)} less per step than replicated"
    else:
        traffic = "sends as much per step as replicated"
    return f"{option.layout}: saves {format_bytes(saved)}/device, {traffic}"


def plan_cost(
    table: CostTable, chosen: tuple[int, ...], budget: int | None, peak: PeakMemory | None = None
) -> PlanCost:
    """The public prediction of the plan that takes candidate `chosen[i]` for unit `i`."""
    wire: dict[str, float] = {}
    cast: dict[str, float] = {}
    choices = []
    for unit, index in zip(table.units, chosen, strict=True):
        candidate = unit.candidates[index]
        for axis, amount in candidate.wire.items():
            wire[axis] = wire.get(axis, 0.0) + amount
        for axis, amount in candidate.cast.items():
            cast[axis] = cast.get(axis, 0.0) + amount
        if len(unit.candidates) > 1:
            why = explain(unit, index, budget is not None)
            choices.append(UnitChoice(unit.name, candidate.layout, candidate.state, candidate.total, why))
    return PlanCost(
        wire_bytes_by_axis=wire,
        state_bytes=sum(u.candidates[i].state for u, i in zip(table.units, chosen, strict=True)),
        activation_bytes=table.reserve,
        budget=budget,
        choices=tuple(choices),
        peak_bytes=None if peak is None else peak.peak,
        cast_gather_bytes_by_axis=cast,
        peak_buffers=() if peak is None else peak.buffers,
    )
