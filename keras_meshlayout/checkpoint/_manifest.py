"""What a checkpoint holds, and the checks made against it before anything is loaded.

A checkpoint is a directory: the arrays (Orbax's `model.orbax/` and
`optimizer.orbax/`, or one Keras `model.weights.h5`), the plan (`plan.json`)
and the manifest (`manifest.json`, written last: its presence marks a
complete checkpoint), which lists every variable (path, shape, dtype, kind),
the optimizer, the random state, the position in training and the checksums
of the other files. This module holds the format, reads and checks the
manifest and the plan, and checks the model and the files against them.
"""

from __future__ import annotations

import json
import re
import warnings
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras

from ..core._errors import CheckpointError, MeshLayoutWarning
from . import _orbax_store  # imports no Orbax until a save or load uses it

if TYPE_CHECKING:
    from ..core._plan import Plan

H5_FORMAT = 1  # the weights in one Keras .weights.h5 file
ORBAX_FORMAT = 2  # the arrays in Orbax checkpoints, each process writing and reading its own shards
WEIGHTS = "model.weights.h5"
PLAN = "plan.json"
MANIFEST = "manifest.json"  # written last: its presence marks a complete checkpoint
_MANIFEST_KEYS = ("format", "variables", "weights_sha256")


def read_manifest(source: Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory `source`, checked field by field against a save's."""
    path = source / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint {source} has no {MANIFEST}: it was not written by kml.save_checkpoint or its "
            "save did not finish. Nothing was loaded; the model is unchanged. Fix: use an earlier checkpoint."
        )
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError alike
        raise CheckpointError(
            f"Checkpoint {source}: {MANIFEST} is corrupt ({err}). Nothing was loaded; the model is "
            "unchanged. Fix: use an earlier checkpoint."
        ) from None
    if not isinstance(manifest, dict) or any(key not in manifest for key in _MANIFEST_KEYS):
        keys = sorted(manifest) if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(
            f"Checkpoint {source}: {MANIFEST} is corrupt: it needs the keys {list(_MANIFEST_KEYS)}. "
            f"Received: {keys}. Nothing was loaded; the model is unchanged. Fix: use an earlier checkpoint."
        )
    if manifest["format"] not in (H5_FORMAT, ORBAX_FORMAT):
        raise CheckpointError(
            f"Checkpoint {source} has format {manifest['format']!r}; this version reads formats {H5_FORMAT} "
            f"(h5) and {ORBAX_FORMAT} (Orbax). Nothing was loaded; the model is unchanged."
        )
    _check_schema(manifest, path)
    return manifest


def _check_schema(manifest: Mapping[str, Any], path: Path) -> None:
    """Raises `CheckpointError` naming the first field of `path` that is not what a save writes."""

    def fail(field: str, expected: str, received: Any) -> None:
        shown = "missing" if received is _MISSING else repr(received)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise CheckpointError(
            f"{path} is corrupt: the field {field} must be {expected}. Received: {shown}. Nothing was "
            "loaded; the model is unchanged. Fix: use an earlier checkpoint, or restore this file from a "
            "copy (kml.save_checkpoint writes it)."
        )

    if not (_text(manifest["weights_sha256"]) and re.fullmatch(r"[0-9a-f]{64}", manifest["weights_sha256"])):
        fail("weights_sha256", "a SHA-256 digest (64 hexadecimal digits)", manifest["weights_sha256"])
    for key in ("plan_sha256", "model", "keras"):
        if manifest.get(key) is not None and not _text(manifest[key]):
            fail(key, "a string or null", manifest[key])
    optimizer = manifest.get("optimizer")
    if optimizer is not None and not (
        isinstance(optimizer, dict) and all(_text(optimizer.get(k)) for k in ("name", "class"))
    ):
        fail("optimizer", 'null or {"name": str, "class": str}', optimizer)
    _check_variables_field(manifest["variables"], fail)
    if manifest["format"] == ORBAX_FORMAT:
        _check_files_field(manifest.get("files", _MISSING), fail)
    training = manifest.get("training")
    if training is not None:
        if not isinstance(training, dict):
            fail("training", '{"epoch": int, "batch": int}', training)
        for key in ("epoch", "batch", "step"):
            if not _natural(training.get(key, 0)):
                fail(f"training.{key}", "a non-negative integer", training[key])
    if manifest.get("rng") is not None:
        _check_rng_field(manifest["rng"], fail)


