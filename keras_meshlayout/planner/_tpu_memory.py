"""Where XLA:TPU's bytes differ from their arrays' own: buffers kept on chip, tiled layouts' padding.

Three corrections the peak walk (`_peak.py`) applies on a TPU target, measured with
libtpu 0.0.42.1 (jax 0.10.2) on TPU v5e (the first two) and v5p (the third) from this
CPU-only machine; each generation's figures are a `Chip` (`_peak.chip_of`):

- **On chip.** XLA:TPU's memory-space assignment places buffers in the chip's vector
  memory (VMEM) instead of HBM where they fit; `memory_analysis()`'s temporaries count
  only what is left in HBM (the toy steps of `tests/test_targets.py` report 0 B).
- **Tiles.** An array in HBM is stored in tiles of 8 × 128 elements over two of its
  dimensions (XLA picks the dimensions that pad least), and no buffer is under 512 B: a
  `(32, 32)` float32 kernel takes 16 KiB, not 4 KiB.
- **Alignment.** On v5p each temporary buffer of the program is aligned to 16 KiB in HBM,
  the small ones too (the tuples of the memory-space assignment's asynchronous copies):
  `aligned_bytes`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..core._axes import Axes, entry_axes
from ..core._errors import MeshLayoutWarning

__all__ = [
    "DEFAULT_CHIP",
    "KEPT_SHARE",
    "KEPT_UP_TO",
    "ON_CHIP_BYTES",
    "VMEM_BYTES",
    "Chip",
    "aligned_bytes",
    "feature_minor_bytes",
    "in_hbm",
    "tiled_bytes",
    "tiled_state",
    "warn_convnet_peak",
]

#: The most temporaries XLA:TPU's memory-space assignment was seen to keep all on chip (TPU v5e);
#: each generation's figure is its `Generation.on_chip_bytes` (0 on v5p).
ON_CHIP_BYTES = 64 * 2**20
#: The vector memory XLA:TPU's memory-space assignment allocates buffers in on TPU v5e: its buffer
#: assignment's `vmem` space came to 112 MiB (of the chip's 128) on every step measured.
VMEM_BYTES = 112 * 2**20
#: The smallest buffer XLA:TPU allocates, in bytes.
_MIN_BUFFER = 512
#: Aligned buffers per array the update of a trainable variable reads (its parameter, its
#: gradient and each optimizer slot), fitted on TPU v5p (see `aligned_bytes`).
ALIGNED_PER_ARRAY = 4.75


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU generation's figures the walk uses (`core._targets.Generation`'s).

    Attributes:
        on_chip: The largest transient peak XLA:TPU keeps all on chip (`in_hbm`).
        alignment: The HBM alignment of each temporary buffer where it costs bytes, else 0
            (`aligned_bytes`).
        vmem: The vector memory XLA:TPU's memory-space assignment holds short-lived buffers in
            (`_liveness._short_lived`); 0 where it was not seen to hold any (v5p).
    """

    on_chip: int = ON_CHIP_BYTES
    alignment: int = 0
    vmem: int = VMEM_BYTES


#: The figures of a target without its own (v5e's), and of the walk's callers that give none.
DEFAULT_CHIP = Chip()


#: What of a transient peak over `Chip.on_chip` XLA:TPU still keeps on chip at least, as a share of
#: `on_chip` (40 MiB on v5e), and up to which multiple of `on_chip` it does (192 MiB on v5e): `in_hbm`.
#: Measured kept up to a 187 MiB transient, none kept from 195 MiB (the cut was 176 MiB until
#: 2026-12-07: a 4-layer Gemma at 16 x 512 tokens, 187 MiB, was predicted at 1.201 of its compiled peak,
#: 0.978 since; a 2-layer Llama 3 at 10 x 1,024 tokens, 180 MiB, 1.326 -> 1.081).
KEPT_SHARE = 0.625
KEPT_UP_TO = 3.0


