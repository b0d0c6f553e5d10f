"""One policy object for how layouts bend where a rule does not fit: `kml.LayoutPolicy`.

Its two options, `on_indivisible` and `replicate_below`, used to be passed separately to
`kml.auto_rules` (which plans with the threshold) and to `kml.ModelParallel` (which applies
both), with the advice to "pass the same value to both". Now the rules `auto_rules` returns
carry the policy they were planned with (`rules.policy`), and `ModelParallel` uses it unless
given one itself, so it is set once. The older keywords keep working; a keyword that
disagrees with `policy=` in the same call is an error.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Literal

from ._errors import InvalidOptionError

__all__ = ["DEFAULT_REPLICATE_BELOW", "IndivisiblePolicy", "LayoutPolicy", "resolve_policy"]

#: Weight matrices (rank 2 or more, biases excepted) with fewer elements than this stay
#: replicated (16 KiB in float32): splitting them saves less memory than the collectives
#: they add cost in latency. Vectors and biases follow their rule whatever their size:
#: beside a column-parallel kernel a sharded bias costs nothing, a replicated one an
#: all-gather per step.
DEFAULT_REPLICATE_BELOW = 4096

IndivisiblePolicy = Literal["replicate", "error"]
POLICIES = ("replicate", "error")


def check_policy(on_indivisible: str, replicate_below: int) -> None:
    """Validates the resolution options once, where the user passed them."""
    if on_indivisible not in POLICIES:
        raise InvalidOptionError(
            f"on_indivisible must be one of {POLICIES}. Received: on_indivisible={on_indivisible!r}."
        )
    if (
        isinstance(replicate_below, bool)
        or not isinstance(replicate_below, numbers.Integral)
        or replicate_below < 0
    ):
        raise InvalidOptionError(
            "replicate_below must be a non-negative integer element count (0 shards even the "
            f"smallest variables). Received: replicate_below={replicate_below!r}."
        )


@dataclasses.dataclass(frozen=True)
class LayoutPolicy:
    """How layouts bend where a rule does not fit a variable; set once, honoured everywhere.

    Give it to `kml.auto_rules(..., policy=...)`: the planner plans with it and
    the rules it returns carry it (`rules.policy`), so `kml.ModelParallel(mesh,
    rules)` applies the same policy without being told again. A policy given
    to `kml.ModelParallel(..., policy=...)` itself wins over the rules'.

    Attributes:
        on_indivisible: `"replicate"` (default): a dimension that does not
            divide by its mesh axis is replicated, with a warning and the
            reason recorded in the plan. `"error"`: it is an
            `IndivisibleShapeError`.
        replicate_below: Weight matrices (rank 2 or more, not biases) of
            preset and planner rules with fewer elements stay replicated.
            Defaults to 4096 (16 KiB in float32); 0 disables it.

    Raises:
        InvalidOptionError: `on_indivisible` is not `"replicate"` or
            `"error"`, or `replicate_below` is not a non-negative integer.

    Example:
        >>> import keras, keras_meshlayout as kml
        >>> policy = kml.LayoutPolicy(replicate_below=0)
        >>> model = keras.Sequential([
        ...     keras.Input((8,)),
        ...     keras.layers.Dense(16, name="up"),
        ...     keras.layers.Dense(8, name="down"),
        ... ], name="mlp")
        >>> mesh = kml.Mesh(data=2, model=4)
        >>> rules = kml.auto_rules(model, mesh, policy=policy)
        >>> rules.policy
        LayoutPolicy(on_indivisible='replicate', replicate_below=0)
        >>> kml.ModelParallel(mesh, rules).replicate_below  # set once, on the rules
        0
    """

    on_indivisible: IndivisiblePolicy = "replicate"
    replicate_below: int = DEFAULT_REPLICATE_BELOW

    def __post_init__(self) -> None:
        check_policy(self.on_indivisible, self.replicate_below)


def resolve_policy(
    where: str,
    policy: LayoutPolicy | None,
    *,
    on_indivisible: IndivisiblePolicy | None = None,
    replicate_below: int | None = None,
    default: LayoutPolicy | None = None,
) -> LayoutPolicy:
    """The policy of one call that takes `policy=` and the older keywords.

    `policy`, else `default` (the rules' own), else `LayoutPolicy()`, with the
    keywords given on top. A keyword that disagrees with `policy` is an error:
    both name the same option in the same call.
    """
    if policy is not None and not isinstance(policy, LayoutPolicy):
        raise InvalidOptionError(
            f"{where}: policy must be a kml.LayoutPolicy. Received: policy={policy!r}. "
            'Fix: policy=kml.LayoutPolicy(on_indivisible="replicate", replicate_below=4096).'
        )
    given = {
        name: value
        for name, value in (("on_indivisible", on_indivisible), ("replicate_below", replicate_below))
        if value is not None
    }
    LayoutPolicy(**given)  # each value is valid on its own
    for name, value in given.items():
        if policy is not None and value != getattr(policy, name):
            raise InvalidOptionError(
                f"{where} got policy={policy!r} and {name}={value!r}, which disagree: both set "
                f"{name} (the policy says {getattr(policy, name)!r}). Fix: pass only policy=, or "
                f"drop {name}= (or give it the policy's value)."
            )
    base = policy if policy is not None else default if default is not None else LayoutPolicy()
    return dataclasses.replace(base, **given)
