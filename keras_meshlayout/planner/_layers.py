"""Reading Keras layers: which kernel dimension holds attention heads, a projection's features.

Shared by the rule writer (`_auto`) and the costs (`_costs`); it imports no
other planner module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras

from .. import _compat
from ..core._axes import Axes
from ._unpacking import lora_parts

__all__ = [
    "Packing",
    "auto_named",
    "features",
    "followers",
    "head_dim_index",
    "heads_dim",
    "idle_axes",
    "int4_shape",
    "kernel_scale_axes",
    "kv_head_count",
    "labels",
    "lookup_table",
    "lora_axes",
    "owners",
    "packed_axes",
    "quantized_weights",
    "stored_weight",
    "tied_table",
]


def heads_dim(layer: Any) -> tuple[int, str] | None:
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


def head_dim_index(
    owner: Any,
    variable: Any,
    uses: tuple,
    size: int,
    whole_outputs: Any,
    with_bias: bool = False,
    kv_heads: Mapping[str, int] | None = None,
) -> int | None:
    """The head_dim of a grouped-query key/value kernel kept whole, when it can split `size` ways.

    The kernel of an `EinsumDense` projecting into heads (`(hidden, kv_heads,
    head_dim)` or `(kv_heads, hidden, head_dim)`), or of a `Dense` one whose
    output features hold the heads one after another (`(hidden, kv_heads ×
    head_dim)`, named in `kv_heads`: its head count by layer path), without a
    bias unless `with_bias`, not quantized (an int8 kernel split on head_dim
    sent 21% more over the model axis than predicted on keras-hub Llama: not
    offered), whose output the rules keep whole (`whole_outputs`: its heads
    do not divide the model axis), read only by projections that all sum over
    the same dimensions: the index of the dimension neither summed over nor
    holding the heads (a `Dense` kernel's output features, heads and head_dim
    together), if it divides by `size`; else `None`. Where this was measured,
    and what is not offered, is in `_kv_costs.KeyValueCosts._head_dim_unit`.
    """
    heads = _kv_heads_dim(owner, variable, kv_heads or {})
    if (
        heads is None
        or getattr(owner, "path", None) not in whole_outputs
        or getattr(getattr(owner, "kernel", None), "path", None) != variable.path
        or size <= 1
        or (getattr(owner, "bias", None) is not None and not with_bias)
        or getattr(owner, "quantization_mode", None) is not None
    ):
        return None
    matmuls = [use for use in uses if use.kind == "matmul"]
    if (
        not matmuls
        or len(matmuls) != len(uses)
        or any(use.batch or use.contracted != matmuls[0].contracted for use in matmuls)
    ):
        return None
    rank = len(variable.shape)
    free = [i for i in range(rank) if i not in matmuls[0].contracted and (i != heads or rank == 2)]
    if len(free) != 1 or variable.shape[free[0]] % size:
        return None
    return free[0]


def kv_head_count(owner: Any, variable: Any, kv_heads: Mapping[str, int]) -> int:
    """The key/value heads of a kernel `head_dim_index` splits: from its einsum, or `kv_heads`."""
    if len(variable.shape) == 2:
        return kv_heads[owner.path]
    return variable.shape[heads_dim(owner)[0]]


def _kv_heads_dim(owner: Any, variable: Any, kv_heads: Mapping[str, int]) -> int | None:
    """The kernel dimension holding a key/value projection's heads (a `Dense` kernel's output), or `None`."""
    heads = heads_dim(owner)
    if heads is not None:
        return heads[0] if heads[1] == "in" and len(variable.shape) == 3 else None
    if features(owner) is not None and getattr(owner, "path", None) in kv_heads and len(variable.shape) == 2:
        return 1
    return None


def labels(layer: Any, variable: Any) -> str:
    """The einsum labels of an EinsumDense variable's dimensions."""
    if variable.path == layer.kernel.path:  # an int4 kernel's `Int4Kernel` stands for the variable
        return layer.equation.split(",")[1].split("->")[0]
    bias_axes = getattr(layer, "bias_axes", None) or ""
    return bias_axes if len(bias_axes) == len(variable.shape) else ""


def features(layer: Any) -> tuple[int, int] | None:
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


