"""Orbax checkpoints written by 2 processes × 4 devices whose variables are split across the processes.

One launcher run on loopback (2 processes × 4 emulated CPU devices) trains a
small MLP with Adam under two layouts that split variables across processes:

- `fsdp`: mesh data=2 × model=4 with `data` across the processes (the default
  hybrid mesh), every kernel split over both axes: fully sharded, each of the
  8 devices holds a different eighth; biases split over `model` and
  replicated across the processes (Orbax writes one copy);
- `model-across`: mesh data=2 × model=4 with `model` across the processes
  (`across_processes="model"`), the MLP tensor-parallel: each process holds
  half of every kernel and bias.

`fsdp` is backed up by `kml.ResumableCheckpoint(storage="orbax", asynchronous=True)`
during `fit` (synchronous in a multi-process run), `model-across` saved with
`kml.save_checkpoint(..., storage="orbax")`. Each checkpoint is then restored
in the same 2 processes onto the *other* layout (each process compares the
slices it holds with the whole saved values, gathered from both processes) and
trained one more epoch there, against the original model trained the same epoch
on its own mesh; and, in this process, bit for bit on 1×8, 4×2 and with no
distribution.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import assert_bit_identical, fresh_env

import keras_meshlayout as kml

TESTS = Path(__file__).resolve().parent
LAUNCH_TIMEOUT_S = 240  # a hard bound on the launcher run (about 40 s on 2 idle cores)
CASES = ("fsdp", "model-across")
TP_RULES = [
    (r".*fc1/kernel", (None, "model")),
    (r".*fc1/bias", ("model",)),
    (r".*fc2/kernel", ("model", None)),
]
MESHES = {"1x8": {"data": 1, "model": 8}, "4x2": {"data": 4, "model": 2}}

#: Runs in each of the 2 processes: `python -m keras_meshlayout.launch -n 2 --devices-per-process 4`.
WORKER = """
import json, sys
from pathlib import Path

import keras_meshlayout as kml

process_id, num_processes = kml.initialize(emulate_devices=8)

import keras
import numpy as np
from jax.experimental import multihost_utils

sys.path.insert(0, {tests!r})
from test_checkpoint_processes import BATCH, CASES, build, data, distribution

out = Path(sys.argv[1])
x, y = data()


def fit(model, dist, epochs=1, callbacks=()):
    local = kml.process_slice((x, y), batch_size=BATCH, distribution=dist)
    history = model.fit(
        *local, batch_size=kml.local_batch_size(BATCH, dist), epochs=epochs, shuffle=False,
        callbacks=list(callbacks), verbose=0,
    )
    return history.history["loss"]


def state(model):
    return [*model.weights, *model.optimizer.variables]


def gathered(model):
    # The whole value of every variable, in every process (each holds only its own slices).
    return [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in state(model)]


def split_across_processes(model):
    # The variables of which this process holds only a part (its devices' distinct slices).
    def held(value):
        slices = {{tuple((i.start, i.stop) for i in shard.index) for shard in value.addressable_shards}}
        return sum(int(np.prod([(b or n) - (a or 0) for (a, b), n in zip(s, value.shape)])) for s in slices)

    return [v.path for v in model.weights if held(v.value) < v.value.size]


report = {{"process": process_id, "cases": {{}}}}
expected, continued = {{}}, {{}}
for case in CASES:
    dist = distribution(case)
    keras.distribution.set_distribution(dist)
    model = build()
    row = report["cases"][case] = {{"split": split_across_processes(model)}}
    if case == "fsdp":
        backup = kml.ResumableCheckpoint(out / case, storage="orbax", asynchronous=True, delete_on_end=False)
        row["loss"] = fit(model, dist, epochs=2, callbacks=[backup])
        path = out / case / "latest"
    else:
        row["loss"] = fit(model, dist, epochs=2)
        path = out / case / "latest"
        kml.save_checkpoint(model, path, storage="orbax")
    expected[case] = gathered(model)
    row["shards"] = {{v.path: len(v.value.addressable_shards) for v in model.weights}}
    fit(model, dist)  # one more epoch on its own mesh, to compare with the restored run
    continued[case] = gathered(model)
    if process_id == 0:
        np.savez(out / f"{{case}}.npz", *expected[case])

