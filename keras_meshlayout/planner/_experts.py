"""Strategy: expert parallelism, the expert dimension of mixture-of-experts weights split over one axis.

An expert bank is a layer holding two or more weights of rank 3 that share
their first dimension (the experts) and that the traced step reads only as
projections keeping that dimension: `th,ehm->etm` (each expert projects every
token) or `eti,eih->eth` (a batched einsum over the experts), as keras-hub's
Mixtral, QwenMoe, Qwen3Moe and GPT-OSS write them. With as many experts as
divide by the model axis, every weight of the bank (and a bias of the bank
with one row per expert) is split on its first dimension: each device runs
its own experts for the tokens it holds, and the weighted sum over the
experts becomes one all-reduce over the model axis forward (and one per
expert projection reading the block's input, plus one of the routing
weights' gradient, backward). No token moves between devices: the
routing is computed whole on every device, as the model computes it.

On a mesh with an axis named `expert` (`data × expert × model`), the banks are
split over it instead, and those all-reduces run over the expert axis; the
model axis is left to the attention and dense projections.
"""

from __future__ import annotations

from typing import Any

from . import _notes
from ._layers import owners
from ._ledger import Ledger, Setting

__all__ = ["EXPERT_AXIS", "expert_banks", "expert_counts"]

#: The mesh axis name that expert banks are split over when a mesh has it.
EXPERT_AXIS = "expert"


def expert_banks(ledger: Ledger, setting: Setting) -> None:
    """Splits every expert bank on its expert dimension, over the expert axis or else the model axis."""
    trace = setting.trace
    if trace is None:
        return
    axis, size = setting.axis, setting.size
    if setting.expert_axis is not None:
        axis, size = setting.expert_axis, setting.expert_size
    for owner, members, count in _banks(ledger, setting):
        unit = setting.display(owner.path)
        if count % size:
            ledger.replicate(members, _notes.experts_indivisible(unit, count, axis, size))
            continue
        for variable in members:
            axes = (axis,) + (None,) * (len(variable.shape) - 1)
            ledger.record(variable.path, axes, _notes.experts_split(unit, count, axis), unit=unit)
        ledger.expert_units.add(unit)
        ledger.expert_axis = setting.expert_axis


def expert_counts(model: Any, trace: Any) -> set[int]:
    """The expert counts of the model's expert banks (empty without one): what an expert axis divides."""
    setting = Setting(model, "", 1, 0, None, trace)
    return {count for _, _, count in _banks(Ledger(model.name, "", None), setting)}


def _banks(ledger: Ledger, setting: Setting) -> list[tuple[Any, list[Any], int]]:
    """Each undecided expert bank: its layer, its weights and biases, its expert count."""
    trace = setting.trace
    if trace is None:
        return []
    owner_of = owners(setting.model)
    banks: dict[int, list[Any]] = {}
    for variable in setting.model.weights:
        if not ledger.decided(variable.path) and _expert_weight(variable, trace.uses.get(variable.path, ())):
            banks.setdefault(id(owner_of.get(id(variable))), []).append(variable)
    found = []
    for weights in banks.values():
        experts = {int(v.shape[0]) for v in weights}
        if len(weights) < 2 or len(experts) != 1:
            continue
        (count,) = experts
        owner = owner_of[id(weights[0])]
        found.append((owner, weights + _bank_biases(owner, weights, count, trace, ledger), count))
    return found


def _expert_weight(variable: Any, uses: tuple) -> bool:
    """A rank-3 weight read only by projections that keep its first dimension (the experts)."""
    return (
        len(variable.shape) == 3
        and bool(uses)
        and all(u.kind == "matmul" and 0 not in u.contracted for u in uses)
        and bool(variable.trainable)
    )


def _bank_biases(owner: Any, weights: list[Any], count: int, trace: Any, ledger: Ledger) -> list[Any]:
    """The bank's other weights with one row per expert, read element-wise (biases)."""
    taken = {id(v) for v in weights}
    return [
        v
        for v in owner.weights
        if id(v) not in taken
        and len(v.shape) == 2
        and v.shape[0] == count
        and not ledger.decided(v.path)
        and not trace.uses.get(v.path)
    ]
