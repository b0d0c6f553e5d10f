"""Array storage for checkpoints on Orbax and TensorStore: each process writes and reads its own shards.

`_checkpoint` keeps the protocol (manifest, plan, hidden directory and rename,
checks before anything is assigned); this module only moves arrays. A save
hands Orbax every variable's `jax.Array` as it is laid out: each process writes
the shards its devices hold, one copy of each (Orbax skips replicas). A load
asks Orbax for every array with the sharding the variable has *now*, so each
process reads only the slices its devices hold under the current plan.

Every array lives in one Orbax checkpoint per kind of variable,
`model.orbax/` and `optimizer.orbax/`, as a flat dictionary keyed by the
variable's position (`"00000"`, ...), the way Keras matches variables on load.

What a save blocks: only the copy of each shard off its device (one copy, from
its first replica; Orbax's replica-parallel writing would first slice every
shard on its device), then Orbax writes in a thread of its own; each shard is
stored in chunks of at most `CHUNK_BYTES`. What a load holds: with `release`,
the model and, per process, one shard's read or `READ_BYTES` (Orbax's restore
limiter) with its copy from the file, each value freed before its replacement
is read and each group on its devices before the next is read.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..core._progress import bytes_bar, watch_bytes

DIRECTORIES = {"model": "model.orbax", "optimizer": "optimizer.orbax"}
#: Files up to this size are checksummed (Orbax's metadata); larger ones (array chunks) are
#: checked by size only, so that a load reads nothing but each process's own slices.
HASHED_BELOW = 1 << 20


def key(index: int) -> str:
    return f"{index:05d}"


def _checkpointer() -> Any:
    """Orbax's asynchronous checkpointer, each shard written whole by its first replica.

    Orbax's default spreads the writing of a replicated shard over its replicas, which first
    slices every shard on its device (a dispatched slice per shard, all before `save` returns);
    here each shard is copied off one device as it is, and only that copy blocks the caller.
    """
    import jax
    import orbax.checkpoint as ocp

    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        (jax.Array, handlers.ArrayHandler(use_replica_parallel=False)),
    )
    handler = ocp.PyTreeCheckpointHandler(type_handler_registry=registry)
    return ocp.AsyncCheckpointer(handler)


#: The most bytes of one stored chunk: Orbax splits each saved shard into chunks of at most this
#: size, along its sharded axes first. A load reads whole chunks, so a shard laid out otherwise than
#: it was saved reads at most a chunk's width more than itself on each side (not a whole saved shard).
CHUNK_BYTES = 1 << 20


def _save_args(values: Sequence[Any]) -> Any:
    import orbax.checkpoint as ocp

    chunked = ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES)
    return ocp.args.PyTreeSave(
        {key(i): v for i, v in enumerate(values)}, save_args={key(i): chunked for i in range(len(values))}
    )


class _OrbaxErrors(logging.Filter):
    """Drops Orbax's own error records (a failed write's traceback, some 150 lines) during our saves.

    The save reports the failure itself, as one `CheckpointError` naming the file; Orbax's
    warnings, and its errors outside our saves, pass.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        if record.name == "asyncio":  # "Task exception was never retrieved": one of Orbax's writes
            return "/orbax/" not in record.getMessage()
        return "orbax" not in Path(record.pathname).parts


_QUIET = _OrbaxErrors()
_SAVES = [0]  # saves in flight, while which `_QUIET` filters the loggers Orbax writes to ("absl", "asyncio")
_SAVES_LOCK = threading.Lock()


def _late_callback(unraisable: Any) -> bool:
    """Whether an unraisable error is a write callback reaching Orbax's event loop after it closed.

    When one write of an Orbax save fails (a full disk), Orbax ends its event loop; TensorStore's
    callbacks for the writes still in flight then find it closed (`RuntimeError: Event loop is
    closed`, raised in `call_soon_threadsafe`, one traceback per write). Nothing is left to do
    for them: the save has failed and says so.
    """
    frames = [frame.name for frame in traceback.extract_tb(unraisable.exc_traceback)]
    return (
        isinstance(unraisable.exc_value, RuntimeError)
        and str(unraisable.exc_value) == "Event loop is closed"
        and frames[:1] == ["call_soon_threadsafe"]
    )


