"""Look-up tables over both axes in the plan without a budget, where their costs win.

The rule writer proposes a large look-up table vocab-parallel (its rows over
the model axis, `_embeddings`), and the costs (`_one_weight`) also offer it
split over both axes. Once the table's model-axis block is as large as what
the batch looks up on a device, XLA moves the ids and the looked-up rows
instead of the table (`OneWeightCosts._moved_rows`): no gradient all-reduce
over the batch axis, whose bytes grow with the vocabulary. There the split
over both axes can send fewer bytes than vocab-parallel *and* hold
`1/batch` of its state: keras-hub's own Gemma and Qwen maps split the table
over both axes, and the plan without a budget, the least traffic, takes such
a layout as soon as it costs no more bytes and no more state than the
proposal's (`no_budget_choice`). Where the batch's rows outweigh the table
(small vocabularies, large batches) vocab-parallel stays.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._candidates import Candidate

__all__ = ["no_budget_choice"]


def no_budget_choice(candidates: Sequence[Candidate], proposed: int) -> int:
    """The candidate the plan without a budget takes: `proposed`, or one that dominates it.

    A candidate dominates the proposal's when it sends no more bytes per
    step and holds no more state per device, and is smaller on one of the
    two; of those, the one sending the least (then holding the least).
    A proposal that keeps the table replicated (`proposed == 0`, the
    policy's small tables) is kept.

    Args:
        candidates: The unit's candidates, the replicated one first.
        proposed: The index of the proposal's own layout.

    Returns:
        The index of the candidate to take without a budget.
    """
    if proposed == 0:
        return proposed
    base = candidates[proposed]
    better = [
        index
        for index, option in enumerate(candidates)
        if option.total <= base.total
        and option.state <= base.state
        and (option.total, option.state) != (base.total, base.state)
    ]
    return min(better, key=lambda i: (candidates[i].total, candidates[i].state), default=proposed)
