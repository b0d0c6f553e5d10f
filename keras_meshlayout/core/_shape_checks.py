"""Where a rule's layout meets a variable's shape: rank, axis names, size and divisibility.

Pure functions of the path, shape, rule and mesh axis sizes, each raising one of our errors
(naming the variable, the rule, the axis and the sizes) before anything is placed on a
device. `_resolve.resolve` applies them in order for every variable; the plan, the planner
and `kml.ModelParallel` all go through it, so they cannot disagree.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from ._axes import Axes, entry_axes, entry_size
from ._errors import IndivisibleShapeError, IndivisibleShapeWarning, InvalidRuleError, RankMismatchError
from ._format import did_you_mean
from ._policy import IndivisiblePolicy
from ._rules import Rule


def checked_rank(path: str, shape: tuple[int, ...], rule: Rule) -> Axes:
    """The rule's layout expanded to the variable's rank (`...` filled in).

    Raises:
        RankMismatchError: the layout has another rank than the variable.

    Example:
        >>> import keras_meshlayout as kml
        >>> rule = kml.LayoutRules([(r".*kernel", (None, "model"))]).rules[0]
        >>> checked_rank("d/kernel", (256, 128), rule)
        (None, 'model')
    """
    requested = rule.expand(len(shape))
    if requested is not None:
        return requested
    rank = f"at least {len(rule.axes) - 1}" if Ellipsis in rule.axes else str(len(rule.axes))
    if Ellipsis not in rule.axes and len(rule.axes) < len(shape):
        missing = len(shape) - len(rule.axes)
        keras = (
            "Keras's own ModelParallel would hand this layout to JAX unchecked, and JAX pads a short "
            f"layout with None: the last {missing} dimension(s) would be replicated without a word. "
            "To mean that, end the layout with '...', e.g. ('model', ...)."
        )
    else:
        keras = (
            "Keras's own ModelParallel would hand this layout to JAX unchecked, and JAX would refuse "
            "it when placing the variable, without naming it."
        )
    raise RankMismatchError(
        f"Variable {path!r} has shape {shape} (rank {len(shape)}), but the first rule "
        f"matching it, {rule.describe()}, gives a layout of rank {rank}. A layout "
        f"needs one entry per dimension. Fix: give this rule {_entries(len(shape))}, or make "
        f"its pattern more specific (e.g. end it in '/kernel' or '/bias') and add a rule "
        f"of rank {len(shape)} for {path!r}. ({keras})"
    )


def check_axis_names(path: str, rule: Rule, requested: Axes, axis_sizes: Mapping[str, int]) -> None:
    """Raises `InvalidRuleError` when the layout names an axis the mesh does not have."""
    for axis in (name for entry in requested for name in entry_axes(entry)):
        if axis not in axis_sizes:
            raise InvalidRuleError(
                f"Layout {rule.describe()}, matching variable {path!r}, names mesh axis "
                f"{axis!r}, but the mesh has axes {tuple(axis_sizes)}."
                f"{did_you_mean(axis, tuple(axis_sizes))} Fix: use one of those or None."
            )


def is_weight_matrix(path: str, shape: Sequence[int]) -> bool:
    """Whether `replicate_below` applies: rank 2 or more, and not a bias.

    Biases and other vectors follow their rule whatever their size: beside a
    split kernel a split bias is free, and a replicated one costs an all-gather
    every step (attention biases are `(heads, head_dim)` matrices, hence the
    name check).
    """
    return len(shape) >= 2 and not path.endswith("/bias")


def divisible_axes(
    path: str,
    shape: tuple[int, ...],
    rule: Rule,
    requested: Axes,
    axis_sizes: Mapping[str, int],
    on_indivisible: IndivisiblePolicy,
    *,
    warn: bool = True,
) -> tuple[Axes, list[str]]:
    """The layout with every dimension that does not divide by its mesh axis replicated.

    Returns the final axes and one reason per replicated dimension. With
    `on_indivisible="error"` the first such dimension raises instead; with
    `"replicate"` each one warns (unless `warn=False`).

    Raises:
        IndivisibleShapeError: a dimension does not divide and the policy is `"error"`.

    Example:
        >>> import warnings
        >>> import keras_meshlayout as kml
        >>> rule = kml.LayoutRules([(r".*kernel", (None, "model"))]).rules[0]
        >>> divisible_axes("d/kernel", (256, 10), rule, (None, "model"), {"model": 4},
        ...                "replicate", warn=False)
        ((None, None), ["dimension 1 (size 10) does not divide by mesh axis 'model' (size 4)"])
    """
    final: list[str | tuple[str, ...] | None] = list(requested)
    reasons: list[str] = []
    for dim, axis in enumerate(requested):
        pieces = entry_size(axis, axis_sizes)
        if axis is None or shape[dim] % pieces == 0:
            continue
        over, over_of = _describe_entry(axis, axis_sizes), _describe_entry(axis, axis_sizes, of=True)
        fewer = "" if len(entry_axes(axis)) == 1 else " (or fewer axes)"
        if on_indivisible == "error":
            raise IndivisibleShapeError(
                f"Variable {path!r} has shape {shape}; {rule.describe()} splits dimension {dim} "
                f"(size {shape[dim]}) over {over_of}, and {shape[dim]} is not a multiple of {pieces}. "
                f"Fix: choose a mesh whose {_names(axis)} divides {shape[dim]}, change the layer "
                f"size, put None{fewer} on dimension {dim} in this rule, or pass "
                "on_indivisible='replicate' to replicate that dimension instead. (Plain Keras would "
                "hand the layout to JAX, which fails with an IndivisibleError naming no variable.)"
            )
        final[dim] = None
        reasons.append(f"dimension {dim} (size {shape[dim]}) does not divide by {over}")
        if warn:
            warnings.warn(
                f"Variable {path!r} (shape {shape}) is replicated on dimension {dim}: size "
                f"{shape[dim]} does not divide by {over_of} ({rule.describe()}). It costs {pieces}x "
                "the memory it would take sharded. Pass on_indivisible='error' to make this an "
                "error. (Plain Keras would fail here in JAX with an IndivisibleError naming no "
                "variable.)",
                IndivisibleShapeWarning,
                stacklevel=4,
            )
    return tuple(final), reasons


def _describe_entry(entry: str | tuple[str, ...], axis_sizes: Mapping[str, int], of: bool = False) -> str:
    """`mesh axis 'model' (size 4)` (`of`: `... of size 4`), or several axes and their product.

    Several: `mesh axes 'data' (size 2) x 'model' (size 4) = 8`.
    """
    names = entry_axes(entry)
    if len(names) == 1:
        size = axis_sizes[names[0]]
        return f"mesh axis {names[0]!r} of size {size}" if of else f"mesh axis {names[0]!r} (size {size})"
    parts = " x ".join(f"{name!r} (size {axis_sizes[name]})" for name in names)
    return f"mesh axes {parts} = {entry_size(entry, axis_sizes)}"


def _names(entry: str | tuple[str, ...]) -> str:
    names = entry_axes(entry)
    if len(names) == 1:
        return f"{names[0]!r} axis"
    return " x ".join(repr(name) for name in names) + " axes (their product)"


def _entries(count: int) -> str:
    return "1 entry" if count == 1 else f"{count} entries"
