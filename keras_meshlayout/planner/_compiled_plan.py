"""`plan_and_compile`: an automatic plan whose compiled training step fits its memory budget.

The planner predicts a step's peak without compiling it (`_peak`); on XLA:TPU that prediction can
miss by a quarter or more (docs/status.md, "The peak memory of a training step"). Here the plan is
confirmed by the compiler: the model's own Keras training step is compiled for the mesh from a dry
build (`kml.compile_step`, nothing allocated), and while XLA's compiled peak exceeds the budget the
plan is made again under its predicted peak scaled by that excess (`refit`, as `plan --compile` does).
Given devices rather than a mesh (a TPU target, a device count), the mesh is chosen too
(`kml.choose_mesh`), and where the chosen one compiles over the budget, the next in rank is compiled
instead (as `plan --mesh auto --compile` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import keras

from ..core._distribution import ModelParallel
from ..core._dry import dry_build
from ..core._errors import InvalidOptionError, MemoryBudgetError
from ..core._format import format_bytes
from ..core._memory import parse_bytes
from ..core._mesh import Mesh
from ..core._rules import LayoutRules
from ..core._targets import Target, parse_target
from ..report._compile import CompiledStep, compile_step
from ._auto import auto_rules
from ._mesh_choice import MeshChoice, choose_mesh, mesh_of, option_rules

__all__ = ["REFITS", "CompiledPlan", "Refit", "next_in_rank", "plan_and_compile", "promoted", "refit"]

#: How many times a plan compiled over its budget is made again, under a budget shrunk by the
#: compiled step's excess, before the budget is reported missed.
REFITS = 2


@dataclasses.dataclass(frozen=True)
class Refit:
    """One plan compiled over its memory budget, and planned again.

    Attributes:
        budget: The budget that plan was made under (the memory budget the first time).
        predicted_peak: Its predicted per-device peak (`planner._peak`), within the budget.
        compiled_peak: XLA's compiled per-device peak, over the memory budget.
        next_budget: The budget planned under next: the predicted peak scaled by the excess, or
            where no plan meets that, the smallest plan's own (`MemoryBudgetError.smallest_bytes`;
            where that plan is the one compiled over, nothing is planned after it); the same budget
            where the next mesh of a choice was tried instead.
        mesh: The mesh of a choice that plan was made for (`"data=2,model=4 fsdp"`), else `""`.
    """

    budget: int
    predicted_peak: int
    compiled_peak: int
    next_budget: int = 0
    mesh: str = ""

    def to_dict(self) -> dict[str, int | str]:
        data: dict[str, int | str] = {"mesh": self.mesh} if self.mesh else {}
        return data | {
            "budget_bytes": self.budget,
            "predicted_peak_bytes": self.predicted_peak,
            "compiled_peak_bytes": self.compiled_peak,
            "next_budget_bytes": self.next_budget,
        }


def refit(
    plan_under: Callable[[int], Any],
    planned: Any,
    budget: int,
    peaks: Callable[[Any], tuple[int, int]],
) -> tuple[Any, list[Refit]]:
    """Plans again under tighter budgets while the compiled step exceeds `budget` (`REFITS` times).

    The prediction keeps part of a budget free for its own error; where XLA's compiled peak is
    still over, the plan is made and compiled again under the planning budget or the predicted
    peak, whichever is smaller, times the ratio of the budget to that compiled peak: the
    prediction's own error, measured, is taken off (a plan predicted at 202 MiB that compiles to
    324 is far under a 277 MiB budget, which binds nothing). Where no plan meets that budget, the
    smallest plan is made (under its own `smallest_bytes`) and compiled instead, if it is smaller
    than the plan just compiled: its prediction may be closer. `plan_under(budget)` makes and
    compiles a plan, and `peaks(planned)` gives its `(predicted, compiled)` peaks; returned is the
    last plan made (over the budget if none fitted, or if no plan exists under the next budget)
    and the plans given up.
    """
    refits: list[Refit] = []
    planning = budget
    predicted, compiled = peaks(planned)
    while compiled > budget and len(refits) < REFITS:
        tighter = min(planning, predicted) * budget // compiled
        refits.append(Refit(planning, predicted, compiled, tighter))
        try:
            planned = plan_under(tighter)
        except MemoryBudgetError as err:
            # No plan under the shrunk budget: the smallest plan, if it was not the one just compiled
            # (its own prediction may be closer: the shrinking measured another plan's error).
            smallest = err.smallest_bytes
            if (
                smallest is None
                or not tighter < smallest < planning
                or predicted <= (err.smallest_peak_bytes or 0)
            ):
                break
            refits[-1] = dataclasses.replace(refits[-1], next_budget=smallest)
            tighter, planned = smallest, plan_under(smallest)
        planning = tighter
        predicted, compiled = peaks(planned)
    return planned, refits


@dataclasses.dataclass(frozen=True)
class CompiledPlan:
    """An automatic plan and its training step as XLA compiled it (`kml.plan_and_compile`).

    Attributes:
        rules: The plan (`kml.auto_rules`'), its predictions in `rules.cost`.
        step: Its compiled training step: XLA's per-device memory and the bytes it sends.
        refits: The plans made first and compiled over the memory budget, in order (empty when
            the first fitted).
        mesh: The mesh the step was compiled for: the one given, or the one chosen.
        choice: `kml.choose_mesh`'s ranking of the meshes, where the mesh was chosen (devices
            given rather than a mesh), else `None`; the one compiled first (`choice.best`), then
            the others in rank (those given up in `refits`).
    """

    rules: LayoutRules
    step: CompiledStep
    refits: tuple[Refit, ...] = ()
    mesh: keras.distribution.DeviceMesh | None = None
    choice: MeshChoice | None = None


def plan_and_compile(
    build: Callable[[], keras.Model],
    mesh: keras.distribution.DeviceMesh | int | str | Target,
    x: Any,
    y: Any = None,
    *,
    memory_budget: int | str | None = None,
    optimizer: str | keras.optimizers.Optimizer | None = "adam",
    loss: Any = None,
    **options: Any,
) -> CompiledPlan:
    """`kml.auto_rules` for one batch, confirmed by compiling the model's training step for the mesh.

    The plan is made from a dry build of `build()` (nothing allocated) under `memory_budget` (by
    default the HBM of the mesh's TPU target, if it has one), and the model's own Keras training
    step is compiled for it (`kml.compile_step`; for a TPU target through libtpu, no TPU needed).
    While XLA's compiled per-device peak exceeds the budget, the plan is made again under a budget
    of its predicted peak scaled by the excess (twice at most): a plan this returns fits once
    compiled.

    Given devices instead of a mesh (a TPU target such as `"tpu-v5e:16x16"`, or a device
    count), the mesh is chosen as well: `kml.choose_mesh` ranks every split of the devices by
    predicted step time within the budget and the best is compiled; while its compiled peak is
    over the budget, the next in rank is planned and compiled instead (three meshes at most). A
    device count's mesh is laid over this process's devices.

    Args:
        build: A function returning the model, as `kml.dry_plan` takes it.
        mesh: The mesh (a `kml.Mesh`, a TPU target's too), or the devices to choose one for: a
            TPU target (`"tpu-v5e:2x4"`, a `kml.Target`) or a device count.
        x: One global batch of inputs (arrays or `jax.ShapeDtypeStruct`s).
        y: Its targets, for the loss.
        memory_budget: Per-device bytes (`"15GiB"` or an int); `None`: the target's HBM, or no
            budget (the least-traffic plan, compiled once) on a mesh without a target.
        optimizer: The optimizer the step trains with.
        loss: The loss it trains with (Keras's name or object); default the mean squared error.
        **options: More of `kml.auto_rules`' options (`replicate_below`, `model_axis`, ...), for
            a mesh given (the mesh choice plans with the defaults).

    Returns:
        The `CompiledPlan`: the rules, the compiled step, any plans compiled over the budget,
        the mesh, and where it was chosen, the choice.

    Raises:
        MemoryBudgetError: No plan fits the budget as predicted, or the last plan made (the
            last mesh tried) still compiles over it; the message names the compiled and
            predicted peaks.
        InvalidOptionError: `auto_rules` options given with devices to choose a mesh for.

    Example:
        >>> import keras, numpy as np, keras_meshlayout as kml
        >>> def build():
        ...     return keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, name="up"),
        ...                              keras.layers.Dense(64, name="down")], name="mlp")
        >>> x, y = np.zeros((16, 64), "float32"), np.zeros((16, 64), "float32")
        >>> planned = kml.plan_and_compile(build, kml.Mesh(data=2, model=4), x, y, memory_budget="1MiB")
        >>> planned.step.peak_bytes <= 2**20, planned.rules.match("mlp/up/kernel").axes
        (True, (None, 'model'))
        >>> chosen = kml.plan_and_compile(build, 8, x, y, memory_budget="1MiB")
        >>> chosen.mesh.axis_sizes == chosen.choice.mesh.axis_sizes, chosen.step.peak_bytes <= 2**20
        (True, True)
    """
    choosing = isinstance(mesh, (int, str, Target))
    if choosing and options:
        raise InvalidOptionError(
            f"plan_and_compile: {sorted(options)} are kml.auto_rules options for a mesh you give; with "
            f"devices ({mesh!r}) the mesh is chosen by kml.choose_mesh, which plans with the defaults. Fix: "
            "drop them, or pass a kml.Mesh."
        )
    if choosing and not isinstance(mesh, (str, Target)):
        _check_count(mesh)
    target = parse_target(mesh) if isinstance(mesh, (str, Target)) else getattr(mesh, "target", None)
    if memory_budget is None and target is not None:
        memory_budget = target.hbm_bytes
    budget = None if memory_budget is None else parse_bytes(memory_budget)

    if choosing:
        return _chosen_and_compiled(build, mesh, x, y, budget, optimizer, loss)

    def plan_under(planning: int | None) -> CompiledPlan:
        with dry_build(build) as model:
            rules = auto_rules(model, mesh, memory_budget=planning, batch=x, optimizer=optimizer, **options)
        step = compile_step(build, ModelParallel(mesh, rules), x, y, optimizer=optimizer, loss=loss)
        return CompiledPlan(rules, step, mesh=mesh)

    planned = plan_under(budget)
    if budget is None:
        return planned
    planned, refits = refit(plan_under, planned, budget, _peaks)
    if planned.step.peak_bytes > budget:
        raise MemoryBudgetError(_missed(planned, budget, refits), smallest_bytes=planned.step.peak_bytes)
    return dataclasses.replace(planned, refits=tuple(refits))


def next_in_rank(
    planned: Any,
    budget: int,
    plan_on: Callable[[MeshChoice], Any],
    rules_of: Callable[[Any], LayoutRules],
    peaks: Callable[[Any], tuple[int, int]],
) -> tuple[Any, list[Refit]]:
    """While `planned` (compiled on its `choice`'s best split) is over `budget`, the next usable split
    in rank (`REFITS` more at most): `rules_of(option)` plans it, `plan_on(choice)` compiles the choice
    that puts it first, and `peaks(planned)` gives `(predicted, compiled)`. Returns the last planned
    and a `Refit` naming each split given up (`plan_and_compile` given devices, `plan --mesh auto`)."""
    refits: list[Refit] = []
    choice = planned.choice
    for option in [o for o in choice.alternatives if o.excluded is None][1 : REFITS + 1]:
        predicted, compiled = peaks(planned)
        if compiled <= budget:
            break
        refits.append(Refit(budget, predicted, compiled, budget, _label(planned.choice.best)))
        planned = plan_on(promoted(choice, option, rules_of(option)))
    return planned, refits


def _chosen_and_compiled(
    build: Callable[[], keras.Model],
    devices: Any,
    x: Any,
    y: Any,
    budget: int | None,
    optimizer: Any,
    loss: Any,
) -> CompiledPlan:
    """The best of `kml.choose_mesh`'s meshes whose compiled step fits `budget`, of its first `REFITS + 1`."""
    choice = choose_mesh(build, devices, batch=x, memory_budget=budget, optimizer=optimizer)

    def plan_on(choice: MeshChoice) -> CompiledPlan:
        mesh = _laid_out(choice.mesh)
        step = compile_step(build, ModelParallel(mesh, choice.rules), x, y, optimizer=optimizer, loss=loss)
        return CompiledPlan(choice.rules, step, mesh=mesh, choice=choice)

    planned = plan_on(choice)
    if budget is None:
        return planned
    planned, over = next_in_rank(
        planned,
        budget,
        plan_on,
        lambda o: option_rules(build, o, choice.target, x, optimizer, budget),
        _peaks,
    )
    if planned.step.peak_bytes <= budget:
        return dataclasses.replace(planned, refits=tuple(over))
    tried = [*over, Refit(budget, *_peaks(planned), budget, _label(planned.choice.best))]
    listed = "; ".join(
        f"{r.mesh}: predicted {format_bytes(r.predicted_peak)}, compiled {format_bytes(r.compiled_peak)}"
        for r in tried
    )
    raise MemoryBudgetError(
        f"plan_and_compile: no mesh for {devices!r} fits the memory budget of {format_bytes(budget)} "
        f"per device once compiled (XLA's memory_analysis), of the {len(tried)} best ranked within it "
        f"({listed}). Fix: a smaller batch, or a larger memory_budget.",
        smallest_bytes=min(r.compiled_peak for r in tried),
    )


def _label(option: Any) -> str:
    """A split as `Refit.mesh` names it: `"data=2,model=4 fsdp"`."""
    return option.spec + (" fsdp" if option.fsdp else "")


def _check_count(count: int) -> None:
    """A device count's chosen mesh is compiled over this process's devices: there must be as many."""
    import jax

    if not isinstance(count, bool) and count > (have := jax.device_count()):
        raise InvalidOptionError(
            f"plan_and_compile: {count} devices to choose a mesh for, but this process has {have}: the step "
            "is compiled over its own devices. Fix: a TPU target (such as 'tpu-v5e:4x4') to compile for "
            f"chips you do not have, kml.emulate_devices({count}) before JAX starts, or kml.choose_mesh to "
            "rank the meshes without compiling."
        )


def promoted(choice: MeshChoice, option: Any, rules: LayoutRules) -> MeshChoice:
    """`choice` with `option` first, as the one compiled: its mesh and its `rules`, the others after."""
    rest = tuple(o for o in choice.alternatives if o is not option)
    return dataclasses.replace(
        choice, mesh=mesh_of(option.axis_sizes, choice.target), rules=rules, alternatives=(option, *rest)
    )


def _laid_out(mesh: Any) -> Any:
    """The chosen mesh over devices to compile for: a device count's abstract mesh over this process's."""
    return Mesh(**mesh.axis_sizes) if mesh.is_abstract else mesh


def _peaks(planned: CompiledPlan) -> tuple[int, int]:
    return planned.rules.cost.peak_bytes or 0, planned.step.peak_bytes


def _missed(planned: CompiledPlan, budget: int, refits: list[Refit]) -> str:
    budgets = ", ".join(format_bytes(r.next_budget) for r in refits)
    unmet = bool(refits) and planned.rules.cost.budget != refits[-1].next_budget
    tried = f"Planned again under {budgets}" + (" (the last met by no plan, as predicted)" if unmet else "")
    return (
        f"plan_and_compile: the compiled training step needs {format_bytes(planned.step.peak_bytes)} per "
        f"device at its peak (XLA's memory_analysis), more than the memory budget of {format_bytes(budget)}; "
        f"the plan was predicted to peak at {format_bytes(planned.rules.cost.peak_bytes or 0)}. {tried}, "
        "without fitting once compiled. Fix: a smaller batch, "
        + ("" if planned.choice is not None else "a mesh with a larger model axis, ")
        + "or a larger memory_budget."
    )
