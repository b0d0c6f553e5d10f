"""`plan --mesh auto`: the mesh chosen for the model (`kml.choose_mesh`), its table of alternatives.

Every data × model split (and, for a mixture-of-experts model, data × expert × model) of
the `--target`'s chips (without a target, of the local devices, emulated with
`--emulate-devices`) is planned with the automatic rules on `--batch-size` rows, and where its
data axis is 2 or more also fully sharded over it (the table's `plan` column, `"fsdp"` in
`--json`), and ranked by predicted step time; the best is planned as `--mesh SPEC` would be
(fully sharded, if that row won). With `--compile --memory-budget`, a chosen mesh whose compiled
step is over the budget gives way to the next in rank (`next_in_rank`, as `kml.plan_and_compile`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from ._args import InputError
from ._plan_inputs import batch_spec

__all__ = ["AUTO", "choose_for", "next_in_rank"]

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


def next_in_rank(
    planned: Any, plan_on: Callable[[Any], Any], args: argparse.Namespace, build: Callable[[], Any]
) -> tuple[Any, list]:
    """While the chosen mesh's compiled step is over `--memory-budget`, the next usable one in rank
    (`REFITS` more at most), planned with `plan_on(choice)` on a choice that puts it first; returns
    the last planned and a `Refit` naming each mesh given up."""
    from ..core._memory import parse_bytes
    from ..planner._compiled_plan import REFITS, Refit

    budget = parse_bytes(args.memory_budget)
    refits: list[Refit] = []
    for option in [o for o in planned.choice.alternatives if o.excluded is None][1 : REFITS + 1]:
        if planned.compiled.peak_bytes <= budget:
            break
        best = planned.choice.best
        label = best.spec + (" fsdp" if best.fsdp else "")
        refits.append(Refit(budget, planned.peak.peak, planned.compiled.peak_bytes, budget, label))
        planned = plan_on(_promoted(planned.choice, option, args, build, budget))
    return planned, refits


def _promoted(
    choice: Any, option: Any, args: argparse.Namespace, build: Callable[[], Any], budget: int
) -> Any:
    """`choice` with `option` first, its mesh and its rules (made again as `choose_mesh` made them)."""
    from ..core._dry import dry_build
    from ..planner._compiled_plan import promoted
    from ..planner._mesh_choice import option_rules

    with dry_build(build) as model:
        batch = batch_spec(model, args.batch_size, args.sequence_length)
    axes = (args.batch_axis or "data", args.model_axis)
    return promoted(
        choice, option, option_rules(build, option, choice.target, batch, args.optimizer, budget, axes)
    )
