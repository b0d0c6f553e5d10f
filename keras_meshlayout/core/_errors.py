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
    "InvalidTargetError",
    "MissingLibtpuError",
    "InvalidRuleError",
    "RankMismatchError",
    "IndivisibleShapeError",
    "IndivisibleBatchError",
    "UnsupportedBackendError",
    "MemoryBudgetError",
    "HloFormatError",
    "LayoutMismatchError",
    "LayoutMismatchWarning",
    "CheckpointError",
    "DevicesAlreadyInitializedError",
    "MeshLayoutWarning",
    "IndivisibleShapeWarning",
    "UnmatchedRuleWarning",
    "GroupedConvWarning",
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


class InvalidTargetError(InvalidMeshError):
    """A target (`tpu-v5e:16x16`) names no TPU machine, or does not fit the mesh asked of it.

    The message is one line: what was received, why it is not a target, and the valid
    forms (`tpu-v5e:RxC`, `tpu-v6e:RxC`, `tpu-v4:AxBxC`, `tpu-v5p:AxBxC`, each optionally
    `:slices=N`). A mesh on a target must use all of its chips: `kml.Mesh(data=4, model=64,
    target="tpu-v5e:16x16")`, not 4 x 32. A subclass of `InvalidMeshError`, so code that
    catches bad meshes catches bad targets too.
    """


class MissingLibtpuError(MeshLayoutError):
    """A TPU target's devices were asked for, and libtpu is not installed.

    The devices of a TPU you do not have (`jax.experimental.topologies`) come from libtpu,
    which compiles for TPUs on any machine. Install the version that matches the installed
    jax, from a keras_meshlayout checkout `pip install ".[tpu-aot]"`, or `pip install
    "libtpu==0.0.42.*"` for jax 0.10.2 (`pip install "jax[tpu]==VERSION"` pins it for
    others). Without libtpu a mesh of any size still plans, without devices and without a
    compile: `kml.Mesh(jax.sharding.AbstractMesh((16, 16), ("data", "model")))`.
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
    """A plan keeps too much replicated, or its training state does not fit a device.

    Attributes:
        smallest_bytes: From `kml.auto_rules(memory_budget=...)`, the per-device
            bytes its smallest plan needs (a budget that fits it); `None` from
            `plan.check()`.
        smallest_peak_bytes: From `kml.auto_rules`, that plan's predicted peak (the
            budget less the headroom kept for the prediction's error); else `None`.
    """

    def __init__(
        self, message: str, *, smallest_bytes: int | None = None, smallest_peak_bytes: int | None = None
    ) -> None:
        super().__init__(message)
        self.smallest_bytes = smallest_bytes
        self.smallest_peak_bytes = smallest_peak_bytes


class CheckpointError(MeshLayoutError):
    """A checkpoint is missing, half-written, corrupt, or made for another model.

    Raised before anything is loaded: the model in memory is left as it was.
    Also raised when a save cannot be written (a full disk, any `OSError`): the
    message names the file, and the previous checkpoint is left intact.
    """


class HloFormatError(MeshLayoutError):
    """Compiled HLO text holds something the communication report cannot read.

    Raised by `kml.comm_report` (and `parse_collectives`) for a `replica_groups` attribute in a
    format it does not know, or an element type whose size it does not know, instead of
    guessing: the message quotes the text and names the JAX version to report it with.
    """


class LayoutMismatchError(MeshLayoutError):
    """A model's variables do not live where the distribution would put them.

    Raised by `fit`, `evaluate` and `predict` under a `kml.ModelParallel`, before any compute,
    when variables sit on devices outside the mesh: the model was built (or its weights
    loaded) before the distribution was set. Build it under the distribution instead.
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


class LayoutMismatchWarning(MeshLayoutWarning):
    """The plan found variables whose real layout differs from what the rules give.

    Issued by `dist.plan(model)` for a model whose variables are allocated: the plan shows
    what each variable really holds, and this warning (also a line under the plan's table)
    names the cause (built outside the distribution, or the distribution set after the
    build) and the fix.
    """


class GroupedConvWarning(MeshLayoutWarning):
    """The model has grouped convolutions and the mesh splits more than the batch.

    Issued by `dist.plan(model)`, and by `model.fit` when it starts, for Keras
    `DepthwiseConv1D`/`DepthwiseConv2D`, `SeparableConv1D`/`SeparableConv2D` and
    `Conv1D`/`Conv2D`/`Conv3D` with `groups > 1` (and custom layers, below) when the batch
    is split and a mesh axis other than the batch axis is larger than 1 (over a batch axis
    of 1 nothing is summed: exact), except those `kml.auto_rules`
    split over their channels together with their input (a convolution unit of the
    planner), which `replicate_below` leaves split (`Rule.keep_split`).
    A rule of your own that splits such a kernel still gets the warning: a
    kernel split with its input whole gets the same wrong gradient (measured).

    The kernel gradient of a grouped convolution (`feature_group_count > 1`) is
    itself a convolution with `batch_group_count > 1`, and XLA's SPMD
    partitioner sums its per-shard results over every device of the mesh
    instead of over the batch shards only: the kernel gradient comes out N times
    too large, N being the product of the sizes of the other mesh axes
    (measured on XLA:CPU with jax 0.10.2: 4x on data=2 x model=4, 2x on
    data=4 x model=2, exact on data=8). Nothing fails; the model trains wrongly.

    Fix: a mesh whose only axis larger than 1 is the batch axis (for instance
    `kml.Mesh(data=8)`), or split each grouped convolution's channels over the
    other axes (its input, through an `/output` rule on the layer feeding it,
    and its kernel's channel dimension), which makes the gradient exact.

    A custom layer that calls `keras.ops.depthwise_conv` or
    `jax.lax.conv_general_dilated(..., feature_group_count=...)` itself (keras-hub's
    Qwen3.5 gated delta-net is one) is found by tracing the model's forward pass on
    its input spec, abstractly, once per model; a model that cannot be traced so (a
    subclassed model never called) gets no warning for such layers.
    """
