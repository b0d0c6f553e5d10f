"""`keras-meshlayout plan`: the plan of a model on a mesh, built without allocating weights.

It prints the plan with the training-state memory per device, and exits 0 when the plan
is valid, 1 when it fails a check, so it can gate a CI job. The model is a saved
`.keras` file (only its config is read) or a builder `MODULE:FUNCTION`; the rules come
from `--rules FILE`, `--preset NAME` (the preset registry) or `--auto`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Callable
from typing import Any

from ..core._errors import MemoryBudgetError, MeshLayoutWarning, UnmatchedRuleWarning
from ..core._format import format_bytes
from ..core._progress import spinner
from ._args import (
    EXIT_HELP,
    EXIT_OK,
    EXIT_PLAN_FAILS,
    InputError,
    add_emulate,
    fraction,
    positive_int,
)
from ._plan_compile import compile_for, compiled_failure, mesh_target, platform_name
from ._plan_inputs import (
    batch_spec,
    check_batch_size,
    check_optimizer,
    load_builder,
    preset_rules,
    rules_file,
)
from ._plan_mesh import AUTO, choose_for, option_rules_for
from ._preset_table import PRESET_TABLE

__all__ = ["HELP", "NAME", "PRESETS", "add_parser", "run"]

NAME = "plan"
#: Plans of more variables than this print as `plan.summary()` unless `--full` is given.
SUMMARY_ABOVE = 60
HELP = "plan a model on a mesh without allocating its weights"


#: How `--preset` spells each registered preset (from the light table: no planner import).
PRESETS = tuple(usage for usage, _ in PRESET_TABLE)


RULES_FILE_HELP = """\
rules files:
  JSON   a list of [pattern, axes] pairs (axes: mesh-axis names or null), e.g.
         [[".*dense_1/kernel", [null, "model"]], [".*dense_1/bias", ["model"]]]
         or {"rules": [...]}.
  Python a module defining RULES (a list of (pattern, axes) pairs or a
         kml.LayoutRules), or a function rules(model, mesh) returning either.
