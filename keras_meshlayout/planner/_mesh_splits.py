"""The meshes `choose_mesh` offers, and where their bytes go: within a slice (ICI) or between (DCN).

Every `data × model` split of the devices, largest data axis first; with mixture-of-experts banks
every `data × expert × model` split too. On a multi-slice target (`tpu-v5e:16x16:slices=2`) the
mesh's first axis, the batch axis, is laid over the slices (`core/_target_mesh.py`); a split whose
batch axis does not divide by them is excluded. (The model axis over the slices is not offered:
`kml.ModelParallel` takes the first axis as the batch axis by default, and a tensor-parallel axis
over the DCN sends each layer's activations between slices.)

A collective over the axis laid over the slices (or over a group of axes holding it) sends part of
its bytes over the data-center network: `report/_collectives.dcn_share` of them, as XLA:TPU
decomposes it; the rest, and every other axis's bytes, go over the ICI. The predicted
communication time is each part over its bandwidth (`dcn_bytes_per_s` per chip; a generation
with no published DCN figure, v4, is costed at its ICI bandwidth), with no overlap.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from ..core._targets import Target
from ..report._collectives import dcn_share
from ._experts import EXPERT_AXIS

__all__ = ["comm_seconds", "factorizations", "float32_across_slices", "network_bytes", "slices_excluded"]


def factorizations(count: int, axes: tuple[str, str], experts: int = 1) -> list[dict[str, int]]:
    """Every `{data: d, model: count // d}`, the largest data axis first; then, for `experts` (the
    experts' common divisor) above 1, every `{data: d, expert: e, model: m}` with `e` of 2 or more
    dividing both `experts` and the devices, the largest data, then expert axis first.

    The batch axis comes first, so on a multi-slice target it is the one laid over the slices; a
    split whose batch axis does not divide by them is listed, and excluded (`slices_excluded`).
    """
    two = [{axes[0]: d, axes[1]: count // d} for d in range(count, 0, -1) if count % d == 0]
    three = [
        {axes[0]: d, EXPERT_AXIS: e, axes[1]: count // (d * e)}
        for d in range(count, 0, -1)
        for e in range(count // d, 1, -1)
        if count % (d * e) == 0 and experts % e == 0
    ]
    return two + three


def slices_excluded(sizes: Mapping[str, int], target: Target | None) -> str | None:
    """Why `sizes` cannot be laid over the target's slices (its first axis does not divide), or `None`."""
    if target is None or target.slices == 1:
        return None
    name, size = next(iter(sizes.items()))
    if size % target.slices == 0:
        return None
    return f"the first axis, {name}={size}, is laid over the {target.slices} slices and does not divide"


def network_bytes(
    by_axis: Mapping[str, float],
    sizes: Mapping[str, int],
    target: Target | None,
    across: Mapping[str, float] | None = None,
) -> tuple[float, float]:
    """Bytes each device sends per step within its slice and between slices: `(ici, dcn)`.

    `by_axis` is keyed as `kml.comm_report` labels collectives (`"data"`, `"data×model"`); of it,
    `across` (`float32_across_slices`) is sent between slices whole, the rest split by `dcn_share`.
    """
    total = float(sum(by_axis.values()))
    if target is None or target.slices == 1:
        return total, 0.0
    over = next(iter(sizes))
    dcn = 0.0
    for label, sent in by_axis.items():
        names = label.split("×")
        if over in names:
            whole = (across or {}).get(label, 0.0)
            dcn += whole + (sent - whole) * dcn_share(math.prod(sizes[name] for name in names), target.slices)
    return total - dcn, dcn


def float32_across_slices(
    cast: Mapping[str, float], sizes: Mapping[str, int], target: Target | None
) -> dict[str, float]:
    """What XLA:TPU sends between slices beyond the bfloat16 gathers `cast` (by label), as it sends
    their share between slices (`dcn_share`) in float32: that share again, per label.

    Measured with libtpu 0.0.42.1 on two v5e 2×2 slices, a fully sharded MLP: its kernels,
    gathered over `data`, went in bfloat16 within each slice and in float32 across (the DCN
    bytes predicted 0.80 and 0.81 of the compiled on `data=2,model=4` and `data=4,model=2`
    while they were counted in bfloat16).
    """
    if target is None or target.slices == 1:
        return {}
    over = next(iter(sizes))
    extra = {}
    for label, sent in cast.items():
        names = label.split("×")
        if over in names:
            extra[label] = sent * dcn_share(math.prod(sizes[name] for name in names), target.slices)
    return extra


def comm_seconds(ici: float, dcn: float, target: Target) -> tuple[float, float]:
    """The seconds of `ici` bytes over the ICI and `dcn` bytes over the data-center network."""
    return ici / target.ici_bytes_per_s, dcn / (target.dcn_bytes_per_s or target.ici_bytes_per_s)