def lookup_table(owner: Any, variable: Any, uses: tuple, size: int) -> bool:
    """Whether `variable` is a look-up table the vocabulary of which can split `size` ways.

    A Keras `Embedding`'s table (keras-hub's `ReversibleEmbedding` too), or a
    custom layer's 2-D float weight (trainable or frozen: LoRA; an int8 one: `quantize("int8")`), read by
    exactly one look-up
    (`gather`) and nothing else, whose rows divide by `size`. Keras and
    keras-hub weights other than an `Embedding`'s table (relative position
    biases) are not tables here; a table also read by a projection (a tied
    language-model head) is not either.
    """
    if isinstance(owner, keras.layers.Embedding):
        if variable.path != owner.embeddings.path:  # an int4 table: its `Int4Kernel`
            return False
    elif owner is None or type(owner).__module__.startswith(("keras.", "keras_hub.")):
        return False
    return (
        len(uses) == 1
        and uses[0].kind == "gather"
        and len(variable.shape) == 2
        and variable.shape[0] % size == 0
        and (bool(variable.trainable) or "float" in str(variable.dtype) or str(variable.dtype) == "int8")
    )


def tied_table(owner: Any, variable: Any, uses: tuple, size: int) -> bool:
    """Whether `variable` is a tied or shared table, read more than once, splitting `size` ways.

    A Keras `Embedding`'s table (keras-hub's `ReversibleEmbedding` with
    `tie_weights=True` too), or a custom layer's trainable 2-D weight, read by
    one look-up (`gather`) or more (an encoder-decoder's one table for both
    sides: T5, BART) and by any number of projections that sum over its width
    (`x @ table.T`, a tied language-model head: the logits keep the
    vocabulary), at least two reads in all, whose rows divide by `size`.
    """
    if isinstance(owner, keras.layers.Embedding):
        if variable.path != owner.embeddings.path:  # an int4 table: its `Int4Kernel`
            return False
    elif owner is None or type(owner).__module__.startswith(("keras.", "keras_hub.")):
        return False
    gathers = [u for u in uses if u.kind == "gather"]
    heads = [u for u in uses if u.kind == "matmul" and u.contracted == (1,) and not u.batch]
    return (
        len(gathers) >= 1
        and len(gathers) + len(heads) == len(uses) >= 2
        and len(variable.shape) == 2
        and variable.shape[0] % size == 0
    )


def stored_weight(variable: Any, followers: Any = ()) -> bool:
    """Whether a non-trainable variable is a frozen matrix of values (float or int8), not a counter or seed.

    A weight that follows another's layout (`followers`: an int8 scale, a
    LoRA adapter, by path) is never one: it is laid out with its weight.
    """
    dtype = str(variable.dtype)
    stored = "float" in dtype or dtype == "int8"
    return stored and len(variable.shape) >= 2 and variable.path not in followers


#: Follow = how a follower's axes derive from its weight's (`None`: it cannot follow them).
Follow = Callable[[tuple], "tuple | None"]


def quantized_weights(layer: Any) -> list[tuple[Any, Any, Follow]]:
    """`(quantized weight, a weight of its quantization, how that one's axes follow the weight's)`.

    Read from Keras's own list of what a quantized layer stores
    (`variable_serialization_spec`). int8 (`quantize("int8")`): `kernel` and
    `kernel_scale`, `embeddings` and `embeddings_scale`, `reverse_embeddings`
    and its scale. A kernel's scale runs along its output features
    (`kernel_scale_axes`), a look-up table's along its rows (one scale per
    row), a reverse table's along its last dimension (the logits it computes).
    int4 (`quantize("int4")`): a kernel stored `(rows, ceil(columns / 2))` has a
    scale and a zero point per column, `(columns,)` or per group of rows
    `(groups, columns)`, laid out with its columns, and its rows' group
    indices `g_idx`, with its rows; a table's scale and zero point run along
    its rows.
    """
    mode = getattr(layer, "quantization_mode", None)
    spec = (getattr(layer, "variable_serialization_spec", None) or {}).get(mode, ())
    own = {variable.name: variable for variable in _compat.own_variables(layer)}
    if mode == "int4":
        return _int4_weights(layer, own, spec)
    if mode != "int8":
        return []
    found = []
    for name in spec:
        weight, scale = own.get(name), getattr(layer, f"{name}_scale", None)
        if weight is None or scale is None or str(weight.dtype) != "int8" or f"{name}_scale" not in spec:
            continue
        if name == "kernel":
            follow: Follow = functools.partial(kernel_scale_axes, layer, scale)
        elif len(scale.shape) == 1 and len(weight.shape) == 2:
            dim = 0 if isinstance(layer, keras.layers.Embedding) and name == "embeddings" else 1
            follow = functools.partial(_one_dim, dim)
        else:
            continue
        found.append((weight, scale, follow))
    return found


