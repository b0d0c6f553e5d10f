"""`kml.ResumableCheckpoint` under the faults of long runs: preemption, clean stops, shared directories.

Issue 22, tried as a user training for days on preemptible machines: SIGTERM saved
nothing, a clean stop (`model.stop_training`) deleted the backup, two jobs on one
directory overwrote each other, NaN weights were backed up over the last good
state, and a full disk during a background save ended the run. Each test here
pins one of those, with real processes and real signals where the fault is one
(every process started has a deadline), and in this process otherwise.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
from helpers import fresh_env

import keras_meshlayout as kml
from keras_meshlayout.checkpoint import _atomic

BATCH, STEPS, EPOCHS = 16, 6, 3  # 18 steps
TOTAL = STEPS * EPOCHS
WEIGHTS = 4  # fc1's and fc2's kernels and biases: the first of `values(model)`
RULES = [(r".*fc1/kernel", (None, "model")), (r".*fc2/kernel", ("model", None))]


def build() -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(32, activation="relu", name="fc1"),
            keras.layers.Dense(4, name="fc2"),
        ],
        name="mlp",
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 8)).astype("float32")
    return x, rng.normal(size=(BATCH * STEPS, 4)).astype("float32")


def fit(callbacks, model=None) -> keras.Model:
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), RULES))
    model = model or build()
    model.fit(*data(), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def values(model: keras.Model) -> list[np.ndarray]:
    return [np.asarray(v.value) for v in [*model.weights, *model.optimizer.variables]]


def training(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())["training"]


@pytest.fixture(scope="module")
def uninterrupted() -> list[np.ndarray]:
    model = fit([])
    keras.distribution.set_distribution(None)
    return values(model)


class StopAt(keras.callbacks.Callback):
    """Sets `model.stop_training` after global step `step` (1-based), as EarlyStopping would."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.steps = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.step:
            self.model.stop_training = True


# -- a clean stop keeps the backup ---------------------------------------------------------


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_clean_stop_keeps_the_backup_at_its_step_and_resumes_exactly(asynchronous, uninterrupted, tmp_path):
    """Regression (issue 22): stop_training let fit end normally and delete_on_end removed `latest`."""
    first = fit([kml.ResumableCheckpoint(tmp_path, save_freq=4, asynchronous=asynchronous), StopAt(7)])
    assert int(first.optimizer.iterations) == 7
    assert training(tmp_path / "latest") == {"epoch": 1, "batch": 1, "step": 7}, "the stop's own step"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000000004"]
    resumed = fit([kml.ResumableCheckpoint(tmp_path, save_freq=4, asynchronous=asynchronous)])
    assert all(np.array_equal(a, b) for a, b in zip(values(resumed), uninterrupted, strict=True))
    assert not tmp_path.exists(), "a completed run deletes its backups (delete_on_end=True)"


# -- keep the last K -----------------------------------------------------------------------


#: Backups after steps 5, 10 and 15 (save_freq=5, 18 steps): what each `max_to_keep` keeps besides `latest`.
KEPT = {1: [], 2: ["step-000000010"], 3: ["step-000000005", "step-000000010"]}


