"""Every note the rule writer puts on a rule, in one place.

A note says why a variable has its layout; users read it in
`dist.plan(model)` and in the `keras-meshlayout plan` table, and tests and
docs quote it, so its wording is part of the behaviour. The strategies
(`_by_layers`, `_by_name`, `_by_trace`) only ever call these functions.
"""

from __future__ import annotations

__all__: list[str] = []

# -- attention --------------------------------------------------------------------------

NOT_A_HEAD_PROJECTION = "attention: not a projection over heads"
ATTENTION_OUTPUT = "attention output: heads split on its input side; one all-reduce each way"
ATTENTION_OUTPUT_BIAS = "attention output bias: added after the all-reduce"
KV_OUTPUT_WHOLE = "grouped-query attention: key/value output kept whole over the model axis"


def heads_split(layer: str, count: int, head_dim: int | None = None) -> str:
    """A query/key/value projection split over its heads."""
    if head_dim is None:
        return f"attention {layer}: heads split ({count} heads)"
    return f"attention {layer}: heads split ({count} heads of {head_dim}, output features)"


def kv_heads_replicated(count: int, axis: str, size: int) -> str:
    """Grouped-query key/value heads too few to divide the model axis."""
    return (
        f"grouped-query attention: {count} key/value heads do not divide by "
        f"{axis!r} ({size}), so every device keeps them all"
    )


#: What `kv_head_dim_split` says of the kernel: the peak walk (`_peak.plan_peak`) reads it off a plan's rules.
KV_GATHERED = "gathered once per step; its output stays whole"


def kv_head_dim_split(count: int, head_dim: int, axis: str, size: int, dense: bool = False) -> str:
    """Grouped-query key/value heads too few to divide the model axis: the kernel split on head_dim.

    A `dense` kernel (`(hidden, heads × head_dim)`) has its output features split, heads and head_dim
    together (`head_dim` is then the width of all of them).
    """
    what = f"head_dim ({head_dim}) is"
    if dense:
        what = f"output features ({count} heads × {head_dim // count}) are"
    return (
        f"grouped-query attention: {count} key/value heads do not divide by {axis!r} ({size}), so the "
        f"kernel's {what} split over it, {KV_GATHERED}"
    )


#: What a table split over both axes whose looked-up rows move says of its gradient
#: (`_tables_2d.BothAxesTables._moved_rows`): the peak walk (`_peak.plan_peak`) reads it off a plan's rules.
ROWS_MOVED = "no gradient all-reduce"


def heads_indivisible(heads: int, axis: str, size: int) -> str:
    return f"attention replicated: {heads} heads do not divide by {axis!r} ({size})"


def heads_unknown(block: str) -> str:
    return f"attention {block}: its head count is unknown, so replicated"


def no_output_projection(block: str) -> str:
    return f"attention {block}: no output projection beside it, so replicated"


def fused_heads(block: str, shape: tuple[int, ...]) -> str:
    return (
        f"attention {block}: a fused query/key/value kernel of shape {shape} holds its heads inside "
        "one feature axis, so a split would cut across query, key and value: replicated"
    )


def not_whole_heads_of_query(block: str, width: int, heads: int) -> str:
    return f"attention {block}: {width} query features do not make {heads} heads"


def not_whole_heads(width: int, head_dim: int) -> str:
    return f"attention: {width} features are not whole heads of {head_dim}"


def unreadable_projection(block: str, layer: str, shape: tuple[int, ...]) -> str:
    return (
        f"attention {block}: {layer} of kernel shape {shape} is not a projection over heads the "
        "planner can read"
    )


def traced_kv_whole(axis: str, size: int, unit: str) -> str:
    return (
        f"grouped-query attention: key/value heads too few to divide by {axis!r} "
        f"({size}); kept whole beside the split query heads of {unit}"
    )


# -- projection pairs ---------------------------------------------------------------------


def column(pair: str) -> str:
    return f"column-parallel: {pair}, output features split"


def row(pair: str) -> str:
    return f"row-parallel: {pair}, input features split; one all-reduce forward, one backward"


def row_bias(pair: str) -> str:
    return f"row-parallel: {pair}, bias added after the all-reduce"


def traced(kind: str, role: str, name: str) -> str:
    """The note of a weight in a unit found in the traced computation."""
    if role == "grouped":
        return (
            f"grouped conv inside {name}: channels split with its input; each device convolves its own "
            "channels, so XLA computes its kernel gradient right"
        )
    if kind == "attention":
        if role == "row":
            return f"attention output: {name}, heads split on its input side; one all-reduce each way"
        return f"attention {name}: heads split (output features)"
    return row(name) if role == "row" else column(name)


def beside_split(unit: str, axis: str) -> str:
    """A weight read beside an activation split over `axis` (a per-head bias of split query heads)."""
    return f"read beside {unit}'s activations split over {axis!r}: split with them"


def after_all_reduce(kind: str, name: str) -> str:
    """A bias added to a unit's all-reduced output."""
    after = "row-parallel" if kind == "pair" else "attention output"
    return f"{after}: {name}, bias added after the all-reduce"


