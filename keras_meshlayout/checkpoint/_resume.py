"""`ResumableCheckpoint`: backs training up as it goes and resumes it exactly, on any mesh."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import keras

from .. import _compat
from ..core._errors import InvalidOptionError
from . import _atomic, _load, _rng, _save

__all__ = ["ResumableCheckpoint"]


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
        storage: How each backup stores its arrays: `"orbax"` (the default,
            every process writing its own shards) or `"h5"`, as for
            `save_checkpoint`. A backup in either format is resumed from,
            whichever this callback writes: a run backed up by an earlier
            version (h5) resumes, and its next backup is written with Orbax.
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
        storage: Literal["orbax", "h5"] = "orbax",
        asynchronous: bool = False,
    ) -> None:
        super().__init__()
        if storage not in ("orbax", "h5"):
            raise InvalidOptionError(
                f'storage must be "orbax" (the default) or "h5". Received: storage={storage!r}.'
            )
        if asynchronous and storage != "orbax":
            raise InvalidOptionError(
                "asynchronous=True writes backups with Orbax in the background: leave storage at its "
                f'default, "orbax". Received: storage={storage!r}.'
            )
        self.storage = storage
        self.asynchronous = asynchronous
        self._pending: _save.BackgroundSave | None = None
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
        source, _ = _atomic.recover(self.path)
        if source is None:
            return
        # No rollback: a model about to train has nothing worth keeping, and a failed load fails fit.
        manifest, _ = _load.load(self.model, source, None, rollback=False, resume=True)
        training = manifest.get("training") or {}
        epoch, batch = int(training.get("epoch", 0)), int(training.get("batch", 0))
        _compat.set_initial_epoch(self.model, epoch)  # read by fit right after on_train_begin
        if batch:
            self._resume = (epoch, batch)
            self._train_function = self.model.train_function
            self.model.train_function = self._train_or_skip
            self._global_seed = manifest  # restored once the batches trained before are skipped
        else:
            _rng.restore_global_seed(manifest)

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
                _rng.restore_global_seed(self._global_seed)
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
            self._pending = _save.BackgroundSave(
                self.model, self.path, None, {"epoch": epoch, "batch": batch}
            )
            return
        _save.save_everywhere(
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
