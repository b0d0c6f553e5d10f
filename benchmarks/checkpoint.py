"""Peak memory while loading a sharded checkpoint, per format and per process, and how long saves block.

An MLP of 5 Dense layers 4096 → 4096 (84 M float32 parameters, 320 MiB) is
built on a data=2 × model=4 mesh, every kernel split over "model", and saved
once in each format. Each format is then loaded in a fresh process on a
data=1 × model=8 mesh (a cross-mesh restore, every variable split 8 ways, so the
loaded model occupies exactly its own size across the 8 devices):

- `.keras`: `keras.saving.load_model("m.keras")` (builds the model itself,
  and reads the whole weights file into memory first when Keras judges there
  is room), and `model.load_weights("m.keras")` into a model built first
  (reads the archive as it goes);
- `.weights.h5`: `model.load_weights("m.weights.h5")` into a model built first;
- `kml`: `kml.load_checkpoint(model, directory)` into a model built first,
  the previous values held until the load completes (to put them back if it
  fails part-way), and with `rollback=False`;
- `kml orbax`: the same, from a checkpoint saved with `storage="orbax"`
  (each process reads only the slices its devices hold; here one process
  holds all 8 devices, so it reads the whole model);
- `kml orbax, 2 processes`: the Orbax checkpoint loaded in 2 processes × 4
  devices (the launcher, on loopback) on data=1 × model=8 split across them:
  each process holds, and reads, half of every kernel; measured in each process
  against the bytes its devices hold;
- `build only`: the model built, nothing loaded (the floor of the other rows).

The save of each format is timed too (in the process that builds the model on
2×4), and both are given as throughput: the model's bytes over the seconds.

The devices are emulated CPUs: their buffers live in the process's own memory,
so the resident set counts the loaded model itself as well as any host copies
made while loading. On accelerators the model lives in device memory and only
the host copies stay on the host.

Columns, each a ratio to the bytes the process's devices hold (the whole
model in one process, half of it in each of 2):

- `peak / held`: peak resident memory while loading (building included where
  the format builds the model) minus the resident memory of the process before
  the model existed: JAX, Keras, h5py and Orbax imported (a fixed cost of the
  libraries, about 26 MiB for Orbax and TensorStore, not of the load), and a
  tiny model of the same layers built and dropped first. XLA's first
  compilations leave about 30 MiB resident for good, whatever the model's size
  (29.8 MiB after building a 20 MiB MLP, 32.7 MiB after the 320 MiB one, still
  there after deleting the model and `jax.clear_caches()`; building again adds
  1 to 2 MiB): the compiler's state, a fixed cost of the process, so it is taken
  out with the libraries. 1.0 is the floor: the model itself;
- `extra / held`: that peak minus the resident memory once loading is over:
  what the load needed on top of the loaded model;
- `cold`: `peak / held` with the compiler's first-use memory counted (the
  baseline read before the tiny model), as this table was measured before: in
  2 processes, where each holds 160 MiB, those 30 MiB alone are 0.19.

Peaks are read from the kernel's high-water mark (`VmHWM`), reset with
`/proc/self/clear_refs` just before the measured step, so what the process did
before (a model built first, JAX's start-up) does not count. Where that reset
is not allowed, `ru_maxrss` (the lifetime peak) is used and the table says so.
The children run with `MALLOC_MMAP_THRESHOLD_=131072`, so that freed blocks go
back to the system and the memory "once loading is over" is what is live.

    python benchmarks/checkpoint.py                  # about five minutes on 2 cores
    python benchmarks/checkpoint.py --repeat 1       # one process per format (peaks vary ±0.3)
    python benchmarks/checkpoint.py --json out.json  # also write the numbers
    python benchmarks/checkpoint.py --width 8192 --only "kml orbax, 2 processes, no rollback"
                                                     # one load, of a 1.25 GiB MLP

`--faults` instead injects every fault into saves and loads of the same model, in
the h5 format (`storage="h5"`; the Orbax format's faults are tested in
tests/test_checkpoint.py), on a tmpfs mounted in a mount namespace of its own (`unshare -rm`: no root needed):
SIGKILL at three points of a save (in a separate process), a disk full while
writing each of the three files, a damaged manifest, a truncated or flipped
weights file. It reports, for each, what reported it and how fast, and what was
lost (the next load must find the newest complete checkpoint, bit for bit, and a
failed load must leave the model in memory as it was):

    python benchmarks/checkpoint.py --faults         # about a minute on 2 cores

The run ends by timing how long a save blocks training (`--blocking` does only
that): the end-of-epoch save of `kml.ResumableCheckpoint(storage="orbax")` on
2×4, of the model and its Adam state (960 MiB), with `asynchronous=False`
against `True`, from the call until training would go on; three of each. The
background save blocks only while each shard is copied off its device (one
copy of each, from its first replica); Orbax then writes the files in a thread.

    python benchmarks/checkpoint.py --blocking
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LAYERS = 5
WIDTH = int(os.environ.get("BENCH_WIDTH", "4096"))  # `--width`, passed on to the child processes
FORMATS = {
    "keras": "keras.saving.load_model(m.keras)",
    "keras, load_weights": "model.load_weights(m.keras)",
    "weights.h5": "model.load_weights(m.weights.h5)",
    "kml": 'kml.load_checkpoint(model, dir), saved with storage="h5"',
    "kml, no rollback": "the same (h5), rollback=False",
    "kml orbax": "kml.load_checkpoint(model, dir), Orbax (the default)",
    "kml orbax, no rollback": "the same, rollback=False",
    "build only": "model built, nothing loaded",
}
RULES = [(r".*kernel", (None, "model")), (r".*bias", ("model",))]


def build_mlp():
    import keras

    inputs = keras.Input((WIDTH,))
    x = inputs
    for i in range(LAYERS):
        x = keras.layers.Dense(WIDTH, activation="relu" if i < LAYERS - 1 else None, name=f"dense_{i}")(x)
    return keras.Model(inputs, x, name="big_mlp")


def model_bytes() -> int:
    return LAYERS * (WIDTH * WIDTH + WIDTH) * 4


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> bool:
    """Resets the kernel's peak-RSS mark for this process; False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak(resettable: bool) -> int:
    if resettable:
        return _status("VmHWM")
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _start(mesh: dict):
    """Emulated devices, JAX started, the distribution set: the state before any model exists."""
    import keras_meshlayout as kml

    kml.emulate_devices(8)
    import jax
    import keras

    jax.numpy.zeros(8).block_until_ready()
    # The libraries a load may use are imported before the baseline is read: their code is a
    # fixed cost of the process (about 26 MiB for Orbax and TensorStore), not of the load.
    import h5py  # noqa: F401
    import orbax.checkpoint  # noqa: F401

    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(**mesh), RULES, batch_axis="data"))
    return kml, keras