"""


def add_parser(commands: Any) -> None:
    """Adds the `plan` subcommand to `commands` (the parser's subparsers)."""
    plan = commands.add_parser(
        NAME,
        help=HELP,
        description="Build the model with its weights deferred, resolve every variable's layout "
        "exactly as kml.ModelParallel would, and print the plan with the training-state memory per "
        "device. Exits 0 when the plan is valid.",
        epilog=RULES_FILE_HELP + "\n" + EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_inputs(plan)
    _add_checks(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.add_argument(
        "--full",
        action="store_true",
        help=f"print every variable's row (plans of more than {SUMMARY_ABOVE} variables are summarised: "
        "repeated blocks folded, the largest rows, the totals)",
    )
    add_emulate(plan)
    plan.set_defaults(run=run)


def _add_inputs(plan: argparse.ArgumentParser) -> None:
    """The mesh, the model, where the rules come from, and the optimizer."""
    plan.add_argument(
        "--mesh",
        required=True,
        help='mesh spec: "2x4", "8" or "data=2,model=4" (-1 infers), or "auto": every data x model split '
        "of the --target's chips (else of the local devices) ranked by predicted step time, the best planned "
        "with --auto (needs --batch-size)",
    )
    plan.add_argument(
        "--target",
        default=None,
        metavar="TPU",
        help="plan for a TPU machine you do not have, e.g. tpu-v5e:16x16, tpu-v5p:4x4x4, tpu-v4:2x2x2, "
        "tpu-v6e:8x8 (add :slices=N for several slices); the mesh must use all its chips. Needs libtpu: "
        'pip install ".[tpu-aot]"',
    )
    plan.add_argument(
        "--model",
        required=True,
        help="a saved model (PATH.keras: only its config is read) or a builder MODULE:FUNCTION "
        "(or FILE.py:FUNCTION) returning a Keras model",
    )
    source = plan.add_mutually_exclusive_group()
    source.add_argument("--rules", metavar="FILE", help="rules from a JSON or Python file (see below)")
    source.add_argument(
        "--preset",
        metavar="NAME",
        help="preset rules: " + "; ".join(f"{usage} ({summary})" for usage, summary in PRESET_TABLE),
    )
    source.add_argument("--auto", action="store_true", help="rules from kml.auto_rules")
    plan.add_argument(
        "--optimizer", default=None, help="plan this optimizer's state too, e.g. adam, sgd, adafactor"
    )
    plan.add_argument(
        "--batch-axis", default=None, help="mesh axis the batch is split over (default: the first)"
    )
    plan.add_argument("--model-axis", default="model", help="tensor-parallel axis for --auto and presets")


def _add_checks(plan: argparse.ArgumentParser) -> None:
    """The policy, the memory checks and the planner's budget."""
    plan.add_argument("--on-indivisible", choices=("replicate", "error"), default="replicate")
    plan.add_argument("--replicate-below", type=int, default=None, help="small-matrix threshold in elements")
    plan.add_argument(
        "--device-memory", default=None, help='device capacity, e.g. "80GB" (default: from JAX)'
    )
    plan.add_argument(
        "--max-replicated-fraction",
        type=fraction,
        default=0.5,
        help="largest share of a device's state that may stay replicated though splittable (default 0.5)",
    )
    plan.add_argument(
        "--strict", action="store_true", help="fail (exit 1) on warnings such as unmatched rules"
    )
    plan.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help='with --auto: per-device memory the plan must fit at the least traffic, e.g. "40GiB" '
        "(needs --batch-size; prints the predicted bytes per step; replaces the replication guard)",
    )
    plan.add_argument(
        "--compile",
        action="store_true",
        help="also AOT-compile the training step for the mesh (the --target's XLA:TPU) from the dry build "
        "and print XLA's argument, output, temporary and peak bytes per device and the compiled traffic "
        "(needs --batch-size)",
    )
    plan.add_argument(
        "--loss",
        default="mse",
        help="with --compile: the loss the step trains with, a name Keras knows (default mse; "
        "sparse_categorical_crossentropy takes integer labels)",
    )
    plan.add_argument(
        "--batch-size",
        type=positive_int,
        default=None,
        help="global batch: predicts the peak memory of one training step (needed by --memory-budget and "
        "--compile)",
    )
    plan.add_argument(
        "--sequence-length",
        type=positive_int,
        default=None,
        help="length for the model inputs' other unknown dimensions (token ids), with --batch-size",
    )


def run(args: argparse.Namespace) -> int:
    """Plans the model on the mesh and prints it; returns the exit status (0: the plan is valid)."""
    from ..core._backend import emulate_devices
    from ..core._memory import parse_bytes

    emulate_devices(args.emulate_devices)
    build = load_builder(args.model)
    budget = None if args.memory_budget is None else parse_bytes(args.memory_budget)
    planned = _planned(args, build, budget)
    refits: list = []
    if args.compile and budget is not None:
        from ..planner._compiled_plan import next_in_rank, refit

        def peaks(planned: _Planned) -> tuple[int, int]:
            return planned.peak.peak, planned.compiled.peak_bytes

        if planned.choice is None:
            planned, refits = refit(lambda tighter: _planned(args, build, tighter), planned, budget, peaks)
        else:  # `--mesh auto`: the next mesh in rank, as `kml.plan_and_compile` given devices
            rules_of = option_rules_for(args, build, planned.choice, budget)
            planned, refits = next_in_rank(
                planned, budget, lambda choice: _planned(args, build, budget, choice), rules_of, peaks
            )
    plan, peak, compiled = planned.plan, planned.peak, planned.compiled
    messages = _messages(plan, planned.caught)
    failure = _failure(args, plan, peak)
    if failure is None and compiled is not None:
        capacity = plan.memory(args.device_memory).capacity
        failure = compiled_failure(compiled, peak, budget, capacity, refits)
    note = None if budget is not None else plan.intended_replication(args.max_replicated_fraction)
    if args.json:
        _print_json(args, planned, messages, failure, note, refits)
    else:
        _print_table(planned, messages, note, full=args.full)
        _print_refits(refits, budget)
    if failure is not None:
        print(f"plan fails: {failure}", file=sys.stderr)
        return EXIT_PLAN_FAILS
    if args.strict and messages:
        print(f"plan fails: {len(messages)} warning(s) with --strict", file=sys.stderr)
        return EXIT_PLAN_FAILS
    return EXIT_OK


@dataclasses.dataclass(frozen=True)
class _Planned:
    """What one planning of the command gives: the rules, the dry plan, its peak and compiled step."""

    choice: Any  # the `MeshChoice` of `--mesh auto`, else None
    rules: Any
    plan: Any
    caught: list[warnings.WarningMessage]
    peak: Any  # the predicted peak of one step (`--batch-size`), else None
    compiled: Any  # the `CompiledStep` (`--compile`), else None


def _planned(
    args: argparse.Namespace, build: Callable[[], Any], budget: int | None, choice: Any = None
) -> _Planned:
    """Plans (under `budget`, with `--auto`; on `choice`'s first mesh if given), predicts the peak and
    compiles, as the arguments ask."""
    from ..core._distribution import ModelParallel
    from ..core._dry import dry_plan
    from ..core._policy import DEFAULT_REPLICATE_BELOW, LayoutPolicy

    choice = _choice(args, build, budget) if choice is None else choice
    mesh = _parse_mesh(args.mesh, args.emulate_devices, args.target) if choice is None else choice.mesh
    if mesh.is_abstract:  # `--mesh auto` ranked this process's device count: lay the choice over them
        mesh = _parse_mesh(",".join(f"{k}={v}" for k, v in mesh.axis_sizes.items()), args.emulate_devices)
    check_optimizer(args.optimizer)
    replicate_below = DEFAULT_REPLICATE_BELOW if args.replicate_below is None else args.replicate_below
    policy = LayoutPolicy(on_indivisible=args.on_indivisible, replicate_below=replicate_below)
    if args.memory_budget is not None and not args.auto:
        raise InputError("--memory-budget chooses layouts for --auto: add --auto.")
    if args.memory_budget is not None and args.batch_size is None:
        raise InputError("--memory-budget needs --batch-size (and --sequence-length for token inputs).")
    if args.compile and args.batch_size is None:
        raise InputError("--compile needs --batch-size (and --sequence-length for token inputs).")
    check_batch_size(args.batch_size, mesh, args.batch_axis)
    with spinner("plan", wanted=not args.json) as step:
        if args.auto:
            step("planning the layouts (kml.auto_rules: tracing the model, costing each unit)")
        rules = choice.rules if choice is not None else _the_rules(args, build, mesh, policy, budget)
        distribution = ModelParallel(mesh, rules, batch_axis=args.batch_axis, policy=policy)
        step("building the model without allocating its weights, and resolving every variable")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MeshLayoutWarning)
            plan = dry_plan(build, distribution, optimizer=args.optimizer)
        peak = None
        if args.batch_size is not None:
            step("predicting the peak memory of one training step (tracing its forward and backward passes)")
            peak = _peak(args, build, plan, distribution)
        compiled = None
        if args.compile:
            step(f"compiling the training step for {platform_name(mesh)} (XLA, ahead of time)")
            compiled = compile_for(build, distribution, args)
    return _Planned(choice, rules, plan, caught, peak, compiled)


def _print_refits(refits: list, budget: int | None) -> None:
    """The plans `--compile` found over the `--memory-budget` once compiled, and planned again."""
    for refit_ in refits:
        if refit_.mesh:
            predicted, compiled = format_bytes(refit_.predicted_peak), format_bytes(refit_.compiled_peak)
            _console().print(
                f"compiled over the budget: the plan on {refit_.mesh} (predicted peak {predicted}) compiled "
                f"to {compiled}, over {format_bytes(budget)}; the next mesh in rank planned instead",
                markup=False,
            )
            continue
        _console().print(
            f"compiled over the budget: the plan made under {format_bytes(refit_.budget)} (predicted peak "
            f"{format_bytes(refit_.predicted_peak)}) compiled to {format_bytes(refit_.compiled_peak)}, over "
            f"{format_bytes(budget)}; planned again under {format_bytes(refit_.next_budget)}, its predicted "
            "peak scaled by that excess",
            markup=False,
        )


def _choice(args: argparse.Namespace, build: Callable[[], Any], budget: int | None) -> Any:
    """With `--mesh auto`, the chosen mesh and its alternatives (the rules are then `--auto`'s)."""
    if args.mesh != AUTO:
        return None
    choice = choose_for(args, build, budget)
    args.auto = True
    return choice


def _failure(args: argparse.Namespace, plan: Any, peak: Any) -> str | None:
    """Why the plan fails its checks (replication guard, device memory, the predicted peak), or `None`."""
    from ..planner._at_peak import filled_by

    try:
        # Under a memory budget the planner replicates on purpose wherever the budget allows,
        # so the budget replaces the replication guard.
        guard = 1.0 if args.memory_budget is not None else args.max_replicated_fraction
        plan.check(max_replicated_fraction=guard, device_memory=args.device_memory)
    except MemoryBudgetError as err:
        return str(err)
    capacity = plan.memory(args.device_memory).capacity
    if peak is not None and capacity is not None and peak.peak > capacity:
        return (
            f"one training step needs {format_bytes(peak.peak)} per device at its predicted peak ("
            f"{_resident(peak)} {format_bytes(peak.resident)}, batch, {_working(peak)} "
            f"{format_bytes(peak.working)}), more than the {format_bytes(capacity)} available."
            f"{filled_by(peak.buffers)} Fix: a smaller --batch-size, a mesh with a larger model axis, or "
            "--auto --memory-budget SIZE"
        )
    return None


def _the_rules(
    args: argparse.Namespace, build: Callable[[], Any], mesh: Any, policy: Any, budget: int | None
) -> Any:
    """The rules from `--auto`, `--preset` or `--rules`; `None` (data parallelism) without any."""
    if args.auto:
        from ..core._dry import dry_build
        from ..planner._auto import auto_rules

        with dry_build(build) as model:
            batch = (
                None if args.batch_size is None else batch_spec(model, args.batch_size, args.sequence_length)
            )
            return auto_rules(
                model,
                mesh,
                model_axis=args.model_axis,
                batch_axis=args.batch_axis,
                memory_budget=budget,
                batch=batch,
                optimizer=args.optimizer,
                policy=policy,
            )
    if args.preset:
        return preset_rules(args.preset, args.model_axis)
    if args.rules:
        return rules_file(args.rules, build, mesh)
    return None


def _peak(args: argparse.Namespace, build: Callable[[], Any], plan: Any, distribution: Any) -> Any:
    """The predicted per-device peak of one training step on `--batch-size` (`planner._peak`),
    following XLA:TPU's buffers on a `--target` mesh."""
    from ..core._dry import dry_build
    from ..planner._peak import chip_of, compiler_of, plan_peak

    mesh = distribution.device_mesh
    with dry_build(build) as model:
        batch = batch_spec(model, args.batch_size, args.sequence_length)
        axis = distribution.batch_dim_name
        return plan_peak(model, plan, batch, axis, compiler_of(mesh), chip_of(mesh), args.optimizer)


def _messages(plan: Any, caught: list[warnings.WarningMessage]) -> list[str]:
    """The plan's own warnings (listed under its table), then the others caught, each once."""
    messages = list(plan.warnings)
    messages += sorted(
        {str(w.message) for w in caught if issubclass(w.category, MeshLayoutWarning)}
        - set(messages)
        - {str(w.message) for w in caught if issubclass(w.category, UnmatchedRuleWarning)}
    )
    return messages


def _print_json(
    args: argparse.Namespace,
    planned: _Planned,
    messages: list[str],
    failure: str | None,
    note: str | None,
    refits: list,
) -> None:
    plan, rules, peak, compiled, choice = (
        planned.plan, planned.rules, planned.peak, planned.compiled, planned.choice
    )  # fmt: skip
    data = plan.to_dict()
    if choice is not None:
        # "mesh" (the plan's own: the chosen mesh's axis sizes) stays as every plan gives it.
        data["alternatives"] = [option.to_dict() for option in choice.alternatives]
        data["fsdp"] = choice.best.fsdp  # whether the chosen plan is the mesh's fully sharded one
    data["memory_per_device"] = plan.memory(args.device_memory).to_dict()
    data["memory_per_device"]["peak_bytes"] = None if peak is None else peak.peak
    data["memory_per_device"]["activation_bytes"] = None if peak is None else peak.working
    if args.target is not None:
        data["target"] = mesh_target(args.target).to_dict()
    # The prediction per device, beside the compiled figures (`--compile`): the training state,
    # and with --batch-size the peak of one step (state, batch, activations and temporaries).
    data["memory"] = {
        "state_bytes": plan.memory(args.device_memory).total,
        "peak_bytes": None if peak is None else peak.peak,
        "peak_buffers": [] if peak is None else [buffer.to_dict() for buffer in peak.buffers],
    }
    if compiled is not None:
        data["compiled"] = compiled.to_dict()
        # The plans compiled over the --memory-budget and made again under a tighter one.
        data["refits"] = [refit_.to_dict() for refit_ in refits]
    data["warnings"] = messages
    cost = getattr(rules, "cost", None)
    if cost is not None:
        data["predicted"] = {
            "wire_bytes_per_device": cost.wire_bytes,
            "wire_bytes_by_axis": dict(cost.wire_bytes_by_axis),
            "state_bytes_per_device": cost.state_bytes,
            "activation_bytes_per_device": cost.activation_bytes,
            "peak_bytes_per_device": cost.peak_bytes,
            "budget": cost.budget,
            "layouts": cost.layouts(),
        }
    data["valid"] = failure is None and not (args.strict and messages)
    data["failure"] = failure
    data["note"] = note
    print(json.dumps(data, indent=2))


def _print_table(planned: _Planned, messages: list[str], note: str | None, *, full: bool = False) -> None:
    plan, rules, peak, compiled, choice = (
        planned.plan, planned.rules, planned.peak, planned.compiled, planned.choice
    )  # fmt: skip
    console = _console()
    if choice is not None:
        console.print(choice)
    console.print(plan if full or len(plan) <= SUMMARY_ABOVE else plan.summary())
    if peak is not None:
        console.print(
            f"Peak per device (one training step, predicted): {format_bytes(peak.peak)} ({_resident(peak)} "
            f"{format_bytes(peak.resident)}, batch {format_bytes(peak.batch)}, {_working(peak)} "
            f"{format_bytes(peak.working - peak.batch)})",
            markup=False,
        )
        lines = [f"\n  {buffer}" for buffer in peak.buffers]
        console.print("largest buffers live at the predicted peak, a device:" + "".join(lines), markup=False)
    if getattr(rules, "cost", None) is not None:
        console.print(f"predicted: {rules.cost}", markup=False)
    if compiled is not None:
        console.print(compiled)
    for message in messages[len(plan.warnings) :]:
        console.print(f"warning: {message}", style="yellow", markup=False)
    if note is not None:
        console.print(f"note: {note}", markup=False)


def _console() -> Any:
    """A terminal's console at its width (at least 120); a pipe or file gets every row whole.

    Written to a pipe, a table at a fixed width would wrap mid-name (`adam/learning_rat` /
    `e`), which breaks `grep` and diffs: there the table takes the width its rows need.
    """
    from rich.console import Console

    if sys.stdout.isatty():
        return Console(width=max(120, Console().width))
    return Console(width=_PIPE_WIDTH, color_system=None, force_terminal=False)


#: Wide enough for any plan's rows; a table is only as wide as its content needs.
_PIPE_WIDTH = 10_000


def _parse_mesh(spec: str, emulated: int, target: str | None = None) -> Any:
    """The `--mesh` (over the `--target`'s chips), its device-count hint said as the command line takes it."""
    from ..core._errors import InvalidMeshError, InvalidTargetError
    from ..core._mesh import DEVICES_HINT, Mesh

    try:
        return Mesh.parse(spec, target=mesh_target(target))
    except InvalidTargetError:
        raise
    except InvalidMeshError as err:
        hint = f"plan on that many emulated CPU devices with --emulate-devices N (now {emulated})"
        raise InputError(str(err).replace(DEVICES_HINT, hint)) from None


def _resident(peak: Any) -> str:
    """What `PeakMemory.resident` is, in words: on XLA:TPU the state without its gradients."""
    return "training state" if peak.held else "parameters and optimizer slots"


def _working(peak: Any) -> str:
    """What `PeakMemory.working` less the batch is, in words."""
    return "activations and temporaries" if peak.held else "activations, temporaries and gradients"