def _text(value: Any) -> bool:
    return isinstance(value, str)


def _natural(value: Any, below: int | None = None) -> bool:
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and value >= 0
        and (below is None or value < below)
    )


def _shape_field(value: Any) -> bool:
    return isinstance(value, list) and all(map(_natural, value))


def _check_variables_field(variables: Any, fail: Callable[[str, str, Any], None]) -> None:
    if not isinstance(variables, list):
        fail("variables", "a list of {path, shape, dtype, kind} entries", variables)
    for i, entry in enumerate(variables):
        where = f"variables[{i}]"
        if not isinstance(entry, dict):
            fail(where, "a {path, shape, dtype, kind} entry", entry)
        for key, expected, ok in (
            ("path", "a string", _text),
            ("dtype", "a string", _text),
            ("shape", "a list of non-negative integers", _shape_field),
        ):
            if not ok(entry.get(key, _MISSING)):
                fail(f"{where}.{key}", expected, entry.get(key, _MISSING))
        if entry.get("kind", "model") not in ("model", "optimizer"):
            fail(f"{where}.kind", '"model" or "optimizer"', entry["kind"])


def _check_files_field(files: Any, fail: Callable[[str, str, Any], None]) -> None:
    if not isinstance(files, dict):
        fail("files", "a {name: {bytes, sha256}} mapping (an Orbax checkpoint's files)", files)
    for name, entry in files.items():
        if not (
            isinstance(entry, dict)
            and _natural(entry.get("bytes", _MISSING))
            and (entry.get("sha256") is None or _text(entry["sha256"]))
        ):
            fail(f"files[{name!r}]", '{"bytes": int, "sha256": str or null}', entry)


def _check_rng_field(rng: Any, fail: Callable[[str, str, Any], None]) -> None:
    def seed(value: Any) -> bool:
        return isinstance(value, list) and len(value) == 2 and all(_natural(x, 1 << 32) for x in value)

    if not isinstance(rng, dict) or not isinstance(rng.get("seed_generators"), list):
        fail("rng", '{"seed_generators": [...], "global": ...}', rng)
    for i, entry in enumerate(rng["seed_generators"]):
        if not isinstance(entry, dict) or not seed(entry.get("state", _MISSING)):
            fail(f"rng.seed_generators[{i}]", '{"path": str, "state": [two uint32]}', entry)
    if rng.get("global") is not None and not seed(rng["global"]):
        fail("rng.global", "null or [two uint32]", rng["global"])


_MISSING = object()


def read_plan(source: Path, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    path = source / PLAN
    expected = manifest.get("plan_sha256")
    if expected is None:
        return None
    try:
        if _orbax_store.sha256(path) != expected:
            raise ValueError("its checksum does not match the manifest")
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"Checkpoint {source}: {PLAN} is missing, truncated or corrupt ({err}). Nothing was loaded; "
            "the model is unchanged. Fix: use an earlier checkpoint."
        ) from None


