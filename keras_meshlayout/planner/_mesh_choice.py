"""The mesh chosen for you: every data × model (× expert) factorization planned, ranked by step time.

`choose_mesh` plans the model (`auto_rules` with a batch) on each way of splitting the devices
into a data axis and a model axis, over `jax.sharding.AbstractMesh`es for a device count (no
device is needed, not even emulated) or over a TPU target's compile-only devices (so that the
predicted peak follows XLA:TPU), each within the memory budget, and ranks the meshes that fit by

    step time = FLOPs per device / peak FLOP/s + bytes within a slice / ICI bandwidth
                                               + bytes between slices / DCN bandwidth

(`_flops`: XLA's count of the unsharded step, split as the layouts split each matmul; the bytes
between slices, on a multi-slice target, are those of the axis laid over them that XLA:TPU sends
across: `_mesh_splits`), with no overlap of compute and communication. A model with
mixture-of-experts banks is also planned on every `data × expert × model` split whose expert
axis divides its experts: the planner (`_experts`) splits the banks over the `expert` axis
there, and over the model axis on the two-axis meshes.

Fully sharded (ZeRO-3/FSDP) alternatives: the data axis is the fsdp axis. Each factorization
with a data axis of 2 or more is planned twice, and both rows are ranked together (`fsdp` says
which a row is, `layouts` what its units took):

- its least-traffic plan within the budget (`auto_rules(memory_budget=...)`): tensor-parallel
  units where they fit, and as the budget tightens, units moved to their 2-D or fully sharded
  layouts one by one (the search of `_search`);
- its fully sharded plan (`_auto.plan_rules(fully_sharded=True)`): every unit at its candidate of
  least state, so weights, gradients and optimizer slots are split over `data` as well as over
  `model` (a unit's 2-D layout, a weight outside every unit split over `data` or both axes, a
  table over both axes), each gathered for the layer's compute: its all-gathers (forward, again
  for the input gradient where XLA does so, in bfloat16 on XLA:TPU;
  `_candidates.Bytes.gathers_per_step`) are in the row's bytes and so in its predicted step
  time; its FLOPs are the least-traffic plan's, since a gathered weight computes as a whole one
  (`_flops`).

When the two plans lay every variable out alike (the budget left the search only the fully sharded
plan), the mesh has one row, marked `fsdp`. A mesh is excluded only when even its fully sharded plan
exceeds the budget, so a budget no tensor-parallel plan fits still gets a mesh wherever sharding over
`data` too fits it. `data=1` has no fully sharded row: there is no batch axis to split over.

There is no separate `fsdp` mesh axis (the batch over `data` and `fsdp` both, weights split over
`fsdp` only: hybrid sharding). Keras's `ModelParallel` splits the batch over one axis
(`batch_dim_name`), and so does everything that follows it here: the batch decision in
`core/_trainer_hooks.py`, the rows each process feeds (`core/_process_data.py`), and in the planner
the batch axis's size (`Bytes.d`, the gradient all-reduces), the propagated activation layouts
(`_propagate`), the peak walk and the FLOPs. A separate axis would take the batch layout as a pair of
axes in all of these, gathers over `fsdp` apart from the all-reduces over `data × fsdp`, and costs
measured against XLA for both; on one axis, `data=D` fully sharded is what a `data=1,fsdp=D` mesh would plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..core._dry import dry_build
from ..core._errors import InvalidOptionError, MemoryBudgetError
from ..core._format import Displayed, format_bytes, format_seconds, to_text
from ..core._memory import parse_bytes
from ..core._targets import Target, parse_target
from ._auto import plan_rules
from ._experts import EXPERT_AXIS, expert_counts
from ._flops import device_flops, step_flops
from ._mesh_splits import (
    comm_seconds,
    factorizations,
    float32_across_slices,
    network_bytes,
    slices_excluded,
)
from ._trace import trace_model, trace_step

if TYPE_CHECKING:
    import keras
    import rich.console

    from ..core._mesh import Mesh
    from ..core._rules import LayoutRules

__all__ = ["MeshChoice", "MeshOption", "choose_mesh", "mesh_of", "option_rules"]


@dataclasses.dataclass(frozen=True)
class MeshOption:
    """One factorization of the devices, planned and costed.

    Attributes:
        axis_sizes: The mesh's axes and sizes, `{"data": 16, "model": 16}` (with an `expert`
            axis between them for a mixture-of-experts model: `{"data": 4, "expert": 4, "model": 2}`).
        wire_bytes_by_axis: Bytes each device sends per step on each axis (`PlanCost`).
        peak_bytes: The predicted per-device peak of one training step, or `None` when the
            mesh was not planned.
        flops_per_device: One device's FLOPs of the step under the mesh's layouts (`None` when not planned).
        compute_seconds: `flops_per_device` over the target's peak FLOP/s (`None` without a target).
        comm_seconds: The bytes within a slice over the ICI bandwidth plus those between slices over
            the DCN bandwidth (`None` without a target; `_mesh_splits`).
        excluded: Why the mesh cannot be used (its predicted peak exceeds the budget, the batch
            does not divide), or `None`.
        fsdp: Whether the row is the mesh's fully sharded plan (ZeRO-3: every unit at its layout
            of least state, its weights, gradients and slots split over the batch axis too and
            gathered for each layer's compute) rather than its least-traffic plan within the budget.
        layouts: How many units took each layout (`PlanCost.layouts`: `{"2-D": 2, "fully sharded": 3}`).
        dcn_wire_bytes: Of `wire_bytes`, what each device sends between slices (the data-center
            network) on a multi-slice target; 0 on one slice.
        dcn_seconds: Of `comm_seconds`, the DCN's part (`None` without a target).
    """

    axis_sizes: dict[str, int]
    wire_bytes_by_axis: dict[str, float]
    peak_bytes: int | None
    flops_per_device: float | None
    compute_seconds: float | None
    comm_seconds: float | None
    excluded: str | None = None
    fsdp: bool = False
    layouts: dict[str, int] = dataclasses.field(default_factory=dict)
    dcn_wire_bytes: float = 0.0
    dcn_seconds: float | None = None

    @property
    def spec(self) -> str:
        """The mesh as `--mesh` takes it: `"data=16,model=16"`."""
        return ",".join(f"{axis}={size}" for axis, size in self.axis_sizes.items())

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends per step, over every axis."""
        return float(sum(self.wire_bytes_by_axis.values()))

    @property
    def ici_wire_bytes(self) -> float:
        """Of `wire_bytes`, what each device sends within its slice (the ICI)."""
        return self.wire_bytes - self.dcn_wire_bytes

    @property
    def step_seconds(self) -> float | None:
        """Predicted step time: compute plus communication, no overlap (`None` without a target)."""
        if self.compute_seconds is None or self.comm_seconds is None:
            return None
        return self.compute_seconds + self.comm_seconds

    def to_dict(self) -> dict[str, Any]:
        """The option as JSON-ready data."""
        return {
            "mesh": self.spec,
            "fsdp": self.fsdp,
            "axis_sizes": dict(self.axis_sizes),
            "wire_bytes_per_device": self.wire_bytes,
            "wire_bytes_by_axis": dict(self.wire_bytes_by_axis),
            "ici_wire_bytes": self.ici_wire_bytes,
            "dcn_wire_bytes": self.dcn_wire_bytes,
            "peak_bytes": self.peak_bytes,
            "flops_per_device": self.flops_per_device,
            "compute_seconds": self.compute_seconds,
            "comm_seconds": self.comm_seconds,
            "dcn_seconds": self.dcn_seconds,
            "step_seconds": self.step_seconds,
            "excluded": self.excluded,
            "layouts": dict(self.layouts),
        }


