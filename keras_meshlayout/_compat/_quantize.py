"""A dry build's `quantize`: traced for the shapes it makes, never computed.

Keras quantizes the values a layer holds (`layer.quantize(mode)`, `model.quantize(mode)`): in a
dry build (`kml.dry_build`, `kml.dry_plan`), the output of each variable's initializer, made
whole. A Gemma-2B-shaped model under `quantize("int8")`, two blocks deep, took 54 s and 8.7 GB of
host memory to build dry; traced, 1.7 s and 0.4 GB (its 256,000 × 2,048 table alone is 2 GB of
float32). The internals it reaches, checked in `tests/test_compat.py`:

- `keras.src.quantizers.abs_max_quantize`, `abs_max_quantize_grouped_with_zero_point` (also as
  `keras.src.quantizers.quantizers`'s, which `AbsMaxQuantizer` calls) and `pack_int4`: computed
  in NumPy when asked `to_numpy=True`, which a trace cannot; here on tensors, and `pack_int4` as
  zeros of the packed shape.
- `StatelessScope.state_mapping`: the values assigned to variables inside the scope, from which
  the traced ones are dropped (a later read gets the new variable's initializer, as it would
  before any assignment).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import jax
import keras

__all__ = ["traced_quantize"]


@contextlib.contextmanager
def traced_quantize(scope: Any) -> Iterator[None]:
    """Each Keras layer's `quantize` traced under `jax.eval_shape`, its assignments to `scope` dropped.

    Keras quantizes the values a layer holds: in a dry build, its initializer's output computed
    whole (a 256,000 × 2,048 table: 8 GB of host memory and a minute). Traced, its quantizers on
    tensors (`to_numpy=False`; `pack_int4` as zeros of the packed shape), nothing is computed.
    """
    from keras.src import quantizers
    from keras.src.quantizers import quantizers as module

    def on_tensors(own: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            bound = inspect.signature(own).bind(*args, **kwargs)
            bound.arguments["to_numpy"] = False
            return own(*bound.args, **bound.kwargs)

        return run

    def packed(array: Any, axis: int = 0, dtype: str = "int8") -> Any:
        shape = list(array.shape)
        length, shape[axis] = shape[axis], (shape[axis] + 1) // 2
        return jax.numpy.zeros(shape, dtype), tuple(shape), length

    def traced(own: Callable[..., Any]) -> Callable[..., Any]:
        def quantize(layer: Any, *args: Any, **kwargs: Any) -> None:
            jax.eval_shape(lambda: own(layer, *args, **kwargs))
            for key in [k for k, v in scope.state_mapping.items() if isinstance(v, jax.core.Tracer)]:
                del scope.state_mapping[key]

        return quantize

    classes, found = [keras.layers.Layer], []
    while classes:  # every layer class defining `quantize` (a model's calls its layers')
        cls = classes.pop()
        classes.extend(cls.__subclasses__())
        if "quantize" in cls.__dict__ and not issubclass(cls, keras.Model):
            found.append((cls, "quantize", traced(cls.__dict__["quantize"])))
    names = ("abs_max_quantize", "abs_max_quantize_grouped_with_zero_point")
    for owner in (quantizers, module):
        found += [(owner, name, on_tensors(getattr(owner, name))) for name in names]
    found.append((quantizers, "pack_int4", packed))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in found]
    for owner, name, replacement in found:
        setattr(owner, name, replacement)
    try:
        yield
    finally:
        for owner, name, own in saved:
            setattr(owner, name, own)
