"""Strategies that read the traced computation: units, final layers and the projections left alone.

- `traced_units`: the column → row pairs and attention heads `find_units`
  reads off the dataflow, whatever style wrote them;
- `final_layers`: a final projection as large as the largest kernel the plan
  splits (a language model's head) has its output features split, a smaller
  one stays whole;
- `beside_split`: a weight read beside an activation split over the model
  axis (a per-head bias added to split query heads) is split with it;
- `unused_weights`: a trainable weight the traced step never reads (an untied
  output embedding while a backbone is fine-tuned) is split over both axes:
  it gets no gradient, so that costs no traffic;
- `lone_projections`: every projection weight no unit took is noted as
  replicated, with the reason;
- `left_whole`: any weight still undecided (one a custom operation reads) is
  noted as replicated, naming the operations that read it.

Each does nothing without a trace (a subclassed model never called).
"""

from __future__ import annotations

import math
from typing import Any

from . import _notes
from ._grouped import must_stay_split
from ._grower import ELEMENTWISE
from ._layers import followers, idle_axes, stored_weight
from ._ledger import Ledger, Setting
from ._propagate import Specs
from ._trace import Trace
from ._units import find_added, find_units, unit_name

__all__ = ["beside_split", "final_layers", "left_whole", "lone_projections", "traced_units", "unused_weights"]


def traced_units(ledger: Ledger, setting: Setting) -> None:
    """Units read off the traced computation: column → row pairs and attention heads.

    A weight an earlier strategy decided (an attention layer split over its
    heads, grouped-query key/value projections kept whole) keeps that
    decision, and a unit that holds one is left whole.
    """
    if setting.trace is None:
        return
    variables = setting.variables
    # Followers take their weight's layout, not a unit's: a quantized layer's LoRA adapters, which
    # project its input beside it (`_lora`), and int8 scales (`_quantized`).
    follows = {weight.path for group in followers(setting.model).values() for weight, _ in group}
    for unit in find_units(setting.trace, setting.size):
        own = [m for m in unit.members if m.path not in follows]
        members = [(variables[m.path], m) for m in own if m.path in variables]
        if not members or len(members) != len(own) or any(ledger.decided(v.path) for v, _ in members):
            continue
        name = setting.display(unit.name if len(own) == len(unit.members) else unit_name(tuple(own)))
        kept = must_stay_split(setting, unit)
        reason = _whole_because(setting, members, name, kept)
        if reason is not None:
            for variable, _ in members:
                ledger.revise(variable.path, (None,) * len(variable.shape), reason)
            continue
        for variable, member in members:
            axes = tuple(setting.axis if i == member.dim else None for i in range(len(variable.shape)))
            note = _notes.traced(unit.kind, member.role, name)
            ledger.revise(variable.path, axes, note, unit=name, keep_split=kept)
        for path in unit.after:
            if path in variables and not ledger.decided(path):
                note = _notes.after_all_reduce(unit.kind, name)
                ledger.revise(path, (None,) * len(variables[path].shape), note)
        for path in unit.whole:
            if path in variables and not ledger.decided(path):
                note = _notes.traced_kv_whole(setting.axis, setting.size, name)
                ledger.revise(path, (None,) * len(variables[path].shape), note)
                ledger.whole_kv[path] = name


def _whole_because(setting: Setting, members: list[tuple[Any, Any]], name: str, kept: bool) -> str | None:
    """Why a traced unit stays whole (a split that does not divide, a kernel too small), or `None`.

    `kept`: the unit must stay split (`_grouped.must_stay_split`), however small its kernels.
    """
    for variable, member in members:
        if variable.shape[member.dim] % setting.size:
            return _notes.indivisible_pair(name, variable.shape[member.dim], setting.axis, setting.size)
    for variable, member in [] if kept else members:
        if member.role != "bias" and math.prod(variable.shape) < setting.replicate_below:
            label = setting.display(_weight_name(variable.path))
            return _notes.too_small(label, math.prod(variable.shape), setting.replicate_below)
    return None


def final_layers(ledger: Ledger, setting: Setting) -> None:
    """Final projections: size decides whether they split, not their position.

    A final layer whose kernel is at least as large as the largest kernel
    the plan splits (a language model's head over its vocabulary) has its
    output features split over the model axis like any unit: the loss
    reduces the split logits with a few small all-reduces, and its input
    gradient is all-reduced. A smaller one stays whole, so its output
    needs no gathering.
    """
    trace = setting.trace
    if trace is None:
        return
    variables = setting.variables
    largest = max((math.prod(variables[p].shape) for p in ledger.split_paths()), default=0)
    for path, uses in trace.uses.items():
        variable = variables.get(path)
        if variable is None or ledger.decided(path) or len(variable.shape) != 2 or len(uses) != 1:
            continue
        (use,) = uses
        output = trace.nodes[use.node].outputs[0]
        if use.kind != "matmul" or use.contracted != (0,) or not _reaches_output(trace, output):
            continue
        count = math.prod(variable.shape)
        biases = [variables[b] for b in find_added(trace, [output]) if b in variables]
        divides = not variable.shape[1] % setting.size
        if largest and count >= max(largest, setting.replicate_below) and divides:
            note = _notes.final_split(setting.display(_weight_name(path)), count, largest, setting.axis)
            unit = f"{setting.display(_weight_name(path))} (final layer)"
            ledger.revise(path, (None, setting.axis), note, unit=unit)
            ledger.final_units.add(unit)
            for bias in biases:
                if len(bias.shape) == 1 and not ledger.decided(bias.path):
                    ledger.revise(bias.path, (setting.axis,), note, unit=unit)
            continue
        note = _notes.final_replicated(count, largest)
        ledger.record(path, (None,) * 2, note)
        ledger.replicate(biases, note)


