"""The `keras-meshlayout` command line (also `python -m keras_meshlayout`).

Commands: `devices` (what JAX sees, and the meshes that fit), `launch` (a script in
several local processes, as `python -m keras_meshlayout.launch`), `plan` (the plan
of a model on a mesh, built without allocating weights, with its memory per
device; exit status 0 when the plan is valid, so it can gate a CI job), and
`demo` (trains an MLP on a 2×4 mesh).
"""

from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import json
import sys
import traceback
import warnings
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..core._errors import MemoryBudgetError, MeshLayoutError, MeshLayoutWarning, UnmatchedRuleWarning
from ..core._mesh import mesh_axis_sizes
from ..planner._presets import PRESETS as _PRESET_REGISTRY

#: The plan is valid.
EXIT_OK = 0
#: The plan was made but fails a check: the memory budget, the replication
#: guard, or (with `--strict`) a warning such as a rule that matched nothing.
EXIT_PLAN_FAILS = 1
#: The input was rejected: a bad mesh, rule, model or option.
EXIT_INVALID = 2

_EXIT_HELP = (
    f"exit status: {EXIT_OK} valid, {EXIT_PLAN_FAILS} the plan fails a check, {EXIT_INVALID} invalid input."
)

#: How `--preset` spells each registered preset (the registry is `_presets.PRESETS`).
PRESETS = tuple(preset.usage for preset in _PRESET_REGISTRY.values())

