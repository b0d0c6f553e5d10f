"""`initialize`: joining JAX's distributed runtime, with a deadline, and keeping the processes in step.

`initialize` is the first call of a script that may run in several processes:
under `python -m keras_meshlayout.launch`, on a cluster that JAX recognises
(SLURM, Open MPI, Kubernetes, Cloud TPU), or set up by hand with the variables
`_cluster` reads; alone, it does nothing but emulate devices. JAX's distributed
runtime does the work (`jax.distributed.initialize`); this module chooses its
arguments, emulates the CPU devices of each process, selects gloo for
collectives between CPU processes, and bounds the wait for the other processes
(a watchdog thread that names whom it waited for, then exits with status 75).
Once joined, it paces Keras's loops (`pace_keras_steps`) and makes an uncaught
exception end the process at once (`install_failure_exit`).
"""

from __future__ import annotations

import math
import numbers
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import keras
import numpy as np

from .. import _compat
from ..core._backend import backends_started, emulate_devices, require_jax_backend
from ..core._errors import DevicesAlreadyInitializedError, InvalidOptionError
from ._cluster import (
    CLUSTER_SOURCES,
    DEVICES_PER_PROCESS_ENV,
    INIT_TIMEOUT_ENV,
    INIT_TIMEOUT_EXIT_STATUS,
    LAUNCH_DIR_ENV,
    ClusterConfig,
    cluster_config,
)

__all__ = [
    "ProcessInfo",
    "give_up",
    "initialize",
    "install_failure_exit",
    "pace_keras_steps",
    "timeout_message",
]


class ProcessInfo(NamedTuple):
    """This process's place in the run: `process_id` in `0 .. num_processes - 1`."""

    process_id: int
    num_processes: int


def initialize(
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    emulate_devices: int | None = None,
    init_timeout: float | None = None,
    auto_detect: bool | None = None,
) -> ProcessInfo:
    """Joins this process to a multi-process run, or sets up a single one.

    Call it at the top of the script, before anything uses JAX. It reads the
    settings as `cluster_config` does (arguments, then the `KML_*` variables
    that `python -m keras_meshlayout.launch` sets, then Keras's
    `KERAS_DISTRIBUTION_*`, then a cluster JAX detects) and then:

    - emulates the CPU devices of this process (`KML_DEVICES_PER_PROCESS`, or
      `emulate_devices` split evenly over the processes);
    - in a multi-process run, selects gloo for collectives between CPU
      processes, calls `jax.distributed.initialize`, and gives every process
      the same Keras random seed (as `keras.distribution.initialize` does),
      so weights are initialised identically everywhere;
    - alone, starts nothing: it returns `(0, 1)`.

    A process that cannot reach the coordinator, or whose peers do not all
    join, within `init_timeout` seconds prints what it waited for and exits
    with status 75. (JAX's runtime aborts the process when its own deadline
    passes, so this cannot be an exception.) Under the launcher, each process
    that joins reports it, so the launcher can name one that never did.

    Args:
        coordinator: `host:port` of process 0, which runs the coordinator.
        num_processes: Number of processes.
        process_id: This process's index, `0 .. num_processes - 1`.
        emulate_devices: Total number of CPU devices to emulate over all
            processes (each gets an equal share) when the launcher does not
            set `KML_DEVICES_PER_PROCESS`. Accelerators, when present, stay
            the default devices.
        init_timeout: Seconds to wait for every process to join (default:
            `KML_INIT_TIMEOUT`, else 300).
        auto_detect: As for `cluster_config`.

    Returns:
        `ProcessInfo(process_id, num_processes)`, a named tuple.

    Raises:
        DevicesAlreadyInitializedError: JAX started its backends before this
            call in a multi-process run, or with another device count.
        InvalidOptionError: a setting is malformed or incomplete, or
            `emulate_devices` does not split evenly over the processes.

    Example:
        >>> import keras_meshlayout as kml
        >>> kml.initialize(emulate_devices=8)  # alone: nothing to join
        ProcessInfo(process_id=0, num_processes=1)
    """
    require_jax_backend()
    import jax

    if jax.distributed.is_initialized():
        return ProcessInfo(jax.process_index(), jax.process_count())
    config = cluster_config(
        coordinator=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        init_timeout=init_timeout,
        auto_detect=auto_detect,
    )
    if not config.multi_process:
        _emulate(config.devices_per_process, emulate_devices, 1)
        return ProcessInfo(0, 1)
    if backends_started():
        raise DevicesAlreadyInitializedError(
            "kml.initialize() was called after JAX had started its backends, so this process can "
            f"no longer join the {config.num_processes or 'multi'}-process run (settings from "
            f"{config.source}). JAX starts them at its first operation or device query, e.g. "
            "jax.devices(), building a Keras model, or kml.Mesh(). Fix: call kml.initialize() at "
            "the very top of the script, right after the imports."
        )
    if config.source in CLUSTER_SOURCES:
        _emulate(config.devices_per_process, None, 1)
    else:
        _emulate(config.devices_per_process, emulate_devices, config.num_processes)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    watchdog = _Watchdog(config)
    watchdog.start()
    try:
        if config.source in CLUSTER_SOURCES:
            jax.distributed.initialize(initialization_timeout=_jax_timeout(config.init_timeout))
        else:
            if config.process_id != 0:
                _wait_for_coordinator(config, watchdog)
            jax.distributed.initialize(
                coordinator_address=config.coordinator,
                num_processes=config.num_processes,
                process_id=config.process_id,
                initialization_timeout=_jax_timeout(watchdog.remaining()),
            )
        watchdog.stage = "collectives"
        _compat.initialize_rng()  # one collective over all processes: proves they can talk
    finally:
        watchdog.stop()
    pace_keras_steps()
    install_failure_exit()
    info = ProcessInfo(jax.process_index(), jax.process_count())
    if os.environ.get(LAUNCH_DIR_ENV):
        _report_joined(Path(os.environ[LAUNCH_DIR_ENV]), info.process_id)
    return info