def _drop_late_callbacks() -> None:
    """Installs (once) an unraisable-error hook that drops `_late_callback`s, passing on the rest."""
    previous = sys.unraisablehook
    if getattr(previous, "_kml_late_callbacks", False):
        return

    def hook(unraisable: Any) -> None:
        if not _late_callback(unraisable):
            previous(unraisable)

    hook._kml_late_callbacks = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def _quiet(begin: bool) -> None:
    """Counts a save in (`begin`) or out; the filter is on while any is in flight."""
    if begin:
        _drop_late_callbacks()
    with _SAVES_LOCK:
        _SAVES[0] += 1 if begin else -1
        if _SAVES[0] == (1 if begin else 0):
            for name in ("absl", "asyncio"):
                logger = logging.getLogger(name)
                (logger.addFilter if begin else logger.removeFilter)(_QUIET)


@contextlib.contextmanager
def _write_errors() -> Iterator[None]:
    """Raises a failed write as an `OSError` (TensorStore reports a full disk as a `ValueError`)."""
    try:
        yield
    except OSError:
        raise
    except Exception as err:
        raise OSError(None, f"{type(err).__name__}: {err}") from err


def release_host_memory() -> None:
    """Hands the host memory freed by a save or load back to the system (glibc's `malloc_trim`).

    A save copies every shard to the host, in Orbax's threads, and a load reads them there: once
    freed, glibc keeps those pages in its per-thread arenas, so that a process that backs up in
    the background held about 2.6 times the model's bytes more after `fit` (measured on a 54 MiB
    MLP: 263 MiB, none after trimming). Elsewhere than glibc, nothing is done.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def save(directory: Path, arrays: Mapping[str, Sequence[Any]]) -> None:
    """Writes each kind's arrays (`jax.Array`s, any sharding) under `directory`; all processes call it.

    Returns once every process's shards are on disk (Orbax's own barrier). Raises `OSError`
    when they cannot be written.
    """
    checkpointer = _checkpointer()
    _quiet(True)
    try:
        for kind, values in arrays.items():
            if values:
                target = directory / DIRECTORIES[kind]
                total = sum(int(getattr(value, "nbytes", 0)) for value in values)
                with (
                    _write_errors(),
                    watch_bytes(f"writing {target.name}", total, functools.partial(_on_disk, target)),
                ):
                    checkpointer.save(target, args=_save_args(values))
                    checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
        _quiet(False)
        release_host_memory()


def start_save(directory: Path, kind: str, values: Sequence[Any]) -> Any:
    """Starts writing one kind's arrays; returns once they are copied off the devices.

    The files are written in the background: call `finish` on what this returns.
    """
    checkpointer = _checkpointer()
    _quiet(True)  # until `finish`
    try:
        with _write_errors():
            checkpointer.save(directory / DIRECTORIES[kind], args=_save_args(values))
    except BaseException:
        checkpointer.close()
        _quiet(False)
        raise
    return checkpointer


def finish(checkpointer: Any) -> None:
    """Waits until what `start_save` started is on disk (raising its error as an `OSError`, if any)."""
    try:
        with _write_errors():
            checkpointer.wait_until_finished()
    finally:
        checkpointer.close()
        _quiet(False)
        release_host_memory()


def restore(directory: Path, targets: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """Reads each kind's arrays onto the shardings of `targets` (`jax.ShapeDtypeStruct`s).

    Each process reads only the slices its devices hold under those shardings.
    """
    restored: dict[str, list[Any]] = {kind: [None] * len(structs) for kind, structs in targets.items()}

    def keep(kind: str, index: int, value: Any) -> None:
        restored[kind][index] = value

    # Read a group at a time only for the bar to move; every array is read before any is assigned.
    restore_into(directory, targets, keep, group_bytes=GROUP_BYTES, limited=False)
    return restored


#: How many bytes `restore_into` reads before handing them over, by default.
GROUP_BYTES = 64 << 20
#: How many bytes of array data each process reads at a time (Orbax's restore limiter): shards
#: smaller than this are read several at a time, a larger one alone (the limit is then its read).
READ_BYTES = 4 << 20


def shard_read_bytes(struct: Any, chunk_shape: Sequence[int] | None) -> int:
    """The most bytes reading one of this process's shards of `struct` (a `jax.ShapeDtypeStruct`) takes.

    Orbax reserves, for each shard it reads, the bytes of the stored chunks the shard overlaps:
    the shard's extent widened to whole chunks of `chunk_shape` (`None`: one chunk, the whole
    array), the last chunk counted whole even where it overhangs the array.
    """
    shape = tuple(struct.shape)
    chunks = tuple(chunk_shape) if chunk_shape and len(chunk_shape) == len(shape) else shape
    most = 0
    for index in struct.sharding.addressable_devices_indices_map(shape).values():
        size = np.dtype(struct.dtype).itemsize
        for part, n, c in zip(index, shape, chunks, strict=True):
            start, stop = part.start or 0, n if part.stop is None else part.stop
            size *= stop - start if c <= 0 else -(-stop // c) * c - start // c * c
        most = max(most, size)
    return most


def _read_limit(directory: Path, targets: Mapping[str, Sequence[Any]]) -> int:
    """The bytes in flight to allow while reading `targets`: `READ_BYTES`, or one shard's read more."""
    import orbax.checkpoint as ocp

    largest = 0
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        for kind, structs in targets.items():
            if not structs:
                continue
            tree = checkpointer.metadata(directory / DIRECTORIES[kind]).item_metadata.tree
            for i, struct in enumerate(structs):
                storage = getattr(tree.get(key(i)), "storage", None)
                largest = max(largest, shard_read_bytes(struct, getattr(storage, "chunk_shape", None)))
    finally:
        checkpointer.close()
    return max(READ_BYTES, largest + 4096)  # Orbax needs more than the request; 4 KiB above rounding


