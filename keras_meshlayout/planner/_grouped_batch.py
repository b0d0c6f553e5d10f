"""A grouped convolution whose channels stay whole: its layer's output split over the batch everywhere.

With the batch split over the batch axis and a grouped (or depthwise) convolution's channels whole
on each device, XLA's SPMD partitioner sums the kernel gradient, itself a convolution grouped over
the batch, over every device of the mesh instead of over the batch's shards: the gradient comes out
as many times too large as the other axes have devices (`kml.GroupedConvWarning`). The planner
splits such a convolution's channels where they divide the model axis (`_convs`); where they do
not (NASNetMobile's 11-channel separable convolutions on a model axis of 4), the layer's output is
laid out over the batch on every mesh axis larger than one: XLA then runs the convolution on the
batch split over the whole mesh, and summing its kernel gradient over every device is summing it
over the batch's shards. XLA carries that split into the layers around it, which the costs do not
follow (`warn_unpredicted`): a correct step whose bytes and peak are estimates. Measured with
jax 0.10.2 on XLA:CPU (`tests/test_grouped_conv.py`):
`fit` on `data=2, model=4` equals one device, where the channels whole on the batch axis alone
had trained the depthwise kernel wrongly by 2e-3 in one step.
"""

from __future__ import annotations

import warnings

from ..core._axes import entry_axes
from ..core._errors import MeshLayoutWarning
from . import _notes
from ._grouped import CONV, conv_kernel
from ._ledger import Ledger, Setting

__all__ = ["grouped_convs_batch_split", "warn_unpredicted"]


def grouped_convs_batch_split(ledger: Ledger, setting: Setting) -> None:
    """Lays out over the batch on every axis the output of each layer whose grouped convolution's
    kernel no strategy split over the model axis (the last strategy but the replicated rest)."""
    trace = setting.trace
    sizes = ((setting.axis, setting.size), (setting.expert_axis, setting.expert_size))
    others = tuple(axis for axis, size in sizes if axis and size > 1)
    if trace is None or not others or setting.batch_axis is None or setting.batch_size <= 1:
        return
    axes = (setting.batch_axis, *others)
    for node in trace.nodes:
        if node.primitive != CONV or node.params.get("feature_group_count", 1) == 1:
            continue
        if trace.from_input(node.inputs[0]):
            continue  # the model's input: XLA cannot split a batch it is given (`tests/test_convs.py`)
        found = conv_kernel(trace, node.inputs[1], node.params["dimension_numbers"].rhs_spec[0], 1)
        if found is None or found[0] not in setting.variables:
            continue
        path = found[0]
        if any(setting.axis in entry_axes(entry) for entry in ledger.axes(path) or ()):
            continue  # its channels split: XLA computes the gradient right
        layer = path.rpartition("/")[0]
        rank = len(trace.shapes[node.outputs[0]])
        note = _notes.conv_grouped_batch(setting.display(layer), setting.display(path), axes)
        ledger.output_split(layer, (axes, *(None,) * (rank - 1)), note)
        if setting.display(layer) not in ledger.batch_everywhere:  # a layer called twice: named once
            ledger.batch_everywhere.append(setting.display(layer))


def warn_unpredicted(layers: list[str]) -> None:
    """Warns that a plan laying out grouped convolutions' outputs over every axis is not predicted."""
    if not layers:
        return
    shown = ", ".join(repr(layer) for layer in layers[:3])
    shown += f" and {len(layers) - 3} more" if len(layers) > 3 else ""
    warnings.warn(
        f"{len(layers)} grouped convolution(s) whose channels do not divide the model axis ({shown}) have "
        "their layer's output split over the batch on every mesh axis, so that XLA computes their kernel "
        "gradients right (kml.GroupedConvWarning). XLA carries that split into the layers around them: "
        "rules.cost does not predict the bytes it sends or the peak (measured on keras.applications "
        "NASNetMobile at 32x32 on 2x4: 17.4 MB a step over data×model unpredicted, the peak 0.87 of the "
        "compiled one). Compile the plan for the real figures (kml.compile_step, or plan --compile), or "
        "train such a model on a mesh whose only axis larger than 1 is the batch's (kml.Mesh(data=8)).",
        MeshLayoutWarning,
        stacklevel=4,
    )
