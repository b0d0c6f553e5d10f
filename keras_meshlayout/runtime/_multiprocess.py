"""Multi-process runs: joining JAX's distributed runtime, and each process's share of the data.

`initialize` is the first call of a script that may run in several processes:
under `python -m keras_meshlayout.launch`, on a cluster that JAX recognises
(SLURM, Open MPI, Kubernetes, Cloud TPU), or set up by hand with the variables
below; alone, it does nothing but emulate devices. JAX's distributed runtime
does the work (`jax.distributed.initialize`); this module chooses its
arguments, emulates the CPU devices of each process, selects gloo for
collectives between CPU processes, and bounds the wait for the other processes.

Keras's JAX trainer builds each global batch from the part every process
passes to `fit` (`jax.make_array_from_process_local_data`). `process_slice`
gives a process exactly that part: of numpy arrays, of a Python generator's
batches, or of a `keras.utils.PyDataset`'s.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import keras
import numpy as np

from .. import _compat
from ..core._backend import backends_started, emulate_devices, require_jax_backend
from ..core._errors import (
    DevicesAlreadyInitializedError,
    IndivisibleBatchError,
    InvalidMeshError,
    InvalidOptionError,
    MeshLayoutError,
)

__all__ = [
    "ClusterConfig",
    "ProcessInfo",
    "cluster_config",
    "initialize",
    "local_batch_size",
    "process_batch_block",
    "process_slice",
    "save_weights",
]

#: The variables `initialize` reads, set by the launcher or by hand.
COORDINATOR_ENV = "KML_COORDINATOR"  # host:port of process 0, which runs the coordinator
NUM_PROCESSES_ENV = "KML_NUM_PROCESSES"
PROCESS_ID_ENV = "KML_PROCESS_ID"  # 0 .. KML_NUM_PROCESSES - 1
DEVICES_PER_PROCESS_ENV = "KML_DEVICES_PER_PROCESS"  # CPU devices to emulate in each process
INIT_TIMEOUT_ENV = "KML_INIT_TIMEOUT"  # seconds to wait for every process to join
LAUNCH_DIR_ENV = "KML_LAUNCH_DIR"  # set by the launcher: where each process reports joining

#: Keras's own variables (`keras.distribution.initialize`), read when ours are absent.
KERAS_ADDRESSES_ENV = "KERAS_DISTRIBUTION_JOB_ADDRESSES"
KERAS_NUM_PROCESSES_ENV = "KERAS_DISTRIBUTION_NUM_PROCESSES"
KERAS_PROCESS_ID_ENV = "KERAS_DISTRIBUTION_PROCESS_ID"

DEFAULT_INIT_TIMEOUT = 300.0
#: Exit status of a process that gave up waiting for the others (sysexits' EX_TEMPFAIL).
INIT_TIMEOUT_EXIT_STATUS = 75


class ProcessInfo(NamedTuple):
    """This process's place in the run: `process_id` in `0 .. num_processes - 1`."""

    process_id: int
    num_processes: int


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
    """How this process joins a run, as read from arguments and the environment.

    Attributes:
        coordinator: `host:port` of the coordinator (process 0), or `None`.
        num_processes: Number of processes, or `None` when not configured.
        process_id: This process's index, or `None` when not configured.
        devices_per_process: CPU devices to emulate here, or `None`.
        init_timeout: Seconds to wait for every process to join.
        source: Where the settings came from: `"arguments"`, `"kml"` (the
            launcher's or hand-set `KML_*` variables), `"keras"`
            (`KERAS_DISTRIBUTION_*`), a detected cluster (`"slurm"`,
            `"openmpi"`, `"kubernetes"`, `"tpu"`: JAX reads its settings), or
            `"none"` (a single process).
    """

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    devices_per_process: int | None
    init_timeout: float
    source: str

    @property
    def multi_process(self) -> bool:
        """Whether this configuration joins a distributed run."""
        if self.source in _CLUSTERS:
            return True
        return self.num_processes is not None and self.num_processes > 1


