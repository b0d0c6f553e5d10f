"""Stage 1: the traced computation, a dataflow graph whose inputs are the variables.

The model's forward pass is traced once with `jax.make_jaxpr` on abstract values
(nothing runs, and a `kml.dry_build` model works). Calls into jitted functions,
`custom_jvp`/`custom_vjp` rules and rematerialised blocks are inlined, so that
the graph is one flat list of primitive operations, however the model was
written: Keras layers, `keras.ops` calls, Python operators or custom layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._grouped_scan import abstract_value
from ..core._model_calls import failing_on
from ._memo import memoised
from ._unpacking import lora_layers, lora_parts, merges_lora, scaled_input, unpacked

__all__ = ["LITERALS", "Node", "Trace", "Use", "trace_body", "trace_model", "trace_step"]

#: The node parameter that holds, per operand, its scalar literal's value (`None` for a value).
LITERALS = "kml_literals"
#: Operations a weight passes through unchanged on its way to being used (a cast under mixed precision).
_PASS = ("convert_element_type", "copy", "copy_p", "reduce_precision")


@dataclasses.dataclass(frozen=True)
class Node:
    """One primitive operation: the values it reads and writes (by id; `-1` is a literal), and its JAX
    name stack (`"jvp(gemma_backbone)/decoder_block_0/attention"`), as XLA's `op_name` metadata has it."""

    index: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    params: Mapping[str, Any]
    name: str = ""


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a weight: a projection (`dot_general`) or a look-up (`gather`).

    Attributes:
        node: The node index.
        kind: `"matmul"` or `"gather"`.
        inputs: Shape of the activation it reads (the look-up indices for a gather).
        output: Shape of what it writes.
        from_input: Whether no gradient flows back to the activation: a model input (cast
            at most), or a value computed from no trainable weight (a frozen backbone's).
        dtype: The dtype the operation computes in.
        contracted: The weight's dimensions summed over (a matmul's inputs).
        batch: The weight's dimensions that are batch dimensions of the matmul (experts).
    """

    node: int
    kind: str
    inputs: tuple[int, ...]
    output: tuple[int, ...]
    from_input: bool
    dtype: str
    contracted: tuple[int, ...]
    batch: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Trace:
    """The forward pass as a flat dataflow graph.

    Attributes:
        nodes: The operations, in execution order.
        shapes: Per value id, its shape.
        dtypes: Per value id, its dtype name.
        variables: Per value id of a model variable, its path.
        inputs: Value ids of the batch's arrays.
        outputs: Value ids the forward pass returns.
        producer: Per value id, the node that writes it.
        consumers: Per value id, the nodes that read it.
        uses: Per variable path, its uses as a projection weight or a look-up table.
        read: Per trainable variable path the outputs depend on, the fraction read.
        trained: Value ids computed from a trainable weight (or a LoRA kernel): the
            values a gradient flows back to.
        losses: Value ids of the auxiliary losses (`add_loss`) among `outputs`, in a trace
            taken in training mode (`auxiliary`); empty otherwise.
        auxiliary: The forward pass traced again in training mode with its auxiliary losses
            as outputs after the model's, when it routes tokens (a `top_k`, as a
            mixture-of-experts router): what those losses add to the step (`_batch_sums`).
    """

    nodes: tuple[Node, ...]
    shapes: Mapping[int, tuple[int, ...]]
    dtypes: Mapping[int, str]
    variables: Mapping[int, str]
    inputs: frozenset[int]
    outputs: tuple[int, ...]
    producer: Mapping[int, int]
    consumers: Mapping[int, tuple[int, ...]]
    uses: Mapping[str, tuple[Use, ...]]
    read: Mapping[str, float]
    trained: frozenset[int] = frozenset()
    losses: tuple[int, ...] = ()
    auxiliary: Trace | None = None

    def unread(self, path: str) -> bool:
        """Whether no operation of the traced step reads the variable at `path` (trainable or frozen)."""
        return path not in self.read and not any(
            self.consumers.get(value) for value, name in self.variables.items() if name == path
        )

    def weight_of(self, value: int) -> tuple[str, tuple[int, ...]] | None:
        """`(path, dims)` when `value` is a variable cast, transposed, scaled by scalars or unpacked.

        `dims[i]` is the variable's dimension that `value`'s dimension `i` comes from: a
        permutation, or for an int4 kernel unpacked and reshaped to its float shape
        (`_unpacking`) the stored dimension each float one was merged into.
        """
        dims: list[int | None] = list(range(len(self.shapes[value])))
        while value not in self.variables:
            node = self.producer.get(value)
            if node is None:
                return None
            op = self.nodes[node]
            if op.primitive == "transpose":
                inner = tuple(op.params["permutation"])
                dims = [None if d is None else inner[d] for d in dims]
            elif op.primitive not in _PASS:
                step = unpacked(self, op, value)
                if step is None:
                    return None
                value, inner_map = step
                dims = [None if d is None else inner_map[d] for d in dims]
                continue
            value = op.inputs[0]
        return self.variables[value], tuple(dims)  # type: ignore[arg-type]

    def from_input(self, value: int) -> bool:
        """Whether `value` is one of the batch's arrays, cast (or quantized, float8) at most."""
        while value not in self.inputs:
            node = self.producer.get(value)
            if node is None:
                return False
            op = self.nodes[node]
            if op.primitive not in _PASS and scaled_input(self, op) is None:
                return False
            value = op.inputs[0] if op.primitive in _PASS else scaled_input(self, op)
        return True


