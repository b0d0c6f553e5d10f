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
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

DIRECTORIES = {"model": "model.orbax", "optimizer": "optimizer.orbax"}
#: Files up to this size are checksummed (Orbax's metadata); larger ones (array chunks) are
#: checked by size only, so that a load reads nothing but each process's own slices.
HASHED_BELOW = 1 << 20


def key(index: int) -> str:
    return f"{index:05d}"


def _checkpointer() -> Any:
    import orbax.checkpoint as ocp

    return ocp.StandardCheckpointer()


def save(directory: Path, arrays: Mapping[str, Sequence[Any]]) -> None:
    """Writes each kind's arrays (`jax.Array`s, any sharding) under `directory`; all processes call it.

    Returns once every process's shards are on disk (Orbax's own barrier).
    """
    checkpointer = _checkpointer()
    try:
        for kind, values in arrays.items():
            if values:
                checkpointer.save(directory / DIRECTORIES[kind], {key(i): v for i, v in enumerate(values)})
                checkpointer.wait_until_finished()
    finally:
        checkpointer.close()


def restore(directory: Path, targets: Mapping[str, Sequence[Any]]) -> dict[str, list[Any]]:
    """Reads each kind's arrays onto the shardings of `targets` (`jax.ShapeDtypeStruct`s).

    Each process reads only the slices its devices hold under those shardings.
    """
    import jax

    checkpointer = _checkpointer()
    try:
        restored = {}
        for kind, structs in targets.items():
            if not structs:
                restored[kind] = []
                continue
            tree = checkpointer.restore(
                directory / DIRECTORIES[kind], {key(i): s for i, s in enumerate(structs)}
            )
            restored[kind] = [tree[key(i)] for i in range(len(structs))]
            for value, struct in zip(restored[kind], structs, strict=True):
                if isinstance(value, jax.Array) and value.sharding != struct.sharding:
                    raise ValueError(f"Orbax restored an array with sharding {value.sharding}")
        return restored
    finally:
        checkpointer.close()


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
                    "sha256": _sha256(path) if size < HASHED_BELOW else None,
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
        if entry["sha256"] is not None and _sha256(path) != entry["sha256"]:
            return f"{name} does not match its checksum in the manifest (corrupt)"
    return None


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            hasher.update(block)
    return hasher.hexdigest()