_CLUSTERS = ("slurm", "openmpi", "kubernetes", "tpu", "auto")
_VARIABLES = {
    "kml": (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV),
    "keras": (KERAS_ADDRESSES_ENV, KERAS_NUM_PROCESSES_ENV, KERAS_PROCESS_ID_ENV),
}


def cluster_config(
    environ: Mapping[str, str] | None = None,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    devices_per_process: int | None = None,
    init_timeout: float | None = None,
    auto_detect: bool | None = None,
) -> ClusterConfig:
    """Reads how this process joins a run; arguments win over the environment.

    Without arguments, the settings come from `KML_COORDINATOR`,
    `KML_NUM_PROCESSES` and `KML_PROCESS_ID` (set by the launcher, or by hand),
    else from Keras's `KERAS_DISTRIBUTION_JOB_ADDRESSES`,
    `KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`, else
    from a cluster that JAX detects by itself. Nothing is started.

    Args:
        environ: The environment to read; defaults to `os.environ`.
        coordinator: `host:port` of process 0.
        num_processes: Number of processes.
        process_id: This process's index.
        devices_per_process: CPU devices to emulate in each process.
        init_timeout: Seconds to wait for every process to join.
        auto_detect: `None` (default): a cluster counts when its variables say
            there is more than one task (SLURM under `srun`, Open MPI,
            an indexed Kubernetes Job, a multi-host Cloud TPU with
            `TPU_WORKER_HOSTNAMES`); `True`: leave it to
            `jax.distributed.initialize()` to find one (for TPU VMs known only
            through their metadata server); `False`: never.

    Returns:
        The `ClusterConfig`.

    Raises:
        InvalidOptionError: a setting is malformed, or only some of the three
            (coordinator, number of processes, process id) are given.

    Example:
        >>> from keras_meshlayout.runtime._multiprocess import cluster_config
        >>> env = {"KML_COORDINATOR": "10.0.0.1:1234", "KML_NUM_PROCESSES": "2", "KML_PROCESS_ID": "1"}
        >>> config = cluster_config(env)
        >>> config.coordinator, config.num_processes, config.process_id, config.source
        ('10.0.0.1:1234', 2, 1, 'kml')
        >>> cluster_config({}).multi_process
        False
    """
    env = os.environ if environ is None else environ
    timeout = _number(init_timeout, INIT_TIMEOUT_ENV, env, float, DEFAULT_INIT_TIMEOUT)
    if timeout <= 0:
        raise InvalidOptionError(
            f"The initialization timeout must be a positive number of seconds. Received: {timeout!r}."
        )
    devices = _number(devices_per_process, DEVICES_PER_PROCESS_ENV, env, int, None)
    if devices is not None and devices < 1:
        raise InvalidOptionError(
            f"devices_per_process must be a positive integer. Received: {devices!r} "
            f"(argument or {DEVICES_PER_PROCESS_ENV})."
        )
    given = {"coordinator": coordinator, "num_processes": num_processes, "process_id": process_id}
    if any(value is not None for value in given.values()):
        source, names, settings = "arguments", dict.fromkeys(given), given
    else:
        found = [key for key, variables in _VARIABLES.items() if any(name in env for name in variables)]
        if not found:
            cluster = _detect_cluster(env) if auto_detect is None else ("auto" if auto_detect else None)
            return ClusterConfig(None, None, None, devices, timeout, cluster or "none")
        source = found[0]  # ours win over Keras's
        names = dict(zip(given, _VARIABLES[source], strict=True))
        settings = {key: env.get(name) for key, name in names.items()}
        if source == "keras" and settings["coordinator"]:
            # Keras takes every job's address; JAX needs only the first, the coordinator's.
            settings["coordinator"] = settings["coordinator"].split(",")[0].strip()

    count = _integer(settings["num_processes"], names["num_processes"] or "num_processes")
    rank = _integer(settings["process_id"], names["process_id"] or "process_id")
    address = settings["coordinator"]
    if count is not None and count < 1:
        raise InvalidOptionError(f"The number of processes must be at least 1. Received: {count}.")
    if count == 1 and rank in (None, 0):
        return ClusterConfig(address, 1, 0, devices, timeout, source)
    missing = [
        names[key] or key
        for key, value in (("coordinator", address), ("num_processes", count), ("process_id", rank))
        if value is None
    ]
    if missing:
        raise InvalidOptionError(
            f"A multi-process run needs the coordinator address, the number of processes and this "
            f"process's id, but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set. "
            f"Received: coordinator={address!r}, num_processes={count!r}, process_id={rank!r} "
            f"(from {source}). Fix: set all three ({COORDINATOR_ENV}=host:port of process 0, "
            f"{NUM_PROCESSES_ENV}, {PROCESS_ID_ENV}), or start the script with "
            "python -m keras_meshlayout.launch."
        )
    if not 0 <= rank < count:
        raise InvalidOptionError(
            f"The process id must be in 0..{count - 1} for {count} processes. Received: process_id={rank}."
        )
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise InvalidOptionError(
            f"The coordinator address must be host:port, e.g. 10.0.0.1:1234 (the host of process 0). "
            f"Received: {address!r}."
        )
    return ClusterConfig(address, count, rank, devices, timeout, source)


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
    if config.source in _CLUSTERS:
        _emulate(config.devices_per_process, None, 1)
    else:
        _emulate(config.devices_per_process, emulate_devices, config.num_processes)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    watchdog = _Watchdog(config)
    watchdog.start()
    try:
        if config.source in _CLUSTERS:
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


