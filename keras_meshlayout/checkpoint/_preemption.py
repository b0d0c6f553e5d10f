"""Preemption notices: SIGTERM and SIGINT caught while training, and the step every process stops at.

Spot VMs, Kubernetes and SLURM stop a job with SIGTERM and a grace period.
While `fit` runs, `Notice` catches SIGTERM and SIGINT (in the main thread) and
only records them; the callback asks `requested()` after every step, which in a
multi-process run is one small collective, so that every process sees the
notice after the same step, even when the signal reached them at different
steps (or only some of them), and all save that step and stop. A second signal
of the same kind while the first is being handled goes to the handler that was
there before (for SIGINT, Python's `KeyboardInterrupt`): stop at once. So does a
signal that comes when the model's `fit` is no longer running (a `fit` that
raised never tells its callbacks it ended).
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import numpy as np

__all__ = ["PREEMPTED_EXIT_BASE", "Notice", "signal_name"]

#: A run stopped by signal N exits with status 128 + N (143 for SIGTERM, 130 for SIGINT), as the
#: shell reports a process ended by that signal, once its backup is saved.
PREEMPTED_EXIT_BASE = 128
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Notice:
    """The preemption signals received while training (see the module docstring)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._owner: Any = None
        self._previous: dict[int, Any] = {}

    def install(self, owner: Any) -> None:
        """Catches SIGTERM and SIGINT until `uninstall` (nothing outside the main thread).

        Args:
            owner: The object whose `fit` catches the signals (the model): a signal that
                comes while no `fit` of it is running goes to the previous handler.
        """
        self.received = None
        self._owner = owner
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)

    def uninstall(self) -> None:
        """Puts the previous handlers back."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received != signum and _fitting(frame, self._owner):
            self.received = signum
            return
        handler = self._previous.get(signum, signal.SIG_DFL)  # the second one: stop at once
        self.uninstall()
        if callable(handler):
            handler(signum, frame)
        else:
            signal.raise_signal(signum)

    def requested(self) -> int | None:
        """The signal any process received (its number), or `None`; every process calls it after each step.

        In a multi-process run this is a collective, so all processes answer alike after the
        same step.
        """
        import jax

        if jax.process_count() == 1:
            return self.received
        from jax.experimental import multihost_utils

        flags = multihost_utils.process_allgather(np.int32(self.received or 0))
        received = [int(flag) for flag in np.asarray(flags).reshape(-1) if flag]
        return received[0] if received else None


def _fitting(frame: Any, owner: Any) -> bool:
    """Whether `owner.fit` is on the stack that `frame` belongs to."""
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is owner:
            return True
        frame = frame.f_back
    return False


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
