"""`ModelParallel`: Keras's model-parallel distribution with shape-checked layouts."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import keras

from .. import _compat
from . import _output_rules, _trainer_hooks
from ._backend import require_jax_backend
from ._errors import (
    IndivisibleBatchError,
    InvalidMeshError,
    InvalidRuleError,
    UnmatchedRuleWarning,
)
from ._format import unmatched_hint
from ._mesh import Mesh, mesh_axis_sizes
from ._plan import Plan
from ._planned import laid_out_otherwise, the_batch_axis, warn_other_policy
from ._planning import plan_model
from ._policy import IndivisiblePolicy, LayoutPolicy, resolve_policy
from ._process_data import process_batch_block
from ._resolve import KeptWhole, Resolution, resolve
from ._rules import LayoutRules

__all__ = ["ModelParallel"]


class ModelParallel(keras.distribution.ModelParallel):
    """Data and tensor parallelism over a named mesh, with every layout checked.

    The batch is split over `batch_axis`; each variable gets the layout of the
    first rule whose pattern matches its path, checked against its shape when
    Keras creates it:

    - a rule of the wrong rank is a `RankMismatchError` naming both;
    - a dimension that does not divide by its mesh axis is replicated with a
      warning and a recorded reason (`on_indivisible="replicate"`), or is an
      `IndivisibleShapeError` (`on_indivisible="error"`);
    - weight matrices (rank 2 or more, biases excepted) smaller than
      `replicate_below` elements stay replicated, so a small classifier head
      needs no rule of its own; vectors and biases follow their rule, since
      beside a split kernel a split bias is free and a replicated one costs an
      all-gather per step;
    - variables no rule matches are replicated;
    - optimizer slots take exactly their parameter's layout.

    It is a `keras.distribution.ModelParallel`: set it with
    `keras.distribution.set_distribution` (or use `scope()`) before building
    the model, then train with `model.fit` as usual. `plan(model)` shows what
    every variable got and why. A rule that matched no variable draws one
    `UnmatchedRuleWarning` when `fit` (or `evaluate`, `predict`) starts,
    unless `plan(model)` already warned.

    Keras's call forms work too, with Keras's meaning:
    `kml.ModelParallel(layout_map=..., batch_dim_name=..., auto_shard_dataset=...)`
    (the mesh is the layout map's) and the older `device_mesh=` keyword. The
    rules are used as given, not copied: rules added to them later apply to
    the variables created after.

    Args:
        mesh: The device mesh (a `kml.Mesh`, any `keras.distribution.DeviceMesh`, or a
            `jax.sharding.Mesh`, taken as `kml.Mesh(jax_mesh)`).
            May be left out when the layout map carries one.
        rules: A `LayoutRules`, a Keras `LayoutMap` (its keys become rules in
            insertion order), or `(pattern, axes)` pairs. `None`: no rules
            (pure data parallelism).
        batch_axis: Mesh axis the batch is split over. Defaults to the first.
        on_indivisible: `"replicate"` or `"error"`; the policy's field of that
            name, for short.
        replicate_below: Weight matrices (rank 2 or more, not biases) with
            fewer elements stay replicated; 0 disables it. The policy's field
            of that name, for short.
        policy: A `kml.LayoutPolicy` (both options at once). Defaults to the
            policy the rules carry (`rules.policy`, set by `kml.auto_rules`),
            else `kml.LayoutPolicy()`: `"replicate"` and 4096 (16 KiB in
            float32). `on_indivisible=`/`replicate_below=` given alone change
            that field of it.
        auto_shard_dataset: Let Keras shard a `tf.data.Dataset` over processes
            itself. Defaults to `False` (`True`, Keras's default, when
            `layout_map=` or `device_mesh=` is given): in a multi-process run
            each process passes `fit` its own part of every global batch
            (`kml.process_slice`); with `True`, Keras refuses any input that is
            not a `tf.data.Dataset`.
        layout_map: Keras's name for `rules`.
        batch_dim_name: Keras's name for `batch_axis`.
        device_mesh: Keras's older name for `mesh`.

    Raises:
        InvalidMeshError: no mesh is given or carried by the layout map, two
            names of one argument disagree, or `batch_axis` is not an axis of
            the mesh.
        InvalidRuleError: a rule does not fit the mesh, or both `rules` and
            `layout_map` are given.
        InvalidOptionError: `policy` is not a `kml.LayoutPolicy`, an option
            is invalid, or `on_indivisible=`/`replicate_below=` disagrees with
            `policy=`.
        UnsupportedBackendError: Keras does not run on JAX.

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> rules = kml.LayoutRules([(r".*dense/kernel", (None, "model"))])
        >>> dist = kml.ModelParallel(mesh, rules, batch_axis="data")
        >>> with dist.scope():
        ...     model = keras.Sequential(
        ...         [keras.Input((32,)), keras.layers.Dense(256, name="dense")], name="mlp")
        >>> model.weights[0].value.sharding.spec
        P(None, 'model')
        >>> layout_map = kml.LayoutRules(mesh)  # Keras's way
        >>> layout_map["mlp/dense/kernel"] = (None, "model")
        >>> kml.ModelParallel(layout_map=layout_map, batch_dim_name="data").auto_shard_dataset
        True
    """

    def __init__(
        self,
        mesh: keras.distribution.DeviceMesh | None = None,
        rules: LayoutRules
        | keras.distribution.LayoutMap
        | Iterable[tuple[str, Sequence[str | None]]]
        | None = None,
        *,
        batch_axis: str | None = None,
        on_indivisible: IndivisiblePolicy | None = None,
        replicate_below: int | None = None,
        policy: LayoutPolicy | None = None,
        auto_shard_dataset: bool | None = None,
        layout_map: LayoutRules | keras.distribution.LayoutMap | None = None,
        batch_dim_name: str | None = None,
        device_mesh: keras.distribution.DeviceMesh | None = None,
    ) -> None:
        require_jax_backend()
        keras_form = layout_map is not None or device_mesh is not None
        if isinstance(mesh, keras.distribution.LayoutMap) and rules is None and layout_map is None:
            mesh, layout_map = None, mesh  # ModelParallel(layout_map): the map carries the mesh
        if layout_map is not None and rules is not None:
            raise InvalidRuleError(
                "ModelParallel got both rules and layout_map=, two names for the same argument. "
                f"Received: rules={rules!r}, layout_map={layout_map!r}. Fix: pass one of them."
            )
        given = layout_map if layout_map is not None else rules
        mesh = _the_mesh(mesh, device_mesh, given)
        policy = resolve_policy(
            "ModelParallel",
            policy,
            on_indivisible=on_indivisible,
            replicate_below=replicate_below,
            default=given.policy if isinstance(given, LayoutRules) else None,
        )
        planned = given.origin if isinstance(given, LayoutRules) and given.origin.planned else None
        planned_below = None if planned is None or planned.policy is None else planned.policy.replicate_below
        batch_axis = the_batch_axis(mesh, batch_axis, batch_dim_name, planned)
        if auto_shard_dataset is None:
            auto_shard_dataset = keras_form  # Keras's default where Keras's call form is used
        self._keras_map = given if _is_raw_layout_map(given) else None
        self._keras_map_seen = _snapshot(self._keras_map)
        super().__init__(
            layout_map=_as_rules(given).bind(mesh),
            batch_dim_name=batch_axis,
            auto_shard_dataset=auto_shard_dataset,
        )
        self._policy = policy
        self._on_indivisible = policy.on_indivisible
        self._replicate_below = policy.replicate_below
        self._axis_sizes = mesh_axis_sizes(mesh)
        self._kept_whole = KeptWhole()
        self._planned_below = planned_below  # the replicate_below auto_rules planned with, if it did
        #: Paths of the model variables laid out so far, for the unmatched-rule check.
        self._laid_out: list[str] = []
        self._unmatched_checked = False
        _trainer_hooks.install(_is_ours)

    @property
    def rules(self) -> LayoutRules:
        """The layout rules, bound to the mesh.

        These are the rules given, not a copy: a rule added to them later takes
        effect for the variables created after it (a Keras `LayoutMap` given
        is converted again when it changes).
        """
        if self._keras_map is not None and _snapshot(self._keras_map) != self._keras_map_seen:
            self._keras_map_seen = _snapshot(self._keras_map)
            _compat.set_distribution_layout_map(self, _as_rules(self._keras_map).bind(self.device_mesh))
        return _compat.distribution_layout_map(self)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Mesh axis sizes by name."""
        return dict(self._axis_sizes)

    @property
    def batch_axis(self) -> str:
        """The mesh axis the batch is split over."""
        return self.batch_dim_name

    @property
    def policy(self) -> LayoutPolicy:
        """The `kml.LayoutPolicy` in force: given here, else the rules', else the default."""
        return self._policy

    @property
    def on_indivisible(self) -> IndivisiblePolicy:
        return self._on_indivisible

    @property
    def replicate_below(self) -> int:
        return self._replicate_below

    def resolve(
        self,
        path: str,
        shape: Sequence[int],
        dtype: Any = "float32",
        *,
        warn: bool = True,
        rules: bool = True,
    ) -> Resolution:
        """Resolves the layout of a variable with this path, shape and dtype.

        This is exactly what happens when Keras creates such a model variable
        under this distribution; nothing is allocated. With `rules=False`, as
        for optimizer and metric variables, no rule applies: replicated.
        """
        resolution = resolve(
            path,
            shape,
            dtype,
            self.rules if rules else _NO_RULES,
            self._axis_sizes,
            on_indivisible=self._on_indivisible,
            replicate_below=self._replicate_below,
            warn=warn,
        )
        if rules and self._planned_below not in (None, self._replicate_below):
            self._warn_if_not_as_planned(resolution)
        return self._kept_whole.follow(resolution) if rules else resolution

    def _warn_if_not_as_planned(self, resolution: Resolution) -> None:
        """Warns, once, when `replicate_below` lays a planned matrix out otherwise than the planner did."""
        if laid_out_otherwise(resolution, self._planned_below, self._replicate_below):
            planned, self._planned_below = self._planned_below, None  # once
            warn_other_policy(resolution, planned, self._replicate_below)

    def plan(self, model: keras.Model) -> Plan:
        """What every variable of `model` (and of its optimizer, once built) got, and why.

        Nothing is allocated or moved: the plan re-runs the resolution that
        `get_variable_layout` runs when Keras creates each variable, and reports
        a layout already fixed on a variable where there is one.

        Args:
            model: A built Keras model.

        Returns:
            The `Plan`; `print(plan)` shows a table, `plan.to_dict()` gives data.

        Warns:
            UnmatchedRuleWarning: for each rule that matched no variable.

        Example:
            >>> import keras, keras_meshlayout as kml
            >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4),
            ...                          [(r".*dense/kernel", (None, "model"))])
            >>> with dist.scope():
            ...     model = keras.Sequential(
            ...         [keras.Input((32,)), keras.layers.Dense(256, name="dense")], name="mlp")
            >>> plan = dist.plan(model)
            >>> plan["mlp/dense/kernel"].axes
            (None, 'model')
            >>> plan.bytes_per_device, plan.replicated_bytes
            (9216, 33792)
        """
        self._unmatched_checked = True  # the plan warns about unmatched rules itself
        return plan_model(self, model)

    # -- keras.distribution.Distribution --------------------------------------

    def get_variable_layout(self, variable: keras.Variable) -> keras.distribution.TensorLayout:
        _refuse_arrays_on_devices_without_memory(self.device_mesh, variable)
        if (layout := _compat.variable_layout(variable)) is not None:
            return layout  # optimizer slots: their parameter's layout
        if _created_by_optimizer_or_metric():
            # Rules describe model variables; an optimizer's own statistics (Adafactor's
            # factored moments, step counters) and metric totals stay replicated.
            return keras.distribution.TensorLayout((None,) * len(variable.shape), self.device_mesh)
        resolution = self.resolve(variable.path, variable.shape, variable.dtype)
        self._laid_out.append(variable.path)
        return _compat.tensor_layout(resolution.axes, self.device_mesh)

    def get_tensor_layout(self, path: str) -> keras.distribution.TensorLayout | None:
        layout = self.rules[path]
        if layout is not None and path.endswith("/output"):
            _output_rules.asked(path, self.rules.match(path), layout)  # checked against the output
        return layout

    def get_data_layout(self, data_shape: Sequence[int]) -> keras.distribution.TensorLayout:
        self._warn_unmatched_once()
        if len(data_shape) == 0:
            return keras.distribution.TensorLayout((), self.device_mesh)
        if _trainer_hooks.batch_decision(self, data_shape) == "replicate":  # predict/evaluate
            return _trainer_hooks.replicated_layout(self, len(data_shape))
        return super().get_data_layout(data_shape)

    def _warn_unmatched_once(self) -> None:
        """Warns, once, about rules that matched none of the variables laid out so far.

        Keras asks for the input layout when `fit`, `evaluate` or `predict`
        starts, after it has built the model and its optimizer: a typo in a rule
        then shows without `dist.plan(model)` (which warns itself, and then this
        stays silent).
        """
        if self._unmatched_checked or not self._laid_out:
            return
        self._unmatched_checked = True
        for rule in self.rules.unmatched(self._laid_out):
            warnings.warn(
                f"{rule.describe()} matched no variable of the {len(self._laid_out)} laid out "
                "under this distribution: check the pattern for a typo (it is matched with "
                "re.fullmatch against variable.path; dist.plan(model) shows every variable's "
                f"layout).{unmatched_hint(rule.pattern, self._laid_out)}",
                UnmatchedRuleWarning,
                stacklevel=3,
            )

    def check_batch(self, data_shape: Sequence[int]) -> None:
        """Raises `IndivisibleBatchError` unless this batch splits over the batch axis.

        Keras computes the input layout from the first batch of an epoch and
        reuses it, so `kml` also checks every later batch (a short last batch
        included) before it reaches JAX.
        """
        if data_shape[0] is None:  # a symbolic batch: nothing to check yet
            return
        axis_size = self._axis_sizes[self.batch_dim_name]
        global_batch = int(data_shape[0]) * axis_size // self._batch_positions_here
        if global_batch % axis_size:
            raise IndivisibleBatchError(
                f"A batch of {global_batch} samples (input shape {tuple(data_shape)}) cannot be "
                f"split over batch axis {self.batch_dim_name!r} of size {axis_size}: "
                f"{global_batch} is not a multiple of {axis_size}. Fix: use a batch_size that is "
                f"a multiple of {axis_size}. If this is the short last batch of an epoch, make "
                "the number of samples a multiple of the batch size, or drop the remainder."
            )

    @functools.cached_property
    def _batch_positions_here(self) -> int:
        """Positions of the batch axis on this process's devices (all of them when alone)."""
        first, stop, _ = process_batch_block(self.device_mesh, self.batch_dim_name)
        return stop - first

    def __repr__(self) -> str:
        return (
            f"ModelParallel({self.device_mesh!r}, rules={len(self.rules)}, "
            f"batch_axis={self.batch_dim_name!r}, on_indivisible={self._on_indivisible!r}, "
            f"replicate_below={self._replicate_below})"
        )

    __str__ = __repr__


_NO_RULES = LayoutRules()


def _refuse_arrays_on_devices_without_memory(mesh: Any, variable: keras.Variable) -> None:
    """A variable about to be allocated on a TPU target's or an abstract mesh's devices: a clear error.

    Those devices hold no array (JAX would say `MakeArraysFromHostBufferShards not available
    with compile-only client`); a dry build (a stateless scope) defers every variable and passes.
    """
    target, abstract = getattr(mesh, "target", None), getattr(mesh, "is_abstract", False)
    if (target is None and not abstract) or _compat.in_stateless_scope():
        return
    where = f"TPU target {target}'s compile-only devices" if target is not None else "an abstract mesh"
    raise InvalidMeshError(
        f"Variable {variable.path!r} would be allocated on {mesh!r}, laid over {where}, which hold no "
        "array. Build the model dry instead: kml.dry_plan(build, dist) for the plan, "
        "kml.compile_step(build, dist, x, y) for XLA's memory and traffic on it."
    )


def _created_by_optimizer_or_metric() -> bool:
    """Whether the variable being created belongs to an optimizer or a metric.

    Keras creates those variables inside a name scope whose `caller` is the
    optimizer or metric; the innermost scope with a caller tells.
    """
    callers = _compat.name_scope_callers()
    return bool(callers) and isinstance(callers[0], (keras.optimizers.Optimizer, keras.metrics.Metric))


def _is_ours(distribution: object) -> bool:
    """Whether the trainer hooks act under `distribution`: a `kml.ModelParallel`."""
    return isinstance(distribution, ModelParallel)


def _as_rules(rules: Any) -> LayoutRules:
    if rules is None:
        return LayoutRules()
    if isinstance(rules, LayoutRules):
        return rules
    if isinstance(rules, keras.distribution.LayoutMap):
        from ._layout_map import rules_from_layout_map

        return rules_from_layout_map(rules)  # the same paths as Keras would match
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Iterable):
        raise InvalidRuleError(
            "rules must be a kml.LayoutRules, a keras.distribution.LayoutMap or a list of "
            f"(pattern, axes) pairs. Received: {rules!r}."
        )
    return LayoutRules(rules)


