"""What collectives send: the ring formulas, shared by the report and the planner.

`kml.comm_report` applies them to the collectives it reads off compiled HLO
(`_hlo`, `_comm`); the planner (`planner/_costs`) applies them to the
collectives it predicts a layout causes. One formula, so the prediction and
the measurement count the same bytes.
"""

from __future__ import annotations

__all__ = ["wire_bytes"]


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