_RULES_FILE_HELP = """\
rules files:
  JSON   a list of [pattern, axes] pairs (axes: mesh-axis names or null), e.g.
         [[".*dense_1/kernel", [null, "model"]], [".*dense_1/bias", ["model"]]]
         or {"rules": [...]}.
  Python a module defining RULES (a list of (pattern, axes) pairs or a
         kml.LayoutRules), or a function rules(model, mesh) returning either.
"""


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # everything after it is the launcher's and the script's
        from ..runtime._launch import main as launch

        return launch(argv[1:], prog="keras-meshlayout launch")
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except MemoryBudgetError as err:
        print(f"plan fails: {err}", file=sys.stderr)
        return EXIT_PLAN_FAILS
    except (MeshLayoutError, _InputError) as err:
        if args.traceback and err.__cause__ is not None:  # the user's code that failed
            traceback.print_exception(err.__cause__)
        print(f"error: {' '.join(_lines(err))}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as err:  # never a traceback: one line, unless asked for
        if args.traceback:
            raise
        print(
            f"error: {type(err).__name__}: {_one_line(err)} (rerun with --traceback for details)",
            file=sys.stderr,
        )
        return EXIT_INVALID


class _InputError(Exception):
    """A model, rules file or option the command line cannot use."""


class _Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line on stderr (exit 2), not the usage text as well."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_INVALID, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _lines(err: BaseException) -> list[str]:
    return [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]


def _one_line(err: BaseException) -> str:
    """The first line of another library's error message, marked when more lines follow."""
    lines = _lines(err)
    return lines[0] + (" [...]" if len(lines) > 1 else "")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="keras-meshlayout",
        description="Named device meshes and checked layout rules for Keras on JAX.",
        epilog=_EXIT_HELP,
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="show the traceback of an unexpected error, or of your builder or rules function that raised",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    devices = commands.add_parser(
        "devices",
        help="list the devices JAX sees and the meshes that fit them",
        description="List devices (platform, kind, process, topology coordinates, memory) and the 1-D "
        "and 2-D meshes that fit them.",
    )
    _add_emulate(devices)
    devices.add_argument("--json", action="store_true", help="print JSON instead of tables")
    devices.set_defaults(run=_devices)

    commands.add_parser(
        "launch",
        help="run a script in N local processes, as on N hosts (see: launch --help)",
        add_help=False,
    )

    plan = commands.add_parser(
        "plan",
        help="plan a model on a mesh without allocating its weights",
        description="Build the model with its weights deferred, resolve every variable's layout "
        "exactly as kml.ModelParallel would, and print the plan with the training-state memory per "
        "device. Exits 0 when the plan is valid.",
        epilog=_RULES_FILE_HELP + "\n" + _EXIT_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("--mesh", required=True, help='mesh spec: "2x4", "8" or "data=2,model=4" (-1 infers)')
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
        help="preset rules: "
        + "; ".join(f"{preset.usage} ({preset.summary})" for preset in _PRESET_REGISTRY.values()),
    )
    source.add_argument("--auto", action="store_true", help="rules from kml.auto_rules")
    plan.add_argument(
        "--optimizer", default=None, help="plan this optimizer's state too, e.g. adam, sgd, adafactor"
    )
    plan.add_argument(
        "--batch-axis", default=None, help="mesh axis the batch is split over (default: the first)"
    )
    plan.add_argument("--model-axis", default="model", help="tensor-parallel axis for --auto and presets")
    plan.add_argument("--on-indivisible", choices=("replicate", "error"), default="replicate")
    plan.add_argument("--replicate-below", type=int, default=None, help="small-matrix threshold in elements")
    plan.add_argument(
        "--device-memory", default=None, help='device capacity, e.g. "80GB" (default: from JAX)'
    )
    plan.add_argument(
        "--max-replicated-fraction",
        type=_fraction,
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
        "--batch-size", type=_positive_int, default=None, help="global batch for --memory-budget"
    )
    plan.add_argument(
        "--sequence-length",
        type=_positive_int,
        default=None,
        help="length for the model inputs' other unknown dimensions (token ids), with --batch-size",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    _add_emulate(plan)
    plan.set_defaults(run=_plan)

    demo = commands.add_parser(
        "demo",
        help="train an MLP on a 2x4 mesh (8 emulated CPU devices without accelerators) and print its plan",
        description="Train a 32-256-128-10 MLP on a data=2, model=4 mesh and print its plan and the "
        "communication of one training step.",
    )
    demo.add_argument(
        "--steps", type=_positive_int, default=20, help="training steps per epoch (default: 20)"
    )
    demo.add_argument(
        "--batch-size",
        type=_positive_int,
        default=64,
        help="global batch size, a multiple of 2 (default: 64)",
    )
    demo.set_defaults(run=_demo)
    return parser


def _add_emulate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--emulate-devices",
        type=_positive_int,
        default=8,
        metavar="N",
        help="CPU devices to emulate (default 8); accelerators, if present, stay the default devices",
    )


# -- devices ---------------------------------------------------------------------------


def _devices(args: argparse.Namespace) -> int:
    from ..core._backend import emulate_devices

    emulate_devices(args.emulate_devices)
    import jax

    devices = jax.devices()
    rows = [_device_row(d) for d in devices]
    meshes = _meshes_that_fit(len(devices))
    if args.json:
        print(json.dumps({"process_count": jax.process_count(), "devices": rows, "meshes": meshes}, indent=2))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(devices)} devices, {jax.process_count()} process(es)", title_justify="left")
    for column in ("id", "platform", "kind", "process", "coords", "memory"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[key]) if row[key] is not None else "-" for key in row))
    console = Console()
    console.print(table)
    console.print("Meshes that fit: " + "  ".join(meshes))
    return EXIT_OK


def _device_row(device: Any) -> dict[str, Any]:
    from ..core._format import format_bytes

    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    coords = getattr(device, "coords", None)
    return {
        "id": device.id,
        "platform": device.platform,
        "kind": device.device_kind,
        "process": device.process_index,
        "coords": list(coords) if coords is not None else None,
        "memory": format_bytes(limit) if limit else None,
    }


def _meshes_that_fit(count: int) -> list[str]:
    return [str(count)] + [f"{d}x{count // d}" for d in range(1, count + 1) if count % d == 0]


# -- plan ------------------------------------------------------------------------------


