"""One directory, one run: the lock a training run holds on its backup directory.

A run that backs up into a directory holds `DIRECTORY/.kml-run.lock` while it
trains: a JSON file naming its host, process id and start time, created with
`O_EXCL` so that two runs cannot both create it, and refreshed every
`REFRESH_S` seconds by a thread. A second run on the directory is refused with
a `CheckpointError` naming the holder while the holder is alive; once it is
gone (its process has ended, on this host; its lock not refreshed for
`STALE_AFTER_S` seconds, on another) the next run takes the lock over and
resumes from the backup, which is how a run interrupted by a kill restarts.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from ..core._errors import CheckpointError
from . import _atomic

__all__ = ["DirectoryLock", "LOCK_NAME"]

LOCK_NAME = ".kml-run.lock"
#: How often the holder refreshes its lock's time stamp.
REFRESH_S = 30.0
#: How long a lock held from another host may go unrefreshed before its holder counts as gone.
STALE_AFTER_S = 120.0


def _describe(holder: dict[str, Any]) -> str:
    started = holder.get("started")
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)) if started else "at an unknown time"
    return f"process {holder.get('pid', '?')} on {holder.get('host', '?')}, started {when}"


def _holder_alive(holder: dict[str, Any], path: Path) -> bool:
    if holder.get("host") == _atomic.hostname():
        if holder.get("pid") == os.getpid():
            return False  # this process's own (a fit that raised): taken over
        return _atomic.process_alive(holder.get("pid"))
    try:
        return time.time() - path.stat().st_mtime < STALE_AFTER_S
    except OSError:
        return False


def _read(path: Path) -> dict[str, Any] | None:
    """The holder a lock file names (`{}` when unreadable: being written), or `None` when there is none."""
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


class DirectoryLock:
    """This run's hold on `directory` (see the module docstring); `acquire`, then `release`.

    Args:
        directory: The backup directory.
    """

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        self._mine: dict[str, Any] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Takes the lock, or raises `CheckpointError` naming the live run that holds it."""
        try:
            self._acquire()
        except OSError as err:
            raise CheckpointError(
                f"Could not lock the backup directory {self.path.parent} ({self.path}): "
                f"{_atomic.failure_reason(err)}. Nothing was loaded or written. Fix: check that the "
                "directory can be created and written, or pass another one."
            ) from err

    def _acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = {"host": _atomic.hostname(), "pid": os.getpid(), "started": time.time()}
        for _ in range(20):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                holder = _read(self.path)
                if holder == {}:  # being written by a run starting now: look again
                    time.sleep(0.05)
                    continue
                if holder is not None and _holder_alive(holder, self.path):
                    raise CheckpointError(_held_message(self.path, holder)) from None
                if holder is not None and _read(self.path) == holder:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self.path)  # its holder is gone: taken over
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(mine, f)
            self._mine = mine
            self._start_refreshing()
            return
        raise CheckpointError(
            f"Could not lock the backup directory {self.path.parent}: other runs kept taking its lock "
            f"({self.path}). Fix: give each run its own directory."
        )

    def _start_refreshing(self) -> None:
        self._stop.clear()

        def refresh() -> None:
            while not self._stop.wait(REFRESH_S):
                with contextlib.suppress(OSError):
                    os.utime(self.path)

        self._thread = threading.Thread(target=refresh, name="kml-run-lock", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Gives the lock up (if this run still holds it)."""
        self._stop.set()
        if self._mine is not None and _read(self.path) == self._mine:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._mine = None


def _held_message(path: Path, holder: dict[str, Any]) -> str:
    return (
        f"The backup directory {path.parent} is in use by another run: {_describe(holder)} (its lock: "
        f"{path}). Two runs backing up into one directory overwrite each other's backups, and a run "
        "started meanwhile would resume the other's training as its own. Nothing was loaded or "
        "written. Fix: give this run its own directory, or wait until that run ends. A run whose "
        f"process is gone resumes here (on another host, {STALE_AFTER_S:g} s after its lock was last "
        "refreshed)."
    )
