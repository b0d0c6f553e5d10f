"""What collectives send: the ring formulas, shared by the report and the planner.

`kml.comm_report` applies them to the collectives it reads off compiled HLO
(`_hlo`, `_comm`); the planner (`planner/_costs`) applies them to the
collectives it predicts a layout causes. One formula, so the prediction and
the measurement count the same bytes.
"""

from __future__ import annotations

__all__ = ["dcn_share", "wire_bytes"]


def wire_bytes(kind: str, result_bytes: float, group_size: int) -> float:
    """Bytes sent per device by one collective, by its kind and result size.

    Ring all-reduce sends 2(n-1)/n of its bytes; all-gather (n-1)/n of the
    gathered result; reduce-scatter (n-1)/n of its input, which is n times the
    scattered result; all-to-all (n-1)/n; a collective-permute sends its
    buffer once.

    Example:
        >>> wire_bytes("all-reduce", 1024, 4)
        1536.0
        >>> wire_bytes("reduce-scatter", 256, 4)
        768.0
    """
    n = group_size
    if kind == "collective-permute":
        return float(result_bytes) if n > 1 else 0.0
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2 * (n - 1) / n * result_bytes
    if kind == "reduce-scatter":
        return float((n - 1) * result_bytes)
    return (n - 1) / n * result_bytes  # all-gather, all-to-all


def dcn_share(group_size: int, slices: int) -> float:
    """The share of a collective's bytes (`wire_bytes`) that crosses the data-center network.

    A group of `group_size` devices spread evenly over `slices` slices (`k = group_size / slices`
    in each) is decomposed by XLA:TPU (libtpu 0.0.42; `report/_megascale.py`): an all-reduce of
    `B` bytes is a reduce-scatter within each slice, an all-reduce of its `B / k` shard across the
    slices, an all-gather within each slice. Each device sends `2(k-1)/k·B` within its slice and
    `2(S-1)/S·B/k` between slices, together the ring's `2(n-1)/n·B`; the share between slices is
    `(S-1)/(n-1)`, and so for an all-gather (across the slices, then within) and a reduce-scatter.

    Example:
        >>> dcn_share(4, 2), dcn_share(2, 2), dcn_share(8, 1)
        (0.3333333333333333, 1.0, 0.0)
    """
    if slices <= 1 or group_size <= 1:
        return 0.0
    return (slices - 1) / (group_size - 1)