for case, other in zip(CASES, reversed(CASES)):
    # Back in the 2 processes, on the other layout.
    dist = distribution(other)
    keras.distribution.set_distribution(dist)
    model = build()
    diff = kml.load_checkpoint(model, out / case / "latest")
    mismatch = [
        variable.path
        for variable, want in zip(state(model), expected[case], strict=True)
        for shard in variable.value.addressable_shards
        if not np.array_equal(np.asarray(shard.data), want[shard.index])
    ]
    fit(model, dist)
    after = gathered(model)
    report["cases"][case]["restored_on"] = {{
        "layout": other,
        "split": split_across_processes(model),
        "mismatch": mismatch,
        "changed": [c.path for c in diff.changes],
        "continued_max_diff": max(float(np.abs(a - b).max()) for a, b in zip(after, continued[case])),
        "iterations": int(np.asarray(model.optimizer.iterations.value)),
    }}
(out / f"report_{{process_id}}.json").write_text(json.dumps(report))
print(f"process {{process_id}} of {{num_processes}} done", flush=True)
"""

BATCH, STEPS = 32, 4


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 16)).astype("float32")
    return x, (x @ rng.normal(size=(16, 8))).astype("float32")


def distribution(case: str) -> kml.ModelParallel:
    """The layout of each case; in a process of its own it uses that process's 8 devices."""
    if case == "fsdp":
        mesh = kml.Mesh(data=2, model=4)
        rules = [(r".*kernel", ("data", "model")), (r".*bias", ("model",))]
    else:
        mesh = kml.Mesh(data=2, model=4, across_processes="model")
        rules = TP_RULES
    return kml.ModelParallel(mesh, rules, batch_axis="data", replicate_below=0, auto_shard_dataset=False)