def in_hbm(transient: int, on_chip: int = ON_CHIP_BYTES, *, gradients: int = 0, convnet: bool = False) -> int:
    """What of the walk's `transient` peak XLA:TPU holds in HBM: none of it up to `on_chip`; beyond, up
    to `KEPT_UP_TO` times `on_chip`, all but `KEPT_SHARE` of `on_chip` or, just over `on_chip`, all but
    what is left of `on_chip` once the excess is taken from it again; all of it beyond.

    What it keeps of a larger one is not the step's `gradients` (their bytes per device), which the
    optimizer applies from HBM, and nothing of a convnet's step (`convnet`).

    XLA:TPU's memory-space assignment places buffers in the chip's vector memory (VMEM,
    128 MiB on v5e) where they fit; `memory_analysis()`'s temporaries count only HBM.
    Measured (TPU v5e) on a chain of eight `tanh(x @ w)` layers whose activations live for
    the backward pass: 8 × 8 MiB all on chip (0 B of temporaries), 8 × 16 MiB leave 25 MiB in
    HBM (this model: 128), 8 × 32 MiB 210 MiB (256), 8 × 64 MiB 481 MiB (512); the toy steps
    of `tests/test_targets.py` report 0 B. On a Llama-3-style block (hidden 1024, 8 × 1024
    tokens, data=2, model=4), whose 304 MiB include a 128 MiB logits buffer, it kept its
    smaller activations (4-16 MiB) in HBM too (292 MiB of temporaries).

    Between, on 2-layer keras-hub decoders at 4 to 16 × 1,024 tokens on `data=2,model=4`
    (`tests/test_targets.py`), XLA:TPU kept 42-67 MiB of the walk's transient on chip up to 180 MiB
    of it (Gemma 70 → 61 MiB, 99 → 46, 132 → 54, 164 → 42; Llama 3 76 → 67, 112 → 51, 145 → 57,
    180 → 53; a convnet of 128 × 128 images 157 → 37) and none from 195 MiB on (Gemma 195 and 257,
    Llama 3 284: its compiled temporaries are above the walk's transient there). Predicted ÷
    compiled peak with all of it counted in HBM above `on_chip`: 1.30-3.12; with 40 MiB kept up to
    176 MiB (192 MiB since, `KEPT_UP_TO`): 0.98-1.73, the highest just over `on_chip`, where XLA:TPU
    keeps nearly all (Gemma at 4 × 1,024 tokens, Llama 3 1.60, Llama 3 under `enable_lora(4)` 2.32
    at 67 MiB; with what is kept falling from `on_chip` to 40 MiB as the transient grows from
    `on_chip` to 88 MiB: 1.10, 1.34, 1.10). It kept nothing of a wide MLP's 64.1 MiB transient, all
    its gradients (two 64 MiB kernels' on `data=8`;
    `test_the_peak_follows_xla_tpu_where_its_temporaries_are_in_hbm`: 0.915 with 40 MiB kept,
    0.992 without), nor of Xception's at 71 × 71 (0.543 with, 0.755 without: a convnet's
    temporaries on XLA:TPU include the memory-space assignment's slots, `warn_convnet_peak`), while
    it kept 37 MiB of a 128 × 128 convnet's 157 (0.975 with, 1.31 without): convnets are left out.

    `on_chip` is the target generation's `Generation.on_chip_bytes`: on TPU v5p the same toy
    steps report 1.4-7.1 MiB of temporaries (their activations are in HBM), so it is 0 there.
    """
    if transient <= on_chip:
        return 0
    if convnet or transient > KEPT_UP_TO * on_chip:
        return transient
    kept = max(round(KEPT_SHARE * on_chip), 2 * on_chip - transient)
    return transient - min(kept, max(0, transient - gradients))


def aligned_bytes(variables: int, arrays: float, alignment: int) -> int:
    """What aligning each temporary buffer to `alignment` bytes in HBM adds to a training step.

    `variables` trainable variables, each updated from `arrays` arrays of its own (the
    parameter, the gradient, each optimizer slot: 4 under Adam, 2 under SGD). On TPU v5p
    (alignment 16 KiB) the step's temporaries less the same step's compiled with 1 KiB
    (`LIBTPU_INIT_ARGS=--xla_jf_program_hbm_alignment_in_kib=1`) came to 17.1-19.2 × 16 KiB per
    variable under Adam on MLPs of 4 and 12 variables, 18.2 on a decoder block (19), 24.1 on a
    keras-hub Llama 3 layer (12) and 9.2 under SGD (12): `ALIGNED_PER_ARRAY` of them per array.
    Most are the tuples of the memory-space assignment's asynchronous copies (32 B each, a 16 KiB
    slot each: 182 of the decoder's 207 temporaries in HBM).
    """
    return round(variables * arrays * ALIGNED_PER_ARRAY) * alignment


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


def feature_minor_bytes(shape: Sequence[int], itemsize: int, batch: int, feature: int) -> int:
    """The bytes of a convolution's activation of `shape` in XLA:TPU's layout: `feature` minor, `batch` rows.

    XLA:TPU lays a convolution's result out with its features in the 128 lanes and its batch
    dimension second-minor, however few features there are: `f32[8,128,128,8]` takes 64 MiB
    (16 × its 4 MiB), `bf16[8,64,64,16]` 8 MiB (measured on TPU v5e, libtpu 0.0.42.1).
    """
    dims = [int(d) for d in shape]
    if len(dims) < 2 or batch == feature:
        return tiled_bytes(dims, itemsize)
    rest = math.prod(d for i, d in enumerate(dims) if i not in (batch, feature))
    padded = -(-dims[feature] // 128) * 128 * _rows(dims[batch]) * rest
    return max(padded * itemsize, _MIN_BUFFER)


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


def warn_convnet_peak() -> None:
    """Warns that a convnet's peak on XLA:TPU is an estimate (`_peak.is_convnet`), with the misses measured.

    keras.applications convnets, 16 images on v5e 2x4, predicted ÷ compiled peak (libtpu 0.0.42.1):
    at 224 x 224 ResNet50 0.72, DenseNet121 0.72, ConvNeXtTiny 0.64, Xception 0.83, MobileNetV2 1.03,
    EfficientNetB0 1.10 (`benchmarks/convnet_peaks.py`); at 32 x 32 EfficientNetB0 0.21, ConvNeXtTiny
    0.70, MobileNetV2 1.00. At 224 x 224 XLA:TPU keeps the image in bfloat16 with the batch in the
    128 lanes for the first convolution's kernel gradient (49 MiB for 8 images), and its heap is
    loosely packed (ResNet50: 482 MB live at once in 676 MB of temporaries); at 32 x 32 it leaves
    the memory-space assignment's small buffers in 16 KiB slots in HBM where the walk keeps the
    step on chip.
    """
    warnings.warn(
        "XLA:TPU's peak of a convnet's step is an estimate: rules.cost.peak_bytes was 0.64-1.10 of the "
        "compiled peak on keras.applications convnets at 224x224 (v5e 2x4: ConvNeXtTiny 0.64, ResNet50 and "
        "DenseNet121 0.72, Xception 0.83, MobileNetV2 1.03, EfficientNetB0 1.10) and down to 0.21 at 32x32 "
        "(EfficientNetB0). "
        "A budget plan keeps 40% of the budget, and 64 MiB at least, to spare. The bytes sent are "
        "predicted. Compile the plan for the real peak: kml.compile_step, or plan --compile.",
        MeshLayoutWarning,
        stacklevel=5,
    )