def unused_weights(ledger: Ledger, setting: Setting) -> None:
    """Splits the weights the step never reads (trainable or frozen) over the model and batch axes.

    Frozen weights count too (a LoRA model's unused reverse table, an int8
    model's, with its scale: `_quantized`): they cost memory on every device
    all the same, and nothing moves (an unread int8 reverse table split over
    both axes, its scale over 'model', sent nothing on keras-hub Llama, 2×4).
    Seed generators' counters are tiny and left alone.
    """
    if setting.trace is None:
        return
    sizes = ((setting.axis, setting.size), (setting.batch_axis, setting.batch_size))
    follow = followers(setting.model)
    following = {f.path for items in follow.values() for f, _ in items}
    for variable in setting.model.weights:
        if not (variable.trainable or stored_weight(variable, following)):
            continue
        # A trainable weight is read when the outputs depend on it; a frozen one, when anything reads it.
        trace = setting.trace
        read = variable.path in trace.read if variable.trainable else not trace.unread(variable.path)
        if ledger.decided(variable.path) or read:
            continue
        axes, shards = idle_axes(tuple(variable.shape), sizes)
        if shards > 1 and math.prod(variable.shape) >= max(setting.replicate_below, 1):
            ledger.record(variable.path, axes, _notes.unused(axes))


def lone_projections(ledger: Ledger, setting: Setting) -> None:
    """Notes the projection weights no unit took, in custom layers as in Keras ones."""
    trace = setting.trace
    if trace is None:
        return
    variables = setting.variables
    for path, uses in trace.uses.items():
        if ledger.decided(path) or path not in variables or any(u.kind != "matmul" for u in uses):
            continue
        final = any(_reaches_output(trace, trace.nodes[u.node].outputs[0]) for u in uses)
        note = _notes.FINAL_REPLICATED if final else _notes.NO_PARTNER
        ledger.record(path, (None,) * len(variables[path].shape), note)


def _reaches_output(trace: Trace, value: int) -> bool:
    """Whether `value` is a model output, a bias add, a cast or an int8 product's rescaling at most away.

    An int8 projection's integer product is cast, then divided by its input's and kernel's scales
    (keras-hub's int8 `ReversibleEmbedding` head: `convert`, `div` by a product of the two
    scales' broadcasts), each a lone reader.
    """
    for _ in range(6):
        if value in trace.outputs:
            return True
        readers = trace.consumers.get(value, ())
        if len(readers) != 1 or not _passes_on(trace, trace.nodes[readers[0]], value):
            return False
        value = trace.nodes[readers[0]].outputs[0]
    return value in trace.outputs


def _passes_on(trace: Trace, node: Any, value: int) -> bool:
    """Whether `node` carries `value` on as a final layer's output: a bias add, a cast, or a rescaling."""
    if node.primitive in ("add", "convert_element_type"):
        return True
    if node.primitive not in ("mul", "div") or node.inputs[:1] != (value,):
        return False
    return trace.dtypes.get(value, "") == "float32" and _rescales(trace, value)


def _rescales(trace: Trace, value: int) -> bool:
    """Whether `value` is an integer product, cast (and already rescaled) at most."""
    for _ in range(4):
        producer = trace.producer.get(value)
        if producer is None:
            return False
        node = trace.nodes[producer]
        if node.primitive == "dot_general":
            return not trace.dtypes.get(value, "float").startswith(("float", "bfloat"))
        if node.primitive not in ("convert_element_type", "mul", "div"):
            return False
        value = node.inputs[0]
    return False


def _weight_name(path: str) -> str:
    """A weight's readable name: its layer's path for `.../kernel`, else the path."""
    head, _, tail = path.rpartition("/")
    return head if head and tail in ("kernel", "embeddings") else path


def left_whole(ledger: Ledger, setting: Setting) -> None:
    """Notes every weight no strategy decided as replicated, with the operations that read it."""
    readers: dict[str, set[str]] = {}
    if setting.trace is not None:
        for value, path in setting.trace.variables.items():
            for index in setting.trace.consumers.get(value, ()):
                readers.setdefault(path, set()).add(setting.trace.nodes[index].primitive)
    for variable in setting.model.weights:
        if not ledger.decided(variable.path):
            ops = sorted(readers.get(variable.path, ()))
            ledger.record(variable.path, (None,) * len(variable.shape), _notes.left_whole(ops, setting.trace))