def build(width: int = 64) -> keras.Model:
    """A 16 → `width` → 8 MLP with the same initial weights in every process, compiled with Adam."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(width, activation="relu", name="fc1"),
            keras.layers.Dense(8, name="fc2"),
        ],
        name="mlp",
    )
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    """One launcher run of the worker; its output directory and the two processes' reports."""
    out = tmp_path_factory.mktemp("checkpoint-processes")
    script = out / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(tests=str(TESTS))))
    env = fresh_env("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")
    env = {k: v for k, v in env.items() if not k.startswith(("KML_", "KERAS_DISTRIBUTION_", "SLURM_"))}
    command = [sys.executable, "-m", "keras_meshlayout.launch", "-n", "2", "--devices-per-process", "4"]
    command += ["--init-timeout", "60", "--timeout", str(LAUNCH_TIMEOUT_S - 20), str(script), str(out)]
    start = time.monotonic()
    result = subprocess.run(
        command, cwd=out, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    assert time.monotonic() - start < LAUNCH_TIMEOUT_S
    reports = [json.loads((out / f"report_{i}.json").read_text()) for i in range(2)]
    return {"out": out, "reports": reports}


@pytest.mark.parametrize("case", CASES)
def test_variables_are_split_across_the_processes(case, run):
    for report in run["reports"]:
        row = report["cases"][case]
        # fsdp: kernels split 8 ways (one shard per local device), biases within each process only.
        split = ["mlp/fc1/kernel", "mlp/fc2/kernel"] + (["mlp/fc1/bias"] if case == "model-across" else [])
        assert sorted(row["split"]) == sorted(split), row
        assert row["loss"][1] < row["loss"][0], "training moved the weights"


@pytest.mark.parametrize("case", CASES)
def test_each_process_wrote_its_own_shards(case, run):
    listing = json.loads((run["out"] / case / "latest" / "manifest.json").read_text())["files"]
    for kind in ("model", "optimizer"):
        for process in (0, 1):
            prefix = f"{kind}.orbax/ocdbt.process_{process}/d/"
            assert any(name.startswith(prefix) for name in listing), (prefix, sorted(listing))


@pytest.mark.parametrize("case", CASES)
def test_restored_in_two_processes_on_the_other_layout(case, run):
    other = CASES[1 - CASES.index(case)]
    for report in run["reports"]:
        restored = report["cases"][case]["restored_on"]
        assert restored["layout"] == other
        assert restored["mismatch"] == [], "every slice each process holds is the saved value, bit for bit"
        assert restored["changed"], "the layouts differ, and plan_diff says how"
        assert restored["split"], "the restored variables are split across the processes too"
        assert restored["iterations"] == 3 * STEPS, "the optimizer's step count came back (then +1 epoch)"
        # One more epoch after the restore trains as the original model's did on its own mesh
        # (float32 sums in another order: not bit for bit).
        assert restored["continued_max_diff"] < 1e-5, restored


@pytest.mark.parametrize("target", ["1x8", "4x2", "none"])
@pytest.mark.parametrize("case", CASES)
def test_restored_in_one_process_bit_for_bit(case, target, run):
    saved = np.load(run["out"] / f"{case}.npz")
    expected = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    dist = None if target == "none" else kml.ModelParallel(kml.Mesh(**MESHES[target]), TP_RULES)
    keras.distribution.set_distribution(dist)
    model = build()
    kml.load_checkpoint(model, run["out"] / case / "latest")
    assert_bit_identical(model, expected)
    assert int(np.asarray(model.optimizer.iterations.value)) == 2 * STEPS
    kernel = model.get_layer("fc1").kernel.value
    if dist is None:
        assert len(kernel.sharding.device_set) == 1
    else:
        assert kernel.sharding.mesh.shape["model"] == MESHES[target]["model"]
        assert tuple(kernel.sharding.spec) == (None, "model")


# -- loads bounded in memory (in this process) -----------------------------------------------

WIDE = 512  # fc1's kernel is 32 KiB: a shard read on 1×8 (8 KiB of stored chunks) outgrows the limit's margin


@pytest.fixture(scope="module")
def saved_here(tmp_path_factory) -> dict:
    """A wider MLP trained one epoch on a 2×4 tensor-parallel mesh in this process, saved with Orbax."""
    path = tmp_path_factory.mktemp("bounded") / "ckpt"
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), TP_RULES))
    model = build(WIDE)
    model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    kml.save_checkpoint(model, path, storage="orbax")
    values = [np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]]
    keras.distribution.set_distribution(None)
    return {"path": path, "values": values}


def load_recording(model, path, rollback, monkeypatch) -> dict:
    """Loads `path` into `model`, recording what Orbax was asked to read and with which limits."""
    import orbax.checkpoint as ocp

    from keras_meshlayout.checkpoint import _orbax_store

    old = {"model.orbax": [v.value for v in model.weights]}
    old["optimizer.orbax"] = [v.value for v in model.optimizer.variables]
    seen = {"deleted_when_read": [], "limits": []}
    restore, reader = ocp.Checkpointer.restore, _orbax_store._reader

    def restore_and_record(self, directory, *args, **kwargs):
        for name in kwargs["args"].item:
            seen["deleted_when_read"].append(old[Path(directory).name][int(name)].is_deleted())
        return restore(self, directory, *args, **kwargs)

    def reader_and_record(limit):
        seen["limits"].append(limit)
        return reader(limit)

    monkeypatch.setattr(ocp.Checkpointer, "restore", restore_and_record)
    monkeypatch.setattr(_orbax_store, "_reader", reader_and_record)
    kml.load_checkpoint(model, path, rollback=rollback)
    monkeypatch.undo()
    return seen


