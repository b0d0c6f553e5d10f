"""`load_checkpoint`: everything checked before the first value is assigned, and put back on failure."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from ..core._errors import CheckpointError
from ..core._progress import spinner
from . import _atomic, _manifest, _orbax_store, _plan_diff, _rng, _save  # _orbax_store: no Orbax until used

if TYPE_CHECKING:
    from ..core._distribution import ModelParallel

__all__ = ["load_checkpoint"]


def load_checkpoint(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    distribution: ModelParallel | None = None,
    rollback: bool = True,
) -> _plan_diff.PlanDiff | None:
    """Restores a `save_checkpoint` checkpoint into `model`, on the current distribution.

    Build the model under the distribution you want first: each variable keeps
    the layout the current plan gives it, whatever mesh the checkpoint was
    saved on. The optimizer state is restored when the model is compiled (its
    optimizer is built here if it is not yet); into a model that is not
    compiled, or from a checkpoint without optimizer state, only the model
    weights are loaded. Everything is checked before the first value is
    assigned, and should Keras still fail part-way, every variable is put back
    (see `rollback`).

    Variables are matched in order, the way Keras's own loading matches them,
    so a rebuilt model whose layers got other automatic names still loads.
    The model's random seed generators get their saved state back when the
    model has as many as the checkpoint (a model with other random layers
    keeps its own).

    If `directory` is missing because its save was killed between moving the
    old checkpoint aside and the new one into place, the newest complete one
    of the two is verified and moved into place first.

    Args:
        model: The model to restore into.
        directory: A checkpoint directory written by `save_checkpoint`.
        distribution: The `kml.ModelParallel` to diff the saved plan against;
            defaults to the current distribution.
        rollback: Keep the variables' previous values until the load has
            completed, to put them back if it fails part-way (an I/O error, a
            custom layer's loader raising, running out of memory). This holds
            up to one more copy of the model (in device memory on accelerators)
            while loading; pass `False` for a model that fills its devices. The
            checks made before loading, which catch a checkpoint that is
            corrupt, half-written or made for another model, apply either way.

    Returns:
        The `PlanDiff` between the saved plan and the current one, or `None`
        when either side has no distribution.

    Raises:
        CheckpointError: the directory is missing, half-written or corrupt, or
            its variables do not match the model's (the message lists the
            missing, extra and reshaped ones): the model is left untouched.
            Also when loading fails part-way: with `rollback`, every variable
            is put back; without, the message says the model is partly loaded.

    Example:
        >>> import keras, keras_meshlayout as kml, tempfile, os
        >>> def build():
        ...     return keras.Sequential([keras.Input((8,)), keras.layers.Dense(4096, name="d")], name="m")
        >>> rules = [(r".*kernel", (None, "model"))]
        >>> with kml.ModelParallel(kml.Mesh(data=2, model=4), rules).scope():
        ...     path = kml.save_checkpoint(build(), os.path.join(tempfile.mkdtemp(), "ckpt"))
        >>> with kml.ModelParallel(kml.Mesh(data=1, model=8), rules).scope():
        ...     model = build()
        ...     diff = kml.load_checkpoint(model, path)
        >>> [(c.path, c.bytes_before, c.bytes_after) for c in diff.changes]
        [('m/d/kernel', 32768, 16384)]
    """
    _, diff = load(model, Path(directory), distribution, rollback=rollback)
    return diff


def load(
    model: keras.Model,
    source: Path,
    distribution: Any,
    *,
    rollback: bool = True,
    resume: bool = False,
) -> tuple[dict[str, Any], _plan_diff.PlanDiff | None]:
    _save.wait_for_background_saves(source)
    recovered, removed = _atomic.recover(source)
    if recovered is not None:
        source = recovered
    if source.is_file():
        raise CheckpointError(_a_file(source))
    if not source.is_dir():
        raise CheckpointError(f"No checkpoint at {source}.{_atomic.siblings_hint(source, removed)}")
    manifest = _manifest.read_manifest(source)
    weights = source / _manifest.WEIGHTS
    orbax = manifest["format"] == _manifest.ORBAX_FORMAT
    _check_arrays(source, manifest)
    saved_plan = _manifest.read_plan(source, manifest)

    saved = manifest["variables"]
    optimizer = getattr(model, "optimizer", None)
    with_optimizer = optimizer is not None and any(v.get("kind") == "optimizer" for v in saved)
    if with_optimizer and not optimizer.built:
        # What fit would do first; its variables take the current distribution's layouts.
        optimizer.build(model.trainable_variables)
    if not with_optimizer:
        saved = [v for v in saved if v.get("kind") != "optimizer"]
    _manifest.check_variables(manifest, saved, model, with_optimizer, source)
    seeds = _rng.seed_states_to_restore(model, manifest, source, resume)

    variables = _manifest.model_variables(model, with_optimizer) + [variable for variable, _ in seeds]
    # Kept alive to put back (nothing is copied, but their memory is not freed until the end).
    values = [v.value for v in variables] if rollback else None
    skip = [] if with_optimizer or optimizer is None else [optimizer]
    try:
        if orbax:
            _load_orbax(model, source, with_optimizer, rollback)
        else:
            with spinner("checkpoint") as step:
                step(f"reading {weights.name}")
                model.load_weights(weights, objects_to_skip=skip) if skip else model.load_weights(weights)
        for variable, state in seeds:
            variable.assign(np.asarray(state, dtype=variable.dtype))
    except BaseException as err:
        if values is not None:
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)
        if not isinstance(err, Exception):
            raise
        raise _load_failed(source, err, rolled_back=values is not None) from err
    current = _manifest.current_plan(model, distribution)
    diff = None if saved_plan is None or current is None else _plan_diff.plan_diff(saved_plan, current)
    return manifest, diff


def _a_file(source: Path) -> str:
    """Why a file is no checkpoint (a checkpoint is a directory), and what loads it."""
    try:
        with open(source, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    if source.name == _manifest.MANIFEST or source.parent.joinpath(_manifest.MANIFEST).is_file():
        what = f"a file inside the checkpoint {source.parent}. Fix: pass the directory, {source.parent}."
    elif source.name.endswith(".keras"):
        what = (
            "a Keras model file (.keras, written by model.save). Fix: load it with "
            "keras.saving.load_model(path), or model.load_weights(path) into a model built under the "
            "distribution; kml.load_checkpoint reads the directories kml.save_checkpoint writes."
        )
    elif head == b"\x89HDF\r\n\x1a\n":
        what = (
            "an HDF5 file: Keras weights (.weights.h5, written by model.save_weights). Fix: load it with "
            "model.load_weights(path), into a model built (and compiled, for the optimizer state) under "
            "the distribution; kml.load_checkpoint reads the directories kml.save_checkpoint writes."
        )
    else:
        what = "a file. Fix: pass the directory kml.save_checkpoint wrote."
    return f"{source} is not a checkpoint: a checkpoint is a directory, and this is {what}"


def _check_arrays(source: Path, manifest: Mapping[str, Any]) -> None:
    """Raises `CheckpointError` if the checkpoint's arrays are missing, truncated or corrupt."""
    if manifest["format"] == _manifest.ORBAX_FORMAT:
        problem = _manifest.orbax_damage(source, manifest)
        if problem is not None:
            raise CheckpointError(
                f"Checkpoint {source}: its arrays are missing, truncated or corrupt: {problem}. Nothing was "
                "loaded; the model is unchanged. Fix: use an earlier checkpoint."
            )
        return
    weights = source / _manifest.WEIGHTS
    if not weights.is_file() or _orbax_store.sha256(weights) != manifest["weights_sha256"]:
        raise CheckpointError(
            f"Checkpoint {source}: {_manifest.WEIGHTS} is missing, truncated or corrupt (its checksum "
            "does not match the manifest). Nothing was loaded; the model is unchanged. Fix: use an "
            "earlier checkpoint."
        )


