"""Checkpoints whose arrays Orbax stores: `kml.save_checkpoint(..., storage="orbax")`.

Every process writes only the shards its devices hold (one copy of each, not
one per replica), and a load reads, in every process, only the slices its
devices hold under the current plan. The guarantees of the h5 format hold: a
small MLP trained with Adam on data=2 × model=4 restores bit for bit on 1×8,
4×2, 8×1 and with no distribution, laid out as the new plan says; a damaged,
half-written or foreign checkpoint is a clear `CheckpointError` with the model
untouched; an interrupted or killed save leaves the previous checkpoint in
place. The last case saves from 2 processes × 4 devices on loopback, with
every variable split across the processes, and restores in 2 processes on
another mesh and in this process on 1×8.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import assert_bit_identical, assert_laid_out_as_planned, values
from jax.sharding import SingleDeviceSharding

import keras_meshlayout as kml
from keras_meshlayout.checkpoint import _atomic, _manifest, _orbax_store, _save

RULES = [
    (r".*fc1/kernel", (None, "model")),
    (r".*fc1/bias", ("model",)),
    (r".*fc2/kernel", ("model", None)),
]
MESHES = {"2x4": "data=2,model=4", "1x8": "data=1,model=8", "4x2": "data=4,model=2", "8x1": "data=8,model=1"}
BATCH, STEPS = 32, 4
TESTS = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 150  # a hard bound on the launcher run; it finishes far sooner


def sizes(name: str) -> dict[str, int]:
    return {axis: int(size) for axis, size in (part.split("=") for part in MESHES[name].split(","))}


def distribution_for(name: str) -> kml.ModelParallel | None:
    if name == "none":
        return None
    return kml.ModelParallel(kml.Mesh.parse(MESHES[name]), RULES, batch_axis="data", replicate_below=0)


def build_mlp(extra: bool = False) -> keras.Model:
    layers = [
        keras.Input((16,)),
        keras.layers.Dense(128, activation="relu", name="fc1"),
        keras.layers.Dense(64, activation="relu", name="fc2"),
        keras.layers.Dense(8, name="head"),
    ]
    if extra:
        layers.append(keras.layers.Dense(8, name="extra"))
    return keras.Sequential(layers, name="mlp")


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


def train_and_save(mesh: str, path: Path, steps: int = STEPS) -> Saved:
    keras.distribution.set_distribution(distribution_for(mesh))
    keras.utils.set_random_seed(1)
    model = compiled()
    x, y = data()
    model.fit(x[: BATCH * steps], y[: BATCH * steps], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert all(np.abs(np.asarray(v.value)).max() > 0 for v in model.optimizer.variables[2:]), "Adam moments"
    kml.save_checkpoint(model, path, storage="orbax")
    saved = Saved(values(model), path)
    keras.distribution.set_distribution(None)
    return saved


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Saved]:
    """The recipe trained and saved with Orbax on 2×4, one step further (\"new\"), and on one device."""
    directory = tmp_path_factory.mktemp("orbax-saved")
    return {
        "2x4": train_and_save("2x4", directory / "2x4"),
        "new": train_and_save("2x4", directory / "new", steps=STEPS - 1),
        "none": train_and_save("none", directory / "none"),
    }


PAIRS = [("2x4", target) for target in ("1x8", "4x2", "8x1", "none")] + [("none", "2x4")]


@pytest.mark.parametrize(("source", "target"), PAIRS, ids=[f"{s}->{t}" for s, t in PAIRS])
def test_orbax_round_trip_is_bit_identical_and_laid_out_as_planned(source, target, saved):
    keras.distribution.set_distribution(distribution_for(target))
    model = compiled()
    diff = kml.load_checkpoint(model, saved[source].path)
    assert_bit_identical(model, saved[source].values)
    assert_laid_out_for(model)
    assert (diff is None) == ("none" in (source, target))
    if diff is not None:
        assert dict(diff.mesh_before) == sizes(source)
        assert dict(diff.mesh_after) == sizes(target)


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


def test_orbax_none_of_the_keras_orbax_callback_defects_apply(saved):
    """Keras 3.15's OrbaxCheckpoint (see tests/test_checkpoint.py): a reloaded Sequential restores
    nothing, an optimizer named otherwise gets no state back, and without a distribution the arrays
    come back on the saved mesh. Here: a Sequential, Adam named "adam_7", no distribution."""
    keras.distribution.set_distribution(None)
    model = build_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2, name="adam_7"), loss="mse")
    kml.load_checkpoint(model, saved["2x4"].path)
    assert model.optimizer.name == "adam_7" and isinstance(model, keras.Sequential)
    assert_bit_identical(model, saved["2x4"].values)
    assert_laid_out_for(model)  # every variable on one device