@pytest.mark.parametrize("max_to_keep", list(KEPT), ids=[f"keep-{k}" for k in KEPT])
def test_the_newest_backups_are_kept_with_their_steps(max_to_keep, tmp_path):
    fit([kml.ResumableCheckpoint(tmp_path, save_freq=5, delete_on_end=False, max_to_keep=max_to_keep)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", *KEPT[max_to_keep]]
    for name in KEPT[max_to_keep]:
        assert training(tmp_path / name)["step"] == int(name.split("-")[1])
    assert training(tmp_path / "latest")["step"] == 15


def test_a_damaged_latest_backup_falls_back_to_the_one_before(uninterrupted, tmp_path):
    fit([kml.ResumableCheckpoint(tmp_path, save_freq=4), StopAt(10)])
    assert training(tmp_path / "latest")["step"] == 10
    shard = next(
        p for p in (tmp_path / "latest" / "model.orbax").rglob("*") if p.is_file() and p.stat().st_size
    )
    shard.write_bytes(shard.read_bytes()[:-1])  # truncated by one byte
    with pytest.warns(
        kml.MeshLayoutWarning,
        match=r"latest is incomplete or damaged .*: resuming from the one before it, \S+/step-000000008\.",
    ):
        resumed = fit([kml.ResumableCheckpoint(tmp_path, save_freq=4)])
    assert all(np.array_equal(a, b) for a, b in zip(values(resumed), uninterrupted, strict=True))


# -- the finite-state guard ----------------------------------------------------------------


class PoisonAt(keras.callbacks.Callback):
    """Writes NaN into one element of fc2's kernel after global step `step`."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step, self.steps = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == self.step:
            kernel = self.model.get_layer("fc2").kernel
            kernel.assign(keras.ops.where(keras.ops.arange(4) == 0, np.nan, kernel.value))


def test_a_nan_state_is_not_backed_up_and_the_restart_starts_from_the_last_finite_one(
    uninterrupted, tmp_path
):
    """Regression (issue 22): NaN weights were backed up over the last good state, silently."""
    # fc2's kernel turns NaN just before the backup after step 8; the loss of step 9 is NaN.
    backup = kml.ResumableCheckpoint(tmp_path, save_freq=4)
    with pytest.warns(kml.MeshLayoutWarning) as caught:
        fit([PoisonAt(8), backup, keras.callbacks.TerminateOnNaN()])
    messages = [str(w.message) for w in caught]
    assert messages[0] == (
        "Not backing up epoch 1, batch 2: mlp/fc2/kernel holds NaN or infinity. The backups keep the last "
        f"finite state ({tmp_path / 'latest'}). Fix: lower the learning rate, clip gradients, or stop with "
        "keras.callbacks.TerminateOnNaN; pass check_finite=False to back up such states anyway."
    )
    assert len(messages) == 2 and messages[1].startswith("Not backing up epoch 1, batch 3: "), "at the stop"
    assert training(tmp_path / "latest")["step"] == 4, "the last finite state"
    resumed = fit([kml.ResumableCheckpoint(tmp_path, save_freq=4)])
    assert all(np.array_equal(a, b) for a, b in zip(values(resumed), uninterrupted, strict=True))


def test_the_guard_can_be_turned_off(tmp_path):
    fit(
        [PoisonAt(9), kml.ResumableCheckpoint(tmp_path, save_freq=4, check_finite=False, delete_on_end=False)]
    )
    assert training(tmp_path / "latest")["step"] == 16  # NaN spreads, every state is backed up


# -- save failures do not end training -----------------------------------------------------


def test_failed_saves_warn_until_too_many_fail_in_a_row(monkeypatch, tmp_path):
    """A save that fails is one warning line; the `max_save_failures`-th in a row stops training."""
    write_json = _atomic.write_json
    failing = {"from": 6, "to": 10}  # the saves after these steps fail: 6, 8, 10 (with save_freq=2)
    backup = kml.ResumableCheckpoint(tmp_path, save_freq=2, max_save_failures=3)

    def write_json_on_a_full_disk(path, content):
        step = content.get("training", {}).get("step", 0) if isinstance(content, dict) else 0
        if path.name == "manifest.json" and failing["from"] <= step <= failing["to"]:
            raise OSError(28, "No space left on device")
        write_json(path, content)

    monkeypatch.setattr(_atomic, "write_json", write_json_on_a_full_disk)
    with pytest.warns(kml.MeshLayoutWarning) as caught, pytest.raises(kml.CheckpointError) as raised:
        fit([backup])
    assert len(caught) == 2
    for number, warning in enumerate(caught, start=1):
        message = str(warning.message)
        assert "\n" not in message
        assert re.fullmatch(
            rf"Saving checkpoint {re.escape(str(tmp_path / 'latest'))} failed while writing "
            r"\S+manifest\.json: No space left on device \(errno 28\)\. The previous checkpoint at \S+ is "
            r"intact\. .* Training goes on; the next backup tries again "
            rf"\({number} of max_save_failures=3 failures in a row\)\.",
            message,
        ), message
    assert str(raised.value).endswith(
        "That is 3 failed saves in a row (max_save_failures=3): training stops."
    )
    assert training(tmp_path / "latest")["step"] == 4, "the backups before the failures stay"


def test_a_failed_save_then_a_good_one_resets_the_count(monkeypatch, uninterrupted, tmp_path):
    write_json = _atomic.write_json

    def fail_at_step_4_and_8(path, content):
        if path.name == "manifest.json" and content.get("training", {}).get("step") in (4, 8):
            raise OSError(28, "No space left on device")
        write_json(path, content)

    monkeypatch.setattr(_atomic, "write_json", fail_at_step_4_and_8)
    with pytest.warns(kml.MeshLayoutWarning, match=r"\(1 of max_save_failures=2 failures in a row\)"):
        model = fit(
            [kml.ResumableCheckpoint(tmp_path, save_freq=2, max_save_failures=2, delete_on_end=False)]
        )
    assert all(np.array_equal(a, b) for a, b in zip(values(model), uninterrupted, strict=True))
    assert training(tmp_path / "latest")["step"] == TOTAL


@pytest.mark.parametrize("failing", ["start", "finish"])
def test_a_failed_background_save_waits_for_the_writes_it_had_started(monkeypatch, tmp_path, failing):
    """Regression: the optimizer's write outlived a failed model write, still writing into the removed
    partial directory; Orbax's checkpointer, collected with its thread never joined, deadlocked a run."""
    from keras_meshlayout.checkpoint import _orbax_store, _save

    started, finished = [], []
    start_save, finish = _orbax_store.start_save, _orbax_store.finish

    def start_then_fail(directory, kind, values):
        if failing == "start" and started:
            raise OSError(28, "No space left on device")
        started.append(start_save(directory, kind, values))
        return started[-1]

    def finish_then_fail(write):
        finished.append(write)
        finish(write)
        if failing == "finish" and len(finished) == 1:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(_orbax_store, "start_save", start_then_fail)
    monkeypatch.setattr(_orbax_store, "finish", finish_then_fail)
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), RULES)
    keras.distribution.set_distribution(distribution)
    model = build()
    model.fit(*data(), batch_size=BATCH, epochs=1, steps_per_epoch=1, verbose=0)
    with pytest.raises(kml.CheckpointError, match="No space left on device"):
        _save.BackgroundSave(model, tmp_path / "latest", distribution, {"step": 1}).wait()
    assert finished == started and len(started) == (1 if failing == "start" else 2), "every write waited for"
    assert list(tmp_path.iterdir()) == [], "nothing left behind"