def _plan(args: argparse.Namespace) -> int:
    from ..core._backend import emulate_devices

    emulate_devices(args.emulate_devices)
    from ..core._distribution import ModelParallel
    from ..core._dry import dry_build, dry_plan
    from ..core._mesh import Mesh
    from ..core._resolve import DEFAULT_REPLICATE_BELOW
    from ..planner._auto import auto_rules

    mesh = Mesh.parse(args.mesh)
    build = _load_builder(args.model)
    _check_optimizer(args.optimizer)
    replicate_below = DEFAULT_REPLICATE_BELOW if args.replicate_below is None else args.replicate_below
    if args.memory_budget is not None and not args.auto:
        raise _InputError("--memory-budget chooses layouts for --auto: add --auto.")
    if args.memory_budget is not None and args.batch_size is None:
        raise _InputError("--memory-budget needs --batch-size (and --sequence-length for token inputs).")
    _check_batch_size(args.batch_size, mesh, args.batch_axis)
    if args.auto:
        with dry_build(build) as model:
            batch = (
                None if args.batch_size is None else _batch_spec(model, args.batch_size, args.sequence_length)
            )
            rules = auto_rules(
                model,
                mesh,
                model_axis=args.model_axis,
                batch_axis=args.batch_axis,
                replicate_below=replicate_below,
                memory_budget=args.memory_budget,
                batch=batch,
                optimizer=args.optimizer,
            )
    elif args.preset:
        rules = _preset(args.preset, args.model_axis)
    elif args.rules:
        rules = _rules_file(args.rules, build, mesh)
    else:
        rules = None
    distribution = ModelParallel(
        mesh,
        rules,
        batch_axis=args.batch_axis,
        on_indivisible=args.on_indivisible,
        replicate_below=replicate_below,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MeshLayoutWarning)
        plan = dry_plan(build, distribution, optimizer=args.optimizer)
    # The plan lists its own warnings (unmatched rules, grouped convolutions) under its table;
    # the others (indivisible shapes replicated) are printed after it, each once.
    messages = list(plan.warnings)
    messages += sorted(
        {str(w.message) for w in caught if issubclass(w.category, MeshLayoutWarning)}
        - set(messages)
        - {str(w.message) for w in caught if issubclass(w.category, UnmatchedRuleWarning)}
    )
    failure = None
    try:
        # Under a memory budget the planner replicates on purpose wherever the budget allows,
        # so the budget replaces the replication guard.
        guard = 1.0 if args.memory_budget is not None else args.max_replicated_fraction
        plan.check(max_replicated_fraction=guard, device_memory=args.device_memory)
    except MemoryBudgetError as err:
        failure = str(err)
    if args.json:
        data = plan.to_dict()
        data["memory_per_device"] = plan.memory(args.device_memory).to_dict()
        data["warnings"] = messages
        cost = getattr(rules, "cost", None)
        if cost is not None:
            data["predicted"] = {
                "wire_bytes_per_device": cost.wire_bytes,
                "wire_bytes_by_axis": dict(cost.wire_bytes_by_axis),
                "state_bytes_per_device": cost.state_bytes,
                "activation_bytes_per_device": cost.activation_bytes,
                "budget": cost.budget,
                "layouts": cost.layouts(),
            }
        data["valid"] = failure is None and not (args.strict and messages)
        data["failure"] = failure
        print(json.dumps(data, indent=2))
    else:
        from rich.console import Console

        console = Console(width=max(120, Console().width))
        console.print(plan)
        if getattr(rules, "cost", None) is not None:
            console.print(f"predicted: {rules.cost}", markup=False)
        for message in messages[len(plan.warnings) :]:
            console.print(f"warning: {message}", style="yellow", markup=False)
    if failure is not None:
        print(f"plan fails: {failure}", file=sys.stderr)
        return EXIT_PLAN_FAILS
    if args.strict and messages:
        print(f"plan fails: {len(messages)} warning(s) with --strict", file=sys.stderr)
        return EXIT_PLAN_FAILS
    return EXIT_OK


