"""What only Orbax storage (`kml.save_checkpoint`'s default) does: one copy of each shard, slice reads.

Every process writes only the shards its devices hold (one copy of each, not
one per replica), and a load reads, in every process, only the slices its
devices hold under the current plan; without rollback it reads and assigns a
group of arrays at a time. The guarantees both storages share (bit-exact
round trips on other meshes, bad input, failed loads, interrupted, killed and
full-disk saves, Keras's Orbax defects) are tested for each storage in
tests/test_checkpoint.py, and saves from 2 processes × 4 devices in
tests/test_checkpoint_processes.py.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import jax
import keras
import numpy as np
import pytest
from helpers import assert_bit_identical, assert_laid_out_as_planned, mlp, values
from jax.sharding import SingleDeviceSharding

import keras_meshlayout as kml
from keras_meshlayout.checkpoint import _manifest, _orbax_store

RULES = [
    (r".*fc1/kernel", (None, "model")),
    (r".*fc1/bias", ("model",)),
    (r".*fc2/kernel", ("model", None)),
]
MESHES = {"2x4": "data=2,model=4", "1x8": "data=1,model=8", "8x1": "data=8,model=1"}
BATCH, STEPS = 32, 4


def distribution_for(name: str) -> kml.ModelParallel | None:
    if name == "none":
        return None
    return kml.ModelParallel(kml.Mesh.parse(MESHES[name]), RULES, batch_axis="data", replicate_below=0)


def build_mlp() -> keras.Model:
    return mlp(16, ("fc1", 128, "relu"), ("fc2", 64, "relu"), ("head", 8))


def compiled(build: Callable[[], keras.Model] = build_mlp) -> keras.Model:
    model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 16)).astype("float32")
    return x, x[:, :8].argmax(axis=1).astype("int32")


def assert_laid_out_for(model: keras.Model) -> None:
    distribution = keras.distribution.distribution()
    variables = [*model.weights, *model.optimizer.variables]
    if distribution is None:
        assert all(isinstance(v.value.sharding, SingleDeviceSharding) for v in variables)
    else:
        assert_laid_out_as_planned(model, distribution.plan(model), distribution.device_mesh)


@dataclasses.dataclass(frozen=True)
class Saved:
    values: list[np.ndarray]
    path: Path


def train_and_save(mesh: str, path: Path) -> Saved:
    keras.distribution.set_distribution(distribution_for(mesh))
    keras.utils.set_random_seed(1)
    model = compiled()
    model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert all(np.abs(np.asarray(v.value)).max() > 0 for v in model.optimizer.variables[2:]), "Adam moments"
    kml.save_checkpoint(model, path)  # Orbax, the default
    saved = Saved(values(model), path)
    keras.distribution.set_distribution(None)
    return saved


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Saved]:
    """The recipe trained and saved with Orbax on 2×4, and on one device."""
    directory = tmp_path_factory.mktemp("orbax-saved")
    return {
        "2x4": train_and_save("2x4", directory / "2x4"),
        "none": train_and_save("none", directory / "none"),
    }


@pytest.mark.parametrize("group_bytes", [4096, None], ids=["small-groups", "one-group"])
def test_orbax_load_without_rollback_reads_and_assigns_a_group_at_a_time(group_bytes, saved, monkeypatch):
    """rollback=False reads about GROUP_BYTES at a time and assigns it, freeing what it replaces."""
    import orbax.checkpoint as ocp

    monkeypatch.setattr(_orbax_store, "GROUP_BYTES", group_bytes)
    reads = []
    restore = ocp.PyTreeCheckpointer.restore

    def counted(self, directory, *args, **kwargs):
        reads.append(len(kwargs["args"].item))
        return restore(self, directory, *args, **kwargs)

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", counted)
    keras.distribution.set_distribution(distribution_for("1x8"))
    model = compiled()
    kml.load_checkpoint(model, saved["2x4"].path, rollback=False)
    monkeypatch.undo()
    assert_bit_identical(model, saved["2x4"].values)
    assert_laid_out_for(model)
    assert sum(reads) == len(saved["2x4"].values)
    if group_bytes is None:
        assert len(reads) == 2, "the model's arrays, then the optimizer's"
    else:
        assert len(reads) > 6, reads


def data_bytes(path: Path) -> int:
    """Bytes of the array data files an Orbax checkpoint lists (chunks and their b-tree nodes)."""
    listing = json.loads((path / "manifest.json").read_text())["files"]
    return sum(e["bytes"] for name, e in listing.items() if "/ocdbt.process_" in f"/{name}")


def test_orbax_checkpoint_holds_plan_manifest_and_one_copy_of_each_shard(saved, tmp_path):
    path = saved["2x4"].path
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json",
        "model.orbax",
        "optimizer.orbax",
        "plan.json",
    ]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == _manifest.ORBAX_FORMAT
    assert manifest["weights_sha256"] == _orbax_store.digest(manifest["files"])
    assert set(manifest["files"]) == set(_orbax_store.files(path)), "every file Orbax wrote is listed"
    # On data=8 every variable has 8 replicas: one copy of each is stored, as from one device.
    keras.distribution.set_distribution(distribution_for("8x1"))
    model = compiled()
    kml.load_checkpoint(model, saved["none"].path)
    kml.save_checkpoint(model, tmp_path / "replicated")
    one, eight = data_bytes(saved["none"].path), data_bytes(tmp_path / "replicated")
    assert one > 0.5 * sum(v.nbytes for v in saved["none"].values)
    assert eight < 2 * one, f"{eight} bytes stored for 8 replicas, {one} for one copy"


def test_storage_must_be_known(tmp_path):
    model = build_mlp()
    with pytest.raises(
        kml.InvalidOptionError,
        match=r'storage must be "orbax" \(the default\) or "h5". Received: storage=\'zarr\'',
    ):
        kml.save_checkpoint(model, tmp_path / "ckpt", storage="zarr")
    with pytest.raises(kml.InvalidOptionError, match="storage must be"):
        kml.ResumableCheckpoint(tmp_path, storage="zarr")


def stored_chunks(path: Path) -> list[tuple[int, ...]]:
    """The chunk shape Orbax stored each model array in, in the model's order."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.PyTreeCheckpointer()
    try:
        tree = checkpointer.metadata(path / _orbax_store.DIRECTORIES["model"]).item_metadata.tree
    finally:
        checkpointer.close()
    return [tuple(tree[_orbax_store.key(i)].storage.chunk_shape) for i in range(len(tree))]


