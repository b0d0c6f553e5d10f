"""The automatic planner: layout rules derived from a built model's structure.

`auto_rules` reads the model's layers, their classes, their variable shapes and
the functional graph, and writes one rule per decision, each with a note that
explains it. It only ever chooses layouts that keep weights where they are:

- a projection (`Dense`, or an `EinsumDense` with an `(in, out)` kernel) whose
  output flows, through element-wise layers only, into a second projection
  becomes a column → row pair (two gated projections multiplied together
  form a pair with the projection that follows);
- attention layers (`MultiHeadAttention`, `GroupQueryAttention`) are split over
  heads; key/value projections with too few heads stay replicated;
- everything else (embeddings, norms, the final head, projections with no
  partner or too small to split) stays replicated, with the reason noted;
- inside custom layers, whose call graph is not visible, variables are matched
  by name against `transformer_rules`, and a match is kept only when its rank
  fits and every split dimension divides.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import keras

from ._errors import InvalidRuleError
from ._presets import transformer_rules
from ._resolve import DEFAULT_REPLICATE_BELOW
from ._rules import Axes, LayoutRules

__all__ = ["auto_rules"]

#: Layers that act on each element alone: a split feature dimension passes through.
ELEMENTWISE = (
    keras.layers.Activation,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
    keras.layers.ELU,
    keras.layers.Dropout,
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
    keras.layers.Identity,
    keras.layers.ActivityRegularization,
)
ATTENTION = (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)


def auto_rules(
    model: keras.Model,
    mesh: keras.distribution.DeviceMesh,
    *,
    model_axis: str = "model",
    batch_axis: str | None = None,
    replicate_below: int = DEFAULT_REPLICATE_BELOW,
) -> LayoutRules:
    """Derives layout rules for a built model on a mesh, explaining each decision.

    Every rule matches one variable path exactly (with or without the model's
    name in front, which a Sequential model loses when reloaded from a
    `.keras` file) and carries a note saying why
    (shown in `dist.plan(model)`). Pass the result to `kml.ModelParallel`.

    Args:
        model: A built Keras model (any distribution, or none).
        mesh: The mesh the rules are for.
        model_axis: The mesh axis for tensor parallelism.
        batch_axis: The mesh axis the batch is split over (for the layer-output
            rules of grouped-query attention). Defaults to the first other axis.
        replicate_below: Projections whose kernels have fewer elements stay
            replicated (as in `kml.ModelParallel`).

    Returns:
        The rules, bound to nothing: hand them to `kml.ModelParallel(mesh, rules)`.

    Raises:
        InvalidRuleError: `model_axis` is not an axis of `mesh`.

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> model = keras.Sequential([
        ...     keras.Input((64,)),
        ...     keras.layers.Dense(256, activation="gelu", name="up"),
        ...     keras.layers.Dense(64, name="down"),
        ...     keras.layers.Dense(10, name="head"),
        ... ], name="mlp")
        >>> rules = kml.auto_rules(model, kml.Mesh(data=2, model=4))
        >>> for rule in rules.rules[:3]:
        ...     print(rule.pattern, rule.axes)
        (?:mlp/)?up/kernel (None, 'model')
        (?:mlp/)?up/bias ('model',)
        (?:mlp/)?down/kernel ('model', None)
        >>> rules.rules[2].note
        'row-parallel: up → down, input features split; one all-reduce forward, one backward'
        >>> rules.rules[-2].note
        'final layer: replicated, so its output needs no gathering'
    """
    if model_axis not in mesh.axis_names:
        raise InvalidRuleError(
            f"auto_rules: model_axis={model_axis!r} is not an axis of the mesh, which has axes "
            f"{tuple(mesh.axis_names)}. Fix: pass model_axis= one of them."
        )
    size = dict(zip(mesh.axis_names, mesh.shape, strict=True))[model_axis]
    if batch_axis is None:
        batch_axis = next((axis for axis in mesh.axis_names if axis != model_axis), None)
    planner = _Planner(model, model_axis, size, replicate_below, batch_axis)
    planner.plan_attention()
    planner.plan_projections()
    planner.plan_by_name()
    return LayoutRules(planner.rules)


class _Planner:
    def __init__(
        self, model: keras.Model, axis: str, size: int, replicate_below: int, batch_axis: str | None
    ) -> None:
        self.model = model
        self.batch_axis = batch_axis
        self.axis = axis
        self.size = size
        self.replicate_below = replicate_below
        self.rules: list[tuple[str, Axes, str]] = []
        self.decided: set[str] = set()
        #: variable path → the tensor-parallel unit it belongs to (a projection pair, an
        #: attention block, a by-name scope): units split or stay whole together.
        self.units: dict[str, str] = {}
        self.layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        self.consumers: dict[int, list[Any]] = {id(layer): [] for layer in self.layers}
        self.producers: dict[int, list[Any]] = {id(layer): [] for layer in self.layers}
        for layer in self.layers:
            for producer in _producers(layer, self.consumers):
                self.producers[id(layer)].append(producer)
                self.consumers[id(producer)].append(layer)
        self.outputs = {id(t._keras_history.operation) for t in _model_outputs(model)}

    # -- recording --------------------------------------------------------------

    def decide(self, variable: keras.Variable, axes: Axes, note: str, unit: str | None = None) -> None:
        if variable.path not in self.decided:
            self.decided.add(variable.path)
            self.rules.append((self._pattern(variable.path), tuple(axes), note))
            if unit is not None and any(axes):
                self.units[variable.path] = unit

    def _pattern(self, path: str) -> str:
        """The variable's path, tolerant of the model-name scope.

        A Sequential model built in code puts its name first (`mlp/fc1/kernel`);
        the same model loaded from a `.keras` file does not (`fc1/kernel`).
        """
        prefix = self.model.name + "/"
        if path.startswith(prefix):
            return f"(?:{re.escape(prefix)})?{re.escape(path[len(prefix) :])}"
        return re.escape(path)

    # -- attention ----------------------------------------------------------------

    def plan_attention(self) -> None:
        for layer in self.model._flatten_layers(include_self=False):
            if isinstance(layer, ATTENTION):
                self._attention(layer)

    def _attention(self, layer: Any) -> None:
        """Splits an attention layer's projections over heads, read off their einsum equations."""
        projections = [
            sub for sub in layer._flatten_layers(include_self=False) if _heads_dim(sub) is not None
        ]
        query_like = [sub for sub in projections if _heads_dim(sub)[1] == "in"]
        heads = max((sub.kernel.shape[_heads_dim(sub)[0]] for sub in query_like), default=0)
        for sub in projections:
            self._heads_projection(sub, heads)
        for variable in layer.weights:
            self.decide(variable, (None,) * len(variable.shape), "attention: not a projection over heads")

    def _heads_projection(self, layer: Any, heads: int) -> None:
        """One EinsumDense projecting into heads (query/key/value) or out of them."""
        index, side = _heads_dim(layer)
        count = layer.kernel.shape[index]
        if heads % self.size or count % self.size:
            if side == "in" and not heads % self.size:
                note = (
                    f"grouped-query attention: {count} key/value heads do not divide by "
                    f"{self.axis!r} ({self.size}), so every device keeps them all"
                )
                self._keep_output_whole(layer.path, rank=len(layer.equation.split("->")[1]))
            else:
                note = f"attention replicated: {heads} heads do not divide by {self.axis!r} ({self.size})"
            for variable in layer.weights:
                self.decide(variable, (None,) * len(variable.shape), note)
            return
        for variable in layer.weights:
            labels = _labels(layer, variable)
            head_label = layer.equation.split(",")[1].split("->")[0][index]
            if head_label in labels:
                axes = tuple(self.axis if label == head_label else None for label in labels)
                if side == "in":
                    note = f"attention {layer.name}: heads split ({count} heads)"
                else:
                    note = "attention output: heads split on its input side; one all-reduce each way"
            else:
                axes, note = (
                    (None,) * len(variable.shape),
                    "attention output bias: added after the all-reduce",
                )
            self.decide(variable, axes, note, unit=layer.path.rsplit("/", 1)[0])

    def _heads_near(self, layer: Any, owners: dict[int, Any]) -> int:
        """The query head count of the attention block `layer` belongs to."""
        parent = layer.path.rsplit("/", 1)[0]
        for candidate in owners.values():
            if candidate.path == f"{parent}/query" and _heads_dim(candidate) is not None:
                return candidate.kernel.shape[_heads_dim(candidate)[0]]
        return layer.kernel.shape[_heads_dim(layer)[0]]

    def _keep_output_whole(self, layer_path: str, rank: int = 4) -> None:
        """Keeps a replicated key/value projection's output whole over the model axis.

        Otherwise XLA splits the replicated projection's gradient over the
        devices that share a key/value head and all-gathers the weights (and
        their optimizer slots) every step.
        """
        pattern = self._pattern(layer_path) + "/output"
        if pattern not in {rule[0] for rule in self.rules}:
            note = "grouped-query attention: key/value output kept whole over the model axis"
            self.rules.append((pattern, (self.batch_axis,) + (None,) * (rank - 1), note))

    # -- projection pairs -------------------------------------------------------------

    def plan_projections(self) -> None:
        paired: set[int] = set()
        for layer in self.layers:
            if id(layer) in paired or _features(layer) is None:
                continue
            columns, row = self._pair_from(layer)
            if row is None or id(row) in paired or any(id(c) in paired for c in columns):
                continue
            if not self._splittable(columns, row):
                continue
            pair = f"{' × '.join(c.name for c in columns)} → {row.name}"
            for column in columns:
                paired.add(id(column))
                self.decide(
                    column.kernel,
                    (None, self.axis),
                    f"column-parallel: {pair}, output features split",
                    unit=pair,
                )
                if column.bias is not None:
                    self.decide(
                        column.bias, (self.axis,), f"column-parallel: {pair}, output features split", unit=pair
                    )
            paired.add(id(row))
            self.decide(
                row.kernel,
                (self.axis, None),
                f"row-parallel: {pair}, input features split; one all-reduce forward, one backward",
                unit=pair,
            )
            if row.bias is not None:
                self.decide(row.bias, (None,), f"row-parallel: {pair}, bias added after the all-reduce")
        for layer in self.layers:
            if _features(layer) is not None and id(layer) not in paired:
                self._replicate_projection(layer)

    def _pair_from(self, layer: Any) -> tuple[list[Any], Any]:
        """`([column, ...], row)` when `layer` starts a pair, else `([], None)`."""
        after = self._follow(layer)
        if after is not None and _features(after) is not None:
            return [layer], after
        if isinstance(after, keras.layers.Multiply):
            columns = [self._trace_back(p) for p in self.producers[id(after)]]
            row = self._follow(after)
            if (
                all(c is not None and _features(c) is not None for c in columns)
                and _features(row) is not None
            ):
                if len({_features(c)[1] for c in columns}) == 1:
                    return columns, row
        return [], None

    def _follow(self, layer: Any) -> Any:
        """The next non-element-wise layer after `layer`, if its output goes nowhere else."""
        while True:
            if id(layer) in self.outputs or len(self.consumers[id(layer)]) != 1:
                return None
            (layer,) = self.consumers[id(layer)]
            if not isinstance(layer, ELEMENTWISE):
                return layer

    def _trace_back(self, layer: Any) -> Any:
        while isinstance(layer, ELEMENTWISE) and len(self.producers[id(layer)]) == 1:
            (layer,) = self.producers[id(layer)]
        return layer if len(self.consumers[id(layer)]) == 1 else None

    def _splittable(self, columns: Sequence[Any], row: Any) -> bool:
        width = _features(columns[0])[1]
        for layer in [*columns, row]:
            if _softmax(layer):
                return False
        if width % self.size:
            pair = f"{' × '.join(c.name for c in columns)} → {row.name}"
            for layer in [*columns, row]:
                self._replicate(
                    layer, f"pair {pair}: {width} features do not divide by {self.axis!r} ({self.size})"
                )
            return False
        small = [layer for layer in [*columns, row] if math.prod(layer.kernel.shape) < self.replicate_below]
        if small:
            for layer in [*columns, row]:
                self._replicate(
                    layer,
                    f"too small to split: {small[0].name} has {math.prod(small[0].kernel.shape)} "
                    f"weights < replicate_below={self.replicate_below}",
                )
            return False
        return True

    def _replicate_projection(self, layer: Any) -> None:
        if id(layer) in self.outputs:
            reason = "final layer: replicated, so its output needs no gathering"
        else:
            reason = "no row-parallel partner follows: replicated, so no activation has to be gathered"
        self._replicate(layer, reason)

    def _replicate(self, layer: Any, reason: str) -> None:
        for variable in layer.weights:
            self.decide(variable, (None,) * len(variable.shape), reason)

    # -- custom layers, by name --------------------------------------------------------

    def plan_by_name(self) -> None:
        """Variables of layers the graph does not show, matched by `transformer_rules`."""
        presets = transformer_rules(model_axis=self.axis)
        owners = {
            id(v): layer for layer in self.model._flatten_layers(include_self=False) for v in layer.weights
        }
        matched: list[tuple[Any, Axes, str]] = []
        for variable in self.model.weights:
            if variable.path in self.decided:
                continue
            owner = owners.get(id(variable))
            if owner is not None and _heads_dim(owner) is not None and owner.name in _HEAD_PROJECTIONS:
                # Custom attention: which dimension holds the heads is read off its equation,
                # (hidden, heads, head_dim) in Keras, (heads, hidden, head_dim) in Gemma.
                self._heads_projection(owner, self._heads_near(owner, owners))
                continue
            rule = presets.match(variable.path)
            if rule is None:
                continue
            axes = rule.expand(len(variable.shape))
            if axes is None or any(a and d % self.size for a, d in zip(axes, variable.shape, strict=True)):
                matched.append(
                    (
                        variable,
                        (None,) * len(variable.shape),
                        f"by name ({rule.note}), but its shape does not fit: replicated",
                    )
                )
            else:
                matched.append((variable, axes, f"by name: {rule.note}"))
        self._pair_by_scope(matched)

    def _pair_by_scope(self, matched: list[tuple[Any, Axes, str]]) -> None:
        """Keeps a by-name column-parallel layer only beside a split row-parallel one.

        A column layer alone leaves its output split, and whatever reads it
        must gather it; so without a partner in the same scope it stays whole.
        """
        rows = {_scope(v.path) for v, axes, note in matched if "row-parallel" in note and any(axes)}
        for variable, axes, note in matched:
            if "column-parallel" in note and any(axes) and _scope(variable.path) not in rows:
                axes = (None,) * len(variable.shape)
                note = f"{note}; no row-parallel partner beside it, so replicated"
            self.decide(variable, axes, note, unit=_scope(variable.path))