def _int4_weights(layer: Any, own: Mapping[str, Any], spec: Sequence[str]) -> list[tuple[Any, Any, Follow]]:
    found = []
    for name, along in (("kernel", 1), ("embeddings", 0)):
        weight = own.get(name)
        if weight is None or name not in spec or len(weight.shape) != 2:
            continue
        for suffix in ("_scale", "_zero"):
            other = own.get(f"{name}{suffix}")
            if other is not None and 1 <= len(other.shape) <= 2:
                # `(columns,)` / `(groups, columns)` with a kernel's columns; `(rows, ...)` with a table's.
                last = len(other.shape) - 1 if along == 1 else 0
                found.append((weight, other, functools.partial(_at, last, len(other.shape), along)))
        groups = own.get("g_idx") if name == "kernel" else None
        if groups is not None and len(groups.shape) == 1:
            found.append((weight, groups, functools.partial(_at, 0, 1, 0)))
    return found


def _at(dim: int, rank: int, source: int, axes: tuple) -> tuple:
    """Axes of rank `rank` whose dimension `dim` takes the weight's axes on its dimension `source`."""
    return tuple(axes[source] if d == dim else None for d in range(rank))


def int4_shape(layer: Any) -> tuple[int, ...] | None:
    """The float shape of an int4 layer's packed weight (`Int4Kernel`), or `None`."""
    if getattr(layer, "quantization_mode", None) != "int4":
        return None
    if isinstance(layer, keras.layers.EinsumDense):
        shape = getattr(layer, "original_kernel_shape", None)
        return None if shape is None else tuple(shape)
    if isinstance(layer, keras.layers.Dense):
        return (int(_compat.stored_weight(layer, "kernel").shape[0]), int(layer.units))
    if isinstance(layer, keras.layers.Embedding):
        return (int(layer.input_dim), int(layer.output_dim))
    return None


@dataclasses.dataclass(frozen=True)
class Packing:
    """How an int4 `EinsumDense` kernel is stored: its float kernel reshaped, row-major, to `(rows, columns)`.

    Called with the float kernel's axes, the stored kernel's (`Ledger.packed`), or `None`.
    """

    shape: tuple[int, ...]  # the float kernel's
    rows: int  # the stored rows: the product of the sizes of the dimensions the layer sums over

    @property
    def columns_start(self) -> int | None:
        """The float dimension the stored columns start with (its split splits them), or `None`."""
        return next((d for d in range(1, len(self.shape)) if math.prod(self.shape[:d]) == self.rows), None)

    def __call__(self, axes: Axes) -> Axes | None:
        axes, start = tuple(axes), self.columns_start
        if any(a is not None for d, a in enumerate(axes) if d not in (0, start)):
            return None
        return (axes[0], None if start is None else axes[start])

    def unpacked(self, axes: Axes) -> Axes:
        """The float kernel's axes given the stored kernel's: the first dimension of each it merges."""
        start = self.columns_start
        return tuple(axes[0] if d == 0 else axes[1] if d == start else None for d in range(len(self.shape)))


def packed_axes(model: Any) -> dict[str, Packing]:
    """Per int4 `EinsumDense` kernel, how its float kernel's axes are the stored kernel's.

    Keras stores it as `(rows, ceil(columns / 2))`, `rows` the product of the sizes of the
    dimensions the layer sums over, and dequantizes it with a plain reshape to the float shape.
    So a split of the float kernel's first dimension splits the stored rows, and one of the
    dimension the last `columns` elements start with splits the columns: `btd,dnh->btnh`'s
    `(d, n × h)` rows its `d`, columns its heads `n`; Gemma's `btd,ndh->btnh`, `(n, d, h)` stored
    as `(d, n × h)` elements, rows its heads `n` (each head's `d × h` block is `d / 4` rows of
    `4 h`) and no columns. No other split (a key/value kernel's head_dim) survives the reshape.
    """
    found = {}
    for layer in _compat.sublayers(model):
        shape, stored = int4_shape(layer), _compat.stored_weight(layer, "kernel")
        if shape is None or stored is None or len(stored.shape) == len(shape):
            continue
        inputs, rest = layer.equation.split(",")
        kernel, output = rest.split("->")
        summed = {label for label in kernel if label in inputs and label not in output}
        rows = math.prod(d for label, d in zip(kernel, shape, strict=True) if label in summed)
        if rows == stored.shape[0] and len(shape) > 1:
            found[stored.path] = Packing(tuple(shape), rows)
    return found


