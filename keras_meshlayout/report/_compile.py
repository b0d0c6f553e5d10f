"""The compile check: the real Keras training step compiled for a mesh, from a dry build.

`compile_step` builds the model with no weight allocated (as `kml.dry_plan` does), gives each
variable the sharding the distribution resolves for it, and compiles Keras's own
`train_step` ahead of time with the state donated, as `fit` runs it. On a TPU target
(`kml.Mesh(..., target="tpu-v5e:16x16")`) that is XLA:TPU compiling on this machine: its
`memory_analysis()` is what one chip would hold, its HLO what the chips would send.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .. import _compat
from ..core._dry import _deferred_variables, names_handed_back, new_optimizer
from ..core._errors import InvalidOptionError, UnmatchedRuleWarning
from ..core._format import Displayed, did_you_mean, format_bytes, to_text
from ..core._mesh import jax_device_grid
from ..core._model_calls import failing_on
from ..core._planning import plan_model
from ._comm import CommReport, report_of

if TYPE_CHECKING:
    import keras
    import rich.console

    from ..core._distribution import ModelParallel

__all__ = ["CompiledStep", "compile_step"]


@dataclasses.dataclass(frozen=True)
class CompiledStep(Displayed):
    """What XLA says of one compiled training step, per device.

    Attributes:
        platform: JAX's platform of the devices compiled for (`"tpu"`, `"cpu"`).
        device_kind: Their kind (`"TPU v5 lite"`).
        argument_bytes: The step's inputs on one device: the training state and the batch.
        output_bytes: Its outputs (the new state, the metrics).
        alias_bytes: Outputs written over donated inputs (the state, as `fit` donates it).
        temp_bytes: Temporaries: activations kept for the backward pass, gradients, workspace.
        unread_bytes: State the step never reads, which `jax.jit` drops from the executable (and
            `memory_analysis()` from its arguments) while the device still holds it through the
            step: Adafactor's velocity of a matrix, rewritten from its row and column statistics
            each step, not updated from its old value.
        peak_bytes: `argument_bytes + output_bytes - alias_bytes + temp_bytes + unread_bytes`,
            what one device holds at most while the step runs.
        live_peak_bytes: On XLA:TPU, its own peak of the bytes live at once
            (`memory_analysis()`'s `peak_memory_in_bytes`, over HBM and the chip's vector
            memory together); `peak_bytes` far above it is how loosely the HBM heap is
            packed (1.77x on a 2-layer decoder of hidden 256 on v5e, 1.06x at 512:
            docs/status.md). `None` on other compilers: XLA:CPU's figure leaves out the
            temporaries.
        compile_seconds: Wall time of the lowering and compile.
        comm: The communication report read from this compile's own HLO.
    """

    platform: str
    device_kind: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    unread_bytes: int
    peak_bytes: int
    live_peak_bytes: int | None
    compile_seconds: float
    comm: CommReport

    def to_dict(self) -> dict[str, Any]:
        """The `"compiled"` entry of `keras-meshlayout plan --compile --json`, with the traffic."""
        return {
            "platform": self.platform,
            "device_kind": self.device_kind,
            "argument_bytes": self.argument_bytes,
            "output_bytes": self.output_bytes,
            "alias_bytes": self.alias_bytes,
            "temp_bytes": self.temp_bytes,
            "unread_bytes": self.unread_bytes,
            "peak_bytes": self.peak_bytes,
            "live_peak_bytes": self.live_peak_bytes,
            "compile_seconds": self.compile_seconds,
            "wire_bytes_per_device": self.comm.wire_bytes,
            "wire_bytes_by_axis": self.comm.wire_bytes_by_axis,
            "wire_bytes_by_network": self.comm.wire_bytes_by_network,
            "collectives": {
                kind: self.comm.count(kind) for kind in sorted({c.kind for c in self.comm.collectives})
            },
            "flops_per_device": self.comm.flops_per_device,
        }

    def __rich_console__(self, console: rich.console.Console, options: Any) -> Iterator[Any]:
        from rich.text import Text

        yield Text(
            f"compiled for {self.platform} ({self.device_kind}) in {self.compile_seconds:.1f} s, per device: "
            f"peak {format_bytes(self.peak_bytes)} (arguments {format_bytes(self.argument_bytes)}, outputs "
            f"{format_bytes(self.output_bytes)}, of which {format_bytes(self.alias_bytes)} over the donated "
            f"state, temporaries {format_bytes(self.temp_bytes)}"
            + (f", state the step never reads {format_bytes(self.unread_bytes)}" if self.unread_bytes else "")
            + ("" if self.live_peak_bytes is None else f"; live at once {format_bytes(self.live_peak_bytes)}")
            + ")"
        )
        by_axis = ", ".join(f"{axis}: {format_bytes(b)}" for axis, b in self.comm.wire_bytes_by_axis.items())
        dcn = self.comm.wire_bytes_by_network["dcn"]
        between = f"; between slices (DCN): {format_bytes(dcn)}" if dcn else ""
        yield Text(
            f"compiled step sends per device: {format_bytes(self.comm.wire_bytes)} ({by_axis or 'nothing'})"
            + between
        )

    def __str__(self) -> str:
        return to_text(self, width=140)

    _repr_pretty_ = Displayed._repr_pretty_


_FIX = (
    "x and y are one global batch of the model's inputs and of its targets, as fit takes them; y "
    "shaped as the loss compares it with the model's output (or pass loss=)."
)


def compile_step(
    build: Callable[[], keras.Model],
    distribution: ModelParallel,
    x: Any,
    y: Any = None,
    *,
    optimizer: str | keras.optimizers.Optimizer | None = None,
    loss: Any = None,
) -> CompiledStep:
    """Compiles the model's Keras training step for the distribution's mesh; allocates no weight.

    The model `build()` returns is built with its variables deferred (as in
    `kml.dry_plan`), each given the sharding the distribution resolves for it, and
    Keras's own `train_step` is lowered and compiled for those shardings with the state
    donated, as `fit` compiles it. Nothing runs. On a mesh over a TPU target
    (`kml.Mesh(..., target="tpu-v5e:2x4")`) XLA:TPU compiles it on this machine, and the
    figures are one chip's. There is no such compile for GPUs without a GPU: there, plan
    with the prediction and run `kml.comm_report` on the real machine.

    Args:
        build: A function that builds and returns the Keras model. If it returns a
            compiled model (a keras-hub task compiles itself), its optimizer and loss
            are used where `optimizer` and `loss` are not given.
        distribution: The `kml.ModelParallel` to compile for.
        x: One global batch of inputs: arrays, `jax.ShapeDtypeStruct`s or anything with
            `shape` and `dtype`, in the model's input structure.
        y: The matching targets, likewise (`None` for a model without).
        optimizer: An optimizer or a name Keras knows (default: the model's own if
            `build` compiled it, else `"adam"`).
        loss: A loss (default: the model's own if `build` compiled it, else `"mse"`).

    Returns:
        The `CompiledStep`: XLA's per-device argument, output, temporary and peak bytes,
        and `comm`, the communication report of the compiled HLO.

    Example:
        >>> import jax, keras, numpy as np, keras_meshlayout as kml
        >>> mesh = kml.Mesh(data=2, model=4, target="tpu-v5e:2x4")
        >>> dist = kml.ModelParallel(mesh, [(r".*up/kernel", (None, "model"))])
        >>> def build():
        ...     return keras.Sequential([keras.Input((128,)), keras.layers.Dense(512, name="up")], name="m")
        >>> x = jax.ShapeDtypeStruct((16, 128), "float32")
        >>> step = kml.compile_step(build, dist, x, jax.ShapeDtypeStruct((16, 512), "float32"))
        >>> step.platform, step.device_kind
        ('tpu', 'TPU v5 lite')
        >>> parts = step.argument_bytes + step.output_bytes - step.alias_bytes + step.temp_bytes
        >>> step.peak_bytes == parts + step.unread_bytes, step.unread_bytes
        (True, 0)
    """

    started = time.perf_counter()
    with names_handed_back(), _deferred_variables():
        chosen = new_optimizer(optimizer if optimizer is not None else "adam")
        with distribution.scope():
            with _compat.stateless_scope():
                model = build()
                _compile_model(model, chosen, optimizer, loss)
                data = (_abstract(x), _abstract(y), None)
                with failing_on(model, {"x": x, "y": y}, _FIX):
                    _compat.symbolic_build(model, data)
                    # Traced in the scope too: the step reads the deferred variables' layouts.
                    lowered, compiled, unread = _lower(model, distribution, data)
            comm = report_of(model, distribution.device_mesh, lowered, compiled)
    device = jax_device_grid(distribution.device_mesh).flat[0]
    memory = comm.memory
    return CompiledStep(
        platform=str(device.platform),
        device_kind=str(device.device_kind),
        argument_bytes=memory["arguments"],
        output_bytes=memory["outputs"],
        alias_bytes=memory["aliased"],
        temp_bytes=memory["temporaries"],
        unread_bytes=unread,
        peak_bytes=memory["total"] + unread,
        compile_seconds=time.perf_counter() - started,
        live_peak_bytes=memory["live_peak"] if device.platform == "tpu" else None,
        comm=comm,
    )


def _compile_model(model: Any, chosen: Any, optimizer: Any, loss: Any) -> None:
    """`model.compile` with `chosen` and `loss` (default `"mse"`), unless `build` compiled it.

    A model `build` compiled (a keras-hub task compiles itself on construction) keeps its
    optimizer and loss, unless `optimizer` or `loss` is given: then it is compiled again
    with them, the other kept, as a training script would.
    """
    _check_loss(loss)
    if not model.compiled:
        model.compile(optimizer=chosen, loss="mse" if loss is None else loss)
    elif optimizer is not None or loss is not None:
        model.compile(
            optimizer=chosen if optimizer is not None else model.optimizer,
            loss=loss if loss is not None else model.loss,
        )


def _check_loss(loss: Any) -> None:
    """A loss named as Keras does not know it, refused here: Keras resolves it only when the step is
    traced, where its failure reads as the data's."""
    import keras

    if not isinstance(loss, str) or loss in ("crossentropy", "ce"):  # `compile` picks those by shape
        return
    try:
        keras.losses.get(loss)
    except ValueError:
        known = sorted(
            name
            for name in dir(keras.losses)
            if name.islower() and name not in ("get", "serialize", "deserialize") and not name.startswith("_")
        )
        raise InvalidOptionError(
            f"Keras knows no loss named {loss!r}.{did_you_mean(loss, known)} Fix: pass one of "
            f"{', '.join(known)}, or a keras.losses.Loss."
        ) from None


def _lower(model: Any, distribution: Any, data: Any) -> tuple[Any, Any, int]:
    """Keras's `train_step` lowered and compiled over abstract, sharded state; state donated as in `fit`.

    Returns the lowered and compiled step and the per-device bytes of the state it never reads
    (`CompiledStep.unread_bytes`)."""
    import jax
    import keras

    # The plan's layouts: an optimizer slot of a deferred parameter has no layout of its own
    # yet, and follows its parameter's (`plan_model` pairs them), as it will in `fit`.
    axes = {entry.path: entry.axes for entry in plan_model(distribution, model, optimizer=model.optimizer)}
    state = tuple(
        [_abstract_variable(v, distribution, axes.get(v.path)) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )

    def placed(array: Any) -> Any:
        if array is None:
            return None
        sharding = distribution.get_data_layout(array.shape).backend_layout
        return jax.ShapeDtypeStruct(array.shape, array.dtype, sharding=sharding)

    with warnings.catch_warnings():
        # `plan_model` above has checked the rules against every variable; the distribution's
        # own check, at its first batch layout, would count only the few it laid out here.
        warnings.simplefilter("ignore", UnmatchedRuleWarning)
        batch = keras.tree.map_structure(placed, data)
    shardings = tuple([s.sharding for s in group] for group in state)
    step = jax.jit(model.train_step, donate_argnums=0, out_shardings=(None, shardings))
    lowered = step.lower(state, batch)
    compiled = lowered.compile()
    return lowered, compiled, _unread_bytes(state, compiled)


def _unread_bytes(state: Any, compiled: Any) -> int:
    """Per-device bytes of the `state` leaves `compiled` does not take: `jax.jit` drops the arguments
    its program never reads (their input sharding is `None`), the device still holds them."""
    import jax
    import numpy as np

    kept = jax.tree.leaves(compiled.input_shardings[0][0], is_leaf=lambda s: s is None)
    leaves = jax.tree.leaves(state)
    if len(kept) != len(leaves):  # not the structure expected: count nothing rather than guess
        return 0
    return sum(
        math.prod(leaf.sharding.shard_shape(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        for leaf, sharding in zip(leaves, kept, strict=True)
        if sharding is None
    )


def _abstract(data: Any) -> Any:
    """The structure of `data` as `jax.ShapeDtypeStruct`s (no sharding yet)."""
    import jax
    import keras
    import numpy as np

    def one(array: Any) -> Any:
        if array is None:
            return None
        if not hasattr(array, "shape") or not hasattr(array, "dtype"):
            array = np.asarray(array)
        return jax.ShapeDtypeStruct(tuple(array.shape), keras.backend.standardize_dtype(array.dtype))

    return None if data is None else keras.tree.map_structure(one, data)


def _abstract_variable(variable: Any, distribution: Any, axes: Any) -> Any:
    """A variable's shape and dtype with the sharding of its plan entry; replicated without one.

    Only metrics' totals have no entry, and `kml.ModelParallel` replicates them too.
    """
    import jax

    if axes is None:
        axes = (None,) * len(variable.shape)
    layout = _compat.tensor_layout(tuple(axes), distribution.device_mesh)
    return jax.ShapeDtypeStruct(tuple(variable.shape), variable.dtype, sharding=layout.backend_layout)
