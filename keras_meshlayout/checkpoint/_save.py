"""`save_checkpoint`: the arrays, the plan and the manifest, written atomically, in every process.

Orbax saves (`_save_orbax`) have every process write its own shards into one
hidden directory that process 0 completes and moves into place; `BackgroundSave`
does the same in one process while training goes on. h5 saves (`_save_h5`)
gather every variable into one Keras `.weights.h5` in process 0.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import keras
import numpy as np

from ..core._errors import CheckpointError, InvalidOptionError
from . import _atomic, _manifest, _rng
from ._orbax_store import sha256 as _sha256  # imports no Orbax until a save or load uses it

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
        directory: Checkpoint directory; replaced if it exists.
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
    return save_everywhere(model, Path(directory), distribution, storage=storage)


def save_everywhere(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
    storage: str = "orbax",
) -> Path:
    """Saves with `storage` ("orbax" or "h5"); every process of a job calls it.

    With Orbax every process writes its own shards (`_save_orbax`); with h5 process 0 writes
    the whole file (`_save_h5`) and the others wait for it.
    """
    import jax

    if storage == "orbax":
        return _save_orbax(model, target, distribution, training)
    if jax.process_count() == 1:
        return _save_h5(model, target, distribution, training)
    # Process 0 writes, with the distribution lifted: Keras's save_weights builds a throwaway
    # optimizer, whose variables would be a collective under a distribution spanning processes.
    from jax.experimental import multihost_utils

    current = keras.distribution.distribution()
    failure: Exception | None = None
    if jax.process_index() == 0:
        keras.distribution.set_distribution(None)
        try:
            _save_h5(model, target, distribution if distribution is not None else current, training)
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


def _save_h5(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
) -> Path:
    step = target.parent
    wait_for_background_saves(target)
    partial = target.with_name(_atomic.sibling_name(target, "partial"))
    _atomic.IN_FLIGHT.add(partial.name)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic.recover(target)  # a save killed between its renames is finished before this one starts
        step = partial
        partial.mkdir()
        step = partial / _manifest.WEIGHTS
        model.save_weights(partial / _manifest.WEIGHTS)
        _atomic.fsync(partial / _manifest.WEIGHTS)
        manifest: dict[str, Any] = {
            "format": _manifest.H5_FORMAT,
            "keras": keras.__version__,
            "model": model.name,
            "optimizer": _manifest.optimizer_info(model),
            "variables": _manifest.describe(model),
            "weights_sha256": _sha256(partial / _manifest.WEIGHTS),
            "rng": _rng.rng_state(model),
        }
        plan = _manifest.current_plan(model, distribution)
        if plan is not None:
            step = partial / _manifest.PLAN
            _atomic.write_json(partial / _manifest.PLAN, plan.to_dict())
            manifest["plan_sha256"] = _sha256(partial / _manifest.PLAN)
        if training is not None:
            manifest["training"] = dict(training)
        step = partial / _manifest.MANIFEST
        _atomic.write_json(partial / _manifest.MANIFEST, manifest)
        step = partial
        _atomic.fsync(partial)
        step = target
        _atomic.replace_directory(partial, target)
    except BaseException as err:
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(err, OSError):
            raise CheckpointError(_atomic.save_failed(target, step, err)) from err
        raise
    finally:
        _atomic.IN_FLIGHT.discard(partial.name)
    return target


def _save_orbax(
    model: keras.Model,
    target: Path,
    distribution: Any,
    training: Mapping[str, int] | None = None,
) -> Path:
    """A checkpoint whose arrays every process writes its own shards of, with Orbax; all processes call it.

    The protocol is `_save_h5`'s (`_atomic`): everything goes to one hidden sibling directory (named by
    process 0, for all), which process 0 moves into place once every process's shards are on
    disk (Orbax's barrier) and it has written the plan and the manifest. A failure in any
    process is raised in every process, after each of the three steps.
    """
    import jax

    from . import _orbax_store

    primary = jax.process_index() == 0
    wait_for_background_saves(target)
    partial = target.with_name(_common(_atomic.sibling_name(target, "partial")))
    step = [partial]  # what is being written, for the error message

    def prepare() -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        _atomic.recover(target)  # a save killed between its renames is finished before this one starts
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
            "format": _manifest.ORBAX_FORMAT,
            "keras": keras.__version__,
            "model": model.name,
            "optimizer": _manifest.optimizer_info(model),
            "variables": _manifest.describe(model),
            "files": listing,
            "weights_sha256": _orbax_store.digest(listing),
            "rng": _rng.rng_state(model),
        }
        plan = _manifest.current_plan(model, distribution)
        if plan is not None:
            step[0] = partial / _manifest.PLAN
            _atomic.write_json(partial / _manifest.PLAN, plan.to_dict())
            manifest["plan_sha256"] = _sha256(partial / _manifest.PLAN)
        if training is not None:
            manifest["training"] = dict(training)
        step[0] = partial / _manifest.MANIFEST
        _atomic.write_json(partial / _manifest.MANIFEST, manifest)
        step[0] = partial
        _atomic.fsync(partial)
        step[0] = target
        _atomic.replace_directory(partial, target)

    _atomic.IN_FLIGHT.add(partial.name)
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
        _atomic.IN_FLIGHT.discard(partial.name)
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

        wait_for_background_saves(target)
        self.target = target
        self.partial = target.with_name(_atomic.sibling_name(target, "partial"))
        self.error: CheckpointError | None = None
        self._step = self.partial
        _atomic.IN_FLIGHT.add(self.partial.name)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _atomic.recover(target)
            self.partial.mkdir()
            plan = _manifest.current_plan(model, distribution)
            self._plan = None if plan is None else plan.to_dict()
            self._manifest: dict[str, Any] = {
                "format": _manifest.ORBAX_FORMAT,
                "keras": keras.__version__,
                "model": model.name,
                "optimizer": _manifest.optimizer_info(model),
                "variables": _manifest.describe(model),
                "rng": _rng.rng_state(model),
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
                self._step = self.partial / _manifest.PLAN
                _atomic.write_json(self.partial / _manifest.PLAN, self._plan)
                manifest["plan_sha256"] = _sha256(self.partial / _manifest.PLAN)
            self._step = self.partial / _manifest.MANIFEST
            _atomic.write_json(self.partial / _manifest.MANIFEST, manifest)
            self._step = self.partial
            _atomic.fsync(self.partial)
            self._step = self.target
            _atomic.replace_directory(self.partial, self.target)
        except BaseException as err:  # reported by wait(), in the thread that trains
            self._fail(err)
        finally:
            _atomic.IN_FLIGHT.discard(self.partial.name)

    def _fail(self, err: BaseException) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)
        _atomic.IN_FLIGHT.discard(self.partial.name)
        if isinstance(err, Exception):
            cause = err if isinstance(err, OSError) else OSError(None, f"{type(err).__name__}: {err}")
            self.error = CheckpointError(_atomic.save_failed(self.target, self._step, cause))
            self.error.__cause__ = err

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
            raise CheckpointError(_atomic.save_failed(target, step, failure)) from failure
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


def wait_for_background_saves(target: Path) -> None:
    """Lets a background save to `target` finish first, so that nothing reads or writes it meanwhile.

    Its error, if any, is left for whoever started it (the previous checkpoint is intact).
    """
    pending = _BACKGROUND.get(_key(target))
    if pending is not None:
        pending._thread.join()
