"""The per-device peak of a training step: state, then what the traced step keeps alive at its worst.

`peak_memory(trace, layouts, axis_sizes, ...)` walks the traced training step
(`_trace.trace_step`: forward, then backward, as JAX emits them) once:

1. **Per-device shapes** (`_propagate.Specs`): each value's layout, propagated from the variables'
   layouts and the batch (split over the batch axis on its first dimension) through the operations,
   with the gathered copies of batch-split weights and the buffers one operation writes while it runs.
2. **What is materialised** (`_fusion`). A value is a buffer unless it is computed by an
   element-wise operation (a cast, a broadcast, a reshape included) whose every
   reader is also element-wise or a reduction: XLA fuses those into their
   readers, which then keep the fused value's own inputs alive instead.
3. **Liveness** (`_liveness.transient_peak`). In program order, a buffer lives from the operation that
   writes it to its last reader; the step's outputs (the gradients) live to
   the end. The largest sum over the program is the step's transient peak:
   activations saved for the backward pass, temporaries (attention scores,
   dequantised int8 kernels, a convnet's feature maps, recomputed remat
   blocks) and the gradients written so far. Over a batch axis of more than
   one device, the gradients' sum (one combined all-reduce) is a second copy
   of them at the end of the backward pass.

The peak per device is then the state without its gradients (parameters,
non-trainable variables, optimizer slots: `core._memory`), the batch's shard,
and the transient peak. Nothing is specific to an architecture: everything is
read off the traced computation.

On a TPU target (`compiler_of(mesh) == "tpu"`) the walk follows what XLA:TPU's buffer assignment
was measured to do instead (libtpu 0.0.42.1): each gradient is applied by the optimizer as soon
as it is written, so the gradients are neither held to the end nor summed into a second copy,
and partial sums are all-reduced in place; a result read only by a transpose is written once, in
the transposed layout; an element-wise result takes the buffer of an operand that dies there; an
element-wise result read only by matmuls is computed inside them, and a cheap one is recomputed
in each of its readers (`_fusion.fused_on_tpu`), an expensive one too where the buffers it is
computed from outlive it (`_liveness._recomputed_on_tpu`); the input a windowed kernel
gradient's loop reads is kept in bfloat16 from the forward pass
(`_windowed_copies.windowed_operands`). A transient peak small enough to stay in the chip's vector
memory (the generation's `on_chip_bytes`, `chip_of`; none on v5p) is not counted in HBM, the
parameters, slots and batch take XLA:TPU's tiled layouts, and on v5p each temporary buffer its
16 KiB alignment (`_tpu_memory`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .. import _compat
from ..core._axes import Axes, entry_axes
from ..core._memory import accumulates
from ..core._mesh import jax_device_grid
from ..core._targets import GENERATIONS, Generation
from . import _notes, _tpu_memory
from ._at_peak import PeakBuffer
from ._convs import CONV_LAYERS
from ._grouped import CONV, conv_kernel
from ._liveness import live_code, transient_peak
from ._quantized import stored_int4
from ._trace import Trace, trace_step
from ._update_memory import accumulated_update, muon_matrices, orthogonalised_update, update_arrays

__all__ = [
    "PeakMemory",
    "PeakWalk",
    "chip_of",
    "compiler_of",
    "generation_of",
    "is_convnet",
    "peak_memory",
    "plan_peak",
]


@dataclasses.dataclass(frozen=True)
class PeakMemory:
    """The predicted per-device peak of one training step.

    Attributes:
        state: Parameters, non-trainable variables, gradients and optimizer slots.
        gradients: The gradients' share of `state`.
        batch: The batch's shard on each device.
        transient: The most the step holds at once beyond its parameters and slots:
            activations, temporaries and the gradients written so far.
        held: Whether every gradient is held until the update (XLA:CPU); on XLA:TPU each is
            applied as it is written, so the peak may hold fewer than all of them.
        tiles: What XLA:TPU's tiled layouts add to the parameters and slots (`_tpu_memory`); 0
            on XLA:CPU.
        aligned: What aligning the step's temporary buffers in HBM adds
            (`_tpu_memory.aligned_bytes`); 0 on XLA:CPU and where the target aligns none.
        buffers: The largest buffers live at the transient peak, each named after the JAX
            operation that writes it (`_at_peak.PeakBuffer`): what fills the memory.
    """

    state: int
    gradients: int
    batch: int
    transient: int
    held: bool = True
    tiles: int = 0
    aligned: int = 0
    buffers: tuple[PeakBuffer, ...] = ()

    @property
    def non_state(self) -> int:
        """What the peak holds beyond the training state: the batch, activations and temporaries."""
        return self.peak - self.state

    @property
    def resident(self) -> int:
        """What the step holds from its start to its end: the state, and on XLA:TPU, where each
        gradient is applied as it is written, the state less its gradients, in XLA:TPU's tiles."""
        return self.state + self.tiles + self.aligned - (0 if self.held else self.gradients)

    @property
    def working(self) -> int:
        """The rest of the peak, never negative: the batch, activations and temporaries (on XLA:TPU
        the gradients written so far too). `non_state`, the search's reserve, is the peak less the
        whole state, which XLA:TPU never holds at once."""
        return self.peak - self.resident

    @property
    def peak(self) -> int:
        """State without gradients, the batch, and the transient peak (gradients included)."""
        transient = max(self.transient, self.gradients) if self.held else self.transient
        return self.state - self.gradients + self.tiles + self.aligned + self.batch + transient


