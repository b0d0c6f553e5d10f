"""The launcher's supervision of its processes: wait for them, find who failed first, stop the rest.

`watch` waits until every process succeeds, one fails, time runs out or the
launcher is told to stop (`joining`: a spinner until all joined); `first_failure`
names the process whose failure made the others fail; `stop` ends them (SIGTERM
to each process group, SIGKILL after a grace period).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from ..core._progress import shown, spinner

__all__ = [
    "Joining",
    "Outcome",
    "Stragglers",
    "die_with_parent",
    "first_failure",
    "joining",
    "reports",
    "stop",
    "watch",
]

POLL = 0.05
_SETTLE = 0.5  # seconds a failure waits for an earlier one to be reported


class Outcome:
    def __init__(self, kind: str, rank: int | None = None, signum: int | None = None) -> None:
        self.kind = kind  # done, failed, timeout, interrupted
        self.rank = rank
        self.signum = signum


def watch(
    processes: list[subprocess.Popen],
    timeout: float | None,
    stop_requested: list[int],
    status_dir: Path | None = None,
    tick: Callable[[], None] | None = None,
) -> Outcome:
    """Waits until all succeed, one fails, time runs out, or the launcher is told to stop.

    `tick()`, when given, is called at every look (every `POLL` seconds), e.g. to draw progress.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    ended: dict[int, float] = {}  # rank: when it ended (time.time()), as its waiter saw it

    def wait(rank: int, process: subprocess.Popen) -> None:
        process.wait()
        ended[rank] = time.time()

    for rank, process in enumerate(processes):
        threading.Thread(target=wait, args=(rank, process), name=f"kml-wait-{rank}", daemon=True).start()
    while True:
        if any(processes[rank].returncode != 0 for rank in list(ended)):
            # The failure that caused this one may be another's, still reporting and ending.
            time.sleep(_SETTLE)
            reported = reports(range(len(processes)), status_dir)
            for rank in reported:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    processes[rank].wait(timeout=5)  # it reported, so it is in os._exit
            failed = {rank: at for rank, at in list(ended.items()) if processes[rank].returncode != 0}
            return Outcome("failed", first_failure(failed, reported))
        if len(ended) == len(processes):
            return Outcome("done")
        if stop_requested:
            return Outcome("interrupted", signum=stop_requested[0])
        if deadline is not None and time.monotonic() > deadline:
            return Outcome("timeout")
        if tick is not None:
            tick()
        time.sleep(POLL)


class Stragglers:
    """Says once which processes still run `after` seconds after another finished its script.

    A process whose script ended well (`done.RANK` in the status directory, `_worker._report_done`)
    waits in JAX's exit barrier for the others. If one of them waits for it in a collective (one rank
    left its training loop early, e.g. with `sys.exit(0)` outside `fit`), neither ever ends, and
    nothing fails: without `--timeout` the job would hang, silent. The notice names both sides.
    """

    def __init__(self, status_dir: Path, after: float, say: Callable[[str], None]) -> None:
        self._status_dir, self._after, self._say = status_dir, after, say
        self._since: float | None = None
        self._said = False

    def tick(self, processes: list[subprocess.Popen]) -> None:
        if self._said:
            return
        done = sorted(
            int(path.suffix[1:]) for path in self._status_dir.glob("done.*") if path.suffix[1:].isdigit()
        )
        running = [rank for rank, p in enumerate(processes) if rank not in done and p.poll() is None]
        if not done or not running:
            return
        if self._since is None:
            self._since = time.monotonic()
        if time.monotonic() - self._since >= self._after:
            self._said = True
            self._say(
                f"{_listed(done)} finished {'its script' if len(done) == 1 else 'their scripts'} "
                f"{self._after:g} s ago and {'waits' if len(done) == 1 else 'wait'} for the others to end; "
                f"{_listed(running)} still running. If {'it waits' if len(running) == 1 else 'they wait'} "
                "in a collective for a process that left its training loop early (sys.exit(0) on one "
                "rank), the job never ends: stop it with Ctrl-C, or pass --timeout. Every process must "
                "run the same steps; stop training on all of them with model.stop_training = True."
            )


def _listed(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


class Joining:
    """The launcher's spinner counting the processes that joined; `tick` and `stop` are thread-safe.

    `tick()` counts the `joined.N` files the processes leave in the status directory
    (`runtime._initialize`) and erases the spinner once all joined; `stop()` erases it at once,
    and is called before any process's line is relayed, so no line lands on the spinner's.
    Both do nothing once it is gone, or when progress is not shown (`step` is `None`).
    """

    def __init__(self, status_dir: Path, count: int, step: Callable[[str], None] | None, close: Any) -> None:
        self._status_dir, self._count, self._step, self._close = status_dir, count, step, close
        self._guard = threading.Lock()
        self._seen = -1

    def tick(self) -> None:
        with self._guard:
            if self._step is None:
                return
            joined = len(list(self._status_dir.glob("joined.*")))
            if joined != self._seen:
                self._seen = joined
                self._step(f"waiting for the processes to join the run: {joined} of {self._count}")
            if joined == self._count:
                self._end()

    def stop(self) -> None:
        with self._guard:
            if self._step is not None:
                self._end()

    def _end(self) -> None:
        self._step = None
        self._close()


@contextlib.contextmanager
def joining(status_dir: Path, count: int) -> Iterator[Joining]:
    """A `Joining` spinner on stderr (terminal only), erased at the latest when the block ends."""
    if not shown():
        yield Joining(status_dir, count, None, lambda: None)
        return
    with contextlib.ExitStack() as stack:
        step = stack.enter_context(spinner("launch"))
        progress = Joining(status_dir, count, step, stack.close)
        progress.tick()
        yield progress
        progress.stop()


def first_failure(failed: dict[int, float], reported: dict[int, tuple[float, bool]]) -> int:
    """The rank that failed first.

    Args:
        failed: When each process that ended with a non-zero status ended.
        reported: For each worker that failed by its own hand (an exception,
            `sys.exit(n)`), when it said so (`_worker.fail`, just before
            ending) and whether its error came from losing another process.

    A failure in one process makes the others fail within milliseconds (a
    collective loses its peer), so the order of the moments alone can mislead
    on a busy machine: a failure that says it lost a peer comes after every
    other; then the earliest moment (the report's, or for a process killed by
    a signal, which cannot report, its end), then the lowest rank.
    """
    moments = {rank: (*reported.get(rank, (at, False))[::-1], rank) for rank, at in failed.items()}
    return min(moments, key=moments.__getitem__)


def reports(ranks: Iterable[int], status_dir: Path | None) -> dict[int, tuple[float, bool]]:
    """For each of `ranks` that reported a failure (`_worker.fail`): when, and whether it lost a peer."""
    reported: dict[int, tuple[float, bool]] = {}
    for rank in ranks:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (status_dir / f"exit.{rank}").read_text().split() if status_dir else []
            reported[rank] = (float(fields[1]), fields[2:3] == ["peer"])
    return reported


def stop(processes: list[subprocess.Popen], grace: float) -> list[int]:
    """SIGTERM to every process group, SIGKILL to what is left after `grace` seconds.

    Returns the ranks that were still running when SIGKILL came.
    """
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        time.sleep(POLL)
    killed = [rank for rank, process in enumerate(processes) if process.poll() is None]
    for process in processes:
        _signal_group(process, signal.SIGKILL)
    for process in processes:
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)
    return killed


def _signal_group(process: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)  # the group outlives its leader while its children run


def die_with_parent() -> None:
    """Linux: the process gets SIGKILL if the launcher itself dies."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