def _is_raw_layout_map(rules: Any) -> bool:
    return isinstance(rules, keras.distribution.LayoutMap) and not isinstance(rules, LayoutRules)


def _snapshot(layout_map: keras.distribution.LayoutMap | None) -> tuple | None:
    """What a Keras `LayoutMap` holds, to tell when it changed: its keys and layouts."""
    if layout_map is None:
        return None
    return tuple((key, id(layout)) for key, layout in layout_map.items())


def _the_mesh(mesh: Any, device_mesh: Any, rules: Any) -> keras.distribution.DeviceMesh:
    """The mesh from `mesh`, Keras's older `device_mesh=`, or the layout map's own."""
    if mesh is not None and device_mesh is not None and mesh is not device_mesh:
        raise InvalidMeshError(
            f"ModelParallel got mesh={mesh!r} and device_mesh={device_mesh!r}, two names (ours and "
            "Keras's older one) for the same argument. Fix: pass one of them."
        )
    mesh = mesh if mesh is not None else device_mesh
    import jax

    if isinstance(mesh, jax.sharding.Mesh):  # JAX's own mesh, as a JAX user writes it first
        mesh = Mesh(mesh)
    if mesh is None and isinstance(rules, keras.distribution.LayoutMap):
        mesh = rules.mesh if isinstance(rules, LayoutRules) else rules.device_mesh
    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise InvalidMeshError(
            "ModelParallel needs a mesh (kml.Mesh or keras.distribution.DeviceMesh): as its first "
            "argument, or carried by the layout map (Keras's form, where plain Keras says 'You must "
            f"specify a layout_map argument'). Received: {mesh!r} as the mesh, and rules={rules!r}. "
            "Example: "
            'kml.ModelParallel(kml.Mesh(data=2, model=4), rules, batch_axis="data"), or '
            'kml.ModelParallel(layout_map=kml.LayoutRules(mesh), batch_dim_name="data").'
        )
    return mesh