def _detect_cluster(env: Mapping[str, str]) -> str | None:
    """The cluster whose variables announce more than one task, if any."""

    def above_one(name: str, default: str = "0") -> bool:
        value = env.get(name, default)
        return value.isdigit() and int(value) > 1

    slurm = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
    if all(name in env for name in slurm) and above_one("SLURM_NTASKS"):
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and above_one("OMPI_COMM_WORLD_SIZE", "2"):
        return "openmpi"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "kubernetes"
    hosts = env.get("TPU_WORKER_HOSTNAMES", "") or env.get("TPU_PROCESS_ADDRESSES", "")
    if "," in hosts or "MEGASCALE_COORDINATOR_ADDRESS" in env:
        return "tpu"
    return None


def _number(value: Any, name: str, env: Mapping[str, str], kind: type, default: Any) -> Any:
    if value is None:
        value = env.get(name)
        if value is None or value == "":
            return default
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise InvalidOptionError(f"{name} must be a number. Received: {value!r}.") from None
    if kind is int and isinstance(value, float) and value != number:
        raise InvalidOptionError(f"{name} must be an integer. Received: {value!r}.")
    return number


def _integer(value: Any, name: str) -> int | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise InvalidOptionError(f"{name} must be an integer. Received: {value!r}.")
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise InvalidOptionError(f"{name} must be an integer. Received: {value!r}.")


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


# -- saving from one process ------------------------------------------------------


def save_weights(model: keras.Model, filepath: str | os.PathLike, **kwargs: Any) -> None:
    """`model.save_weights` for a multi-process run: process 0 writes, every process calls it.

    Keras's `save_weights` creates a throwaway optimizer while saving; under a
    distribution spanning processes that is a collective, so process 0 cannot
    call it alone (it would wait for the others forever). Here every process
    calls `save_weights`: process 0 writes the file with the distribution
    lifted, reading each variable from its own devices, and all processes
    wait until the file is complete. The file is an ordinary Keras weights
    file: it loads in a single process, on any mesh, with `model.load_weights`.
    In a single process this is exactly `model.save_weights`.

    Args:
        model: The model (its optimizer's variables are saved too, once built).
        filepath: The `.weights.h5` file to write.
        **kwargs: Passed on to `model.save_weights`.

    Raises:
        MeshLayoutError: a variable is split across processes, so process 0
            does not hold all of it (a mesh built with
            `allow_split_across_processes=True`).
    """
    import jax

    if jax.process_count() == 1:
        model.save_weights(filepath, **kwargs)
        return
    from jax.experimental import multihost_utils

    variables = list(model.weights) + list(getattr(getattr(model, "optimizer", None), "variables", []))
    partial = [v.path for v in variables if not _held_whole(v.value)]
    if partial:
        raise MeshLayoutError(
            f"Process {jax.process_index()} holds only part of {len(partial)} variable(s), e.g. "
            f"{partial[0]!r}: they are split over a mesh axis that spans processes, so no single "
            "process can write them. Fix: keep tensor-parallel axes within a process (the "
            "default of kml.Mesh), or save with a multi-process checkpointer such as Orbax."
        )
    if jax.process_index() == 0:
        previous = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        try:
            model.save_weights(filepath, **kwargs)
        finally:
            keras.distribution.set_distribution(previous)
    multihost_utils.sync_global_devices(f"kml.save_weights {os.fspath(filepath)}")


