"""The memory budget: bytes per device, and the guard against too much replication.

Per device, a training step holds the parameters (and non-trainable state),
one gradient per trainable parameter with the parameter's layout and dtype,
and the optimizer's variables with their own layouts. All three come from the
plan, so whatever optimizer was planned (SGD with or without momentum,
Adam/AdamW, Adafactor, Lion, ...) is counted from its real slot variables, in
their real dtypes, mixed precision included. Activations are not counted.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from .. import _compat
from ._errors import InvalidOptionError, MemoryBudgetError
from ._format import did_you_mean, format_bytes

if TYPE_CHECKING:
    from ._resolve import Resolution


class PlanEntries(Protocol):
    """What the memory budget reads of a plan (`kml.Plan` has it): its entries and mesh."""

    @property
    def entries(self) -> Sequence[Resolution]: ...
    @property
    def axis_sizes(self) -> Mapping[str, int]: ...
    @property
    def intended(self) -> frozenset[str]: ...


__all__ = [
    "MemoryEstimate",
    "PlanEntries",
    "SlotModel",
    "accumulates",
    "check_plan",
    "memory_of",
    "parse_bytes",
    "slot_model",
]


@dataclasses.dataclass(frozen=True)
class SlotModel:
    """What an optimizer keeps per trainable parameter: the one model of optimizer memory.

    The plan counts an optimizer's real variables; the dry plan (for
    Adafactor, which cannot be built in a stateless scope) and the budget
    planner (for layouts not yet chosen) describe them with this model.

    Attributes:
        like_parameter: Slots shaped like the parameter, laid out like it
            (Adam's two moments, SGD's momentum, Adafactor's velocity).
        factored: Adafactor: a matrix also keeps the row and column statistics
            of its last two dimensions, replicated; a vector two int32 placeholders.
        scalar_bytes: The optimizer's own scalars (iterations, learning rate).
        one_more: Whether a parameter keeps one more slot like itself than the probe did
            (Keras's Muon: the variables it updates as AdamW, vectors and embeddings by
            default, keep a velocity beside the momentum); `None` when none does.
    """

    like_parameter: int
    factored: bool
    scalar_bytes: int
    one_more: Callable[[Any], bool] | None = None

    def variable_bytes(self, variable: Any, shards: int, trainable: bool = True, slots: bool = True) -> int:
        """`state_bytes` of a variable, with the slots the optimizer keeps for it (`slots_like`)."""
        shape, dtype, like = tuple(variable.shape), str(variable.dtype), self.slots_like(variable)
        return self.state_bytes(shape, dtype, shards, trainable, slots, like)

    def slots_like(self, variable: Any) -> int:
        """How many slots shaped and laid out like `variable` the optimizer keeps for it."""
        return self.like_parameter + bool(self.one_more is not None and self.one_more(variable))

    def slot_shapes(
        self, shape: tuple[int, ...], dtype: str, like: int | None = None
    ) -> list[tuple[tuple[int, ...], str, bool]]:
        """`(shape, dtype, laid out like the parameter)` of each slot one parameter gets (`like` of
        them shaped like it: `slots_like`, the probe's count by default)."""
        slots = [(tuple(shape), dtype, True)] * (self.like_parameter if like is None else like)
        if self.factored:
            if len(shape) >= 2:
                slots += [(tuple(shape[:-1]), dtype, False), (tuple(shape[:-2] + shape[-1:]), dtype, False)]
            else:
                slots += [((), "int32", False)] * 2
        return slots

    def state_bytes(
        self,
        shape: tuple[int, ...],
        dtype: str,
        shards: int,
        trainable: bool = True,
        slots: bool = True,
        like: int | None = None,
    ) -> int:
        """Per-device bytes of a parameter split into `shards`, its gradient and its slots.

        Without `slots`: a variable Keras's optimizers overwrite with its gradient (float8's scales
        and amax histories, `overwrite_with_gradient`), which they keep no slots for. `like`: the
        slots shaped like it (`slots_like`).
        """
        per_device = _nbytes(shape, dtype) // shards
        if not trainable:
            return per_device
        total = 2 * per_device
        if not slots:
            return total
        for slot_shape, slot_dtype, follows in self.slot_shapes(tuple(shape), dtype, like):
            size = _nbytes(slot_shape, slot_dtype)
            total += size // shards if follows else size
        return total


#: No optimizer: parameters and gradients only.
NO_OPTIMIZER = SlotModel(like_parameter=0, factored=False, scalar_bytes=0)


def optimizer_of(optimizer: Any) -> Any:
    """`keras.optimizers.get(optimizer)`, a name Keras does not know refused with the names it does.

    A name `get` does not know but `keras.optimizers` exports a class of (`"lamb"`) makes that class.

    Example:
        >>> type(optimizer_of("lamb")).__name__
        'Lamb'
        >>> try:
        ...     optimizer_of("adamm")
        ... except InvalidOptionError as error:
        ...     print(str(error).split(" Fix")[0])
        Keras knows no optimizer named 'adamm'. Did you mean 'adam'?
    """
    import keras

    if not isinstance(optimizer, (str, dict, keras.optimizers.Optimizer)):
        raise InvalidOptionError(
            f"The optimizer must be a name (such as 'adam') or a keras.optimizers.Optimizer; received "
            f"{type(optimizer).__name__} {optimizer!r}. Fix: pass optimizer='adam' or "
            "keras.optimizers.Adam(...)."
        )
    try:
        return keras.optimizers.get(optimizer)
    except ValueError:
        if not isinstance(optimizer, str):
            raise
        classes = [c for c in vars(keras.optimizers).values() if isinstance(c, type)]
        made = [c for c in classes if issubclass(c, keras.optimizers.Optimizer) and _made_by_name(c)]
        by_name = {c.__name__.lower(): c for c in made if c is not keras.optimizers.Optimizer}
        if optimizer.lower() in by_name:  # exported, but not in `get`'s table (Lamb, ScheduleFreeAdamW)
            return by_name[optimizer.lower()]()
        known = sorted(by_name)
        raise InvalidOptionError(
            f"Keras knows no optimizer named {optimizer!r}.{did_you_mean(optimizer.lower(), known)} "
            f"Fix: pass one of {', '.join(known)}, or a keras.optimizers.Optimizer."
        ) from None


def _made_by_name(cls: type) -> bool:
    """Whether an optimizer class is made from its name alone (a wrapper needs the optimizer it wraps)."""
    import inspect

    required = [
        p
        for p in list(inspect.signature(cls.__init__).parameters.values())[1:]
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    return not required and not inspect.isabstract(cls)


def slot_model(optimizer: Any) -> SlotModel:
    """The `SlotModel` of an optimizer (or a name Keras knows), measured on a 4×4 probe variable."""
    if optimizer is None:
        return NO_OPTIMIZER
    import keras
    import numpy as np

    optimizer = optimizer_of(optimizer)
    if isinstance(optimizer, keras.optimizers.Adafactor):
        # Its build makes eager placeholders; its variables are known (see `SlotModel.factored`).
        return SlotModel(like_parameter=1, factored=True, scalar_bytes=_scalar_bytes(optimizer.variables))
    with warnings.catch_warnings():  # Keras's Muon reads its config with numpy 2's `copy=False` warning
        warnings.simplefilter("ignore", DeprecationWarning)
        fresh = optimizer.__class__.from_config(optimizer.get_config())
    probe = keras.Variable(np.zeros((4, 4), "float32"), name="kml_slot_probe")
    fresh.build([probe])
    slots = sum(int(np.prod(v.shape)) for v in fresh.variables if len(v.shape) > 0)
    one_more = None
    if isinstance(fresh, keras.optimizers.Muon):  # the probe, a 4×4 matrix, is one it orthogonalises
        one_more = functools.partial(_compat.updated_as_adamw, fresh)
    return SlotModel(
        like_parameter=round(slots / 16),
        factored=False,
        scalar_bytes=_scalar_bytes(fresh.variables),
        one_more=one_more,
    )


def accumulates(optimizer: Any) -> bool:
    """Whether `optimizer` accumulates gradients over steps (`gradient_accumulation_steps` above 1).

    Its update is then a conditional (apply, or add to the accumulators) that the peak walk
    counts (`planner._peak.peak_memory`); a name or `None` never accumulates.

    Example:
        >>> import keras
        >>> accumulates(keras.optimizers.Adam(gradient_accumulation_steps=4)), accumulates("adam")
        (True, False)
    """
    steps = getattr(optimizer, "gradient_accumulation_steps", None)
    return isinstance(steps, int) and steps > 1


def _scalar_bytes(variables: Any) -> int:
    import numpy as np

    return sum(np.dtype(v.dtype).itemsize for v in variables if len(v.shape) == 0)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    import math

    import numpy as np

    return math.prod(shape) * np.dtype(dtype).itemsize


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes each device holds for training state (activations excluded).

    Attributes:
        parameters: Model variables, trainable and not.
        gradients: One gradient per trainable variable.
        optimizer: Optimizer variables (slots, step counters).
        capacity: Device memory in bytes, when known.
    """

    parameters: int
    gradients: int
    optimizer: int
    capacity: int | None = None

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def fits(self) -> bool | None:
        """Whether `total` fits `capacity` (`None` when the capacity is unknown)."""
        return None if self.capacity is None else self.total <= self.capacity

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total": self.total, "fits": self.fits}


def memory_of(entries: Iterable[Resolution], device_memory: int | str | None = None) -> MemoryEstimate:
    """The per-device training-state bytes of a plan's entries (see `Plan.memory`)."""
    capacity = None if device_memory is None else parse_bytes(device_memory)
    by_role = {"parameter": 0, "state": 0, "optimizer": 0, "rng": 0}  # rng: a SeedGenerator, uncounted
    for entry in entries:
        by_role[entry.role] += entry.bytes_per_device
    return MemoryEstimate(
        parameters=by_role["parameter"] + by_role["state"],
        gradients=by_role["parameter"],
        optimizer=by_role["optimizer"],
        capacity=capacity,
    )


def check_plan(
    plan: PlanEntries,
    *,
    max_replicated_fraction: float = 0.5,
    device_memory: int | str | None = None,
    show: int = 5,
) -> None:
    """Fails a plan that keeps too much replicated or does not fit a device.

    Variables that a rule chosen for the user (`kml.auto_rules`, a preset) keeps
    replicated on purpose (`plan.intended`; the rule's note says why) are that rule's
    honest answer, not a failure: see `intended_replication` for what to pass to split
    them.

    Args:
        plan: The plan to check.
        max_replicated_fraction: Largest share of each device's training state
            that may sit in replicated variables that some mesh axis could
            split, not counting `plan.intended` (1.0 turns this check off).
        device_memory: Device capacity (`80e9`, `"80GB"`, `"16GiB"`); `None`
            skips the capacity check.
        show: How many of the largest replicated variables to name.

    Raises:
        MemoryBudgetError: either check fails; the message names the largest
            replicated variables and the mesh axes that could split them.
    """
    if not 0.0 <= max_replicated_fraction <= 1.0:
        raise InvalidOptionError(
            f"max_replicated_fraction must be between 0 and 1. Received: {max_replicated_fraction!r}."
        )
    memory = memory_of(plan.entries, device_memory)
    problems = []
    if memory.fits is False:
        problems.append(
            f"training state needs {_gb(memory.total)} per device (parameters {_gb(memory.parameters)}, "
            f"gradients {_gb(memory.gradients)}, optimizer {_gb(memory.optimizer)}), more than the "
            f"{_gb(memory.capacity)} available"
        )
    intended = getattr(plan, "intended", frozenset())
    splittable = [
        (e, _axes_that_split(e, plan.axis_sizes))
        for e in plan.entries
        if e.replicated and e.path not in intended
    ]
    splittable = [(e, axes) for e, axes in splittable if axes]
    replicated = sum(_training_bytes(e) for e, _ in splittable)
    fraction = replicated / memory.total if memory.total else 0.0
    if fraction > max_replicated_fraction:
        problems.append(
            f"{fraction:.0%} of each device's training state ({_gb(replicated)} of {_gb(memory.total)}) "
            f"is replicated although a mesh axis could split it (max_replicated_fraction="
            f"{max_replicated_fraction})"
        )
    if not problems:
        return
    largest = sorted(splittable, key=lambda item: -_training_bytes(item[0]))[:show]
    lines = [
        f"  {e.path} {e.shape} {e.dtype}: {_gb(_training_bytes(e))} per device; could split {axes}"
        for e, axes in largest
    ]
    if not lines:  # every variable split already, or none a mesh axis divides: only a larger device helps
        raise MemoryBudgetError(
            "The plan does not fit: "
            + "; and ".join(problems)
            + ". No replicated variable is left that a mesh axis could split. Fix: a device with more "
            "memory, more devices (a larger mesh axis), or an optimizer with fewer slots (e.g. Adafactor)."
        )
    raise MemoryBudgetError(
        "The plan does not fit: "
        + "; and ".join(problems)
        + ".\nLargest replicated variables (with gradient and optimizer state where they have them):\n"
        + "\n".join(lines)
        + "\nFix: add rules that split these variables over one of the axes shown (or use "
        "kml.auto_rules / a preset), use a mesh with a larger model axis, or raise "
        "max_replicated_fraction if replication is intended (pure data parallelism)."
    )


def intended_replication(plan: PlanEntries, *, max_replicated_fraction: float = 0.5) -> str | None:
    """Why the rules chosen for the user keep much replicated, and what to pass to split more.

    `None` unless the variables kept replicated on purpose (`plan.intended`), and that
    some mesh axis could split, exceed `max_replicated_fraction` of each device's training
    state. The guard (`check_plan`) does not fail on them: this says why they stay whole.
    """
    memory = memory_of(plan.entries)
    kept = [e for e in plan.entries if e.path in plan.intended and _axes_that_split(e, plan.axis_sizes)]
    share = sum(_training_bytes(e) for e in kept) / memory.total if memory.total else 0.0
    if share <= max_replicated_fraction:
        return None
    notes: dict[str, int] = {}
    for entry in kept:
        if entry.rule is not None and entry.rule.note:
            notes[entry.rule.note] = notes.get(entry.rule.note, 0) + _training_bytes(entry)
    why = "; ".join(note for note, _ in sorted(notes.items(), key=lambda item: -item[1])[:3])
    return (
        f"{share:.0%} of each device's training state stays replicated by the planner's (or preset's) own "
        f"choice: {why or 'see the notes in the table'}. That is its honest answer on this mesh, not a "
        "failure. To split more: give it a memory budget (keras-meshlayout plan --auto --memory-budget SIZE "
        "--batch-size N; kml.auto_rules(..., memory_budget=..., batch=...)), which may shard these "
        "variables over the batch axis, or plan on another mesh whose model axis divides these sizes."
    )


def parse_bytes(value: int | float | str) -> int:
    """`80e9`, `"80GB"`, `"16GiB"`, `"512 MiB"` → bytes.

    Example:
        >>> parse_bytes("80GB"), parse_bytes("16GiB"), parse_bytes(1024)
        (80000000000, 17179869184, 1024)
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value >= 1 and float(value).is_integer():
            return int(value)
        meant = f' ("{value}GB" or "{value}GiB", if that is what you meant)' if value > 0 else ""
        raise InvalidOptionError(
            f"A memory size of {value!r} bytes is not a whole, positive number of bytes. Write it in "
            f"bytes (80e9) or with a unit{meant}."
        )
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", str(value), flags=re.IGNORECASE)
    if not match or float(match[1]) * _UNITS[(match[2] or "").upper()] < 1:
        why = " (a memory size is positive)" if str(value).strip().startswith(("-", "0")) or match else ""
        raise InvalidOptionError(
            f"Cannot read a memory size from {value!r}{why}. Write it as a number of bytes or with a "
            'unit, e.g. "80GB" or "16GiB".'
        )
    return int(float(match[1]) * _UNITS[(match[2] or "").upper()])


def _training_bytes(entry: Resolution) -> int:
    """Per-device bytes of a variable and of its gradient, if it has one."""
    return entry.bytes_per_device * (2 if entry.role == "parameter" else 1)


def _axes_that_split(entry: Resolution, axis_sizes: dict[str, int]) -> str:
    """`"dim 0 (4096) over model (4) or data (2)"`, or `""` when nothing divides."""
    options = []
    for dim, size in enumerate(entry.shape):
        axes = [f"{name} ({n})" for name, n in axis_sizes.items() if n > 1 and size % n == 0]
        if axes:
            options.append(f"dim {dim} ({size}) over {' or '.join(axes)}")
    return "; ".join(options)


def _gb(count: float | None) -> str:
    return "unknown" if count is None else format_bytes(count)
