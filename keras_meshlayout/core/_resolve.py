"""Resolving one variable's layout from its path and shape.

The first matching rule meets the variable's real shape here: the checks of rank, axis
names and divisibility (`_shape_checks`), and the small-matrix threshold, applied in order as
pure functions of the path, shape, dtype, rules and mesh axis sizes.
`kml.ModelParallel` calls `resolve` for every variable Keras creates, and the
plan calls the same function, so the two cannot disagree.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._axes import Axes, axes_to_json, shards_of
from ._policy import DEFAULT_REPLICATE_BELOW, POLICIES, IndivisiblePolicy, check_policy
from ._rules import LayoutRules, Rule
from ._shape_checks import check_axis_names, checked_rank, divisible_axes, is_weight_matrix

__all__ = [
    "DEFAULT_REPLICATE_BELOW",
    "POLICIES",
    "IndivisiblePolicy",
    "KeptWhole",
    "Resolution",
    "check_policy",
    "resolve",
]


@dataclasses.dataclass(frozen=True)
class Resolution:
    """What one variable got, and why.

    Attributes:
        path: The variable path, e.g. `"sequential/dense_1/kernel"`.
        shape: The variable shape.
        dtype: The variable dtype name.
        rule: The rule that matched, or `None`.
        requested: The matching rule's axes, or `None` when no rule matched.
        axes: The final layout, one mesh-axis name or `None` per dimension.
        reasons: Why `axes` differs from `requested`, one line per change, or
            why it does not where one might expect it (a rule of the user's
            own splitting a small matrix).
        shards: Number of pieces the variable is split into (1 = replicated).
        nbytes: Size of the whole variable in bytes.
        source: Where the layout came from: `"rule"`, `"default"` (no rule
            matched), or `"parameter"` for an optimizer slot, which follows its
            parameter, or `"preset"` for a layout fixed on the variable itself.
        role: What the variable is in training: `"parameter"` (trainable),
            `"state"` (non-trainable), `"optimizer"`, or `"rng"` (a `SeedGenerator`'s
            state: laid out by the rules as Keras does, not counted in `Plan.memory`).
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    rule: Rule | None
    requested: Axes | None
    axes: Axes
    reasons: tuple[str, ...] = ()
    shards: int = 1
    nbytes: int = 0
    source: str = "rule"
    role: str = "parameter"

    @property
    def bytes_per_device(self) -> int:
        """Bytes of this variable held by each device."""
        return self.nbytes // self.shards

    @property
    def replicated(self) -> bool:
        return self.shards == 1

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "rule": None
            if self.rule is None
            else {"index": self.rule.index, "pattern": self.rule.pattern, "note": self.rule.note},
            "requested": None if self.requested is None else axes_to_json(self.requested),
            "axes": axes_to_json(self.axes),
            "reasons": list(self.reasons),
            "source": self.source,
            "role": self.role,
            "shards": self.shards,
            "bytes": self.nbytes,
            "bytes_per_device": self.bytes_per_device,
        }