def warm_up() -> int:
    """Builds and drops a tiny model of the same layers; returns the resident memory before it.

    XLA's first compilations in a process leave about 30 MiB resident for good (the compiler's
    own state: measured 29.8 MiB after building a 20 MiB MLP, 32.7 MiB after the 320 MiB one,
    and still there once the model is deleted and `jax.clear_caches()` called; building the
    model again adds 1 to 2 MiB). Like the libraries' code, that is a fixed cost of the
    process, not of the model or of a load: the baselines are read after this warm-up, and
    the memory before it is kept as `rss_cold_bytes` (the `cold` column).
    """
    import keras

    gc.collect()
    cold = _status("VmRSS")
    inputs = keras.Input((64,))
    x = keras.layers.Dense(64, activation="relu", name="warm_up_0")(inputs)
    tiny = keras.Model(inputs, keras.layers.Dense(64, name="warm_up_1")(x), name="warm_up")
    del tiny, inputs, x
    gc.collect()
    return cold


def save(directory: Path) -> dict:
    """In a fresh process: builds the model on 2×4 and saves it in every format."""
    kml, keras = _start({"data": 2, "model": 4})
    keras.utils.set_random_seed(0)
    model = build_mlp()
    saves = {
        "keras": lambda: model.save(directory / "m.keras"),
        "weights.h5": lambda: model.save_weights(directory / "m.weights.h5"),
        "kml": lambda: kml.save_checkpoint(model, directory / "ckpt", storage="h5"),  # Orbax: the default
        "kml orbax": lambda: kml.save_checkpoint(model, directory / "ckpt_orbax", storage="orbax"),
    }
    seconds = {}
    for fmt, run in saves.items():
        start = time.perf_counter()
        run()
        seconds[fmt] = round(time.perf_counter() - start, 2)

    def size(path: Path) -> int:
        return (
            path.stat().st_size
            if path.is_file()
            else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        )

    paths = {"keras": "m.keras", "weights.h5": "m.weights.h5", "kml": "ckpt", "kml orbax": "ckpt_orbax"}
    return {"bytes": {fmt: size(directory / name) for fmt, name in paths.items()}, "save_seconds": seconds}


