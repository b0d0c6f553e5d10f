"""Which projections a rematerialised step computes twice: their forward collectives are sent twice.

Under `keras.RematScope` (or any `jax.checkpoint`) the backward pass recomputes a block's forward
products where their outputs are needed again. A row-parallel projection recomputed so (its output
read by an activation whose gradient needs it) all-reduces its output over the model axis again,
and a vocab-parallel table looked up again all-reduces the looked-up rows again;
one whose output nothing in the backward pass reads is not recomputed (JAX drops it). Counted by
comparing the step's trace with the forward pass's: each weight's products with the same contracted
dimensions as its forward products, beyond those of the forward pass.

Measured on XLA:CPU (2×4, a Dense MLP 64 → 128 × 3 → 64 under `RematScope(mode="full")`): the
`gelu` projection's forward all-reduce is sent twice, the last projection's (no activation) once.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

import keras

from .. import _compat
from ._trace import Trace, trace_step

__all__ = ["recomputed_products"]

_PASS = ("convert_element_type", "copy")


def recomputed_products(model: keras.Model, batch: Any, forward: Trace) -> Mapping[tuple[str, str], int]:
    """Per `(weight path, "matmul" or "gather")`, how many more of its forward products (or look-ups)
    the training step computes than the forward pass (one per recomputed block), or nothing when the
    step cannot be traced."""
    if not _compat.rematerialised(model):
        return {}  # nothing recomputed (and a weight read twice in the backward pass is no recompute)
    try:
        step = trace_step(model, batch)
    except Exception:  # a model whose gradient JAX cannot trace: costed without recomputation
        return {}
    once, twice = _products(forward), _products(step)
    extra: collections.Counter = collections.Counter()
    for (path, dims), count in twice.items():
        if (path, dims) in once and count > once[path, dims]:
            extra[path, "gather" if dims == "gather" else "matmul"] += count - once[path, dims]
    return dict(extra)


def _products(trace: Trace) -> collections.Counter:
    """`(weight path, contracted dimensions)` → how many `dot_general`s read the weight so; and
    `(table path, "gather")` → how many look-ups read the table."""
    counts: collections.Counter = collections.Counter()
    for node in trace.nodes:
        if node.primitive == "gather":
            reads = [(node.inputs[0], "gather")]
        elif node.primitive == "dot_general":
            (lhs, rhs), _ = node.params["dimension_numbers"]
            reads = [(node.inputs[0], tuple(lhs)), (node.inputs[1], tuple(rhs))]
        else:
            continue
        for value, contracted in reads:
            while value not in trace.variables and value in trace.producer:
                producer = trace.nodes[trace.producer[value]]
                if producer.primitive not in _PASS:
                    break
                value = producer.inputs[0]
            if value in trace.variables:
                counts[trace.variables[value], contracted] += 1
    return counts
