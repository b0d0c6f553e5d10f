"""The metric objects given to `compile`: their variables exist before `fit` builds the rest."""

from __future__ import annotations

from typing import Any

__all__ = ["compile_metric_variables"]


def compile_metric_variables(model: Any) -> list[Any]:
    """The variables of the metric objects given to `compile` (built before `fit` builds the rest)."""
    container = getattr(model, "_compile_metrics", None)
    given = [getattr(container, name, None) for name in ("_user_metrics", "_user_weighted_metrics")]
    import keras

    metrics = [m for m in keras.tree.flatten(given) if isinstance(m, keras.metrics.Metric)]
    return [variable for metric in metrics for variable in metric.variables]
