"""`plan --mesh auto`: the mesh chosen for the model (`kml.choose_mesh`), its table of alternatives.

Every data × model split (and, for a mixture-of-experts model, data × expert × model) of
the `--target`'s chips (without a target, of the local devices, emulated with
`--emulate-devices`) is planned with the automatic rules on `--batch-size` rows, and where its
data axis is 2 or more also fully sharded over it (the table's `plan` column, `"fsdp"` in
`--json`), and ranked by predicted step time; the best is planned as `--mesh SPEC` would be
(fully sharded, if that row won). With `--compile --memory-budget`, a chosen mesh whose compiled
step is over the budget gives way to the next in rank (`planner._compiled_plan.next_in_rank`, as
`kml.plan_and_compile`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ._args import InputError
from ._plan_inputs import batch_spec

__all__ = ["AUTO", "choose_for", "option_rules_for"]

#: The `--mesh` value that asks for the mesh to be chosen.
AUTO = "auto"


def choose_for(args: argparse.Namespace, build: Callable[[], Any], budget: int | None) -> Any:
    """The `MeshChoice` for `--target` (or the local device count) on `--batch-size` rows, within `budget`."""
    if args.batch_size is None:
        raise InputError(
            "--mesh auto needs --batch-size (and --sequence-length for token inputs): the meshes are "
            "ranked by one training step's predicted time and peak."
        )
    if args.rules or args.preset:
        raise InputError(
            "--mesh auto plans with the automatic rules: drop --rules/--preset (or give a mesh)."
        )
    import jax

    from ..core._dry import dry_build
    from ..planner._mesh_choice import choose_mesh

    with dry_build(build) as model:
        batch = batch_spec(model, args.batch_size, args.sequence_length)
    devices = args.target if args.target is not None else jax.device_count()
    return choose_mesh(
        build, devices, batch=batch, memory_budget=budget, optimizer=args.optimizer,
        axes=(args.batch_axis or "data", args.model_axis),
    )  # fmt: skip


def option_rules_for(args: argparse.Namespace, build: Callable[[], Any], choice: Any, budget: int) -> Any:
    """A function planning one of `choice`'s rows as `choose_for` planned them (`next_in_rank`)."""
    from ..core._dry import dry_build
    from ..planner._mesh_choice import option_rules

    with dry_build(build) as model:
        batch = batch_spec(model, args.batch_size, args.sequence_length)
    axes = (args.batch_axis or "data", args.model_axis)
    return lambda option: option_rules(build, option, choice.target, batch, args.optimizer, budget, axes)