def resolve(
    path: str,
    shape: Sequence[int],
    dtype: Any,
    rules: LayoutRules,
    axis_sizes: Mapping[str, int],
    *,
    on_indivisible: IndivisiblePolicy = "replicate",
    replicate_below: int = DEFAULT_REPLICATE_BELOW,
    warn: bool = True,
) -> Resolution:
    """Resolves the layout of one variable.

    In order: scalars are replicated; the matching rule gives the requested
    layout (no match: replicated); its rank must equal the variable's; a
    weight matrix (rank 2 or more, not a bias) with fewer than
    `replicate_below` elements stays replicated when the rule is `suggested`
    (a preset's or the planner's), and is split with a note in `reasons` when
    the user wrote the rule or the rule is `keep_split`; every sharded dimension must
    divide by its mesh axis size, or else, by `on_indivisible`, that dimension
    is replicated (with an `IndivisibleShapeWarning`) or an error is raised.

    Args:
        path: Variable path.
        shape: Variable shape.
        dtype: Variable dtype (anything `numpy.dtype` or Keras understands).
        rules: The layout rules.
        axis_sizes: Mesh axis sizes by name.
        on_indivisible: `"replicate"` or `"error"`.
        replicate_below: Element count under which the weight matrices of
            suggested rules stay replicated.
        warn: Whether to warn when a dimension is replicated for divisibility.

    Returns:
        The `Resolution`.

    Raises:
        RankMismatchError: the matching rule's layout has the wrong rank.
        IndivisibleShapeError: a dimension does not divide and the policy is
            `"error"`.
        InvalidRuleError: the matching rule names an axis not in `axis_sizes`.

    Example:
        >>> import keras_meshlayout as kml
        >>> from keras_meshlayout.core._resolve import resolve
        >>> rules = kml.LayoutRules([(r".*kernel", (None, "model"))])
        >>> resolve("d/kernel", (256, 128), "float32", rules, {"data": 2, "model": 4}).axes
        (None, 'model')
        >>> res = resolve("d/kernel", (256, 10), "float32", rules, {"data": 2, "model": 4},
        ...               replicate_below=0, warn=False)
        >>> res.axes, res.reasons
        ((None, None), ("dimension 1 (size 10) does not divide by mesh axis 'model' (size 4)",))
    """
    shape = tuple(int(d) for d in shape)
    dtype_name = _dtype_name(dtype)
    nbytes = math.prod(shape) * _itemsize(dtype_name)
    replicated = (None,) * len(shape)
    rule = rules.match(path)
    if not shape and rule is not None:
        # A scalar has nothing to split. Keras also creates unscoped scalars whose paths
        # a broad rule can match (Adafactor's placeholders are named after parameters).
        requested = tuple(axis for axis in rule.axes if axis is not Ellipsis)
        reasons = ("scalar: nothing to split",) if requested else ()
        return Resolution(path, shape, dtype_name, rule, requested, (), reasons, nbytes=nbytes)
    if rule is None:
        return Resolution(path, shape, dtype_name, None, None, replicated, nbytes=nbytes, source="default")

    requested = checked_rank(path, shape, rule)
    check_axis_names(path, rule, requested, axis_sizes)
    if all(axis is None for axis in requested):
        return Resolution(path, shape, dtype_name, rule, requested, requested, nbytes=nbytes)

    size = math.prod(shape)
    reasons: list[str] = []
    if is_weight_matrix(path, shape) and size < replicate_below:
        if rule.suggested and not rule.keep_split:
            reason = f"small: {size} elements < replicate_below={replicate_below}"
            return Resolution(path, shape, dtype_name, rule, requested, replicated, (reason,), nbytes=nbytes)
        reasons.append(_split_anyway(rule, size, replicate_below))
    axes, indivisible = divisible_axes(path, shape, rule, requested, axis_sizes, on_indivisible, warn=warn)
    reasons += indivisible
    shards = shards_of(axes, axis_sizes)
    return Resolution(path, shape, dtype_name, rule, requested, axes, tuple(reasons), shards, nbytes)


class KeptWhole:
    """The layers whose kernel a distribution kept whole as small, so that their biases stay whole too.

    `replicate_below` keeps a preset's or the planner's small weight matrix whole, but a bias is
    no matrix (`is_weight_matrix`): split beside a whole kernel, XLA gathers it, and the kernel's
    updates with it, every step (`kml.mlp_rules` on a 16 → 64 → 16 MLP on 2×4: 18,816 bytes a
    step over 'model' against none with no rules at all). Keras creates a layer's kernel before its
    bias, and a plan lists them in that order: `follow` sees the kernel first.
    """

    def __init__(self) -> None:
        self._whole: set[str] = set()

    def follow(self, resolution: Resolution) -> Resolution:
        """`resolution`, or for a bias (or vector) of a layer whose kernel was kept whole, replicated."""
        layer, rule = resolution.path.rpartition("/")[0], resolution.rule
        if is_weight_matrix(resolution.path, resolution.shape):
            small = any(r.startswith("small:") and "split anyway" not in r for r in resolution.reasons)
            (self._whole.add if small else self._whole.discard)(layer)
            return resolution
        if layer not in self._whole or rule is None or not rule.suggested or rule.keep_split:
            return resolution
        if resolution.shards == 1:
            return resolution
        reason = "its layer's kernel is small and kept whole (replicate_below): so is it, or XLA gathers it"
        whole = (None,) * len(resolution.shape)
        return dataclasses.replace(resolution, axes=whole, shards=1, reasons=(*resolution.reasons, reason))


def _split_anyway(rule: Rule, size: int, replicate_below: int) -> str:
    """Why a matrix under `replicate_below` is split all the same (a rule of the user's, `keep_split`)."""
    if rule.keep_split:
        why = (
            "the planner keeps it split (Rule.keep_split): whole, a grouped convolution's kernel gradient "
            "comes out wrong on this mesh (kml.GroupedConvWarning)"
        )
    else:
        why = "a rule of your own (replicate_below keeps only preset and planner rules' small matrices whole)"
    return f"small: {size} elements < replicate_below={replicate_below}, split anyway: {why}"


def _dtype_name(dtype: Any) -> str:
    import keras

    return keras.backend.standardize_dtype(dtype)


def _itemsize(dtype_name: str) -> int:
    import jax.numpy as jnp  # knows bfloat16 and the float8 types; starts no backend

    return jnp.dtype(dtype_name).itemsize
