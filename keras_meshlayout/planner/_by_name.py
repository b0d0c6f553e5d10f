"""Strategies that read names: attention blocks in custom layers, and `transformer_rules` for the rest.

- `attention_blocks`: a layer with a query projection (or a fused
  query/key/value one) and an output projection among its direct sublayers,
  named as in Keras and keras-hub code, is split over heads when its head
  count divides the model axis.
- `named_weights`: whatever no other strategy decided (embeddings, norms,
  feed-forward layers of subclassed models) is matched against
  `transformer_rules`; a column or row layer without its partner in the
  same scope stays whole.
"""

from __future__ import annotations

from typing import Any

from .. import _compat
from ..core._axes import Axes
from . import _notes
from ._by_layers import ATTENTION, heads_projection
from ._layers import features, heads_dim
from ._ledger import Ledger, Setting
from ._presets import ffn_role, transformer_rules

__all__ = ["attention_blocks", "named_weights"]

#: Attention projections by name, as Keras and keras-hub write them, and their role.
HEAD_PROJECTIONS = {
    **dict.fromkeys(("query", "q_proj", "query_dense", "query_projector", "q_dense_layer"), "query"),
    **dict.fromkeys(("key", "k_proj", "key_dense", "key_projector", "k_dense_layer"), "key"),
    **dict.fromkeys(("value", "v_proj", "value_dense", "value_projector", "v_dense_layer"), "value"),
    **dict.fromkeys(("query_key_value",), "fused"),
    **dict.fromkeys(
        ("attention_output", "o_proj", "output_dense", "output_projector", "o_dense_layer"), "output"
    ),
}

#: Attributes attention layers keep their query head count in (keras-hub, Keras, common code).
_HEAD_COUNT_ATTRIBUTES = ("num_query_heads", "num_attention_heads", "num_heads", "heads", "_num_heads")


# -- attention blocks ---------------------------------------------------------------------


def attention_blocks(ledger: Ledger, setting: Setting) -> None:
    """Attention blocks in custom layers, found by their projections' names.

    A layer's direct sublayers are read off the layer objects, not the
    variable paths, since some layers are built outside their parent's name
    scope (SmolLM's `o_proj/kernel`).
    """
    for block in _compat.sublayers(setting.model):
        if isinstance(block, ATTENTION):
            continue  # planned from its own structure by `_by_layers.attention_layers`
        roles: dict[str, Any] = {}
        for child in _compat.sublayers(block, recursive=False):
            role = HEAD_PROJECTIONS.get(child.name)
            if role is not None and getattr(child, "kernel", None) is not None:
                roles.setdefault(role, child)
        if not ({"query", "fused"} & roles.keys()):
            continue
        query = roles.get("query", roles.get("fused"))
        if any(ledger.decided(v.path) for v in query.weights):
            continue  # the graph planner has it (an output projection's path may be shared)
        _attention_block(ledger, setting, block, roles)


def _block_shape(setting: Setting, block: Any, roles: dict[str, Any]) -> tuple[int | None, str | None]:
    """`(head_dim, None)` when a block splits over heads (`head_dim` for Dense projections), else why not."""
    heads = _head_count(block, roles)
    query = roles.get("query", roles.get("fused"))
    if heads is None:
        return None, _notes.heads_unknown(block.name)
    if "output" not in roles:
        return None, _notes.no_output_projection(block.name)
    if heads % setting.size:
        return None, _notes.heads_indivisible(heads, setting.axis, setting.size)
    if heads_dim(query) is not None:
        return None, None
    width = query.kernel.shape[-1]
    if "query" in roles and len(query.kernel.shape) == 2 and width % heads == 0:
        return width // heads, None
    if "fused" in roles:
        return None, _notes.fused_heads(block.name, tuple(query.kernel.shape))
    return None, _notes.not_whole_heads_of_query(block.name, width, heads)