def _batch_spec(model: Any, batch_size: int, length: int | None) -> Any:
    """Abstract inputs for `model`: `batch_size` first, `length` for any other unknown dimension."""
    import jax
    import keras

    def spec(tensor: Any) -> Any:
        shape = [batch_size, *tensor.shape[1:]]
        if None in shape[1:]:
            if length is None:
                raise _InputError(
                    f"--batch-size: the input {tensor.name!r} has shape {tuple(tensor.shape)}; give its "
                    "other unknown dimensions with --sequence-length."
                )
            shape = [length if size is None else size for size in shape]
        return jax.ShapeDtypeStruct(tuple(shape), keras.backend.standardize_dtype(tensor.dtype))

    return keras.tree.map_structure(spec, _model_inputs(model))


def _model_inputs(model: Any) -> Any:
    """The model's symbolic inputs in their structure (a Sequential's one input as itself)."""
    try:
        return model.input
    except (AttributeError, ValueError):
        pass
    inputs = getattr(model, "inputs", None)
    if inputs:
        return inputs[0] if len(inputs) == 1 else list(inputs)
    raise _InputError(
        f"--batch-size: the model {model.name!r} has no defined inputs to size (a subclassed model?). "
        "Build it from keras.Input (a functional or Sequential model) to plan with --batch-size."
    )


def _check_batch_size(batch_size: int | None, mesh: Any, batch_axis: str | None) -> None:
    """Refuses a `--batch-size` that training could not split over the batch axis."""
    sizes = mesh_axis_sizes(mesh)
    axis = mesh.axis_names[0] if batch_axis is None else batch_axis
    if batch_size is None or axis not in sizes or batch_size % sizes[axis] == 0:
        return  # an unknown batch axis is reported with the distribution's own message
    raise _InputError(
        f"--batch-size {batch_size} cannot be split over batch axis {axis!r} of size {sizes[axis]}: "
        f"use a multiple of {sizes[axis]}."
    )


def _check_optimizer(name: str | None) -> None:
    """Refuses an `--optimizer` Keras does not know, before any model is built."""
    if name is None:
        return
    import keras

    try:
        keras.optimizers.get(name)
    except ValueError:
        known = sorted(
            n.lower()
            for n, value in vars(keras.optimizers).items()
            if isinstance(value, type)
            and issubclass(value, keras.optimizers.Optimizer)
            and _known_optimizer(n.lower())
        )
        raise _InputError(
            f"--optimizer {name!r}: Keras knows no optimizer by that name. Use one of: {', '.join(known)}."
        ) from None


def _known_optimizer(name: str) -> bool:
    import keras

    try:
        keras.optimizers.get(name)
    except Exception:
        return False
    return True


def _load_builder(spec: str) -> Callable[[], Any]:
    """A zero-argument function building the model named by `--model`."""
    if spec.endswith(".keras"):
        path = Path(spec)
        if not path.is_file():
            raise _InputError(f"--model {spec}: no such file.")
        try:
            with zipfile.ZipFile(path) as archive:
                config = json.loads(archive.read("config.json"))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as err:
            raise _InputError(f"--model {spec} is not a Keras archive with a config.json ({err}).") from None
        if not isinstance(config, dict):
            raise _InputError(f"--model {spec}: its config.json does not describe a Keras object.")
        # The plan needs the architecture only: compiling would create the saved optimizer's
        # variables, which a dry build refuses (plan an optimizer's state with --optimizer).
        config = {key: value for key, value in config.items() if key != "compile_config"}

        def deserialize() -> Any:
            import keras

            # Keras consumes parts of the config it deserializes: each build gets its own copy.
            return keras.saving.deserialize_keras_object(copy.deepcopy(config))

        return _checked_builder(deserialize, f"--model {spec}", "its config")
    module_name, sep, function = spec.rpartition(":")
    if not sep or not module_name or not function:
        raise _InputError(
            f"--model {spec!r}: give a saved model (PATH.keras) or a builder as MODULE:FUNCTION "
            "or FILE.py:FUNCTION."
        )
    module = _import(module_name, "--model")
    builder = getattr(module, function, None)
    if not callable(builder):
        raise _InputError(f"--model {spec!r}: {module_name} has no function {function!r}.")
    return _checked_builder(builder, f"--model {spec!r}", f"{function}()")