_HEAD_PROJECTIONS = ("query", "key", "value", "attention_output")


def _scope(path: str) -> str:
    """The scope a variable's layer sits in: `block_0/ffn_up/kernel` → `block_0`."""
    return path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""


def _heads_dim(layer: Any) -> tuple[int, str] | None:
    """`(kernel dimension holding the heads, "in" | "out")` of an attention projection.

    An `EinsumDense` projects into heads when its output has one more
    dimension than its input (`btd,dnh->btnh`: the heads are the output's
    second-to-last label) and out of them when its input has one more
    (`btnh,nhd->btd`: the input's second-to-last label). `None` otherwise.
    """
    equation = getattr(layer, "equation", None)
    if not isinstance(layer, keras.layers.EinsumDense) or not equation or "," not in equation:
        return None
    inputs, rest = equation.split(",")
    kernel, output = rest.split("->")
    if len(output) == len(inputs) + 1 and output[-2] in kernel:
        return kernel.index(output[-2]), "in"
    if len(inputs) == len(output) + 1 and inputs[-2] in kernel:
        return kernel.index(inputs[-2]), "out"
    return None


def _labels(layer: Any, variable: Any) -> str:
    """The einsum labels of an EinsumDense variable's dimensions."""
    if variable is layer.kernel:
        return layer.equation.split(",")[1].split("->")[0]
    bias_axes = getattr(layer, "bias_axes", None) or ""
    return bias_axes if len(bias_axes) == len(variable.shape) else ""