def test_a_background_save_past_the_exit_deadline_is_named_and_left(monkeypatch, tmp_path, capsys):
    """At exit the process waits for its background saves up to a deadline; one still writing then is
    named on stderr and left to the next save or load, the checkpoint before it intact."""
    from keras_meshlayout.checkpoint import _orbax_store, _save

    finish = _orbax_store.finish
    monkeypatch.setattr(_orbax_store, "finish", lambda write: (time.sleep(1.0), finish(write)))
    distribution = kml.ModelParallel(kml.Mesh(data=2, model=4), RULES)
    keras.distribution.set_distribution(distribution)
    model = build()
    model.fit(*data(), batch_size=BATCH, epochs=1, steps_per_epoch=1, verbose=0)
    pending = _save.BackgroundSave(model, tmp_path / "latest", distribution, {"step": 1})
    assert _save.finish_background_saves(deadline_s=0.05) == [tmp_path / "latest"]
    err = capsys.readouterr().err
    assert f"the background save of {tmp_path / 'latest'} did not finish in time" in err, err
    pending.wait()  # it goes on meanwhile: once waited for, it is in place and nothing is left
    assert _save.finish_background_saves(deadline_s=0.05) == []
    assert training(tmp_path / "latest")["step"] == 1


@pytest.mark.parametrize("removable", [True, False], ids=["removed", "left"])
def test_a_failed_save_says_truly_whether_what_it_wrote_was_removed(monkeypatch, tmp_path, removable):
    """The message says "removed" only when the partial directory is gone, else where it is left."""
    if not removable:  # a file system that refuses the removal (a busy mount, an immutable file)
        monkeypatch.setattr(_atomic.shutil, "rmtree", lambda path, ignore_errors=False: None)
    target = tmp_path / "latest"
    with pytest.raises(kml.CheckpointError) as raised, _atomic.writing(target) as save:
        save.prepare()
        (save.at(save.partial / "weights.bin")).write_bytes(b"0")
        raise OSError(28, "No space left on device")
    message = str(raised.value)
    assert save.partial.exists() is not removable
    if removable:
        assert "What this save had written was removed." in message
    else:
        assert f"What this save had written is left in {save.partial}: it could not be removed" in message
        assert "was removed" not in message