def trace_model(model: keras.Model, batch: Any) -> Trace:
    """Traces `model`'s forward pass on `batch` (arrays or shapes) into a `Trace` (once per model state).

    Layers a custom `build()` left for the first call are built on `batch` first, as `fit` builds
    them, so that their weights exist when the trace reads them.
    """
    with _calling(model, batch):
        _compat.build_layers(model, batch)
    return memoised("forward", model, batch, lambda: _trace_model(model, batch))


def _calling(model: keras.Model, batch: Any) -> contextlib.AbstractContextManager[None]:
    """The model's own failure on `batch` (wrong structure or shapes) as one clear error."""
    return failing_on(
        model,
        {"batch": batch},
        "batch= is one global batch of the model's inputs alone, in the structure the model is "
        "called with: pass x, not (x, y), with the shapes fit will see.",
    )


def _trace_model(model: keras.Model, batch: Any) -> Trace:
    import jax

    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)

    kwargs = {"training": False} if _compat.takes_training(model) else {}

    def forward(train: Any, state: Any, x: Any) -> Any:
        return model.stateless_call(train, state, x, **kwargs)[0]

    # LoRA kernels read as their base kernel (the adapters follow it)
    with _compat.lora_off(model), _calling(model, batch):
        closed = jax.make_jaxpr(forward)(
            [abstract_value(v) for v in trainable],
            [abstract_value(v) for v in non_trainable],
            keras.tree.map_structure(abstract_value, batch),
        )
    jaxpr = closed.jaxpr
    # Only adapters that train make their kernel trained (a layer frozen after `enable_lora` has none),
    # and only where they are merged into it (a quantized layer adds their product to its output).
    lora = [
        parts
        for layer in lora_layers(model)
        if (parts := lora_parts(layer)) is not None
        and (parts[1].trainable or parts[2].trainable)
        and merges_lora(layer)
    ]
    trained = {v.path for v in trainable} | {base.path for base, _, _ in lora}
    trace = _flat(jaxpr, [v.path for v in trainable + non_trainable], trained=trained)
    read = _fraction_read(jaxpr)
    used = {path: f for path, f in zip([v.path for v in trainable], read, strict=False) if f > 0}
    for base, a, b in lora:  # the adapters are read whole; XLA sums the gradient of the merged kernel
        used.update({base.path: 1.0, a.path: 1.0, b.path: 1.0})
    auxiliary = None
    if kwargs and any(node.primitive == "top_k" for node in trace.nodes):
        try:
            auxiliary = _trace_losses(model, batch, trainable, non_trainable)
        except Exception:  # a model that cannot run in training mode here: plan without its losses
            auxiliary = None
    return dataclasses.replace(trace, read=MappingProxyType(used), auxiliary=auxiliary)


