"""The random state of a checkpoint: the model's seed generators and Keras's global one."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._errors import CheckpointError, MeshLayoutWarning


def seed_states(model: keras.Model) -> list[keras.Variable]:
    """The state variables of the model's seed generators (`model.variables` beyond its weights)."""
    weights = {id(v) for v in model.weights}
    return [v for v in model.variables if id(v) not in weights and tuple(v.shape) == (2,)]


def _host_value(variable: Any) -> list[int]:
    value = variable.value if hasattr(variable, "value") else variable
    if not getattr(value, "is_fully_addressable", True):
        value = value.addressable_data(0)  # a seed state is replicated: every device holds all of it
    return [int(x) for x in np.asarray(value).reshape(-1)]


def _global_seed_generator(create: bool = False) -> Any:
    """Keras's process-wide seed generator (used by random ops given no seed), if there is one."""
    return _compat.global_seed_generator(create)


def rng_state(model: keras.Model) -> dict[str, Any]:
    generator = _global_seed_generator()
    return {
        "seed_generators": [{"path": v.path, "state": _host_value(v)} for v in seed_states(model)],
        "global": None if generator is None else _host_value(generator.state),
    }


def seed_states_to_restore(
    model: keras.Model, manifest: Mapping[str, Any], source: Path, resume: bool
) -> list[tuple[keras.Variable, list[int]]]:
    """(variable, saved state) pairs, matched in order; checked before anything is loaded."""
    states = seed_states(model)
    rng = manifest.get("rng")
    if rng is None:
        if resume and states:
            warnings.warn(
                f"Checkpoint {source} holds no random state (written by an earlier version of "
                f"keras_meshlayout), and the model has {len(states)} random seed generator(s), e.g. "
                f"{states[0].path!r}: training resumes, but its random numbers (dropout masks) are not "
                "those of the interrupted run. Backups written from now on hold the random state.",
                MeshLayoutWarning,
                stacklevel=4,
            )
        return []
    saved = rng["seed_generators"]
    if len(saved) == len(states):
        return [(v, entry["state"]) for v, entry in zip(states, saved, strict=True)]
    if resume:
        raise CheckpointError(
            f"Checkpoint {source} holds the state of {len(saved)} random seed generator(s), and the model "
            f"has {len(states)} ({', '.join(repr(v.path) for v in states[:3]) or 'none'}): it has other "
            "random layers (Dropout, GaussianNoise, ...) than the model that was backed up, so training "
            "could not resume exactly. Nothing was loaded; the model is unchanged. Fix: build the same "
            "model, or start from scratch in an empty backup directory."
        )
    return []  # another model's random layers: the model keeps its own random state


def restore_global_seed(manifest: Mapping[str, Any]) -> None:
    state = (manifest.get("rng") or {}).get("global")
    if state is not None:
        generator = _global_seed_generator(create=True)
        generator.state.assign(np.asarray(state, dtype=generator.state.dtype))