def check_variables(
    manifest: Mapping[str, Any],
    saved: list[dict[str, Any]],
    model: keras.Model,
    with_optimizer: bool,
    source: Path,
) -> None:
    """Raises `CheckpointError` unless the saved variables line up with the model's, in order."""
    current = [v for v in describe(model) if with_optimizer or v["kind"] == "model"]
    if [_signature(v) for v in saved] == [_signature(v) for v in current]:
        if with_optimizer:
            _warn_other_optimizer(manifest, model, source)
        return
    _check_manifest_against_weights(manifest, source)
    saved_names = _names(saved, manifest.get("model"), (manifest.get("optimizer") or {}).get("name"))
    optimizer = getattr(model, "optimizer", None)
    current_names = _names(current, model.name, optimizer.name if optimizer is not None else None)
    old = dict(zip(saved_names, saved, strict=True))
    new = dict(zip(current_names, current, strict=True))
    lines = [f"  missing from the checkpoint: {p} {_shape(new[p])}" for p in new if p not in old]
    lines += [f"  only in the checkpoint: {p} {_shape(old[p])}" for p in old if p not in new]
    lines += [
        f"  different: {p}: checkpoint {_shape(old[p])} {old[p]['dtype']}, "
        f"model {_shape(new[p])} {new[p]['dtype']}"
        for p in new
        if p in old and _signature(old[p]) != _signature(new[p])
    ]
    if not lines or len(set(old) & set(new)) < min(len(old), len(new)) / 2:
        # The names do not line up (layers named automatically): compare position by position.
        lines = [
            f"  variable #{i}: checkpoint {a['path']} {_shape(a)} {a['dtype']}, "
            f"model {b['path']} {_shape(b)} {b['dtype']}"
            for i, (a, b) in enumerate(zip(saved, current, strict=False))
            if _signature(a) != _signature(b)
        ]
        if len(saved) != len(current):
            lines.append(f"  the checkpoint has {len(saved)} variables, the model {len(current)}")
    saved_optimizer = manifest.get("optimizer") or {}
    if with_optimizer and saved_optimizer.get("class") not in (None, type(optimizer).__name__):
        lines.insert(
            0, f"  optimizer: checkpoint {saved_optimizer['class']}, model {type(optimizer).__name__}"
        )
    shown = lines[:20] + ([f"  ... and {len(lines) - 20} more"] if len(lines) > 20 else [])
    raise CheckpointError(
        f"Checkpoint {source} does not match the model ({_count(saved)} saved, {_count(current)} in the "
        "model):\n" + "\n".join(shown) + "\nNothing was loaded; the model is unchanged. Fix: build the "
        "same model (and compile it with the same optimizer, to restore the optimizer state) before "
        "loading; to load only the model weights, load into the model before compiling it."
    )


def _warn_other_optimizer(manifest: Mapping[str, Any], model: keras.Model, source: Path) -> None:
    """Warns when optimizer state saved by one optimizer class is loaded into another of the same slots.

    Adam's moments load into AdamW (and Adam into Lion's one slot's shape, or Adamax) variable for
    variable: the shapes match, so nothing refuses it, but the state means what the saved optimizer
    meant by it, and the step count (and its learning-rate schedule) carries on from the checkpoint.
    """
    saved = (manifest.get("optimizer") or {}).get("class")
    now = type(model.optimizer).__name__
    if saved in (None, now):
        return
    warnings.warn(
        f"Checkpoint {source} holds optimizer state saved by {saved}; it was loaded into the model's "
        f"{now}, slot for slot (the shapes match), and its step count (optimizer.iterations, which "
        "drives the learning-rate schedule) carries on from the checkpoint. If that is not what you meant, "
        f"compile the model with {saved} before loading; to start {now} afresh, load into the model "
        "before compiling it (the weights only).",
        MeshLayoutWarning,
        stacklevel=3,
    )