def _trace_losses(model: keras.Model, batch: Any, trainable: list, non_trainable: list) -> Trace | None:
    """The forward pass in training mode, its auxiliary losses (`add_loss`) as outputs after the model's.

    Keras adds them to the loss only when training (a router's load-balancing loss), so the
    inference trace never sees them; `None` when there are none.
    """
    import jax

    def forward(train: Any, state: Any, x: Any) -> Any:
        outputs, _, losses = model.stateless_call(train, state, x, training=True, return_losses=True)
        return keras.tree.flatten(outputs), list(losses)

    with _compat.lora_off(model):
        closed, (outs, losses) = jax.make_jaxpr(forward, return_shape=True)(
            [abstract_value(v) for v in trainable],
            [abstract_value(v) for v in non_trainable],
            keras.tree.map_structure(abstract_value, batch),
        )
    if not losses:
        return None
    trace = _flat(closed.jaxpr, [v.path for v in trainable + non_trainable], keep_uses=False)
    return dataclasses.replace(trace, losses=trace.outputs[len(outs) :])


def trace_step(model: keras.Model, batch: Any) -> Trace:
    """Traces one training step's forward and backward passes on `batch` into a `Trace` (once per model
    state, as `trace_model`).

    The step is the gradient of a stand-in loss (the mean square of every output, in
    float32) with respect to every trainable variable: the same forward pass as
    `trace_model`, then what the backward pass computes, in the order JAX emits it
    (rematerialised blocks recomputed where their gradients are taken). Its outputs are
    the gradients, one per trainable variable. Only the dataflow is kept (`uses` and
    `read` are empty): what the peak-memory walk (`_peak`) reads.
    """
    return memoised("step", model, batch, lambda: _trace_step(model, batch))


def _trace_step(model: keras.Model, batch: Any) -> Trace:
    import jax
    import jax.numpy as jnp

    trainable = list(model.trainable_variables)
    non_trainable = list(model.non_trainable_variables)
    kwargs = {"training": False} if _compat.takes_training(model) else {}

    def step(train: Any, state: Any, x: Any) -> Any:
        def loss(weights: Any) -> Any:
            outputs = model.stateless_call(weights, state, x, **kwargs)[0]
            return sum(jnp.mean(jnp.square(out.astype("float32"))) for out in keras.tree.flatten(outputs))

        return jax.grad(loss)(train)

    closed = jax.make_jaxpr(step)(
        [abstract_value(v) for v in trainable],
        [abstract_value(v) for v in non_trainable],
        keras.tree.map_structure(abstract_value, batch),
    )
    return _flat(closed.jaxpr, [v.path for v in trainable + non_trainable], keep_uses=False)


def trace_body(closed: Any) -> Trace:
    """The body of a loop (a `scan`'s `jaxpr` parameter) as a `Trace` of its own: its inputs, in order,
    are the body's (constants, carried values, the sequences' per-step slices), its outputs the body's."""
    return _flat(getattr(closed, "jaxpr", closed), [], keep_uses=False)