class PeakWalk:
    """One traced training step, walked again for each set of layouts the search tries."""

    def __init__(
        self,
        model: Any,
        trace: Trace,
        axis_sizes: Mapping[str, int],
        batch_axis: str | None,
        compiler: str = "cpu",
        chip: _tpu_memory.Chip = _tpu_memory.DEFAULT_CHIP,
        accumulated: bool = False,
        orthogonalised: Mapping[str, tuple[tuple[int, ...], int]] | None = None,
        update_arrays: float = 0.0,
    ) -> None:
        self.trace = live_code(trace)
        self.convnet = is_convnet(trace)
        self.update_arrays = update_arrays
        self.orthogonalised = dict(orthogonalised or {})
        self.axis_sizes = dict(axis_sizes)
        self.batch_axis = batch_axis
        self.compiler = compiler
        self.chip = chip
        self.trainable = {v.path: v for v in model.trainable_variables}
        self.variables = tuple(model.variables)
        self.accumulated = accumulated

    @classmethod
    def of(
        cls,
        model: Any,
        batch: Any,
        axis_sizes: Mapping[str, int],
        batch_axis: str | None,
        compiler: str = "cpu",
        chip: _tpu_memory.Chip = _tpu_memory.DEFAULT_CHIP,
        optimizer: Any = None,
    ) -> PeakWalk | None:
        """The walk of `model`'s step on `batch`, or `None` when its gradient cannot be traced.

        `optimizer` (an optimizer, its name or `None`) says what its update holds: accumulated
        gradients (`core._memory.accumulates`, `accumulated_update`), Muon's orthogonalised matrices
        (`orthogonalised_update`), one more array of the gradients' size (`update_arrays`)."""
        accumulated, muon = accumulates(optimizer), muon_matrices(model, optimizer)
        try:
            traced = trace_step(model, batch)
            arrays = update_arrays(optimizer)
            return cls(model, traced, axis_sizes, batch_axis, compiler, chip, accumulated, muon, arrays)
        except Exception:  # a model whose gradient JAX cannot trace still plans, on its reserve
            return None

    def peak(self, table: Any, chosen: Sequence[int]) -> PeakMemory:
        """The `PeakMemory` of candidate `chosen[i]` for each unit `i` of the `CostTable` `table`."""
        layouts: dict[str, Axes] = {}
        state = 0
        for unit, index in zip(table.units, chosen, strict=True):
            layouts.update(unit.candidates[index].axes)
            state += unit.candidates[index].state
        gradients = 0
        for path, variable in self.trainable.items():
            axes = layouts.get(path, ())
            pieces = math.prod(self.axis_sizes.get(a, 1) for entry in axes for a in entry_axes(entry))
            gradients += math.prod(variable.shape) * np.dtype(variable.dtype).itemsize // pieces
        return peak_memory(
            self.trace,
            layouts,
            self.axis_sizes,
            self.batch_axis,
            state=state,
            gradients=gradients,
            compiler=self.compiler,
            chip=self.chip,
            variables=len(self.trainable),
            whole_after=getattr(table, "whole_after", frozenset()),
            gathered=getattr(table, "gathered", frozenset()),
            rows_moved=getattr(table, "rows_moved", frozenset()),
            tiles=_tiles(self.compiler, self.variables, layouts, self.axis_sizes),
            accumulated=self.accumulated,
            update=orthogonalised_update(self.orthogonalised, layouts, self.axis_sizes, self.compiler),
            update_arrays=self.update_arrays,
            convnet=self.convnet,
        )


