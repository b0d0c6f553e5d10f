"""What an optimizer's update sends that the plan's prediction does not count, said when planning.

Muon orthogonalises each 2-D update whole (Newton-Schulz iterations, `x @ xᵀ` five times): on a
kernel split over a mesh axis XLA all-reduces or gathers it at every iteration. Measured on
XLA:CPU, 2×4, a Dense pair 64 → 256 → 64 under Muon: split on the long side, ten all-reduces of
64 × 64 over 'model' in the update (245,760 bytes); on the short side, gathers of each kernel
(1.1 MB); over both axes, gathers over 'data' too. The costs do not model it: the planner says so.
"""

from __future__ import annotations

import warnings
from typing import Any

import keras

from ..core._errors import MeshLayoutWarning
from ..core._rules import LayoutRules

__all__ = ["warn_unpredicted_updates"]


def warn_unpredicted_updates(model: keras.Model, rules: LayoutRules, optimizer: Any) -> None:
    """Warns when the plan splits a matrix that Muon orthogonalises (its update's traffic is not costed)."""
    name = optimizer if isinstance(optimizer, str) else type(optimizer).__name__
    if name.lower() != "muon":
        return
    split = [
        v.path
        for v in model.trainable_weights
        if len(v.shape) == 2
        and "embedding" not in v.path.lower()  # Muon's own default: tables take its AdamW update
        and (rule := rules.match(v.path)) is not None
        and any(rule.expand(2))
    ]
    if split:
        warnings.warn(
            f"Muon orthogonalises each matrix's update whole (Newton-Schulz iterations): for the "
            f"{len(split)} kernel(s) this plan splits ({split[0]!r}...), XLA sends collectives in the "
            "optimizer update at every iteration, and holds the iterations' products, that rules.cost "
            "does not count (an MLP on 2x4: 13x its predicted bytes, 3x its predicted peak). Compile "
            "the plan for the real figures: kml.compile_step, or plan --compile.",
            MeshLayoutWarning,
            stacklevel=4,
        )