def indivisible_pair(pair: str, width: int, axis: str, size: int) -> str:
    return f"pair {pair}: {width} features do not divide by {axis!r} ({size})"


def too_small(name: str, count: int, replicate_below: int) -> str:
    return f"too small to split: {name} has {count} weights < replicate_below={replicate_below}"


def small_matrix(note: str, count: int, replicate_below: int) -> str:
    """A split a strategy chose for a weight matrix the policy keeps whole."""
    return f"{note}; kept whole: {count:,} elements < replicate_below={replicate_below:,}"


FINAL_REPLICATED = "final layer: replicated, so its output needs no gathering"
NO_PARTNER = "no row-parallel partner follows: replicated, so no activation has to be gathered"


def final_replicated(count: int, largest: int) -> str:
    """A final projection smaller than the largest split kernel."""
    why = (
        f"{count:,} weights, fewer than the {largest:,} of the largest split kernel"
        if largest
        else "the plan splits no other kernel"
    )
    return f"{FINAL_REPLICATED} ({why})"


def final_split(name: str, count: int, largest: int, axis: str) -> str:
    """A final projection as large as the largest split kernel: its output features split."""
    return (
        f"final layer {name}, vocab-parallel: {count:,} weights, at least the {largest:,} of "
        f"the largest split kernel, so its output features split over {axis!r}; the loss "
        "reduces the split outputs with small all-reduces, its input gradient is all-reduced"
    )


# -- look-up tables ----------------------------------------------------------------------


def vocab_parallel(rows: int, width: int, axis: str) -> str:
    """A look-up table split over its vocabulary."""
    return (
        f"embedding, vocab-parallel: {rows:,} rows of {width} split over {axis!r}; each device looks up "
        "its rows, one all-reduce of the looked-up vectors forward"
    )


# -- tied tables (look-up and language-model head) ------------------------------------------


def tied_vocab_parallel(rows: int, width: int, axis: str, lookups: int = 1, heads: int = 1) -> str:
    """A tied or shared table (looked up, and read again) split over its vocabulary."""
    if heads and lookups == 1:
        return (
            f"tied embedding, vocab-parallel: {rows:,} rows of {width} split over {axis!r}; the look-up is "
            "all-reduced forward, the head's logits stay split (the loss reduces them with small "
            "all-reduces) and its input gradient is all-reduced"
        )
    read = f"{lookups} look-ups" + (f" and {heads} head{'s' if heads > 1 else ''}" if heads else "")
    head = (
        "; the head's logits stay split (the loss reduces them with small all-reduces) and its input "
        "gradient is all-reduced"
        if heads
        else ""
    )
    return (
        f"shared embedding, vocab-parallel: {rows:,} rows of {width} split over {axis!r}, read by {read}; "
        f"each look-up is all-reduced forward{head}"
    )


# -- LoRA adapters ----------------------------------------------------------------------


def lora(layer: str, which: str, axes: tuple) -> str:
    """A LoRA adapter laid out as its base kernel."""
    split = " and ".join(repr(a) for a in axes if a is not None)
    how = f"split over {split}" if split else "whole"
    return (
        f"LoRA adapter {which} of {layer}: {how}, following its base kernel's split, so a @ b adds in place"
    )


def fully_sharded(batch_axis: str, how: str) -> str:
    """A weight outside every unit split over the batch axis (`_one_weight`'s fully sharded candidate)."""
    return f"split over {batch_axis!r}, {how}; its gradient reduced over it"


def fully_sharded_over_both(shards: int, batch_axis: str, model_axis: str, when: str) -> str:
    """The same weight split over the batch and model axes together."""
    return (
        f"split {shards} ways over {batch_axis!r} and {model_axis!r}, gathered over "
        f"both {when}; its gradient reduced over {batch_axis!r}"
    )


def lora_sharded(batch_axis: str, model_axis: str, shards: int) -> str:
    """A LoRA adapter `a` split further than its head_dim-split kernel, gathered where used."""
    return (
        f"LoRA adapter a split {shards} ways, its input dimension over {batch_axis!r} and its rank over "
        f"{model_axis!r}: gathered for a @ b (over {model_axis!r} forward and backward, over "
        f"{batch_axis!r} forward), its gradient reduced over {model_axis!r}"
    )


# -- int8 weights' scales ------------------------------------------------------------------


_SCALED = {"kernel": "its kernel's output features", "embeddings": "its table's rows"}


def int8_scale(layer: str, axes: tuple, weight: str = "kernel", scale: str = "", mode: str = "int8") -> str:
    """A quantized weight's scale laid out with its kernel's output features, its table's rows, its logits;
    an int4 kernel's zero points with its columns and its rows' group indices (`g_idx`) with its rows."""
    split = " and ".join(repr(a) for a in axes if a is not None)
    how = f"split over {split}" if split else "whole"
    if mode == "int4":
        what = "group indices" if scale == "g_idx" else "zero points" if scale.endswith("_zero") else "scale"
        along = "rows" if scale == "g_idx" or weight == "embeddings" else "columns"
        return f"int4 {what} of {layer}: {how}, as its {weight}'s {along}, so each device dequantizes its own"
    scaled = _SCALED.get(weight, f"its {weight}' logits")
    return f"int8 scale of {layer}: {how}, as {scaled}, so each device scales its own"