def test_orbax_loaded_model_trains_on_its_new_mesh(saved):
    keras.distribution.set_distribution(distribution_for("1x8"))
    model = compiled()
    kml.load_checkpoint(model, saved["2x4"].path)
    model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 2 * STEPS


def test_orbax_into_a_model_without_optimizer_loads_the_weights(saved):
    keras.distribution.set_distribution(distribution_for("4x2"))
    model = build_mlp()
    kml.load_checkpoint(model, saved["2x4"].path)
    for variable, want in zip(model.weights, saved["2x4"].values, strict=False):
        assert np.array_equal(np.asarray(variable.value), want), variable.path


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
    kml.save_checkpoint(model, tmp_path / "replicated", storage="orbax")
    one, eight = data_bytes(saved["none"].path), data_bytes(tmp_path / "replicated")
    assert one > 0.5 * sum(v.nbytes for v in saved["none"].values)
    assert eight < 2 * one, f"{eight} bytes stored for 8 replicas, {one} for one copy"


# -- bad input: a clear error, and nothing lost -----------------------------------------


def chunks(path: Path) -> list[Path]:
    """The data files of the model's arrays, largest first."""
    found = [p for p in (path / "model.orbax").rglob("*") if p.is_file() and p.parent.name == "d"]
    return sorted(found, key=lambda p: p.stat().st_size, reverse=True)


def truncate_a_chunk(path: Path) -> None:
    chunk = chunks(path)[0]
    chunk.write_bytes(chunk.read_bytes()[: chunk.stat().st_size // 2])


def flip_a_byte(path: Path) -> None:
    chunk = chunks(path)[0]
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))


def remove(name: str) -> Callable[[Path], None]:
    return lambda path: (path / name).unlink()


