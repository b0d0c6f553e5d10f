"""Each process's share of the data: which rows of every global batch a process feeds.

Keras's JAX trainer builds each global batch from the part every process
passes to `fit` (`jax.make_array_from_process_local_data`). `process_batch_block`
says which positions of the batch axis a process's devices hold (the
distribution lays out its batches by it), `local_batch_size` how many rows that
is, and `process_slice` gives a process exactly its part: of numpy arrays, of a
Python generator's batches, or of a `keras.utils.PyDataset`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import keras
import numpy as np

from ._errors import IndivisibleBatchError, InvalidMeshError, InvalidOptionError, MeshLayoutError

__all__ = ["local_batch_size", "process_batch_block", "process_slice"]


def process_batch_block(
    mesh: keras.distribution.DeviceMesh, batch_axis: str, process: int | None = None
) -> tuple[int, int, int]:
    """The positions of the batch axis whose data a process feeds.

    Args:
        mesh: The mesh.
        batch_axis: The mesh axis the batch is split over.
        process: A process index; defaults to this process.

    Returns:
        `(first, stop, size)`: the process's devices sit at positions
        `first .. stop - 1` of the batch axis, which has `size` positions.
        The process feeds rows `first * B // size` to `stop * B // size` of
        each global batch of `B` rows.

    Raises:
        InvalidMeshError: the batch axis is not an axis of the mesh, the
            process holds no device of the mesh, or its positions are not
            contiguous (JAX needs one block of rows per process).
    """
    import jax

    names = tuple(mesh.axis_names)
    if batch_axis not in names:
        raise InvalidMeshError(
            f"The batch axis {batch_axis!r} is not an axis of the mesh, which has axes {names}. "
            "Fix: pass the distribution's batch axis."
        )
    process = jax.process_index() if process is None else process
    devices = np.asarray(mesh.backend_mesh.devices)
    axis = names.index(batch_axis)
    mine = np.vectorize(lambda d: int(getattr(d, "process_index", 0)) == process, otypes=[bool])(devices)
    positions = sorted(set(np.argwhere(mine)[:, axis].tolist()))
    if not positions:
        raise InvalidMeshError(
            f"Process {process} holds no device of the mesh {dict(zip(names, mesh.shape, strict=True))}, "
            "so it has no share of the batch. Fix: build the mesh over the devices of every process "
            "(kml.Mesh uses jax.devices(), all of them, by default)."
        )
    first, stop = positions[0], positions[-1] + 1
    if len(positions) != stop - first:
        raise InvalidMeshError(
            f"Process {process} holds positions {positions} of batch axis {batch_axis!r}, which are "
            "not contiguous, but each process must feed one contiguous block of every batch. Fix: "
            f'build the mesh with kml.Mesh(..., across_processes=("{batch_axis}",)).'
        )
    return first, stop, devices.shape[axis]


def local_batch_size(global_batch_size: int, distribution: Any = None) -> int:
    """How many rows of each global batch this process feeds.

    Pass it as `batch_size` to `fit` with the arrays from `process_slice`.

    Args:
        global_batch_size: Rows in each global batch (over all processes).
        distribution: A Keras distribution; defaults to the current one.

    Returns:
        The rows per process: `global_batch_size` in a single process, half
        of it on a mesh whose batch axis spans two processes.

    Raises:
        IndivisibleBatchError: `global_batch_size` does not divide by the
            batch axis.

    Example:
        >>> import keras_meshlayout as kml
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4))
        >>> kml.local_batch_size(64, dist)  # one process feeds the whole batch
        64
    """
    slicer = _slicer_for(distribution)
    if slicer is None:
        return int(global_batch_size)
    low, high = slicer.rows(int(global_batch_size))
    return high - low


def process_slice(data: Any, *, batch_size: int | None = None, distribution: Any = None) -> Any:
    """This process's part of global batches, for `model.fit` in a multi-process run.

    In a multi-process run each process passes `fit` only the rows of each
    global batch that its devices hold along the batch axis (Keras builds the
    global batch with `jax.make_array_from_process_local_data`). With data
    across processes on `data=2`, process 0 feeds the first half of every
    batch and process 1 the second half. Alone, a process feeds everything.

    Args:
        data: One of
            - arrays (numpy or anything with `shape`), or a tuple, list or
              dict of them: one global batch, or with `batch_size`, the whole
              dataset, cut into global batches of `batch_size` rows in order
              (a short last batch included);
            - an iterator or generator of global batches (arrays or
              structures of them): returns a generator of this process's
              parts;
            - a `keras.utils.PyDataset` whose items are global batches:
              returns a `PyDataset` of this process's parts.
        batch_size: Global batch size, when `data` holds several batches.
            Then pass `kml.local_batch_size(batch_size)` to `fit`. Shuffling
            in `fit` then shuffles each process's rows on their own, which
            trains fine; pass `shuffle=False` to reproduce a single-process
            run exactly. Every process must get the same number of batches.
        distribution: A Keras distribution (a `kml.ModelParallel` or Keras's
            own); defaults to the current one.

    Returns:
        The same kind of data, holding only this process's rows.

    Raises:
        IndivisibleBatchError: a global batch does not divide by the batch
            axis size, so the processes cannot get equal parts.
        MeshLayoutError: the data are of a kind this cannot split, or their
            arrays differ in length, or a multi-process run has no
            distribution.

    Example:
        >>> import numpy as np, keras_meshlayout as kml
        >>> dist = kml.ModelParallel(kml.Mesh(data=2, model=4))
        >>> x = np.arange(16).reshape(8, 2)
        >>> kml.process_slice(x, distribution=dist).shape  # alone: all 8 rows
        (8, 2)
        >>> kml.process_slice(np.arange(7), distribution=dist)
        Traceback (most recent call last):
        ...
        keras_meshlayout.core._errors.IndivisibleBatchError: A global batch of 7 rows cannot be split ...
    """
    slicer = _slicer_for(distribution)
    if slicer is None:
        return data
    if isinstance(data, keras.utils.PyDataset):
        return _ProcessPyDataset(data, slicer)
    if _is_structure(data):
        if batch_size is None:
            return slicer.batch(data)
        return slicer.dataset(data, int(batch_size))
    if isinstance(data, Iterator):
        return _process_batches(data, slicer)
    raise MeshLayoutError(
        f"process_slice cannot split data of type {type(data).__name__}. Received: {data!r:.200}. "
        "It takes numpy arrays (or a tuple, list or dict of them), an iterator or generator of "
        "such batches, or a keras.utils.PyDataset. For a tf.data.Dataset, let Keras shard it "
        "(ModelParallel(..., auto_shard_dataset=True))."
    )


@dataclasses.dataclass(frozen=True)
class _RowSlicer:
    """Cuts this process's rows out of global batches (picklable, for PyDataset workers)."""

    first: int
    stop: int
    size: int
    batch_axis: str

    def rows(self, global_batch: int) -> tuple[int, int]:
        if global_batch % self.size:
            raise IndivisibleBatchError(
                f"A global batch of {global_batch} rows cannot be split over batch axis "
                f"{self.batch_axis!r} of size {self.size}: {global_batch} is not a multiple of "
                f"{self.size}, so the processes cannot feed equal parts. Fix: use a global batch "
                f"size that is a multiple of {self.size}; for the short last batch of a dataset, "
                f"make the number of samples a multiple of {self.size} (or drop the remainder)."
            )
        per_position = global_batch // self.size
        return self.first * per_position, self.stop * per_position

    def batch(self, batch: Any) -> Any:
        length = _common_length(batch)
        if length is None:
            return batch
        low, high = self.rows(length)
        return _map_arrays(lambda a: a[low:high], batch)

    def dataset(self, data: Any, batch_size: int) -> Any:
        if batch_size < 1:
            raise InvalidOptionError(f"batch_size must be a positive integer. Received: {batch_size!r}.")
        length = _common_length(data)
        if length is None:
            return data
        full = length - length % batch_size
        low, high = self.rows(batch_size)
        tail = self.rows(length - full) if full < length else (0, 0)

        def cut(array: Any) -> np.ndarray:
            array = np.asarray(array)
            head = array[:full].reshape((full // batch_size, batch_size, *array.shape[1:]))
            head = head[:, low:high].reshape((-1, *array.shape[1:]))
            return np.concatenate([head, array[full:][tail[0] : tail[1]]])

        return _map_arrays(cut, data)


def _slicer_for(distribution: Any) -> _RowSlicer | None:
    import jax

    distribution = keras.distribution.distribution() if distribution is None else distribution
    if distribution is None:
        if jax.process_count() == 1:
            return None
        raise MeshLayoutError(
            f"This is process {jax.process_index()} of {jax.process_count()}, but no distribution "
            "is set, so which rows of each batch it feeds is unknown. Fix: set the distribution "
            "first (keras.distribution.set_distribution(dist)) or pass distribution=dist."
        )
    mesh = getattr(distribution, "device_mesh", None)
    batch_axis = getattr(distribution, "batch_dim_name", None)
    if mesh is None or batch_axis is None:
        raise MeshLayoutError(
            f"The distribution {distribution!r} has no device mesh or batch axis. Fix: use a "
            "kml.ModelParallel, or Keras's ModelParallel or DataParallel."
        )
    first, stop, size = process_batch_block(mesh, batch_axis)
    return _RowSlicer(first, stop, size, batch_axis)


def _is_array(value: Any) -> bool:
    return hasattr(value, "shape") and hasattr(value, "__getitem__") and len(value.shape) > 0


def _is_structure(data: Any) -> bool:
    if _is_array(data):
        return True
    if isinstance(data, (tuple, list)):
        return all(_is_structure(item) or item is None for item in data) and any(
            item is not None for item in data
        )
    if isinstance(data, dict):
        return bool(data) and all(_is_structure(item) or item is None for item in data.values())
    return False


def _map_arrays(function: Callable[[Any], Any], data: Any) -> Any:
    if data is None:
        return None
    if isinstance(data, dict):
        return {key: _map_arrays(function, value) for key, value in data.items()}
    if isinstance(data, (tuple, list)):
        return type(data)(_map_arrays(function, item) for item in data)
    return function(data)


def _common_length(data: Any) -> int | None:
    lengths: list[int] = []
    _map_arrays(lambda a: lengths.append(int(a.shape[0])), data)
    if len(set(lengths)) > 1:
        raise MeshLayoutError(
            f"The arrays of one batch have different numbers of rows: {lengths}. Every input, "
            "target and sample weight must have the same first dimension."
        )
    return lengths[0] if lengths else None


def _process_batches(batches: Iterable[Any], slicer: _RowSlicer) -> Iterator[Any]:
    for batch in batches:
        if not _is_structure(batch):
            raise MeshLayoutError(
                f"process_slice expects each batch of the generator to be arrays or a tuple, list or "
                f"dict of them. Received a {type(batch).__name__}."
            )
        yield slicer.batch(batch)


class _ProcessPyDataset(keras.utils.PyDataset):
    """A `PyDataset` that yields this process's part of each batch of another."""

    def __init__(self, dataset: keras.utils.PyDataset, slicer: _RowSlicer) -> None:
        super().__init__(
            workers=dataset.workers,
            use_multiprocessing=dataset.use_multiprocessing,
            max_queue_size=dataset.max_queue_size,
        )
        self.dataset = dataset
        self.slicer = slicer

    @property
    def num_batches(self) -> int | None:
        return self.dataset.num_batches

    def __getitem__(self, index: int) -> Any:
        batch = self.dataset[index]
        if not _is_structure(batch):
            raise MeshLayoutError(
                f"process_slice expects each item of the PyDataset to be arrays or a tuple, list or "
                f"dict of them. Item {index} is a {type(batch).__name__}."
            )
        return self.slicer.batch(batch)

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()
