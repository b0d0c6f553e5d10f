"""Progress on a terminal: a spinner naming the step at hand, and a bar counting bytes.

Long operations (dry plans of big models, checkpoint saves and loads, the launcher's wait for
its processes to join) draw their progress on stderr with `rich`, and only where a person
watches: nothing is drawn when stderr is no terminal (a pipe, a file, a CI log), when the `CI`
environment variable is set, or when the caller does not want it (`--json`). Progress is
transient: it is erased once the operation ends, so what remains is the operation's output.

`KML_PROGRESS` overrides the choice: `1` draws progress even off a terminal (as a terminal
would show it), `0` never draws it.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["ENV", "bytes_bar", "shown", "spinner", "watch_bytes"]

#: The environment variable that forces progress on (`1`) or off (`0`).
ENV = "KML_PROGRESS"

#: Seconds between two looks at the bytes a background writer has put on disk.
_POLL = 0.1


def _console(console: Any = None) -> Any:
    from rich.console import Console

    if console is not None:
        return console
    return Console(stderr=True, force_terminal=True if os.environ.get(ENV) == "1" else None)


def shown(console: Any = None) -> bool:
    """Whether progress is drawn on `console` (default: stderr): a terminal, `CI` unset, or forced."""
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return bool(_console(console).is_terminal) and not os.environ.get("CI")


@contextlib.contextmanager
def spinner(label: str, *, wanted: bool = True, console: Any = None) -> Iterator[Callable[[str], None]]:
    """A spinner labelled `label`; `step(text)` names the step at hand.

    Silent (every `step` a no-op) when not `wanted` or when progress is not `shown`.

    Example:
        >>> with spinner("plan") as step:
        ...     step("resolving every variable")
    """
    console = _console(console)
    if not wanted or not shown(console):
        yield lambda text: None
        return
    from rich.live import Live
    from rich.spinner import Spinner

    spin = Spinner("dots", f"[bold]{label}[/bold] ...", style="green")
    with Live(spin, console=console, transient=True, refresh_per_second=12.5) as live:

        def step(text: str) -> None:
            spin.update(text=f"[bold]{label}[/bold]: {text} ...")
            live.refresh()  # each step drawn at once, however short

        yield step


@contextlib.contextmanager
def bytes_bar(
    label: str, total: int, *, wanted: bool = True, console: Any = None
) -> Iterator[Callable[[int], None]]:
    """A bar of `total` bytes labelled `label`; `advance(n)` counts `n` more bytes done.

    Silent when not `wanted` or when progress is not `shown`. The bar shows the bytes done, the
    total, the rate and the time left, and is erased at the end.

    Example:
        >>> with bytes_bar("reading model.orbax", 1 << 20) as advance:
        ...     advance(1 << 20)
    """
    with _bar(label, total, wanted, console) as bar:
        yield (lambda n: None) if bar is None else (lambda n: bar[0].advance(bar[1], n))


@contextlib.contextmanager
def watch_bytes(
    label: str, total: int, measure: Callable[[], int], *, wanted: bool = True, console: Any = None
) -> Iterator[None]:
    """A bar of `total` bytes filled from `measure()` (the bytes done so far), looked at every 0.1 s.

    For work done out of sight (a background writer): `measure` is called from a thread while
    the block runs, and once more at the end. Silent, and `measure` never called, when progress
    is not `shown`.
    """
    with _bar(label, total, wanted, console) as bar:
        if bar is None:
            yield
            return
        progress, task = bar
        stop = threading.Event()

        def look() -> None:
            while not stop.wait(_POLL):
                with contextlib.suppress(OSError):
                    progress.update(task, completed=min(measure(), total))

        watcher = threading.Thread(target=look, name="kml-progress", daemon=True)
        watcher.start()
        try:
            yield
        finally:
            stop.set()
            watcher.join()
        progress.update(task, completed=total)


@contextlib.contextmanager
def _bar(label: str, total: int, wanted: bool, console: Any) -> Iterator[tuple[Any, Any] | None]:
    console = _console(console)
    if not wanted or not shown(console):
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True) as progress:
        yield progress, progress.add_task(label, total=max(total, 1))
