"""The presets as `plan --help` lists them, without importing the planner (and so Keras and JAX).

The registry (`planner/_presets.PRESETS`) is the truth: `tests/test_cli_light.py` checks that
this table equals it, row for row and in order, so a preset registered there and not here
fails a test instead of going missing from the help.
"""

from __future__ import annotations

__all__ = ["PRESET_TABLE"]

#: `(how --preset spells it, one-line summary)` for every registered preset, in registry order.
PRESET_TABLE: tuple[tuple[str, str], ...] = (
    ("mlp:LAYER,LAYER,...", "Dense layers in data-flow order, alternating column and row"),
    ("transformer", "attention heads and feed-forward pairs split, Megatron-style"),
    ("conv", "convolution output channels split"),
)