def is_convnet(trace: Trace) -> bool:
    """Whether `trace` is a convnet's step: convolutions over two spatial dimensions or more with two
    kernels or more (a vision transformer's patch embedding alone is not one), whose predicted peak
    keeps a larger headroom in a budget (`_auto.peak_headroom`)."""
    kernels = set()
    for node in trace.nodes:
        if node.primitive == CONV and len(node.params["dimension_numbers"].lhs_spec) > 3:
            kernel = conv_kernel(trace, node.inputs[1], 0, 1)
            kernels.update(() if kernel is None else (kernel[0],))
    return len(kernels) > 1


def generation_of(mesh: Any) -> Generation | None:
    """The TPU generation whose XLA:TPU the planner follows for `mesh`, or `None` off TPUs.

    The mesh's target's (`kml.Mesh(..., target=...)`); else, on a TPU machine, that of the devices
    the mesh holds, by their `device_kind` (a v5e VM's `kml.Mesh(data=..., model=...)` plans as
    `target="tpu-v5e:..."` does); v5e's figures for a TPU generation not in `GENERATIONS`.
    """
    target = getattr(mesh, "target", None)
    if target is not None:
        return target.generation
    try:
        device = jax_device_grid(mesh).flat[0]
    except Exception:  # not a mesh of devices (an abstract mesh): no compiler to follow
        return None
    if getattr(device, "platform", None) != "tpu":
        return None
    kind = str(getattr(device, "device_kind", ""))
    known = [g for g in GENERATIONS.values() if g.device_kind == kind]
    return known[0] if known else GENERATIONS["tpu-v5e"]


def compiler_of(mesh: Any) -> str:
    """The compiler whose buffers the walk follows for `mesh`: `"tpu"` on a TPU target or TPU devices,
    else `"cpu"`."""
    return "tpu" if generation_of(mesh) is not None else "cpu"


def reduced_gather_bytes_of(mesh: Any) -> float:
    """The largest copy XLA:TPU gathers over 64 devices or more as an all-reduce, on `mesh`'s TPU
    generation (`Generation.reduced_gather_bytes`); 0 (none) off TPUs."""
    generation = generation_of(mesh)
    return 0.0 if generation is None else generation.reduced_gather_bytes


def chip_of(mesh: Any) -> _tpu_memory.Chip:
    """The walk's figures of `mesh`'s TPU generation: on-chip memory, HBM alignment (`_tpu_memory`).

    `Generation.on_chip_bytes` and `hbm_alignment` (64 MiB and 0 on v5e, 0 and 16 KiB on v5p); the
    defaults off TPUs.
    """
    generation = generation_of(mesh)
    if generation is None:
        return _tpu_memory.DEFAULT_CHIP
    return _tpu_memory.Chip(generation.on_chip_bytes, generation.hbm_alignment, generation.vmem_bytes)


def plan_peak(
    model: Any,
    plan: Any,
    batch: Any,
    batch_axis: str | None,
    compiler: str = "cpu",
    chip: _tpu_memory.Chip = _tpu_memory.DEFAULT_CHIP,
    optimizer: Any = None,
) -> PeakMemory:
    """The predicted per-device peak of one training step of `model` on `batch` under `plan`.

    `plan` is a `kml.Plan` of `model` (its entries give each variable's layout and its
    `memory()` the training state); `model` may be a `kml.dry_build` model. `compiler`
    (`compiler_of(mesh)`) is the XLA whose buffers the walk follows, `chip` (`chip_of(mesh)`) its
    target generation's figures; `optimizer` (an optimizer, its name or `None`) what its update
    holds, as `PeakWalk.of` says.
    """
    memory = plan.memory()
    layouts = {entry.path: entry.axes for entry in plan.entries}
    with stored_int4():  # an int4 layer's `kernel` read as stored (a dry build's has no value to unpack)
        whole_after, gathered = _whole_conv_outputs(model, plan, batch_axis), _gathered_kernels(model, plan)
    return peak_memory(
        live_code(trace_step(model, batch)),
        layouts,
        plan.axis_sizes,
        batch_axis,
        state=memory.total,
        gradients=memory.gradients,
        compiler=compiler,
        chip=chip,
        variables=len(model.trainable_variables),
        whole_after=whole_after,
        gathered=gathered,
        rows_moved=_noted(plan, _notes.ROWS_MOVED),
        tiles=_tiles(compiler, model.variables, layouts, plan.axis_sizes),
        accumulated=accumulates(optimizer),
        update=orthogonalised_update(muon_matrices(model, optimizer), layouts, plan.axis_sizes, compiler),
        update_arrays=update_arrays(optimizer),
    )