# -- options and the smaller items ---------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [("max_to_keep", 0), ("max_to_keep", "2"), ("max_save_failures", 0), ("max_save_failures", True)],
    ids=["keep-0", "keep-str", "failures-0", "failures-bool"],
)
def test_bad_options_are_clear_errors(option, value):
    with pytest.raises(kml.InvalidOptionError) as raised:
        kml.ResumableCheckpoint("backup", **{option: value})
    assert str(raised.value) == f"{option} must be a positive integer. Received: {option}={value!r}."


@pytest.mark.parametrize(("age_s", "refused"), [(10, True), (200, False)], ids=["fresh", "stale"])
def test_a_lock_from_another_host_counts_while_it_is_refreshed(age_s, refused, tmp_path):
    """A holder on another host cannot be asked if it lives: its lock counts for 120 s after a refresh."""
    from keras_meshlayout.checkpoint import _lock

    lock = tmp_path / ".kml-run.lock"
    lock.write_text(json.dumps({"host": "elsewhere", "pid": 1, "started": 0}))
    os.utime(lock, (time.time() - age_s,) * 2)
    holder = _lock.DirectoryLock(tmp_path)
    if refused:
        with pytest.raises(
            kml.CheckpointError, match="in use by another run: process 1 on elsewhere, started "
        ):
            holder.acquire()
        return
    holder.acquire()  # taken over
    assert json.loads(lock.read_text())["pid"] == os.getpid()
    holder.release()
    assert not lock.exists()


def test_a_directory_that_cannot_be_created_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(kml.CheckpointError) as raised:
        fit([kml.ResumableCheckpoint(tmp_path / "file" / "backup")])
    assert str(raised.value) == (
        f"Could not lock the backup directory {tmp_path / 'file' / 'backup'} "
        f"({tmp_path / 'file' / 'backup' / '.kml-run.lock'}): Not a directory (errno 20). Nothing was "
        "loaded or written. Fix: check that the directory can be created and written, or pass another one."
    )


def test_loading_a_keras_weights_file_says_what_it_is_and_what_loads_it(tmp_path):
    keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), RULES))
    model = build()
    model.save_weights(tmp_path / "model.weights.h5")
    with pytest.raises(kml.CheckpointError) as raised:
        kml.load_checkpoint(model, tmp_path / "model.weights.h5")
    assert str(raised.value) == (
        f"{tmp_path / 'model.weights.h5'} is not a checkpoint: a checkpoint is a directory, and this is an "
        "HDF5 file: Keras weights (.weights.h5, written by model.save_weights). Fix: load it with "
        "model.load_weights(path), into a model built (and compiled, for the optimizer state) under the "
        "distribution; kml.load_checkpoint reads the directories kml.save_checkpoint writes."
    )


# -- real processes, real signals ----------------------------------------------------------