# The model's arrays on 2×4 (fc1 kernel split over "model" on its columns, fc2 kernel on its rows,
# the rest whole), each stored in chunks of at most 1 KiB, split along its sharded axis first.
SMALL_CHUNKS = [(16, 16), (32,), (4, 64), (64,), (32, 8), (8,)]


@pytest.mark.parametrize(
    ("chunk_bytes", "chunks", "fc2_read"),
    [(1024, SMALL_CHUNKS, 1), (None, None, 2)],
    ids=["1KiB-chunks", "default-chunks"],
)
def test_orbax_stores_small_chunks_so_a_load_on_another_mesh_reads_only_its_shards(
    chunk_bytes, chunks, fc2_read, saved, tmp_path, monkeypatch
):
    """Each saved shard is stored in chunks of at most CHUNK_BYTES along its sharded axes, so a
    shard laid out otherwise on load (fc2's rows split 8 ways, saved 4 ways) reads only itself;
    stored as whole shards (the tiny model's shards are under the default 1 MiB), it reads twice
    its bytes. The read limit is the largest such read, or READ_BYTES."""
    path = saved["2x4"].path
    if chunk_bytes is not None:
        monkeypatch.setattr(_orbax_store, "CHUNK_BYTES", chunk_bytes)
        keras.distribution.set_distribution(distribution_for("2x4"))
        model = compiled()
        kml.load_checkpoint(model, path)
        path = tmp_path / "small-chunks"
        kml.save_checkpoint(model, path)
        assert stored_chunks(path) == chunks
        assert all(np.prod(c) * 4 <= chunk_bytes for c in stored_chunks(path))
    keras.distribution.set_distribution(distribution_for("1x8"))
    model = compiled()
    structs = [jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.value.sharding) for v in model.weights]
    reads = [_orbax_store.shard_read_bytes(s, c) for s, c in zip(structs, stored_chunks(path), strict=True)]
    held = [int(np.prod(s.sharding.shard_shape(s.shape))) * 4 for s in structs]
    assert reads[2] == fc2_read * held[2], "fc2/kernel: rows 16 per device, saved 32 per shard"
    limit = _orbax_store._read_limit(path, {"model": structs})
    assert limit == max(_orbax_store.READ_BYTES, max(reads) + 4096)
    kml.load_checkpoint(model, path, rollback=False)
    assert_bit_identical(model, saved["2x4"].values)
    assert_laid_out_for(model)