def _reader(limit: int | None) -> Any:
    """Orbax's `PyTreeCheckpointer`, reading at most `limit` bytes at a time in each process (`None`: 96 GB).

    Orbax refuses (`ValueError`) a shard whose read needs `limit` bytes or more: `_read_limit`
    computes the limit from the chunks stored, as Orbax does.
    """
    import orbax.checkpoint as ocp

    class Reader(ocp.PyTreeCheckpointer):
        def __init__(self) -> None:
            # Orbax takes the limit in GB (10**9 bytes), and multiplies it back.
            gb = None if limit is None else limit / 10**9
            handler = ocp.PyTreeCheckpointHandler(restore_concurrent_gb=gb)
            ocp.Checkpointer.__init__(self, handler)

    return Reader()


def restore_into(
    directory: Path,
    targets: Mapping[str, Sequence[Any]],
    assign: Callable[[str, int, Any], None],
    group_bytes: int | None = GROUP_BYTES,
    release: Callable[[str, int], None] | None = None,
    limited: bool = True,
) -> None:
    """Reads the arrays in groups of about `group_bytes` (`None`: all at once), and hands each over.

    `assign(kind, index, array)` is called for every array of a group once the whole group is
    read, so that at most one group is held beside the variables it replaces. `release(kind,
    index)`, when given, is called for every array of a group just before the group is read,
    for the caller to free the value it will replace: then a load holds the model and, on the
    host, about `READ_BYTES` of reads in flight (each shard is read, put on its device and
    dropped, a few at a time). Not `limited`: as many reads at once as Orbax likes (faster).
    On a terminal a bar counts the bytes read (`core._progress`), a group at a time.
    """
    checkpointer = _reader(_read_limit(directory, targets) if limited else None)
    try:
        for kind, structs in targets.items():
            sizes = [int(np.prod(s.shape, dtype=np.int64)) * np.dtype(s.dtype).itemsize for s in structs]
            groups: list[list[int]] = [[]]
            size = 0
            for i, nbytes in enumerate(sizes):
                if groups[-1] and group_bytes is not None and size + nbytes > group_bytes:
                    groups.append([])
                    size = 0
                groups[-1].append(i)
                size += nbytes
            with bytes_bar(f"reading {DIRECTORIES[kind]}", sum(sizes)) as advance:
                for group in groups:
                    _restore_group(checkpointer, kind, directory, structs, group, assign, release)
                    advance(sum(sizes[i] for i in group))
    finally:
        checkpointer.close()
        release_host_memory()


