"""Strategy: expert parallelism, the expert dimension of mixture-of-experts weights split over the model axis.

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
"""

from __future__ import annotations

from typing import Any

from . import _notes
from ._layers import owners
from ._ledger import Ledger, Setting

__all__ = ["expert_banks"]


def expert_banks(ledger: Ledger, setting: Setting) -> None:
    """Splits every expert bank over the model axis on its expert dimension."""
    trace = setting.trace
    if trace is None:
        return
    owner_of = owners(setting.model)
    banks: dict[int, list[Any]] = {}
    for variable in setting.model.weights:
        if not ledger.decided(variable.path) and _expert_weight(variable, trace.uses.get(variable.path, ())):
            banks.setdefault(id(owner_of.get(id(variable))), []).append(variable)
    for weights in banks.values():
        experts = {int(v.shape[0]) for v in weights}
        if len(weights) < 2 or len(experts) != 1:
            continue
        (count,) = experts
        owner = owner_of[id(weights[0])]
        members = weights + _bank_biases(owner, weights, count, trace, ledger)
        unit = setting.display(owner.path)
        if count % setting.size:
            ledger.replicate(members, _notes.experts_indivisible(unit, count, setting.axis, setting.size))
            continue
        for variable in members:
            axes = (setting.axis,) + (None,) * (len(variable.shape) - 1)
            ledger.record(variable.path, axes, _notes.experts_split(unit, count, setting.axis), unit=unit)
        ledger.expert_units.add(unit)


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
