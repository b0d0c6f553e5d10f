"""`save_checkpoint`: the arrays, the plan and the manifest, written atomically, in every process.

Orbax saves (`_save_orbax`) have every process write its own shards into one
hidden directory that process 0 completes and moves into place; `BackgroundSave`
does the same in one process while training goes on. h5 saves (`_save_h5`)
gather every variable into one Keras `.weights.h5` in process 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import keras
import numpy as np

from .. import _compat
from ..core._errors import CheckpointError, InvalidOptionError
from ..core._progress import spinner
from . import _atomic, _manifest, _orbax_store, _rng  # _orbax_store imports no Orbax until it is used

if TYPE_CHECKING:
    from ..core._distribution import ModelParallel

__all__ = ["save_checkpoint"]


def save_checkpoint(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    distribution: ModelParallel | None = None,
    storage: Literal["orbax", "h5"] = "orbax",
) -> Path:
    """Saves the weights (optimizer state included), the plan and a manifest, atomically.

    The arrays are stored with Orbax (on TensorStore): every process writes
    only the shards its devices hold, one copy of each, and `load_checkpoint`
    reads, in every process, only the slices its devices hold under the plan
    current then, on any mesh. Every process must call `save_checkpoint`,
    and the directory must be on a file system they all see.

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
        directory: Checkpoint directory; replaced if it holds a checkpoint
            (or nothing).
        distribution: The `kml.ModelParallel` whose plan to save; defaults to
            the current distribution (no plan is saved without one).
        storage: How the arrays are stored. `"orbax"` (the default): Orbax
            checkpoints, `model.orbax/` and `optimizer.orbax/`, each process
            writing its own shards. `"h5"`: one Keras `model.weights.h5`
            file, every variable gathered whole (in a multi-process run, by
            process 0, which must then hold every variable whole), the
            format earlier versions wrote. `load_checkpoint` reads either.

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: the save could not be written (a full disk, a
            read-only directory, any `OSError`): the message names the file
            and says whether a previous checkpoint at `directory` is intact
            (it always is: nothing replaces it until the new one is complete).
            Also, before anything is written, when `directory` holds what no
            save wrote (a file, or a directory of files without a manifest),
            which the save would otherwise delete.

    Example:
        >>> import keras, keras_meshlayout as kml, tempfile, os
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*kernel", (None, "model"))])
        >>> with dist.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4096, name="d")], name="m")
        >>> path = kml.save_checkpoint(model, os.path.join(tempfile.mkdtemp(), "step_1"), distribution=dist)
        >>> sorted(p.name for p in path.iterdir())
        ['manifest.json', 'model.orbax', 'plan.json']
        >>> path = kml.save_checkpoint(model, path.with_name("step_2"), distribution=dist, storage="h5")
        >>> sorted(p.name for p in path.iterdir())
        ['manifest.json', 'model.weights.h5', 'plan.json']
    """
    if storage not in ("orbax", "h5"):
        raise InvalidOptionError(
            f'storage must be "orbax" (the default) or "h5". Received: storage={storage!r}.'
        )
    if not model.weights:
        raise CheckpointError(
            f"save_checkpoint: model {model.name!r} has no variables yet (not built), so the checkpoint "
            "would hold nothing to load; nothing was written. Fix: build it first: call it on a batch, "
            "or model.build(input_shape)."
        )
    _refuse_what_is_not_a_checkpoint(Path(directory))
    return save_everywhere(model, Path(directory), distribution, storage=storage)


def refuse_lora_in_h5(model: keras.Model, storage: str) -> None:
    """Raises `CheckpointError` for `storage="h5"` of a model with LoRA enabled: Keras's h5 weights hold
    each such kernel merged with its adapters and no adapters, so training resumed from them does not
    continue the run (every weight differed after a resume, measured on a LoRA Dense)."""
    if storage != "h5":
        return
    lora = [layer.name for layer in _compat.sublayers(model) if getattr(layer, "lora_enabled", False)]
    if lora:
        raise CheckpointError(
            f'storage="h5" cannot hold the LoRA adapters of {", ".join(map(repr, lora[:3]))}'
            f"{' and more' if len(lora) > 3 else ''}: Keras's h5 weights merge them into their kernels "
            'and drop them, so a resumed run would not continue this one. Fix: storage="orbax" (the '
            "default), which keeps them."
        )


def _refuse_what_is_not_a_checkpoint(target: Path) -> None:
    """Raises `CheckpointError` when `target` holds something a save would replace that no save wrote.

    A save replaces its directory whole: a directory of the user's own files (no manifest) or a
    file there would be deleted. An empty directory, or a checkpoint, is replaced.
    """
    if not target.exists() and not target.is_symlink():
        return
    if target.is_dir() and not target.is_symlink():
        if (target / _manifest.MANIFEST).is_file() or not any(target.iterdir()):
            return
        what = f"a directory that is not a checkpoint (it has no {_manifest.MANIFEST})"
    else:
        what = "a file" if target.is_file() else "not a directory"
    raise CheckpointError(
        f"save_checkpoint: {target} exists and is {what}. A save replaces its directory whole, so "
        f"what is there would be deleted; nothing was written. Fix: save to a new directory (or to one "
        f"a save wrote before), or move {target} away first."
    )


def save_everywhere(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
    storage: str = "orbax",
    keep: _atomic.Keep | None = None,
) -> Path:
    """Saves with `storage` ("orbax" or "h5"); every process of a job calls it.

    With Orbax every process writes its own shards (`_save_orbax`); with h5 process 0 writes
    the whole file (`_save_h5`) and the others wait for it. `keep`: where to keep the
    checkpoint this one replaces (`_atomic.replace_directory`).
    """
    import jax

    refuse_lora_in_h5(model, storage)
    extras = _Extras(training, keep)
    if storage == "orbax":
        return _save_orbax(model, target, distribution, extras)
    if jax.process_count() == 1:
        return _save_h5(model, target, distribution, extras)
    # Process 0 writes, with the distribution lifted: Keras's save_weights builds a throwaway
    # optimizer, whose variables would be a collective under a distribution spanning processes.
    from jax.experimental import multihost_utils

    current = keras.distribution.distribution()
    failure: Exception | None = None
    if jax.process_index() == 0:
        keras.distribution.set_distribution(None)
        try:
            _save_h5(model, target, distribution if distribution is not None else current, extras)
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


def _manifest_of(
    model: keras.Model, storage_format: int, training: Mapping[str, int] | None
) -> dict[str, Any]:
    """The manifest's fields every save writes (the files' checksums are added by each kind of save)."""
    manifest: dict[str, Any] = {
        "format": storage_format,
        "keras": keras.__version__,
        "model": model.name,
        "optimizer": _manifest.optimizer_info(model),
        "variables": _manifest.describe(model),
        "rng": _rng.rng_state(model),
    }
    if training is not None:
        manifest["training"] = dict(training)
    return manifest


def _plan_of(model: keras.Model, distribution: Any) -> dict[str, Any] | None:
    plan = _manifest.current_plan(model, distribution)
    return None if plan is None else plan.to_dict()


def _arrays(model: keras.Model) -> dict[str, list[Any]]:
    """The arrays to store, by kind: the model's variables and the optimizer's (once built)."""
    optimizer = getattr(model, "optimizer", None)
    slots = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return {"model": [v.value for v in model.weights], "optimizer": [v.value for v in slots]}


def _orbax_manifest(partial: Path, manifest: Mapping[str, Any]) -> dict[str, Any]:
    """`manifest` with the listing (and its digest) of the arrays Orbax wrote under `partial`."""
    listing = _orbax_store.files(partial)
    return {**manifest, "files": listing, "weights_sha256": _orbax_store.digest(listing)}


@dataclasses.dataclass(frozen=True)
class _Extras:
    """What a save writes besides the model and its plan, and where the checkpoint it replaces goes."""

    training: Mapping[str, int] | None = None  # the position in training, for the manifest
    keep: _atomic.Keep | None = None  # see `_atomic.replace_directory`


def _save_h5(model: keras.Model, target: Path, distribution: Any, extras: _Extras) -> Path:
    wait_for_background_saves(target)
    training = extras.training
    with _atomic.writing(target, keep=extras.keep) as save:
        save.prepare()
        weights = save.at(save.partial / _manifest.WEIGHTS)
        with spinner("checkpoint") as step:
            step(f"writing {weights.name}")
            model.save_weights(weights)
        _atomic.fsync(weights)
        manifest = _manifest_of(model, _manifest.H5_FORMAT, training)
        manifest["weights_sha256"] = _orbax_store.sha256(weights)
        save.finish(manifest, _plan_of(model, distribution))
    return target


def _save_orbax(model: keras.Model, target: Path, distribution: Any, extras: _Extras) -> Path:
    """A checkpoint whose arrays every process writes its own shards of, with Orbax; all processes call it.

    The procedure is `_atomic.writing`'s: everything goes to one hidden sibling directory (named by
    process 0, for all), which process 0 moves into place once every process's shards are on
    disk (Orbax's barrier) and it has written the plan and the manifest. A failure in any
    process is raised in every process, after each of the three steps.
    """
    import jax

    primary = jax.process_index() == 0
    wait_for_background_saves(target)
    name = _common(_atomic.sibling_name(target, "partial"))
    training = extras.training
    with _atomic.writing(target, name, owner=primary, keep=extras.keep) as save:

        def write_arrays() -> None:
            for kind, values in _arrays(model).items():
                save.at(save.partial / _orbax_store.DIRECTORIES[kind])
                _orbax_store.save(save.partial, {kind: values})

        def finish() -> None:
            manifest = _manifest_of(model, _manifest.ORBAX_FORMAT, training)
            save.finish(_orbax_manifest(save.partial, manifest), _plan_of(model, distribution))

        _agree(_attempt(save.prepare) if primary else None, target)
        _agree(_attempt(write_arrays), target)
        _agree(_attempt(finish) if primary else None, target)
    return target


def _attempt(run: Any) -> BaseException | None:
    try:
        run()
    except BaseException as err:  # raised by _agree, once every process knows
        return err
    return None


class BackgroundSave:
    """An Orbax save, in one process, whose files are written while training goes on.

    Starting it (the constructor) copies the arrays off the devices and snapshots the
    manifest and the plan; a thread then waits for Orbax's writes and finishes the save
    (`_atomic.Writing.finish`), as `_save_orbax` does. Until then the previous checkpoint
    stays in place; a process killed meanwhile leaves a hidden partial directory, which the
    next save or load removes.
    """

    def __init__(
        self,
        model: keras.Model,
        target: Path,
        distribution: Any,
        training: Mapping[str, int] | None,
        keep: _atomic.Keep | None = None,
    ) -> None:
        import threading

        wait_for_background_saves(target)
        self.target = target
        self.error: BaseException | None = None
        self._save = _atomic.Writing(target, keep=keep)
        self._writes: list[tuple[str, Any]] = []
        try:
            with self._save:
                try:
                    self._save.prepare()
                    self._manifest = _manifest_of(model, _manifest.ORBAX_FORMAT, training)
                    self._plan = _plan_of(model, distribution)
                    for kind, values in _arrays(model).items():
                        if values:
                            self._save.at(self._save.partial / _orbax_store.DIRECTORIES[kind])
                            write = _orbax_store.start_save(self._save.partial, kind, values)
                            self._writes.append((kind, write))
                except BaseException:
                    self._abandon()  # a kind started before the one that failed is still writing
                    raise
        except BaseException:
            self._save.close()
            raise
        self._thread = threading.Thread(target=self._complete, name=f"kml-save-{target.name}", daemon=True)
        _BACKGROUND[_key(target)] = self
        _finish_at_exit()
        self._thread.start()

    def _complete(self) -> None:
        save = self._save
        try:
            with save:
                try:
                    while self._writes:
                        kind, write = self._writes.pop(0)
                        save.at(save.partial / _orbax_store.DIRECTORIES[kind])
                        _orbax_store.finish(write)
                finally:
                    self._abandon()  # before the partial directory is removed
                save.finish(_orbax_manifest(save.partial, self._manifest), self._plan)
        except BaseException as err:  # reported by wait(), in the thread that trains
            self.error = err
        finally:
            save.close()

    def _abandon(self) -> None:
        """Waits for (and closes) every write still under way, once the save has failed.

        None may be left running: its thread would go on writing into the partial directory, and
        Orbax's checkpointer, collected with its thread never joined, checks that thread from its
        `__del__`, which deadlocks the process when the collection happens while CPython's
        threading module holds its shutdown lock (a whole run hung on a full disk this way).
        """
        while self._writes:
            _, write = self._writes.pop(0)
            try:
                _orbax_store.finish(write)
            except BaseException:  # the save has already failed: its first error is the one reported
                pass

    def wait(self) -> None:
        """Blocks until the checkpoint is in place; raises `CheckpointError` if it could not be written."""
        self._thread.join()
        if _BACKGROUND.get(_key(self.target)) is self:
            del _BACKGROUND[_key(self.target)]
        if self.error is not None:
            raise self.error


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


def _agree(failure: BaseException | None, target: Path) -> None:
    """Raises `failure` here, and a `CheckpointError` in every other process, if any process failed.

    With several processes, a collective: every process calls it at the same point. An `OSError`
    is turned into a `CheckpointError` by the save's `_atomic.writing`.
    """
    import jax

    failed: list[int] = []
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(failure is not None))
        failed = [i for i, flag in enumerate(np.asarray(flags).reshape(-1)) if flag]
    if failure is not None:
        raise failure
    if failed:
        raise CheckpointError(
            f"Saving checkpoint {target} failed in process(es) {failed} (their error says why). "
            f"Whatever was at {target} before is intact."
        )


#: The background save under way to each checkpoint path (at most one), in this process.
_BACKGROUND: dict[str, BackgroundSave] = {}


def _key(target: Path) -> str:
    return os.path.abspath(target)


#: How long a process that is exiting waits for its background saves before leaving them unfinished.
EXIT_DEADLINE_S = 600.0


def _finish_at_exit() -> None:
    """Registers (once) the wait at interpreter exit for the background saves still under way.

    A script whose `fit` raised would otherwise exit with its last backup half written (its
    thread is a daemon, stopped at exit) and resume from the one before, losing the steps since.
    """
    global _EXIT_REGISTERED
    if not _EXIT_REGISTERED:
        _compat.at_exit_before_thread_pools(finish_background_saves)
        _EXIT_REGISTERED = True


_EXIT_REGISTERED = False


def finish_background_saves(deadline_s: float | None = None) -> list[Path]:
    """Waits for every background save of this process, up to `deadline_s` in all; returns those left.

    Run at interpreter exit. Errors are not raised here (each save's previous checkpoint is intact,
    and the process is leaving); a save still running at the deadline is named on stderr and left
    to be removed by the next save or load.
    """
    deadline = time.monotonic() + (EXIT_DEADLINE_S if deadline_s is None else deadline_s)
    left = []
    for pending in list(_BACKGROUND.values()):
        if pending._thread.is_alive():
            print(
                f"keras_meshlayout: finishing the background save of {pending.target} before exiting.",
                file=sys.stderr,
                flush=True,
            )
        pending._thread.join(max(0.0, deadline - time.monotonic()))
        if pending._thread.is_alive():
            left.append(pending.target)
            print(
                f"keras_meshlayout: the background save of {pending.target} did not finish in time "
                "and is abandoned; the checkpoint before it is intact.",
                file=sys.stderr,
                flush=True,
            )
    return left


def wait_for_background_saves(target: Path) -> None:
    """Lets a background save to `target` finish first, so that nothing reads or writes it meanwhile.

    Its error, if any, is left for whoever started it (the previous checkpoint is intact).
    """
    pending = _BACKGROUND.get(_key(target))
    if pending is not None:
        pending._thread.join()
