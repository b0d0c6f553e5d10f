"""The local launcher: one script in N processes on this machine, as on N hosts.

`python -m keras_meshlayout.launch -n 2 --devices-per-process 4 train.py ARGS`
starts `train.py ARGS` twice, each process with its own emulated CPU devices,
the coordinator of JAX's distributed runtime on a free loopback port, and the
variables `kml.initialize()` (and Keras's `keras.distribution.initialize()`)
read. Every line a process prints comes out prefixed with its rank, `[0] ...`.
When a process fails, the launcher stops the others (SIGTERM, then SIGKILL
after a grace period), says which rank failed first and how, and exits
non-zero; a process that never reaches the others gives up after
`--init-timeout`.

Each process runs the script under `_worker.py`, which ends a failing process
at once instead of letting it wait in JAX's exit barrier. Each job holds a
lock named after its coordinator port, so a second job on the same port is
refused before it starts, and a port another program listens on is named as
such. Gloo's "Rank N is connected to K peer ranks" lines are dropped.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

from ._cluster import (
    COORDINATOR_ENV,
    DEFAULT_INIT_TIMEOUT,
    DEVICES_PER_PROCESS_ENV,
    INIT_TIMEOUT_ENV,
    INIT_TIMEOUT_EXIT_STATUS,
    KERAS_ADDRESSES_ENV,
    KERAS_NUM_PROCESSES_ENV,
    KERAS_PROCESS_ID_ENV,
    LAUNCH_DIR_ENV,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
)

PROG = "python -m keras_meshlayout.launch"
NAME = "keras_meshlayout.launch"
DEFAULT_GRACE = 5.0
_POLL = 0.05
_SETTLE = 0.5  # seconds a failure waits for an earlier one to be reported
_XLA_DEVICE_COUNT_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S*")
#: The bootstrap each process runs the script under (see its docstring).
WORKER = Path(__file__).resolve().with_name("_worker.py")


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Runs the launcher command line; returns its exit status.

    Args:
        argv: The arguments; defaults to `sys.argv[1:]`.
        prog: The command's name in help and usage messages.
    """
    args = _parser(prog).parse_args(argv)
    if args.num_processes < 1:
        return _usage_error(f"-n must be at least 1. Received: {args.num_processes}.")
    if args.devices_per_process is not None and args.devices_per_process < 1:
        return _usage_error(
            f"--devices-per-process must be at least 1. Received: {args.devices_per_process}."
        )
    if args.port is not None and not 0 <= args.port < 65536:
        return _usage_error(f"--port must be in 0..65535 (0: a free one). Received: {args.port}.")
    for option in ("init_timeout", "grace", "timeout"):
        value = getattr(args, option)
        if value is not None and value <= 0:
            return _usage_error(f"--{option.replace('_', '-')} must be positive. Received: {value}.")
    target = ["-m", args.script] if args.module else [args.script]
    if not args.module and not Path(args.script).is_file():
        return _usage_error(f"{args.script}: no such file.")
    return launch(
        [*target, *args.args],
        num_processes=args.num_processes,
        devices_per_process=args.devices_per_process,
        port=args.port or None,
        init_timeout=args.init_timeout,
        grace=args.grace,
        timeout=args.timeout,
        cpu_only=args.platform == "cpu",
    )