def _checked_builder(build: Callable[[], Any], option: str, what: str) -> Callable[[], Any]:
    """`build`, failing with one clear line when it raises or returns something that is not a model."""

    def checked() -> Any:
        import keras

        try:
            model = build()
        except MeshLayoutError:
            raise  # a rule or mesh problem found while building: reported as such
        except Exception as err:
            raise _InputError(
                f"{option}: building the model from {what} raised {type(err).__name__}: {_one_line(err)} "
                "(rerun with --traceback to see where)"
            ) from err
        if not isinstance(model, keras.Model):
            raise _InputError(
                f"{option}: {what} returned {type(model).__name__} ({model!r:.60}), not a keras.Model."
            )
        return model

    return checked


def _import(name: str, option: str) -> Any:
    try:
        if name.endswith(".py"):
            path = Path(name)
            spec = importlib.util.spec_from_file_location(path.stem, path)
            if spec is None or not path.is_file():
                raise _InputError(f"{option} {name}: no such file.")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except _InputError:
        raise
    except Exception as err:  # ImportError, or whatever the module raises as it runs
        raise _InputError(
            f"{option} {name}: cannot import it ({type(err).__name__}: {_one_line(err)})."
        ) from None


def _preset(name: str, model_axis: str) -> Any:
    """The rules of `--preset NAME` or `--preset NAME:LAYER,LAYER,...`, from the preset registry."""
    kind, colon, argument = name.partition(":")
    preset = _PRESET_REGISTRY.get(kind)
    if preset is None:
        raise _InputError(f"--preset {name!r}: unknown preset. Choose one of: {', '.join(PRESETS)}.")
    layers = [layer.strip() for layer in argument.split(",")] if colon else []
    if preset.takes_layers and (not layers or not all(layers)):
        raise _InputError(
            f"--preset {name!r}: the {kind!r} preset needs layer names in data-flow order, "
            f"e.g. --preset {kind}:fc1,fc2 (Received: {argument!r})."
        )
    if not preset.takes_layers and colon:
        raise _InputError(
            f"--preset {name!r}: the {kind!r} preset takes no layer names; use --preset {kind}."
        )
    return preset.build(layers, model_axis=model_axis)


def _rules_file(name: str, build: Callable[[], Any], mesh: Any) -> Any:
    path = Path(name)
    if not path.is_file():
        raise _InputError(f"--rules {name}: no such file.")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise _InputError(f"--rules {name} is not valid JSON: {err}.") from None
        rules = data.get("rules") if isinstance(data, dict) else data
        if not isinstance(rules, list):
            raise _InputError(
                f"--rules {name}: expected a list of [pattern, axes] pairs or {{'rules': [...]}}."
            )
        return [tuple(_json_rule(entry, name)) for entry in rules]
    if path.suffix == ".py":
        module = _import(name, "--rules")
        if callable(getattr(module, "rules", None)):
            from ..core._dry import dry_build

            with dry_build(build) as model:
                try:
                    return module.rules(model, mesh)
                except MeshLayoutError:
                    raise
                except Exception as err:
                    raise _InputError(
                        f"--rules {name}: rules(model, mesh) raised {type(err).__name__}: {_one_line(err)} "
                        "(rerun with --traceback to see where)"
                    ) from err
        if hasattr(module, "RULES"):
            return module.RULES
        raise _InputError(f"--rules {name} defines neither RULES nor a function rules(model, mesh).")
    raise _InputError(f"--rules {name}: use a .json or .py file.")


def _json_rule(entry: Any, name: str) -> tuple:
    if not isinstance(entry, list) or len(entry) not in (2, 3) or not isinstance(entry[1], list):
        raise _InputError(f"--rules {name}: each rule must be [pattern, [axes...]]; got {entry!r}.")
    return (entry[0], tuple(entry[1]), *entry[2:])


# -- demo ------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    from ._demo import run_demo

    run_demo(steps=args.steps, batch_size=args.batch_size)
    return EXIT_OK