@pytest.mark.parametrize("rollback", [False, True], ids=["no-rollback", "rollback"])
@pytest.mark.parametrize("target", ["1x8", "4x2", "none"])
def test_a_load_without_rollback_frees_each_value_before_reading_its_replacement(
    target, rollback, saved_here, monkeypatch
):
    """rollback=False: one array per group, the value it replaces deleted before the group is read,
    the reads in flight limited.

    The restore limiter is set as low as it goes (one shard's read at a time, plus 4 KiB): the
    bound on a shard's read (8 to 32 KiB of stored chunks here) must hold, or Orbax refuses it.
    """
    from keras_meshlayout.checkpoint import _orbax_store

    monkeypatch.setattr(_orbax_store, "GROUP_BYTES", 1)
    monkeypatch.setattr(_orbax_store, "READ_BYTES", 1)
    dist = None if target == "none" else kml.ModelParallel(kml.Mesh(**MESHES[target]), TP_RULES)
    keras.distribution.set_distribution(dist)
    model = build(WIDE)
    seen = load_recording(model, saved_here["path"], rollback, monkeypatch)
    assert_bit_identical(model, saved_here["values"])
    assert len(seen["deleted_when_read"]) == len(saved_here["values"])
    assert seen["deleted_when_read"] == [not rollback] * len(saved_here["values"])
    if rollback:  # the whole model is read before anything is assigned: as fast as Orbax reads
        assert seen["limits"] == [None]
    else:
        assert len(seen["limits"]) == 1 and seen["limits"][0] < 64 << 10, "one reader, limited"


@pytest.mark.parametrize(
    ("shape", "mesh", "spec", "chunks", "expected"),
    [
        ((4096, 4096), (1, 8), (None, "model"), (4096, 1024), 4096 * 1024),  # saved on 2×4, read on 1×8
        ((4096, 4096), (4, 2), (None, "model"), (4096, 512), 4096 * 2048),  # saved on 1×8, read on 4×2
        ((96, 40), (1, 8), ("model", None), (30, 40), 60 * 40),  # rows 24..36 lie in 2 chunks
        ((10, 7), (1, 8), (None, None), (3, 7), 12 * 7),  # the last chunk overhangs the array
        ((10, 7), (1, 8), (None, None), None, 10 * 7),  # no chunk shape known: the whole array
        ((), (1, 8), (), (), 1),  # a scalar
    ],
    ids=["aligned", "finer-chunks", "misaligned", "overhang", "unknown-chunks", "scalar"],
)
def test_shard_read_bytes_is_the_stored_chunks_a_shard_overlaps(shape, mesh, spec, chunks, expected):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from keras_meshlayout.checkpoint import _orbax_store

    devices = np.array(jax.devices()[:8]).reshape(mesh)
    sharding = NamedSharding(jax.sharding.Mesh(devices, ("data", "model")), PartitionSpec(*spec))
    struct = jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding)
    assert _orbax_store.shard_read_bytes(struct, chunks) == 4 * expected


# -- a background save while training goes on (in this process) -------------------------------


def test_a_background_save_holds_the_values_of_its_step_while_training_goes_on(tmp_path):
    """The backup after step 3 is written while step 4 trains (and donates the old buffers): it
    holds step 3's values bit for bit, each shard copied off one device (replicas over `data`)."""
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), TP_RULES))
    model = build(WIDE)
    recorded = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:  # after step 3, when the backup below starts
                recorded["values"] = [
                    np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]
                ]

    backup = kml.ResumableCheckpoint(
        tmp_path, save_freq=3, storage="orbax", asynchronous=True, delete_on_end=False
    )
    model.fit(*data(), batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[backup, Record()])
    final = [np.asarray(v.value) for v in model.weights]
    assert any(not np.array_equal(a, b) for a, b in zip(final, recorded["values"], strict=False)), (
        "step 4 moved"
    )
    manifest = json.loads((tmp_path / "latest" / "manifest.json").read_text())
    assert manifest["training"] == {"epoch": 0, "batch": 3, "step": 3}
    fresh = build(WIDE)
    kml.load_checkpoint(fresh, tmp_path / "latest")
    assert_bit_identical(fresh, recorded["values"])
