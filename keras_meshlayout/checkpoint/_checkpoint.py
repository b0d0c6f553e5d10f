"""Checkpoints that carry their plan, load on any mesh, never half-apply, and resume exactly.

Keras's own formats (`model.save`/`load_model`, `save_weights`/`load_weights`)
already restore into whatever layout the current distribution gives each
variable. `save_checkpoint` and `load_checkpoint` add what they lack:

- the plan (mesh and resolved layouts) saved beside the weights, as JSON, and
  a diff of that plan against the current one on load;
- a manifest of every variable (path, shape, dtype) and checksums of the
  files, checked *before* anything is assigned, so a checkpoint for another
  model, a truncated or corrupt file, or a half-written directory is a clear
  error and the model in memory is left as it was; should Keras still fail
  part-way through a load, every variable is put back as it was;
- atomic saves: everything is written to a hidden sibling directory and moved
  into place only when complete, so an interrupted save never leaves a
  checkpoint that looks complete.

`ResumableCheckpoint` is a training callback built on the two: it backs
training up every few steps and, after a crash or a pre-emption, resumes it
exactly where the last backup was taken, mid-epoch included, on any mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import time
import uuid
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import keras
import numpy as np

from .. import _compat
from ..core._errors import CheckpointError, InvalidOptionError, MeshLayoutWarning
from ..core._format import format_bytes, to_text
from ..core._plan import Plan
from ._orbax_store import sha256 as _sha256  # imports no Orbax until a save or load uses it

if TYPE_CHECKING:
    import rich.console

    from ..core._distribution import ModelParallel

__all__ = [
    "LayoutChange",
    "PlanDiff",
    "ResumableCheckpoint",
    "load_checkpoint",
    "plan_diff",
    "save_checkpoint",
]

FORMAT = 1  # the weights in one Keras .weights.h5 file
ORBAX_FORMAT = 2  # the arrays in Orbax checkpoints, each process writing and reading its own shards
WEIGHTS = "model.weights.h5"
PLAN = "plan.json"
MANIFEST = "manifest.json"  # written last: its presence marks a complete checkpoint
_MANIFEST_KEYS = ("format", "variables", "weights_sha256")


def save_checkpoint(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    distribution: ModelParallel | None = None,
    storage: Literal["h5", "orbax"] = "h5",
) -> Path:
    """Saves the weights (optimizer state included), the plan and a manifest, atomically.

    Everything is written to a hidden sibling directory
    (`.NAME.partial-HOST-PID-*`) that replaces `directory` only once complete:
    a save that is interrupted leaves the previous checkpoint in place, and
    never one that looks complete. The next save or load finishes a save that
    was killed while moving into place (so the newest complete checkpoint is
    never lost) and removes what killed saves left behind, once the process
    that wrote them is gone.

    The state of every random seed generator (`keras.random.SeedGenerator`,
    as in `Dropout`) is saved in the manifest, so that training resumed from
    the checkpoint draws the same random numbers.

    Args:
        model: The model, built (and compiled, with its optimizer built, to
            include the optimizer state).
        directory: Checkpoint directory; replaced if it exists.
        distribution: The `kml.ModelParallel` whose plan to save; defaults to
            the current distribution (no plan is saved without one).
        storage: How the arrays are stored. `"h5"`: one Keras
            `model.weights.h5` file, every variable gathered whole (in a
            multi-process run, by process 0). `"orbax"`: Orbax checkpoints
            (`model.orbax/`, `optimizer.orbax/`, on TensorStore) that every
            process writes its own shards into, one copy of each, and that a
            load reads, in every process, only the slices its devices hold
            under the current plan. `load_checkpoint` reads either. Every
            process must call `save_checkpoint` with `"orbax"`, and the
            directory must be on a file system they all see.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: the save could not be written (a full disk, a
            read-only directory, any `OSError`): the message names the file
            and says whether a previous checkpoint at `directory` is intact
            (it always is: nothing replaces it until the new one is complete).

    Example:
        >>> import keras, keras_meshlayout as kml, tempfile, os
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*kernel", (None, "model"))])
        >>> with dist.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4096, name="d")], name="m")
        >>> path = kml.save_checkpoint(model, os.path.join(tempfile.mkdtemp(), "step_1"), distribution=dist)
        >>> sorted(p.name for p in path.iterdir())
        ['manifest.json', 'model.weights.h5', 'plan.json']
        >>> path = kml.save_checkpoint(model, path.with_name("step_2"), distribution=dist, storage="orbax")
        >>> sorted(p.name for p in path.iterdir())
        ['manifest.json', 'model.orbax', 'plan.json']
    """
    if storage not in ("h5", "orbax"):
        raise InvalidOptionError(f'storage must be "h5" or "orbax". Received: storage={storage!r}.')
    return _save_everywhere(model, Path(directory), distribution, storage=storage)


def load_checkpoint(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    distribution: ModelParallel | None = None,
    rollback: bool = True,
) -> PlanDiff | None:
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
    _, diff = _load(model, Path(directory), distribution, rollback=rollback)
    return diff


class ResumableCheckpoint(keras.callbacks.Callback):
    """Backs training up as it goes and resumes it exactly where it stopped, on any mesh.

    Pass it to `fit`; if the run dies (an exception, a pre-emption, SIGKILL),
    call the same `fit` again, in a new process if need be, with a model built
    and compiled the same way: it restores the weights, the optimizer state
    and the position in training from its checkpoint, and the run ends with the
    weights an uninterrupted run would have had, as long as the data come in
    the same order (`shuffle=False`, or a dataset that replays each epoch in
    the same order).

    It is `keras.callbacks.BackupAndRestore` made exact and safe:

    - with `save_freq=N`, `BackupAndRestore` (Keras 3.15) restarts the
      interrupted epoch from its first batch, so the batches already trained
      on since the epoch began are trained on twice; this callback skips them
      (reading past them without a training step);
    - each backup is written with `save_checkpoint`, atomically: a run killed
      while saving resumes from the previous backup, where `BackupAndRestore`
      overwrites its only backup in place;
    - the backup is restored with `load_checkpoint`, checked before anything is
      assigned, and into the layouts of the current distribution, so a run
      interrupted on a 2×4 mesh can resume on 1×8;
    - the random state is part of the backup: every `keras.random.SeedGenerator`
      of the model (`Dropout`, `GaussianNoise`, a custom layer's own) and Keras's
      global one, so a model with random layers resumes exactly too. (The global
      one, which random ops given no seed draw from eagerly, is saved as it is
      when this callback runs: list it after callbacks that draw from it.)

    Metrics of the resumed epoch count only the batches trained after
    resuming; while batches are skipped, other callbacks get empty logs.

    Args:
        directory: The backup directory. The backup itself is the checkpoint
            `directory/latest` (readable with `load_checkpoint`), replaced
            atomically at each save; nothing else there is touched.
        save_freq: `"epoch"` (at the end of every epoch) or a number of
            batches (across epochs).
        delete_on_end: Delete the backup once `fit` completes (and `directory`,
            if that leaves it empty). Defaults to `True`, like `BackupAndRestore`.
        storage: How each backup stores its arrays: `"h5"` or `"orbax"`, as
            for `save_checkpoint` (a backup in either is resumed from).
        asynchronous: With `storage="orbax"`, write each backup while training
            goes on: a save blocks training only while the arrays are copied
            off the devices, and the files are written, and the backup moved
            into place, in the background. One backup is written at a time
            (the next save waits for the last), so the extra memory is one host
            copy of the training state. Until a backup is complete the previous
            one stays in place, and a process killed meanwhile resumes from it.
            A background save that fails is raised at the next save or when
            `fit` ends. In a multi-process run, saves are synchronous.

    Raises:
        InvalidOptionError: `save_freq` is neither `"epoch"` nor a positive integer.

    Example:
        >>> import keras, keras_meshlayout as kml, numpy as np, tempfile
        >>> keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=8)))
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="adam", loss="mse")
        >>> backup = kml.ResumableCheckpoint(tempfile.mkdtemp(), save_freq=2)
        >>> x, y = np.ones((64, 4)), np.ones((64, 1))
        >>> history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, callbacks=[backup], verbose=0)
        >>> keras.distribution.set_distribution(None)
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        save_freq: int | Literal["epoch"] = "epoch",
        *,
        delete_on_end: bool = True,
        storage: Literal["h5", "orbax"] = "h5",
        asynchronous: bool = False,
    ) -> None:
        super().__init__()
        if storage not in ("h5", "orbax"):
            raise InvalidOptionError(f'storage must be "h5" or "orbax". Received: storage={storage!r}.')
        if asynchronous and storage != "orbax":
            raise InvalidOptionError(
                'asynchronous=True writes backups with Orbax in the background: pass storage="orbax" too. '
                f"Received: storage={storage!r}."
            )
        self.storage = storage
        self.asynchronous = asynchronous
        self._pending: _BackgroundSave | None = None
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise InvalidOptionError(
                'save_freq must be "epoch" or a positive number of batches. '
                f"Received: save_freq={save_freq!r}."
            )
        self.directory = Path(directory)
        self.path = self.directory / "latest"
        self.save_freq = save_freq
        self.delete_on_end = delete_on_end
        self._epoch = 0
        self._done = 0  # batches done in the current epoch
        self._since_save = 0
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip in it)
        self._train_function = None
        self._skip_now = False
        self._global_seed: Mapping[str, Any] | None = None  # a manifest whose global seed is due

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        self._wait_for_save()  # a backup this callback started in a fit that died
        self._restore_train_function()  # left in place if the last fit died while skipping
        self._since_save = 0
        self._resume = None
        self._global_seed = None
        # A save killed midway is finished (or removed) here: after a kill between its two renames,
        # the newest complete backup is moved into place rather than lost.
        source, _ = _recover(self.path)
        if source is None:
            return
        # No rollback: a model about to train has nothing worth keeping, and a failed load fails fit.
        manifest, _ = _load(self.model, source, None, rollback=False, resume=True)
        training = manifest.get("training") or {}
        epoch, batch = int(training.get("epoch", 0)), int(training.get("batch", 0))
        _compat.set_initial_epoch(self.model, epoch)  # read by fit right after on_train_begin
        if batch:
            self._resume = (epoch, batch)
            self._train_function = self.model.train_function
            self.model.train_function = self._train_or_skip
            self._global_seed = manifest  # restored once the batches trained before are skipped
        else:
            _restore_global_seed(manifest)

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._done = 0

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        resume = self._resume
        self._skip_now = resume is not None and resume[0] == self._epoch and batch < resume[1]
        if resume is not None and not self._skip_now:
            self._resume = None
            self._restore_train_function()
            if self._global_seed is not None:
                # Other callbacks ran while skipping and may have drawn from it: restore it now.
                _restore_global_seed(self._global_seed)
                self._global_seed = None

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        done, self._done = self._done, batch + 1
        if self._skip_now:
            self._skip_now = False
            return
        if self.save_freq == "epoch":
            return
        self._since_save += self._done - done
        if self._since_save >= self.save_freq:
            self._since_save = 0
            steps = self.params.get("steps") if self.params else None
            if steps and self._done >= steps:
                self._save(self._epoch + 1, 0)
            else:
                self._save(self._epoch, self._done)

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        self._wait_for_save()
        self._restore_train_function()
        _compat.set_initial_epoch(self.model, None)  # BackupAndRestore leaves it set for the next fit
        if self.delete_on_end:
            shutil.rmtree(self.path, ignore_errors=True)
            try:
                self.directory.rmdir()  # only if empty
            except OSError:
                pass

    def _wait_for_save(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()

    def _save(self, epoch: int, batch: int) -> None:
        import jax

        if self.asynchronous and jax.process_count() == 1:
            self._wait_for_save()
            self._pending = _BackgroundSave(self.model, self.path, None, {"epoch": epoch, "batch": batch})
            return
        _save_everywhere(
            self.model, self.path, None, training={"epoch": epoch, "batch": batch}, storage=self.storage
        )

    def _train_or_skip(self, state: Any, iterator: Iterator[Any]) -> tuple[dict, Any]:
        """The model's train function while resuming: reads past a batch trained before the crash.

        A stale copy left behind by an interrupted `fit` only ever trains.
        """
        if not self._skip_now:
            return self._train_function(state, iterator)
        next(iterator)
        for _ in range(getattr(self._model, "steps_per_execution", 1) - 1):
            try:
                next(iterator)
            except StopIteration:
                break
        return {}, state

    def _restore_train_function(self) -> None:
        if self._train_function is not None:
            if self._model.train_function == self._train_or_skip:
                self._model.train_function = self._train_function
            self._train_function = None


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """One variable whose layout, or share per device, differs between two plans."""

    path: str
    shape: tuple[int, ...]
    before: tuple
    after: tuple
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What changes between a saved plan and the current one.

    Attributes:
        mesh_before, mesh_after: Mesh axis sizes by name.
        changes: Variables whose layout changes: other mesh axes, or the same
            axes with other sizes (a dimension split 4 ways, then 8 ways).
        memory_before, memory_after: Training-state bytes per device (the
            plans' `memory_per_device`: parameters, gradients, optimizer, total).
    """

    mesh_before: Mapping[str, int]
    mesh_after: Mapping[str, int]
    changes: tuple[LayoutChange, ...]
    memory_before: Mapping[str, Any]
    memory_after: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh_before": dict(self.mesh_before),
            "mesh_after": dict(self.mesh_after),
            "changes": [
                {
                    **dataclasses.asdict(c),
                    "shape": list(c.shape),
                    "before": list(c.before),
                    "after": list(c.after),
                }
                for c in self.changes
            ],
            "memory_before": dict(self.memory_before),
            "memory_after": dict(self.memory_after),
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.table import Table
        from rich.text import Text

        def mesh(sizes: Mapping[str, int]) -> str:
            return " × ".join(f"{k}={v}" for k, v in sizes.items())

        table = Table(
            title=f"Layout changes: {mesh(self.mesh_before)} → {mesh(self.mesh_after)}", title_justify="left"
        )
        for column, justify in [
            ("variable", "left"),
            ("shape", "left"),
            ("before", "left"),
            ("after", "left"),
            ("per device before", "right"),
            ("after", "right"),
        ]:
            table.add_column(column, justify=justify, overflow="fold")
        for c in self.changes:
            table.add_row(
                c.path,
                _format_axes(c.shape, None),
                _format_axes(c.before, self.mesh_before),
                _format_axes(c.after, self.mesh_after),
                format_bytes(c.bytes_before),
                format_bytes(c.bytes_after),
            )
        if self.changes:
            yield table
        else:
            yield Text(f"No layout changes: {mesh(self.mesh_before)} → {mesh(self.mesh_after)}")
        yield Text(
            f"Training state per device: {format_bytes(self.memory_before['total'])} → "
            f"{format_bytes(self.memory_after['total'])}"
        )

    def __str__(self) -> str:
        return to_text(self, width=140)


def plan_diff(before: Plan | Mapping[str, Any], after: Plan | Mapping[str, Any]) -> PlanDiff:
    """Which variables change layout between two plans, and the memory per device of each.

    Variables are matched in order when both plans list the same shapes in
    the same order (the same model, whatever its layers or optimizer were
    named), and by path otherwise, with any leading model-name scope ignored
    (Keras drops it when a Sequential model is reloaded). A variable changes
    when its mesh axes differ, or its share per device does (same axes, other
    sizes).

    Args:
        before: A `Plan` or its `to_dict()` (e.g. a checkpoint's `plan.json`).
        after: The same for the other plan.

    Returns:
        The `PlanDiff`; `print(diff)` shows a table.
    """
    old = before.to_dict() if isinstance(before, Plan) else before
    new = after.to_dict() if isinstance(after, Plan) else after
    old_vars, new_vars = old["variables"], new["variables"]
    if [v["shape"] for v in old_vars] == [v["shape"] for v in new_vars]:
        pairs = list(zip(old_vars, new_vars, strict=True))
    else:
        by_path = {_short(v["path"]): v for v in old_vars}
        pairs = [(by_path[_short(v["path"])], v) for v in new_vars if _short(v["path"]) in by_path]
    changes = tuple(
        LayoutChange(
            v["path"],
            tuple(v["shape"]),
            tuple(was["axes"]),
            tuple(v["axes"]),
            was["bytes_per_device"],
            v["bytes_per_device"],
        )
        for was, v in pairs
        if was["axes"] != v["axes"] or was["bytes_per_device"] != v["bytes_per_device"]
    )
    return PlanDiff(old["mesh"], new["mesh"], changes, old["memory_per_device"], new["memory_per_device"])


# -- saving and loading ---------------------------------------------------------------------


def _save_everywhere(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
    storage: str = "h5",
) -> Path:
    """`_save`, called by every process of a job: process 0 writes, the others wait for it."""
    import jax

    if storage == "orbax":
        return _save_orbax(model, target, distribution, training)
    if jax.process_count() == 1:
        return _save(model, target, distribution, training)
    # Process 0 writes, with the distribution lifted: Keras's save_weights builds a throwaway
    # optimizer, whose variables would be a collective under a distribution spanning processes.
    from jax.experimental import multihost_utils

    current = keras.distribution.distribution()
    failure: Exception | None = None
    if jax.process_index() == 0:
        keras.distribution.set_distribution(None)
        try:
            _save(model, target, distribution if distribution is not None else current, training)
        except Exception as err:  # every process must still reach the collective below
            failure = err
        finally:
            keras.distribution.set_distribution(current)
    # Also the barrier: no process goes on before the checkpoint is complete, or has failed.
    failed = int(multihost_utils.broadcast_one_to_all(np.int32(failure is not None)))
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(
            f"Saving checkpoint {target} failed in process 0, which writes it (its error says why). "
            f"Whatever was at {target} before is intact."
        )
    return target


def _save(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
) -> Path:
    step = target.parent
    _wait_for_background_saves(target)
    partial = target.with_name(_sibling_name(target, "partial"))
    _IN_FLIGHT.add(partial.name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _recover(target)  # a save killed between its renames is finished before this one starts
        step = partial
        partial.mkdir()
        step = partial / WEIGHTS
        model.save_weights(partial / WEIGHTS)
        _fsync(partial / WEIGHTS)
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "keras": keras.__version__,
            "model": model.name,
            "optimizer": _optimizer_info(model),
            "variables": _describe(model),
            "weights_sha256": _sha256(partial / WEIGHTS),
            "rng": _rng_state(model),
        }
        plan = _current_plan(model, distribution)
        if plan is not None:
            step = partial / PLAN
            _write_json(partial / PLAN, plan.to_dict())
            manifest["plan_sha256"] = _sha256(partial / PLAN)
        if training is not None:
            manifest["training"] = dict(training)
        step = partial / MANIFEST
        _write_json(partial / MANIFEST, manifest)
        step = partial
        _fsync(partial)
        step = target
        _replace_directory(partial, target)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            raise CheckpointError(_save_failed(target, step, err)) from err
        raise
    finally:
        _IN_FLIGHT.discard(partial.name)
    return target


def _save_orbax(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
) -> Path:
    """A checkpoint whose arrays every process writes its own shards of, with Orbax; all processes call it.

    The protocol is `_save`'s: everything goes to one hidden sibling directory (named by
    process 0, for all), which process 0 moves into place once every process's shards are on
    disk (Orbax's barrier) and it has written the plan and the manifest. A failure in any
    process is raised in every process, after each of the three steps.
    """
    import jax

    from . import _orbax_store

    primary = jax.process_index() == 0
    _wait_for_background_saves(target)
    partial = target.with_name(_common(_sibling_name(target, "partial")))
    step = [partial]  # what is being written, for the error message

    def prepare() -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        _recover(target)  # a save killed between its renames is finished before this one starts
        partial.mkdir()

    def write_arrays() -> None:
        optimizer = getattr(model, "optimizer", None)
        slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
        for kind, variables in (("model", model.weights), ("optimizer", slots)):
            step[0] = partial / _orbax_store.DIRECTORIES[kind]
            try:
                _orbax_store.save(partial, {kind: [v.value for v in variables]})
            except Exception as err:  # TensorStore reports a write error (a full disk) as a ValueError
                if isinstance(err, OSError):
                    raise
                raise OSError(None, f"{type(err).__name__}: {err}") from err

    def complete() -> None:
        listing = _orbax_store.files(partial)
        manifest: dict[str, Any] = {
            "format": ORBAX_FORMAT,
            "keras": keras.__version__,
            "model": model.name,
            "optimizer": _optimizer_info(model),
            "variables": _describe(model),
            "files": listing,
            "weights_sha256": _orbax_store.digest(listing),
            "rng": _rng_state(model),
        }
        plan = _current_plan(model, distribution)
        if plan is not None:
            step[0] = partial / PLAN
            _write_json(partial / PLAN, plan.to_dict())
            manifest["plan_sha256"] = _sha256(partial / PLAN)
        if training is not None:
            manifest["training"] = dict(training)
        step[0] = partial / MANIFEST
        _write_json(partial / MANIFEST, manifest)
        step[0] = partial
        _fsync(partial)
        step[0] = target
        _replace_directory(partial, target)

    _IN_FLIGHT.add(partial.name)
    try:
        for run, everywhere in ((prepare, False), (write_arrays, True), (complete, False)):
            failure = _attempt(run) if everywhere or primary else None
            try:
                _agree(failure, target, step[0])
            except BaseException:
                if primary:
                    shutil.rmtree(partial, ignore_errors=True)
                raise
    finally:
        _IN_FLIGHT.discard(partial.name)
    return target


def _attempt(run: Any) -> BaseException | None:
    try:
        run()
    except BaseException as err:  # raised by _agree, once every process knows
        return err
    return None


class _BackgroundSave:
    """An Orbax save, in one process, whose files are written while training goes on.

    Starting it (the constructor) copies the arrays off the devices and snapshots the
    manifest; a thread then waits for Orbax's writes, writes the plan and the manifest and
    moves the checkpoint into place, as `_save_orbax` does. Until then the previous
    checkpoint stays in place; a process killed meanwhile leaves a hidden partial directory,
    which the next save or load removes.
    """

    def __init__(
        self, model: keras.Model, target: Path, distribution: Any, training: Mapping[str, int] | None
    ) -> None:
        import threading

        from . import _orbax_store

        _wait_for_background_saves(target)
        self.target = target
        self.partial = target.with_name(_sibling_name(target, "partial"))
        self.error: CheckpointError | None = None
        self._step = self.partial
        _IN_FLIGHT.add(self.partial.name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _recover(target)
            self.partial.mkdir()
            plan = _current_plan(model, distribution)
            self._plan = None if plan is None else plan.to_dict()
            self._manifest: dict[str, Any] = {
                "format": ORBAX_FORMAT,
                "keras": keras.__version__,
                "model": model.name,
                "optimizer": _optimizer_info(model),
                "variables": _describe(model),
                "rng": _rng_state(model),
            }
            if training is not None:
                self._manifest["training"] = dict(training)
            optimizer = getattr(model, "optimizer", None)
            slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
            self._writes = []
            for kind, variables in (("model", model.weights), ("optimizer", slots)):
                if variables:
                    self._step = self.partial / _orbax_store.DIRECTORIES[kind]
                    self._writes.append(
                        (kind, _orbax_store.start_save(self.partial, kind, [v.value for v in variables]))
                    )
        except BaseException as err:
            self._fail(err)
            if self.error is None:
                raise
            raise self.error from err
        self._thread = threading.Thread(target=self._complete, name=f"kml-save-{target.name}", daemon=True)
        _BACKGROUND[_key(target)] = self
        self._thread.start()

    def _complete(self) -> None:
        from . import _orbax_store

        try:
            for kind, write in self._writes:
                self._step = self.partial / _orbax_store.DIRECTORIES[kind]
                _orbax_store.finish(write)
            listing = _orbax_store.files(self.partial)
            manifest = {**self._manifest, "files": listing, "weights_sha256": _orbax_store.digest(listing)}
            if self._plan is not None:
                self._step = self.partial / PLAN
                _write_json(self.partial / PLAN, self._plan)
                manifest["plan_sha256"] = _sha256(self.partial / PLAN)
            self._step = self.partial / MANIFEST
            _write_json(self.partial / MANIFEST, manifest)
            self._step = self.partial
            _fsync(self.partial)
            self._step = self.target
            _replace_directory(self.partial, self.target)
        except BaseException as err:  # reported by wait(), in the thread that trains
            self._fail(err)
        finally:
            _IN_FLIGHT.discard(self.partial.name)

    def _fail(self, err: BaseException) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)
        _IN_FLIGHT.discard(self.partial.name)
        if isinstance(err, Exception):
            cause = err if isinstance(err, OSError) else OSError(None, f"{type(err).__name__}: {err}")
            self.error = CheckpointError(_save_failed(self.target, self._step, cause))
            self.error.__cause__ = err

    def wait(self) -> None:
        """Blocks until the checkpoint is in place; raises `CheckpointError` if it could not be written."""
        self._thread.join()
        if _BACKGROUND.get(_key(self.target)) is self:
            del _BACKGROUND[_key(self.target)]
        if self.error is not None:
            raise self.error


#: The background save under way to each checkpoint path (at most one), in this process.
_BACKGROUND: dict[str, _BackgroundSave] = {}


def _key(target: Path) -> str:
    return os.path.abspath(target)


def _wait_for_background_saves(target: Path) -> None:
    """Lets a background save to `target` finish first, so that nothing reads or writes it meanwhile.

    Its error, if any, is left for whoever started it (the previous checkpoint is intact).
    """
    pending = _BACKGROUND.get(_key(target))
    if pending is not None:
        pending._thread.join()


def _common(name: str) -> str:
    """`name` as process 0 has it, in every process (a collective)."""
    import jax

    if jax.process_count() == 1:
        return name
    from jax.experimental import multihost_utils

    raw = np.zeros(255, np.uint8)
    encoded = np.frombuffer(name.encode()[:255], np.uint8)
    raw[: len(encoded)] = encoded
    shared = np.asarray(multihost_utils.broadcast_one_to_all(raw), np.uint8)
    return bytes(shared).rstrip(b"\0").decode()


def _agree(failure: BaseException | None, target: Path, step: Path) -> None:
    """Raises `failure` here, and a `CheckpointError` in every other process, if any process failed.

    With several processes, a collective: every process calls it at the same point.
    """
    import jax

    failed: list[int] = []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(failure is not None))
        failed = [i for i, flag in enumerate(np.asarray(flags).reshape(-1)) if flag]
    if failure is not None:
        if isinstance(failure, OSError):
            raise CheckpointError(_save_failed(target, step, failure)) from failure
        raise failure
    if failed:
        raise CheckpointError(
            f"Saving checkpoint {target} failed in process(es) {failed} (their error says why). "
            f"Whatever was at {target} before is intact."
        )


def _save_failed(target: Path, step: Path, err: OSError) -> str:
    if err.strerror and err.errno is not None:
        reason = f"{err.strerror} (errno {err.errno})"
    else:
        reason = err.strerror or f"{type(err).__name__}: {err}"
    if _complete(target):
        previous = f"The previous checkpoint at {target} is intact."
    elif target.exists():
        previous = f"{target} was left as it was (it holds no complete checkpoint)."
    else:
        previous = f"Nothing was written at {target} (there was no checkpoint there before)."
    return (
        f"Saving checkpoint {target} failed while writing {step}: {reason}. {previous} "
        "What this save had written was removed. Fix: free space on that disk, or check that the "
        "directory is writable, and save again."
    )


def _load(
    model: keras.Model,
    source: Path,
    distribution: Any,
    *,
    rollback: bool = True,
    resume: bool = False,
) -> tuple[dict[str, Any], PlanDiff | None]:
    _wait_for_background_saves(source)
    recovered, removed = _recover(source)
    if recovered is not None:
        source = recovered
    manifest = _read_manifest(source, removed)
    weights = source / WEIGHTS
    orbax = manifest["format"] == ORBAX_FORMAT
    if orbax:
        problem = _orbax_damage(source, manifest)
        if problem is not None:
            raise CheckpointError(
                f"Checkpoint {source}: its arrays are missing, truncated or corrupt: {problem}. Nothing was "
                "loaded; the model is unchanged. Fix: use an earlier checkpoint."
            )
    elif not weights.is_file() or _sha256(weights) != manifest["weights_sha256"]:
        raise CheckpointError(
            f"Checkpoint {source}: {WEIGHTS} is missing, truncated or corrupt (its checksum does not "
            "match the manifest). Nothing was loaded; the model is unchanged. Fix: use an earlier "
            "checkpoint."
        )
    saved_plan = _read_plan(source, manifest)

    saved = manifest["variables"]
    optimizer = getattr(model, "optimizer", None)
    with_optimizer = optimizer is not None and any(v.get("kind") == "optimizer" for v in saved)
    if with_optimizer and not optimizer.built:
        # What fit would do first; its variables take the current distribution's layouts.
        optimizer.build(model.trainable_variables)
    if not with_optimizer:
        saved = [v for v in saved if v.get("kind") != "optimizer"]
    _check_variables(manifest, saved, model, with_optimizer, source)
    seeds = _seed_states_to_restore(model, manifest, source, resume)

    variables = _variables(model, with_optimizer) + [variable for variable, _ in seeds]
    # Kept alive to put back (nothing is copied, but their memory is not freed until the end).
    values = [v.value for v in variables] if rollback else None
    skip = [] if with_optimizer or optimizer is None else [optimizer]
    try:
        if orbax:
            _load_orbax(model, source, with_optimizer, rollback)
        else:
            model.load_weights(weights, objects_to_skip=skip) if skip else model.load_weights(weights)
        for variable, state in seeds:
            variable.assign(np.asarray(state, dtype=variable.dtype))
    except BaseException as err:
        if values is not None:
            for variable, value in zip(variables, values, strict=True):
                variable.assign(value)
        if not isinstance(err, Exception):
            raise
        outcome = (
            "Every variable was put back as it was; the model is unchanged."
            if values is not None
            else "The model is partly loaded (rollback=False): load it again, or rebuild it."
        )
        memory = "memory" in str(err).lower() or "resource_exhausted" in str(err).lower()
        hint = " If memory ran out, rollback=False holds one copy of the model fewer." if memory else ""
        raise CheckpointError(
            f"Loading checkpoint {source} failed part-way ({type(err).__name__}: {err}). {outcome}{hint}"
        ) from err
    current = _current_plan(model, distribution)
    diff = None if saved_plan is None or current is None else plan_diff(saved_plan, current)
    return manifest, diff


def _load_orbax(model: keras.Model, source: Path, with_optimizer: bool, rollback: bool) -> None:
    """Reads every array onto its variable's current sharding (each process its own slices), and assigns.

    With `rollback`, everything is read before the first variable is assigned. Without, the
    arrays are read and assigned a group at a time, each variable's previous value freed as
    it goes, so that the load holds at most one group beside the model.
    """
    import jax

    from . import _orbax_store

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
        )


def _orbax_damage(source: Path, manifest: Mapping[str, Any]) -> str | None:
    """What is wrong with an Orbax checkpoint's files, or `None` (sizes everywhere, checksums of metadata)."""
    from . import _orbax_store

    listing = manifest["files"]
    if _orbax_store.digest(listing) != manifest["weights_sha256"]:
        return f'the file list in {MANIFEST} does not match its "weights_sha256" (edited or damaged)'
    return _orbax_store.damage(source, listing)


# -- random state -------------------------------------------------------------------------


def _seed_states(model: keras.Model) -> list[keras.Variable]:
    """The state variables of the model's seed generators (`model.variables` beyond its weights)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights and tuple(v.shape) == (2,)]


def _host_value(variable: Any) -> list[int]:
    value = variable.value if hasattr(variable, "value") else variable
    if not getattr(value, "is_fully_addressable", True):
        value = value.addressable_data(0)  # a seed state is replicated: every device holds all of it
    return [int(x) for x in np.asarray(value).reshape(-1)]


def _global_seed_generator(create: bool = False) -> Any:
    """Keras's process-wide seed generator (used by random ops given no seed), if there is one."""
    return _compat.global_seed_generator(create)


def _rng_state(model: keras.Model) -> dict[str, Any]:
    generator = _global_seed_generator()
    return {
        "seed_generators": [{"path": v.path, "state": _host_value(v)} for v in _seed_states(model)],
        "global": None if generator is None else _host_value(generator.state),
    }


def _seed_states_to_restore(
    model: keras.Model, manifest: Mapping[str, Any], source: Path, resume: bool
) -> list[tuple[keras.Variable, list[int]]]:
    """(variable, saved state) pairs, matched in order; checked before anything is loaded."""
    states = _seed_states(model)
    rng = manifest.get("rng")
    if rng is None:
        if resume and states:
            warnings.warn(
                f"Checkpoint {source} holds no random state (written by an earlier version of "
                f"keras_meshlayout), and the model has {len(states)} random seed generator(s), e.g. "
                f"{states[0].path!r}: training resumes, but its random numbers (dropout masks) are not "
                "those of the interrupted run. Backups written from now on hold the random state.",
                MeshLayoutWarning,
                stacklevel=4,
            )
        return []
    saved = rng["seed_generators"]
    if len(saved) == len(states):
        return [(v, entry["state"]) for v, entry in zip(states, saved, strict=True)]
    if resume:
        raise CheckpointError(
            f"Checkpoint {source} holds the state of {len(saved)} random seed generator(s), and the model "
            f"has {len(states)} ({', '.join(repr(v.path) for v in states[:3]) or 'none'}): it has other "
            "random layers (Dropout, GaussianNoise, ...) than the model that was backed up, so training "
            "could not resume exactly. Nothing was loaded; the model is unchanged. Fix: build the same "
            "model, or start from scratch in an empty backup directory."
        )
    return []  # another model's random layers: the model keeps its own random state


def _restore_global_seed(manifest: Mapping[str, Any]) -> None:
    state = (manifest.get("rng") or {}).get("global")
    if state is not None:
        generator = _global_seed_generator(create=True)
        generator.state.assign(np.asarray(state, dtype=generator.state.dtype))


# -- interrupted saves ----------------------------------------------------------------------

#: Hidden directories of saves this process has under way (by name): never stale.
_IN_FLIGHT: set[str] = set()
#: How long a save from another host may go without writing anything before it counts as dead.
_FOREIGN_STALE_AFTER_S = 24 * 3600


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def _sibling_name(target: Path, kind: Literal["partial", "old"]) -> str:
    """`.NAME.partial-HOST-PID-TAG`: who writes it, so that another process can tell it is stale."""
    return f".{target.name}.{kind}-{_host()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class _Sibling:
    """A hidden directory a save to `target` left beside it."""

    path: Path
    kind: str  # "partial": a new checkpoint being written; "old": the previous one, moved aside
    host: str | None  # None: named by a version that did not record its writer
    pid: int | None

    @property
    def complete(self) -> bool:
        return _complete(self.path)

    def alive(self) -> bool:
        """Whether the process that writes it may still be running (then it is left alone)."""
        if self.host is None:
            return False
        if self.host != _host():
            try:
                newest = max([self.path.stat().st_mtime] + [p.stat().st_mtime for p in self.path.iterdir()])
            except OSError:
                return False
            return time.time() - newest < _FOREIGN_STALE_AFTER_S
        if self.pid == os.getpid():
            return self.path.name in _IN_FLIGHT
        return _process_alive(self.pid)

    def describe(self) -> str:
        writer = "" if self.host is None else f" (process {self.pid} on {self.host})"
        return f"{self.path.name}{writer}"


def _process_alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    try:  # a killed process not yet reaped by its parent is a zombie: it writes nothing more
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _siblings(target: Path) -> list[_Sibling]:
    pattern = re.compile(rf"\.{re.escape(target.name)}\.(partial|old)-(?:([A-Za-z0-9._]+)-(\d+)-)?[0-9a-f]+")
    found = []
    try:
        entries = list(target.parent.iterdir())
    except OSError:
        return []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match and entry.is_dir():
            kind, host, pid = match.groups()
            found.append(_Sibling(entry, kind, host, None if pid is None else int(pid)))
    return sorted(found, key=lambda s: s.path.name)


def _complete(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def _verified(path: Path) -> bool:
    """Whether `path` holds a complete checkpoint whose files match their checksums."""
    try:
        manifest = json.loads((path / MANIFEST).read_bytes().decode("utf-8"))
        if manifest.get("format") == ORBAX_FORMAT:
            if _orbax_damage(path, manifest) is not None:
                return False
        elif _sha256(path / WEIGHTS) != manifest["weights_sha256"]:
            return False
        plan = manifest.get("plan_sha256")
        return plan is None or _sha256(path / PLAN) == plan
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _recover(target: Path) -> tuple[Path | None, list[str]]:
    """Finishes what killed saves to `target` left undone, and removes what they left behind.

    A save writes `.NAME.partial-*`, moves the previous checkpoint aside to
    `.NAME.old-*`, moves the new one into place, then deletes the old one. If
    `target` is missing, a save was killed between the two moves (or before its
    only one): the newest of its complete, verified siblings is moved into place.
    Siblings whose writer is gone are then removed: all of them once `target`
    holds a checkpoint, else only incomplete ones. A sibling that a live
    process may still be writing is never touched.

    Returns:
        The checkpoint to read (`target`, or a sibling that could not be moved
        into place, in a read-only directory), or `None`; and the names removed.
    """
    siblings = [s for s in _siblings(target) if not s.alive()]
    chosen = target if _complete(target) else None
    if chosen is None and not target.exists():

        def newest(s: _Sibling) -> tuple[int, bool]:
            try:
                return (s.path / MANIFEST).stat().st_mtime_ns, s.kind == "partial"
            except OSError:  # moved away meanwhile, by another process recovering it
                return 0, False

        for candidate in sorted((s for s in siblings if s.complete), key=newest, reverse=True):
            if not _verified(candidate.path):
                continue
            try:
                os.replace(candidate.path, target)
                _fsync(target.parent)
                chosen = target
            except OSError:  # another process did it first, or the directory is read-only
                chosen = target if _complete(target) else candidate.path if candidate.path.is_dir() else None
            if chosen is not None:
                siblings.remove(candidate)
                break
    removed = []
    for sibling in siblings:
        if chosen is not None or not sibling.complete:
            shutil.rmtree(sibling.path, ignore_errors=True)
            if not sibling.path.exists():
                removed.append(sibling.describe())
    return chosen, removed


# -- helpers ------------------------------------------------------------------------------


def _variables(model: keras.Model, with_optimizer: bool = True) -> list[keras.Variable]:
    optimizer = getattr(model, "optimizer", None)
    built = with_optimizer and optimizer is not None and optimizer.built
    return list(model.weights) + (list(optimizer.variables) if built else [])


def _describe(model: keras.Model) -> list[dict[str, Any]]:
    optimizer = getattr(model, "optimizer", None)
    slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return [
        {"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype), "kind": kind}
        for kind, variables in (("model", model.weights), ("optimizer", slots))
        for v in variables
    ]


def _optimizer_info(model: keras.Model) -> dict[str, str] | None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return None
    return {"name": optimizer.name, "class": type(optimizer).__name__}


def _current_plan(model: keras.Model, distribution: Any = None) -> Plan | None:
    from ..core._distribution import ModelParallel

    distribution = distribution or keras.distribution.distribution()
    if not isinstance(distribution, ModelParallel):
        return None
    import warnings

    from ..core._errors import MeshLayoutWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MeshLayoutWarning)
        return distribution.plan(model)


def _read_manifest(source: Path, removed: Sequence[str] = ()) -> dict[str, Any]:
    if not source.is_dir():
        raise CheckpointError(f"No checkpoint at {source}.{_siblings_hint(source, removed)}")
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
    if manifest["format"] not in (FORMAT, ORBAX_FORMAT):
        raise CheckpointError(
            f"Checkpoint {source} has format {manifest['format']!r}; this version reads formats {FORMAT} "
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

    def text(value: Any) -> bool:
        return isinstance(value, str)

    def shape(value: Any) -> bool:
        return isinstance(value, list) and all(map(count, value))

    def count(value: Any, below: int | None = None) -> bool:
        return (
            isinstance(value, int)
            and not isinstance(value, bool)
            and value >= 0
            and (below is None or value < below)
        )

    if not (text(manifest["weights_sha256"]) and re.fullmatch(r"[0-9a-f]{64}", manifest["weights_sha256"])):
        fail("weights_sha256", "a SHA-256 digest (64 hexadecimal digits)", manifest["weights_sha256"])
    for key in ("plan_sha256", "model", "keras"):
        if manifest.get(key) is not None and not text(manifest[key]):
            fail(key, "a string or null", manifest[key])
    optimizer = manifest.get("optimizer")
    if optimizer is not None and not (
        isinstance(optimizer, dict) and all(text(optimizer.get(k)) for k in ("name", "class"))
    ):
        fail("optimizer", 'null or {"name": str, "class": str}', optimizer)
    variables = manifest["variables"]
    if not isinstance(variables, list):
        fail("variables", "a list of {path, shape, dtype, kind} entries", variables)
    for i, entry in enumerate(variables):
        where = f"variables[{i}]"
        if not isinstance(entry, dict):
            fail(where, "a {path, shape, dtype, kind} entry", entry)
        for key, expected, ok in (
            ("path", "a string", text),
            ("dtype", "a string", text),
            ("shape", "a list of non-negative integers", shape),
        ):
            if not ok(entry.get(key, _MISSING)):
                fail(f"{where}.{key}", expected, entry.get(key, _MISSING))
        if entry.get("kind", "model") not in ("model", "optimizer"):
            fail(f"{where}.kind", '"model" or "optimizer"', entry["kind"])
    if manifest["format"] == ORBAX_FORMAT:
        files = manifest.get("files", _MISSING)
        if not isinstance(files, dict):
            fail("files", "a {name: {bytes, sha256}} mapping (an Orbax checkpoint's files)", files)
        for name, entry in files.items():
            if not (
                isinstance(entry, dict)
                and count(entry.get("bytes", _MISSING))
                and (entry.get("sha256") is None or text(entry["sha256"]))
            ):
                fail(f"files[{name!r}]", '{"bytes": int, "sha256": str or null}', entry)
    training = manifest.get("training")
    if training is not None:
        if not isinstance(training, dict):
            fail("training", '{"epoch": int, "batch": int}', training)
        for key in ("epoch", "batch"):
            if not count(training.get(key, 0)):
                fail(f"training.{key}", "a non-negative integer", training[key])
    rng = manifest.get("rng")
    if rng is not None:

        def seed(value: Any) -> bool:
            return isinstance(value, list) and len(value) == 2 and all(count(x, 1 << 32) for x in value)

        if not isinstance(rng, dict) or not isinstance(rng.get("seed_generators"), list):
            fail("rng", '{"seed_generators": [...], "global": ...}', rng)
        for i, entry in enumerate(rng["seed_generators"]):
            if not isinstance(entry, dict) or not seed(entry.get("state", _MISSING)):
                fail(f"rng.seed_generators[{i}]", '{"path": str, "state": [two uint32]}', entry)
        if rng.get("global") is not None and not seed(rng["global"]):
            fail("rng.global", "null or [two uint32]", rng["global"])


_MISSING = object()


def _read_plan(source: Path, manifest: Mapping[str, Any]) -> dict[str, Any] | None:
    path = source / PLAN
    expected = manifest.get("plan_sha256")
    if expected is None:
        return None
    try:
        if _sha256(path) != expected:
            raise ValueError("its checksum does not match the manifest")
        return json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as err:
        raise CheckpointError(
            f"Checkpoint {source}: {PLAN} is missing, truncated or corrupt ({err}). Nothing was loaded; "
            "the model is unchanged. Fix: use an earlier checkpoint."
        ) from None


def _siblings_hint(source: Path, removed: Sequence[str] = ()) -> str:
    """What interrupted saves left beside a missing checkpoint, if anything."""
    if not source.parent.is_dir():
        return " Fix: check the path."
    hint = ""
    if removed:
        hint += (
            f" Removed what {len(removed)} save(s) killed before completing had left beside it "
            f"({', '.join(removed)}): none held a complete checkpoint."
        )
    found = _siblings(source)
    damaged = [s for s in found if not s.alive() and s.complete]
    if damaged:
        hint += (
            f" A checkpoint that a killed save left beside it ({damaged[0].describe()}) was not used: "
            "its files do not match the checksums in its manifest."
        )
    busy = [s for s in found if s.alive()]
    if busy:
        hint += (
            f" A save is under way beside it ({busy[0].describe()}): wait until it completes, or, if "
            "that process is gone (on another host, after 24 hours without a write), load again."
        )
    return hint + " Fix: check the path, or use an earlier checkpoint."


def _check_variables(
    manifest: Mapping[str, Any],
    saved: list[dict[str, Any]],
    model: keras.Model,
    with_optimizer: bool,
    source: Path,
) -> None:
    """Raises `CheckpointError` unless the saved variables line up with the model's, in order."""
    current = [v for v in _describe(model) if with_optimizer or v["kind"] == "model"]
    if [_signature(v) for v in saved] == [_signature(v) for v in current]:
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


def _check_manifest_against_weights(manifest: Mapping[str, Any], source: Path) -> None:
    """Raises `CheckpointError` if the manifest lists shapes the weights file does not hold.

    The weights file is checked against its checksum, the manifest is not: before a
    mismatch is blamed on the model, make sure it is not the manifest that was edited.
    """
    stored: Counter[tuple[int, ...]] = Counter()
    where = WEIGHTS
    if manifest["format"] == ORBAX_FORMAT:
        from . import _orbax_store

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


def _format_axes(axes: Sequence[Any], sizes: Mapping[str, int] | None) -> str:
    """`(None, 'model')` with sizes `{'model': 4}` → `(None, model=4)`."""
    inner = ", ".join(
        "None" if a is None else f"{a}={sizes[a]}" if sizes and a in sizes else str(a) for a in axes
    )
    return f"({inner},)" if len(axes) == 1 else f"({inner})"


def _short(path: str) -> str:
    """A variable path without its first scope, the way Keras sometimes drops it."""
    return path.split("/", 1)[1] if path.count("/") >= 2 else path


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flushes a file, or a directory's entries, to disk (where the platform allows)."""
    directory = path.is_dir()
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:  # a file that cannot be flushed may not be on disk: fail the save
            raise  # (directories cannot be fsync'ed on some platforms)
    finally:
        os.close(fd)


def _replace_directory(partial: Path, target: Path) -> None:
    """Moves the complete `partial` directory to `target`, replacing any old one.

    Should the second move fail, the previous checkpoint is moved back; should the
    process be killed between the two, the next save or load finishes the job
    (`_recover`).
    """
    old = None
    if target.exists():
        old = target.with_name(_sibling_name(target, "old"))
        _IN_FLIGHT.add(old.name)
        os.replace(target, old)
    try:
        os.replace(partial, target)
        _fsync(target.parent)
    except BaseException:
        if old is not None and not target.exists():
            os.replace(old, target)
        if old is not None:
            _IN_FLIGHT.discard(old.name)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        _IN_FLIGHT.discard(old.name)
