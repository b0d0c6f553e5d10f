"""`plan --target` and `plan --compile`: the TPU machine planned for, and the compile check.

The training step is compiled from the dry build for the mesh (`kml.compile_step`), with a
batch made from `--batch-size`/`--sequence-length` and targets shaped like the model's
outputs: integer labels without the last dimension for a sparse categorical `--loss`, else
arrays like the outputs. The step trains with `--optimizer` (default adam) and `--loss`
(default the mean squared error).
"""

from __future__ import annotations

import argparse
from typing import Any

from ..core._format import format_bytes
from ._args import InputError
from ._plan_inputs import batch_spec

__all__ = ["compile_for", "compiled_failure", "mesh_target", "platform_name"]


def mesh_target(spec: str | None) -> Any:
    """The `--target` as a `Target` (`None` without one); a bad one raises `InvalidTargetError`."""
    if spec is None:
        return None
    from ..core._targets import parse_target

    return parse_target(spec)


def platform_name(mesh: Any) -> str:
    """The mesh's platform as the progress line says it (`tpu (TPU v5 lite)`)."""
    from ..core._mesh import platform_name as name

    return name(mesh)


def compile_for(build: Any, distribution: Any, args: argparse.Namespace) -> Any:
    """The `CompiledStep` of the model `build` returns, for `--batch-size` rows."""
    from ..core._dry import dry_build
    from ..report._compile import compile_step

    with dry_build(build) as model:
        x = batch_spec(model, args.batch_size, args.sequence_length)
        y = _targets_for(model, args.batch_size, args.sequence_length, sparse="sparse" in args.loss)
    return compile_step(build, distribution, x, y, optimizer=args.optimizer or "adam", loss=args.loss)


def _targets_for(model: Any, batch_size: int, length: int | None, *, sparse: bool) -> Any:
    """Abstract targets shaped like the model's outputs (labels for a sparse categorical loss)."""
    import jax
    import keras

    def spec(tensor: Any) -> Any:
        shape = [batch_size, *(length if size is None else size for size in tensor.shape[1:])]
        if None in shape:
            raise InputError(
                f"--compile: the output {tensor.name!r} has shape {tuple(tensor.shape)}; give its other "
                "unknown dimensions with --sequence-length."
            )
        if sparse:
            return jax.ShapeDtypeStruct(tuple(shape[:-1]), "int32")
        return jax.ShapeDtypeStruct(tuple(shape), keras.backend.standardize_dtype(tensor.dtype))

    outputs = getattr(model, "outputs", None)
    if not outputs:
        raise InputError(
            f"--compile: the model {model.name!r} has no defined outputs to size targets from (a "
            "subclassed model?). Build it from keras.Input (a functional or Sequential model)."
        )
    return spec(outputs[0]) if len(outputs) == 1 else [spec(output) for output in outputs]


def compiled_failure(
    compiled: Any, peak: Any, budget: int | None, capacity: int | None, refits: list[Any]
) -> str | None:
    """Why the compiled step fails the `--memory-budget` or the device memory, or `None`."""
    named = ((budget, "--memory-budget"), (capacity, "device memory"))
    limits = [(value, name) for value, name in named if value]
    limit, name = min(limits, default=(None, None))
    if limit is None or compiled.peak_bytes <= limit:
        return None
    tried = ""
    if refits:
        budgets = ", ".join(format_bytes(refit.next_budget) for refit in refits)
        tried = f" Planned again under {budgets} without fitting once compiled."
    return (
        f"the compiled training step needs {format_bytes(compiled.peak_bytes)} per device at its peak (XLA's "
        f"memory_analysis), more than the {format_bytes(limit)} of {name}; the plan was predicted to peak at "
        f"{format_bytes(peak.peak)}.{tried} Fix: a smaller --batch-size, a mesh with a larger model axis, or "
        "(with --auto) a smaller --memory-budget"
    )
