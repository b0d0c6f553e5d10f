"""`ResumableCheckpoint`: backs training up as it goes and resumes it exactly, on any mesh."""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import keras
import numpy as np

from .. import _compat
from ..core._errors import CheckpointError, InvalidOptionError, MeshLayoutWarning
from . import _atomic, _backups, _finite, _load, _lock, _preemption, _rng, _save

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

    Preemption: while `fit` runs, SIGTERM and SIGINT (what spot VMs,
    Kubernetes and SLURM send before they stop a job, and Ctrl-C) are caught:
    the current step finishes, every process saves a backup after the same
    step, and the process exits with status 128 + the signal's number (143
    for SIGTERM, 130 for SIGINT), so at most the step under way is lost. A
    second signal of the same kind stops at once.

    One directory, one run: while it trains, a run holds a lock on
    `directory` (`.kml-run.lock`, naming its host, process and start time);
    another run started on it meanwhile is refused with a `CheckpointError`
    naming the holder. Once the holder's process is gone, the next run takes
    the lock over and resumes.

    Args:
        directory: The backup directory. The newest backup is the checkpoint
            `directory/latest` (readable with `load_checkpoint`), replaced
            atomically at each save; the ones before it are kept as
            `directory/step-NNNNNNNNN` (see `max_to_keep`); nothing else there
            is touched.
        save_freq: `"epoch"` (at the end of every epoch) or a number of
            batches (across epochs).
        delete_on_end: Delete the backups once `fit` has completed every epoch
            (and `directory`, if that leaves it empty). Defaults to `True`, like
            `BackupAndRestore`. A run that ends early (`model.stop_training`, as
            `EarlyStopping` and `TerminateOnNaN` set it, an exception, a
            signal) keeps them, its last steps backed up, so that it can resume.
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
            A background save that fails is reported at the next save or when
            `fit` ends (see `max_save_failures`). In a multi-process run, saves
            are synchronous.
        max_to_keep: How many complete backups to keep, the newest at `latest`
            and the ones before it as `step-NNNNNNNNN` (their training step).
            A run resumes from the newest complete one whose files match their
            checksums. At least 1; defaults to 2.
        check_finite: Before each save, check that no weight or optimizer
            variable holds NaN or infinity; a state that does is not saved (a
            `MeshLayoutWarning` names its first such variable), so the backups
            keep the last finite state to resume from. `False` saves whatever
            the state holds.
        max_save_failures: A save that fails (a full disk, a read-only
            directory) is a `MeshLayoutWarning` of one line, and training goes
            on with the previous backups in place; the next save tries again.
            After this many failures in a row, the `CheckpointError` is raised
            and training stops. At least 1; defaults to 3.
        preemption: Catch SIGTERM and SIGINT while training, as described
            above. `False` leaves signals alone.

    Raises:
        InvalidOptionError: `save_freq` is neither `"epoch"` nor a positive integer,
            or `max_to_keep` or `max_save_failures` is not a positive integer.
        CheckpointError: (from `fit`) another live run holds `directory`.

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
        max_to_keep: int = 2,
        check_finite: bool = True,
        max_save_failures: int = 3,
        preemption: bool = True,
    ) -> None:
        super().__init__()
        _check_options(save_freq, storage, asynchronous, max_to_keep, max_save_failures)
        self.storage = storage
        self.asynchronous = asynchronous
        self.directory = Path(directory)
        self.path = self.directory / _backups.LATEST
        self.save_freq = save_freq
        self.delete_on_end = delete_on_end
        self.max_to_keep = max_to_keep
        self.check_finite = check_finite
        self.max_save_failures = max_save_failures
        self.preemption = preemption
        self._backups = _backups.Backups(self.directory, max_to_keep)
        self._run_lock = _lock.DirectoryLock(self.directory)
        self._notice = _preemption.Notice()
        self._pending: _save.BackgroundSave | None = None
        self._failures = 0  # saves failed in a row
        self._epoch = 0
        self._done = 0  # batches done in the current epoch
        self._since_save = 0
        self._epochs_done = 0  # epochs completed, every batch trained
        self._stopped_by: int | None = None  # the signal that stopped training
        self._resume: tuple[int, int] | None = None  # (epoch, batches to skip in it)
        self._train_function = None
        self._skip_now = False
        self._global_seed: Mapping[str, Any] | None = None  # a manifest whose global seed is due

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        _save.refuse_lora_in_h5(_compat.callback_model(self), self.storage)  # before any step, not at a save
        self._wait_for_save()  # a backup this callback started in a fit that died
        self._restore_train_function()  # left in place if the last fit died while skipping
        self._since_save = 0
        self._epochs_done = 0
        self._stopped_by = None
        self._resume = None
        self._global_seed = None
        self._failures = 0
        self._take_lock()
        try:
            self._resume_from_backup()
        except BaseException:
            self._release_lock()  # a fit that fails to start holds nothing
            raise
        if self.preemption:
            self._notice.install(_compat.callback_model(self))

    def _resume_from_backup(self) -> None:
        # A save killed midway is finished (or removed) here: after a kill between its two renames,
        # the newest complete backup is moved into place rather than lost.
        recovered, _ = _atomic.recover(self.path)
        # A sibling that could not be moved into place (a read-only directory) is read where it is.
        source = recovered if recovered not in (None, self.path) else self._backups.newest()
        if source is None:
            return
        # No rollback: a model about to train has nothing worth keeping, and a failed load fails fit.
        manifest, _ = _load.load(self.model, source, None, rollback=False, resume=True)
        training = manifest.get("training") or {}
        epoch, batch = int(training.get("epoch", 0)), int(training.get("batch", 0))
        _compat.set_initial_epoch(self.model, epoch)  # read by fit right after on_train_begin
        self._epochs_done = epoch
        self._warn_if_data_differ(source, epoch, batch)
        if batch:
            self._resume = (epoch, batch)
            self._train_function = self.model.train_function
            self.model.train_function = self._train_or_skip
            self._global_seed = manifest  # restored once the batches trained before are skipped
        else:
            _rng.restore_global_seed(manifest)

    def _warn_if_data_differ(self, source: Path, epoch: int, batch: int) -> None:
        """Warns when the backup's position is past what this fit trains: nothing, or the epoch whole."""
        epochs, steps = (self.params.get(key) if self.params else None for key in ("epochs", "steps"))
        if epochs is not None and epoch >= epochs and not batch:
            warnings.warn(
                f"ResumableCheckpoint: the backup {source} is of a run that completed {epoch} epochs, "
                f"and this fit asks for {epochs}: it trains nothing. fit counts epochs from the "
                f"backup's, so to train on, pass epochs greater than {epoch}; to start a new run, give "
                f"the callback another directory, or delete {self.directory}.",
                MeshLayoutWarning,
                stacklevel=4,
            )
        if batch and steps is not None and batch >= steps:
            self._warn_fewer_batches(source, epoch, batch, steps)

    def _warn_fewer_batches(self, source: Path, epoch: int, batch: int, steps: int) -> None:
        warnings.warn(
            f"ResumableCheckpoint: the backup {source} was taken after batch {batch} of epoch "
            f"{epoch + 1}, but this fit's epochs have {steps} batches: the data differ from the "
            f"interrupted run's, so the resume is not exact. Epoch {epoch + 1}'s batches are all skipped "
            "as trained, and training goes on from the next epoch. Fix: resume with the same data "
            "(samples, batch size, steps_per_epoch), or start a new run in another directory.",
            MeshLayoutWarning,
            stacklevel=3,
        )

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
        self._since_save += self._done - done
        signum = self._notice.requested() if self.preemption else None
        if signum is not None:  # every process saw it after this step: save it, and stop
            self._stopped_by = signum
            self._save_here()
            self.model.stop_training = True
            return
        if self.save_freq != "epoch" and self._since_save >= self.save_freq:
            self._save_here()

    def on_epoch_end(self, epoch: int, logs: Mapping[str, Any] | None = None) -> None:
        resume = self._resume
        if resume is not None and resume[0] == epoch and not (self.params or {}).get("steps"):
            # An epoch of unknown length (a generator) ended before the batches to skip did.
            self._warn_fewer_batches(self.path, epoch, resume[1], self._done)
        steps = self.params.get("steps") if self.params else None
        if self._stopped_by is None and (self._done >= steps if steps else not self.model.stop_training):
            self._epochs_done = epoch + 1
        if self.save_freq == "epoch" and self._epochs_done == epoch + 1:
            self._since_save = 0
            self._save(epoch + 1, 0)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        # A signal after the last step (during the last validation) stops the run as after any step:
        # backed up, the backups kept, the process ended with 128 + N (it was lost: fit returned 0).
        late = self._notice.requested() if self.preemption and self._stopped_by is None else None
        self._notice.uninstall()
        if late is not None:
            self._stopped_by = late
            if self._since_save:
                self._save_here()
        epochs = self.params.get("epochs") if self.params else None
        completed = self._stopped_by is None and (epochs is None or self._epochs_done >= epochs)
        if not completed and self._since_save and self._stopped_by is None:
            self._save_here()  # stopped early (stop_training): its last steps are backed up too
        try:
            self._wait_for_save()
        finally:
            self._restore_train_function()
            _compat.set_initial_epoch(self.model, None)  # BackupAndRestore leaves it set for the next fit
            if completed and self.delete_on_end:
                self._backups.delete()
            self._release_lock()
        if completed and self.delete_on_end:
            try:
                self.directory.rmdir()  # only if empty
            except OSError:
                pass
        if self._stopped_by is not None:
            self._exit_preempted(self._stopped_by)

    def _save_here(self) -> None:
        """Backs up the state after the batch just trained."""
        self._since_save = 0
        steps = self.params.get("steps") if self.params else None
        if steps and self._done >= steps:
            self._save(self._epoch + 1, 0)
        else:
            self._save(self._epoch, self._done)

    def _save(self, epoch: int, batch: int) -> None:
        import jax

        if self.check_finite:
            bad = _finite.first_nonfinite(self.model)
            if bad is not None:
                warnings.warn(
                    f"Not backing up epoch {epoch}, batch {batch}: {bad} holds NaN or infinity. The "
                    f"backups keep the last finite state ({self.path}). Fix: lower the learning rate, "
                    "clip gradients, or stop with keras.callbacks.TerminateOnNaN; pass check_finite=False "
                    "to back up such states anyway.",
                    MeshLayoutWarning,
                    stacklevel=2,
                )
                return
        training = {"epoch": epoch, "batch": batch, "step": self._step()}
        self._wait_for_save()
        try:
            if self.asynchronous and jax.process_count() == 1:
                self._pending = _save.BackgroundSave(
                    self.model, self.path, None, training, self._backups.keep
                )
                return
            _save.save_everywhere(
                self.model, self.path, None, training, storage=self.storage, keep=self._backups.keep
            )
        except CheckpointError as err:
            self._save_failed(err)
        else:
            self._failures = 0

    def _step(self) -> int:
        optimizer = getattr(self.model, "optimizer", None)
        iterations = getattr(optimizer, "iterations", None)
        if iterations is None:
            return 0
        value = iterations.value
        if not getattr(value, "is_fully_addressable", True):
            value = value.addressable_data(0)
        return int(np.asarray(value))

    def wait(self) -> None:
        """Blocks until the backup being written in the background (`asynchronous=True`), if any, is in place.

        `fit` waits for it before it returns; call this after a `fit` that raised, before
        copying or reading `directory` from elsewhere. (A process that exits waits for it too,
        up to 10 minutes.)

        Raises:
            CheckpointError: That backup could not be written; the one before it is intact.
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
            self._failures = 0

    def _wait_for_save(self) -> None:
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.wait()
        except CheckpointError as err:
            self._save_failed(err)
        else:
            self._failures = 0

    def _save_failed(self, err: CheckpointError) -> None:
        """One line, and training goes on; after `max_save_failures` in a row, the error."""
        self._failures += 1
        if self._failures >= self.max_save_failures:
            raise CheckpointError(
                f"{err} That is {self._failures} failed saves in a row (max_save_failures="
                f"{self.max_save_failures}): training stops."
            ) from err
        warnings.warn(
            f"{err} Training goes on; the next backup tries again ({self._failures} of "
            f"max_save_failures={self.max_save_failures} failures in a row).",
            MeshLayoutWarning,
            stacklevel=2,
        )

    def _take_lock(self) -> None:
        """Locks the directory in process 0; every process fails alike if another run holds it."""
        import jax

        failure: CheckpointError | None = None
        if jax.process_index() == 0:
            try:
                self._run_lock.acquire()
            except CheckpointError as err:
                failure = err
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            held = int(multihost_utils.broadcast_one_to_all(np.int32(failure is not None)))
            if held and failure is None:
                failure = CheckpointError(
                    f"The backup directory {self.directory} is in use by another run (process 0's error "
                    "names it). Fix: give this run its own directory, or wait until that run ends."
                )
        if failure is not None:
            raise failure

    def _release_lock(self) -> None:
        import jax

        if jax.process_index() == 0:
            self._run_lock.release()

    def _exit_preempted(self, signum: int) -> None:
        status = _preemption.PREEMPTED_EXIT_BASE + signum
        name = _preemption.signal_name(signum)
        print(
            f"keras_meshlayout: {name} received: training stopped after epoch {self._epoch}, batch "
            f"{self._done}, backed up at {self.path}. Exiting with status {status}; run the same "
            "script again to resume.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(status)

    def _train_or_skip(self, state: Any, iterator: Iterator[Any]) -> tuple[dict, Any]:
        """The model's train function while resuming: reads past a batch trained before the crash.

        A stale copy left behind by an interrupted `fit` only ever trains.
        """
        if not self._skip_now:
            return self._train_function(state, iterator)
        next(iterator)
        for _ in range(getattr(_compat.callback_model(self), "steps_per_execution", 1) - 1):
            try:
                next(iterator)
            except StopIteration:
                break
        return {}, state

    def _restore_train_function(self) -> None:
        if self._train_function is not None:
            if _compat.callback_model(self).train_function == self._train_or_skip:
                _compat.callback_model(self).train_function = self._train_function
            self._train_function = None


def _check_options(
    save_freq: Any, storage: Any, asynchronous: bool, max_to_keep: Any, max_save_failures: Any
) -> None:
    if storage not in ("orbax", "h5"):
        raise InvalidOptionError(
            f'storage must be "orbax" (the default) or "h5". Received: storage={storage!r}.'
        )
    if asynchronous and storage != "orbax":
        raise InvalidOptionError(
            "asynchronous=True writes backups with Orbax in the background: leave storage at its "
            f'default, "orbax". Received: storage={storage!r}.'
        )
    if save_freq != "epoch" and not _positive(save_freq):
        raise InvalidOptionError(
            f'save_freq must be "epoch" or a positive number of batches. Received: save_freq={save_freq!r}.'
        )
    for name, value in (("max_to_keep", max_to_keep), ("max_save_failures", max_save_failures)):
        if not _positive(value):
            raise InvalidOptionError(f"{name} must be a positive integer. Received: {name}={value!r}.")


def _positive(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
