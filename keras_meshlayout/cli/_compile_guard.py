"""`plan --compile` in a child process: a compiler that dies is one line and an exit status, not a core dump.

XLA runs in this process's address space: when it aborts while compiling (JAX's Shardy
partitioner does, with `free(): invalid pointer`, on some memory-budget plans of keras.applications'
MobileNetV2 on a 2×4 mesh, jax 0.10.2, on XLA:CPU and XLA:TPU alike), Python cannot catch it and
the shell sees only SIGABRT. So `plan --compile` runs the same command line in a child process
(`python -m keras_meshlayout`, this environment, `CHILD` set so that it does not fork again) whose
output passes through as it comes, and turns a death by signal into a `plan fails:` line naming the
signal and the way around it. The child has a deadline (`DEADLINE_SECONDS`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from ._args import EXIT_PLAN_FAILS

__all__ = ["CHILD", "DEADLINE_SECONDS", "in_child"]

#: Set in the child's environment: it runs the command itself.
CHILD = "KERAS_MESHLAYOUT_COMPILE_CHILD"
#: The most one `plan --compile` may take, planning and compiling included.
DEADLINE_SECONDS = 3600


def in_child(argv: Sequence[str], deadline: float = DEADLINE_SECONDS) -> int:
    """Runs `keras-meshlayout argv` in a child process; its exit status, or `EXIT_PLAN_FAILS` with one
    line on stderr when it dies by a signal or outlives `deadline` seconds."""
    env = {**os.environ, CHILD: "1"}
    command = [sys.executable, "-m", "keras_meshlayout", *argv]
    pipe = subprocess.PIPE
    with subprocess.Popen(command, env=env, stdout=pipe, stderr=pipe, text=True) as child:
        pumps = [_pump(child.stdout, lambda: sys.stdout), _pump(child.stderr, lambda: sys.stderr)]
        try:
            status = child.wait(timeout=deadline)
        except subprocess.TimeoutExpired:
            child.kill()
            status = None
        for pump in pumps:
            pump.join()
    if status is None:
        print(
            f"plan fails: --compile did not finish within {deadline:.0f} s (planning and XLA's compile "
            "together). Fix: a smaller model or batch for the check, or plan without --compile.",
            file=sys.stderr,
        )
        return EXIT_PLAN_FAILS
    if status >= 0:
        return status
    try:
        name = signal.Signals(-status).name
    except ValueError:
        name = f"signal {-status}"
    print(
        f"plan fails: the process compiling the training step died of {name}: a crash inside native code "
        "(XLA's compiler), not a bad input. JAX's Shardy partitioner (jax 0.10.2) aborts so on some plans "
        "of 2-D convolutions. Fix: rerun with JAX_USE_SHARDY_PARTITIONER=false (XLA's previous "
        "partitioner, for the check and for training alike), another --memory-budget, or without --compile.",
        file=sys.stderr,
    )
    return EXIT_PLAN_FAILS


def _pump(stream: IO[str] | None, target) -> threading.Thread:
    """Copies `stream` line by line to `target()` (read at each line: tests redirect `sys.stdout`)."""

    def copy() -> None:
        for text in iter(stream.readline, ""):
            out = target()
            out.write(text)
            out.flush()

    thread = threading.Thread(target=copy, daemon=True)
    thread.start()
    return thread