#: One training run: `python train.py WORK PAUSE SLOW_FROM`, alone or under the launcher (2 × 4): it
#: sleeps PAUSE seconds after each step from step SLOW_FROM on (0: never), to be signalled there.
TRAIN = """
import json, os, sys, time
from pathlib import Path

import keras_meshlayout as kml

process, processes = kml.initialize(emulate_devices=8)

import keras
import numpy as np
from jax.experimental import multihost_utils

sys.path.insert(0, {tests!r})
from test_checkpoint_faults import BATCH, EPOCHS, RULES, build, data

work, pause, slow_from = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
dist = kml.ModelParallel(kml.Mesh(data=2, model=4), RULES)
keras.distribution.set_distribution(dist)
model = build()
x, y = kml.process_slice(data(), batch_size=BATCH, distribution=dist)


class Progress(keras.callbacks.Callback):
    # Says how far training is (process 0), and trains slowly enough to be signalled at a step.
    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations)
        if process == 0:
            (work / "progress").write_text(str(step))
        if slow_from and step >= slow_from:
            time.sleep(pause)


backup = kml.ResumableCheckpoint(work / "backup", save_freq=4)
model.fit(
    x, y, batch_size=kml.local_batch_size(BATCH, dist), epochs=EPOCHS, shuffle=False, verbose=0,
    callbacks=[Progress(), backup],
)
state = [np.asarray(multihost_utils.process_allgather(v.value, tiled=True)) for v in model.weights]
if process == 0:
    np.savez(work / "final.npz", *state)
    print("iterations", int(model.optimizer.iterations))
"""

LAUNCH = [sys.executable, "-m", "keras_meshlayout.launch", "-n", "2", "--devices-per-process", "4"]
TIMEOUT_S = 240  # a bound on each run (a few seconds each on 2 idle cores)


def child_env() -> dict[str, str]:
    """This environment minus JAX and Keras settings: the script sets up its own devices."""
    return fresh_env()


def command(work: Path, processes: int, pause: float = 0.0, slow_from: int = 0) -> list[str]:
    script = work / "train.py"
    if not script.exists():
        script.write_text(TRAIN.format(tests=str(Path(__file__).resolve().parent)))
    launcher = [*LAUNCH, "--timeout", str(TIMEOUT_S), "--grace", "60"] if processes > 1 else [sys.executable]
    return [*launcher, str(script), str(work), str(pause), str(slow_from)]