def _emulate(per_process: int | None, total: int | None, processes: int) -> None:
    """Emulates the launcher's per-process count, else an even share of `total`."""
    if per_process is not None:
        emulate_devices(per_process)
        return
    if total is None:
        return
    if isinstance(total, bool) or not isinstance(total, numbers.Integral) or total < 1:
        raise InvalidOptionError(
            f"emulate_devices must be a positive integer (the total over all processes). Received: {total!r}."
        )
    if total % processes:
        raise InvalidOptionError(
            f"emulate_devices={total} cannot be split evenly over {processes} processes. Fix: make it "
            f"a multiple of {processes}, or give each process its count with "
            f"--devices-per-process ({DEVICES_PER_PROCESS_ENV})."
        )
    emulate_devices(total // processes)


def _jax_timeout(seconds: float) -> int:
    # JAX's runtime aborts the process at its own deadline; ours must come first.
    return math.ceil(seconds) + 30


class _Watchdog:
    """Ends the process with a clear message if joining takes longer than the timeout.

    JAX waits for the other processes inside native code that releases the GIL,
    so a Python thread can still report and exit when the deadline passes.
    """

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.stage = "join"
        self._deadline = time.monotonic() + config.init_timeout
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kml-initialize-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()

    def remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def _watch(self) -> None:
        if not self._done.wait(self.config.init_timeout):
            give_up(timeout_message(self.config, self.stage))


def give_up(message: str) -> None:
    """Prints `message` and ends the process at once with `INIT_TIMEOUT_EXIT_STATUS`.

    `os._exit` skips JAX's exit handlers, which would wait for the missing
    processes all over again.
    """
    sys.stdout.flush()
    sys.stderr.write(f"{message}\n")
    sys.stderr.flush()
    os._exit(INIT_TIMEOUT_EXIT_STATUS)


def timeout_message(config: ClusterConfig, stage: str) -> str:
    """What a process that gave up waiting says: whom it waited for, why that happens, what to do."""
    seconds = f"{config.init_timeout:g} s"
    who = (
        f"process {config.process_id} of {config.num_processes}"
        if config.process_id is not None
        else f"this process (settings from {config.source})"
    )
    fix = (
        "Fix: look at the other processes' output for an earlier error; make sure every process "
        "runs this script and calls kml.initialize(); on a cluster check that the coordinator's "
        "host and port are reachable from every host; or allow more time with --init-timeout "
        f"(launcher) or {INIT_TIMEOUT_ENV}."
    )
    if stage == "connect":
        return (
            f"keras_meshlayout: {who} could not reach the coordinator at {config.coordinator} within "
            f"{seconds}: nothing accepted a connection there. Process 0 runs the coordinator: it "
            f"has not started, has exited or crashed, or listens elsewhere. {fix}"
        )
    if stage == "collectives":
        return (
            f"keras_meshlayout: {who} joined the run at {config.coordinator or 'the coordinator'}, "
            f"but the first collective over all processes did not complete within {seconds}: "
            "another process stopped after joining, or the processes cannot reach each other "
            f"directly (gloo connects every pair of processes). {fix}"
        )
    everyone = f"all {config.num_processes} processes" if config.num_processes else "all processes"
    return (
        f"keras_meshlayout: {who} waited {seconds} for {everyone} to join at the coordinator "
        f"{config.coordinator or '(found by JAX)'} and gave up: at least one process never called "
        f"kml.initialize() (it did not start, exited early or crashed) or cannot reach the "
        f"coordinator. {fix}"
    )


def _wait_for_coordinator(config: ClusterConfig, watchdog: _Watchdog) -> None:
    """Polls the coordinator's port, so that a missing coordinator is named as such."""
    host, _, port = config.coordinator.rpartition(":")
    host = host.strip("[]")
    watchdog.stage = "connect"
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=1.0):
                break
        except OSError:
            if watchdog.remaining() <= 0:
                give_up(timeout_message(config, "connect"))
            time.sleep(0.1)
    watchdog.stage = "join"


