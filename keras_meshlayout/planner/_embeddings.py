"""Strategy: look-up tables split over their vocabulary (vocab-parallel), Megatron's embedding.

A table read by one look-up (`lookup_table`: a Keras `Embedding`, keras-hub's
`ReversibleEmbedding`, a custom layer's weight read by one `take`) with at
least `replicate_below` entries and rows that divide by the model axis has
its rows split over it: each device looks up the ids that fall in its rows
(zeros for the others) and one all-reduce over the model axis sums the
looked-up vectors forward; its gradient stays local to the rows, all-reduced
over the batch axis at 1/model of the table's size. Smaller tables, tables
that do not divide are left to the later strategies (by name).

A tied table (`tied_tables`: looked up, and read again as the language-model
head, `x @ table.T`, as Gemma, Qwen and GPT-2 causal models do) is split the
same way: the look-up is all-reduced forward as above, the head's logits stay
split over the vocabulary like a final layer's (the loss reduces them with
small all-reduces), and the head's input gradient is all-reduced backward. So
is a shared table, looked up more than once (the one table of an
encoder-decoder's two sides: T5, BART), with or without a head: each look-up
all-reduced forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from . import _notes
from ._layers import lookup_table, owners, tied_table
from ._ledger import Ledger, Setting

__all__ = ["tied_tables", "vocab_parallel_tables"]


def vocab_parallel_tables(ledger: Ledger, setting: Setting) -> None:
    """Splits every large look-up table's rows over the model axis."""
    _split_rows(ledger, setting, lookup_table, _vocab_note)


def _vocab_note(rows: int, width: int, axis: str, uses: tuple) -> str:
    return _notes.vocab_parallel(rows, width, axis)


def tied_tables(ledger: Ledger, setting: Setting) -> None:
    """Splits every large tied or shared table's rows (look-ups, language-model heads) over the model axis."""
    _split_rows(ledger, setting, tied_table, _tied_note)


def _tied_note(rows: int, width: int, axis: str, uses: tuple) -> str:
    lookups = sum(1 for use in uses if use.kind == "gather")
    return _notes.tied_vocab_parallel(rows, width, axis, lookups, len(uses) - lookups)


def _split_rows(
    ledger: Ledger, setting: Setting, is_table: Callable[..., bool], note: Callable[..., str]
) -> None:
    """Records the rows of every undecided variable `is_table` takes, from `replicate_below` up, split."""
    trace = setting.trace
    if trace is None:
        return
    owner_of = owners(setting.model)
    for variable in setting.model.weights:
        uses = trace.uses.get(variable.path, ())
        if ledger.decided(variable.path) or not is_table(
            owner_of.get(id(variable)), variable, uses, setting.size
        ):
            continue
        if math.prod(variable.shape) < max(setting.replicate_below, 1):
            continue
        rows, width = variable.shape
        ledger.record(variable.path, (setting.axis, None), note(rows, width, setting.axis, uses))
