"""The local launcher's command line and `launch`: one script in N processes on this machine, as on N hosts.

`python -m keras_meshlayout.launch -n 2 --devices-per-process 4 train.py ARGS`
starts `train.py ARGS` twice, each process with its own emulated CPU devices,
the coordinator of JAX's distributed runtime on a free loopback port, and the
variables `kml.initialize()` (and Keras's `keras.distribution.initialize()`)
read. Every line a process prints comes out prefixed with its rank, `[0] ...`.
When a process fails, the launcher stops the others (SIGTERM, then SIGKILL
after a grace period), says which rank failed first and how, and exits
non-zero; a process that never reaches the others gives up after
`--init-timeout`. SIGTERM or SIGINT sent to the launcher is forwarded to every
process as SIGTERM, a preemption notice (a `kml.ResumableCheckpoint` backs up
after the step under way and exits with status 143), with `--grace` seconds
to finish before SIGKILL.

Each process runs the script under `_worker.py`, which ends a failing process
at once instead of letting it wait in JAX's exit barrier. Each job holds a
lock named after its coordinator port, so a second job on the same port is
refused before it starts, and a port another program listens on is named as
such. Gloo's "Rank N is connected to K peer ranks" lines are dropped.

The pieces: `_ports` (the port lock), `_supervise` (waiting, the first
failure, stopping), `_relay` (the prefixed output), `_failure` (what the
launcher says at the end, and its exit status).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
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
from ._failure import report
from ._ports import NAME, PortInUseError, claim_port
from ._relay import GlooLines, relay
from ._supervise import Stragglers, die_with_parent, joining, stop, watch

PROG = "python -m keras_meshlayout.launch"
DEFAULT_GRACE = 5.0
DEFAULT_NOTICE_AFTER = 60.0
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
    for option in ("init_timeout", "grace", "timeout", "notice_after"):
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
        notice_after=args.notice_after,
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
    _add_timing_options(parser)
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


def _add_timing_options(parser: argparse.ArgumentParser) -> None:
    """--init-timeout, --grace, --timeout and --notice-after: how long the launcher waits, for what."""
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
        help="seconds between SIGTERM and SIGKILL when stopping processes; SIGTERM is a preemption "
        "notice (a kml.ResumableCheckpoint backs up and exits), so leave it time to save, and keep it "
        f"below the scheduler's own grace period (default {DEFAULT_GRACE:g})",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, metavar="S", help="stop everything after S seconds"
    )
    parser.add_argument(
        "--notice-after",
        type=float,
        default=DEFAULT_NOTICE_AFTER,
        metavar="S",
        help="once a process has finished its script and others still run S seconds later, say which "
        f"(they may wait in a collective for it, forever) (default {DEFAULT_NOTICE_AFTER:g})",
    )


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
    notice_after: float = DEFAULT_NOTICE_AFTER,
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
        notice_after: Seconds after a process finished its script with others still running before
            the launcher names them (`_supervise.Stragglers`).
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
        claim = claim_port(port)
    except PortInUseError as error:
        say(f"error: {error}")
        return 2
    address = f"127.0.0.1:{claim.port}"
    status_dir = Path(tempfile.mkdtemp(prefix="kml-launch-"))
    stop_requested: list[int] = []
    previous = _catch_stop_signals(stop_requested)
    processes: list[subprocess.Popen] = []
    try:
        for rank in range(num_processes):
            env = _environment(
                rank, num_processes, address, devices_per_process, init_timeout, status_dir, cpu_only
            )
            processes.append(_start(command, env))
        devices = f" × {devices_per_process} CPU devices" if devices_per_process else ""
        say(
            f"{num_processes} process{'es' if num_processes != 1 else ''}{devices}, coordinator {address}; "
            + ", ".join(f"rank {rank}: pid {p.pid}" for rank, p in enumerate(processes))
        )
        with joining(status_dir, num_processes) as progress:
            readers = _relays(processes, out, err, lock, before=progress.stop)
            stragglers = Stragglers(status_dir, notice_after, lambda message: (progress.stop(), say(message)))

            def tick() -> None:
                progress.tick()
                stragglers.tick(processes)

            outcome = watch(processes, timeout, stop_requested, status_dir, tick)
        survivors = [rank for rank, p in enumerate(processes) if p.poll() is None]
        killed = stop(processes, grace) if outcome.kind != "done" else []
        for reader in readers:
            reader.join(timeout=5)
        return report(outcome, processes, survivors, killed, status_dir, init_timeout, grace, timeout, say)
    finally:
        stop(processes, grace)
        claim.release()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        shutil.rmtree(status_dir, ignore_errors=True)


def _catch_stop_signals(requested: list[int]) -> dict[int, Any]:
    """Records SIGINT and SIGTERM in `requested` (in the main thread only); returns the previous handlers."""
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, lambda signum, _frame: requested.append(signum))
    return previous


def _start(command: Sequence[str], env: dict[str, str]) -> subprocess.Popen:
    """Starts one process of the job, under the worker bootstrap."""
    return subprocess.Popen(
        [sys.executable, str(WORKER), *command],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: stopped with everything it starts
        preexec_fn=die_with_parent if sys.platform.startswith("linux") else None,
    )


def _relays(
    processes: Sequence[subprocess.Popen],
    out: IO[bytes],
    err: IO[bytes],
    lock: threading.Lock,
    before: Any = None,
) -> list[threading.Thread]:
    """Starts a thread per output stream of every process, copying its lines prefixed with its rank."""
    quiet = GlooLines()
    readers = [
        threading.Thread(
            target=relay, args=(stream, sink, f"[{rank}] ".encode(), lock, quiet, before), daemon=True
        )
        for rank, p in enumerate(processes)
        for stream, sink in ((p.stdout, out), (p.stderr, err))
    ]
    for reader in readers:
        reader.start()
    return readers


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