def _held_whole(array: Any) -> bool:
    """Whether this process's devices hold every element of `array`."""
    if getattr(array, "is_fully_addressable", True) or array.is_fully_replicated:
        return True
    covered = np.zeros(array.shape, dtype=bool)
    for shard in array.addressable_shards:
        covered[shard.index] = True
    return bool(covered.all())


# -- each process's share of the data ------------------------------------------


def process_batch_block(
    mesh: keras.distribution.DeviceMesh, batch_axis: str, process: int | None = None
) -> tuple[int, int, int]:
    """The positions of the batch axis whose data a process feeds.

    Args:
        mesh: The mesh.
        batch_axis: The mesh axis the batch is split over.
        process: A process index; defaults to this process.

    Returns:
        `(first, stop, size)`: the process's devices sit at positions
        `first .. stop - 1` of the batch axis, which has `size` positions.
        The process feeds rows `first * B // size` to `stop * B // size` of
        each global batch of `B` rows.

    Raises:
        InvalidMeshError: the batch axis is not an axis of the mesh, the
            process holds no device of the mesh, or its positions are not
            contiguous (JAX needs one block of rows per process).
    """
    import jax

    names = tuple(mesh.axis_names)
    if batch_axis not in names:
        raise InvalidMeshError(
            f"The batch axis {batch_axis!r} is not an axis of the mesh, which has axes {names}. "
            "Fix: pass the distribution's batch axis."
        )
    process = jax.process_index() if process is None else process
    devices = np.asarray(mesh.backend_mesh.devices)
    axis = names.index(batch_axis)
    mine = np.vectorize(lambda d: int(getattr(d, "process_index", 0)) == process, otypes=[bool])(devices)
    positions = sorted(set(np.argwhere(mine)[:, axis].tolist()))
    if not positions:
        raise InvalidMeshError(
            f"Process {process} holds no device of the mesh {dict(zip(names, mesh.shape, strict=True))}, "
            "so it has no share of the batch. Fix: build the mesh over the devices of every process "
            "(kml.Mesh uses jax.devices(), all of them, by default)."
        )
    first, stop = positions[0], positions[-1] + 1
    if len(positions) != stop - first:
        raise InvalidMeshError(
            f"Process {process} holds positions {positions} of batch axis {batch_axis!r}, which are "
            "not contiguous, but each process must feed one contiguous block of every batch. Fix: "
            f'build the mesh with kml.Mesh(..., across_processes=("{batch_axis}",)).'
        )
    return first, stop, devices.shape[axis]


def local_batch_size(global_batch_size: int, distribution: Any = None) -> int:
    """How many rows of each global batch this process feeds.

    Pass it as `batch_size` to `fit` with the arrays from `process_slice`.

    Args:
        global_batch_size: Rows in each global batch (over all processes).
        distribution: A Keras distribution; defaults to the current one.

    Returns:
        The rows per process: `global_batch_size` in a single process, half
        of it on a mesh whose batch axis spans two processes.

    Raises:
        IndivisibleBatchError: `global_batch_size` does not divide by the
            batch axis.

    Example:
        >>> import keras_meshlayout as kml
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4))
        >>> kml.local_batch_size(64, dist)  # one process feeds the whole batch
        64
    """
    slicer = _slicer_for(distribution)
    if slicer is None:
        return int(global_batch_size)
    low, high = slicer.rows(int(global_batch_size))
    return high - low