def edit_manifest(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        manifest = json.loads((path / "manifest.json").read_text())
        edit(manifest)
        (path / "manifest.json").write_text(json.dumps(manifest))

    return damage


def reshape_first_variable(manifest: dict) -> None:
    manifest["variables"][0]["shape"] = [16, 129]


def drop_a_file(manifest: dict) -> None:
    manifest["files"].pop(next(iter(manifest["files"])))


BAD = {
    "truncated chunk": (
        build_mlp,
        truncate_a_chunk,
        ["its arrays are missing, truncated or corrupt: model.orbax/", "(truncated or overwritten)"],
    ),
    "flipped byte": (build_mlp, flip_a_byte, ["does not match its checksum in the manifest (corrupt)"]),
    "missing metadata": (
        build_mlp,
        remove("model.orbax/_METADATA"),
        ["its arrays are missing, truncated or corrupt: model.orbax/_METADATA is missing"],
    ),
    "half-written": (build_mlp, remove("manifest.json"), ["has no manifest.json"]),
    "file list edited": (
        build_mlp,
        edit_manifest(drop_a_file),
        ['the file list in manifest.json does not match its "weights_sha256"'],
    ),
    "files field wrong": (
        build_mlp,
        edit_manifest(lambda m: m.__setitem__("files", [])),
        ["the field files must be a {name: {bytes, sha256}} mapping"],
    ),
    "variable shape edited": (
        build_mlp,
        edit_manifest(reshape_first_variable),
        [
            "manifest.json disagrees with the arrays stored in model.orbax/ and optimizer.orbax/:",
            "variables[0] mlp/fc1/kernel: shape (16, 129) in the manifest",
        ],
    ),
    "another model": (
        lambda: build_mlp(extra=True),
        lambda path: None,
        ["does not match the model", "missing from the checkpoint: extra/kernel (8, 8)"],
    ),
}


def randomise(model: keras.Model) -> None:
    rng = np.random.default_rng(7)
    for v in [*model.weights, *model.optimizer.variables]:
        v.assign(rng.normal(size=v.shape).astype(v.dtype) if "float" in str(v.dtype) else v.value)


@pytest.mark.parametrize("case", list(BAD))
def test_orbax_bad_input_is_a_clear_error_and_the_model_is_untouched(case, saved, tmp_path):
    build, damage, fragments = BAD[case]
    path = tmp_path / "ckpt"
    shutil.copytree(saved["2x4"].path, path)
    damage(path)
    keras.distribution.set_distribution(distribution_for("1x8"))
    model = compiled(build)
    model.optimizer.build(model.trainable_variables)
    randomise(model)
    before = values(model)
    with pytest.raises(kml.CheckpointError) as raised:
        kml.load_checkpoint(model, path)
    message = str(raised.value)
    for fragment in [*fragments, "Nothing was loaded; the model is unchanged."]:
        assert fragment in message, message
    assert all(np.array_equal(a, b) for a, b in zip(values(model), before, strict=True))


def test_orbax_a_load_that_fails_part_way_puts_everything_back(saved, monkeypatch):
    keras.distribution.set_distribution(distribution_for("2x4"))
    model = compiled()
    model.optimizer.build(model.trainable_variables)
    randomise(model)
    before = values(model)
    head = model.get_layer("head").kernel
    assign = type(head).assign

    failed = []

    def assign_or_fail(variable, value):
        if variable is head and not failed:  # once: putting it back works
            failed.append(variable.path)
            raise OSError("device lost")
        return assign(variable, value)

    monkeypatch.setattr(type(head), "assign", assign_or_fail)
    with pytest.raises(kml.CheckpointError, match=r"failed part-way \(OSError: device lost\)") as raised:
        kml.load_checkpoint(model, saved["2x4"].path)
    monkeypatch.undo()
    assert failed == ["mlp/head/kernel"], "weights before it were assigned: something to put back"
    assert "Every variable was put back as it was; the model is unchanged." in str(raised.value)
    assert all(np.array_equal(a, b) for a, b in zip(values(model), before, strict=True))


def test_orbax_storage_must_be_known(tmp_path):
    model = build_mlp()
    with pytest.raises(
        kml.InvalidOptionError, match=r'storage must be "h5" or "orbax". Received: storage=\'zarr\''
    ):
        kml.save_checkpoint(model, tmp_path / "ckpt", storage="zarr")
    with pytest.raises(kml.InvalidOptionError, match="storage must be"):
        kml.ResumableCheckpoint(tmp_path, storage="zarr")


# -- interrupted saves -------------------------------------------------------------------

KILL_POINTS = {
    "writing the arrays": "model.orbax",
    "writing the manifest": "manifest.json",
    "moving into place": "ckpt",
}


@pytest.mark.parametrize("cleanup", [True, False], ids=["exception", "killed"])
@pytest.mark.parametrize("point", list(KILL_POINTS))
def test_orbax_an_interrupted_save_leaves_the_previous_checkpoint_intact(
    point, cleanup, saved, tmp_path, monkeypatch
):
    path = tmp_path / "ckpt"
    shutil.copytree(saved["2x4"].path, path)
    old_manifest = (path / "manifest.json").read_bytes()
    keras.distribution.set_distribution(distribution_for("2x4"))
    model = compiled()
    model.optimizer.build(model.trainable_variables)
    randomise(model)

    failure = OSError(28, "No space left on device")
    if point == "writing the arrays":
        save = _orbax_store.save

        def save_then_fail(directory, arrays):
            save(directory, arrays)
            raise failure

        monkeypatch.setattr(_orbax_store, "save", save_then_fail)
    elif point == "writing the manifest":
        write_json = _atomic.write_json

        def write_json_until_manifest(file, content):
            if file.name == "manifest.json":
                file.write_text('{"format": 2, "vari')
                raise failure
            write_json(file, content)

        monkeypatch.setattr(_atomic, "write_json", write_json_until_manifest)
    else:

        def fail(partial, target):
            raise failure

        monkeypatch.setattr(_atomic, "replace_directory", fail)
    if not cleanup:
        monkeypatch.setattr(_save.shutil, "rmtree", lambda *args, **kwargs: None)

    with pytest.raises(kml.CheckpointError) as raised:
        kml.save_checkpoint(model, path, storage="orbax")
    monkeypatch.undo()
    message = str(raised.value)
    assert message.split("failed while writing ")[1].split(":")[0].endswith(KILL_POINTS[point]), message
    assert f"No space left on device (errno 28). The previous checkpoint at {path} is intact." in message
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.partial-")]
    assert len(leftovers) == (0 if cleanup else 1)
    assert (path / "manifest.json").read_bytes() == old_manifest
    fresh = compiled()
    kml.load_checkpoint(fresh, path)
    assert_bit_identical(fresh, saved["2x4"].values)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "the stale partial save is removed"


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def hidden(path: Path, kind: str, pid: int) -> Path:
    return path.with_name(f".{path.name}.{kind}-{_atomic.hostname()}-{pid}-0badc0de")


#: (previous checkpoint at, new one at, new one complete, new one damaged, which one a load finds)
WINDOWS = {
    "while writing the arrays": ("ckpt", "partial", False, False, "2x4"),
    "before the first rename": ("ckpt", "partial", True, False, "2x4"),
    "between the two renames": ("old", "partial", True, False, "new"),
    "between the two renames, the new one damaged": ("old", "partial", True, True, "2x4"),
    "before the old one is deleted": ("old", "ckpt", True, False, "new"),
}


@pytest.mark.parametrize("window", list(WINDOWS))
def test_orbax_a_save_killed_anywhere_loads_the_newest_complete_checkpoint(window, saved, tmp_path):
    previous, new, complete, damaged, expect = WINDOWS[window]
    dead, path = dead_pid(), tmp_path / "ckpt"
    places = {"ckpt": path, "old": hidden(path, "old", dead), "partial": hidden(path, "partial", dead)}
    shutil.copytree(saved["2x4"].path, places[previous])
    shutil.copytree(saved["new"].path, places[new])
    if not complete:
        (places[new] / "manifest.json").unlink()
    if damaged:
        truncate_a_chunk(places[new])
    keras.distribution.set_distribution(distribution_for("1x8"))
    model = compiled()
    kml.load_checkpoint(model, path)
    assert_bit_identical(model, saved[expect].values)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"], "what the killed save left is removed"


KILLED_SAVE = """
import os, signal, sys
from pathlib import Path

import keras_meshlayout as kml

kml.emulate_devices(8)
import keras
from keras_meshlayout.checkpoint import _orbax_store

path, point = Path(sys.argv[1]), sys.argv[2]
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(128, name="fc1")], name="mlp")
model.compile(optimizer="adam", loss="mse")
model.optimizer.build(model.trainable_variables)
kml.save_checkpoint(model, path, storage="orbax")
print("saved", flush=True)
save, replace = _orbax_store.save, os.replace


def die(*args):  # the fault: SIGKILL at this point of the second save
    os.kill(os.getpid(), signal.SIGKILL)


if point == "after the arrays are written":
    _orbax_store.save = lambda *args: (save(*args), die())
elif point == "between the two renames":
    os.replace = lambda src, dst: (replace(src, dst), die())
kml.save_checkpoint(model, path, storage="orbax")
"""


@pytest.mark.parametrize("point", ["after the arrays are written", "between the two renames"])
def test_orbax_a_save_killed_by_sigkill_is_recovered_and_cleaned_up(point, tmp_path):
    script = tmp_path / "save.py"
    script.write_text(KILLED_SAVE)
    path = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    run = subprocess.run(
        [sys.executable, str(script), str(path), point], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == -signal.SIGKILL and "saved" in run.stdout, run.stderr[-3000:]
    left = sorted(p.name.split(".")[2].split("-")[0] for p in tmp_path.iterdir() if p.name.startswith("."))
    assert left == (["partial"] if point == "after the arrays are written" else ["old", "partial"])
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(128, name="fc1")], name="mlp")
    kml.load_checkpoint(model, path)
    kml.save_checkpoint(model, path, storage="orbax")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "save.py"]


