"""Liveness over a traced training step: the most its buffers hold at once, per device.

`transient_peak(trace, layouts, axis_sizes, batch_axis, ...)` walks the step (`_trace.trace_step`)
in program order: a buffer (a value `_fusion` does not fuse) lives from the operation that
writes it to its last reader, where reading a fused value reads its inputs too; the step's
outputs (the gradients) live to the end on XLA:CPU. Each value's bytes are its per-device shard
(`_propagate.Specs`), plus the gathered copies of batch-split weights and the buffers one
operation writes while it runs. On XLA:TPU an element-wise result takes the buffer of an operand
that dies there (`_in_place`), and a small peak stays in on-chip memory (`_tpu_memory`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from types import MappingProxyType

from ..core._axes import Axes
from . import _tpu_memory
from ._at_peak import PeakBuffer, buffers_at
from ._fusion import (
    ELEMENTWISE,
    EXPENSIVE,
    fused,
    fused_on_tpu,
    laid_out,
    laid_out_gradients,
    shared_constants,
    stacked_early,
)
from ._max_pooling import pool_gradients
from ._propagate import REDUCTIONS, Specs, copied_operands, itemsize
from ._trace import Trace
from ._walk_gradients import walked_gradients
from ._windowed_copies import windowed_operands

__all__ = ["SHORT_LIVED", "live_code", "transient_peak"]

#: The most operations of the traced step between a buffer's write and its last read for XLA:TPU to
#: hold it in vector memory (`_short_lived`; fitted on TPU v5e, libtpu 0.0.42.1).
SHORT_LIVED = 24


def transient_peak(
    trace: Trace,
    layouts: Mapping[str, Axes],
    axis_sizes: Mapping[str, int],
    batch_axis: str | None,
    compiler: str = "cpu",
    whole_after: frozenset[str] = frozenset(),
    gathered: frozenset[str] = frozenset(),
    chip: _tpu_memory.Chip = _tpu_memory.DEFAULT_CHIP,
    rows_moved: frozenset[str] = frozenset(),
    update: int = 0,
    gradients: int = 0,
    convnet: bool = False,
) -> tuple[int, int, tuple[PeakBuffer, ...]]:
    """`(transient peak, batch bytes, buffers)` per device of the traced step `trace` (see the module
    docstring); `buffers` the largest live at the walk's peak (`_at_peak.buffers_at`), before what
    XLA:TPU keeps on chip.

    `layouts` gives each variable path its axes (missing: replicated); `whole_after` and
    `gathered` are `_propagate.Specs`'; `chip` the TPU generation's on-chip figures (`_tpu_memory.Chip`:
    the largest peak XLA:TPU keeps all on chip, `in_hbm`, and its vector memory, `_short_lived`);
    `rows_moved` the tables split over the batch axis whose looked-up rows move instead
    (`_tables_2d.BothAxesTables._moved_rows`): each device sums its own rows' gradient, in its
    shard, with no all-reduce. `update` is what the optimizer's update holds beyond the gradients at
    the end of the step (`_update_memory.accumulated_update`): on XLA:TPU it is in HBM, whatever
    stays on chip.
    `gradients` (the step's, per device) and `convnet` (`_peak.is_convnet`) say what of a larger
    transient XLA:TPU keeps on chip (`_tpu_memory.in_hbm`).
    """
    held = compiler != "tpu"
    # XLA:CPU computes bfloat16 in float32 and writes most of its buffers so: under
    # `mixed_bfloat16` its compiled peak is float32's (a transformer block on 2×4: 1,055,268
    # bytes against 1,059,108), 0.62-0.84 of the walk's with bfloat16 buffers (`_propagate`).
    specs = Specs(trace, layouts, axis_sizes, batch_axis, whole_after, gathered=gathered, xla_cpu=held)
    sizes = {value: specs.bytes(value) for value in trace.shapes}
    zeros, summed = walked_gradients(trace, specs, sizes, held, rows_moved)
    not_written = zeros | (_not_written_on_cpu(trace) if held else _not_written_on_tpu(trace, specs, sizes))
    recomputed = _recomputed_copies(trace) if held else {}
    pools = tuple(pool_gradients(trace, specs)) if held else ()  # max pooling's argmax (`_max_pooling`)
    unread = {(pool.backward, pool.operand) for pool in pools}
    last = _last_reads(trace, not_written, set(recomputed) | unread)
    end = len(trace.nodes)
    last.update({value: end for value in trace.outputs if value >= 0 and held})  # gradients to the update
    written = {value: node.index for node in trace.nodes for value in node.outputs}
    written.update(stacked_early(trace) if held else {})
    written.update({trace.nodes[pool.backward].outputs[0]: 0 for pool in pools})  # its zeros, made early
    starts: dict[int, int] = {}
    frees: dict[int, int] = {}
    buffers = [v for v in written if v not in not_written]
    _extend_lives(trace, recomputed, buffers, written, last, held)
    for value in buffers:
        _add(starts, written[value], sizes[value])
        _add(frees, last.get(value, written[value]), sizes[value])
    pooled = [held for pool in pools for held in pool.held]
    beside = _held_beside(trace, specs, not_written, pooled, layouts, set(buffers))
    for first, final, size in beside:
        _add(starts, first, size)
        _add(frees, final, size)
    if held and axis_sizes.get(batch_axis or "", 1) > 1:
        # The gradients are summed over the batch axis into buffers of their own (one combined
        # all-reduce at the end of the backward pass, measured on XLA:CPU), before the update.
        _add(specs.scratch, end, sum(sizes[value] for value in summed))
    _add(specs.scratch, end, update if held else 0)  # the update's own copies (XLA:TPU's: in HBM, below)
    if not held:
        for when, reused in _in_place(trace, set(buffers), sizes, last).items():
            starts[when] -= reused
            frees[when] -= reused
    extras = [specs.scratch, specs.partial_sums] if held else [specs.scratch]
    for when, extra in ((w, e) for scratch in extras for w, e in scratch.items()):
        _add(starts, when, extra)
        _add(frees, when, extra)
    batch = sum(sizes[value] if held else _tiled(trace, specs, value) for value in trace.inputs)
    vmem = 0 if held else chip.vmem
    peak, when = _sweep(starts, frees, end, _short_lived(trace, buffers, sizes, last, written, vmem), vmem)
    at_peak = buffers_at(trace, when, buffers, sizes, written, last, also=pooled)
    if not held:  # XLA:TPU keeps a step whose temporaries are small in on-chip memory, not HBM
        peak = _tpu_memory.in_hbm(peak, chip.on_chip, gradients=gradients, convnet=convnet) + update
    return peak, batch, at_peak


def _not_written_on_cpu(trace: Trace) -> set[int]:
    """The values XLA:CPU does not write (`_fusion`'s rules)."""
    return fused(trace) | laid_out_gradients(trace)


def _not_written_on_tpu(trace: Trace, specs: Specs, sizes: dict[int, int]) -> set[int]:
    """The values XLA:TPU does not write (`_fusion`'s rules, then the walk's own), and in `sizes` the
    bytes of the convolutions' results in XLA:TPU's layouts."""
    sizes.update(_feature_minor_bytes(trace, specs))
    not_written = fused(trace) | fused_on_tpu(trace)
    not_written |= laid_out(trace, not_written)
    not_written |= _recomputed_on_tpu(trace, not_written)
    for value in _convolved_only(trace, not_written):
        sizes[value] //= 2
    return not_written


def _extend_lives(
    trace: Trace,
    recomputed: Mapping[tuple[int, int], int],
    buffers: list[int],
    written: dict[int, int],
    last: dict[int, int],
    held: bool,
) -> None:
    """Buffers XLA:CPU holds longer than their reads say, in `written` and `last`.

    A recomputed convolution operand's copy reads what its operand is made of, there. A look-up's
    gradient is scattered into zeros that XLA:CPU allocates early in the forward pass and
    scatters into in place (a keras-hub Llama and Qwen on 2×4: the table's 32 KiB shard from
    the 86th and 100th of 470 and 503 instructions to the update): the scatter's result lives from
    the step's start, the zeros take no buffer of their own.
    """
    for (conv, _), producer in recomputed.items():
        for value in _operands(trace, trace.nodes[producer].inputs, set(buffers)):
            last[value] = max(last.get(value, conv), conv)
    for node in trace.nodes if held else ():
        zeros = node.inputs[0] if node.primitive == "scatter-add" else -1
        source = trace.nodes[trace.producer[zeros]] if zeros in trace.producer else None
        if source is None or source.primitive != "broadcast_in_dim" or any(v >= 0 for v in source.inputs):
            continue
        written[node.outputs[0]] = 0
        if zeros in buffers:
            buffers.remove(zeros)


def live_code(trace: Trace) -> Trace:
    """`trace` without the operations its outputs do not need (XLA removes them too)."""
    needed = {v for v in trace.outputs if v >= 0}
    kept = []
    for node in reversed(trace.nodes):
        if any(v in needed for v in node.outputs):
            kept.append(node)
            needed.update(v for v in node.inputs if v >= 0)
    nodes = tuple(dataclasses.replace(node, index=i) for i, node in enumerate(reversed(kept)))
    consumers: dict[int, list[int]] = {}
    producer: dict[int, int] = {}
    for node in nodes:
        for value in node.inputs:
            if value >= 0:
                consumers.setdefault(value, []).append(node.index)
        for value in node.outputs:
            producer[value] = node.index
    return dataclasses.replace(
        trace,
        nodes=nodes,
        producer=MappingProxyType(producer),
        consumers=MappingProxyType({k: tuple(v) for k, v in consumers.items()}),
    )


def _add(counts: dict[int, int], when: int, size: int) -> None:
    counts[when] = counts.get(when, 0) + size


def _shard(trace: Trace, specs: Specs, value: int) -> list[int]:
    shard = list(trace.shapes[value])
    for dim, entry in enumerate(specs.spec.get(value, ())[: len(shard)]):
        shard[dim] = -(-shard[dim] // math.prod(specs.sizes[a] for a in entry))
    return shard


def _tiled(trace: Trace, specs: Specs, value: int) -> int:
    """The bytes of `value`'s shard in XLA:TPU's tiled layout (`_tpu_memory.tiled_bytes`)."""
    return _tpu_memory.tiled_bytes(_shard(trace, specs, value), itemsize(trace.dtypes[value]))


def _convolved_only(trace: Trace, not_written: set[int]) -> list[int]:
    """The float32 input gradients of convolutions XLA:TPU writes in bfloat16: those read, through
    fused values, only by convolutions and reductions.

    An input gradient is a convolution with the kernel reversed (`rev`), as JAX transposes one. A
    convolution computes in bfloat16 at default precision, so XLA:TPU writes such an operand
    rounded, with its reductions (a bias gradient) fused in. Measured on a convnet's backward pass
    (v5e 2x4): each input gradient, through the ReLU's backward `select`, is `bf16[8,128,128,8]`;
    the forward pass's results stay float32.
    """
    found = []
    for node in trace.nodes:
        if node.primitive != "conv_general_dilated" or trace.dtypes[node.outputs[0]] != "float32":
            continue
        kernel = trace.producer.get(node.inputs[1])
        if kernel is None or trace.nodes[kernel].primitive != "rev":
            continue
        pending, readers = [node.outputs[0]], set()
        while pending:
            for reader in trace.consumers.get(pending.pop(), ()):
                outputs = trace.nodes[reader].outputs
                if outputs and all(v in not_written for v in outputs):
                    pending.extend(outputs)
                else:
                    readers.add(trace.nodes[reader].primitive)
        if readers and readers <= {"conv_general_dilated", *REDUCTIONS}:
            found.append(node.outputs[0])
    return found


def _feature_minor_bytes(trace: Trace, specs: Specs) -> dict[int, int]:
    """The bytes XLA:TPU gives a convolution's result, and the element-wise results computed from it.

    XLA:TPU lays them out features minor (128 lanes), batch second-minor (8 rows): whatever the
    padding (`_tpu_memory.feature_minor_bytes`). Measured on a convnet (v5e 2x4, 16 images of
    128 × 128): the first convolution's 32 features split over `model` are 8 a device, stored as
    `f32[8,128,128,8]` in 64 MiB where its elements take 4 MiB; the walk, counting 4 MiB, had put
    the step on chip (predicted ÷ compiled 0.03).
    """
    layouts: dict[int, tuple[int, int]] = {}
    for node in trace.nodes:
        numbers = node.params.get("dimension_numbers") if node.primitive == "conv_general_dilated" else None
        if getattr(numbers, "out_spec", None) is not None:
            layouts[node.outputs[0]] = tuple(numbers.out_spec[:2])
        elif node.primitive in ELEMENTWISE:
            shaped = [v for v in node.inputs if v in layouts]
            for value in node.outputs:
                same = [v for v in shaped if trace.shapes[v] == trace.shapes[value]]
                if same:
                    layouts[value] = layouts[same[0]]
    return {
        value: _tpu_memory.feature_minor_bytes(
            _shard(trace, specs, value), itemsize(trace.dtypes[value]), *dims
        )
        for value, dims in layouts.items()
    }


def _held_beside(
    trace: Trace,
    specs: Specs,
    not_written: set[int],
    pooled: Sequence[tuple[int, int, PeakBuffer]],
    layouts: Mapping[str, Axes],
    buffers: set[int],
) -> Iterator[tuple[int, int, int]]:
    """`(first, last node, bytes)` of what the step holds beside its traced values' buffers: XLA:CPU's
    shared constants, the batch-split weights' gathered copies, max pooling's positions (`pooled`),
    the early copies, and XLA:TPU's bfloat16 copies of windowed projections' inputs."""
    if specs.xla_cpu:
        for first, final, value in shared_constants(trace, not_written):
            yield first, final, specs.bytes(value)
    for value, (first, final) in specs.gathered.items():
        yield first, final, specs.bytes(value)
    yield from ((first, final, buffer.bytes) for first, final, buffer in pooled)
    yield from ((0, when, size) for when, size in specs.early_copies.items())
    if not specs.xla_cpu:
        yield from windowed_operands(trace, specs, layouts, specs.batch_axis, buffers)


def _sweep(
    starts: Mapping[int, int],
    frees: Mapping[int, int],
    end: int,
    short: tuple[Mapping[int, int], Mapping[int, int]] = (MappingProxyType({}), MappingProxyType({})),
    vmem: int = 0,
) -> tuple[int, int]:
    """The largest sum of live bytes over the program, less what of the short-lived buffers live then
    (`short`: their bytes written and freed per node, `_short_lived`) the `vmem` bytes of vector
    memory hold; and the first node where the program holds it."""
    live = peak = kept = at = 0
    for when in range(end + 1):
        live += starts.get(when, 0)
        kept += short[0].get(when, 0)
        if live - min(kept, vmem) > peak:
            peak, at = live - min(kept, vmem), when
        live -= frees.get(when, 0)
        kept -= short[1].get(when, 0)
    return peak, at


def _short_lived(
    trace: Trace,
    buffers: Sequence[int],
    sizes: Mapping[int, int],
    last: Mapping[int, int],
    written: Mapping[int, int],
    vmem: int,
) -> tuple[dict[int, int], dict[int, int]]:
    """The buffers XLA:TPU's memory-space assignment may hold in vector memory instead of HBM: per node,
    the bytes of those written and freed there (`_sweep`).

    They are those read for the last time within `SHORT_LIVED` operations of being written, each of
    at most `vmem` bytes, and not a gradient (applied by the optimizer from HBM as it is written).
    Up to `vmem` bytes of them at once (`Chip.vmem`) are left out of the HBM peak. Measured on TPU
    v5e (libtpu 0.0.42.1) on 2-layer keras-hub decoders, 16 × 1,024 tokens on `data=2,model=4`:
    XLA:TPU computes a language-model head's logits (64 MiB) and an attention's score gradients into
    vector memory, evicting the activations saved for the backward pass to HBM. Predicted ÷
    compiled peak, before → with this: Llama 3 1.15 → 0.93, Gemma 1.24 → 0.96, Llama 3 under LoRA
    1.33 → 1.03. Buffers read within 8 operations: 1.01, 1.10, 1.16; within 48: 0.88, 0.91, 0.94.
    At 8 × 1,024 tokens XLA:TPU keeps longer-lived activations on chip too, 40 MiB of which
    `_tpu_memory.in_hbm` leaves out of HBM: 1.14 (1.46-1.71 before).
    """
    outputs = set(trace.outputs)
    starts: dict[int, int] = {}
    frees: dict[int, int] = {}
    for value in buffers:
        final = last.get(value, written[value])
        if final - written[value] <= SHORT_LIVED and sizes[value] <= vmem and value not in outputs:
            _add(starts, written[value], sizes[value])
            _add(frees, final, sizes[value])
    return starts, frees


def _last_reads(
    trace: Trace, fused_values: set[int], skipped: set[tuple[int, int]] = frozenset()
) -> dict[int, int]:
    """Per value, the last node that reads it, where reading a fused value reads its inputs too.

    A `(node, value)` in `skipped` is not a read (a convolution's operand whose copy is recomputed).
    """
    last: dict[int, int] = {}
    for node in reversed(trace.nodes):
        when = max((last.get(v, node.index) for v in node.outputs if v in fused_values), default=node.index)
        when = max(when, node.index)
        for value in node.inputs:
            if (node.index, value) in skipped:
                continue
            if value >= 0 and last.get(value, -1) < when:
                last[value] = when
    return last


def _recomputed_on_tpu(trace: Trace, not_written: set[int]) -> set[int]:
    """Expensive element-wise results XLA:TPU recomputes in their readers: their operands outlive them.

    `_fusion.fused_on_tpu` never duplicates a transcendental into its readers; where every
    buffer it is computed from is read at least as late as it is, XLA:TPU recomputes it all the
    same, since keeping it saves no memory. Measured on an expert bank's SwiGLU (v5e data=2,model=4,
    16,384 tokens a chip, one expert a chip, intermediate 2048): the gate and up projections and the
    down projection's input gradient are live together at the peak, 3 × 128 MiB; the sigmoid of
    the gate, read by the backward pass as late as the gate itself, is not a buffer (the walk held it:
    1.31 of XLA:TPU's peak).
    """
    buffers = {v for node in trace.nodes for v in node.outputs} - not_written
    last = _last_reads(trace, not_written)
    outputs = set(trace.outputs)
    found = set()
    for node in trace.nodes:
        if node.primitive not in EXPENSIVE:
            continue
        for value in node.outputs:
            if value in outputs or value not in buffers or value not in last:
                continue
            operands = _operands(trace, node.inputs, buffers)
            if operands and all(last.get(o, -1) >= last[value] for o in operands):
                found.add(value)
    return found


def _recomputed_copies(trace: Trace) -> dict[tuple[int, int], int]:
    """Per `(convolution, operand)` whose copy XLA:CPU recomputes, the operand's element-wise producer.

    XLA:CPU fuses the copy of a convolution's operand into its own layout (`copied_operands`) with
    the element-wise operation that computes the operand: the copy reads that operation's inputs,
    not the operand. Measured on a convnet: the kernel gradient of its second convolution copies
    the ReLU's backward `select` transposed, recomputed from the convolution's output (on 2x4 its
    all-reduced 256 KiB, which lives to there: the walk had freed it at the `select`, 0.765 of the
    compiled peak), and the first ReLU's output transposed, recomputed from the first convolution's.
    """
    found = {}
    for node in trace.nodes:
        for operand in copied_operands(node):
            producer = trace.producer.get(operand)
            if producer is not None and trace.nodes[producer].primitive in ELEMENTWISE:
                found[(node.index, operand)] = producer
    return found


def _in_place(
    trace: Trace, buffers: set[int], sizes: Mapping[int, int], last: Mapping[int, int]
) -> dict[int, int]:
    """Per node, the bytes of element-wise results XLA:TPU writes over an operand that dies there.

    The operands are the node's inputs and, through values fused into it, theirs. Measured on a
    language-model head: the logits' gradient takes the logits' own buffer, so one (tokens ×
    vocabulary) buffer is live where the walk counted two.
    """
    reused: dict[int, int] = {}
    for node in trace.nodes:
        if node.primitive not in ELEMENTWISE:
            continue
        taken: set[int] = set()
        for value in (v for v in node.outputs if v in buffers):
            for operand in _operands(trace, node.inputs, buffers):
                if operand in buffers and operand not in taken and last.get(operand) == node.index:
                    if sizes[operand] == sizes[value]:
                        taken.add(operand)
                        _add(reused, node.index, sizes[value])
                        break
    return reused


def _operands(trace: Trace, inputs: Sequence[int], buffers: set[int]) -> list[int]:
    """The buffers `inputs` read: each input that is one, else (fused) those its producer reads."""
    found: list[int] = []
    seen: set[int] = set()
    pending = [v for v in inputs if v >= 0]
    while pending:
        value = pending.pop(0)
        if value in seen:
            continue
        seen.add(value)
        if value in buffers:
            found.append(value)
        elif value in trace.producer:
            pending.extend(v for v in trace.nodes[trace.producer[value]].inputs if v >= 0)
    return found
