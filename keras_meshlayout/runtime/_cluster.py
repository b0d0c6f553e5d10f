"""How this process joins a run: the settings read from arguments and the environment.

`cluster_config` reads them (ours, `KML_*`, set by `python -m keras_meshlayout.launch`
or by hand; Keras's `KERAS_DISTRIBUTION_*`; or a cluster JAX detects by itself:
SLURM, Open MPI, Kubernetes, Cloud TPU) into a frozen `ClusterConfig`, and starts
nothing. The variable names and the exit status of a process that gave up waiting
are the contract between `initialize` and the launcher, so both read them here.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from collections.abc import Mapping
from typing import Any

from ..core._errors import InvalidOptionError

__all__ = ["ClusterConfig", "cluster_config"]

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
        if self.source in CLUSTER_SOURCES:
            return True
        return self.num_processes is not None and self.num_processes > 1


#: The sources whose settings JAX reads itself (`jax.distributed.initialize()` without arguments).
CLUSTER_SOURCES = ("slurm", "openmpi", "kubernetes", "tpu", "auto")
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
        >>> from keras_meshlayout.runtime._cluster import cluster_config
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

    return _checked(settings, names, source, devices, timeout)


def _checked(
    settings: Mapping[str, Any],
    names: Mapping[str, str | None],
    source: str,
    devices: int | None,
    timeout: float,
) -> ClusterConfig:
    """The `ClusterConfig` of the three settings (coordinator, number of processes, id), once checked."""
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