def _report_joined(directory: Path, process_id: int) -> None:
    try:
        (directory / f"joined.{process_id}").write_text(str(os.getpid()))
    except OSError:
        pass  # only diagnostics for the launcher


# -- keeping the processes in step ------------------------------------------------

#: Steps of a Keras loop (fit, evaluate, predict) that may run ahead of the devices.
STEPS_AHEAD = 2
_PACED = "_kml_paced"


def pace_keras_steps() -> None:
    """Bounds how far Keras's JAX loops run ahead of the devices in a multi-process run on CPUs.

    JAX dispatches every step asynchronously, so `fit`, `evaluate` and
    `predict` queue steps as fast as Python produces them. XLA's CPU client
    lets at most 32 computations be in flight per device, and launches each
    device's part of a computation on a shared thread pool in no fixed order.
    When collectives cross processes, a full queue deadlocks: a device's
    slots are held by later computations while the one they all wait for
    cannot start, so its collective with the other process never completes
    and both processes hang. Measured (jaxlib 0.10.2, 2 processes x 4 CPU
    devices): 20 chained steps with an all-reduce pass, 32 hang every time,
    as the recipe's 32-step epoch did. One process, or accelerators (whose
    streams run in order), are not affected.

    Here, after each step of a Keras loop, the step `STEPS_AHEAD` steps back
    is waited for, so a loop never has more than `STEPS_AHEAD + 1` steps
    queued, whatever the number of steps, the callbacks or the verbosity;
    the host still prepares the next batch while the devices compute.
    Installed once by `initialize` in a multi-process run; a loop whose
    distribution has no CPU device is left alone. A hand-written loop of
    jitted steps must block on a result every few steps itself
    (`jax.block_until_ready`).
    """
    from .._compat import trainer_class

    trainer = trainer_class()
    for name, attribute in (
        ("make_train_function", "train_function"),
        ("make_test_function", "test_function"),
        ("make_predict_function", "predict_function"),
    ):
        method = getattr(trainer, name)
        if getattr(method, _PACED, False):
            continue
        setattr(trainer, name, _paced_maker(method, attribute))


def _paced_maker(method: Callable[..., Any], attribute: str) -> Callable[..., Any]:
    def make(model: Any, *args: Any, **kwargs: Any) -> Any:
        result = method(model, *args, **kwargs)
        step = getattr(model, attribute, None)
        if step is not None and not getattr(step, _PACED, False) and _on_cpu():
            paced = _paced_step(step)
            setattr(model, attribute, paced)
            if result is step:
                result = paced
        return result

    setattr(make, _PACED, True)
    make.__name__ = getattr(method, "__name__", "make_function")
    make.__doc__ = method.__doc__
    return make


def _paced_step(step: Callable[..., Any]) -> Callable[..., Any]:
    import collections

    import jax

    queued: collections.deque = collections.deque()

    def paced(*args: Any, **kwargs: Any) -> Any:
        result = step(*args, **kwargs)
        # The first output (logs, or predictions) is never donated to the next step.
        first = result[0] if isinstance(result, tuple) and result else result
        queued.append([a for a in jax.tree_util.tree_leaves(first) if isinstance(a, jax.Array)])
        while len(queued) > STEPS_AHEAD:
            arrays = [a for a in queued.popleft() if not a.is_deleted()]
            jax.block_until_ready(arrays[:1])  # one output: a computation ends as a whole
        return result

    setattr(paced, _PACED, True)
    return paced


def _on_cpu() -> bool:
    """Whether the current distribution (or, without one, JAX's default backend) runs on CPUs."""
    import jax

    if jax.process_count() == 1:
        return False
    distribution = keras.distribution.distribution()
    mesh = getattr(distribution, "device_mesh", None)
    if mesh is not None:
        devices = np.asarray(mesh.backend_mesh.devices).flat
        return any(getattr(device, "platform", "cpu") == "cpu" for device in devices)
    return jax.default_backend() == "cpu"


def install_failure_exit() -> None:
    """Makes an uncaught exception end this process of a multi-process run at once, with status 1.

    JAX's exit handler waits in a barrier until every process has exited, so
    a process that raises would wait there for minutes while the others wait
    for it inside a collective. After Python prints the traceback, this
    process reports its status (under the launcher) and leaves with
    `os._exit(1)`, skipping that barrier and the remaining exit handlers; the
    launcher, or the cluster's scheduler, then stops the others. Installed
    once by `initialize`. (`sys.exit(n)` under the launcher is handled by its
    worker bootstrap, `_worker.py`, in the same way.)
    """
    previous = sys.excepthook
    if getattr(previous, _PACED, False):
        return

    def excepthook(kind: type[BaseException], error: BaseException, trace: Any) -> None:
        try:
            previous(kind, error, trace)
        finally:
            _fail(1, error)

    setattr(excepthook, _PACED, True)
    sys.excepthook = excepthook


def _fail(status: int, error: BaseException | None = None) -> None:
    from . import _worker

    _worker.fail(status, error)