def _flat(jaxpr: Any, paths: list[str], *, trained: set[str] = frozenset(), keep_uses: bool = True) -> Trace:
    """`jaxpr`, whose first inputs are the variables at `paths`, as a flat `Trace`.

    The values computed from the variables at `trained` paths are the trace's `trained`.
    """
    builder = _Builder()
    ids = [builder.new(v.aval) for v in jaxpr.invars]
    for var in jaxpr.constvars:
        builder.env[var] = builder.new(var.aval)
    for var, value in zip(jaxpr.invars, ids, strict=True):
        builder.env[var] = value
    outputs = builder.inline(jaxpr)
    variables = dict(zip(ids[: len(paths)], paths, strict=True))
    reached = {value for value, path in variables.items() if path in trained}
    consumers: dict[int, list[int]] = {}
    producer: dict[int, int] = {}
    for node in builder.nodes:
        for value in node.inputs:
            if value >= 0:
                consumers.setdefault(value, []).append(node.index)
        for value in node.outputs:
            producer[value] = node.index
        if any(value in reached for value in node.inputs):
            reached.update(node.outputs)
    trace = Trace(
        nodes=tuple(builder.nodes),
        shapes=MappingProxyType(builder.shapes),
        dtypes=MappingProxyType(builder.dtypes),
        variables=MappingProxyType(variables),
        inputs=frozenset(ids[len(paths) :]),
        outputs=tuple(outputs),
        producer=MappingProxyType(producer),
        consumers=MappingProxyType({k: tuple(v) for k, v in consumers.items()}),
        uses=MappingProxyType({}),
        read=MappingProxyType({}),
        trained=frozenset(reached),
    )
    if not keep_uses:
        return trace
    return dataclasses.replace(trace, uses=MappingProxyType(_uses(trace)))


def _uses(trace: Trace) -> dict[str, tuple[Use, ...]]:
    uses: dict[str, list[Use]] = {}
    for node in trace.nodes:
        if node.primitive == "dot_general":
            (lhs_c, rhs_c), (lhs_b, rhs_b) = node.params["dimension_numbers"]
            for side, other in ((0, 1), (1, 0)):
                weight = trace.weight_of(node.inputs[side])
                if weight is None or trace.weight_of(node.inputs[other]) is not None:
                    continue
                path, perm = weight
                activation = node.inputs[other]
                uses.setdefault(path, []).append(
                    Use(
                        node.index,
                        "matmul",
                        trace.shapes[activation],
                        trace.shapes[node.outputs[0]],
                        trace.from_input(activation) or activation not in trace.trained,
                        trace.dtypes[node.inputs[side]],
                        tuple(sorted(perm[c] for c in (lhs_c if side == 0 else rhs_c))),
                        tuple(sorted(perm[b] for b in (lhs_b if side == 0 else rhs_b))),
                    )
                )
        elif node.primitive == "gather":
            weight = trace.weight_of(node.inputs[0])
            if weight is not None:
                uses.setdefault(weight[0], []).append(
                    Use(
                        node.index,
                        "gather",
                        trace.shapes[node.inputs[1]],
                        trace.shapes[node.outputs[0]],
                        trace.from_input(node.inputs[1]) or node.inputs[1] not in trace.trained,
                        trace.dtypes[node.inputs[0]],
                        (),
                    )
                )
    return {path: tuple(u) for path, u in uses.items()}