@dataclasses.dataclass(frozen=True)
class MeshChoice(Displayed):
    """The mesh `choose_mesh` picked, its rules, and every alternative, best first.

    Attributes:
        mesh: The best mesh (over the target's compile-only devices with a target, else an
            abstract mesh of the device count).
        rules: `kml.auto_rules` for it, with `rules.cost`.
        alternatives: Every factorization, the usable ones best first, then the excluded.
        target: The TPU target ranked for, or `None` (a device count: ranked by bytes sent).
        flops: FLOPs of one unsharded training step (XLA's cost analysis of the lowered step).
        budget: The per-device memory budget the peaks were held to, or `None`.
    """

    mesh: Mesh
    rules: LayoutRules
    alternatives: tuple[MeshOption, ...]
    target: Target | None
    flops: float
    budget: int | None

    @property
    def best(self) -> MeshOption:
        """The chosen mesh's row."""
        return self.alternatives[0]

    def to_dict(self) -> dict[str, Any]:
        """`{"mesh": ..., "alternatives": [...], ...}` as `plan --json` prints it."""
        return {
            "mesh": self.best.spec,
            "fsdp": self.best.fsdp,
            "target": None if self.target is None else self.target.spec,
            "flops_per_step": self.flops,
            "budget": self.budget,
            "alternatives": [option.to_dict() for option in self.alternatives],
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.table import Table

        ranked = "predicted step time" if self.target is not None else "FLOPs per device, then bytes sent"
        table = Table(title=f"Meshes for {self.target or f'{self.mesh.size} devices'}, by {ranked}")
        slices = self.target is not None and self.target.slices > 1
        comm = ("ICI", "DCN", "DCN sent") if slices else ("comm",)
        for column in ("mesh", "plan", "step", "compute", *comm, "FLOPs/device", "sent/device", "peak/device",
                       "note"):  # fmt: skip
            table.add_column(column, justify="left" if column in ("mesh", "plan", "note") else "right")
        for index, option in enumerate(self.alternatives):
            note = option.excluded or ("chosen" if index == 0 else "")
            used = option.excluded is None
            times = (format_seconds(option.comm_seconds),)
            if slices:
                comm_s, dcn_s = option.comm_seconds, option.dcn_seconds
                ici = None if comm_s is None else comm_s - (dcn_s or 0.0)
                times = (format_seconds(ici), format_seconds(option.dcn_seconds),
                         format_bytes(option.dcn_wire_bytes) if used else "-")  # fmt: skip
            table.add_row(
                option.spec,
                "fully sharded" if option.fsdp else "least traffic",
                format_seconds(option.step_seconds),
                format_seconds(option.compute_seconds),
                *times,
                "-" if option.flops_per_device is None else f"{option.flops_per_device:.3g}",
                format_bytes(option.wire_bytes) if used else "-",
                "-" if option.peak_bytes is None else format_bytes(option.peak_bytes),
                note,
            )
        yield table
        budget = "no budget" if self.budget is None else f"budget {format_bytes(self.budget)}/device"
        yield f"{self.flops:.3g} FLOPs per step (XLA, unsharded), {budget}; compute and comm not overlapped"
        if self.best.axis_sizes.get("data", 1) == 1 and set(self.best.layouts or {}) <= {"replicated"}:
            yield (
                f"note: the chosen split runs the same step on each of its {self.mesh.size} devices (the "
                "batch not split, every weight whole): here no split pays for its traffic, so one device "
                "would be as fast; a larger batch or model changes that"
            )

    def __str__(self) -> str:
        return to_text(self)


def choose_mesh(
    build: Callable[[], keras.Model],
    devices: int | str | Target,
    *,
    batch: Any,
    memory_budget: int | str | None = None,
    optimizer: str | keras.optimizers.Optimizer | None = None,
    axes: tuple[str, str] = ("data", "model"),
) -> MeshChoice:
    """Plans the model on every data × model (× expert) split of the devices; returns the fastest that fits.

    Each factorization `data × model = devices` is planned with `kml.auto_rules` on an abstract
    mesh (on the target's devices for a target, whose peak follows XLA:TPU), with `batch` and
    within the budget (default: the target's HBM), so its rules carry the
    bytes each device sends per axis and the predicted peak, and trade traffic for memory as
    `auto_rules(memory_budget=...)` does. The step time is predicted as

        FLOPs per device / the target's peak FLOP/s + bytes within a slice / ICI bandwidth
                                                     + bytes between slices / DCN bandwidth

    with no overlap of compute and communication. The FLOPs are XLA's `cost_analysis` of the
    lowered, unsharded step; each device's share divides every traced matmul and convolution
    by the axes its output and contracted dimensions are split over (a layer left replicated
    on the model axis counts in full on each of its devices), the rest of the step evenly over
    all devices. On a multi-slice target the data axis is laid over the slices (a split whose
    data axis does not divide by them is excluded), and the bytes of collectives over it are
    split as XLA:TPU decomposes them: within each slice over the ICI, across the slices over the
    DCN (`_mesh_splits`; `MeshOption.dcn_wire_bytes`). Without a target, the splits rank by
    FLOPs per device, then bytes sent. A mesh on which no layout fits the budget (not even the
    fully sharded one), or whose data axis does not divide the batch, is listed as excluded.

    Each split with a data axis of 2 or more is also planned fully sharded (ZeRO-3 over the
    data axis: every unit at its layout of least state, its weights gathered for each layer's
    compute, the gathers in its bytes sent); that plan is ranked beside the least-traffic one,
    marked `fsdp` (see the module).

    A model with mixture-of-experts banks (`kml.auto_rules` splits them on their expert
    dimension) is also planned on each `data × expert × model = devices` with an expert axis of 2
    or more that divides every bank's expert count; its banks are split over `expert`, the
    rest of the model over `model` as on two axes.

    Args:
        build: A function returning the Keras model, built with its weights deferred (as
            `kml.dry_plan` does).
        devices: A TPU target (`"tpu-v5e:16x16"`, a `kml.Target`) or a device count (then ranked
            by FLOPs per device and bytes sent, with no budget unless given).
        batch: One global batch of inputs (arrays or `jax.ShapeDtypeStruct`s).
        memory_budget: Per-device memory the predicted peak must fit (bytes or `"16GiB"`).
        optimizer: The optimizer whose slots the peak counts (as for `kml.auto_rules`).
        axes: The names of the batch axis and the tensor-parallel axis (neither may be
            `"expert"`, the expert axis's name, for the three-axis splits to be planned).

    Returns:
        A `MeshChoice`: the best mesh (over the target's devices, or abstract), its rules (the
        fully sharded plan where `choice.best.fsdp`), and the alternatives, best first.

    Raises:
        InvalidOptionError: `devices` is not a positive count or a target, or `axes` not two names.
        MemoryBudgetError: No factorization fits the budget (or divides the batch).

    Example:
        >>> import keras, numpy as np, keras_meshlayout as kml
        >>> def build():
        ...     return keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, name="up"),
        ...                              keras.layers.Dense(64, name="down")], name="mlp")
        >>> choice = kml.choose_mesh(build, 8, batch=np.zeros((16, 64), "float32"), optimizer="adam")
        >>> [option.spec + (" fsdp" if option.fsdp else "") for option in choice.alternatives[:3]]
        ['data=1,model=8', 'data=2,model=4', 'data=2,model=4 fsdp']
        >>> choice.mesh.axis_sizes, choice.best.wire_bytes < choice.alternatives[-1].wire_bytes
        ({'data': 1, 'model': 8}, True)
    """
    target, count = _devices_of(devices)
    if len(axes) != 2 or len(set(axes)) != 2:
        raise InvalidOptionError(
            f"choose_mesh: axes={axes!r} must be two different names, the batch axis then the "
            "tensor-parallel axis. Fix: axes=('data', 'model')."
        )
    budget = _budget(memory_budget, target)
    with dry_build(build) as model:
        step = _Step(model, batch, step_flops(model, batch), trace_step(model, batch), optimizer, axes)
        experts = expert_counts(model, trace_model(model, batch)) if EXPERT_AXIS not in axes else set()
        sizes_list = factorizations(count, axes, math.gcd(*experts) if experts else 1)
        options = [option for sizes in sizes_list for option in _options(step, sizes, target, budget)]
    ranked = sorted((o for o in options if o.excluded is None), key=_rank)
    if not ranked:
        peaks = [o.peak_bytes for o in options if o.peak_bytes is not None]
        raise MemoryBudgetError(
            _none_fit(count, target, budget, options), smallest_bytes=min(peaks, default=None)
        )
    mesh = mesh_of(ranked[0].axis_sizes, target)
    rules = option_rules(build, ranked[0], target, batch, optimizer, budget, axes)
    alternatives = (*ranked, *(o for o in options if o.excluded is not None))
    return MeshChoice(mesh, rules, alternatives, target, step.flops, budget)


def _devices_of(devices: int | str | Target) -> tuple[Target | None, int]:
    """The target (or `None`) and the device count `devices` names."""
    if isinstance(devices, bool) or not isinstance(devices, (int, str, Target)):
        raise InvalidOptionError(
            f"choose_mesh: devices={devices!r} is neither a device count nor a TPU target. Fix: pass "
            "an int such as 8, or a target such as 'tpu-v5e:16x16'."
        )
    if isinstance(devices, int):
        if devices < 1:
            raise InvalidOptionError(f"choose_mesh: devices={devices} must be at least 1. Fix: pass 8.")
        return None, devices
    target = parse_target(devices)
    return target, target.chips


def _budget(memory_budget: int | str | None, target: Target | None) -> int | None:
    if memory_budget is not None:
        return parse_bytes(memory_budget)
    return None if target is None else target.hbm_bytes


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every factorization is planned from: the dry model, its batch, its step's FLOPs and trace."""

    model: Any
    batch: Any
    flops: float
    trace: Any
    optimizer: Any
    axes: tuple[str, str]


def _options(
    step: _Step, sizes: dict[str, int], target: Target | None, budget: int | None
) -> list[MeshOption]:
    """One factorization's rows: its least-traffic plan within the budget and, with a batch axis of 2
    or more, its fully sharded plan where that differs (one row marked `fsdp` where the budget left
    the search only the fully sharded plan); or one row saying why the mesh cannot be used."""
    rows = _rows(step.batch)
    data = sizes[step.axes[0]]
    if rows % data:
        why = f"the batch of {rows} rows does not split over {step.axes[0]}={data}"
        return [MeshOption(sizes, {}, None, None, None, None, excluded=why)]
    why = slices_excluded(sizes, target)
    if why is not None:
        return [MeshOption(sizes, {}, None, None, None, None, excluded=why)]
    # Over the target's devices, so that the predicted peak follows its compiler (`_peak`).
    mesh = mesh_of(sizes, target)
    try:
        least = _plan(step.model, mesh, step.batch, step.optimizer, budget, step.axes)
    except MemoryBudgetError as err:  # the fully sharded plan is the smallest: it does not fit either
        why = f"no layout fits the budget (fully sharded, needs {format_bytes(err.smallest_bytes or 0)})"
        return [MeshOption(sizes, {}, err.smallest_bytes, None, None, None, excluded=why)]
    if data < 2:
        return [_costed(step, sizes, target, least, fsdp=False)]
    sharded = _plan(step.model, mesh, step.batch, step.optimizer, budget, step.axes, fully_sharded=True)
    if _same_layouts(least, sharded):
        return [_costed(step, sizes, target, least, fsdp=True)]
    return [_costed(step, sizes, target, least, fsdp=False), _costed(step, sizes, target, sharded, fsdp=True)]


def _same_layouts(one: Any, other: Any) -> bool:
    """Whether two plans of one mesh lay out every variable alike."""
    return [(r.pattern, r.axes) for r in one.rules] == [(r.pattern, r.axes) for r in other.rules]


def _costed(step: _Step, sizes: dict[str, int], target: Target | None, rules: Any, fsdp: bool) -> MeshOption:
    """A planned factorization's row: bytes per axis, peak, FLOPs and times."""
    cost = rules.cost
    peak = cost.peak_bytes if cost.peak_bytes is not None else cost.memory_bytes
    # Every axis, and the groups over several (a table over both axes sends on "data×model").
    by_axis = {axis: 0.0 for axis in sizes} | {a: float(b) for a, b in cost.wire_bytes_by_axis.items()}
    extra = float32_across_slices(cost.cast_gather_bytes_by_axis, sizes, target)
    for label, amount in extra.items():  # the bfloat16 gathers' share between slices, in float32
        by_axis[label] = by_axis.get(label, 0.0) + amount
    flops = device_flops(step.flops, step.trace, _layouts(step.model, rules, sizes), sizes, step.axes[0])
    ici, dcn = network_bytes(by_axis, sizes, target, across=extra)
    compute = comm = dcn_seconds = None
    if target is not None:
        compute = flops / target.peak_flops
        ici_seconds, dcn_seconds = comm_seconds(ici, dcn, target)
        comm = ici_seconds + dcn_seconds
    return MeshOption(
        sizes, by_axis, peak, flops, compute, comm, fsdp=fsdp, layouts=cost.layouts(),
        dcn_wire_bytes=dcn, dcn_seconds=dcn_seconds,
    )  # fmt: skip


def _layouts(model: Any, rules: Any, sizes: dict[str, int]) -> dict[str, Any]:
    """Each variable's layout as `kml.ModelParallel` resolves it under `rules`."""
    from ..core._resolve import resolve

    below = rules.policy.replicate_below if rules.policy is not None else 0
    return {
        v.path: resolve(v.path, v.shape, v.dtype, rules, sizes, replicate_below=below, warn=False).axes
        for v in model.weights
    }


def _rank(option: MeshOption) -> tuple[float, float, int, bool]:
    """Step time, then bytes, then the larger data axis, then the least-traffic plan before the fully
    sharded one; without a target the FLOPs per device (to 0.1%) come first, then the bytes sent."""
    data = -next(iter(option.axis_sizes.values()))
    if option.step_seconds is not None:
        return (option.step_seconds, option.wire_bytes, data, option.fsdp)
    flops = float(f"{option.flops_per_device or 0.0:.3g}")
    return (flops, option.wire_bytes, data, option.fsdp)


def _plan(
    model: Any,
    mesh: Any,
    batch: Any,
    optimizer: Any,
    budget: int | None,
    axes: Sequence[str],
    fully_sharded: bool = False,
) -> Any:
    return plan_rules(
        model, mesh, model_axis=axes[1], batch_axis=axes[0], batch=batch, optimizer=optimizer,
        memory_budget=budget, fully_sharded=fully_sharded,
    )  # fmt: skip


def option_rules(build, option: MeshOption, target, batch, optimizer, budget, axes=("data", "model")) -> Any:
    """The rules of one of `choose_mesh`'s rows (its least-traffic or fully sharded plan), made again."""
    with dry_build(build) as model:
        mesh = mesh_of(option.axis_sizes, target)
        return _plan(model, mesh, batch, optimizer, budget, axes, fully_sharded=option.fsdp)


def mesh_of(sizes: dict[str, int], target: Target | None) -> Any:
    """The mesh of `sizes`: over the target's compile-only devices, else abstract."""
    import jax

    from ..core._mesh import Mesh

    if target is not None:
        return Mesh(**sizes, target=target)
    return Mesh(jax.sharding.AbstractMesh(tuple(sizes.values()), tuple(sizes)))


def _rows(batch: Any) -> int:
    import jax

    leaves = jax.tree_util.tree_leaves(batch)
    return int(leaves[0].shape[0])


def _none_fit(count: int, target: Target | None, budget: int | None, options: list[MeshOption]) -> str:
    where = target.spec if target is not None else f"{count} devices"
    kinds = "data × model" if all(len(o.axis_sizes) == 2 for o in options) else "data × (expert ×) model"
    reasons = "; ".join(f"{o.spec}: {o.excluded}" for o in options)
    return (
        f"choose_mesh: no {kinds} split of {where} fits ({reasons}). Fix: a smaller batch, a "
        f"larger target, or a larger memory budget (now {format_bytes(budget) if budget else 'none'})."
    )