# -- 2 processes x 4 devices on loopback -------------------------------------------------

WORKER = """
import json, sys
from pathlib import Path

import keras_meshlayout as kml

process_id, num_processes = kml.initialize(emulate_devices=8)

import keras
import numpy as np

sys.path.insert(0, {tests!r})
from test_orbax_checkpoint import build_mlp, compiled, expected_values

out = Path(sys.argv[1])
RULES = [(r".*kernel", (None, "model")), (r".*bias", ("model",))]


def assign_expected(model):
    for variable, value in zip([*model.weights, *model.optimizer.variables], expected_values(), strict=True):
        variable.assign(value)


def shards_match(model):
    # Each process holds only its own slices: compare them with the expected whole values.
    for variable, want in zip([*model.weights, *model.optimizer.variables], expected_values(), strict=True):
        for shard in variable.value.addressable_shards:
            if not np.array_equal(np.asarray(shard.data), want[shard.index]):
                return variable.path
    return None


report = {{}}
# Fully sharded over all 8 devices: axis "model" spans both processes, each holds half of every kernel.
split = kml.Mesh(data=1, model=8, allow_split_across_processes=True)
keras.distribution.set_distribution(kml.ModelParallel(split, RULES, replicate_below=0))
model = compiled()
model.optimizer.build(model.trainable_variables)
assign_expected(model)
report["fully_addressable"] = [v.value.is_fully_addressable for v in model.weights]
kml.save_checkpoint(model, out / "ckpt", storage="orbax")

# Back in 2 processes, on another mesh (data across the processes, model within each).
keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), RULES, replicate_below=0))
restored = compiled()
diff = kml.load_checkpoint(restored, out / "ckpt")
report["mismatch"] = shards_match(restored)
report["mesh_before"] = dict(diff.mesh_before)
(out / f"report_{{process_id}}.json").write_text(json.dumps(report))
print(f"process {{process_id}} of {{num_processes}} done", flush=True)
"""