def _features(layer: Any) -> tuple[int, int] | None:
    """`(in, out)` features of a projection with an `(in, out)` kernel, else `None`."""
    if isinstance(layer, keras.layers.Dense) and getattr(layer, "kernel", None) is not None:
        if layer.kernel.shape is not None and len(layer.kernel.shape) == 2:
            return tuple(layer.kernel.shape)
    if isinstance(layer, keras.layers.EinsumDense) and len(layer.kernel.shape) == 2:
        inputs, rest = layer.equation.split(",")
        kernel, output = rest.split("->")
        if (
            kernel[0] in inputs
            and kernel[0] not in output
            and kernel[1] in output
            and kernel[1] not in inputs
        ):
            if output.endswith(kernel[1]):
                return tuple(layer.kernel.shape)
    return None


def _softmax(layer: Any) -> bool:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", "") in ("softmax", "log_softmax")


def _producers(layer: Any, known: dict[int, Any]) -> Iterator[Any]:
    seen = set()
    for node in layer._inbound_nodes:
        for tensor in node.input_tensors:
            producer = tensor._keras_history.operation
            if id(producer) in known and id(producer) not in seen:
                seen.add(id(producer))
                yield producer


def _model_outputs(model: keras.Model) -> list[Any]:
    outputs = getattr(model, "outputs", None) or []
    return [t for t in keras.tree.flatten(outputs) if hasattr(t, "_keras_history")]