def _one_dim(dim: int, axes: tuple) -> tuple:
    return (axes[dim],)


def kernel_scale_axes(layer: Any, scale: Any, kernel_axes: tuple) -> tuple | None:
    """The axes of an int8 kernel's scale given its kernel's, or `None` when unreadable.

    `(units,)` for a `Dense`: its output features; for an `EinsumDense`, the
    output's shape with 1 for every dimension the kernel lacks
    (`(1, 1, heads, head_dim)` for `btd,dnh->btnh`): the kernel's axis on
    each output dimension it shares with the kernel.
    """
    if isinstance(layer, keras.layers.Dense) and len(scale.shape) == 1 and len(kernel_axes) == 2:
        return (kernel_axes[1],)
    equation = getattr(layer, "equation", None)
    if not equation or "->" not in equation or "," not in equation:
        return None
    kernel, output = equation.split(",")[1].split("->")
    if len(output) != len(scale.shape) or len(kernel) != len(kernel_axes):
        return None
    axes = []
    for label, size in zip(output, scale.shape, strict=True):
        where = kernel.find(label)
        axes.append(kernel_axes[where] if where >= 0 and size > 1 else None)
    return tuple(axes)


def lora_axes(base_axes: tuple, which: str) -> tuple:
    """A LoRA adapter's axes given its base kernel's: `a` its axes but the last, `b` the last one.

    So `a @ b` comes out split as the kernel is and adds without moving anything.
    """
    return (*base_axes[:-1], None) if which == "a" else (None, base_axes[-1])


def followers(model: keras.Model) -> dict[str, tuple[tuple[Any, Follow], ...]]:
    """The weights laid out as another one, by that one's path: LoRA adapters, int8 scales.

    Each with how its axes follow the weight's (`lora_axes`, `quantized_weights`).
    """
    found: dict[str, list[tuple[Any, Follow]]] = {}
    packing = packed_axes(model)  # an int4 base is stored flattened: its adapters follow its float axes
    for layer in _compat.sublayers(model):
        parts = lora_parts(layer) if getattr(layer, "lora_kernel_a", None) is not None else None
        if parts is not None:
            base, a, b = parts
            unpacked = packing[base.path].unpacked if base.path in packing else tuple
            found.setdefault(base.path, []).extend(
                [
                    (a, lambda axes, f=unpacked: lora_axes(f(axes), "a")),
                    (b, lambda axes, f=unpacked: lora_axes(f(axes), "b")),
                ]
            )
        for weight, scale, follow in quantized_weights(layer):
            found.setdefault(weight.path, []).append((scale, follow))
    return {path: tuple(items) for path, items in found.items()}


def idle_axes(shape: tuple[int, ...], axes_and_sizes: tuple[tuple[str | None, int], ...]) -> tuple:
    """How a weight the step never reads is split: each axis in turn on the largest dimension it divides.

    `((axes), shards)`; `shards == 1` when no axis divides any dimension.
    """
    dims = sorted(range(len(shape)), key=lambda i: -shape[i])
    axes: list[str | None] = [None] * len(shape)
    shards = 1
    for axis, size in axes_and_sizes:
        free = [i for i in dims if axes[i] is None and size > 1 and shape[i] % size == 0]
        if axis is not None and free:
            axes[free[0]] = axis
            shards *= size
    return tuple(axes), shards


def owners(model: keras.Model) -> dict[int, Any]:
    """The layer that created each variable of `model`, by the variable's `id`."""
    found = {}
    for layer in _compat.sublayers(model):
        for variable in _compat.own_variables(layer):
            found[id(variable)] = layer
    return found


def auto_named(model: keras.Model) -> frozenset[str]:
    """The paths of `model`'s layers whose names Keras generated (`dense`, `mixtral_sparse_moe_block_2`).

    A layer built without `name=` is named after its class in snake case,
    numbered from the second one on in the session; a model rebuilt in the
    same session gets other numbers, so rules must not pin them.
    """
    found = set()
    for layer in _compat.sublayers(model):
        path = getattr(layer, "path", None)
        if path and re.fullmatch(re.escape(_snake_case(type(layer).__name__)) + r"(?:_\d+)?", layer.name):
            found.add(path)
    return frozenset(found)


def _snake_case(name: str) -> str:
    """`MixtralSparseMoeBlock` → `mixtral_sparse_moe_block`, `GRU` → `gru`, as Keras names layers."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()
