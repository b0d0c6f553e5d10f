"""Strategies that read Keras layers: attention layers over heads, and projection pairs along the layer graph.

- `attention_layers`: Keras `MultiHeadAttention` and `GroupQueryAttention`
  split over heads, read off their `EinsumDense` equations; key/value
  projections with too few heads stay replicated, their output kept whole.
- `kv_head_dim`: such a key/value projection (outside Keras's own attention
  layers, an `EinsumDense` or a `Dense`) has its kernel split on its head_dim
  (a `Dense` kernel: on its output features) instead, where the batch axis
  has 2 devices or more: the kernel is gathered once per step, which sends
  no more than its replicated gradient's all-reduce would
  (`_kv_costs.KeyValueCosts._head_dim_unit` has the measurements).
- `projection_pairs`: without a trace (a subclassed model never called), a
  `Dense` whose output goes, through element-wise layers (or a `Multiply`
  gate), only into another `Dense` makes a column → row pair; with a trace
  the pairs come from `_by_trace`, and this strategy only notes the
  projections that stay whole.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import keras

from .. import _compat
from . import _notes
from ._layers import features, head_dim_index, heads_dim, kv_head_count, labels, owners
from ._ledger import Ledger, Setting

__all__ = [
    "ATTENTION",
    "ELEMENTWISE",
    "attention_layers",
    "heads_projection",
    "kv_head_dim",
    "projection_pairs",
]

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


# -- attention layers ---------------------------------------------------------------------


def attention_layers(ledger: Ledger, setting: Setting) -> None:
    """Splits every Keras attention layer's projections over heads."""
    for layer in _compat.sublayers(setting.model):
        if not isinstance(layer, ATTENTION):
            continue
        projections = [sub for sub in _compat.sublayers(layer) if heads_dim(sub) is not None]
        query_like = [sub for sub in projections if heads_dim(sub)[1] == "in"]
        heads = max((sub.kernel.shape[heads_dim(sub)[0]] for sub in query_like), default=0)
        for sub in projections:
            heads_projection(ledger, setting, sub, heads)
        ledger.replicate(layer.weights, _notes.NOT_A_HEAD_PROJECTION)


def heads_projection(ledger: Ledger, setting: Setting, layer: Any, heads: int) -> None:
    """One EinsumDense projecting into heads (query/key/value) or out of them."""
    index, side = heads_dim(layer)
    count = layer.kernel.shape[index]
    axis, size = setting.axis, setting.size
    if heads % size or count % size:
        if side == "in" and not heads % size:
            note = _notes.kv_heads_replicated(count, axis, size)
            ledger.keep_output_whole(layer.path, rank=len(layer.equation.split("->")[1]))
        else:
            note = _notes.heads_indivisible(heads, axis, size)
        ledger.replicate(layer.weights, note)
        return
    head_label = layer.equation.split(",")[1].split("->")[0][index]
    for variable in layer.weights:
        names = labels(layer, variable)
        if head_label in names:
            axes = tuple(axis if label == head_label else None for label in names)
            note = _notes.heads_split(layer.name, count) if side == "in" else _notes.ATTENTION_OUTPUT
        else:
            axes, note = (None,) * len(variable.shape), _notes.ATTENTION_OUTPUT_BIAS
        ledger.record(variable.path, axes, note, unit=layer.path.rsplit("/", 1)[0])


# -- projection pairs along the layer graph -----------------------------------------------


class _Graph:
    """The model's layers with their producers and consumers, and the layers that make its outputs."""

    def __init__(self, model: keras.Model) -> None:
        self.layers = [layer for layer in model.layers if not isinstance(layer, keras.layers.InputLayer)]
        self.consumers: dict[int, list[Any]] = {id(layer): [] for layer in self.layers}
        self.producers: dict[int, list[Any]] = {id(layer): [] for layer in self.layers}
        for layer in self.layers:
            for producer in _producers(layer, self.consumers):
                self.producers[id(layer)].append(producer)
                self.consumers[id(producer)].append(layer)
        self.outputs = {id(_compat.producing_layer(t)) for t in _model_outputs(model)}

    def pair_from(self, layer: Any) -> tuple[list[Any], Any]:
        """`([column, ...], row)` when `layer` starts a pair, else `([], None)`."""
        after = self.follow(layer)
        if after is not None and features(after) is not None:
            return [layer], after
        if isinstance(after, keras.layers.Multiply):
            columns = [self.trace_back(p) for p in self.producers[id(after)]]
            row = self.follow(after)
            if all(c is not None and features(c) is not None for c in columns) and features(row) is not None:
                if len({features(c)[1] for c in columns}) == 1:
                    return columns, row
        return [], None

    def follow(self, layer: Any) -> Any:
        """The next non-element-wise layer after `layer`, if its output goes nowhere else."""
        while True:
            if id(layer) in self.outputs or len(self.consumers[id(layer)]) != 1:
                return None
            (layer,) = self.consumers[id(layer)]
            if not isinstance(layer, ELEMENTWISE):
                return layer

    def trace_back(self, layer: Any) -> Any:
        while isinstance(layer, ELEMENTWISE) and len(self.producers[id(layer)]) == 1:
            (layer,) = self.producers[id(layer)]
        return layer if len(self.consumers[id(layer)]) == 1 else None