def load(fmt: str, directory: Path) -> dict:
    """In a fresh process: loads one format on 1×8 and measures the resident memory."""
    kml, keras = _start({"data": 1, "model": 8})
    cold = warm_up()
    before = _status("VmRSS")
    model = None
    if fmt != "keras":
        model = build_mlp()  # the model exists before the load
        gc.collect()
    resettable = _reset_peak()
    start = time.perf_counter()
    if fmt == "keras":
        model = keras.saving.load_model(directory / "m.keras")
    elif fmt == "keras, load_weights":
        model.load_weights(directory / "m.keras")
    elif fmt == "weights.h5":
        model.load_weights(directory / "m.weights.h5")
    elif fmt == "kml":
        kml.load_checkpoint(model, directory / "ckpt")
    elif fmt == "kml, no rollback":
        kml.load_checkpoint(model, directory / "ckpt", rollback=False)
    elif fmt == "kml orbax":
        kml.load_checkpoint(model, directory / "ckpt_orbax")
    elif fmt == "kml orbax, no rollback":
        kml.load_checkpoint(model, directory / "ckpt_orbax", rollback=False)
    seconds = time.perf_counter() - start
    peak = _peak(resettable)
    gc.collect()
    after = _status("VmRSS")
    kernel = model.get_layer("dense_0").kernel.value
    assert tuple(kernel.sharding.spec) == (None, "model"), kernel.sharding
    size = model_bytes()
    return {
        "format": fmt,
        "how": FORMATS[fmt],
        "seconds": round(seconds, 2),
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "peak_rss_bytes": peak,
        "peak_over_model": round((peak - before) / size, 3),
        "extra_over_model": round((peak - after) / size, 3),
        "peak_is_lifetime": not resettable,
        "rss_cold_bytes": cold,
        "peak_over_model_cold": round((peak - cold) / size, 3),
    }


def load_build_only(directory: Path) -> dict:
    """The floor: the model built on 1×8 and nothing loaded, measured like the loads."""
    _start({"data": 1, "model": 8})
    cold = warm_up()
    before = _status("VmRSS")
    resettable = _reset_peak()
    start = time.perf_counter()
    model = build_mlp()
    seconds = time.perf_counter() - start
    peak = _peak(resettable)
    gc.collect()
    after = _status("VmRSS")
    assert tuple(model.get_layer("dense_0").kernel.value.sharding.spec) == (None, "model")
    size = model_bytes()
    return {
        "format": "build only",
        "how": FORMATS["build only"],
        "seconds": round(seconds, 2),
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "peak_rss_bytes": peak,
        "peak_over_model": round((peak - before) / size, 3),
        "extra_over_model": round((peak - after) / size, 3),
        "peak_is_lifetime": not resettable,
        "rss_cold_bytes": cold,
        "peak_over_model_cold": round((peak - cold) / size, 3),
    }


#: Loads measured in each of 2 processes × 4 devices, on data=1 × model=8 split across them.
PROCESS_FORMATS = {
    "kml orbax, 2 processes": "each process of 2: kml.load_checkpoint(model, dir), Orbax",
    "kml orbax, 2 processes, no rollback": "the same, rollback=False",
}


def held_bytes(model) -> int:
    """The bytes of the model's variables this process's devices hold (one copy of each slice)."""
    total = 0
    for variable in model.weights:
        shards = variable.value.addressable_shards
        slices = {tuple((i.start, i.stop) for i in shard.index): shard.data.nbytes for shard in shards}
        total += sum(slices.values())
    return int(total)