def expected_values() -> list[np.ndarray]:
    """Distinct values for every variable of `compiled()` (weights, then Adam's), the same everywhere."""
    rng = np.random.default_rng(5)
    keras.utils.set_random_seed(1)
    model = compiled()
    model.optimizer.build(model.trainable_variables)
    out = []
    for v in [*model.weights, *model.optimizer.variables]:
        dtype = np.dtype(v.dtype)
        out.append(
            rng.normal(size=v.shape).astype(dtype) if dtype.kind == "f" else np.full(v.shape, 7, dtype)
        )
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("orbax-two-processes")
    script = out / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(tests=str(TESTS))))
    drop = ("XLA_FLAGS", "KERAS_BACKEND", "JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in drop and not k.startswith(("KML_", "KERAS_DISTRIBUTION_", "SLURM_"))
    }
    command = [sys.executable, "-m", "keras_meshlayout.launch", "-n", "2", "--devices-per-process", "4"]
    command += ["--init-timeout", "60", "--timeout", str(LAUNCH_TIMEOUT_S - 20), str(script), str(out)]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=out, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S
    return out


def test_two_processes_write_their_own_shards_and_restore_on_another_mesh(two_processes):
    reports = [json.loads((two_processes / f"report_{i}.json").read_text()) for i in range(2)]
    for report in reports:
        assert not any(report["fully_addressable"]), "every kernel and bias is split across the processes"
        assert report["mismatch"] is None, report["mismatch"]
        assert report["mesh_before"] == {"data": 1, "model": 8}
    # Each process wrote its own shards, into its own part of the Orbax checkpoint.
    listing = json.loads((two_processes / "ckpt" / "manifest.json").read_text())["files"]
    for process in (0, 1):
        assert any(name.startswith(f"model.orbax/ocdbt.process_{process}/d/") for name in listing), listing


