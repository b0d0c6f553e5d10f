"""`save_weights` in a multi-process run: every process calls it, process 0 writes."""

from __future__ import annotations

import os
from typing import Any

import keras
import numpy as np

from ..core._errors import MeshLayoutError

__all__ = ["save_weights"]


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
