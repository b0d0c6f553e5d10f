"""Preset layout rules for the structures people train.

Each function returns `LayoutRules` whose rules carry a note saying why. The
layouts follow Megatron-LM (Shoeybi et al., 2019): a column-parallel layer
splits its output features over the model axis and a row-parallel layer its
input features, so a column → row pair needs one all-reduce of activations
forward and one backward, and no weight ever moves.

All presets take the axis names as arguments. `fsdp_axis` (for instance
`"data"`) additionally splits each sharded weight's other dimension over a
second axis, as large-model recipes do to save memory: that trades memory for
an all-gather of those weights every step.

Every preset is registered once, in `PRESETS`, which the command line reads for
`keras-meshlayout plan --preset`: a new preset is a function here with a
`@_register(...)` line, exported from `keras_meshlayout/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Literal

from ..core._errors import InvalidOptionError
from ..core._policy import LayoutPolicy, resolve_policy
from ..core._rules import LayoutRules

__all__ = ["conv_rules", "mlp_rules", "transformer_rules"]

EmbeddingLayout = Literal["replicated", "vocab", "hidden"]


@dataclasses.dataclass(frozen=True)
class Preset:
    """One preset as the API and the command line share it.

    Attributes:
        name: Its name on the command line (`--preset NAME`).
        rules: The public function that builds its rules; it takes
            `model_axis` and `fsdp_axis` keywords.
        takes_layers: Whether it needs layer names, given on the command line
            as `NAME:LAYER,LAYER,...` and passed to `rules` first.
        summary: One line for the command line's help.
    """

    name: str
    rules: Callable[..., LayoutRules]
    takes_layers: bool
    summary: str

    @property
    def usage(self) -> str:
        """How `--preset` spells it, e.g. `"conv"` or `"mlp:LAYER,LAYER,..."`."""
        return f"{self.name}:LAYER,LAYER,..." if self.takes_layers else self.name

    def build(
        self, layers: Sequence[str] = (), *, model_axis: str = "model", fsdp_axis: str | None = None
    ) -> LayoutRules:
        """Its rules for `layers` (only when it `takes_layers`) on the given axes."""
        if self.takes_layers:
            return self.rules(list(layers), model_axis=model_axis, fsdp_axis=fsdp_axis)
        return self.rules(model_axis=model_axis, fsdp_axis=fsdp_axis)


#: Every preset by its command-line name, in the order the help lists them.
PRESETS: dict[str, Preset] = {}


def _register(
    name: str, *, summary: str, takes_layers: bool = False
) -> Callable[[Callable[..., LayoutRules]], Callable[..., LayoutRules]]:
    """Adds the decorated preset function to `PRESETS` under `name`, unchanged."""

    def register(rules: Callable[..., LayoutRules]) -> Callable[..., LayoutRules]:
        if name in PRESETS:
            taken = PRESETS[name].rules.__name__
            raise InvalidOptionError(
                f"A preset named {name!r} is already registered ({taken}). "
                "Fix: give the new preset another name in its @_register(...) line."
            )
        PRESETS[name] = Preset(name, rules, takes_layers, summary)
        return rules

    return register


#: Feed-forward input projections (column-parallel) and output projections
#: (row-parallel), by the names common in Keras and keras-hub model code.
FFN_COLUMN = (
    r"ffw_gating\w*",
    r"\w*feedforward_(?:gate|intermediate|up)_dense",
    r"(?:\w*_)?(?:gate|up|intermediate|fc1|wi(?:_\d+)?)_(?:dense|proj)",  # Llama-style, SmolLM
    r"(?:input|gate)_projector",  # T5
    r"dense_h_to_4h",  # Falcon
)
FFN_ROW = (
    r"ffw_linear",
    r"\w*feedforward_output_dense",
    r"(?:\w*_)?(?:down|fc2|wo)_(?:dense|proj)",
    r"(?:mlp_)?output_dense",  # Bloom, FNet
    r"output_projector",  # T5
    r"dense_4h_to_h",  # Falcon
)


def ffn_role(path: str) -> str | None:
    """`"column"` or `"row"` for a variable of a feed-forward layer named as in `FFN_COLUMN`/`FFN_ROW`."""
    for role, names in (("column", FFN_COLUMN), ("row", FFN_ROW)):
        if re.fullmatch(rf"(?:.*/)?(?:{'|'.join(names)})/\w+", path):
            return role
    return None


@_register("mlp", takes_layers=True, summary="Dense layers in data-flow order, alternating column and row")
def mlp_rules(
    layers: Sequence[str],
    *,
    model_axis: str = "model",
    fsdp_axis: str | None = None,
    policy: LayoutPolicy | None = None,
) -> LayoutRules:
    """Megatron-style rules for a stack of Dense layers, alternating column and row.

    The 1st, 3rd, 5th... named layer is column-parallel (kernel `(fsdp, model)`,
    bias `(model,)`), the 2nd, 4th... row-parallel (kernel `(model, fsdp)`,
    bias replicated). Give an even number of layers: a trailing column layer
    leaves its output split, and the next replicated layer must gather it.

    A kernel rule that matches no variable (a misspelt layer) is reported as any rule of
    yours (`kml.UnmatchedRuleWarning`, the plan's `unmatched_rules`); a bias rule is optional.

    Args:
        layers: Layer names (or regexes matching them), in data-flow order.
        model_axis: The tensor-parallel mesh axis.
        fsdp_axis: Optional second axis for the other weight dimension.
        policy: A `kml.LayoutPolicy` for these rules (`rules.policy`), applied by
            `kml.ModelParallel`; `None`: the default policy.

    Returns:
        The rules.

    Example:
        >>> import keras_meshlayout as kml
        >>> rules = kml.mlp_rules(["fc1", "fc2"])
        >>> [(r.pattern, r.axes) for r in rules.rules]  # doctest: +NORMALIZE_WHITESPACE
        [('(?:.*/)?fc1/kernel', (None, 'model')), ('(?:.*/)?fc1/bias', ('model',)),
         ('(?:.*/)?fc2/kernel', ('model', None)), ('(?:.*/)?fc2/bias', (None,))]
    """
    rules = []
    for position, layer in enumerate(layers):
        scope = _under(layer)
        if position % 2 == 0:
            rules.append(
                (scope + "/kernel", (fsdp_axis, model_axis), "column-parallel: output features split")
            )
            rules.append(
                (scope + "/bias", (model_axis,), "bias of a column-parallel layer: split with its outputs")
            )
        else:
            rules.append((scope + "/kernel", (model_axis, fsdp_axis), "row-parallel: input features split"))
            rules.append(
                (scope + "/bias", (None,), "bias of a row-parallel layer: added after the all-reduce")
            )
    # The layers are named by the user: a kernel rule matching nothing is a typo, warned of as any
    # (`UnmatchedRuleWarning`); a bias rule may (a layer built with `use_bias=False`).
    checked = LayoutRules(rules, suggested=True).rules
    kept = [dataclasses.replace(rule, optional=rule.pattern.endswith("/bias")) for rule in checked]
    return LayoutRules(kept, suggested=True, policy=resolve_policy("mlp_rules()", policy))


@_register("transformer", summary="attention heads and feed-forward pairs split, Megatron-style")
def transformer_rules(
    *,
    model_axis: str = "model",
    fsdp_axis: str | None = None,
    embeddings: EmbeddingLayout = "replicated",
    policy: LayoutPolicy | None = None,
) -> LayoutRules:
    """Megatron-style rules for transformer blocks written with Keras layers.

    - Attention (`keras.layers.MultiHeadAttention`, `GroupQueryAttention`, and
      `EinsumDense` layers named `query`, `key`, `value`, `attention_output`
      with kernels laid out `(hidden, heads, head_dim)` and
      `(heads, head_dim, hidden)` as those layers do): query/key/value split
      over heads, the output projection over heads on its input side. With
      grouped-query attention, key/value projections whose head count does not
      divide by the model axis are replicated (by the `on_indivisible`
      policy) rather than crash.
    - Feed-forward: `ffw_gating*`, `feedforward_{gate,intermediate,up}_dense`,
      `*_{gate,up,intermediate,fc1}_{dense,proj}`, T5's
      `{input,gate}_projector` and Falcon's `dense_h_to_4h` column-parallel;
      `ffw_linear`, `feedforward_output_dense`, `*_{down,fc2}_{dense,proj}`,
      `[mlp_]output_dense`, `output_projector` and `dense_4h_to_h`
      row-parallel.
    - Norms, position embeddings, row-parallel biases, mixture-of-experts
      routers and stacked expert weights (`experts/*`: expert parallelism is
      not planned) and RWKV's mixing layers replicated (`kml.auto_rules`
      splits RWKV's time mixing over heads).
    - Token embeddings by `embeddings`: `"replicated"` (no traffic, full
      memory), `"vocab"` (rows split: each device looks up its part of the
      vocabulary and an all-reduce of the embedded batch combines them: saves
      the most memory for a large vocabulary), or `"hidden"` (columns split:
      lookups are local, but the next layer norm needs the whole hidden vector,
      so the activations are all-gathered).

    Args:
        model_axis: The tensor-parallel mesh axis.
        fsdp_axis: Optional second axis for the other weight dimension.
        embeddings: How to lay out token embeddings.
        policy: A `kml.LayoutPolicy` for these rules (`rules.policy`), applied by
            `kml.ModelParallel`; `None`: the default policy.

    Returns:
        The rules.

    Example:
        >>> import keras_meshlayout as kml
        >>> rules = kml.transformer_rules()
        >>> rules.match("encoder/attn/query/kernel").axes
        (None, 'model', None)
        >>> rules.match("block_0/feedforward_output_dense/kernel").axes
        ('model', None)
    """
    if embeddings not in ("replicated", "vocab", "hidden"):
        raise InvalidOptionError(
            f"transformer_rules: embeddings must be 'replicated', 'vocab' or 'hidden'. Received: "
            f'embeddings={embeddings!r}. Fix: transformer_rules(embeddings="vocab") splits the '
            'vocabulary over the model axis, "hidden" the hidden features.'
        )
    column = "(?:" + "|".join(FFN_COLUMN) + ")"
    row = "(?:" + "|".join(FFN_ROW) + ")"
    vocab_hidden, note = {
        "replicated": ((None, None), "token embeddings replicated: no traffic"),
        "vocab": ((model_axis, fsdp_axis), "vocabulary split: lookups all-reduced"),
        "hidden": ((fsdp_axis, model_axis), "hidden split: looked-up vectors all-gathered"),
    }[embeddings]
    return LayoutRules(
        [
            (r"(?:.*/)?\w*position\w*/\w+", (...,), "position embeddings: small, replicated"),
            (
                r"(?:.*/)?(?:\w*norm\w*|(?:\w*_)?ln(?:_\w*|\d*))/\w+",
                (...,),
                "normalisation: needs whole features, replicated",
            ),
            # A mixture-of-experts router picks experts from whole logits: never split it.
            (r"(?:.*/)?\w*(?:router|sparse_feedforward_gate)\w*/\w+", (...,), "expert router: replicated"),
            # Expert weights stacked as (experts, in, out): splitting experts over an axis
            # (expert parallelism) needs an all-to-all dispatch that these rules do not plan.
            (r"(?:.*/)?experts/\w+", (...,), "mixture-of-experts weights: replicated, experts not split"),
            # RWKV's time mixing carries a recurrent state across all channels.
            (
                r"(?:.*/)?RWKV_(?:TIME_MIX|CMIX)/.+",
                (...,),
                "RWKV time/channel mixing: replicated by these name rules (kml.auto_rules splits its heads)",
            ),
            (r"(?:.*/)?(?:query|key|value)/kernel", (fsdp_axis, model_axis, None), "attention: heads split"),
            (r"(?:.*/)?(?:query|key|value)/bias", (model_axis, None), "attention bias: heads split"),
            (
                r"(?:.*/)?attention_output/kernel",
                (model_axis, None, fsdp_axis),
                "attention output: heads split",
            ),
            (r"(?:.*/)?attention_output/bias", (None,), "added after the all-reduce"),
            (rf"(?:.*/)?{column}/kernel", (fsdp_axis, model_axis), "feed-forward in: column-parallel"),
            (rf"(?:.*/)?{column}/bias", (model_axis,), "bias of a column-parallel layer"),
            (rf"(?:.*/)?{row}/kernel", (model_axis, fsdp_axis), "feed-forward out: row-parallel"),
            (rf"(?:.*/)?{row}/bias", (None,), "added after the all-reduce"),
            (r"(?:.*/)?\w*embed\w*/embeddings", vocab_hidden, note),
            # keras-hub's ReversibleEmbedding keeps an untied output matrix as (hidden, vocab).
            (r"(?:.*/)?\w*embed\w*/reverse_embeddings", vocab_hidden[::-1], note),
        ],
        optional=True,
        suggested=True,
        policy=resolve_policy("transformer_rules()", policy),
    )


@_register("conv", summary="convolution output channels split")
def conv_rules(
    convs: str = r"\w*conv\w*",
    *,
    model_axis: str = "model",
    fsdp_axis: str | None = None,
    policy: LayoutPolicy | None = None,
) -> LayoutRules:
    """Rules for convolutional nets: output channels split, everything else replicated.

    Convolution kernels (any spatial rank: `(..., in, out)`) are split on their
    output channels, and their biases and the batch-normalisation variables of
    those channels follow. Dense layers (the classifier head) match no rule
    and stay replicated. Each convolution then needs its input channels whole,
    so its input is all-gathered over the model axis: worth it where weights
    dominate memory, not where activations do.

    Args:
        convs: Regex matching convolution layer names.
        model_axis: The mesh axis that splits output channels.
        fsdp_axis: Optional second axis for the input channels.
        policy: A `kml.LayoutPolicy` for these rules (`rules.policy`), applied by
            `kml.ModelParallel`; `None`: the default policy.

    Returns:
        The rules.

    Example:
        >>> import keras_meshlayout as kml
        >>> rules = kml.conv_rules()
        >>> rules.match("resnet/conv2d_3/kernel").expand(4)
        (None, None, None, 'model')
    """
    scope = f"(?:.*/)?{convs}"
    return LayoutRules(
        [
            (scope + "/kernel", (..., fsdp_axis, model_axis), "convolution: output channels split"),
            (scope + "/bias", (model_axis,), "bias of split output channels"),
        ],
        optional=True,
        suggested=True,
        policy=resolve_policy("conv_rules()", policy),
    )


def _under(layer: str) -> str:
    """A pattern for the variables of `layer` anywhere in the model."""
    name = layer if _is_regex(layer) else re.escape(layer)
    return f"(?:.*/)?{name}"


def _is_regex(text: str) -> bool:
    return re.escape(text) != text
