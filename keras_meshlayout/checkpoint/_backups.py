"""The backups a `ResumableCheckpoint` keeps: the newest at `latest`, the ones before it by step.

`DIRECTORY/latest` is always the newest complete backup. When a save replaces it,
the backup it replaces is kept as `DIRECTORY/step-NNNNNNNNN` (its training step)
rather than deleted, and only the newest `max_to_keep` backups, `latest`
included, are kept. A run resumes from the newest one that is complete and whose
files match their checksums, so a damaged `latest` falls back to the backup
before it.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

from ..core._errors import MeshLayoutWarning
from . import _manifest

__all__ = ["Backups"]

LATEST = "latest"
_STEP = re.compile(r"step-(\d+)")


class Backups:
    """The backups in `directory`, the newest `max_to_keep` of them kept.

    Args:
        directory: The backup directory.
        max_to_keep: How many complete backups to keep, `latest` included (at least 1).
    """

    def __init__(self, directory: Path, max_to_keep: int) -> None:
        self.directory = directory
        self.latest = directory / LATEST
        self.max_to_keep = max_to_keep

    def kept(self) -> list[Path]:
        """The older backups kept (`step-*`), newest first."""
        try:
            entries = list(self.directory.iterdir())
        except OSError:
            return []
        found = [(int(m[1]), e) for e in entries if (m := _STEP.fullmatch(e.name)) and e.is_dir()]
        return [path for _, path in sorted(found, reverse=True)]

    def keep(self, previous: Path) -> Path | None:
        """Where the backup a save replaces goes (`previous`: where it was moved aside), or `None`.

        Called once the new backup is in place (`_atomic.replace_directory`); older backups
        beyond `max_to_keep` are deleted here.
        """
        if self.max_to_keep < 2:
            return None
        step = _step_of(previous)
        if step is None:
            return None
        for extra in self.kept()[self.max_to_keep - 2 :]:
            shutil.rmtree(extra, ignore_errors=True)
        return self.directory / f"step-{step:09d}"

    def newest(self) -> Path | None:
        """The backup to resume from, or `None` when there is none.

        The newest complete one whose files match their checksums (`latest` first); when
        none does, `latest` (or the newest kept), for the load to say what is wrong with it.
        """
        candidates = [path for path in [self.latest, *self.kept()] if path.is_dir()]
        for candidate in candidates:
            if _manifest.verified(candidate):
                if candidate != candidates[0]:
                    warnings.warn(
                        f"The backup {candidates[0]} is incomplete or damaged (its files do not match "
                        f"its manifest): resuming from the one before it, {candidate}.",
                        MeshLayoutWarning,
                        stacklevel=3,
                    )
                return candidate
        return candidates[0] if candidates else None

    def delete(self) -> None:
        """Deletes every backup (`latest` and the older ones kept)."""
        for path in [self.latest, *self.kept()]:
            shutil.rmtree(path, ignore_errors=True)


def _step_of(path: Path) -> int | None:
    """The training step a backup was saved at, from its manifest (`None`: unknown)."""
    try:
        training = json.loads((path / _manifest.MANIFEST).read_text()).get("training") or {}
        step = training.get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and step >= 0 else None