def _parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run a script in several processes on this machine, as on several hosts: each "
        "with its emulated CPU devices, joined through JAX's distributed runtime on a loopback port. "
        "The script calls kml.initialize() first.",
        epilog=f"exit status: 0 when every process succeeds; otherwise the failing process's status "
        f"(128+N when killed by signal N; {INIT_TIMEOUT_EXIT_STATUS} when it gave up waiting for the "
        "others), 124 when --timeout passes, 2 for a usage error or a --port in use.",
    )
    parser.add_argument(
        "-n", "--num-processes", type=int, default=2, metavar="N", help="processes (default 2)"
    )
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        metavar="D",
        help="CPU devices to emulate in each process (default: what the script asks of kml.initialize)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=None,
        help="coordinator port on 127.0.0.1 (default: a free one); refused when another job or "
        "program uses it",
    )
    parser.add_argument(
        "--init-timeout",
        type=float,
        default=DEFAULT_INIT_TIMEOUT,
        metavar="S",
        help=f"seconds every process waits for all to join (default {DEFAULT_INIT_TIMEOUT:g})",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE,
        metavar="S",
        help=f"seconds between SIGTERM and SIGKILL when stopping processes (default {DEFAULT_GRACE:g})",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop everything after S seconds"
    )
    parser.add_argument(
        "--platform",
        choices=("cpu", "auto"),
        default="cpu",
        help="cpu (default): JAX sees only CPUs, so processes do not compete for accelerators; "
        "auto: JAX's default platform",
    )
    parser.add_argument("-m", "--module", action="store_true", help="SCRIPT is a module name, as python -m")
    parser.add_argument("script", metavar="SCRIPT", help="the Python script (or, with -m, module) to run")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    return parser


def _usage_error(message: str) -> int:
    print(f"{NAME}: error: {message}", file=sys.stderr)
    return 2


def launch(
    command: Sequence[str],
    *,
    num_processes: int = 2,
    devices_per_process: int | None = None,
    port: int | None = None,
    init_timeout: float = DEFAULT_INIT_TIMEOUT,
    grace: float = DEFAULT_GRACE,
    timeout: float | None = None,
    cpu_only: bool = True,
    stdout: IO[bytes] | None = None,
    stderr: IO[bytes] | None = None,
) -> int:
    """Runs `python COMMAND` in `num_processes` local processes; returns the exit status.

    Args:
        command: Arguments after `python`: a script and its arguments, or
            `-m`, a module and its arguments.
        num_processes: Number of processes.
        devices_per_process: CPU devices to emulate in each; `None` leaves
            it to the script (`kml.initialize(emulate_devices=...)`).
        port: Coordinator port on 127.0.0.1; `None` picks a free one.
        init_timeout: Seconds each process waits for all to join.
        grace: Seconds between SIGTERM and SIGKILL when stopping processes.
        timeout: Stop everything after this many seconds (status 124).
        cpu_only: Make JAX use only CPUs (`JAX_PLATFORMS=cpu`).
        stdout: Where prefixed output goes; defaults to this process's.
        stderr: Where prefixed error output and the launcher's messages go.

    Returns:
        0 when every process succeeded, else as the command line documents.
    """
    out = stdout if stdout is not None else sys.stdout.buffer
    err = stderr if stderr is not None else sys.stderr.buffer
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock:
            err.write(f"{NAME}: {message}\n".encode())
            err.flush()

    try:
        claim = _claim_port(port)
    except PortInUseError as error:
        say(f"error: {error}")
        return 2
    address = f"127.0.0.1:{claim.port}"
    status_dir = Path(tempfile.mkdtemp(prefix="kml-launch-"))
    stop_requested: list[int] = []
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda signum, _frame: stop_requested.append(signum))
    processes: list[subprocess.Popen] = []
    try:
        for rank in range(num_processes):
            env = _environment(
                rank, num_processes, address, devices_per_process, init_timeout, status_dir, cpu_only
            )
            processes.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), *command],
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # its own process group: stopped with everything it starts
                    preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
                )
            )
        devices = f" × {devices_per_process} CPU devices" if devices_per_process else ""
        say(
            f"{num_processes} processes{devices}, coordinator {address}; "
            + ", ".join(f"rank {rank}: pid {p.pid}" for rank, p in enumerate(processes))
        )
        quiet = _GlooLines()
        readers = [
            threading.Thread(
                target=_relay, args=(stream, sink, f"[{rank}] ".encode(), lock, quiet), daemon=True
            )
            for rank, p in enumerate(processes)
            for stream, sink in ((p.stdout, out), (p.stderr, err))
        ]
        for reader in readers:
            reader.start()
        outcome = _watch(processes, timeout, stop_requested, status_dir)
        survivors = [rank for rank, p in enumerate(processes) if p.poll() is None]
        killed = _stop(processes, grace) if outcome.kind != "done" else []
        for reader in readers:
            reader.join(timeout=5)
        return _report(outcome, processes, survivors, killed, status_dir, init_timeout, grace, timeout, say)
    finally:
        _stop(processes, grace)
        claim.release()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(status_dir, ignore_errors=True)


