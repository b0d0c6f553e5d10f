"""Every error and warning that keras_meshlayout raises.

All errors derive from `MeshLayoutError`, itself a `ValueError`, so one
`except kml.MeshLayoutError` catches anything this package rejects. The
subclasses exist for the cases a caller may want to tell apart. Each message
says what was received, why it is wrong and how to fix it.
"""

from __future__ import annotations

__all__ = [
    "MeshLayoutError",
    "InvalidOptionError",
    "InvalidMeshError",
    "InvalidRuleError",
    "RankMismatchError",
    "IndivisibleShapeError",
    "IndivisibleBatchError",
    "UnsupportedBackendError",
    "MemoryBudgetError",
    "CheckpointError",
    "DevicesAlreadyInitializedError",
    "MeshLayoutWarning",
    "IndivisibleShapeWarning",
    "UnmatchedRuleWarning",
]


class MeshLayoutError(ValueError):
    """Base class of every error raised by keras_meshlayout."""


class InvalidOptionError(MeshLayoutError):
    """An option has a value outside its documented range.

    Raised for `on_indivisible` other than `"replicate"` or `"error"`, a
    negative or non-integer `replicate_below`, or a device count for
    `emulate_devices` that is not a positive integer.
    """


class InvalidMeshError(MeshLayoutError):
    """A mesh specification cannot describe the devices at hand.

    Raised for a malformed spec string, a non-positive axis size, more than one
    inferred (`-1`) axis, repeated axis names, an axis-size product that differs
    from the device count, or a batch axis that is not an axis of the mesh.
    """


class InvalidRuleError(MeshLayoutError):
    """A layout rule is malformed or does not fit the mesh.

    Raised for a pattern that is not a valid regular expression, a layout entry
    that is neither a mesh-axis name nor `None`, a mesh axis used twice in one
    layout, a repeated pattern, or an axis name the mesh does not have.
    """


class RankMismatchError(MeshLayoutError):
    """A rule's layout has a different rank from the variable it matched.

    A layout needs exactly one entry per tensor dimension. This is usually a
    pattern that is broader than intended (for instance `.*dense.*` matching a
    rank-1 bias as well as a rank-2 kernel).
    """


class IndivisibleShapeError(MeshLayoutError):
    """A sharded dimension does not divide evenly by its mesh axis size.

    Raised only with `on_indivisible="error"`; the default policy replicates the
    offending dimension and records why.
    """


class IndivisibleBatchError(MeshLayoutError):
    """The global batch size does not divide evenly by the batch axis size."""


class MemoryBudgetError(MeshLayoutError):
    """A plan keeps too much replicated, or its training state does not fit a device."""


class CheckpointError(MeshLayoutError):
    """A checkpoint is missing, half-written, corrupt, or made for another model.

    Raised before anything is loaded: the model in memory is left as it was.
    """


class UnsupportedBackendError(MeshLayoutError):
    """Keras runs on a backend other than JAX."""


class DevicesAlreadyInitializedError(MeshLayoutError):
    """Device emulation was requested after JAX had started its backends."""


class MeshLayoutWarning(UserWarning):
    """Base class of every warning issued by keras_meshlayout."""


class IndivisibleShapeWarning(MeshLayoutWarning):
    """A dimension was replicated because it does not divide by its mesh axis."""


class UnmatchedRuleWarning(MeshLayoutWarning):
    """A rule matched no variable of the model: most likely a typo."""