class _Builder:
    """Flattens a jaxpr, inlining calls, into `Node`s over integer value ids."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.shapes: dict[int, tuple[int, ...]] = {}
        self.dtypes: dict[int, str] = {}
        self.env: dict[Any, int] = {}

    def new(self, aval: Any) -> int:
        value = len(self.shapes)
        self.shapes[value] = tuple(int(d) for d in getattr(aval, "shape", ()))
        self.dtypes[value] = str(getattr(aval, "dtype", "float32"))
        return value

    def read(self, atom: Any) -> int:
        if type(atom).__name__ == "Literal":
            return -1
        return self.env[atom]

    def inline(self, jaxpr: Any, scope: str = "") -> list[int]:
        for eqn in jaxpr.eqns:
            name = "/".join(n for n in (scope, str(eqn.source_info.name_stack)) if n)
            inner = _inner_jaxpr(eqn)
            args = tuple(self.read(a) for a in eqn.invars)
            if inner is not None:
                body = getattr(inner, "jaxpr", inner)
                for var in body.constvars:
                    self.env[var] = self.new(var.aval)
                for var, value in zip(body.invars, args, strict=True):
                    if value < 0:
                        value = self.new(var.aval)
                    self.env[var] = value
                results = self.inline(body, name)
                for var, value in zip(eqn.outvars, results, strict=True):
                    self.env[var] = value if value >= 0 else self.new(var.aval)
                continue
            outs = tuple(self.new(v.aval) for v in eqn.outvars)
            for var, value in zip(eqn.outvars, outs, strict=True):
                self.env[var] = value
            params = dict(eqn.params)
            literals = tuple(_scalar(a) for a in eqn.invars)
            if any(v is not None for v in literals):
                params[LITERALS] = literals
            self.nodes.append(Node(len(self.nodes), eqn.primitive.name, args, outs, params, name))
        return [self.read(v) for v in jaxpr.outvars]


#: Primitives whose body is inlined: calls, custom derivative rules, rematerialisation.
_CALLS = (
    "jit",
    "pjit",
    "closed_call",
    "core_call",
    "custom_jvp_call",
    "custom_vjp_call",
    "custom_vjp_call_jaxpr",
    "remat",
    "remat2",
    "checkpoint",
    "custom_lin",
)


def _scalar(atom: Any) -> float | None:
    """A scalar literal operand's value, else `None`."""
    if type(atom).__name__ != "Literal" or np.size(atom.val) != 1:
        return None
    try:
        return float(np.asarray(atom.val).reshape(()))
    except (TypeError, ValueError):
        return None


def _inner_jaxpr(eqn: Any) -> Any:
    if eqn.primitive.name not in _CALLS:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        inner = eqn.params.get(key)
        body = getattr(inner, "jaxpr", inner)
        if body is not None and hasattr(body, "eqns"):
            if len(body.invars) == len(eqn.invars) and len(body.outvars) == len(eqn.outvars):
                return inner
    return None


def _fraction_read(jaxpr: Any) -> list[float]:
    """Per input of `jaxpr`: the fraction of it the outputs depend on.

    0 for an input the outputs do not depend on (dead code removed first), the
    sliced fraction for one read only through static slices (a position
    embedding table longer than the sequence: only the rows read get a
    gradient, and XLA sums only those), else 1.
    """
    try:  # JAX's own dead-code elimination: a layer computed but never used reads nothing
        jaxpr, used = _compat.dce_jaxpr(jaxpr)
    except (ImportError, AttributeError, TypeError):  # pragma: no cover - a JAX without it
        used = [True] * len(jaxpr.invars)
    kept = iter(jaxpr.invars)  # the pruned jaxpr keeps only the inputs it reads, in order
    readers_of: dict[int, list[Any]] = {}  # by identity, as the equations hold them
    for reader, var in ((e, v) for e in jaxpr.eqns for v in e.invars):
        readers_of.setdefault(id(var), []).append(reader)
    fractions = []
    for invar in (next(kept) if is_used else None for is_used in used):
        readers = readers_of.get(id(invar), [])
        if invar is None:
            fractions.append(0.0)
        elif (
            readers
            and all(eqn.primitive.name in ("slice", "dynamic_slice") for eqn in readers)
            and invar not in jaxpr.outvars
        ):
            size = math.prod(invar.aval.shape) or 1
            fractions.append(max(math.prod(eqn.outvars[0].aval.shape) for eqn in readers) / size)
        else:
            fractions.append(1.0)
    return fractions


def _reshape_dim(before: tuple[int, ...], after: tuple[int, ...], dim: int, size: int) -> int | None:
    """The dimension of `after` whose blocks over `size` devices hold the same elements as `dim`'s."""
    prefix = math.prod(before[:dim])
    for index in range(len(after)):
        here = math.prod(after[:index])
        if here > prefix:
            return None
        if here == prefix and after[index] != 1:
            return index if after[index] % size == 0 and before[dim] % size == 0 else None
    return None