def beside_split(ledger: Ledger, setting: Setting) -> None:
    """Weights read beside an activation split over the model axis are split with it.

    A per-head bias added to split query heads (XLNet's content, position and
    segment biases, `(heads, head_dim)`), or a per-head table contracted with
    them over the heads as a batch dimension: XLA computes their gradients split
    like the activation and, were they whole, all-gathers each (with its
    optimizer slots) after every update. Split with the activation's unit, each
    device holds and updates its own heads and nothing moves for them.
    """
    trace = setting.trace
    if trace is None:
        return
    layouts = {path: ledger.axes(path) for path in setting.variables if ledger.decided(path)}
    sizes = {setting.axis: setting.size}
    if setting.batch_axis is not None:
        sizes[setting.batch_axis] = setting.batch_size
    specs = Specs(trace, layouts, sizes, setting.batch_axis)
    trainable = {v.path: v for v in setting.model.trainable_weights}
    for value, path in trace.variables.items():
        variable = trainable.get(path)
        if variable is None or ledger.decided(path) or len(variable.shape) < 2:
            continue
        found = _split_beside(trace, specs, ledger, value, setting.axis)
        if found is None or variable.shape[found[0]] % setting.size:
            continue
        dim, unit = found
        axes = tuple(setting.axis if i == dim else None for i in range(len(variable.shape)))
        ledger.record(path, axes, _notes.beside_split(setting.display(unit), setting.axis), unit=unit)


def _split_beside(
    trace: Trace, specs: Specs, ledger: Ledger, value: int, axis: str
) -> tuple[int, str] | None:
    """`(dimension, unit)`: where the activation that `value` meets is split over `axis`, and whose unit."""
    stack = [(value, tuple(range(len(trace.shapes[value]))))]
    while stack:
        current, dims = stack.pop()  # dims: per dimension of `current`, the weight's dimension (or -1)
        for index in trace.consumers.get(current, ()):
            node = trace.nodes[index]
            if node.primitive in ("convert_element_type", "copy"):
                stack.append((node.outputs[0], dims))
            elif node.primitive == "broadcast_in_dim":
                out = [-1] * len(trace.shapes[node.outputs[0]])
                for i, d in enumerate(node.params["broadcast_dimensions"]):
                    out[d] = dims[i]
                stack.append((node.outputs[0], tuple(out)))
            elif node.primitive == "reshape":
                out = _unit_dims(dims, trace.shapes[current], trace.shapes[node.outputs[0]])
                if out is not None:
                    stack.append((node.outputs[0], out))
            elif node.primitive in ELEMENTWISE or node.primitive == "dot_general":
                for other in node.inputs:
                    if other < 0 or other == current:
                        continue
                    found = _split_dim(trace, specs, ledger, node, current, other, dims, axis)
                    if found is not None:
                        return found
    return None


def _split_dim(
    trace: Trace, specs: Specs, ledger: Ledger, node: Any, mine: int, other: int, dims: tuple, axis: str
) -> tuple[int, str] | None:
    """The weight's dimension facing `other`'s split over `axis` at `node`, and the unit it comes from."""
    spec = specs.spec.get(other)
    if spec is None:
        return None
    if node.primitive == "dot_general":
        (_, _), (mine_batch, other_batch) = node.params["dimension_numbers"]
        if node.inputs[0] != mine:
            mine_batch, other_batch = other_batch, mine_batch
        pairs = zip(mine_batch, other_batch, strict=True)
    else:
        if len(trace.shapes[other]) != len(dims):
            return None
        pairs = ((d, d) for d, n in enumerate(trace.shapes[mine]) if n == trace.shapes[other][d])
    unit = _source_unit(trace, ledger, other)
    for mine_dim, other_dim in pairs:
        if axis in spec[other_dim] and dims[mine_dim] >= 0 and unit is not None:
            return dims[mine_dim], unit
    return None


def _source_unit(trace: Trace, ledger: Ledger, value: int, depth: int = 8) -> str | None:
    """The unit of the split kernel a projection reading it wrote `value` with, a few operations back."""
    for _ in range(depth):
        index = trace.producer.get(value)
        if index is None:
            return None
        node = trace.nodes[index]
        if node.primitive == "dot_general":
            for operand in node.inputs:
                weight = trace.weight_of(operand)
                if weight is not None and ledger.unit(weight[0]) is not None:
                    return ledger.unit(weight[0])
            return None
        if node.primitive not in ELEMENTWISE and node.primitive not in (
            "reshape",
            "transpose",
            "broadcast_in_dim",
        ):
            return None
        value = next((v for v in node.inputs if v >= 0 and v not in trace.variables), -1)
        if value < 0:
            return None
    return None


def _unit_dims(dims: tuple, shape: tuple, out: tuple) -> tuple | None:
    """`dims` carried through a reshape that only adds or drops dimensions of size 1, else `None`."""
    if [n for n in shape if n != 1] != [n for n in out if n != 1]:
        return None
    kept = iter(d for d, n in zip(dims, shape, strict=True) if n != 1)
    return tuple(next(kept) if n != 1 else -1 for n in out)