def run(work: Path, processes: int) -> subprocess.CompletedProcess:
    done = subprocess.run(
        command(work, processes),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def final(work: Path) -> list[np.ndarray]:
    saved = np.load(work / "final.npz")
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def start_slow(work: Path, processes: int, slow_from: int, pause: float = 0.3) -> subprocess.Popen:
    """A run at full speed until step `slow_from`, then `pause` seconds after each step."""
    return subprocess.Popen(
        command(work, processes, pause, slow_from),
        env=child_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_step(child: subprocess.Popen, work: Path, step: int) -> int:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            reached = int((work / "progress").read_text() or 0)
        except (OSError, ValueError):
            reached = 0
        if reached >= step:
            return reached
        if child.poll() is not None:
            pytest.fail(f"the run ended before step {step}:\n{child.stderr.read()[-4000:]}")
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"the run never reached step {step}")
        time.sleep(0.02)


@pytest.mark.parametrize("processes", [1, 2], ids=["1-process", "launcher-2x4"])
def test_sigterm_at_a_random_step_backs_up_that_step_and_the_restart_is_bit_exact(
    processes, uninterrupted, tmp_path
):
    if processes == 1:  # one process of 8 devices computes bit for bit what this one does
        reference = uninterrupted[:WEIGHTS]
    else:  # two processes do not (their collectives add in another order): trained the same way
        (tmp_path / "reference").mkdir()
        run(tmp_path / "reference", processes)
        reference = final(tmp_path / "reference")
    work = tmp_path / "work"
    work.mkdir()
    step = random.Random().randrange(2, TOTAL - 2)  # any step: the message says which, if it fails
    child = start_slow(work, processes, slow_from=step)
    try:
        signalled = wait_for_step(child, work, step)
        child.send_signal(signal.SIGTERM)
        _, stderr = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate(timeout=60)
    assert child.returncode == 143, stderr[-4000:]
    saved = training(work / "backup" / "latest")["step"]
    assert signalled <= saved <= signalled + 1, f"signalled after step {signalled}, backed up {saved}"
    stopped = re.search(
        r"keras_meshlayout: SIGTERM received: training stopped after epoch \d+, batch \d+, "
        r"backed up at \S+latest\. Exiting with status 143; run the same script again to resume\.",
        stderr,
    )
    assert stopped, stderr[-4000:]
    if processes > 1:
        assert "received SIGTERM: sent SIGTERM to ranks 0, 1 as a preemption notice" in stderr, stderr[-4000:]
        assert "rank 0 exited with status 143, rank 1 exited with status 143." in stderr, stderr[-4000:]
    rerun = run(work, processes)
    assert f"iterations {TOTAL}" in rerun.stdout
    assert all(np.array_equal(a, b) for a, b in zip(final(work), reference, strict=True)), (
        f"signalled at step {step}"
    )
    assert not (work / "backup").exists(), "deleted once the resumed run completed"


LAST_VALIDATION = """
import os, signal, sys

import keras_meshlayout as kml

kml.emulate_devices(8)
import keras
import numpy as np

x = np.random.default_rng(0).normal(size=(96, 16)).astype("float32")
keras.utils.set_random_seed(0)
layers = [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(8)]
model = keras.Sequential(layers)
model.compile(keras.optimizers.Adam(1e-2), "mse")


class SignalInTheLastValidation(keras.callbacks.Callback):
    def on_test_batch_end(self, batch, logs=None):
        if sys.argv[2] == "signal" and int(model.optimizer.iterations) == 18 and batch == 0:
            os.kill(os.getpid(), signal.SIGTERM)


backup = kml.ResumableCheckpoint(sys.argv[1], save_freq=4)
callbacks = [SignalInTheLastValidation(), backup]
model.fit(x, x[:, :8], batch_size=16, epochs=3, verbose=0, validation_data=(x, x[:, :8]), callbacks=callbacks)
print("fit returned, iterations", int(model.optimizer.iterations), flush=True)
"""


def test_a_sigterm_in_the_last_validation_stops_the_run_as_after_any_step(tmp_path):
    """Regression: a SIGTERM after the last step (the last epoch's validation) was lost: `fit` returned,
    the backups were deleted and the script went on, to be killed mid-write by the scheduler. It stops
    as after any step now: backed up, status 143; run again, the script finds the run complete."""
    script = tmp_path / "train.py"
    script.write_text(LAST_VALIDATION)

    def run_it(*how: str) -> subprocess.CompletedProcess:
        argv = [sys.executable, str(script), str(tmp_path / "backup"), *how]
        return subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S)

    stopped = run_it("signal")
    assert stopped.returncode == 143, stopped.stderr[-4000:]
    assert "fit returned" not in stopped.stdout
    assert training(tmp_path / "backup" / "latest")["step"] == 18
    resumed = run_it("no-signal")
    assert resumed.returncode == 0 and "fit returned, iterations 18" in resumed.stdout, resumed.stderr[-4000:]
    assert not (tmp_path / "backup").exists()


