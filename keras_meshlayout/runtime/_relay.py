"""The launcher's output relay: each line a process prints, prefixed with its rank; gloo's chatter dropped."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import IO

__all__ = ["GlooLines", "relay"]


#: What gloo prints, once per communicator and device, when a group of devices connects.
_GLOO_CONNECTED = re.compile(
    rb"\[Gloo\] Rank (\d+) is connected to (\d+) peer ranks\. "
    rb"Expected number of connected peer ranks is : (\d+)\s*"
)
#: The pieces gloo writes that line in (`std::cout << ...`, piece by piece).
_GLOO_WORDS = (
    b"[Gloo] Rank ",
    b" is connected to ",
    b" peer ranks. ",
    b"Expected number of connected peer ranks is : ",
)
_GLOO_PIECES = re.compile(b"(?:" + b"|".join(re.escape(word) for word in _GLOO_WORDS) + rb"|\d+|\s)+")


class GlooLines:
    """Drops gloo's "Rank N is connected to K peer ranks" lines, dozens per run, that bury the output.

    The devices of a process connect at the same time and gloo writes each
    line in pieces, so the lines arrive interleaved ("[Gloo] Rank 2 is
    connected to [Gloo] Rank 73 peer ranks. ..."): a line made only of such
    pieces is dropped. A whole line whose count of connected peers differs
    from the expected one is kept: it tells of a connection problem.
    """

    def __init__(self) -> None:
        self.dropped = 0

    def keep(self, line: bytes) -> bool:
        whole = _GLOO_CONNECTED.fullmatch(line)
        if whole is not None:
            keep = whole[2] != whole[3]
        else:
            keep = not any(word in line for word in _GLOO_WORDS) or _GLOO_PIECES.fullmatch(line) is None
        self.dropped += not keep
        return keep


def relay(
    stream: IO[bytes],
    sink: IO[bytes],
    prefix: bytes,
    lock: threading.Lock,
    quiet: GlooLines | None = None,
    before: Callable[[], None] | None = None,
) -> None:
    """Copies lines from a process to `sink`, each prefixed with its rank.

    `before()`, when given, is called under `lock` before each line is written (the launcher
    erases its progress spinner there).
    """
    with stream:
        for line in iter(stream.readline, b""):
            if quiet is not None and not quiet.keep(line):
                continue
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                if before is not None:
                    before()
                sink.write(prefix + line)
                sink.flush()