def load_in_process(fmt: str, directory: Path) -> dict:
    """In one of 2 launched processes: loads the Orbax checkpoint, measured like `load`."""
    import keras_meshlayout as kml

    kml.initialize(emulate_devices=8)
    import warnings

    import h5py  # noqa: F401
    import jax
    import keras
    import orbax.checkpoint  # noqa: F401

    jax.numpy.zeros(8).block_until_ready()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", kml.ProcessSplitWarning)  # model spans the processes: intended
        mesh = kml.Mesh(data=1, model=8, allow_split_across_processes=True)
    keras.distribution.set_distribution(kml.ModelParallel(mesh, RULES, batch_axis="data"))
    cold = warm_up()
    before = _status("VmRSS")
    model = build_mlp()
    gc.collect()
    resettable = _reset_peak()
    start = time.perf_counter()
    kml.load_checkpoint(model, directory / "ckpt_orbax", rollback="no rollback" not in fmt)
    seconds = time.perf_counter() - start
    peak = _peak(resettable)
    gc.collect()
    after = _status("VmRSS")
    held = held_bytes(model)
    assert held < model_bytes(), "each process holds only its part of the model"
    return {
        "format": fmt,
        "how": PROCESS_FORMATS[fmt],
        "process": jax.process_index(),
        "held_bytes": held,
        "seconds": round(seconds, 2),
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "peak_rss_bytes": peak,
        "peak_over_model": round((peak - before) / held, 3),
        "extra_over_model": round((peak - after) / held, 3),
        "peak_is_lifetime": not resettable,
        "rss_cold_bytes": cold,
        "peak_over_model_cold": round((peak - cold) / held, 3),
    }


