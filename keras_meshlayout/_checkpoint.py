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
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import keras

from ._errors import CheckpointError, InvalidOptionError
from ._plan import Plan
from ._render import format_bytes, to_text

if TYPE_CHECKING:
    import rich.console

    from ._distribution import ModelParallel

__all__ = [
    "LayoutChange",
    "PlanDiff",
    "ResumableCheckpoint",
    "load_checkpoint",
    "plan_diff",
    "save_checkpoint",
]

FORMAT = 1
WEIGHTS = "model.weights.h5"
PLAN = "plan.json"
MANIFEST = "manifest.json"  # written last: its presence marks a complete checkpoint
_MANIFEST_KEYS = ("format", "variables", "weights_sha256")


def save_checkpoint(
    model: keras.Model, directory: str | os.PathLike, *, distribution: ModelParallel | None = None
) -> Path:
    """Saves the weights (optimizer state included), the plan and a manifest, atomically.

    Everything is written to a hidden sibling directory (`.NAME.partial-*`)
    that replaces `directory` only once complete: a save that is interrupted
    leaves the previous checkpoint in place, and never one that looks complete.

    Args:
        model: The model, built (and compiled, with its optimizer built, to
            include the optimizer state).
        directory: Checkpoint directory; replaced if it exists.
        distribution: The `kml.ModelParallel` whose plan to save; defaults to
            the current distribution (no plan is saved without one).

    Returns:
        The checkpoint directory.

    Example:
        >>> import keras, keras_meshlayout as kml, tempfile, os
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*kernel", (None, "model"))])
        >>> with dist.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4096, name="d")], name="m")
        >>> path = kml.save_checkpoint(model, os.path.join(tempfile.mkdtemp(), "step_1"), distribution=dist)
        >>> sorted(p.name for p in path.iterdir())
        ['manifest.json', 'model.weights.h5', 'plan.json']
    """
    import jax

    if jax.process_count() == 1:
        return _save(model, Path(directory), distribution)
    # Several processes: every one calls this. Process 0 writes, with the distribution
    # lifted: Keras's save_weights builds a throwaway optimizer, whose variables would be
    # a collective under a distribution spanning processes. The others wait until done.
    from jax.experimental import multihost_utils

    current = keras.distribution.distribution()
    if jax.process_index() == 0:
        keras.distribution.set_distribution(None)
        try:
            _save(model, Path(directory), distribution if distribution is not None else current)
        finally:
            keras.distribution.set_distribution(current)
    multihost_utils.sync_global_devices(f"kml.save_checkpoint {os.fspath(directory)}")
    return Path(directory)


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
      interrupted on a 2×4 mesh can resume on 1×8.

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
    ) -> None:
        super().__init__()
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

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        self._restore_train_function()  # left in place if the last fit died while skipping
        self._since_save = 0
        self._resume = None
        _discard_partial_saves(self.path)
        if not self.path.exists():
            return
        # No rollback: a model about to train has nothing worth keeping, and a failed load fails fit.
        manifest, _ = _load(self.model, self.path, None, rollback=False)
        training = manifest.get("training") or {}
        epoch, batch = int(training.get("epoch", 0)), int(training.get("batch", 0))
        self.model._initial_epoch = epoch  # read by fit right after on_train_begin, as for BackupAndRestore
        if batch:
            self._resume = (epoch, batch)
            self._train_function = self.model.train_function
            self.model.train_function = self._train_or_skip

    def on_epoch_begin(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        self._epoch = epoch
        self._done = 0

    def on_train_batch_begin(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        resume = self._resume
        self._skip_now = resume is not None and resume[0] == self._epoch and batch < resume[1]
        if resume is not None and not self._skip_now:
            self._resume = None
            self._restore_train_function()

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
        self._restore_train_function()
        self.model._initial_epoch = None  # BackupAndRestore leaves it set for the next fit
        if self.delete_on_end:
            shutil.rmtree(self.path, ignore_errors=True)
            try:
                self.directory.rmdir()  # only if empty
            except OSError:
                pass

    def _save(self, epoch: int, batch: int) -> None:
        _save(self.model, self.path, None, training={"epoch": epoch, "batch": batch})

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


def _save(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        model.save_weights(partial / WEIGHTS)
        _fsync(partial / WEIGHTS)
        manifest: dict[str, Any] = {
            "format": FORMAT,
            "keras": keras.__version__,
            "model": model.name,
            "optimizer": _optimizer_info(model),
            "variables": _describe(model),
            "weights_sha256": _sha256(partial / WEIGHTS),
        }
        plan = _current_plan(model, distribution)
        if plan is not None:
            _write_json(partial / PLAN, plan.to_dict())
            manifest["plan_sha256"] = _sha256(partial / PLAN)
        if training is not None:
            manifest["training"] = dict(training)
        _write_json(partial / MANIFEST, manifest)
        _fsync(partial)
        _replace_directory(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def _load(
    model: keras.Model, source: Path, distribution: Any, *, rollback: bool = True
) -> tuple[dict[str, Any], PlanDiff | None]:
    manifest = _read_manifest(source)
    weights = source / WEIGHTS
    if not weights.is_file() or _sha256(weights) != manifest["weights_sha256"]:
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

    variables = _variables(model, with_optimizer)
    # Kept alive to put back (nothing is copied, but their memory is not freed until the end).
    values = [v.value for v in variables] if rollback else None
    skip = [] if with_optimizer or optimizer is None else [optimizer]
    try:
        model.load_weights(weights, objects_to_skip=skip) if skip else model.load_weights(weights)
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
    from ._distribution import ModelParallel

    distribution = distribution or keras.distribution.distribution()
    if not isinstance(distribution, ModelParallel):
        return None
    import warnings

    from ._errors import MeshLayoutWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MeshLayoutWarning)
        return distribution.plan(model)


def _read_manifest(source: Path) -> dict[str, Any]:
    if not source.is_dir():
        raise CheckpointError(f"No checkpoint at {source}.{_siblings_hint(source)}")
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
    if manifest["format"] != FORMAT:
        raise CheckpointError(
            f"Checkpoint {source} has format {manifest['format']!r}; this version reads format {FORMAT}. "
            "Nothing was loaded; the model is unchanged."
        )
    return manifest


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


def _siblings_hint(source: Path) -> str:
    """What an interrupted save left beside a missing checkpoint, if anything."""
    if not source.parent.is_dir():
        return " Fix: check the path."
    partial = sorted(source.parent.glob(f".{source.name}.partial-*"))
    old = sorted(source.parent.glob(f".{source.name}.old-*"))
    hint = ""
    if partial:
        hint += f" A half-written save was found beside it ({partial[0].name}): its save did not finish."
    if old:
        hint += (
            f" The previous checkpoint was moved aside to {old[0].name} by a save that did not finish: "
            f"rename it back to {source.name} to use it."
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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync(path: Path) -> None:
    """Flushes a file, or a directory's entries, to disk (where the platform allows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # directories cannot be fsync'ed on some platforms
    finally:
        os.close(fd)


def _replace_directory(partial: Path, target: Path) -> None:
    """Moves the complete `partial` directory to `target`, replacing any old one."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(partial, target)
    _fsync(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _discard_partial_saves(target: Path) -> None:
    """Removes what saves to `target` killed midway left behind (they never look complete)."""
    if target.parent.is_dir():
        for leftover in target.parent.glob(f".{target.name}.partial-*"):
            shutil.rmtree(leftover, ignore_errors=True)
