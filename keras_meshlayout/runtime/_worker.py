"""The launcher's worker bootstrap: runs the user's script, and makes a failure end the process at once.

`python -m keras_meshlayout.launch` starts each process as
`python .../keras_meshlayout/runtime/_worker.py SCRIPT ARGS` (or `... -m MODULE ARGS`).
This file imports only the standard library, so the script starts exactly as
under `python SCRIPT ARGS`: same `sys.argv`, `sys.path[0]` and `__main__`.

Why it exists: after `kml.initialize()`, JAX registers an exit handler that
waits in a barrier until every process of the job exits. A process that
raises or calls `sys.exit(3)` would sit there for minutes while the others
wait for it inside a collective, and the launcher would see nobody fail. Here
a script that ends with a non-zero status (an exception, `sys.exit(n)`,
`KeyboardInterrupt`) reports its status to the launcher and leaves at once
with `os._exit`, skipping that barrier; a script that succeeds exits normally
and waits for the others, as it must. The report (`exit.RANK` in the launch
directory: the status and the time) lets the launcher name the process that
failed first even when several end within the same instant.
"""

import os
import runpy
import sys
import time
import traceback

LAUNCH_DIR_ENV = "KML_LAUNCH_DIR"  # as in _cluster.py; this file imports nothing of ours
PROCESS_ID_ENV = "KML_PROCESS_ID"
NUM_PROCESSES_ENV = "KML_NUM_PROCESSES"
#: The statuses of a run stopped by a signal it was told to stop on (SIGINT, SIGTERM: 128 + N), as
#: `checkpoint._preemption.PREEMPTED_EXIT_BASE` gives them: every process of the job stops alike.
STOPPED_STATUSES = (130, 143)
#: How long process 0 waits, once stopped, for the others to leave before it does (seconds).
PEERS_GRACE = 20.0


def main() -> None:
    arguments = sys.argv[1:]
    status = 0
    try:
        if arguments[:1] == ["-m"]:
            sys.argv = arguments[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        else:
            sys.argv = arguments
            sys.path[0] = os.path.dirname(os.path.abspath(arguments[0]))
            runpy.run_path(arguments[0], run_name="__main__")
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        status = 130
    except BaseException as error:
        # kml.initialize's hook ends the process here, reporting it
        error = error.with_traceback(_script_frames(error.__traceback__))
        sys.excepthook(type(error), error, error.__traceback__)
        status = 1
        fail(status, error)
    if status == 0 and _exited_during_fit():
        print(
            "kml: this process left model.fit with sys.exit(0): the other processes would wait for it "
            "in their next collective forever, so the job is stopped. To end training on every process, "
            "set model.stop_training = True in a callback (or raise) instead.",
            file=sys.stderr,
        )
        status = 1
    if status != 0:
        fail(status)
    _report_done()


def _report_done() -> None:
    """Leaves `done.RANK` in the launch directory: the script ended well, and JAX's exit barrier is next.

    The launcher says so when the others still run long after (`_supervise.Stragglers`).
    """
    directory, rank = os.environ.get(LAUNCH_DIR_ENV), os.environ.get(PROCESS_ID_ENV)
    if directory and rank:
        try:
            with open(os.path.join(directory, f"done.{rank}"), "w") as report:
                report.write(f"{time.time():.6f}\n")
        except OSError:
            pass  # only diagnostics for the launcher


def _script_frames(trace):
    """`trace` without this bootstrap's and runpy's frames: the traceback `python SCRIPT` would show."""
    while trace is not None and (
        trace.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>")
        or os.path.basename(trace.tb_frame.f_code.co_filename) == "runpy.py"
    ):
        trace = trace.tb_next
    return trace


def _exited_during_fit() -> bool:
    """Whether the script left a `fit` with `sys.exit(0)` (`core._trainer_hooks.exited_during_fit`)."""
    hooks = sys.modules.get("keras_meshlayout.core._trainer_hooks")
    return bool(getattr(hooks, "exited_during_fit", False))


def _exit_status(code: object) -> int:
    """The status Python exits with for `sys.exit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if code >= 0 else code % 256
    print(code, file=sys.stderr)
    return 1


#: Words of the errors a process gets when another process of the job vanished mid-collective.
_PEER_LOST = (
    "Gloo",
    "Connection reset by peer",
    "Connection closed by peer",
    "heartbeat",
    "coordination service",
)


def lost_a_peer(error: BaseException | None) -> bool:
    """Whether `error` is what a collective raises once another process of the job has gone.

    Such a failure is a consequence: the launcher names the process that went.
    """
    if error is None or type(error).__name__ != "JaxRuntimeError":
        return False
    return any(word in str(error) for word in _PEER_LOST)


def fail(status: int, error: BaseException | None = None) -> None:
    """Reports `status` to the launcher and ends the process now, skipping JAX's exit barrier.

    The report, `exit.RANK` in the launch directory, reads `STATUS TIME CAUSE`,
    where CAUSE is `peer` when `error` came from losing another process
    (`lost_a_peer`), else `own`.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    directory, rank = os.environ.get(LAUNCH_DIR_ENV), os.environ.get(PROCESS_ID_ENV)
    if directory and rank:
        try:
            with open(os.path.join(directory, f"exit.{rank}"), "w") as report:
                cause = "peer" if lost_a_peer(error) else "own"
                report.write(f"{status} {time.time():.6f} {cause}\n")
        except OSError:
            pass  # only diagnostics for the launcher
        if rank == "0" and status in STOPPED_STATUSES:
            wait_for_peers(directory, int(os.environ.get(NUM_PROCESSES_ENV, "1")), PEERS_GRACE)
    os._exit(status)


def wait_for_peers(directory: str, processes: int, grace: float) -> bool:
    """Waits until processes 1 to `processes - 1` have reported their exit, at most `grace` seconds.

    Process 0 hosts JAX's coordination service: when it leaves, every process still connected
    aborts ("the JAX distributed service detected fatal errors"). A job stopped by SIGTERM backs
    up, then each process exits with 143; process 0, first out, made a slower peer abort instead
    (seen under load: rank 1 killed by SIGABRT after the backup). Stopped, it leaves last.
    """
    deadline = time.monotonic() + grace
    pending = [os.path.join(directory, f"exit.{rank}") for rank in range(1, processes)]
    while pending and time.monotonic() < deadline:
        pending = [path for path in pending if not os.path.exists(path)]
        if pending:
            time.sleep(0.05)
    if not pending:
        time.sleep(0.1)  # each has written its report and is in os._exit
    return not pending


if __name__ == "__main__":
    main()