def test_a_second_job_on_a_held_directory_is_refused_until_the_holder_is_gone(tmp_path):
    first = start_slow(tmp_path, 1, slow_from=2, pause=5.0)  # held until killed below
    try:
        wait_for_step(first, tmp_path, 2)
        second = subprocess.run(
            command(tmp_path, 1), env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
        assert second.returncode == 1
        host = re.escape(_atomic.hostname())
        assert re.search(
            rf"CheckpointError: The backup directory \S+backup is in use by another run: "
            rf"process {first.pid} on {host}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC "
            r"\(its lock: \S+\.kml-run\.lock\)\.",
            second.stderr,
        ), second.stderr[-3000:]
        assert first.poll() is None, "the first job runs on"
    finally:
        first.kill()  # the holder is gone: the same run resumes
        first.communicate(timeout=60)
    rerun = run(tmp_path, 1)
    assert f"iterations {TOTAL}" in rerun.stdout


#: Trains with asynchronous backups (after steps 4, 8, 12, 16) on a small tmpfs, filled after step 5
#: (once the backup after step 4 is in place) and freed after step 10 (once the one after step 8 failed).
DISK_FULL = """
import faulthandler, json, os, sys, time, warnings
from pathlib import Path

faulthandler.dump_traceback_later({hang_s}, exit=True)  # a hang shows its threads' stacks, not a timeout

import keras_meshlayout as kml

kml.emulate_devices(8)

import keras
import numpy as np
from keras_meshlayout.checkpoint import _save

sys.path.insert(0, {tests!r})
from test_checkpoint_faults import BATCH, EPOCHS, RULES, build, data

disk, work = Path(sys.argv[1]), Path(sys.argv[2])


def settled():
    # Waits until the background save under way (if any) has ended: in place, or failed. (A failed
    # save can leave its hidden directory beside "latest" until the next save removes it, so waiting
    # for the directory to go waited out a 60 s deadline: 68 s of this test's 70.)
    _save.wait_for_background_saves(disk / "backup" / "latest")


class Fill(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        if self.steps == 5:
            settled()
            # Unbuffered: a buffered file kept the part of its last write that did not fit, and
            # failed again (ENOSPC) when closed, whenever the free space was not a multiple of 64 KiB.
            with open(disk / "filler", "wb", buffering=0) as f:
                try:
                    while True:
                        f.write(bytes(1 << 16))
                except OSError:
                    pass
        if self.steps == 10:
            settled()
            (disk / "filler").unlink()
        if self.steps == 16:  # what the last backup holds
            self.saved = [np.asarray(v.value) for v in self.model.weights]


keras.distribution.set_distribution(kml.ModelParallel(kml.Mesh(data=2, model=4), RULES))
model = build()
backup = kml.ResumableCheckpoint(disk / "backup", save_freq=4, asynchronous=True, delete_on_end=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fill = Fill()
    model.fit(*data(), batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0, callbacks=[fill, backup])
fresh = build()
kml.load_checkpoint(fresh, disk / "backup" / "latest")
results = dict(
    warnings=[str(w.message) for w in caught],
    iterations=int(model.optimizer.iterations),
    latest=json.loads((disk / "backup" / "latest" / "manifest.json").read_text())["training"],
    entries=sorted(os.listdir(disk / "backup")),
    loaded=all(np.array_equal(np.asarray(a.value), b) for a, b in zip(fresh.weights, fill.saved)),
)
(work / "results.json").write_text(json.dumps(results))
"""


def test_a_full_disk_during_a_background_save_is_one_line_and_training_goes_on(tmp_path):
    (tmp_path / "disk").mkdir()
    script = tmp_path / "disk_full.py"
    script.write_text(DISK_FULL.format(tests=str(Path(__file__).resolve().parent), hang_s=TIMEOUT_S - 30))
    # unshare: a user and mount namespace, so that no root is needed and the mount dies with the child.
    mount = 'mount -t tmpfs -o size=4m tmpfs "$0" && exec "$1" "$2" "$0" "$3"'
    argv = ["unshare", "-rm", "sh", "-c", mount, tmp_path / "disk", sys.executable, script, tmp_path]
    done = subprocess.run(
        [str(a) for a in argv], env=child_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["iterations"] == TOTAL, "training went on"
    [message] = results["warnings"]  # the backup after step 8, reported when the next one starts
    assert "\n" not in message
    assert re.fullmatch(
        r"Saving checkpoint \S+/latest failed while writing \S+\.orbax: No space left on device "
        r"\(errno 28\)\. The previous checkpoint at \S+/latest is intact\. .* Training goes on; the next "
        r"backup tries again "
        r"\(1 of max_save_failures=3 failures in a row\)\.",
        message,
    ), message
    assert results["latest"]["step"] == 16, "a later save succeeded once space was freed"
    assert results["entries"] == ["latest", "step-000000012"]
    assert results["loaded"]
