"""Grouped convolutions found in a model's traced forward pass, custom layers' included.

`kml.GroupedConvWarning` names the Keras layers that run a grouped or depthwise convolution
by their class (`_planning`); a custom layer that calls `keras.ops.depthwise_conv` or
`jax.lax.conv_general_dilated(..., feature_group_count=...)` itself (keras-hub's Qwen 3.5
gated delta-net) has no such class. `grouped_kernels` traces the model's forward pass on its
input spec (abstract values: nothing is computed or allocated) and returns the variables the
kernels of such convolutions are read from, through casts, transposes, reshapes and nested
calls. A model whose inputs are unknown (a subclassed model never called), or that does not
trace on a guessed batch of 2, gives none.
"""

from __future__ import annotations

import weakref
from typing import Any

import keras
import numpy as np

from .. import _compat

__all__ = ["abstract_batch", "abstract_value", "grouped_kernels"]

#: The primitives a kernel may pass on its way to the convolution: one input, the same values.
_VIEWS = frozenset(
    {"convert_element_type", "transpose", "reshape", "broadcast_in_dim", "copy", "copy_p", "squeeze",
     "expand_dims", "reduce_precision"}
)  # fmt: skip
#: Per model, the kernels found, with the number of variables they were found among.
_FOUND: weakref.WeakKeyDictionary[Any, tuple[int, frozenset[str]]] = weakref.WeakKeyDictionary()


def abstract_batch(model: keras.Model) -> Any:
    """Abstract inputs for a model when no batch is given: its input spec with a batch of 2, or `None`."""
    import jax

    inputs = _compat.input_structure(model)
    if inputs is None:
        try:
            inputs = model.inputs
        except (AttributeError, ValueError):
            inputs = None
    if isinstance(inputs, (list, tuple)) and len(inputs) == 1 and isinstance(model, keras.Sequential):
        inputs = inputs[0]  # a Sequential model takes its one input bare
    if inputs is not None:
        try:
            return keras.tree.map_structure(
                lambda t: jax.ShapeDtypeStruct(
                    tuple(2 if d is None else d for d in t.shape), np.dtype(t.dtype or "float32")
                ),
                inputs,
            )
        except (AttributeError, TypeError):
            return None
    shapes = _compat.build_shapes(model)
    if len(shapes) == 1:
        (shape,) = shapes.values()
        if isinstance(shape, (tuple, list)) and all(isinstance(d, int) or d is None for d in shape):
            return jax.ShapeDtypeStruct(tuple(2 if d is None else d for d in shape), np.dtype("float32"))
    return None


def abstract_value(value: Any) -> Any:
    """`value` (an array, a variable, anything with a shape) as a `jax.ShapeDtypeStruct`."""
    import jax

    return jax.ShapeDtypeStruct(
        tuple(value.shape), np.dtype(getattr(value, "dtype", None) or np.asarray(value).dtype)
    )


def grouped_kernels(model: keras.Model) -> frozenset[str]:
    """The paths of the variables read as kernels of grouped convolutions in `model`'s forward pass.

    Traced once per model (again when its variables change); empty when it cannot be traced.
    """
    variables = list(model.trainable_variables) + list(model.non_trainable_variables)
    known = _FOUND.get(model)
    if known is not None and known[0] == len(variables):
        return known[1]
    found = _traced(model, variables)
    _FOUND[model] = (len(variables), found)
    return found


def _traced(model: keras.Model, variables: list[Any]) -> frozenset[str]:
    import jax

    batch = abstract_batch(model)
    if batch is None:
        return frozenset()
    count = len(model.trainable_variables)
    kwargs = {"training": False} if _compat.takes_training(model) else {}

    def forward(train: Any, state: Any, x: Any) -> Any:
        return model.stateless_call(train, state, x, **kwargs)[0]

    abstract = [abstract_value(v) for v in variables]
    try:
        closed = jax.make_jaxpr(forward)(abstract[:count], abstract[count:], batch)
    except Exception:  # the spec was a guess (a batch of 2): no trace, no finding
        return frozenset()
    jaxpr = closed.jaxpr
    return frozenset(_scan(jaxpr, dict(zip(jaxpr.invars, (v.path for v in variables), strict=False))))


def _scan(jaxpr: Any, held: dict[Any, str]) -> set[str]:
    """Kernels of grouped convolutions in `jaxpr`, whose variables `held` maps to the paths they view."""
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "conv_general_dilated" and eqn.params.get("feature_group_count", 1) > 1:
            if _in(eqn.invars[1], held):
                found.add(held[eqn.invars[1]])
        elif name in _VIEWS and eqn.invars and _in(eqn.invars[0], held):
            held[eqn.outvars[0]] = held[eqn.invars[0]]
        for inner in _inner_jaxprs(eqn):
            inner_held = {v: held[o] for o, v in zip(eqn.invars, inner.invars, strict=False) if _in(o, held)}
            found |= _scan(inner, inner_held)
    return found


def _in(var: Any, held: dict[Any, str]) -> bool:
    try:
        return var in held
    except TypeError:  # a literal
        return False


def _inner_jaxprs(eqn: Any) -> list[Any]:
    """The jaxprs a call-like equation runs on its own inputs, in order (a `pjit`, `remat`, `custom_jvp`)."""
    inner = []
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        value = eqn.params.get(key)
        value = getattr(value, "jaxpr", value)
        if value is not None and hasattr(value, "eqns") and len(value.invars) == len(eqn.invars):
            inner.append(value)
    return inner
