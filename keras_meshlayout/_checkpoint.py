"""Checkpoints that carry their plan, load on any mesh, and never half-apply.

Keras's own formats (`model.save`/`load_model`, `save_weights`/`load_weights`)
already restore into whatever layout the current distribution gives each
variable. `save_checkpoint` and `load_checkpoint` add what they lack:

- the plan (mesh and resolved layouts) saved beside the weights, as JSON, and
  a diff of that plan against the current one on load;
- a manifest of every variable (path, shape, dtype) and a checksum of the
  weights file, checked *before* anything is assigned, so a checkpoint for
  another model, a truncated or corrupt file, or a half-written directory is
  a clear error and the model in memory is left as it was;
- atomic saves: everything is written to a hidden sibling directory and moved
  into place only when complete, so an interrupted save never leaves a
  checkpoint that looks complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras

from ._errors import CheckpointError
from ._plan import Plan, format_axes, format_bytes

if TYPE_CHECKING:
    import rich.console

    from ._distribution import ModelParallel

__all__ = ["LayoutChange", "PlanDiff", "load_checkpoint", "plan_diff", "save_checkpoint"]

FORMAT = 1
WEIGHTS = "model.weights.h5"
PLAN = "plan.json"
MANIFEST = "manifest.json"  # written last: its presence marks a complete checkpoint


def save_checkpoint(
    model: keras.Model, directory: str | os.PathLike, *, distribution: ModelParallel | None = None
) -> Path:
    """Saves the weights (optimizer state included), the plan and a manifest, atomically.

    Args:
        model: The model, built (and compiled, to include the optimizer).
        directory: Checkpoint directory; replaced if it exists.
        distribution: The `kml.ModelParallel` whose plan to save; defaults to
            the current distribution (no plan is saved without one).

    Returns:
        The checkpoint directory.

    Example:
        >>> import keras, keras_meshlayout as kml, tempfile, os
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*kernel", (None, "model"))])
        >>> with dist.scope():
        ...     model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4096, name="d")], name="m")
        >>> path = kml.save_checkpoint(model, os.path.join(tempfile.mkdtemp(), "step_1"), distribution=dist)
        >>> sorted(p.name for p in path.iterdir())
        ['manifest.json', 'model.weights.h5', 'plan.json']
    """
    target = Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
    partial.mkdir()
    try:
        model.save_weights(partial / WEIGHTS)
        plan = _current_plan(model, distribution)
        if plan is not None:
            _write_json(partial / PLAN, plan.to_dict())
        _write_json(
            partial / MANIFEST,
            {
                "format": FORMAT,
                "keras": keras.__version__,
                "variables": _describe(_variables(model)),
                "weights_sha256": _sha256(partial / WEIGHTS),
            },
        )
        _replace_directory(partial, target)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return target


def load_checkpoint(
    model: keras.Model, directory: str | os.PathLike, *, distribution: ModelParallel | None = None
) -> PlanDiff | None:
    """Restores a `save_checkpoint` checkpoint into `model`, on the current distribution.

    Build (and compile, to restore the optimizer) the model under the
    distribution you want first: each variable keeps the layout the current
    plan gives it, whatever mesh the checkpoint was saved on. Everything is
    checked before the first value is assigned.

    Args:
        model: The model to restore into.
        directory: A checkpoint directory written by `save_checkpoint`.
        distribution: The `kml.ModelParallel` to diff the saved plan against;
            defaults to the current distribution.

    Returns:
        The `PlanDiff` between the saved plan and the current one, or `None`
        when either side has no distribution.

    Raises:
        CheckpointError: the directory is missing, half-written or corrupt, or
            its variables do not match the model's (the message lists the
            missing, extra and reshaped ones). The model is left untouched.
    """
    source = Path(directory)
    manifest = _read_manifest(source)
    weights = source / WEIGHTS
    if not weights.is_file() or _sha256(weights) != manifest.get("weights_sha256"):
        raise CheckpointError(
            f"Checkpoint {source}: {WEIGHTS} is missing, truncated or corrupt (its checksum does not "
            "match the manifest). Nothing was loaded; the model is unchanged. Fix: restore from an "
            "earlier checkpoint."
        )
    _check_variables(manifest["variables"], _describe(_variables(model)), source)
    model.load_weights(weights)
    saved = source / PLAN
    current = _current_plan(model, distribution)
    if not saved.is_file() or current is None:
        return None
    return plan_diff(json.loads(saved.read_text()), current)


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """One variable whose layout differs between two plans."""

    path: str
    shape: tuple[int, ...]
    before: tuple
    after: tuple
    bytes_before: int
    bytes_after: int


@dataclasses.dataclass(frozen=True)
class PlanDiff:
    """What changes between a saved plan and the current one.

    Attributes:
        mesh_before, mesh_after: Mesh axis sizes by name.
        changes: Variables whose layout changes.
        memory_before, memory_after: Training-state bytes per device.
    """

    mesh_before: Mapping[str, int]
    mesh_after: Mapping[str, int]
    changes: tuple[LayoutChange, ...]
    memory_before: Mapping[str, Any]
    memory_after: Mapping[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mesh_before": dict(self.mesh_before),
            "mesh_after": dict(self.mesh_after),
            "changes": [
                {
                    **dataclasses.asdict(c),
                    "shape": list(c.shape),
                    "before": list(c.before),
                    "after": list(c.after),
                }
                for c in self.changes
            ],
            "memory_before": dict(self.memory_before),
            "memory_after": dict(self.memory_after),
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.table import Table
        from rich.text import Text

        def mesh(sizes: Mapping[str, int]) -> str:
            return " × ".join(f"{k}={v}" for k, v in sizes.items())

        table = Table(
            title=f"Layout changes: {mesh(self.mesh_before)} → {mesh(self.mesh_after)}", title_justify="left"
        )
        for column in ("variable", "shape", "before", "after", "per device before", "after"):
            table.add_column(column)
        for c in self.changes:
            table.add_row(
                c.path,
                format_axes(c.shape),
                format_axes(c.before),
                format_axes(c.after),
                format_bytes(c.bytes_before),
                format_bytes(c.bytes_after),
            )
        yield table
        yield Text(
            f"Training state per device: {format_bytes(self.memory_before['total'])} → "
            f"{format_bytes(self.memory_after['total'])}"
        )

    def __str__(self) -> str:
        from rich.console import Console

        buffer = io.StringIO()
        Console(file=buffer, width=140, force_terminal=False, color_system=None).print(self)
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())


def plan_diff(before: Plan | Mapping[str, Any], after: Plan | Mapping[str, Any]) -> PlanDiff:
    """Which variables change layout between two plans, and the memory per device of each.

    Variables are matched by path with any leading model-name scope ignored
    (Keras drops it when a Sequential model is reloaded).

    Args:
        before: A `Plan` or its `to_dict()` (e.g. a checkpoint's `plan.json`).
        after: The same for the other plan.
    """
    old = before.to_dict() if isinstance(before, Plan) else before
    new = after.to_dict() if isinstance(after, Plan) else after
    old_vars = {_short(v["path"]): v for v in old["variables"]}
    changes = []
    for v in new["variables"]:
        was = old_vars.get(_short(v["path"]))
        if was is not None and was["axes"] != v["axes"]:
            changes.append(
                LayoutChange(
                    v["path"],
                    tuple(v["shape"]),
                    tuple(was["axes"]),
                    tuple(v["axes"]),
                    was["bytes_per_device"],
                    v["bytes_per_device"],
                )
            )
    return PlanDiff(
        old["mesh"], new["mesh"], tuple(changes), old["memory_per_device"], new["memory_per_device"]
    )


# -- helpers ------------------------------------------------------------------------------


def _variables(model: keras.Model) -> list[keras.Variable]:
    optimizer = getattr(model, "optimizer", None)
    extra = list(optimizer.variables) if optimizer is not None and optimizer.built else []
    return list(model.weights) + extra


def _describe(variables: Sequence[keras.Variable]) -> list[dict[str, Any]]:
    return [{"path": v.path, "shape": list(v.shape), "dtype": str(v.dtype)} for v in variables]


def _current_plan(model: keras.Model, distribution: Any = None) -> Plan | None:
    from ._distribution import ModelParallel

    distribution = distribution or keras.distribution.distribution()
    if not isinstance(distribution, ModelParallel):
        return None
    import warnings

    from ._errors import MeshLayoutWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MeshLayoutWarning)
        return distribution.plan(model)


def _read_manifest(source: Path) -> dict[str, Any]:
    if not source.is_dir():
        partial = sorted(source.parent.glob(f".{source.name}.partial-*")) if source.parent.is_dir() else []
        hint = f" A half-written save was found beside it ({partial[0].name})." if partial else ""
        raise CheckpointError(
            f"No checkpoint at {source}.{hint} Fix: check the path, or use an earlier checkpoint."
        )
    path = source / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"Checkpoint {source} has no {MANIFEST}: it was not written by kml.save_checkpoint or its "
            "save did not finish. Nothing was loaded; the model is unchanged."
        )
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(
            f"Checkpoint {source}: {MANIFEST} is corrupt ({err}). Nothing was loaded."
        ) from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(
            f"Checkpoint {source} has format {manifest.get('format')!r}; this version reads format {FORMAT}."
        )
    return manifest


def _check_variables(saved: list[dict[str, Any]], current: list[dict[str, Any]], source: Path) -> None:
    if [(_short(v["path"]), v["shape"], v["dtype"]) for v in saved] == [
        (_short(v["path"]), v["shape"], v["dtype"]) for v in current
    ]:
        return
    old = {_short(v["path"]): v for v in saved}
    new = {_short(v["path"]): v for v in current}
    lines = [f"  missing from the checkpoint: {p} {new[p]['shape']}" for p in new if p not in old]
    lines += [f"  only in the checkpoint: {p} {old[p]['shape']}" for p in old if p not in new]
    lines += [
        f"  different: {p}: checkpoint {old[p]['shape']} {old[p]['dtype']}, "
        f"model {new[p]['shape']} {new[p]['dtype']}"
        for p in new
        if p in old and (old[p]["shape"], old[p]["dtype"]) != (new[p]["shape"], new[p]["dtype"])
    ]
    if not lines:
        lines = ["  the same variables in a different order"]
    raise CheckpointError(
        f"Checkpoint {source} does not match the model ({len(saved)} variables saved, {len(current)} in the "
        "model):\n" + "\n".join(lines[:20]) + "\nNothing was loaded; the model is unchanged. Fix: build the "
        "same model (and compile it with the same optimizer, to restore the optimizer state) before loading."
    )


def _short(path: str) -> str:
    """A variable path without its first scope, the way Keras sometimes drops it."""
    return path.split("/", 1)[1] if path.count("/") >= 2 else path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _replace_directory(partial: Path, target: Path) -> None:
    """Moves the complete `partial` directory to `target`, replacing any old one."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.replace(target, old)
    os.replace(partial, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