def _environment(
    rank: int,
    count: int,
    address: str,
    devices: int | None,
    init_timeout: float,
    status_dir: Path,
    cpu_only: bool,
) -> dict[str, str]:
    """The environment of one process: ours, Keras's and JAX's variables."""
    env = dict(os.environ)
    env.update(
        {
            COORDINATOR_ENV: address,
            NUM_PROCESSES_ENV: str(count),
            PROCESS_ID_ENV: str(rank),
            INIT_TIMEOUT_ENV: f"{init_timeout:g}",
            LAUNCH_DIR_ENV: str(status_dir),
            KERAS_ADDRESSES_ENV: address,
            KERAS_NUM_PROCESSES_ENV: str(count),
            KERAS_PROCESS_ID_ENV: str(rank),
            "JAX_COORDINATOR_BIND_ADDRESS": address,  # loopback only, not every interface
            "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
            # JAX's preemption service would catch SIGTERM and carry on; here SIGTERM means stop.
            "JAX_ENABLE_PREEMPTION_SERVICE": "false",
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.setdefault("KERAS_BACKEND", "jax")
    if cpu_only:
        env["JAX_PLATFORMS"] = "cpu"
    if devices is not None:
        env[DEVICES_PER_PROCESS_ENV] = str(devices)
        env["JAX_NUM_CPU_DEVICES"] = str(devices)
        flags = _XLA_DEVICE_COUNT_FLAG.sub("", env.get("XLA_FLAGS", "")).split()
        env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    return env


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class PortInUseError(OSError):
    """The coordinator port is taken: by another launched job, or by another program."""


class _PortClaim:
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


def _claim_port(port: int | None) -> _PortClaim:
    """Claims `port`, or a free port when `None`; raises `PortInUseError` naming who holds it."""
    if port is not None:
        return _claim(port)
    for _ in range(20):
        with contextlib.suppress(PortInUseError):
            return _claim(_free_port())
    raise PortInUseError("no free loopback port could be claimed after 20 tries")


def _claim(port: int) -> _PortClaim:
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
    return _PortClaim(port, holder)


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


def _die_with_parent() -> None:
    """Linux: the process gets SIGKILL if the launcher itself dies."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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


class _GlooLines:
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


def _relay(
    stream: IO[bytes],
    sink: IO[bytes],
    prefix: bytes,
    lock: threading.Lock,
    quiet: _GlooLines | None = None,
) -> None:
    """Copies lines from a process to `sink`, each prefixed with its rank."""
    with stream:
        for line in iter(stream.readline, b""):
            if quiet is not None and not quiet.keep(line):
                continue
            if not line.endswith(b"\n"):
                line += b"\n"
            with lock:
                sink.write(prefix + line)
                sink.flush()


class _Outcome:
    def __init__(self, kind: str, rank: int | None = None, signum: int | None = None) -> None:
        self.kind = kind  # done, failed, timeout, interrupted
        self.rank = rank
        self.signum = signum


def _watch(
    processes: list[subprocess.Popen],
    timeout: float | None,
    stop_requested: list[int],
    status_dir: Path | None = None,
) -> _Outcome:
    """Waits until all succeed, one fails, time runs out, or the launcher is told to stop."""
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
            reported = _reports(range(len(processes)), status_dir)
            for rank in reported:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    processes[rank].wait(timeout=5)  # it reported, so it is in os._exit
            failed = {rank: at for rank, at in list(ended.items()) if processes[rank].returncode != 0}
            return _Outcome("failed", _first_failure(failed, reported))
        if len(ended) == len(processes):
            return _Outcome("done")
        if stop_requested:
            return _Outcome("interrupted", signum=stop_requested[0])
        if deadline is not None and time.monotonic() > deadline:
            return _Outcome("timeout")
        time.sleep(_POLL)


def _first_failure(failed: dict[int, float], reported: dict[int, tuple[float, bool]]) -> int:
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


def _reports(ranks: Iterable[int], status_dir: Path | None) -> dict[int, tuple[float, bool]]:
    """For each of `ranks` that reported a failure (`_worker.fail`): when, and whether it lost a peer."""
    reported: dict[int, tuple[float, bool]] = {}
    for rank in ranks:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (status_dir / f"exit.{rank}").read_text().split() if status_dir else []
            reported[rank] = (float(fields[1]), fields[2:3] == ["peer"])
    return reported


def _stop(processes: list[subprocess.Popen], grace: float) -> list[int]:
    """SIGTERM to every process group, SIGKILL to what is left after `grace` seconds.

    Returns the ranks that were still running when SIGKILL came.
    """
    for process in processes:
        _signal_group(process, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for p in processes):
        time.sleep(_POLL)
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


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"was killed by signal {-code} ({_signal_name(-code)})"
    return f"exited with status {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def _report(
    outcome: _Outcome,
    processes: list[subprocess.Popen],
    survivors: list[int],
    killed: list[int],
    status_dir: Path,
    init_timeout: float,
    grace: float,
    timeout: float | None,
    say: Any,
) -> int:
    """Says what happened and returns the launcher's exit status."""
    if outcome.kind == "done":
        return 0
    stopped = ""
    if survivors:
        termed = [r for r in survivors if r not in killed]
        parts = [f"{_ranks(termed)} by SIGTERM"] if termed else []
        if killed:
            parts.append(f"{_ranks(killed)} by SIGKILL after {grace:g} s")
        stopped = f"; stopped {' and '.join(parts)}"
    if outcome.kind == "failed":
        rank = outcome.rank
        code = processes[rank].returncode
        message = f"rank {rank} (pid {processes[rank].pid}) {_describe_exit(code)}{stopped}."
        after = [
            r
            for r, process in enumerate(processes)
            if r != rank and r not in survivors and process.returncode not in (None, 0)
        ]
        if after and code != INIT_TIMEOUT_EXIT_STATUS:
            message += (
                " Then "
                + "; ".join(f"rank {r} {_describe_exit(processes[r].returncode)}" for r in after)
                + " (a process fails once a collective loses its peer)."
            )
        if code == INIT_TIMEOUT_EXIT_STATUS:
            message += (
                f" It gave up waiting for the other processes to join (--init-timeout {init_timeout:g} s)."
            )
            joined = {int(p.suffix[1:]) for p in status_dir.glob("joined.*") if p.suffix[1:].isdigit()}
            early = [
                r
                for r, process in enumerate(processes)
                if r != rank and r not in joined and r not in survivors and process.returncode is not None
            ]
            if early:
                message += " " + "; ".join(
                    f"Rank {r} {_describe_exit(processes[r].returncode)} without joining "
                    "(before or in kml.initialize())"
                    for r in early
                )
                message += "."
            hung = [r for r in survivors if r != rank and r not in joined]
            if hung:
                message += (
                    f" {_ranks(hung).capitalize()} had not joined and was still running: it hung before "
                    "or in kml.initialize()."
                )
        say(message)
        return code if code > 0 else 128 - code
    if outcome.kind == "timeout":
        say(f"--timeout {timeout:g} s passed with {_ranks(survivors)} still running{stopped}.")
        return 124
    say(f"received {_signal_name(outcome.signum)}{stopped}.")
    return 128 + outcome.signum


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
