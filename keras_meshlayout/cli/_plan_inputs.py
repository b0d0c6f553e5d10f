"""What `keras-meshlayout plan` reads: the model builder, rules files, presets, the optimizer, batches.

Each helper raises `InputError` (one line, exit 2) for input the command cannot use, before
anything is built where it can.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import json
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..core._errors import MeshLayoutError
from ._args import InputError, one_line

__all__ = [
    "batch_spec",
    "check_batch_size",
    "check_optimizer",
    "load_builder",
    "preset_rules",
    "registry",
    "rules_file",
]


def registry() -> Any:
    """The preset registry (`_presets.PRESETS`), imported when a preset is asked for."""
    from ..planner._presets import PRESETS

    return PRESETS


def batch_spec(model: Any, batch_size: int, length: int | None) -> Any:
    """Abstract inputs for `model`: `batch_size` first, `length` for any other unknown dimension."""
    import jax
    import keras

    def spec(tensor: Any) -> Any:
        shape = [batch_size, *tensor.shape[1:]]
        if None in shape[1:]:
            if length is None:
                raise InputError(
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
    raise InputError(
        f"--batch-size: the model {model.name!r} has no defined inputs to size (a subclassed model?). "
        "Build it from keras.Input (a functional or Sequential model) to plan with --batch-size."
    )


def check_batch_size(batch_size: int | None, mesh: Any, batch_axis: str | None) -> None:
    """Refuses a `--batch-size` that training could not split over the batch axis."""
    from ..core._mesh import mesh_axis_sizes

    sizes = mesh_axis_sizes(mesh)
    axis = mesh.axis_names[0] if batch_axis is None else batch_axis
    if batch_size is None or axis not in sizes or batch_size % sizes[axis] == 0:
        return  # an unknown batch axis is reported with the distribution's own message
    raise InputError(
        f"--batch-size {batch_size} cannot be split over batch axis {axis!r} of size {sizes[axis]}: "
        f"use a multiple of {sizes[axis]}."
    )


def check_optimizer(name: str | None) -> None:
    """Refuses an `--optimizer` Keras does not know, before any model is built."""
    if name is None:
        return
    from ..core._dry import names_handed_back
    from ..core._errors import InvalidOptionError
    from ..core._memory import optimizer_of

    try:
        with names_handed_back():  # the plan's optimizer is then `adam/`, as the README shows, not `adam_1/`
            optimizer_of(name)
    except InvalidOptionError as error:
        raise InputError(f"--optimizer {name!r}: {error}") from None


def load_builder(spec: str) -> Callable[[], Any]:
    """A zero-argument function building the model named by `--model`."""
    if spec.endswith(".keras"):
        path = Path(spec)
        if not path.is_file():
            raise InputError(f"--model {spec}: no such file.")
        try:
            with zipfile.ZipFile(path) as archive:
                config = json.loads(archive.read("config.json"))
        except (zipfile.BadZipFile, KeyError, json.JSONDecodeError) as err:
            raise InputError(f"--model {spec} is not a Keras archive with a config.json ({err}).") from None
        if not isinstance(config, dict):
            raise InputError(f"--model {spec}: its config.json does not describe a Keras object.")
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
        raise InputError(
            f"--model {spec!r}: give a saved model (PATH.keras) or a builder as MODULE:FUNCTION "
            "or FILE.py:FUNCTION."
        )
    module = _import(module_name, "--model")
    builder = getattr(module, function, None)
    if not callable(builder):
        raise InputError(f"--model {spec!r}: {module_name} has no function {function!r}.")
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
            raise InputError(
                f"{option}: building the model from {what} raised {type(err).__name__}: {one_line(err)} "
                "(rerun with --traceback to see where)"
            ) from err
        if not isinstance(model, keras.Model):
            raise InputError(
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
                raise InputError(f"{option} {name}: no such file.")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        return importlib.import_module(name)
    except InputError:
        raise
    except Exception as err:  # ImportError, or whatever the module raises as it runs
        raise InputError(
            f"{option} {name}: cannot import it ({type(err).__name__}: {one_line(err)})."
        ) from None


def preset_rules(name: str, model_axis: str) -> Any:
    """The rules of `--preset NAME` or `--preset NAME:LAYER,LAYER,...`, from the preset registry."""
    kind, colon, argument = name.partition(":")
    preset = registry().get(kind)
    if preset is None:
        usages = (preset.usage for preset in registry().values())
        raise InputError(f"--preset {name!r}: unknown preset. Choose one of: {', '.join(usages)}.")
    layers = [layer.strip() for layer in argument.split(",")] if colon else []
    if preset.takes_layers and (not layers or not all(layers)):
        raise InputError(
            f"--preset {name!r}: the {kind!r} preset needs layer names in data-flow order, "
            f"e.g. --preset {kind}:fc1,fc2 (Received: {argument!r})."
        )
    if not preset.takes_layers and colon:
        raise InputError(f"--preset {name!r}: the {kind!r} preset takes no layer names; use --preset {kind}.")
    return preset.build(layers, model_axis=model_axis)


def rules_file(name: str, build: Callable[[], Any], mesh: Any) -> Any:
    path = Path(name)
    if not path.is_file():
        said = "a directory, not a rules file (.json or .py)" if path.is_dir() else "no such file"
        raise InputError(f"--rules {name}: {said}.")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise InputError(f"--rules {name} is not valid JSON: {err}.") from None
        except RecursionError:
            raise InputError(
                f"--rules {name} nests its JSON too deeply to read (more than about "
                f"{sys.getrecursionlimit()} levels). A rules file is a flat list of "
                '[pattern, axes] pairs, e.g. [[".*dense/kernel", [null, "model"]]].'
            ) from None
        rules = data.get("rules") if isinstance(data, dict) else data
        if not isinstance(rules, list):
            raise InputError(
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
                    raise InputError(
                        f"--rules {name}: rules(model, mesh) raised {type(err).__name__}: {one_line(err)} "
                        "(rerun with --traceback to see where)"
                    ) from err
        if hasattr(module, "RULES"):
            return module.RULES
        raise InputError(f"--rules {name} defines neither RULES nor a function rules(model, mesh).")
    raise InputError(f"--rules {name}: use a .json or .py file.")


def _json_rule(entry: Any, name: str) -> tuple:
    if not isinstance(entry, list) or len(entry) not in (2, 3) or not isinstance(entry[1], list):
        raise InputError(f"--rules {name}: each rule must be [pattern, [axes...]]; got {entry!r}.")
    return (entry[0], tuple(entry[1]), *entry[2:])