def process_slice(data: Any, *, batch_size: int | None = None, distribution: Any = None) -> Any:
    """This process's part of global batches, for `model.fit` in a multi-process run.

    In a multi-process run each process passes `fit` only the rows of each
    global batch that its devices hold along the batch axis (Keras builds the
    global batch with `jax.make_array_from_process_local_data`). With data
    across processes on `data=2`, process 0 feeds the first half of every
    batch and process 1 the second half. Alone, a process feeds everything.

    Args:
        data: One of
            - arrays (numpy or anything with `shape`), or a tuple, list or
              dict of them: one global batch, or with `batch_size`, the whole
              dataset, cut into global batches of `batch_size` rows in order
              (a short last batch included);
            - an iterator or generator of global batches (arrays or
              structures of them): returns a generator of this process's
              parts;
            - a `keras.utils.PyDataset` whose items are global batches:
              returns a `PyDataset` of this process's parts.
        batch_size: Global batch size, when `data` holds several batches.
            Then pass `kml.local_batch_size(batch_size)` to `fit`. Shuffling
            in `fit` then shuffles each process's rows on their own, which
            trains fine; pass `shuffle=False` to reproduce a single-process
            run exactly. Every process must get the same number of batches.
        distribution: A Keras distribution (a `kml.ModelParallel` or Keras's
            own); defaults to the current one.

    Returns:
        The same kind of data, holding only this process's rows.

    Raises:
        IndivisibleBatchError: a global batch does not divide by the batch
            axis size, so the processes cannot get equal parts.
        MeshLayoutError: the data are of a kind this cannot split, or their
            arrays differ in length, or a multi-process run has no
            distribution.

    Example:
        >>> import numpy as np, keras_meshlayout as kml
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4))
        >>> x = np.arange(16).reshape(8, 2)
        >>> kml.process_slice(x, distribution=dist).shape  # alone: all 8 rows
        (8, 2)
        >>> kml.process_slice(np.arange(7), distribution=dist)
        Traceback (most recent call last):
        ...
        keras_meshlayout.core._errors.IndivisibleBatchError: A global batch of 7 rows cannot be split ...
    """
    slicer = _slicer_for(distribution)
    if slicer is None:
        return data
    if isinstance(data, keras.utils.PyDataset):
        return _ProcessPyDataset(data, slicer)
    if _is_structure(data):
        if batch_size is None:
            return slicer.batch(data)
        return slicer.dataset(data, int(batch_size))
    if isinstance(data, Iterator):
        return _process_batches(data, slicer)
    raise MeshLayoutError(
        f"process_slice cannot split data of type {type(data).__name__}. Received: {data!r:.200}. "
        "It takes numpy arrays (or a tuple, list or dict of them), an iterator or generator of "
        "such batches, or a keras.utils.PyDataset. For a tf.data.Dataset, let Keras shard it "
        "(ModelParallel(..., auto_shard_dataset=True))."
    )