def int4_whole(note: str) -> str:
    """An int4 kernel kept whole: its float kernel's split runs along a dimension its packing merges."""
    return (
        f"whole: {note}, but Keras stores this int4 kernel flattened to 2-D, and the split dimension "
        "is not the first of those it merges"
    )


# -- experts ----------------------------------------------------------------------------


def experts_split(bank: str, count: int, axis: str) -> str:
    """A weight of an expert bank split on its expert dimension."""
    return (
        f"expert-parallel: {bank}, {count} experts split over {axis!r}; each device runs its experts, "
        "their weighted sum is all-reduced forward"
    )


def experts_indivisible(bank: str, count: int, axis: str, size: int) -> str:
    return f"experts {bank}: {count} experts do not divide by {axis!r} ({size}), replicated"


# -- convolutions ------------------------------------------------------------------------


def conv(role: str, unit: str, axis: str) -> str:
    """A weight of a convolution unit (`_convs`), split over the channels."""
    if role == "column":
        return f"conv output channels split over {axis!r}: {unit}"
    if role == "row":
        return f"conv input channels split over {axis!r}: {unit}; its output all-reduced forward"
    if role == "grouped":
        return (
            f"grouped conv, channels split over {axis!r} with its input: {unit}; each device convolves "
            "its own channels, so XLA computes its kernel gradient right"
        )
    return f"channels split over {axis!r} with the convolution before: {unit}"


def conv_lone(kernel: str, axis: str) -> str:
    return (
        f"conv input channels split over {axis!r}, no unit: {kernel} convolves each device's slice of its "
        "input; its output all-reduced forward, its input gradient gathered backward"
    )


def conv_lone_assembled(kernel: str, axis: str, how: str) -> str:
    if how == "concatenate":
        return (
            f"replicated: {kernel} reads a concatenation of feature maps; split on its input channels over "
            f"{axis!r}, XLA would carry the split back into every map the concatenation joins and reshuffle "
            "them each step (all-to-alls and permutes)"
        )
    return (
        f"replicated: {kernel} reads a token sequence laid out as an image; split on its input channels "
        f"over {axis!r}, XLA would carry the split back through the stage's residual stream and gather it "
        "for every projection reading it"
    )


def conv_grouped_lone(kernel: str, axis: str) -> str:
    return (
        f"grouped conv, channels split over {axis!r}, no unit: {kernel}; XLA splits the values around it "
        "alike and computes its kernel gradient right (its channels whole, XLA sums it over the whole mesh)"
    )


def conv_grouped_batch(layer: str, kernel: str, axes: tuple[str, ...]) -> str:
    over = " × ".join(axes)
    return (
        f"grouped conv, channels whole: {layer}'s output split over the batch on {over}, so XLA sums "
        f"{kernel}'s gradient over the batch's shards only (with the batch on the batch axis alone it "
        "sums over the whole mesh: kml.GroupedConvWarning)"
    )


def conv_input(kernel: str, axis: str) -> str:
    return (
        f"input conv, output channels split over {axis!r}: {kernel} reads the model's input (a patch or "
        "stem conv, no partner summing its channels); its output gathered over the axis forward"
    )


def conv_input_replicated(count: int, largest: int) -> str:
    """An input conv smaller than the largest split kernel (a ResNet stem): its output needs no gathering."""
    why = (
        f"{count:,} weights, fewer than the {largest:,} of the largest split kernel"
        if largest
        else "the plan splits no other kernel"
    )
    return f"input conv: replicated, so its output needs no gathering ({why})"


INPUT_CONV_OUTPUT = "input conv: output gathered whole over the model axis, as the layers after it read it"


def conv_after(unit: str) -> str:
    return f"conv unit {unit}: added after the all-reduce, replicated"


def conv_indivisible(unit: str, width: int, axis: str, size: int) -> str:
    return f"conv unit {unit}: {width} channels do not divide by {axis!r} ({size}), replicated"


def unused(axes: tuple) -> str:
    """A trainable weight the traced step never reads."""
    over = " and ".join(repr(a) for a in axes if a is not None)
    return f"not read by the training step: split over {over}; it gets no gradient, so no traffic"


# -- by name ------------------------------------------------------------------------------


def by_name(rule_note: str) -> str:
    return f"by name: {rule_note}"


def by_name_misfit(rule_note: str) -> str:
    return f"by name ({rule_note}), but its shape does not fit: replicated"


def without_partner(note: str, role: str) -> str:
    """A by-name column (or row) layer with no partner of the other kind in its scope."""
    other = "row" if role == "column" else "column"
    return f"{note}; no {other}-parallel partner beside it, so replicated"


def left_whole(ops: list[str], trace: object) -> str:
    """A weight no strategy splits."""
    if trace is None:
        return "replicated: the model was not traced and no layer or name says how to split it"
    if not ops:
        return "replicated: the traced step does not read it"
    return f"replicated: no strategy splits a weight read by {', '.join(ops)}"
