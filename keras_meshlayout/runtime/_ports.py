"""The launcher's hold on its coordinator port: one job per port on this machine, and who holds it.

JAX's coordinator accepts any process that connects to its port, so a second
job on the port of a running one would join it and abort both. Every launched
job holds a lock named after its port (`claim_port`) for as long as it runs,
and a port any other program listens on is refused before a process starts.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

#: The launcher's name, as its messages say it.
NAME = "keras_meshlayout.launch"

__all__ = ["PortClaim", "PortInUseError", "claim_port", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PortInUseError(OSError):
    """The coordinator port is taken: by another launched job, or by another program."""


class PortClaim:
    """This job's hold on its coordinator port, against every other job of this launcher on the machine.

    JAX's coordinator accepts any process that connects to its port, and its
    gRPC server shares a port with another that binds it too (SO_REUSEPORT):
    a second job on the port of a running one would join the running job's
    coordinator, which then aborts both jobs. So every launched job holds a
    lock named after its port for as long as it runs (on Linux an abstract
    Unix socket, which the kernel releases when the launcher exits however it
    exits; elsewhere an `flock` on a file in the temporary directory), and a
    port that any program listens on is refused before a process starts.
    """

    def __init__(self, port: int, holder: Any) -> None:
        self.port = port
        self._holder = holder

    def release(self) -> None:
        with contextlib.suppress(OSError):
            if isinstance(self._holder, socket.socket):
                self._holder.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept()
        with contextlib.suppress(OSError):
            self._holder.close()


def claim_port(port: int | None) -> PortClaim:
    """Claims `port`, or a free port when `None`; raises `PortInUseError` naming who holds it."""
    if port is not None:
        return _claim(port)
    for _ in range(20):
        with contextlib.suppress(PortInUseError):
            return _claim(free_port())
    raise PortInUseError("no free loopback port could be claimed after 20 tries")


def _claim(port: int) -> PortClaim:
    holder = _lock(port)
    if holder is None:
        raise PortInUseError(
            f"port {port} is in use by another {NAME} job on this machine ({_owner(port)}): its "
            "coordinator listens there, and processes of a second job would join it and abort both "
            f"jobs. Fix: pass another --port, or leave out --port to use a free one."
        )
    try:
        _check_free(port)
    except OSError as error:
        holder.close()
        raise PortInUseError(
            f"port {port} on 127.0.0.1 is in use by another program ({error.strerror or error}), so "
            "the coordinator cannot listen there. Fix: pass another --port, or leave out --port to "
            "use a free one."
        ) from None
    _write_owner(holder, port)
    return PortClaim(port, holder)


def _lock_name(port: int) -> str:
    return f"keras_meshlayout.launch-port-{port}"


def _lock(port: int) -> Any:
    """A held lock for `port`, or `None` when another job holds it."""
    if sys.platform.startswith("linux"):
        holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            holder.bind("\0" + _lock_name(port))
        except OSError:
            holder.close()
            return None
        holder.listen(8)  # so that another launcher can ask whose it is
        return holder
    import fcntl

    holder = open(Path(tempfile.gettempdir()) / f"{_lock_name(port)}.lock", "a+")
    try:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder.close()
        return None
    return holder


def _write_owner(holder: Any, port: int) -> None:
    """Lets a second launcher name this one: on Linux it answers on its lock socket."""
    if isinstance(holder, socket.socket):

        def answer() -> None:
            while True:
                try:
                    connection, _ = holder.accept()
                except OSError:
                    return  # released
                with connection:
                    with contextlib.suppress(OSError):
                        connection.sendall(f"pid {os.getpid()}".encode())

        threading.Thread(target=answer, name=f"kml-port-{port}", daemon=True).start()
    else:
        holder.seek(0)
        holder.truncate()
        holder.write(f"pid {os.getpid()}")
        holder.flush()


def _owner(port: int) -> str:
    """Who holds the lock of `port`, as its holder says ("pid 123"), or "pid unknown"."""
    with contextlib.suppress(OSError):
        if sys.platform.startswith("linux"):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as ask:
                ask.settimeout(1.0)
                ask.connect("\0" + _lock_name(port))
                return ask.recv(64).decode(errors="replace") or "pid unknown"
        return (Path(tempfile.gettempdir()) / f"{_lock_name(port)}.lock").read_text() or "pid unknown"
    return "pid unknown"


def _check_free(port: int) -> None:
    """Raises `OSError` when something listens on 127.0.0.1:`port` (TIME_WAIT leftovers are fine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("127.0.0.1", port))