def _load_failed(source: Path, err: Exception, *, rolled_back: bool) -> CheckpointError:
    """The error of a load that failed part-way, saying what became of the model."""
    outcome = (
        "Every variable was put back as it was; the model is unchanged."
        if rolled_back
        else "The model is partly loaded (rollback=False): load it again, or rebuild it."
    )
    memory = "memory" in str(err).lower() or "resource_exhausted" in str(err).lower()
    hint = " If memory ran out, rollback=False holds one copy of the model fewer." if memory else ""
    return CheckpointError(
        f"Loading checkpoint {source} failed part-way ({type(err).__name__}: {err}). {outcome}{hint}"
    )


def _load_orbax(model: keras.Model, source: Path, with_optimizer: bool, rollback: bool) -> None:
    """Reads every array onto its variable's current sharding (each process its own slices), and assigns.

    With `rollback`, everything is read before the first variable is assigned. Without, the
    arrays are read and assigned a group at a time, each variable's previous value freed as
    it goes, so that the load holds at most one group beside the model.
    """
    import jax

    kinds = {"model": list(model.weights)}
    if with_optimizer:
        kinds["optimizer"] = list(model.optimizer.variables)
    targets = {
        kind: [
            jax.ShapeDtypeStruct(v.value.shape, v.value.dtype, sharding=v.value.sharding) for v in variables
        ]
        for kind, variables in kinds.items()
    }
    if rollback:
        restored = _orbax_store.restore(source, targets)
        for kind, variables in kinds.items():
            for variable, value in zip(variables, restored[kind], strict=True):
                variable.assign(value)
    else:
        _orbax_store.restore_into(
            source,
            targets,
            lambda kind, i, value: kinds[kind][i].assign(value),
            group_bytes=_orbax_store.GROUP_BYTES,
            release=lambda kind, i: kinds[kind][i].value.delete(),  # freed before its group is read
        )