@pytest.mark.parametrize("target", ["1x8", "4x2", "none"])
def test_two_process_checkpoint_restores_in_one_process(target, two_processes):
    keras.distribution.set_distribution(None)
    expected = expected_values()
    keras.distribution.set_distribution(distribution_for(target))
    model = compiled()
    kml.load_checkpoint(model, two_processes / "ckpt")
    assert_bit_identical(model, expected)
    if target != "none":
        kernel = model.get_layer("fc1").kernel.value
        assert kernel.sharding.mesh.shape["model"] == sizes(target)["model"]


# -- a full disk ---------------------------------------------------------------------------

FULL_DISK = """
import json, os, sys
from pathlib import Path

import keras_meshlayout as kml

kml.emulate_devices(8)
import keras
import numpy as np

disk, out = Path(sys.argv[1]), Path(sys.argv[2])
keras.distribution.set_distribution(
    kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*fc1/kernel", (None, "model"))], replicate_below=0)
)
model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(2048, name="fc1")], name="mlp")
model.compile(optimizer="adam", loss="mse")
model.optimizer.build(model.trainable_variables)
path = disk / "ckpt"
kml.save_checkpoint(model, path, storage="orbax")
first = [np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]]
arrays = sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file() and ".orbax" in str(p))
for variable in model.weights:
    variable.assign(variable.value + 1.0)
stat = os.statvfs(disk)
with open(disk / "filler", "wb") as filler:  # room for a third of the arrays
    filler.write(b"0" * (stat.f_bavail * stat.f_frsize - arrays // 3))
try:
    kml.save_checkpoint(model, path, storage="orbax")
    error = None
except kml.CheckpointError as err:
    error = str(err)
(disk / "filler").unlink()
entries = sorted(p.name for p in disk.iterdir())
fresh = keras.Sequential([keras.Input((16,)), keras.layers.Dense(2048, name="fc1")], name="mlp")
fresh.compile(optimizer="adam", loss="mse")
kml.load_checkpoint(fresh, path)
intact = all(
    np.array_equal(np.asarray(v.value), w)
    for v, w in zip([*fresh.weights, *fresh.optimizer.variables], first, strict=True)
)
(out / "results.json").write_text(json.dumps({"error": error, "entries": entries, "intact": intact}))
"""


def test_orbax_a_full_disk_is_a_clear_error_and_the_previous_checkpoint_is_intact(tmp_path):
    """A real full disk (a 1 MiB tmpfs in a mount namespace of a child process) while Orbax writes."""
    (tmp_path / "disk").mkdir()
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    mount = 'mount -t tmpfs -o size=1m tmpfs "$0" && exec "$1" "$2" "$0" "$3"'
    command = ["unshare", "-rm", "sh", "-c", mount, tmp_path / "disk", sys.executable, script, tmp_path]
    run = subprocess.run([str(c) for c in command], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "results.json").read_text())
    message = result["error"]
    assert message is not None, "the disk was not full"
    assert message.split("failed while writing ")[1].split(":")[0].endswith(".orbax"), message
    assert "No space left on device" in message
    assert "/disk/ckpt is intact." in message and "Fix: free space on that disk" in message
    assert result["entries"] == ["ckpt"], "what the failed save had written is removed"
    assert result["intact"], "the previous checkpoint loads bit for bit"