@dataclasses.dataclass(frozen=True)
class _RowSlicer:
    """Cuts this process's rows out of global batches (picklable, for PyDataset workers)."""

    first: int
    stop: int
    size: int
    batch_axis: str

    def rows(self, global_batch: int) -> tuple[int, int]:
        if global_batch % self.size:
            raise IndivisibleBatchError(
                f"A global batch of {global_batch} rows cannot be split over batch axis "
                f"{self.batch_axis!r} of size {self.size}: {global_batch} is not a multiple of "
                f"{self.size}, so the processes cannot feed equal parts. Fix: use a global batch "
                f"size that is a multiple of {self.size}; for the short last batch of a dataset, "
                f"make the number of samples a multiple of {self.size} (or drop the remainder)."
            )
        per_position = global_batch // self.size
        return self.first * per_position, self.stop * per_position

    def batch(self, batch: Any) -> Any:
        length = _common_length(batch)
        if length is None:
            return batch
        low, high = self.rows(length)
        return _map_arrays(lambda a: a[low:high], batch)

    def dataset(self, data: Any, batch_size: int) -> Any:
        if batch_size < 1:
            raise InvalidOptionError(f"batch_size must be a positive integer. Received: {batch_size!r}.")
        length = _common_length(data)
        if length is None:
            return data
        full = length - length % batch_size
        low, high = self.rows(batch_size)
        tail = self.rows(length - full) if full < length else (0, 0)

        def cut(array: Any) -> np.ndarray:
            array = np.asarray(array)
            head = array[:full].reshape((full // batch_size, batch_size, *array.shape[1:]))
            head = head[:, low:high].reshape((-1, *array.shape[1:]))
            return np.concatenate([head, array[full:][tail[0] : tail[1]]])

        return _map_arrays(cut, data)


def _slicer_for(distribution: Any) -> _RowSlicer | None:
    import jax

    distribution = keras.distribution.distribution() if distribution is None else distribution
    if distribution is None:
        if jax.process_count() == 1:
            return None
        raise MeshLayoutError(
            f"This is process {jax.process_index()} of {jax.process_count()}, but no distribution "
            "is set, so which rows of each batch it feeds is unknown. Fix: set the distribution "
            "first (keras.distribution.set_distribution(dist)) or pass distribution=dist."
        )
    mesh = getattr(distribution, "device_mesh", None)
    batch_axis = getattr(distribution, "batch_dim_name", None)
    if mesh is None or batch_axis is None:
        raise MeshLayoutError(
            f"The distribution {distribution!r} has no device mesh or batch axis. Fix: use a "
            "kml.ModelParallel, or Keras's ModelParallel or DataParallel."
        )
    first, stop, size = process_batch_block(mesh, batch_axis)
    return _RowSlicer(first, stop, size, batch_axis)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "__getitem__") and len(value.shape) > 0


def _is_structure(data: Any) -> bool:
    if _is_array(data):
        return True
    if isinstance(data, (tuple, list)):
        return all(_is_structure(item) or item is None for item in data) and any(
            item is not None for item in data
        )
    if isinstance(data, dict):
        return bool(data) and all(_is_structure(item) or item is None for item in data.values())
    return False


def _map_arrays(function: Callable[[Any], Any], data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, dict):
        return {key: _map_arrays(function, value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(_map_arrays(function, item) for item in data)
    return function(data)


def _common_length(data: Any) -> int | None:
    lengths: list[int] = []
    _map_arrays(lambda a: lengths.append(int(a.shape[0])), data)
    if len(set(lengths)) > 1:
        raise MeshLayoutError(
            f"The arrays of one batch have different numbers of rows: {lengths}. Every input, "
            "target and sample weight must have the same first dimension."
        )
    return lengths[0] if lengths else None


def _process_batches(batches: Iterable[Any], slicer: _RowSlicer) -> Iterator[Any]:
    for batch in batches:
        if not _is_structure(batch):
            raise MeshLayoutError(
                f"process_slice expects each batch of the generator to be arrays or a tuple, list or "
                f"dict of them. Received a {type(batch).__name__}."
            )
        yield slicer.batch(batch)


class _ProcessPyDataset(keras.utils.PyDataset):
    """A `PyDataset` that yields this process's part of each batch of another."""

    def __init__(self, dataset: keras.utils.PyDataset, slicer: _RowSlicer) -> None:
        super().__init__(
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self.dataset = dataset
        self.slicer = slicer

    @property
    def num_batches(self) -> int | None:
        return self.dataset.num_batches

    def __getitem__(self, index: int) -> Any:
        batch = self.dataset[index]
        if not _is_structure(batch):
            raise MeshLayoutError(
                f"process_slice expects each item of the PyDataset to be arrays or a tuple, list or "
                f"dict of them. Item {index} is a {type(batch).__name__}."
            )
        return self.slicer.batch(batch)

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()