def _tiles(
    compiler: str, variables: Any, layouts: Mapping[str, Axes], axis_sizes: Mapping[str, int]
) -> float:
    """The state's padding factor on `compiler`: XLA:TPU's tiles (`_tpu_memory.tiled_state`), else 1."""
    return _tpu_memory.tiled_state(variables, layouts, axis_sizes) if compiler == "tpu" else 1.0


def _whole_conv_outputs(model: Any, plan: Any, batch_axis: str | None) -> frozenset[str]:
    """The kernels of the convolution layers whose output a layer-output rule splits over the batch only."""
    kept = {
        layer
        for rule, layers in plan.outputs
        if all(axis == batch_axis for entry in rule.axes for axis in entry_axes(entry))
        for layer in layers
    }
    return frozenset(
        layer.kernel.path
        for layer in _compat.sublayers(model)
        if isinstance(layer, CONV_LAYERS) and getattr(layer, "path", None) in kept
    )


def _gathered_kernels(model: Any, plan: Any) -> frozenset[str]:
    """The trainable key/value kernels whose rule splits them on head_dim, gathered once per step (no bias).

    As `CostTable.gathered`, read off the plan: the rule's note says so (`_notes.KV_GATHERED`).
    """
    unbiased = {
        layer.kernel.path
        for layer in _compat.sublayers(model)
        if getattr(layer, "bias", None) is None
        and getattr(getattr(layer, "kernel", None), "trainable", False)
    }
    return frozenset(path for path in _noted(plan, _notes.KV_GATHERED) if path in unbiased)


def _noted(plan: Any, note: str) -> frozenset[str]:
    """The paths whose rule's note says `note`."""
    return frozenset(e.path for e in plan.entries if e.rule is not None and note in e.rule.note)


def peak_memory(
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
    *,
    state: int,
    gradients: int,
    compiler: str = "cpu",
    whole_after: frozenset[str] = frozenset(),
    tiles: float = 1.0,
    gathered: frozenset[str] = frozenset(),
    chip: _tpu_memory.Chip = _tpu_memory.DEFAULT_CHIP,
    variables: int = 0,
    rows_moved: frozenset[str] = frozenset(),
    accumulated: bool = False,
    update: int = 0,
    update_arrays: float = 0.0,
    convnet: bool | None = None,
) -> PeakMemory:
    """The `PeakMemory` of the traced step `trace` (`_trace.trace_step`) under `layouts`.

    `state` and `gradients` are the per-device training-state bytes and their gradients' share
    (`core._memory`: a plan's `memory()`, or the planner's candidates); `whole_after` the kernels
    whose convolution's layer output a rule keeps whole and `gathered` the kernels XLA gathers whole
    where they are read (`_propagate.Specs`); `tiles` the factor by which the parameters and slots
    are padded in the compiler's layouts; `chip` the TPU generation's figures and `variables` the
    trainable variables' count (`_tpu_memory.aligned_bytes`); `rows_moved` the tables whose gradient
    each device sums in its own shard (`CostTable.rows_moved`); `accumulated` whether the
    optimizer accumulates gradients (`accumulated_update`); `update` what the optimizer's update holds
    once the gradients are spent (`orthogonalised_update`), `update_arrays` the arrays of its
    gradients' size it writes beside them (`update_arrays`); `convnet` whether `trace` is a convnet's
    step (`is_convnet`, worked out where `None`): XLA:TPU keeps less of it on chip.
    """
    arrays = state / gradients if gradients else 0.0
    accumulated_bytes = accumulated_update(gradients, compiler, arrays) if accumulated else 0
    accumulated_bytes += round(update_arrays * gradients) if compiler != "tpu" else 0
    transient, batch, buffers = transient_peak(
        trace,
        layouts,
        axis_sizes,
        batch_axis,
        compiler,
        whole_after,
        gathered,
        chip,
        rows_moved,
        accumulated_bytes,
        gradients=gradients,
        convnet=compiler == "tpu" and (is_convnet(trace) if convnet is None else convnet),
    )
    transient = max(transient, update)
    if compiler == "tpu":  # each gradient is applied as it is written: none is held to the end
        padding = round((state - gradients) * (tiles - 1))
        # Each variable's update reads its parameter, gradient and slots: state ÷ gradients arrays.
        aligned = _tpu_memory.aligned_bytes(variables, arrays, chip.alignment)
        return PeakMemory(state, gradients, batch, transient, False, padding, aligned, buffers)
    return PeakMemory(state=state, gradients=gradients, batch=batch, transient=transient, buffers=buffers)
