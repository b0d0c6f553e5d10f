"""What an optimizer's update holds beyond the gradients, per device, at the end of a training step.

The peak walk (`_peak`) adds it to the step's transient peak: gradients accumulated over steps
(`accumulated_update`), one more array of the gradients' size some optimizers write
(`update_arrays`), and Keras's Muon's orthogonalised matrices (`orthogonalised_update`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np

from .. import _compat
from ..core._axes import Axes, entry_axes
from ..core._memory import optimizer_of

__all__ = ["UPDATE_ARRAYS", "accumulated_update", "muon_matrices", "orthogonalised_update", "update_arrays"]


def accumulated_update(gradients: int, compiler: str, arrays: float) -> int:
    """What an optimizer accumulating gradients adds to the step's peak at its update, per device.

    Keras applies such an update as a conditional (apply the accumulated gradients, or add these to
    them), and XLA writes the conditional's results (parameters, slots and accumulators) to buffers
    of their own beside its operands. `arrays` is the training state over its gradients (each
    variable's parameter, gradient, slots and accumulator: 3 under plain SGD, 5 under Adam).
    Measured with `gradient_accumulation_steps=4` on Dense MLPs (64→2048→2048→10,
    64→4096→4096→10, 256→2048→256→10, 256→4096→256→10; SGD, SGD with momentum, Adam):

    - XLA:CPU (2×4, 8×1): exactly twice the gradients' bytes more temporaries than the same step
      without accumulation, whatever the optimizer;
    - XLA:TPU (v5e, libtpu 0.0.42.1; 2×4, 4×2, 8×1), whose step without accumulation keeps its
      gradients on chip (0 B of temporaries): 2.07–3.0× the gradients in HBM with slots (Adam,
      SGD with momentum), 1.25–1.49× without (plain SGD); counted 2.5× and 1.5×, which puts the
      nine steps measured within 8% of their compiled peaks. The walk counts these in HBM
      whatever stays on chip (`_liveness.transient_peak`).
    """
    if compiler != "tpu":
        return 2 * gradients
    return round(gradients * (1.5 if arrays < 3.5 else 2.5))  # slots or none (its scalars aside)


#: Optimizers whose update XLA:CPU computes through one more array of the gradients' size, written
#: beside them at the update (an intermediate read by two of its assignments: Adadelta's step,
#: Ftrl's new accumulator's root): measured on a Dense MLP 64 → 256 → 256 → 64 on 2×4, 4×2 and 8×1,
#: the compiled temporaries exactly the gradients' bytes above Adam's (0.83 of the compiled peak
#: without it). Every other Keras optimizer measured so adds none.
UPDATE_ARRAYS = {"Adadelta": 1.0, "Ftrl": 1.0}


def update_arrays(optimizer: Any) -> float:
    """`UPDATE_ARRAYS`' figure for `optimizer` (an optimizer, its name or `None`): 0 for the others."""
    if optimizer is None:
        return 0.0
    return UPDATE_ARRAYS.get(type(optimizer_of(optimizer)).__name__, 0.0)


def orthogonalised_update(
    matrices: Mapping[str, tuple[tuple[int, ...], int]],
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    compiler: str = "cpu",
) -> int:
    """What Keras's Muon holds at once in its update of `matrices` (path: shape, itemsize), per device.

    Each matrix's new momentum (its shard), and the Newton-Schulz iterations' buffers: its
    normalised copy and three `s × s` products (`s` its short side, whole), or with its short side
    split, three whole copies of it (gathered). XLA:CPU runs the iterations of the matrices it
    updates on each device's own shards together, and those that send collectives one after
    another: every new momentum, every unsplit matrix's iterations and the largest split one's.
    Measured (jax 0.10.2) on a Dense MLP 64 → 256 → 256 → 64 on 2×4: replicated, 1,638,420 bytes
    live at XLA's peak (this: 1,671,168); split over `model`, 933,904 (950,272). The gradients are
    spent by then: the step's peak is the larger of this and the walk's. Not measured on XLA:TPU:
    0 there (`auto_rules` warns).
    """
    if compiler == "tpu" or not matrices:
        return 0
    momenta, together, apart = 0, 0, 0
    for path, (shape, itemsize) in matrices.items():
        axes = tuple(layouts.get(path, ())) or (None, None)
        short = 1 if shape[0] > shape[1] else 0  # Keras transposes a tall matrix first
        pieces = math.prod(axis_sizes.get(a, 1) for entry in axes for a in entry_axes(entry))
        local = math.prod(shape) * itemsize // pieces
        momenta += local
        if math.prod(axis_sizes.get(a, 1) for a in entry_axes(axes[short])) > 1:
            apart = max(apart, 3 * math.prod(shape) * itemsize)
        elif pieces > 1:
            apart = max(apart, local + 3 * shape[short] ** 2 * itemsize)
        else:
            together += local + 3 * shape[short] ** 2 * itemsize
    return momenta + together + apart


def muon_matrices(model: Any, optimizer: Any) -> dict[str, tuple[tuple[int, ...], int]]:
    """The matrices Keras's Muon orthogonalises, by path: shape and itemsize (none for other optimizers)."""
    if optimizer is None or (isinstance(optimizer, str) and optimizer.lower() != "muon"):
        return {}
    optimizer = optimizer_of(optimizer)
    if not isinstance(optimizer, keras.optimizers.Muon):
        return {}
    return {
        v.path: (tuple(v.shape), np.dtype(v.dtype).itemsize)
        for v in model.trainable_weights
        if _compat.orthogonalised(optimizer, v)
    }