def _check_manifest_against_weights(manifest: Mapping[str, Any], source: Path) -> None:
    """Raises `CheckpointError` if the manifest lists shapes the weights file does not hold.

    The weights file is checked against its checksum, the manifest is not: before a
    mismatch is blamed on the model, make sure it is not the manifest that was edited.
    """
    stored: Counter[tuple[int, ...]] = Counter()
    where = WEIGHTS
    if manifest["format"] == ORBAX_FORMAT:
        found = _orbax_store.stored_shapes(source)
        if found is None:
            return  # unreadable: the load reports it
        stored, where = found, "model.orbax/ and optimizer.orbax/"
    else:
        import h5py

        def visit(_: str, item: Any) -> None:
            if isinstance(item, h5py.Dataset):
                stored[tuple(item.shape)] += 1

        try:
            with h5py.File(source / WEIGHTS, "r") as f:
                f.visititems(visit)
        except OSError:
            return  # unreadable: Keras's own load reports it
    listed = Counter(tuple(v["shape"]) for v in manifest["variables"])
    extra = listed - stored
    if not extra:
        return
    lines = [
        f"  variables[{i}] {v['path']}: shape {_shape(v)} in the manifest; the weights file holds "
        f"{stored[tuple(v['shape'])]} array(s) of that shape, the manifest lists {listed[tuple(v['shape'])]}"
        for i, v in enumerate(manifest["variables"])
        if tuple(v["shape"]) in extra
    ]
    raise CheckpointError(
        f"Checkpoint {source}: {MANIFEST} disagrees with the arrays stored in {where}:\n"
        + "\n".join(lines[:10] + ([f"  ... and {len(lines) - 10} more"] if len(lines) > 10 else []))
        + "\nThe manifest was edited or damaged after the save (the weights file matches its checksum), "
        "so the model was not compared with it. Nothing was loaded; the model is unchanged. Fix: use an "
        f"earlier checkpoint, or restore {MANIFEST} from a copy."
    )


def _signature(entry: Mapping[str, Any]) -> tuple:
    return entry.get("kind", "model"), tuple(entry["shape"]), entry["dtype"]


def _names(entries: Sequence[Mapping[str, Any]], model: str | None, optimizer: str | None) -> list[str]:
    """Variable paths without the model's and the optimizer's own names, which vary between builds."""
    names = []
    for entry in entries:
        path = entry["path"]
        if entry.get("kind") == "optimizer":
            if optimizer and path.startswith(optimizer + "/"):
                path = path[len(optimizer) + 1 :]
            if model and path.startswith(model + "_"):
                path = path[len(model) + 1 :]
            path = "optimizer: " + path
        elif model and path.startswith(model + "/"):
            path = path[len(model) + 1 :]
        names.append(path)
    return names


def _count(entries: Sequence[Mapping[str, Any]]) -> str:
    slots = sum(1 for v in entries if v.get("kind") == "optimizer")
    return f"{len(entries) - slots} model and {slots} optimizer variables"


def _shape(entry: Mapping[str, Any]) -> str:
    return str(tuple(entry["shape"]))


def describe(model: keras.Model) -> list[dict[str, Any]]:
    optimizer = getattr(model, "optimizer", None)
    slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return [
        {"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype), "kind": kind}
        for kind, variables in (("model", model.weights), ("optimizer", slots))
        for v in variables
    ]


def optimizer_info(model: keras.Model) -> dict[str, str] | None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    return {"name": optimizer.name, "class": type(optimizer).__name__}


def model_variables(model: keras.Model, with_optimizer: bool = True) -> list[keras.Variable]:
    optimizer = getattr(model, "optimizer", None)
    built = with_optimizer and optimizer is not None and optimizer.built
    return list(model.weights) + (list(optimizer.variables) if built else [])


def current_plan(model: keras.Model, distribution: Any = None) -> Plan | None:
    from ..core._distribution import ModelParallel

    distribution = distribution or keras.distribution.distribution()
    if not isinstance(distribution, ModelParallel):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MeshLayoutWarning)
        return distribution.plan(model)


def orbax_damage(source: Path, manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with an Orbax checkpoint's files, or `None` (sizes everywhere, checksums of metadata)."""
    listing = manifest["files"]
    if _orbax_store.digest(listing) != manifest["weights_sha256"]:
        return f'the file list in {MANIFEST} does not match its "weights_sha256" (edited or damaged)'
    return _orbax_store.damage(source, listing)


def complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def verified(path: Path) -> bool:
    """Whether `path` holds a complete checkpoint whose files match their checksums."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
        if manifest.get("format") == ORBAX_FORMAT:
            if orbax_damage(path, manifest) is not None:
                return False
        elif _orbax_store.sha256(path / WEIGHTS) != manifest["weights_sha256"]:
            return False
        plan = manifest.get("plan_sha256")
        return plan is None or _orbax_store.sha256(path / PLAN) == plan
    except (OSError, ValueError, KeyError, TypeError):
        return False