def kv_head_dim(ledger: Ledger, setting: Setting) -> None:
    """Splits the kernels of grouped-query key/value projections kept whole on their head_dim.

    Only with a batch axis of 2 devices or more: per step the split kernel is
    all-gathered over the model axis (`(m-1)/m` of it) and its gradient
    all-reduced over the batch axis in model-axis shards, at most the
    `2(d-1)/d` of it a replicated kernel's gradient all-reduce sends (equal
    at `d = 2`), for `1/m` of the state. An `EinsumDense` kernel is split on
    its head_dim, a `Dense` one (`(hidden, kv_heads × head_dim)`, SmolLM3's)
    on its output features. Never inside Keras's own attention layers, and
    never with a bias (see `head_dim_index`).
    """
    if setting.trace is None or setting.batch_size < 2:
        return
    keras_owned = {
        id(sub)
        for layer in _compat.sublayers(setting.model)
        if isinstance(layer, ATTENTION)
        for sub in _compat.sublayers(layer)
    }
    whole = ledger.proposal().whole_outputs
    for variable, owner in _owned(setting.model):
        if (
            id(owner) in keras_owned
            or ledger.axes(variable.path) != (None,) * len(variable.shape)
            or math.prod(variable.shape) < setting.replicate_below  # the policy keeps it whole
        ):
            continue
        uses = setting.trace.uses.get(variable.path, ())
        index = head_dim_index(owner, variable, uses, setting.size, whole, kv_heads=ledger.kv_heads)
        if index is None:
            continue
        heads = kv_head_count(owner, variable, ledger.kv_heads)
        axes = tuple(setting.axis if i == index else None for i in range(len(variable.shape)))
        width, dense = variable.shape[index], len(variable.shape) == 2
        note = _notes.kv_head_dim_split(heads, width, setting.axis, setting.size, dense)
        ledger.revise(variable.path, axes, note)


def _owned(model: keras.Model) -> Iterator[tuple[Any, Any]]:
    """Each variable of `model` with the layer that created it."""
    owner_of = owners(model)
    for variable in model.weights:
        if id(variable) in owner_of:
            yield variable, owner_of[id(variable)]


def projection_pairs(ledger: Ledger, setting: Setting) -> None:
    """Pairs projections along the layer graph (without a trace); notes the ones left whole."""
    graph = _Graph(setting.model)
    paired: set[int] = set()
    for layer in graph.layers if setting.trace is None else ():
        if id(layer) in paired or features(layer) is None:
            continue
        columns, row = graph.pair_from(layer)
        if row is None or id(row) in paired or any(id(c) in paired for c in columns):
            continue
        if not _splittable(ledger, setting, columns, row):
            continue
        _record_pair(ledger, setting.axis, columns, row)
        paired.update(id(layer) for layer in [*columns, row])
    for layer in graph.layers:
        if features(layer) is not None and id(layer) not in paired:
            if not any(ledger.decided(v.path) for v in layer.weights):
                note = _notes.FINAL_REPLICATED if id(layer) in graph.outputs else _notes.NO_PARTNER
                ledger.replicate(layer.weights, note)


def _record_pair(ledger: Ledger, axis: str, columns: Sequence[Any], row: Any) -> None:
    pair = f"{' × '.join(c.name for c in columns)} → {row.name}"
    for column in columns:
        ledger.record(column.kernel.path, (None, axis), _notes.column(pair), unit=pair)
        if column.bias is not None:
            ledger.record(column.bias.path, (axis,), _notes.column(pair), unit=pair)
    ledger.record(row.kernel.path, (axis, None), _notes.row(pair), unit=pair)
    if row.bias is not None:
        ledger.record(row.bias.path, (None,), _notes.row_bias(pair))


def _splittable(ledger: Ledger, setting: Setting, columns: Sequence[Any], row: Any) -> bool:
    """Whether a pair splits; when its features do not divide or it is too small, replicates it."""
    width = features(columns[0])[1]
    members = [*columns, row]
    if any(_softmax(layer) for layer in members):
        return False
    if width % setting.size:
        pair = f"{' × '.join(c.name for c in columns)} → {row.name}"
        note = _notes.indivisible_pair(pair, width, setting.axis, setting.size)
        for layer in members:
            ledger.replicate(layer.weights, note)
        return False
    small = [layer for layer in members if math.prod(layer.kernel.shape) < setting.replicate_below]
    if small:
        note = _notes.too_small(small[0].name, math.prod(small[0].kernel.shape), setting.replicate_below)
        for layer in members:
            ledger.replicate(layer.weights, note)
        return False
    return True


def _softmax(layer: Any) -> bool:
    activation = getattr(layer, "activation", None)
    return getattr(activation, "__name__", "") in ("softmax", "log_softmax")


def _producers(layer: Any, known: dict[int, Any]) -> Iterator[Any]:
    seen = set()
    for producer in _compat.input_layers(layer):
        if id(producer) in known and id(producer) not in seen:
            seen.add(id(producer))
            yield producer


def _model_outputs(model: keras.Model) -> list[Any]:
    outputs = getattr(model, "outputs", None) or []
    return [t for t in keras.tree.flatten(outputs) if _compat.made_by_a_layer(t)]
