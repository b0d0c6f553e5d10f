"""Where XLA:TPU's bytes differ from their arrays' own: buffers kept on chip, tiled layouts' padding.

Two corrections the peak walk (`_peak.py`) applies on a TPU target, both measured with
libtpu 0.0.42.1 (jax 0.10.2) on TPU v5e from this CPU-only machine:

- **On chip.** XLA:TPU's memory-space assignment places small buffers in the chip's
  vector memory (VMEM) instead of HBM; `memory_analysis()`'s temporaries count only what
  is left in HBM (the toy steps of `tests/test_targets.py` report 0 B).
- **Tiles.** An array in HBM is stored in tiles of 8 × 128 elements over two of its
  dimensions (XLA picks the dimensions that pad least), and no buffer is under 512 B: a
  `(32, 32)` float32 kernel takes 16 KiB, not 4 KiB.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..core._axes import Axes, entry_axes

__all__ = ["ON_CHIP_BUFFER", "ON_CHIP_BYTES", "on_chip", "tiled_bytes", "tiled_state"]

#: The largest buffer XLA:TPU's memory-space assignment was seen to place on chip (TPU v5e), in bytes.
ON_CHIP_BUFFER = 16 * 2**20
#: The most bytes of such buffers it kept on chip at once (of v5e's 128 MiB of vector memory).
ON_CHIP_BYTES = 100 * 2**20
#: The smallest buffer XLA:TPU allocates, in bytes.
_MIN_BUFFER = 512


def on_chip(spans: Iterable[tuple[int, int, int]], end: int) -> list[int]:
    """Per node `0..end`, the live bytes XLA:TPU keeps in on-chip memory rather than in HBM.

    `spans` are the walk's buffers as `(first node, last node, bytes)`. Buffers of at most
    `ON_CHIP_BUFFER` bytes are on chip, up to `ON_CHIP_BYTES` live at once. Measured (TPU
    v5e) on a chain of eight `tanh(x @ w)` layers whose activations live for the backward
    pass: 8 × 8 MiB all on chip (0 B of temporaries), 8 × 16 MiB leave 25 MiB in HBM (this
    model: 28), 8 × 32 MiB 210 MiB (this model, none on chip: 256), 8 × 64 MiB 481 MiB.
    """
    small = [0] * (end + 2)
    for first, final, size in spans:
        if size <= ON_CHIP_BUFFER:
            small[first] += size
            small[final + 1] -= size
    held, live = [], 0
    for when in range(end + 1):
        live += small[when]
        held.append(min(live, ON_CHIP_BYTES))
    return held


def tiled_bytes(shape: Sequence[int], itemsize: int) -> int:
    """The bytes XLA:TPU's layout gives an array of `shape`: two dimensions tiled, 512 B at least.

    XLA chooses which dimension is minor (rounded up to 128 elements) and which second-minor
    (rounded up to 8, or to a power of two below 8); the choice that pads least is taken.
    Measured on parameters: `(32, 32)` float32 16,384 B, `(64, 10)` 8,192 B (64 minor, 10 → 16),
    `(64, 2, 4)` 4,096 B, `(128, 1, 32)` 16,384 B (unpadded).
    """
    dims = [int(d) for d in shape]
    if len(dims) == 0:
        return _MIN_BUFFER
    best = None
    for minor in range(len(dims)):
        rest = dims[:minor] + dims[minor + 1 :]
        seconds = range(len(rest)) if rest else [None]
        for second in seconds:
            padded = -(-dims[minor] // 128) * 128
            if second is not None:
                padded *= _rows(rest[second]) * math.prod(d for i, d in enumerate(rest) if i != second)
            best = padded if best is None else min(best, padded)
    return max(best * itemsize, _MIN_BUFFER)


def _rows(size: int) -> int:
    return -(-size // 8) * 8 if size >= 8 else 1 << max(size - 1, 0).bit_length()


def tiled_state(
    variables: Iterable[Any], layouts: Mapping[str, Axes], axis_sizes: Mapping[str, int]
) -> float:
    """The variables' per-device shards in XLA:TPU's tiles, ÷ their own bytes (1.0: no padding).

    The optimizer's slots have their variables' shapes, so the training state pads alike.
    """
    raw = tiled = 0
    for variable in variables:
        shard = list(variable.shape)
        for dim, entry in enumerate(layouts.get(variable.path, ())[: len(shard)]):
            pieces = math.prod(axis_sizes.get(a, 1) for a in entry_axes(entry))
            shard[dim] = -(-shard[dim] // max(pieces, 1))
        itemsize = np.dtype(variable.dtype).itemsize
        raw += math.prod(shard) * itemsize
        tiled += tiled_bytes(shard, itemsize)
    return tiled / raw if raw else 1.0