def run_processes(fmt: str, directory: Path) -> list[dict]:
    """Runs `load_in_process` in 2 processes × 4 devices (the launcher, on loopback); both results."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")
    command = [sys.executable, "-m", "keras_meshlayout.launch", "-n", "2", "--devices-per-process", "4"]
    command += ["--timeout", "280", __file__, "--child", "processes", str(directory), fmt]
    out = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"the 2-process load failed (exit status {out.returncode}):\n{out.stderr[-4000:]}")
    found = [line.split("RESULT ", 1)[1] for line in out.stdout.splitlines() if "RESULT " in line]
    return sorted((json.loads(line) for line in found), key=lambda r: r["process"])


def blocking(directory: Path) -> dict:
    """In a fresh process: seconds a synchronous and a background Orbax backup block training.

    Each is `kml.ResumableCheckpoint(storage="orbax")`'s save at the end of an epoch, timed
    from the call to its return (when training would go on), with `asynchronous=False` and
    `True`; the background one is then waited for (`on_train_end`), which gives its total.
    """
    import numpy as np

    kml, keras = _start({"data": 2, "model": 4})
    keras.utils.set_random_seed(0)
    model = build_mlp()
    model.compile(optimizer="adam", loss="mse")
    model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    for variable in model.optimizer.variables:  # Adam's moments as after training, not zeros
        if len(variable.shape):
            variable.assign(rng.standard_normal(variable.shape, dtype=np.float32))
    sync, blocked, total = [], [], []
    for i in range(3):
        for asynchronous, times in ((False, sync), (True, blocked)):
            backup = kml.ResumableCheckpoint(
                directory / f"{'async' if asynchronous else 'sync'}_{i}",
                storage="orbax",
                asynchronous=asynchronous,
                delete_on_end=False,
            )
            backup.set_model(model)
            start = time.perf_counter()
            backup.on_epoch_end(0)
            times.append(time.perf_counter() - start)
            backup.on_train_end()
            if asynchronous:
                total.append(time.perf_counter() - start)
    state = sum(int(np.prod(v.shape)) * 4 for v in [*model.weights, *model.optimizer.variables])
    return {
        "state_bytes": state,
        "sync_seconds": sync,
        "async_blocking_seconds": blocked,
        "async_total_seconds": total,
        "blocked_over_sync": round(min(blocked) / min(sync), 3),
        "save_mb_per_s_sync": round(state / 1e6 / min(sync), 1),
        "save_mb_per_s_async_total": round(state / 1e6 / min(total), 1),
    }


# -- faults: what each one costs (`--faults`) ---------------------------------------------

FAULT_KILLS = {
    "SIGKILL after the weights are written": "previous",
    "SIGKILL between the two renames": "new",
    "SIGKILL after moving into place": "new",
}


def _values(model) -> list:
    import numpy as np

    return [np.asarray(v.value) for v in model.weights]


def kill_during_save(point: str, directory: Path) -> None:
    """In a fresh process: saves the model built with seed 1 over `ckpt`, and dies at `point`."""
    import signal

    kml, keras = _start({"data": 2, "model": 4})
    keras.utils.set_random_seed(1)
    model = build_mlp()
    fsync, replace = os.fsync, os.replace

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "SIGKILL after the weights are written":
        os.fsync = lambda fd: (fsync(fd), die())
    else:
        first = point == "SIGKILL between the two renames"
        os.replace = lambda src, dst: (replace(src, dst), first == (".old-" in str(dst)) and die())
    kml.save_checkpoint(model, directory / "ckpt", storage="h5")
    raise SystemExit("not killed")


def faults(directory: Path) -> dict:
    """In a fresh process, on a tmpfs of its own: every fault, the time until it is reported, the loss."""
    import json as json_
    import shutil

    import numpy as np

    kml, keras = _start({"data": 2, "model": 4})
    ckpt = directory / "ckpt"
    keras.utils.set_random_seed(0)
    model = build_mlp()
    start = time.perf_counter()
    kml.save_checkpoint(model, ckpt, storage="h5")  # the fault table is the h5 format's
    save_seconds = time.perf_counter() - start
    saved = {"previous": _values(model)}
    keras.utils.set_random_seed(1)
    saved["new"] = _values(build_mlp())
    rows = []

    def load(expect: str) -> tuple[float, str, str]:
        fresh = build_mlp()
        start = time.perf_counter()
        try:
            kml.load_checkpoint(fresh, ckpt)
            outcome = "loaded the " + ("newest" if expect == "new" else "previous") + " complete checkpoint"
        except kml.CheckpointError as err:
            outcome = "CheckpointError: " + str(err).split(". ")[0][-90:]
        seconds = time.perf_counter() - start
        same = all(np.array_equal(a, b) for a, b in zip(_values(fresh), saved[expect], strict=True))
        left = [p.name for p in directory.iterdir() if p.name.startswith(".")]
        lost = "nothing" if same and not left else f"weights equal: {same}; left: {left}"
        return seconds, outcome, lost

    seconds, outcome, lost = load("previous")
    rows.append({"fault": "none (for comparison)", "reported": outcome, "seconds": seconds, "lost": lost})
    for point, expect in FAULT_KILLS.items():
        run = subprocess.run(
            [sys.executable, __file__, "--child", "kill", str(directory), point],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == -9, run.stderr[-2000:]
        seconds, outcome, lost = load(expect)
        rows.append({"fault": point, "reported": "next load: " + outcome, "seconds": seconds, "lost": lost})
        kml.save_checkpoint(model, ckpt, storage="h5")  # the previous checkpoint again, for the next fault

    size = {p.name: p.stat().st_blocks * 512 for p in ckpt.iterdir()}
    room = {
        "model.weights.h5": size["model.weights.h5"] // 2,
        "plan.json": size["model.weights.h5"],
        "manifest.json": size["model.weights.h5"] + size["plan.json"],
    }
    other = build_mlp()  # values of the "new" checkpoint
    for name, free in room.items():
        stat = os.statvfs(directory)
        with open(directory / "filler", "wb") as filler:
            for _ in range((stat.f_bavail * stat.f_frsize - free) // (1 << 20)):
                filler.write(b"0" * (1 << 20))
            filler.write(b"0" * ((stat.f_bavail * stat.f_frsize - free) % (1 << 20)))
        start = time.perf_counter()
        try:
            kml.save_checkpoint(other, ckpt, storage="h5")
            reported = "not reported: the save succeeded"
        except kml.CheckpointError as err:
            reported = "the save: CheckpointError naming " + name
            assert "is intact" in str(err), str(err)
        seconds = time.perf_counter() - start
        (directory / "filler").unlink()
        _, _, lost = load("previous")
        rows.append(
            {"fault": f"disk full writing {name}", "reported": reported, "seconds": seconds, "lost": lost}
        )

    manifest = (ckpt / "manifest.json").read_bytes()
    weights = ckpt / "model.weights.h5"
    shutil.copyfile(weights, directory / "weights.copy")
    damages = {
        "manifest: variables null": lambda m: m.update(variables=None),
        "manifest: an entry without a shape": lambda m: m["variables"][0].pop("shape"),
        "manifest: a shape edited": lambda m: m["variables"][0].update(shape=[WIDTH, 8]),
        "weights file truncated": None,
        "weights file: one byte flipped": None,
    }
    for fault, edit in damages.items():
        if edit is not None:
            content = json_.loads(manifest)
            edit(content)
            (ckpt / "manifest.json").write_text(json_.dumps(content))
        else:
            raw = bytearray(weights.read_bytes())
            raw = raw[: len(raw) // 2] if "truncated" in fault else raw
            if "flipped" in fault:
                raw[len(raw) // 2] ^= 0xFF
            weights.write_bytes(bytes(raw))
        fresh = build_mlp()
        before = _values(fresh)
        start = time.perf_counter()
        try:
            kml.load_checkpoint(fresh, ckpt)
            reported = "not reported"
        except kml.CheckpointError as err:
            reported = "the load: CheckpointError: " + str(err).split("\n")[0].split(": ", 1)[1][:70]
        seconds = time.perf_counter() - start
        untouched = all(np.array_equal(a, b) for a, b in zip(_values(fresh), before, strict=True))
        (ckpt / "manifest.json").write_bytes(manifest)
        shutil.copyfile(directory / "weights.copy", weights)
        _, _, lost = load("previous")
        lost = lost if untouched else "the model in memory was changed"
        rows.append({"fault": fault, "reported": reported, "seconds": seconds, "lost": lost})
    return {"model_bytes": model_bytes(), "save_seconds": save_seconds, "rows": rows}


def run_child(*args: str) -> dict:
    """Runs one step in a fresh process, with devices it emulates itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "131072")  # big blocks go back to the OS when freed
    out = subprocess.run(
        [sys.executable, __file__, "--child", *args], capture_output=True, text=True, env=env, timeout=300
    )
    if out.returncode != 0:
        raise SystemExit(f"step {args[0]!r} failed (exit status {out.returncode}):\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    global WIDTH
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--repeat", type=int, default=2, help="fresh processes per format (default: 2)")
    parser.add_argument("--width", type=int, default=WIDTH, help="the MLP's width (default: 4096, 320 MiB)")
    parser.add_argument(
        "--only",
        help="the loads to measure, separated by ';' (default: every format and the 2-process ones)",
    )
    parser.add_argument(
        "--faults",
        action="store_true",
        help="instead, inject every fault (kills in a save, full disk, damaged files) and time each",
    )
    parser.add_argument(
        "--blocking",
        action="store_true",
        help="instead, time how long a synchronous and a background Orbax save block training",
    )
    parser.add_argument("--child", nargs="+", metavar="STEP DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    WIDTH = args.width
    os.environ["BENCH_WIDTH"] = str(args.width)  # for the child processes
    if args.child:
        step, directory = args.child[0], Path(args.child[1])
        if step == "kill":
            kill_during_save(args.child[2], directory)
        if step == "faults":
            print(json.dumps(faults(directory)), flush=True)
            # h5py crashes at interpreter exit once one of its writes has failed for a full disk.
            os._exit(0)
        if step == "processes":
            print("RESULT " + json.dumps(load_in_process(args.child[2], directory)), flush=True)
            return
        if step == "blocking":
            result = blocking(directory)
        elif step == "save":
            result = save(directory)
        elif step == "build only":
            result = load_build_only(directory)
        else:
            result = load(step, directory)
        print(json.dumps(result))
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    if args.faults:
        print_faults(console, args.json)
        return
    if args.blocking:
        with tempfile.TemporaryDirectory(prefix="kml-bench-") as tmp:
            result = run_child("blocking", tmp)
        print_blocking(console, result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return
    size = model_bytes()
    with tempfile.TemporaryDirectory(prefix="kml-bench-") as tmp:
        start = time.perf_counter()
        saved = run_child("save", tmp)
        files, save_seconds = saved["bytes"], saved["save_seconds"]
        chosen = [*FORMATS, *PROCESS_FORMATS] if args.only is None else args.only.split(";")
        runs = {fmt: [run_child(fmt, tmp) for _ in range(args.repeat)] for fmt in FORMATS if fmt in chosen}
        for fmt in (f for f in PROCESS_FORMATS if f in chosen):  # each run gives one result per process
            runs[fmt] = [r for _ in range(args.repeat) for r in run_processes(fmt, Path(tmp))]
        blocked = run_child("blocking", tmp) if args.only is None else None
        total = time.perf_counter() - start
    # The worst of the runs: what a machine must have room for. JAX frees buffers asynchronously,
    # so peaks vary by about ±0.3 model sizes from run to run on a busy machine.
    results = [max(found, key=lambda r: r["peak_over_model"]) for found in runs.values()]
    for r in results:
        r["file_bytes"] = files.get(r["format"].split(",")[0])
        r["save_seconds"] = None if "," in r["format"] else save_seconds.get(r["format"])
        r["runs"] = [
            {k: run[k] for k in ("seconds", "peak_over_model", "extra_over_model", "peak_over_model_cold")}
            for run in runs[r["format"]]
        ]

    table = Table(
        title=f"Loading a {size / 2**20:.0f} MiB MLP saved on data=2 × model=4 onto data=1 × model=8 "
        "(fresh process each)",
        title_justify="left",
    )
    columns = ("format", "how", "file", "save s", "save MB/s", "load s", "load MB/s", "peak / held")
    for column in (*columns, "extra / held", "cold"):
        table.add_column(column, justify="left" if column in ("format", "how") else "right")
    for r in results:
        saved_in = r["save_seconds"]
        table.add_row(
            r["format"],
            r["how"],
            "-" if r["file_bytes"] is None else f"{r['file_bytes'] / 2**20:.0f} MiB",
            "-" if saved_in is None else f"{saved_in:.2f}",
            "-" if saved_in is None else f"{size / 1e6 / saved_in:.0f}",
            f"{r['seconds']:.2f}",
            "-" if r["format"] == "build only" else f"{r.get('held_bytes', size) / 1e6 / r['seconds']:.0f}",
            f"{r['peak_over_model']:.2f}" + (" *" if r["peak_is_lifetime"] else ""),
            f"{r['extra_over_model']:.2f}",
            f"{r['peak_over_model_cold']:.2f}",
        )
    console.print(table)
    console.print(
        "peak / held: peak resident memory of a process while loading, less that process before the "
        "model existed (JAX, Keras, h5py and Orbax imported, a tiny model built and dropped so that "
        "XLA's one-time ~30 MiB of compiler state is not counted), over the bytes its devices hold (the "
        "whole model in one process, about half in each of 2); extra / held: that peak less the memory "
        "once loaded; cold: the peak / held with the compiler's first-use memory counted (read before "
        "the tiny model). Emulated CPU devices: the loaded model itself is resident (1.00 = just the "
        "model; load MB/s: the bytes a process holds over its seconds). "
        f"Worst of {args.repeat} runs each (each process of a 2-process run counted); {total:.0f} s in all."
    )
    if blocked is not None:
        print_blocking(console, blocked)
    if any(r["peak_is_lifetime"] for r in results):
        console.print("* peak over the process's lifetime (resetting the peak mark is not allowed here)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model_bytes": size, "results": results, "blocking": blocked}, f, indent=2)


def print_blocking(console, result: dict) -> None:
    console.print(
        f"Backing up {result['state_bytes'] / 2**20:.0f} MiB of training state (model and Adam) with "
        f'ResumableCheckpoint(storage="orbax") on 2×4: synchronous {min(result["sync_seconds"]):.2f} s '
        f"({result['save_mb_per_s_sync']:.0f} MB/s); asynchronous=True blocks training "
        f"{min(result['async_blocking_seconds']):.3f} s "
        f"(written after {min(result['async_total_seconds']):.2f} s): "
        f"blocked / synchronous = {result['blocked_over_sync']:.3f} (best of 3 each)"
    )


def print_faults(console, json_path: str | None) -> None:
    """Runs `faults` in a child process, on a tmpfs mounted in a mount namespace of its own."""
    from rich.table import Table

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    size_mib = 3 * model_bytes() // 2**20 + 64
    with tempfile.TemporaryDirectory(prefix="kml-faults-") as tmp:
        mount = f'mount -t tmpfs -o size={size_mib}m tmpfs "$0" && exec "$1" "$2" --child faults "$0"'
        out = subprocess.run(
            ["unshare", "-rm", "sh", "-c", mount, tmp, sys.executable, __file__],
            capture_output=True,
            text=True,
            env=env,
            timeout=1200,
        )
    if out.returncode != 0:
        raise SystemExit(f"the fault run failed (exit status {out.returncode}):\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    table = Table(
        title=f"Faults on a {result['model_bytes'] / 2**20:.0f} MiB checkpoint (save: "
        f"{result['save_seconds']:.1f} s, on tmpfs)",
        title_justify="left",
    )
    for column in ("fault", "reported by", "seconds", "lost"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for row in result["rows"]:
        table.add_row(row["fault"], row["reported"], f"{row['seconds']:.2f}", row["lost"])
    console.print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
