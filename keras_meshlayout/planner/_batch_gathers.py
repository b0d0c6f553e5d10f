"""Kernels split over the batch axis (2-D and fully sharded layouts), gathered for their compute.

`BatchGathers` is the part of `_candidates.Bytes` that says how often XLA all-gathers such a
kernel in one step, what its input gradient sends and, on XLA:TPU, when its gradient is
reduce-scattered as a windowed einsum, as XLA:CPU and XLA:TPU compile it (each formula says
where it was measured); `nbytes`, a variable's bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import keras
import numpy as np

from ..report._collectives import wire_bytes
from ._trace import Trace, Use

__all__ = ["REDUCED_GROUP", "WINDOWED_ROWS", "WINDOWED_SIZES", "BatchGathers", "nbytes", "windowed_on_tpu"]

#: The rows (tokens) a projection contracts from which XLA:TPU reduce-scatters the gradient of its kernel
#: split over a batch axis of `WINDOWED_SIZES` devices as a windowed einsum (`BatchGathers.windowed_sync`).
WINDOWED_ROWS = 16384
#: The batch-axis sizes where that was measured (2: never windowed; 64: all-reduced; more: not measured).
WINDOWED_SIZES = (4, 8, 16, 32)


#: The devices over both axes (or the batch axis alone) from which XLA:TPU gathers a small kernel as
#: an all-reduce (`OneWeightCosts._gathers_over_both`, `_whole_kernel_gathers`): 64 measured so (v5e
#: 8×8, v5p 4×4×4; a Dense MLP on v5e `data=64,model=1`), 32 not.
REDUCED_GROUP = 64


def windowed_on_tpu(compiler: str, batch_devices: int, rows: int) -> bool:
    """Whether XLA:TPU computes a batch-split kernel's projections as windowed einsums over the batch
    axis: on a batch axis of `WINDOWED_SIZES` devices, `WINDOWED_ROWS` rows or more contracted."""
    return compiler == "tpu" and batch_devices in WINDOWED_SIZES and rows >= WINDOWED_ROWS


def nbytes(variable: keras.Variable) -> int:
    """A variable's bytes, whole."""
    return math.prod(variable.shape) * np.dtype(variable.dtype).itemsize