def _restore_group(
    checkpointer: Any,
    kind: str,
    directory: Path,
    structs: Sequence[Any],
    group: list[int],
    assign: Callable[[str, int, Any], None],
    release: Callable[[str, int], None] | None,
) -> None:
    """Reads one group of `kind`'s arrays, hands each over, and waits until they are on their devices."""
    import jax
    import orbax.checkpoint as ocp

    if not group:
        return
    item = {key(i): structs[i] for i in group}
    if release is not None:
        for i in group:
            release(kind, i)
    args = ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
    )
    tree = checkpointer.restore(directory / DIRECTORIES[kind], args=args)
    for i in group:
        value = tree[key(i)]
        if not isinstance(value, jax.Array) or value.sharding != structs[i].sharding:
            raise ValueError(f"Orbax restored {key(i)} as {type(value).__name__}, not as asked")
        assign(kind, i, value)
    # Each group done before the next is read: otherwise reads outpace the copies onto the
    # devices and their host buffers pile up (1.25 GiB MLP on 1x8: 0.37x the model in flight,
    # 0.05x with this wait, as fast).
    jax.block_until_ready([tree[key(i)] for i in group])


def _on_disk(directory: Path) -> int:
    """The bytes a save in progress has written for `directory` so far.

    Orbax writes into a temporary sibling (`model.orbax.orbax-checkpoint-tmp-...`) and renames
    it at the end: every entry beside `directory` whose name starts with its name is counted.
    """
    total = 0
    for root in directory.parent.glob(f"{directory.name}*"):
        for folder, _, names in os.walk(root):
            for name in names:
                with contextlib.suppress(OSError):  # a temporary file renamed meanwhile
                    total += (Path(folder) / name).stat().st_size
    return total


def stored_shapes(directory: Path) -> Counter[tuple[int, ...]] | None:
    """How many arrays of each shape the checkpoint holds, from Orbax's metadata (`None`: unreadable)."""
    checkpointer = _checkpointer()
    shapes: Counter[tuple[int, ...]] = Counter()
    try:
        for name in DIRECTORIES.values():
            if not (directory / name).is_dir():
                continue
            tree = checkpointer.metadata(directory / name).item_metadata.tree
            for value in tree.values():
                shapes[tuple(value.shape)] += 1
    except Exception:  # unreadable metadata: the load reports it
        return None
    finally:
        checkpointer.close()
    return shapes


def files(directory: Path) -> dict[str, dict[str, Any]]:
    """Every file the arrays occupy under `directory`: its size, and the SHA-256 of the small ones."""
    listing = {}
    for name in sorted(DIRECTORIES.values()):
        root = directory / name
        if not root.is_dir():
            continue
        for folder, _, names in os.walk(root):
            for file in names:
                path = Path(folder) / file
                size = path.stat().st_size
                listing[path.relative_to(directory).as_posix()] = {
                    "bytes": size,
                    "sha256": sha256(path) if size < HASHED_BELOW else None,
                }
    return dict(sorted(listing.items()))


def digest(listing: Mapping[str, Any]) -> str:
    """The SHA-256 of a file listing, as the manifest's `weights_sha256` of an Orbax checkpoint."""
    return hashlib.sha256(json.dumps(listing, sort_keys=True).encode()).hexdigest()


def damage(directory: Path, listing: Mapping[str, Mapping[str, Any]]) -> str | None:
    """What is wrong with the files under `directory` against `listing`, or `None` if nothing is."""
    for name, entry in listing.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except OSError:
            return f"{name} is missing"
        if size != entry["bytes"]:
            return f"{name} holds {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
        if entry["sha256"] is not None and sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum in the manifest (corrupt)"
    return None


def sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes, read 1 MiB at a time."""
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()
