"""Saves that complete or leave nothing behind: hidden siblings, fsync, rename, recovery.

A save writes `.NAME.partial-HOST-PID-TAG`, moves the previous checkpoint
aside to `.NAME.old-HOST-PID-TAG`, moves the new one into place, then deletes
the old one. `writing(target)` is that procedure, once for every kind of save
(h5, Orbax, in the background): it records what is being written, writes the
plan and the manifest last, and turns an `OSError` into one `CheckpointError`
that names the file and says what happened to the previous checkpoint.
`recover` finishes what a save killed between those steps left undone (the
newest complete, verified checkpoint wins) and removes what dead writers left
behind; a sibling a live process may still be writing is never touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from ..core._errors import CheckpointError
from . import _manifest
from ._orbax_store import sha256

#: Hidden directories of saves this process has under way (by name): never stale.
IN_FLIGHT: set[str] = set()


#: How long a save from another host may go without writing anything before it counts as dead.
_FOREIGN_STALE_AFTER_S = 24 * 3600


def hostname() -> str:
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"


def sibling_name(target: Path, kind: Literal["partial", "old"]) -> str:
    """`.NAME.partial-HOST-PID-TAG`: who writes it, so that another process can tell it is stale."""
    return f".{target.name}.{kind}-{hostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclasses.dataclass(frozen=True)
class _Sibling:
    """A hidden directory a save to `target` left beside it."""

    path: Path
    kind: str  # "partial": a new checkpoint being written; "old": the previous one, moved aside
    host: str | None  # None: named by a version that did not record its writer
    pid: int | None

    @property
    def complete(self) -> bool:
        return _manifest.complete(self.path)

    def alive(self) -> bool:
        """Whether the process that writes it may still be running (then it is left alone)."""
        if self.host is None:
            return False
        if self.host != hostname():
            try:
                newest = max([self.path.stat().st_mtime] + [p.stat().st_mtime for p in self.path.iterdir()])
            except OSError:
                return False
            return time.time() - newest < _FOREIGN_STALE_AFTER_S
        if self.pid == os.getpid():
            return self.path.name in IN_FLIGHT
        return process_alive(self.pid)

    def describe(self) -> str:
        writer = "" if self.host is None else f" (process {self.pid} on {self.host})"
        return f"{self.path.name}{writer}"


def process_alive(pid: int | None) -> bool:
    """Whether process `pid` of this host is running (not ended, not a zombie)."""
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


def find_siblings(target: Path) -> list[_Sibling]:
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


def recover(target: Path) -> tuple[Path | None, list[str]]:
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
    siblings = [s for s in find_siblings(target) if not s.alive()]
    chosen = target if _manifest.complete(target) else None
    if chosen is None and not target.exists():

        def newest(s: _Sibling) -> tuple[int, bool]:
            try:
                return (s.path / _manifest.MANIFEST).stat().st_mtime_ns, s.kind == "partial"
            except OSError:  # moved away meanwhile, by another process recovering it
                return 0, False

        for candidate in sorted((s for s in siblings if s.complete), key=newest, reverse=True):
            if not _manifest.verified(candidate.path):
                continue
            try:
                os.replace(candidate.path, target)
                fsync(target.parent)
                chosen = target
            except OSError:  # another process did it first, or the directory is read-only
                chosen = (
                    target
                    if _manifest.complete(target)
                    else candidate.path
                    if candidate.path.is_dir()
                    else None
                )
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


def siblings_hint(source: Path, removed: Sequence[str] = ()) -> str:
    """What interrupted saves left beside a missing checkpoint, if anything."""
    if not source.parent.is_dir():
        return " Fix: check the path."
    hint = ""
    if removed:
        hint += (
            f" Removed what {len(removed)} save(s) killed before completing had left beside it "
            f"({', '.join(removed)}): none held a complete checkpoint."
        )
    found = find_siblings(source)
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


def write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def fsync(path: Path) -> None:
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


#: Where to keep the checkpoint a save replaces (given the path it was moved aside to), or `None`.
Keep = Callable[[Path], "Path | None"]


def replace_directory(partial: Path, target: Path, keep: Keep | None = None) -> None:
    """Moves the complete `partial` directory to `target`, replacing any old one.

    Should the second move fail, the previous checkpoint is moved back; should the
    process be killed between the two, the next save or load finishes the job
    (`recover`). The previous checkpoint is then deleted, or moved to `keep(it)`.
    """
    old = None
    if target.exists():
        old = target.with_name(sibling_name(target, "old"))
        IN_FLIGHT.add(old.name)
        os.replace(target, old)
    try:
        os.replace(partial, target)
        fsync(target.parent)
    except BaseException:
        if old is not None and not target.exists():
            os.replace(old, target)
        if old is not None:
            IN_FLIGHT.discard(old.name)
        raise
    if old is not None:
        kept = keep(old) if keep is not None else None
        try:
            if kept is None:
                raise OSError
            os.replace(old, kept)
        except OSError:
            shutil.rmtree(old, ignore_errors=True)
        IN_FLIGHT.discard(old.name)


#: Where the error code stands in what TensorStore ("[os_error_code='28']") and HDF5 ("errno = 28") say.
_ERROR_CODE = re.compile(r"os_error_code='?(\d+)|errno = (\d+)")


def failure_reason(err: OSError) -> str:
    """Why a write failed, on one line: the system's words for its error code where one is known.

    HDF5 and TensorStore wrap a full disk in a paragraph of their own (file descriptors, offsets,
    database paths); the error code says it all.
    """
    code = err.errno
    text = err.strerror or f"{type(err).__name__}: {err}"
    if code is None:
        found = _ERROR_CODE.search(text)
        code = None if found is None else int(found[1] or found[2])
    if code is not None:
        return f"{os.strerror(code)} (errno {code})"
    return " ".join(text.split())


def save_failed(target: Path, step: Path, err: OSError, left: Path | None = None) -> str:
    """The message of a save that failed while writing `step`, saying what happened to `target`.

    `left` is the partial directory when it could not be removed (the next save to `target`
    removes it, once its writer is gone).
    """
    why = failure_reason(err)
    if _manifest.complete(target):
        previous = f"The previous checkpoint at {target} is intact."
    elif target.exists():
        previous = f"{target} was left as it was (it holds no complete checkpoint)."
    else:
        previous = f"Nothing was written at {target} (there was no checkpoint there before)."
    written = (
        "What this save had written was removed."
        if left is None
        else f"What this save had written is left in {left}: it could not be removed (the next save to "
        f"{target.name} removes it, or delete it by hand)."
    )
    return (
        f"Saving checkpoint {target} failed while writing {step}: {why}. {previous} {written} "
        "Fix: free space on that disk, or check that the directory is writable, and save again."
    )


class Writing:
    """One save to `target` under way: its hidden partial directory and what it is writing now.

    Every save (h5, Orbax in every process, Orbax in the background) goes
    through these steps: `prepare`, its own arrays (recording each file with
    `at`), then `finish`. Used as a context manager (`with writing:`, possibly
    several times, as the background save does, in two threads), an error
    inside removes the partial directory and an `OSError` comes out as one
    `CheckpointError` saying which file was being written and that the previous
    checkpoint is intact. `close` ends the save (the partial directory is then
    no longer in flight).

    Args:
        target: The checkpoint directory the save replaces.
        name: The partial directory's name (default: a new one, naming this
            process); in a multi-process save, process 0's, for all.
        owner: Whether this process removes the partial directory on failure
            (in a multi-process save, only process 0 does).
        keep: Where to keep the checkpoint this save replaces (see
            `replace_directory`); by default it is deleted.
    """

    def __init__(
        self, target: Path, name: str | None = None, *, owner: bool = True, keep: Keep | None = None
    ) -> None:
        self.target = target
        self.keep = keep
        self.partial = target.with_name(name or sibling_name(target, "partial"))
        self.owner = owner
        self.step = target.parent  # what is being written, for the error message
        IN_FLIGHT.add(self.partial.name)

    def at(self, path: Path) -> Path:
        """Records that `path` is being written now; returns it."""
        self.step = path
        return path

    def prepare(self) -> None:
        """Creates the partial directory, after finishing a save killed between its renames."""
        self.at(self.target.parent).mkdir(parents=True, exist_ok=True)
        recover(self.target)
        self.at(self.partial).mkdir()

    def finish(self, manifest: Mapping[str, Any], plan: Mapping[str, Any] | None) -> None:
        """Writes the plan and the manifest (last), flushes, and moves the checkpoint into place."""
        manifest = dict(manifest)
        if plan is not None:
            write_json(self.at(self.partial / _manifest.PLAN), plan)
            manifest["plan_sha256"] = sha256(self.partial / _manifest.PLAN)
        write_json(self.at(self.partial / _manifest.MANIFEST), manifest)
        fsync(self.at(self.partial))
        self.at(self.target)
        replace_directory(self.partial, self.target, self.keep)

    def failed(self, err: BaseException) -> BaseException:
        """Removes what this save wrote (if it is the owner); returns the error to raise for `err`."""
        if self.owner:
            shutil.rmtree(self.partial, ignore_errors=True)
        if not isinstance(err, OSError):
            return err
        left = self.partial if self.owner and self.partial.exists() else None
        error = CheckpointError(save_failed(self.target, self.step, err, left))
        error.__cause__ = err
        return error

    def close(self) -> None:
        IN_FLIGHT.discard(self.partial.name)

    def __enter__(self) -> Writing:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, err: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if err is None:
            return
        mapped = self.failed(err)
        if mapped is not err:
            raise mapped from err


@contextlib.contextmanager
def writing(
    target: Path, name: str | None = None, *, owner: bool = True, keep: Keep | None = None
) -> Iterator[Writing]:
    """A save to `target`, from start to end (see `Writing`)."""
    save = Writing(target, name, owner=owner, keep=keep)
    try:
        with save:
            yield save
    finally:
        save.close()