class BatchGathers:
    """How kernels split over the batch axis are gathered: a mixin of `_candidates.Bytes`, whose
    mesh sizes (`d`, `m`), `compiler`, trace (`trace`, `uses`, `calls`), activation bytes
    (`_activation`, `_summed`) and gradient all-reduce (`_grad_sync`) it reads."""

    d: int
    m: int
    int4: Mapping[str, int]
    compiler: str
    reduced_gathers: float
    trace: Trace
    uses: Mapping[str, tuple[Use, ...]]

    def gathers_per_step(
        self, layer: keras.layers.Layer | None, kernel: keras.Variable, gathered: float, side: str
    ) -> int:
        """How often XLA all-gathers a kernel split over the batch axis in one step (2-D, fully sharded).

        `side` is how the model axis splits it: `"row"`, `"column"` or `"whole"` (not at all).
        Measured on XLA:CPU (jaxlib 0.10) on MLPs and on the Llama, Gemma,
        Mistral, Falcon, Qwen, SmolLM3, GPT-2, BERT and T5 backbones of the
        tests: the kernel gathered for the forward pass is kept for the
        backward one unless it is large beside the projection's activations on one device; then
        it is gathered again, unless the projection reads the model's input (no input gradient,
        so the backward pass needs no kernel). Over a batch axis of 4 or more devices, large is
        larger than both the projection's input and output on one device (at least as large,
        for a `Dense` kernel); over 2 devices, a kernel split over the batch axis alone larger than
        its output on one device (a Dense MLP on `data=2,model=1`, 8 to 512 rows per device: the
        input's size does not decide there). A 2-D kernel over 2 devices: a column kernel is
        gathered once (keras-hub T5 and Qwen on 2×4); a row kernel again when its output on one
        device is at most 1/model of its gathered copy (the kernel ÷ model²) and no other matmul
        reads that output (the model's, as a two-layer MLP's second kernel; a row kernel feeding
        the next Dense pair is gathered once): the partitioner gathers it anew for the input
        gradient, an all-gather of the same shard with its own `channel_id` (Dense MLPs
        64→512→64 and 32→256→128 on 2×4 and 2×2, each on both sides of that line: twice at 32
        rows per device on 2×4 and 128 on 2×2, once at 36 and 136 for the first, 16 / 20 and
        64 / 72 for the second; it was 0.860–0.876 of the compiled bytes
        when counted once; `tests/test_batch_gathers.py`). Over 4 devices or more the rule above,
        except for a kernel gathered whole (split over the batch axis alone, or `model=1`) whose
        output feeds another matmul: kept (one-layer keras-hub Llama on `data=4` and `data=8` and
        Mixtral on `data=4`, `model=1`, every attention and feed-forward kernel gathered once; they
        were costed at 1.29x and 1.10x the compiled bytes); over `data=4,model=2` the same Llama's
        query, output and feed-forward shards are gathered again, as the rule says.
        `tests/test_budget.py` and `tests/test_mesh_choice.py` hold this against the compiled
        HLO. XLA:TPU (libtpu 0.0.42.1, v5e 2×4, 4×2 and 8×1, a two-layer Dense MLP, 2 to 512
        rows per device) gathers a kernel in bfloat16 (`gathered_share`) whatever its size: one
        all-gather (one `channel_id`) per gather in the HLO, which prints it in each fusion of
        the asynchronous collective (the three counted before `parse_collectives` skipped those
        copies). It keeps the gathered kernel for the backward pass when the forward pass reads
        it after its last product of two activations (attention's probabilities and values;
        an MLP has none: every kernel kept), and gathers the others again for the backward pass
        (`_kept_for_backward`).
        """
        if kernel.path in self.int4 or self._int8_kernel(kernel):  # its input gradient dequantizes it anew
            return 1 if all(use.from_input for use in self.uses.get(kernel.path, ())) else 2
        if self.compiler == "tpu":
            return 1 if self._kept_for_backward(kernel) else 2
        return 2 if self._regathered(layer, kernel, gathered, side) else 1

    def _kept_for_backward(self, kernel: keras.Variable) -> bool:
        """Whether XLA:TPU keeps a kernel gathered over the batch axis for the backward pass too.

        Kept when the forward pass first reads it after the last product of two trained activations
        (a `dot_general` reading no weight: attention's scores or its probabilities times the
        values), the kernels the backward pass reads first; the others are gathered again for
        it. Measured with libtpu 0.0.42.1 on a 2-layer keras-hub Llama 3 under its output table,
        fully sharded: on v5e 2×4 (`data=2,model=4`, `4×2`, `8×1`, 64 tokens of 8 rows) the
        second layer's feed-forward kernels and the output table are gathered once, every other
        kernel twice (over `data=8` also the second layer's attention output, 0.6% of the bytes,
        not predicted); on v5p 4×4×4 at Llama-3 8 B widths (`data=8,model=8`, 2048 tokens a
        row) the same, and the second layer's attention output kept.
        """
        reads = [use.node for use in self.uses.get(kernel.path, ()) if use.kind == "matmul"]
        return not reads or min(reads) > self._last_activation_product()

    def _last_activation_product(self) -> int:
        """The index of the forward pass's last `dot_general` of two trained activations (-1: none)."""
        if not hasattr(self, "_activation_product"):
            weighted = {use.node for uses in self.uses.values() for use in uses}
            trained = self.trace.trained
            products = [
                node.index
                for node in self.trace.nodes
                if node.primitive == "dot_general"
                and node.index not in weighted
                and all(value in trained for value in node.inputs)
            ]
            self._activation_product = max(products, default=-1)
        return self._activation_product

    def _regathered(
        self, layer: keras.layers.Layer | None, kernel: keras.Variable, gathered: float, side: str
    ) -> bool:
        """Whether XLA:CPU gathers a kernel again for its input gradient (`gathers_per_step`)."""
        largest = largest_out = 0.0
        for inputs, output, from_input, dtype in self.calls(kernel.path):
            if from_input:
                return False
            local_in = self._activation(inputs, dtype) / (self.m if side == "row" else 1)
            local_out = self._activation(output, dtype) / (self.m if side == "column" else 1)
            largest, largest_out = max(largest, local_in, local_out), max(largest_out, local_out)
        if self.d >= 4 and (side == "whole" or self.m == 1) and self._feeds_matmul(kernel.path):
            return False  # gathered whole, feeding the next layer: kept (keras-hub Llama on data=4,8)
        if self.d < 4:
            if side == "row":  # its output on one device at most its gathered copy's 1/model: again
                return largest_out * self.m <= gathered and not self._feeds_matmul(kernel.path)
            return side == "whole" and gathered > largest_out  # a column kernel: once (T5, Qwen)
        if isinstance(layer, keras.layers.EinsumDense):
            return gathered > largest
        return gathered >= largest  # a Dense layer, or a custom layer's matmul

    def _feeds_matmul(self, path: str) -> bool:
        """Whether a projection's output reaches another matmul in the forward pass (the next layer)."""
        uses = self.uses.get(path, ())
        values = [self.trace.nodes[use.node].outputs[0] for use in uses if use.kind == "matmul"]
        seen: set[int] = set()
        while values:
            value = values.pop()
            if value in seen:
                continue
            seen.add(value)
            for index in self.trace.consumers.get(value, ()):
                node = self.trace.nodes[index]
                if node.primitive == "dot_general":
                    return True
                values.extend(node.outputs)
        return False

    def two_d_gathers(self, variable: keras.Variable, shards: int, count: int, gathered: float) -> float:
        """A kernel's `count` gathers of `gathered` bytes over the batch axis, plus `windowed_sync`."""
        wire = count * wire_bytes("all-gather", gathered, self.d)
        return wire + self.windowed_sync(variable, shards) + self.windowed_gather(variable, gathered)

    def windowed_sync(self, variable: keras.Variable, shards: int) -> float:
        """What XLA:TPU's windowed reduce-scatter of a kernel's gradient sends beyond its all-reduce (<= 0).

        Over a batch axis of 4 or 8 devices, a kernel whose projection contracts `WINDOWED_ROWS`
        rows or more (the batch's tokens) has its gradient reduce-scattered as a windowed einsum:
        `d + 1` collective-permutes of its shard (a loop of 4 run twice and one before it over
        `data=8`, 5 unrolled over `data=4`) in place of the all-reduce (`_grad_sync`) and the slice
        of it. Measured with libtpu 0.0.42.1, Dense MLPs fully sharded on v5e 2×4 (`data=8`: 8,192
        rows all-reduced, 16,384 and 32,768 windowed; `data=4`: 8,192 and 4,096 all-reduced, 16,384
        and 65,536 windowed; `data=2`: all-reduced up to 131,072) and on v5p 4×4×4 `data=8,model=8`
        (65,536 rows), and Llama-3 8 B widths there (131,072 tokens); over `data=16` and `data=32`
        (2026-12-05: the same MLP on v5e 4×4 and 4×8, windowed at 16,384 rows, not at 8,192; a
        keras-hub Llama 3 on v5p `data=16,model=4`, Llama-3 8 B widths there and Mixtral 8×7 B widths
        on v5e `data=32,model=8`, whose bytes were 1.151 of the compiled, 0.993 since). Over
        `data=64` (v5e 8×8) the gradient is all-reduced; other sizes are not measured and keep the
        all-reduce (`WINDOWED_SIZES`).
        """
        summed = self._grad_sync(variable, shards) if self._windowed(variable) else 0.0
        if not summed:
            return 0.0
        gradient = summed * self.d / (2 * (self.d - 1))  # the summed gradient's bytes on one device
        return gradient * (self.d + 1) / self.d - summed

    def windowed_gather(self, variable: keras.Variable, gathered: float) -> float:
        """What XLA:TPU's windowed gather of a kernel read with the model's input sends beyond an all-gather.

        Where its gradient is windowed (`windowed_sync`), a kernel whose projection reads the model's
        input (no input gradient) is gathered forward by a windowed einsum too: `d + 1`
        collective-permutes of its shard in place of the all-gather's `d - 1` (a Dense MLP's first
        kernel at 16,384 rows, fully sharded: over `data=8` 9 permutes, over `data=16` 17).
        """
        from_input = any(from_input for *_, from_input, _ in self.calls(variable.path))
        return 2 * gathered / self.d if from_input and self._windowed(variable) else 0.0

    def _windowed(self, variable: keras.Variable) -> bool:
        """Whether XLA:TPU computes this kernel's projections as windowed einsums over the batch axis:
        a batch axis of `WINDOWED_SIZES` devices, `WINDOWED_ROWS` rows or more contracted."""
        rows = max((math.prod(inputs[:-1]) for inputs, *_ in self.calls(variable.path)), default=0)
        return windowed_on_tpu(self.compiler, self.d, rows)

    def cast_gathers(
        self, owner: keras.layers.Layer | None, kernel: keras.Variable, shards: int, over_both: bool = False
    ) -> float:
        """Of a whole kernel's gathers over `shards` devices, what XLA:TPU sends cast to bfloat16.

        They are `Candidate.cast`: between the slices of a multi-slice target XLA:TPU sends them in
        float32 (measured with libtpu 0.0.42.1 on two v5e 2×2 slices, a fully sharded MLP). None for
        a weight of one dimension (gathered in float32), a copy gathered over both axes as an
        all-reduce (`gathered_as_all_reduce`), or a kernel split over a batch axis smaller than
        the model axis (moved to the model axis instead, `OneWeightCosts._permuted_kernel`).
        """
        share = self.gathered_share(kernel)
        alone_permuted = not over_both and self.d < self.m
        if share == 1 or len(kernel.shape) < 2 or alone_permuted:
            return 0.0
        if over_both and self.gathered_as_all_reduce(kernel):
            return 0.0
        count = self.gathers_per_step(owner, kernel, nbytes(kernel), "whole")
        return count * wire_bytes("all-gather", nbytes(kernel) * share, shards)

    def gathered_as_all_reduce(self, kernel: keras.Variable) -> bool:
        """Whether XLA:TPU gathers a kernel over both axes as an all-reduce of its shard written into
        zeros (`_one_weight.OneWeightCosts._gathers_over_both`): a bfloat16 copy of at most the
        generation's `reduced_gathers` bytes, over `REDUCED_GROUP` devices or more."""
        gathered = nbytes(kernel) * self.gathered_share(kernel)
        over = self.d * self.m >= REDUCED_GROUP
        return self.compiler == "tpu" and over and gathered <= self.reduced_gathers

    def gathered_share(self, variable: keras.Variable) -> float:
        """The share of a kernel's bytes an all-gather over the batch axis sends: on XLA:TPU a float32
        kernel is cast to bfloat16 before it is gathered (measured on v5e, see `gathers_per_step`).

        An int4 kernel is gathered dequantized: two elements of the compute dtype a stored byte
        (measured on XLA:CPU, keras-hub Llama under `quantize("int4")`, fully sharded on 2×4:
        float32, gathered forward and again for the input gradient, which dequantizes it anew).
        """
        if variable.path in self.int4:
            return 2.0 * self.int4[variable.path]
        if self._int8_kernel(variable) and not all(u.from_input for u in self.uses.get(variable.path, ())):
            return (1.0 + 4.0) / 2  # the mean of its two gathers (`_int8_kernel`)
        itemsize = np.dtype(variable.dtype).itemsize
        return 2 / itemsize if self.compiler == "tpu" and itemsize > 2 else 1.0

    def _int8_kernel(self, kernel: keras.Variable) -> bool:
        """Whether `kernel` is an int8 `Dense` or `EinsumDense` kernel (`quantize("int8")`).

        Split over the batch axis, XLA:CPU gathers it as stored (one byte an element) for the
        forward pass, and where its input needs a gradient, gathers again the float32 kernel that
        Keras's custom gradient dequantizes for it (measured on keras-hub Gemma with LoRA, its
        smallest plan on 2×4: the feed-forward and attention output kernels gathered in int8 forward
        and float32 backward; the query, key and value ones, reading a frozen table's rows, once).
        """
        uses = self.uses.get(kernel.path, ())
        return (
            self.compiler != "tpu"  # XLA:TPU not calibrated (docs/status.md)
            and str(kernel.dtype) == "int8"
            and kernel.path not in self.int4
            and kernel.path.endswith("/kernel")
            and bool(uses)
            and all(use.kind == "matmul" for use in uses)
        )

    def _input_gradient(self, layer: keras.layers.Layer | None, kernel: keras.Variable, use) -> float:
        """What a kernel split over the batch axis alone on its input features sends for its input gradient.

        Nothing while XLA keeps the kernel gathered for the forward pass (`gathers_per_step`);
        otherwise the output's gradient of the whole batch is gathered, and its product with the
        kernel's shards (the input gradient of the whole batch, split on its features) is turned
        into each device's rows by an all-to-all; over 4 devices or more, the kernel is gathered
        again instead where that sends no more. Measured on XLA:CPU, a Dense MLP on `data=2` and
        `data=8` with `model=1`, 2 to 512 rows per device: `data=8` gathered the output gradient at
        2 and 8 rows, the kernel at 32 (a tie), kept it at 128; `data=2` gathered the output
        gradient at 8, 32 and 128 rows (at 128 more than the kernel would send), kept it at 512.
        """
        size, d = nbytes(kernel), self.d
        if not self._regathered(layer, kernel, size, "whole"):
            return 0.0
        again = wire_bytes("all-gather", size, d)
        output = self._activation(use.output, use.dtype) * d
        moved = wire_bytes("all-gather", output, d) + wire_bytes(
            "all-to-all", self._activation(use.inputs, use.dtype), d
        )
        return moved if moved < again or d < 4 else again

    def _whole_kernel_gathers(self, layer: keras.layers.Layer | None, kernel: keras.Variable, use) -> float:
        """A kernel split over the batch axis alone, on its input features: its gathers and input gradient.

        XLA:CPU gathers it once forward, its input gradient as `_input_gradient` says. XLA:TPU
        gathers it in bfloat16 (`gathers_per_step`), and, where the output gradient of the whole
        batch holds fewer elements than the kernel, also gathers that (in bfloat16) and moves the
        input gradient (an all-to-all in float32): measured on v5e `data=8`, a Dense MLP 64→512→64,
        at 2, 8 and 32 rows per device, not at 128 or 512 (predicted 0.996–0.997 of the compiled
        bytes), and not for a keras-hub Mixtral's output table (256×1024, 512 tokens; XLA:CPU's
        rule, `_regathered`, said it did: 1.043 of the compiled `data` bytes on `data=8`); its
        gradient's all-reduce (counted with the weight) is a windowed reduce-scatter from
        `WINDOWED_ROWS` rows (`windowed_sync`).
        """
        size, d = nbytes(kernel), self.d
        if self.compiler != "tpu":
            return wire_bytes("all-gather", size, d) + self._input_gradient(layer, kernel, use)
        share = self.gathered_share(kernel)
        count = self.gathers_per_step(layer, kernel, size, "whole")
        # Over `REDUCED_GROUP` devices or more, gathered as an all-reduce (as over both axes).
        kind = "all-reduce" if d >= REDUCED_GROUP and self.gathered_as_all_reduce(kernel) else "all-gather"
        wire = count * wire_bytes(kind, size * share, d) + self.windowed_sync(kernel, 1)
        wire += self.windowed_gather(kernel, size * share)
        if use.from_input or math.prod(use.output) >= math.prod(kernel.shape):
            return wire
        output = self._activation(use.output, use.dtype) * d * share
        moved = wire_bytes("all-to-all", self._summed(use.inputs, use.dtype), d)
        return wire + wire_bytes("all-gather", output, d) + moved
