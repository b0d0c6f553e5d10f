"""How much of a memory budget a plan's predicted peak leaves free, for the prediction's error.

`peak_headroom(compiler, convnet)` is what `kml.auto_rules(memory_budget=...)` keeps free of the
budget (`Headroom`): a share, and on XLA:TPU for a convnet a number of bytes at least, each the
worst miss measured of the walk (`_peak`) against the compiled peak on that kind of step.
"""

from __future__ import annotations

import dataclasses
import math

from ..core._format import format_bytes

__all__ = [
    "CONV_PEAK_HEADROOM",
    "PEAK_HEADROOM",
    "TPU_CONV_PEAK_HEADROOM",
    "TPU_CONV_SPARE_BYTES",
    "TPU_PEAK_HEADROOM",
    "Headroom",
    "peak_headroom",
]

#: The share of the budget the predicted peak leaves free: the prediction is within a few percent of
#: XLA's compiled peak on dense models (docs/status.md), so a plan said to fit stays under the budget.
PEAK_HEADROOM = 0.05
#: The same on a TPU target: the walk follows XLA:TPU's buffers to 0.87-1.06 of its compiled peak at
#: Llama-3 and Mixtral widths (docs/benchmarks.md, `benchmarks/targets.py`), under it where XLA:TPU's
#: heap fragments (0.87: the Llama-3 8 B fully sharded on v5e 16x16); over long sequences, where a few
#: attention-score buffers of hundreds of MiB a device fill the step, its heap packs the bytes live at
#: once loosely: a 2-layer Gemma at 16 x 2,048 tokens on v5e 2x4 is predicted at 0.734 of its compiled
#: peak, XLA:TPU's heap 1.237 of its 943 MiB live at once, which the walk's 966 MiB follows (docs/status.md,
#: "Decoders over longer sequences"). So a plan said to fit keeps 27% (15% until 2026-12-07). One-layer
#: decoders over 512-1,024 tokens (0.645-0.773) are not covered; `plan_and_compile` confirms a plan by
#: compiling it.
TPU_PEAK_HEADROOM = 0.27
#: The same for a convnet's step (`_peak.is_convnet`), on XLA:CPU: keras.applications convnets at
#: 224 x 224 (16 images on 2x4, `benchmarks/convnet_peaks.py`) were predicted at 0.76 (ResNet50) to
#: 1.25 (ConvNeXtTiny) of the compiled peak: XLA:CPU keeps transposed copies of activations for the
#: kernel gradients, and max pooling's indices, from the forward pass to the backward.
CONV_PEAK_HEADROOM = 0.30
#: And on XLA:TPU, 0.64 (ConvNeXtTiny) to 1.10 (EfficientNetB0) at 224 x 224: its convolutions' own
#: layouts (the image kept in bfloat16 with the batch in the lanes) and a loosely packed heap.
TPU_CONV_PEAK_HEADROOM = 0.40
#: What a convnet's plan keeps free on XLA:TPU however small its peak: at 32 x 32 XLA:TPU left up to
#: 59 MiB of temporaries in HBM that the walk keeps on chip (EfficientNetB0: 16.5 MB predicted, 78.6 MB
#: compiled; the memory-space assignment's 16 KiB slots, and its 5 x 5 depthwise convolutions' buffers).
TPU_CONV_SPARE_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Headroom:
    """What of a memory budget a plan's predicted peak leaves free, for the prediction's error.

    Attributes:
        share: The share of the budget kept free.
        spare: The bytes kept free at least.
    """

    share: float
    spare: int = 0

    def usable(self, budget: int) -> int:
        """The most a predicted peak may be within `budget`."""
        return min(int(budget * (1 - self.share)), budget - self.spare)

    def needed(self, peak: int) -> int:
        """The least budget a predicted `peak` fits (`MemoryBudgetError.smallest_bytes`)."""
        return max(math.ceil(peak / (1 - self.share)), peak + self.spare)

    def __str__(self) -> str:
        spare = f" (at least {format_bytes(self.spare)})" if self.spare else ""
        return f"{self.share:.0%} headroom{spare}"


def peak_headroom(compiler: str, convnet: bool = False) -> Headroom:
    """What of the budget a plan's predicted peak leaves free on `compiler` (`_peak.compiler_of`), for
    a convnet's step (`_peak.is_convnet`) or another's."""
    if convnet:
        if compiler == "tpu":
            return Headroom(TPU_CONV_PEAK_HEADROOM, TPU_CONV_SPARE_BYTES)
        return Headroom(CONV_PEAK_HEADROOM)
    return Headroom(TPU_PEAK_HEADROOM if compiler == "tpu" else PEAK_HEADROOM)