def _attention_block(ledger: Ledger, setting: Setting, block: Any, roles: dict[str, Any]) -> None:
    """Splits one by-name attention block over heads, or replicates it with the reason."""
    unit = block.path
    head_dim, reason = _block_shape(setting, block, roles)
    if reason is not None:
        for layer in roles.values():
            ledger.replicate(layer.weights, reason, unit)
        return
    heads = _head_count(block, roles)
    for role, layer in roles.items():
        if heads_dim(layer) is not None:
            heads_projection(ledger, setting, layer, heads)
            for variable in layer.weights:
                ledger.regroup(variable.path, unit)
        elif role == "output" and features(layer) is not None and features(layer)[0] % heads == 0:
            ledger.record(layer.kernel.path, (setting.axis, None), _notes.ATTENTION_OUTPUT, unit=unit)
            if layer.bias is not None:
                ledger.record(layer.bias.path, (None,), _notes.ATTENTION_OUTPUT_BIAS)
        elif role in ("query", "key", "value") and head_dim and features(layer) is not None:
            _dense_heads(ledger, setting, layer, layer.kernel.shape[1] // head_dim, head_dim, unit)
        else:
            shape = tuple(layer.kernel.shape)
            ledger.replicate(layer.weights, _notes.unreadable_projection(block.name, layer.name, shape), unit)


def _dense_heads(ledger: Ledger, setting: Setting, layer: Any, count: int, head_dim: int, unit: str) -> None:
    """A Dense query/key/value projection with an `(hidden, heads × head_dim)` kernel.

    Its output features hold the heads one after another, so splitting
    them over the model axis gives each device whole heads, provided the
    head count divides.
    """
    if count * head_dim != layer.kernel.shape[1]:
        ledger.replicate(layer.weights, _notes.not_whole_heads(layer.kernel.shape[1], head_dim), unit)
    elif count % setting.size:
        ledger.replicate(layer.weights, _notes.kv_heads_replicated(count, setting.axis, setting.size), unit)
        ledger.keep_output_whole(layer.path, rank=_input_rank(layer))
        ledger.kv_heads[layer.path] = count
    else:
        note = _notes.heads_split(layer.name, count, head_dim)
        ledger.record(layer.kernel.path, (None, setting.axis), note, unit=unit)
        if layer.bias is not None:
            ledger.record(layer.bias.path, (setting.axis,), note, unit=unit)


def _head_count(block: Any, roles: dict[str, Any]) -> int | None:
    """The query head count of an attention block, read off an einsum kernel or the layer."""
    for role, side in (("query", "in"), ("fused", "in"), ("output", "out")):
        layer = roles.get(role)
        if layer is not None and heads_dim(layer) is not None and heads_dim(layer)[1] == side:
            return int(layer.kernel.shape[heads_dim(layer)[0]])
    for name in _HEAD_COUNT_ATTRIBUTES:
        value = getattr(block, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _input_rank(layer: Any) -> int:
    """The rank of a built layer's input (and so of a Dense layer's output); 3 if unknown."""
    shapes = _compat.build_shapes(layer)
    shape = next(iter(shapes.values()), None)
    return len(shape) if isinstance(shape, (tuple, list)) else 3


# -- everything else, by name -------------------------------------------------------------


def named_weights(ledger: Ledger, setting: Setting) -> None:
    """Variables no other strategy decided, matched against `transformer_rules`."""
    presets = transformer_rules(model_axis=setting.axis)
    matched: list[tuple[Any, Axes, str]] = []
    for variable in setting.model.weights:
        if ledger.decided(variable.path):
            continue
        rule = presets.match(variable.path)
        if rule is None:
            continue
        axes = rule.expand(len(variable.shape))
        if axes is None or any(a and d % setting.size for a, d in zip(axes, variable.shape, strict=True)):
            matched.append((variable, (None,) * len(variable.shape), _notes.by_name_misfit(rule.note)))
        else:
            matched.append((variable, axes, _notes.by_name(rule.note)))
    _pair_by_scope(ledger, matched)


def _pair_by_scope(ledger: Ledger, matched: list[tuple[Any, Axes, str]]) -> None:
    """Keeps by-name column- and row-parallel layers only as a pair in one scope.

    A column layer alone leaves its output split, and whatever reads it
    must gather it; a row layer alone all-reduces its output for a weight
    no column layer prepared. So without a partner in the same scope each
    stays whole.
    """
    roles = {id(v): ffn_role(v.path) if any(axes) else None for v, axes, _ in matched}
    present = {
        role: {_scope(v.path) for v, _, _ in matched if roles[id(v)] == role} for role in ("row", "column")
    }
    for variable, axes, note in matched:
        role = roles[id(variable)]
        other = {"column": "row", "row": "column"}.get(role)
        if other is not None and _scope(variable.path) not in present[other]:
            axes = (None,) * len(variable.shape)
            note = _notes.without_partner(note, role)
        ledger.record(variable.path, axes, note, unit=_scope(variable.path))


def _scope(path: str) -> str:
    """The scope a variable's layer sits in: `block_0/ffn_up/kernel` → `block_0`."""
    return path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""
