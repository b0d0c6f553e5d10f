"""Past one process: the launcher, `kml.initialize`, hybrid meshes, per-process data, checkpoints.

The end-to-end cases start real processes on loopback with
`python -m keras_meshlayout.launch`, each bounded by a timeout; the others run
in this process, with fake devices standing in for the devices of other
processes where a mesh must span several.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import jax
import keras
import numpy as np
import pytest
from helpers import BATCH, MLP_RULES, assert_same_weights, build_mlp, fresh_env, train

import keras_meshlayout as kml
from keras_meshlayout import launch as launch_module
from keras_meshlayout.runtime._cluster import INIT_TIMEOUT_EXIT_STATUS, cluster_config
from keras_meshlayout.runtime._launch import _environment
from keras_meshlayout.runtime._ports import free_port as _free_port
from keras_meshlayout.runtime._relay import GlooLines as _GlooLines
from keras_meshlayout.runtime._supervise import first_failure as _first_failure
from keras_meshlayout.runtime._supervise import watch as _watch
from keras_meshlayout.runtime._worker import _exit_status, wait_for_peers

TESTS = Path(__file__).resolve().parent
STEPS = 8
LAUNCH_TIMEOUT_S = 120  # a hard bound on every launcher run; each finishes far sooner


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the test session's JAX, Keras and distribution settings."""
    env = fresh_env("JAX_PLATFORMS", "JAX_NUM_CPU_DEVICES")
    env = {k: v for k, v in env.items() if not k.startswith(("KML_", "KERAS_DISTRIBUTION_", "SLURM_"))}
    return {**env, "PYTHONIOENCODING": "utf-8", **extra}


def run_launcher(script: Path, *args: str, n: int = 2, options: tuple[str, ...] = ()) -> tuple:
    """Runs the launcher on `script`; returns the completed process and the seconds it took."""
    command = [sys.executable, "-m", "keras_meshlayout.launch", "-n", str(n), *options, str(script), *args]
    start = time.monotonic()
    result = subprocess.run(
        command,
        cwd=script.parent,
        env=clean_env(),
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=LAUNCH_TIMEOUT_S,
    )
    return result, time.monotonic() - start


def output(result: subprocess.CompletedProcess) -> str:
    return (
        f"exit status {result.returncode}\n--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def launched_pids(stderr: str) -> dict[int, int]:
    """The pids the launcher announces: `rank 0: pid 123, rank 1: pid 124`."""
    return {int(rank): int(pid) for rank, pid in re.findall(r"rank (\d+): pid (\d+)", stderr)}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def processes_running(fragment: str) -> list[int]:
    """Pids of processes whose command line mentions `fragment` (from /proc, no psutil)."""
    found = []
    if not Path("/proc").is_dir():
        return found  # not Linux: the pid checks still run
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if fragment in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def write_script(directory: Path, name: str, source: str) -> Path:
    path = directory / name
    path.write_text(textwrap.dedent(source))
    return path


# -- 2 processes x 4 devices train exactly as 1 process x 8 ------------------------

TRAIN_WORKER = """
import json, sys, warnings
from pathlib import Path

import keras_meshlayout as kml

process_id, num_processes = kml.initialize(emulate_devices=8)

import keras
import numpy as np

sys.path.insert(0, {tests!r})
from helpers import BATCH, MLP_RULES, build_mlp, train

out = Path(sys.argv[1])
inputs = np.load(out / "inputs.npz")
initial = [inputs[f"w{{i}}"] for i in range(len(inputs.files) - 2)]

mesh = kml.Mesh(data=2, model=4)
report = {{
    "process": [process_id, num_processes],
    "process_ids": mesh.process_ids.tolist(),
    "axes_across_processes": list(mesh.axes_across_processes),
    "process_layout": kml.process_layout(mesh),
}}
try:
    kml.Mesh(data=1, model=8)
except kml.InvalidMeshError as err:
    report["refused"] = str(err)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    split = kml.Mesh(data=1, model=8, allow_split_across_processes=True)
report["split_warnings"] = [str(w.message) for w in caught if issubclass(w.category, kml.ProcessSplitWarning)]
report["split_process_ids"] = split.process_ids.tolist()

dist = kml.ModelParallel(mesh, MLP_RULES, batch_axis="data", auto_shard_dataset=False)
local = kml.process_slice((inputs["x"], inputs["y"]), batch_size=BATCH, distribution=dist)
report["local_rows"] = int(local[0].shape[0])
model = train(build_mlp, initial, local, dist, batch_size=kml.local_batch_size(BATCH, dist))
weights = [np.asarray(w.value) for w in model.weights]  # each process holds them whole
kml.save_weights(model, out / "model.weights.h5")  # every process calls it; process 0 writes
kml.save_checkpoint(model, out / "checkpoint")  # likewise, with the plan and the manifest
if process_id == 0:
    np.savez(out / "trained.npz", *weights)
    (out / "report.json").write_text(json.dumps(report))
print(f"process {{process_id}} of {{num_processes}} done", flush=True)
"""


@pytest.fixture(scope="module")
def mlp_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 32)).astype("float32")
    return x, x[:, :10].argmax(axis=1).astype("int32")


@pytest.fixture(scope="module")
def initial_weights() -> list[np.ndarray]:
    keras.distribution.set_distribution(None)
    keras.utils.set_random_seed(42)
    return build_mlp().get_weights()


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, mlp_data, initial_weights):
    """One launcher run of 2 processes x 4 devices training the MLP; its outputs."""
    out = tmp_path_factory.mktemp("two_process_run")
    x, y = mlp_data
    np.savez(out / "inputs.npz", x=x, y=y, **{f"w{i}": w for i, w in enumerate(initial_weights)})
    script = write_script(out, "train_worker.py", TRAIN_WORKER.format(tests=str(TESTS)))
    result, seconds = run_launcher(
        script, str(out), options=("--devices-per-process", "4", "--init-timeout", "60")
    )
    assert result.returncode == 0, output(result)
    trained = np.load(out / "trained.npz")
    return {
        "result": result,
        "seconds": seconds,
        "out": out,
        "trained": [trained[f"arr_{i}"] for i in range(len(trained.files))],
        "report": json.loads((out / "report.json").read_text()),
    }


def test_two_processes_train_like_one_process_of_eight_devices(two_process_run, mlp_data, initial_weights):
    keras.distribution.set_distribution(None)
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), MLP_RULES, batch_axis="data")
    reference = train(build_mlp, initial_weights, mlp_data, dist)
    moved = max(np.abs(a - b).max() for a, b in zip(initial_weights, two_process_run["trained"], strict=True))
    assert moved > 1e-3, "training must change the weights for the comparison to mean anything"
    assert_same_weights(reference, two_process_run["trained"])


def test_two_process_run_output_is_prefixed_by_rank(two_process_run):
    result = two_process_run["result"]
    assert "[0] process 0 of 2 done" in result.stdout, output(result)
    assert "[1] process 1 of 2 done" in result.stdout, output(result)
    assert set(launched_pids(result.stderr)) == {0, 1}, output(result)


def test_two_process_mesh_puts_data_across_processes(two_process_run):
    report = two_process_run["report"]
    assert report["process"] == [0, 2]
    assert report["process_ids"] == [[0, 0, 0, 0], [1, 1, 1, 1]]
    assert report["axes_across_processes"] == ["data"]
    assert report["local_rows"] == BATCH * STEPS // 2
    assert report["process_layout"] == [
        "2 processes × 4 devices; across processes: data; within each process: model",
        "process 0: data=0, model=0..3 (devices 0-3)",
        "process 1: data=1, model=0..3 (devices 2048-2051)",
    ]


def test_two_process_mesh_refuses_model_axis_across_processes(two_process_run):
    report = two_process_run["report"]
    assert report["refused"].startswith(
        "Mesh(data=1, model=8) on 2 processes × 4 devices: the axes across processes ('data',) can "
        "hold only 1 of the 2 processes, so axis 'model' would also span processes"
    ), report["refused"]
    assert "allow_split_across_processes=True" in report["refused"]
    assert report["split_process_ids"] == [[0, 0, 0, 0, 1, 1, 1, 1]]
    assert report["split_warnings"] == [
        "Mesh(data=1, model=8): axis 'model' spans processes (model: 2 processes), as "
        "allow_split_across_processes=True permits; collectives over it cross the links between "
        "hosts every step."
    ]


def compiled_mlp_on_1x8() -> keras.Model:
    """The MLP built and compiled (optimizer built) under a 1x8 distribution in this process."""
    keras.distribution.set_distribution(
        kml.ModelParallel(kml.Mesh(data=1, model=8), MLP_RULES, batch_axis="data")
    )
    model = build_mlp()
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.optimizer.build(model.trainable_variables)
    return model


def test_multi_process_checkpoint_restores_in_one_process(two_process_run, mlp_data):
    """Weights saved by process 0 of the 2-process run load on a 1x8 mesh in this process."""
    model = compiled_mlp_on_1x8()
    model.load_weights(two_process_run["out"] / "model.weights.h5")
    assert_same_weights(model, two_process_run["trained"])
    kernel = model.get_layer("hidden_1").kernel.value
    assert tuple(kernel.sharding.spec) == (None, "model") and kernel.sharding.mesh.shape["model"] == 8
    momentum = [v for v in model.optimizer.variables if v.path.endswith("hidden_1_kernel_momentum")]
    assert momentum and np.abs(np.asarray(momentum[0].value)).max() > 0, "optimizer state restored"


def test_multi_process_save_checkpoint_loads_in_one_process(two_process_run):
    """`kml.save_checkpoint` from both processes: one complete checkpoint, loadable on 1x8."""
    model = compiled_mlp_on_1x8()
    diff = kml.load_checkpoint(model, two_process_run["out"] / "checkpoint")
    assert_same_weights(model, two_process_run["trained"])
    assert (dict(diff.mesh_before), dict(diff.mesh_after)) == (
        {"data": 2, "model": 4},
        {"data": 1, "model": 8},
    )


LONG_LOOPS_WORKER = """
import keras_meshlayout as kml

process_id, _ = kml.initialize(emulate_devices=8)
import keras
import numpy as np

# Tensor-parallel layers: collectives inside each process and across the two, every step.
rules = kml.LayoutRules([(r".*fc1/kernel", (None, "model")), (r".*fc2/kernel", ("model", None))])
dist = kml.ModelParallel(kml.Mesh(data=2, model=4), rules, auto_shard_dataset=False)
keras.distribution.set_distribution(dist)
layers = [keras.Input((8,)), keras.layers.Dense(16, name="fc1"), keras.layers.Dense(4, name="fc2")]
model = keras.Sequential(layers)
model.compile(optimizer="sgd", loss="mse", metrics=["mae"])
x, y = kml.process_slice((np.ones((8 * 48, 8), "float32"), np.ones((8 * 48, 4), "float32")), batch_size=8)
local = kml.local_batch_size(8)
model.evaluate(x, y, batch_size=local, verbose=0)
model.fit(x, y, batch_size=local, epochs=1, verbose=0)
print(f"rank {process_id}: fit and evaluate, 48 steps each", flush=True)
"""


def test_keras_loops_longer_than_xla_cpu_in_flight_limit(tmp_path):
    """Regression (issue 13): from about 32 queued steps on, XLA's CPU client deadlocked
    multi-process fit and evaluate; kml.initialize now paces Keras's loops."""
    script = write_script(tmp_path, "long_loops.py", LONG_LOOPS_WORKER)
    result, _ = run_launcher(script, options=("--devices-per-process", "4", "--timeout", "90"))
    assert result.returncode == 0, output(result)
    for rank in (0, 1):
        assert f"[{rank}] rank {rank}: fit and evaluate, 48 steps each" in result.stdout, output(result)


@pytest.mark.parametrize(
    "maker, attribute",
    [
        ("make_train_function", "train_function"),
        ("make_test_function", "test_function"),
        ("make_predict_function", "predict_function"),
    ],
    ids=["train", "test", "predict"],
)
def test_keras_trainer_has_what_pacing_wraps(maker, attribute):
    """kml.initialize paces these Keras trainer methods; a Keras upgrade that renames one fails here."""
    from keras_meshlayout._compat import trainer_class
    from keras_meshlayout.runtime._initialize import pace_keras_steps

    assert callable(getattr(trainer_class(), maker, None)), f"JAXTrainer.{maker} is gone"
    pace_keras_steps()
    pace_keras_steps()  # once only
    assert getattr(getattr(trainer_class(), maker), "_kml_paced", False)
    keras.distribution.set_distribution(None)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="sgd", loss="mse")
    getattr(model, maker)()
    step = getattr(model, attribute)
    assert callable(step), f"{maker} no longer sets model.{attribute}"
    assert not getattr(step, "_kml_paced", False), "one process: nothing to pace"


# -- failures end the run, bounded, with nothing left behind ------------------------------

FAILING_WORKER = """
import os, signal, sys

import keras_meshlayout as kml

process_id, _ = kml.initialize(emulate_devices=8)

import keras
import numpy as np

HOW, RANK = sys.argv[1], int(sys.argv[2])


class FailAtStep3(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if process_id == RANK and batch == 3:
            print(f"rank {RANK} fails at step 3: {HOW}", flush=True)
            if HOW == "exception":
                raise RuntimeError("step 3 went wrong")
            if HOW == "exit":
                sys.exit(3)
            if HOW == "exit-0":
                sys.exit(0)
            os.kill(os.getpid(), signal.SIGKILL)


dist = kml.ModelParallel(kml.Mesh(data=2, model=4), auto_shard_dataset=False)
keras.distribution.set_distribution(dist)
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64), keras.layers.Dense(10)])
model.compile(optimizer="sgd", loss="mse")
x, y = np.zeros((64 * 50, 32), "float32"), np.zeros((64 * 50, 10), "float32")
x, y = kml.process_slice((x, y), batch_size=64)
model.fit(x, y, batch_size=kml.local_batch_size(64), epochs=100, verbose=0, callbacks=[FailAtStep3()])
"""


@pytest.mark.parametrize(
    "how, rank, status, described, shown",
    [
        ("exception", 1, 1, "exited with status 1", "RuntimeError: step 3 went wrong"),
        ("exception", 0, 1, "exited with status 1", "RuntimeError: step 3 went wrong"),
        ("exit", 1, 3, "exited with status 3", None),
        # Regression: a status of 0 from inside `fit` hung the job (the other rank waited for it in
        # a collective, the launcher for both): reported as a failure with what to do instead.
        ("exit-0", 1, 1, "exited with status 1", "kml: this process left model.fit with sys.exit(0)"),
        ("sigkill", 1, 128 + signal.SIGKILL, r"was killed by signal 9 \(SIGKILL\)", None),
    ],
    ids=["exception-rank-1", "exception-coordinator", "sys-exit", "sys-exit-0", "sigkill"],
)
def test_a_failing_worker_ends_the_job_naming_it(tmp_path, how, rank, status, described, shown):
    """Regression (issue 13): a worker failing after kml.initialize hung ~300 s in JAX's exit barrier,
    and then the launcher blamed another rank with another status."""
    script = write_script(tmp_path, "failing_worker.py", FAILING_WORKER)
    result, seconds = run_launcher(
        script, how, str(rank), options=("--devices-per-process", "4", "--init-timeout", "60", "--grace", "3")
    )
    assert result.returncode == status, output(result)
    assert seconds < 60, f"took {seconds:.0f} s\n{output(result)}"
    assert f"[{rank}] rank {rank} fails at step 3: {how}" in result.stdout, output(result)
    if shown:
        assert f"[{rank}] {shown}" in result.stderr, output(result)
    other = 1 - rank
    # The other rank is stopped by the launcher, or ends on its own when its peer vanishes.
    assert re.search(
        rf"keras_meshlayout\.launch: rank {rank} \(pid \d+\) {described}"
        rf"(; stopped rank {other} by SIGTERM\.|\. Then rank {other} (exited with status|was killed by) .*)$",
        result.stderr.strip().splitlines()[-1],
    ), output(result)
    pids = launched_pids(result.stderr)
    assert set(pids) == {0, 1}, output(result)
    assert not [pid for pid in pids.values() if alive(pid)], "a launched process outlived the launcher"
    assert not processes_running(str(script)), "a process of the run is still running"


JOB_ON_A_PORT = """
import sys, time
from pathlib import Path

import keras_meshlayout as kml

process_id, _ = kml.initialize()
import jax
from jax.experimental import multihost_utils

print(f"rank {process_id} joined", flush=True)
flag = Path(sys.argv[1])
deadline = time.monotonic() + 60
while not flag.exists() and time.monotonic() < deadline:  # the test lets the job end
    time.sleep(0.1)
multihost_utils.sync_global_devices("still one job")  # fails if another job's process joined
print(f"rank {process_id} done", flush=True)
"""


def wait_for_line(process: subprocess.Popen, text: str, seconds: float) -> str:
    """Reads the process's stdout until a line contains `text`; returns what was read."""
    seen, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"{text!r} not printed within {seconds} s:\n{''.join(seen)}")


def test_second_job_on_a_running_jobs_port_fails_fast_and_the_first_finishes(tmp_path):
    """Regression (issue 13): the second job's processes joined the first's coordinator and killed it."""
    script = write_script(tmp_path, "job.py", JOB_ON_A_PORT)
    port = str(_free_port())
    command = [sys.executable, "-m", "keras_meshlayout.launch", "--port", port, "--devices-per-process", "2"]
    first = subprocess.Popen(
        [*command, str(script), str(tmp_path / "end")],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        encoding="utf-8",
    )
    try:
        wait_for_line(first, "joined", LAUNCH_TIMEOUT_S)
        start = time.monotonic()
        second = subprocess.run(
            [*command, str(script), str(tmp_path / "end")],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            encoding="utf-8",
            timeout=LAUNCH_TIMEOUT_S,
        )
        seconds = time.monotonic() - start
        (tmp_path / "end").touch()
        rest, errors = first.communicate(timeout=LAUNCH_TIMEOUT_S)
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2, output(second)
    assert seconds < 15, f"took {seconds:.0f} s\n{output(second)}"
    assert second.stderr == (
        f"keras_meshlayout.launch: error: port {port} is in use by another keras_meshlayout.launch job "
        f"on this machine (pid {first.pid}): its coordinator listens there, and processes of a second "
        "job would join it and abort both jobs. Fix: pass another --port, or leave out --port to use "
        "a free one.\n"
    ), output(second)
    assert second.stdout == ""
    assert first.returncode == 0, f"exit status {first.returncode}\n{rest}\n{errors}"
    assert "[0] rank 0 done" in rest and "[1] rank 1 done" in rest, rest


def test_port_held_by_another_program_is_a_clear_error(tmp_path):
    script = write_script(tmp_path, "never_runs.py", "raise SystemExit('must not start')\n")
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(1)
        port = squatter.getsockname()[1]
        result, seconds = run_launcher(script, options=("--port", str(port)))
    assert result.returncode == 2, output(result)
    assert seconds < 15, output(result)
    assert result.stderr == (
        f"keras_meshlayout.launch: error: port {port} on 127.0.0.1 is in use by another program "
        "(Address already in use), so the coordinator cannot listen there. Fix: pass another --port, "
        "or leave out --port to use a free one.\n"
    ), output(result)


def gloo_line(rank: int, connected: int, expected: int) -> bytes:
    return (
        f"[Gloo] Rank {rank} is connected to {connected} peer ranks. Expected number of connected "
        f"peer ranks is : {expected}\n"
    ).encode()


@pytest.mark.parametrize(
    "line, kept",
    [
        (gloo_line(3, 7, 7), False),
        (gloo_line(0, 1, 1), False),
        (gloo_line(3, 5, 7), True),
        (b"[Gloo] Rank " + gloo_line(0, 1, 1), False),  # two devices' lines, interleaved (seen)
        (gloo_line(0, 1, 1)[len(b"[Gloo] Rank ") :], False),  # ... and the rest of the second
        (
            b"[Gloo] Rank 2 is connected to [Gloo] Rank 73 peer ranks.  is connected to Expected number "
            b"of connected peer ranks is : 77 peer ranks. \n",
            False,
        ),  # seen in a recipe run
        (b"Expected number of connected peer ranks is : 7\n", False),  # ... its next line
        (b"[Gloo] something else\n", True),
        (b"epoch 1: loss 0.3 [Gloo] Rank 3 is connected to 7 peer ranks.\n", True),
        (b"Rank 3 is connected\n", True),
        (b"42\n", True),
    ],
    ids=[
        "connected-8",
        "connected-2",
        "missing-peers",
        "interleaved",
        "interleaved-rest",
        "interleaved-finer",
        "interleaved-tail",
        "other-gloo",
        "user-line",
        "plain",
        "number",
    ],
)
def test_launcher_drops_gloo_connection_lines(line, kept):
    """Regression (issue 13): about 30 of these per run buried the user's output."""
    assert _GlooLines().keep(line) is kept


@pytest.mark.parametrize(
    "code, status",
    [(None, 0), (0, 0), (3, 3), (256 + 7, 7), (-1, 255), ("bad input", 1), (True, 1)],
    ids=["none", "zero", "three", "wraps", "negative", "message", "bool"],
)
def test_worker_exit_status_is_pythons(code, status, capsys):
    assert _exit_status(code) == status
    assert capsys.readouterr().err == ("bad input\n" if code == "bad input" else "")


@pytest.mark.parametrize(
    "reported, late, waited",
    [((1, 2, 3), (), True), ((1, 3), (2,), True), ((1, 3), (), False), ((), (), False)],
    ids=["all-there", "one-late", "one-missing", "none"],
)
def test_stopped_process_0_leaves_after_its_peers_reported_or_its_grace(tmp_path, reported, late, waited):
    """Process 0 hosts the coordination service: stopped by SIGTERM, it leaves last, or after its grace."""
    for rank in reported:
        (tmp_path / f"exit.{rank}").write_text("143 0 own\n")
    timers = [threading.Timer(0.2, (tmp_path / f"exit.{rank}").write_text, ["143 0 own\n"]) for rank in late]
    for timer in timers:
        timer.start()
    start = time.monotonic()
    assert wait_for_peers(str(tmp_path), 4, grace=2.0) is waited  # a late report comes at 0.2 s
    assert (time.monotonic() - start >= 2.0) is not waited


def test_watch_names_the_worker_that_reported_first_though_another_ended_first(tmp_path):
    """Rank 1 fails (reports at t0, then takes 1 s to exit); rank 0, aborted by its peer's failure
    once the report is there, ends before it. The launcher must still name rank 1."""
    report, written = tmp_path / "exit.1", tmp_path / "exit.1.part"
    scripts = [  # the order is forced by the report file, not by timing, so a loaded machine keeps it
        "import os, signal, time\n"
        f"deadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(report)!r}) and time.monotonic() < deadline: time.sleep(0.01)\n"
        "os.kill(os.getpid(), signal.SIGABRT)",
        f"import os, time; open({str(written)!r}, 'w').write(f'3 {{time.time():.6f}} own'); "
        f"os.replace({str(written)!r}, {str(report)!r}); time.sleep(1.0); raise SystemExit(3)",
    ]
    processes = [subprocess.Popen([sys.executable, "-c", code]) for code in scripts]
    try:
        outcome = _watch(processes, 30, [], tmp_path)
    finally:
        for process in processes:
            process.kill()
            process.wait()
    assert (outcome.kind, outcome.rank) == ("failed", 1)
    assert processes[1].returncode == 3


@pytest.mark.parametrize(
    "failed, reported, first",
    [
        ({0: 100.3, 1: 100.6}, {1: (100.5, False)}, 0),  # rank 0 killed by a signal before rank 1 failed
        ({0: 100.6, 1: 100.7}, {1: (100.5, False)}, 1),  # rank 1 raised; rank 0 then lost its peer
        ({0: 100.6, 1: 100.9}, {0: (100.5, True)}, 1),  # rank 1 killed; rank 0's collective lost it first
        ({0: 100.6, 2: 100.9}, {0: (100.5, False), 2: (100.2, False)}, 2),
        ({1: 100.0, 0: 100.0}, {}, 0),
        ({1: 100.0}, {0: (99.0, False)}, 1),  # a report from a rank that did not fail does not count
    ],
    ids=[
        "signal-first",
        "report-first",
        "peer-lost-last",
        "earliest-report",
        "tie-lowest-rank",
        "only-failed",
    ],
)
def test_first_failure_is_the_earliest(failed, reported, first):
    assert _first_failure(failed, reported) == first


def test_failing_process_stops_the_others_and_sets_the_exit_status(tmp_path):
    script = write_script(
        tmp_path,
        "fails.py",
        """
        import os, sys, time
        if os.environ["KML_PROCESS_ID"] == "1":
            print("rank 1 fails", flush=True)
            sys.exit(3)
        print("rank 0 waits", flush=True)
        time.sleep(100)
        """,
    )
    result, seconds = run_launcher(script, options=("--grace", "2"))
    assert result.returncode == 3, output(result)
    assert seconds < 20, output(result)
    assert "[1] rank 1 fails" in result.stdout
    assert re.search(
        r"rank 1 \(pid \d+\) exited with status 3; stopped rank 0 by SIGTERM\.", result.stderr
    ), output(result)
    assert not processes_running(str(script))


def test_a_script_failing_in_every_process_is_its_own_failure_not_a_lost_peer(tmp_path):
    """Regression: a SyntaxError in both ranks ended "Then rank 1 exited with status 1 (a process fails
    once a collective loses its peer)", and each traceback opened on the launcher's own frames."""
    script = write_script(tmp_path, "broken.py", "def broken(:\n    pass\n")
    result, seconds = run_launcher(script, options=("--grace", "2"))
    assert result.returncode == 1, output(result)
    assert seconds < 30, output(result)
    for rank in (0, 1):  # what `python broken.py` prints, no more
        assert f'[{rank}]   File "{script}", line 1\n' in result.stderr, output(result)
        assert f"[{rank}] SyntaxError: invalid syntax" in result.stderr, output(result)
    assert "_worker.py" not in result.stderr and "runpy" not in result.stderr, output(result)
    last = result.stderr.strip().splitlines()[-1]
    assert "loses its peer" not in last, output(result)
    if "stopped rank" not in last:  # both failed within the launcher's settling time (0.5 s)
        assert re.search(r"Rank [01] exited with status 1 too, by an error of its own", last), last
        assert last.endswith("Every process failed by itself: the script fails on its own, not the job."), (
            last
        )


STRAGGLER = """
import sys
import keras_meshlayout as kml

process_id, _ = kml.initialize()
if process_id == 1:
    print("rank 1 leaves its loop early", flush=True)
    sys.exit(0)
from jax.experimental import multihost_utils

multihost_utils.sync_global_devices("rank 1 never comes")
"""


def test_a_process_that_finished_while_another_waits_for_it_is_named(tmp_path):
    """Regression: `sys.exit(0)` outside `fit` on one rank left the other in a collective and the job
    silent until --timeout (forever without one). Nothing failed; the launcher now says who is done
    and who still runs, and what to do."""
    script = write_script(tmp_path, "straggler.py", STRAGGLER)
    options = ("--notice-after", "2", "--timeout", "12", "--grace", "2", "--init-timeout", "60")
    result, _ = run_launcher(script, options=options)
    assert result.returncode == 124, output(result)
    notice = [line for line in result.stderr.splitlines() if "finished its script" in line]
    assert len(notice) == 1, output(result)
    assert notice[0].startswith(
        "keras_meshlayout.launch: rank 1 finished its script 2 s ago and waits for the others to end; "
        "rank 0 still running. If it waits in a collective"
    ), notice
    assert "model.stop_training = True" in notice[0]
    assert not processes_running(str(script))


SEES = """
import json, sys
print("SEES " + json.dumps([sys.argv, sys.path[0], __name__, __file__, type(__spec__).__name__]))
"""


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_launched_script_starts_as_under_python(tmp_path, as_module):
    """The worker bootstrap is invisible: sys.argv, sys.path[0], __name__, __file__ as `python` sets them."""
    write_script(tmp_path, "sees.py", SEES)
    target = ["-m", "sees"] if as_module else [str(tmp_path / "sees.py")]
    direct = subprocess.run(
        [sys.executable, *target, "a", "--b"], cwd=tmp_path, env=clean_env(), capture_output=True, text=True
    )
    launched = subprocess.run(
        [sys.executable, "-m", "keras_meshlayout.launch", "-n", "1", *target, "a", "--b"],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert launched.returncode == 0, output(launched)
    assert direct.stdout.startswith("SEES "), output(direct)
    assert launched.stdout == f"[0] {direct.stdout}", output(launched)


def test_launcher_timeout_stops_everything(tmp_path):
    script = write_script(tmp_path, "sleeps.py", "import time\ntime.sleep(100)\n")
    result, seconds = run_launcher(script, options=("--timeout", "1", "--grace", "2"))
    assert result.returncode == 124, output(result)
    assert seconds < 20
    assert (
        "--timeout 1 s passed with ranks 0, 1 still running; stopped ranks 0, 1 by SIGTERM." in result.stderr
    )
    assert not processes_running(str(script))


def test_process_that_never_joins_times_out_with_a_clear_message(tmp_path):
    script = write_script(
        tmp_path,
        "leaves_early.py",
        """
        import os, sys
        if os.environ["KML_PROCESS_ID"] == "1":
            sys.exit(0)  # never calls kml.initialize()
        import keras_meshlayout as kml
        kml.initialize()
        print("unreachable")
        """,
    )
    result, seconds = run_launcher(script, options=("--devices-per-process", "4", "--init-timeout", "3"))
    assert result.returncode == INIT_TIMEOUT_EXIT_STATUS, output(result)
    assert seconds < 40, output(result)
    assert "unreachable" not in result.stdout
    assert (
        "[0] keras_meshlayout: process 0 of 2 waited 3 s for all 2 processes to join at the coordinator "
        "127.0.0.1:"
    ) in result.stderr, output(result)
    assert "at least one process never called kml.initialize()" in result.stderr
    assert "--init-timeout (launcher) or KML_INIT_TIMEOUT" in result.stderr
    assert re.search(
        r"rank 0 \(pid \d+\) exited with status 75\. It gave up waiting for the other processes to join "
        r"\(--init-timeout 3 s\)\. Rank 1 exited with status 0 without joining",
        result.stderr,
    ), output(result)


def test_process_that_hangs_before_joining_is_named(tmp_path):
    script = write_script(
        tmp_path,
        "hangs_early.py",
        """
        import os, time
        if os.environ["KML_PROCESS_ID"] == "1":
            time.sleep(100)  # hangs before kml.initialize()
        import keras_meshlayout as kml
        kml.initialize()
        """,
    )
    result, seconds = run_launcher(
        script, options=("--devices-per-process", "4", "--init-timeout", "3", "--grace", "2")
    )
    assert result.returncode == INIT_TIMEOUT_EXIT_STATUS, output(result)
    assert seconds < 40, output(result)
    assert re.search(
        r"rank 0 \(pid \d+\) exited with status 75; stopped rank 1 by SIGTERM\. It gave up waiting for the "
        r"other processes to join \(--init-timeout 3 s\)\. Rank 1 had not joined and was still running: "
        r"it hung before or in kml\.initialize\(\)\.",
        result.stderr,
    ), output(result)
    assert not processes_running(str(script))


def test_unreachable_coordinator_times_out_with_a_clear_message(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    code = "import keras_meshlayout as kml\nkml.initialize()\nprint('unreachable')\n"
    env = clean_env(
        KML_COORDINATOR=f"127.0.0.1:{port}", KML_NUM_PROCESSES="2", KML_PROCESS_ID="1", KML_INIT_TIMEOUT="2"
    )
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert result.returncode == INIT_TIMEOUT_EXIT_STATUS, output(result)
    assert time.monotonic() - start < 30
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith(
        f"keras_meshlayout: process 1 of 2 could not reach the coordinator at 127.0.0.1:{port} "
        "within 2 s: nothing accepted a connection there. Process 0 runs the coordinator"
    ), output(result)


def free_slurm_job_id() -> int:
    """A job id whose coordinator port (JAX: 61440 + id % 4096) is free on loopback now."""
    for job_id in np.random.default_rng().permutation(4096):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", 61440 + int(job_id)))
            except OSError:
                continue
            return int(job_id)
    pytest.skip("no free port in JAX's SLURM coordinator range")


def test_script_runs_unchanged_under_slurm(tmp_path):
    """Two tasks with the variables `srun` sets: kml.initialize lets JAX find them."""
    script = write_script(
        tmp_path,
        "slurm_task.py",
        """
        import keras_meshlayout as kml
        process_id, num_processes = kml.initialize(init_timeout=60)
        mesh = kml.Mesh(data=2, model=4)
        print(process_id, num_processes, mesh.process_ids.tolist(), flush=True)
        """,
    )
    job_id = free_slurm_job_id()
    tasks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=clean_env(
                SLURM_JOB_ID=str(job_id),
                SLURM_STEP_NODELIST="localhost",
                SLURM_NTASKS="2",
                SLURM_PROCID=str(rank),
                SLURM_LOCALID=str(rank),
                KML_DEVICES_PER_PROCESS="4",
                JAX_PLATFORMS="cpu",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [task.communicate(timeout=LAUNCH_TIMEOUT_S) for task in tasks]
    finally:
        for task in tasks:
            task.kill()
            task.wait()
    for rank, (task, (stdout, stderr)) in enumerate(zip(tasks, outputs, strict=True)):
        assert task.returncode == 0, f"task {rank}: {task.returncode}\n{stdout}\n{stderr}"
        assert f"{rank} 2 [[0, 0, 0, 0], [1, 1, 1, 1]]" in stdout, stdout


def test_raising_process_exits_at_once_without_the_launcher(tmp_path):
    """On a cluster (here: the variables set by hand), a process that raises after kml.initialize
    exits with status 1 at once instead of waiting in JAX's exit barrier for the others."""
    script = write_script(
        tmp_path,
        "task.py",
        """
        import time
        import keras_meshlayout as kml
        process_id, _ = kml.initialize(init_timeout=60)
        if process_id == 1:
            raise RuntimeError("rank 1 fails after joining")
        time.sleep(90)  # rank 0 carries on; JAX's exit barrier would hold rank 1 until it ends
        """,
    )
    port = _free_port()
    tasks = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env=clean_env(
                KML_COORDINATOR=f"127.0.0.1:{port}",
                KML_NUM_PROCESSES="2",
                KML_PROCESS_ID=str(rank),
                KML_DEVICES_PER_PROCESS="2",
                JAX_PLATFORMS="cpu",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        stdout, stderr = tasks[1].communicate(timeout=LAUNCH_TIMEOUT_S)
        raised_at = time.monotonic()
        assert tasks[0].poll() is None, "rank 0 is still running when rank 1 has exited"
    finally:
        for task in tasks:
            task.kill()
            task.communicate()  # also closes its pipes
    assert tasks[1].returncode == 1, f"{tasks[1].returncode}\n{stdout}\n{stderr}"
    assert "RuntimeError: rank 1 fails after joining" in stderr, stderr
    assert time.monotonic() - raised_at < 5


# -- settings: arguments, our variables, Keras's, clusters ---------------------------------

KML = {"KML_COORDINATOR": "10.0.0.1:1234", "KML_NUM_PROCESSES": "2", "KML_PROCESS_ID": "1"}
SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_NODELIST": "node[1-2]",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
}


@pytest.mark.parametrize(
    "environ, arguments, expected",
    [
        ({}, {}, (None, None, None, "none", False)),
        (KML, {}, ("10.0.0.1:1234", 2, 1, "kml", True)),
        (
            {
                "KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.9:99,10.0.0.8:99",
                "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
                "KERAS_DISTRIBUTION_PROCESS_ID": "0",
            },
            {},
            ("10.0.0.9:99", 2, 0, "keras", True),
        ),
        (KML, {"coordinator": "h:5", "num_processes": 4, "process_id": 3}, ("h:5", 4, 3, "arguments", True)),
        ({"KML_NUM_PROCESSES": "1"}, {}, (None, 1, 0, "kml", False)),
        (SLURM, {}, (None, None, None, "slurm", True)),
        ({**SLURM, "SLURM_NTASKS": "1"}, {}, (None, None, None, "none", False)),
        (
            {"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1", "OMPI_COMM_WORLD_SIZE": "4"},
            {},
            (None,) * 3 + ("openmpi", True),
        ),
        (
            {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "0"},
            {},
            (None,) * 3 + ("kubernetes", True),
        ),
        ({"TPU_WORKER_HOSTNAMES": "t0,t1"}, {}, (None,) * 3 + ("tpu", True)),
        ({"TPU_WORKER_HOSTNAMES": "t0"}, {}, (None,) * 3 + ("none", False)),
        (SLURM, {"auto_detect": False}, (None,) * 3 + ("none", False)),
        ({}, {"auto_detect": True}, (None,) * 3 + ("auto", True)),
    ],
    ids=[
        "nothing",
        "kml-variables",
        "keras-variables-first-address",
        "arguments-win",
        "one-process",
        "slurm",
        "slurm-one-task",
        "openmpi",
        "kubernetes",
        "tpu-hosts",
        "tpu-one-host",
        "detection-off",
        "detection-forced",
    ],
)
def test_cluster_config(environ, arguments, expected):
    config = cluster_config(environ, **arguments)
    got = (config.coordinator, config.num_processes, config.process_id, config.source, config.multi_process)
    assert got == expected


def test_cluster_config_timeout_and_devices():
    config = cluster_config({**KML, "KML_INIT_TIMEOUT": "12.5", "KML_DEVICES_PER_PROCESS": "4"})
    assert (config.init_timeout, config.devices_per_process) == (12.5, 4)
    assert cluster_config({}).init_timeout == 300
    assert cluster_config(KML, init_timeout=3).init_timeout == 3


#: (environment, arguments, start of the message): every malformed or incomplete setting.
CLUSTER_CONFIG_ERRORS = pytest.mark.parametrize(
    "environ, arguments, message",
    [
        (
            {"KML_COORDINATOR": "10.0.0.1:1234", "KML_NUM_PROCESSES": "2"},
            {},
            "A multi-process run needs the coordinator address, the number of processes and this "
            "process's id, but KML_PROCESS_ID is not set.",
        ),
        (
            {},
            {"num_processes": 2},
            "A multi-process run needs the coordinator address, the number of processes and this "
            "process's id, but coordinator, process_id are not set.",
        ),
        (
            {**KML, "KML_PROCESS_ID": "2"},
            {},
            "The process id must be in 0..1 for 2 processes. Received: process_id=2.",
        ),
        ({**KML, "KML_NUM_PROCESSES": "two"}, {}, "KML_NUM_PROCESSES must be an integer. Received: 'two'."),
        ({**KML, "KML_COORDINATOR": "10.0.0.1"}, {}, "The coordinator address must be host:port"),
        ({**KML, "KML_INIT_TIMEOUT": "0"}, {}, "The initialization timeout must be a positive number"),
        ({**KML, "KML_DEVICES_PER_PROCESS": "0"}, {}, "devices_per_process must be a positive integer."),
    ],
    ids=[
        "missing-id",
        "missing-two",
        "id-out-of-range",
        "not-an-integer",
        "no-port",
        "zero-timeout",
        "zero-devices",
    ],
)


@CLUSTER_CONFIG_ERRORS
def test_cluster_config_errors(environ, arguments, message):
    with pytest.raises(kml.InvalidOptionError) as caught:
        cluster_config(environ, **arguments)
    assert str(caught.value).startswith(message), str(caught.value)


@CLUSTER_CONFIG_ERRORS
def test_initialize_gives_the_cluster_config_errors(monkeypatch, environ, arguments, message):
    """kml.initialize reads os.environ as cluster_config does, and fails the same way before starting."""
    for name in list(os.environ):
        if name.startswith(("KML_", "KERAS_DISTRIBUTION_")):
            monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(kml.InvalidOptionError) as expected:
        cluster_config(**arguments)
    with pytest.raises(kml.InvalidOptionError) as caught:
        kml.initialize(**arguments)
    assert str(caught.value) == str(expected.value)
    assert str(caught.value).startswith(message), str(caught.value)
    assert not jax.distributed.is_initialized()


def test_initialize_alone_is_a_no_op(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("KML_", "KERAS_DISTRIBUTION_", "SLURM_", "OMPI_", "TPU_")):
            monkeypatch.delenv(name)
    assert kml.initialize() == (0, 1)
    assert kml.initialize(emulate_devices=8) == kml.ProcessInfo(process_id=0, num_processes=1)
    assert not jax.distributed.is_initialized()


def test_initialize_after_jax_started_is_a_clear_error():
    jax.devices()  # this session's backends have started
    with pytest.raises(kml.DevicesAlreadyInitializedError) as caught:
        kml.initialize(coordinator="127.0.0.1:1", num_processes=2, process_id=1)
    message = str(caught.value)
    assert message.startswith(
        "kml.initialize() was called after JAX had started its backends, so this process can no longer "
        "join the 2-process run (settings from arguments)."
    )
    assert message.endswith(
        "Fix: call kml.initialize() at the very top of the script, right after the imports."
    )


def test_initialize_needs_devices_to_split_evenly(monkeypatch):
    monkeypatch.setenv("KML_NUM_PROCESSES", "3")
    monkeypatch.setenv("KML_PROCESS_ID", "0")
    monkeypatch.setenv("KML_COORDINATOR", "127.0.0.1:1")
    from keras_meshlayout.runtime import _initialize

    monkeypatch.setattr(_initialize, "backends_started", lambda: False)  # reach the device check
    with pytest.raises(
        kml.InvalidOptionError, match=r"emulate_devices=8 cannot be split evenly over 3 processes"
    ):
        kml.initialize(emulate_devices=8)


def test_launcher_environment():
    env = _environment(1, 2, "127.0.0.1:5000", 4, 30, Path("/tmp/status"), cpu_only=True)
    assert {k: env[k] for k in env if k.startswith(("KML_", "KERAS_DISTRIBUTION_"))} == {
        "KML_COORDINATOR": "127.0.0.1:5000",
        "KML_NUM_PROCESSES": "2",
        "KML_PROCESS_ID": "1",
        "KML_DEVICES_PER_PROCESS": "4",
        "KML_INIT_TIMEOUT": "30",
        "KML_LAUNCH_DIR": "/tmp/status",
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": "127.0.0.1:5000",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
        "KERAS_DISTRIBUTION_PROCESS_ID": "1",
    }
    assert env["XLA_FLAGS"].split().count("--xla_force_host_platform_device_count=4") == 1
    assert "--xla_force_host_platform_device_count=8" not in env["XLA_FLAGS"]  # the session's own, replaced
    assert env["JAX_NUM_CPU_DEVICES"] == "4"
    assert env["JAX_PLATFORMS"] == "cpu"
    assert env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] == "gloo"
    assert env["JAX_ENABLE_PREEMPTION_SERVICE"] == "false"  # so that SIGTERM stops a process


#: (launcher arguments, the one line it prints): input refused before any process starts.
LAUNCHER_USAGE_ERRORS = pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "0", "x.py"], "-n must be at least 1. Received: 0."),
        (["--init-timeout", "0", "x.py"], "--init-timeout must be positive. Received: 0.0."),
        (["no_such_script.py"], "no_such_script.py: no such file."),
        (["--port", "70000", "x.py"], "--port must be in 0..65535 (0: a free one). Received: 70000."),
        (["--port", "-1", "x.py"], "--port must be in 0..65535 (0: a free one). Received: -1."),
    ],
    ids=["no-processes", "zero-timeout", "missing-script", "port-too-large", "port-negative"],
)


@LAUNCHER_USAGE_ERRORS
def test_launcher_usage_errors(argv, message, capsys):
    assert launch_module.main(argv) == 2
    assert capsys.readouterr().err == f"keras_meshlayout.launch: error: {message}\n"


@LAUNCHER_USAGE_ERRORS
def test_launch_subcommand_gives_the_launcher_usage_errors(argv, message, capsys):
    """`keras-meshlayout launch ...` hands its arguments to the launcher untouched: same line, same status."""
    from keras_meshlayout.cli._main import main

    assert main(["launch", *argv]) == 2
    assert capsys.readouterr().err == f"keras_meshlayout.launch: error: {message}\n"


# -- hybrid meshes, with fake devices of several processes ------------------------------


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What JAX's mesh utilities read from a CPU device, in a given process."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"


def fake_devices(processes: int, per_process: int) -> list[FakeDevice]:
    return [FakeDevice(p * 1000 + i, p) for p in range(processes) for i in range(per_process)]


@pytest.mark.parametrize(
    "axes, processes, per_process, options, process_ids",
    [
        ({"data": 2, "model": 4}, 2, 4, {}, [[0, 0, 0, 0], [1, 1, 1, 1]]),
        ({"data": 4, "model": 2}, 2, 4, {}, [[0, 0], [0, 0], [1, 1], [1, 1]]),
        ({"model": 4, "data": 2}, 2, 4, {}, [[0, 1]] * 4),
        ({"data": 8}, 2, 4, {}, [0, 0, 0, 0, 1, 1, 1, 1]),
        ({"batch": 4, "model": 2}, 4, 2, {}, [[0, 0], [1, 1], [2, 2], [3, 3]]),
        ({"data": 2, "model": 4}, 2, 4, {"across_processes": "model"}, [[0, 0, 1, 1], [0, 0, 1, 1]]),
        (
            {"data": 2, "expert": 2, "model": 2},
            4,
            2,
            {"across_processes": ("data", "expert")},
            [[[0, 0], [1, 1]], [[2, 2], [3, 3]]],
        ),
    ],
    ids=["2x4", "4x2", "model-first", "1-d", "batch-axis-default", "across-model", "two-axes-across"],
)
def test_hybrid_mesh_process_grid(axes, processes, per_process, options, process_ids):
    mesh = kml.Mesh(axes, devices=fake_devices(processes, per_process), **options)
    assert mesh.process_ids.tolist() == process_ids
    assert mesh.process_count == processes


def test_hybrid_mesh_process_layout_lines():
    mesh = kml.Mesh(data=4, model=2, devices=fake_devices(2, 4))
    assert kml.process_layout(mesh) == [
        "2 processes × 4 devices; across processes: data; within each process: model",
        "process 0: data=0..1, model=0..1 (devices 0-3)",
        "process 1: data=2..3, model=0..1 (devices 1000-1003)",
    ]
    assert mesh.axes_across_processes == ("data",)


def test_hybrid_mesh_refuses_model_axis_across_processes():
    with pytest.raises(kml.InvalidMeshError) as caught:
        kml.Mesh(data=2, model=4, devices=fake_devices(4, 2))
    assert str(caught.value) == (
        "Mesh(data=2, model=4) on 4 processes × 2 devices: the axes across processes ('data',) can "
        "hold only 2 of the 4 processes, so axis 'model' would also span processes and every "
        "collective of it (the all-reduces and all-gathers of tensor-parallel layers, every step) "
        "would cross the slow links between hosts. Fix: make the sizes of the across_processes axes "
        "multiply to a multiple of 4 (e.g. a larger data axis and a smaller model axis), name more "
        "axes in across_processes=, or pass allow_split_across_processes=True to accept it."
    )


def test_hybrid_mesh_split_allowed_with_a_warning():
    with pytest.warns(kml.ProcessSplitWarning, match=r"axis 'model' spans processes \(model: 2 processes\)"):
        mesh = kml.Mesh(data=2, model=4, devices=fake_devices(4, 2), allow_split_across_processes=True)
    assert mesh.process_ids.tolist() == [[0, 0, 1, 1], [2, 2, 3, 3]]
    assert mesh.axes_across_processes == ("data", "model")


@pytest.mark.parametrize(
    "axes, devices, options, message",
    [
        (
            {"data": 2, "model": 4},
            fake_devices(2, 4),
            {"across_processes": "expert"},
            "across_processes names axis 'expert', which the mesh does not have. The mesh has axes "
            "('data', 'model').",
        ),
        (
            {"data": 2, "model": 4},
            fake_devices(1, 3) + [FakeDevice(1000 + i, 1) for i in range(5)],
            {},
            "Mesh(data=2, model=4) spans 2 processes holding different numbers of devices ({0: 3, 1: 5} "
            "by process)",
        ),
        (
            {"data": 2, "model": 4},
            fake_devices(2, 4),
            {"across_processes": ("data", "data")},
            "across_processes names an axis twice. Received: ('data', 'data').",
        ),
    ],
    ids=["unknown-axis", "uneven-processes", "axis-twice"],
)
def test_hybrid_mesh_errors(axes, devices, options, message):
    with pytest.raises(kml.InvalidMeshError) as caught:
        kml.Mesh(axes, devices=devices, **options)
    assert str(caught.value).startswith(message), str(caught.value)


def test_single_process_mesh_is_unchanged():
    mesh = kml.Mesh(data=2, model=4, across_processes="model")
    np.testing.assert_array_equal(mesh.device_ids, [[0, 1, 2, 3], [4, 5, 6, 7]])
    assert mesh.process_ids.tolist() == [[0] * 4] * 2
    assert mesh.axes_across_processes == ()
    assert kml.process_layout(mesh) == ["1 process with 8 devices"]


# -- each process's part of the data -----------------------------------------------------


@pytest.fixture
def two_process_dist():
    """A distribution over a 2x4 mesh of fake devices in 2 processes (this one is process 0)."""
    return kml.ModelParallel(kml.Mesh(data=2, model=4, devices=fake_devices(2, 4)), batch_axis="data")


def as_process(monkeypatch, index: int) -> None:
    monkeypatch.setattr(jax, "process_index", lambda: index)


@pytest.mark.parametrize(
    "process, rows", [(0, [0, 1, 2, 3, 8, 9, 10, 11]), (1, [4, 5, 6, 7, 12, 13, 14, 15])]
)
def test_process_slice_takes_each_global_batch_part(monkeypatch, two_process_dist, process, rows):
    as_process(monkeypatch, process)
    x = np.arange(16 * 3).reshape(16, 3)
    y = np.arange(16)
    local_x, local_y = kml.process_slice((x, y), batch_size=8, distribution=two_process_dist)
    np.testing.assert_array_equal(local_y, rows)
    np.testing.assert_array_equal(local_x, x[rows])
    assert kml.local_batch_size(8, two_process_dist) == 4
    np.testing.assert_array_equal(kml.process_slice(y[:8], distribution=two_process_dist), rows[:4])


def test_process_slice_short_last_batch_and_dicts(monkeypatch, two_process_dist):
    as_process(monkeypatch, 1)
    data = {"a": np.arange(12), "b": np.arange(12) * 10}
    local = kml.process_slice(data, batch_size=8, distribution=two_process_dist)
    np.testing.assert_array_equal(local["a"], [4, 5, 6, 7, 10, 11])
    np.testing.assert_array_equal(local["b"], [40, 50, 60, 70, 100, 110])


def test_process_slice_generator_and_pydataset(monkeypatch, two_process_dist):
    as_process(monkeypatch, 1)

    class Batches(keras.utils.PyDataset):
        def __init__(self):
            super().__init__()

        def __len__(self):
            return 2

        def __getitem__(self, index):
            start = index * 4
            return np.arange(start, start + 4), np.arange(start, start + 4) * 2

    local = kml.process_slice(Batches(), distribution=two_process_dist)
    assert isinstance(local, keras.utils.PyDataset) and local.num_batches == 2
    np.testing.assert_array_equal(local[1][0], [6, 7])
    np.testing.assert_array_equal(local[1][1], [12, 14])
    generator = kml.process_slice(iter(Batches()), distribution=two_process_dist)
    assert [batch[0].tolist() for batch in generator] == [[2, 3], [6, 7]]


@pytest.mark.parametrize(
    "data, batch_size, message",
    [
        (
            np.arange(7),
            None,
            "A global batch of 7 rows cannot be split over batch axis 'data' of size 2: 7 is not a "
            "multiple of 2, so the processes cannot feed equal parts.",
        ),
        (
            np.arange(13),
            8,
            "A global batch of 5 rows cannot be split over batch axis 'data' of size 2",
        ),
    ],
    ids=["batch", "short-last-batch"],
)
def test_process_slice_indivisible_batch(two_process_dist, data, batch_size, message):
    with pytest.raises(kml.IndivisibleBatchError) as caught:
        kml.process_slice(data, batch_size=batch_size, distribution=two_process_dist)
    assert str(caught.value).startswith(message), str(caught.value)


def test_process_slice_rejects_what_it_cannot_split(two_process_dist):
    with pytest.raises(kml.MeshLayoutError, match=r"process_slice cannot split data of type str"):
        kml.process_slice("not data", distribution=two_process_dist)
    with pytest.raises(kml.MeshLayoutError, match=r"different numbers of rows: \[8, 6\]"):
        kml.process_slice((np.zeros(8), np.zeros(6)), distribution=two_process_dist)


def test_process_slice_alone_keeps_everything():
    x = np.arange(8)
    assert kml.process_slice(x) is x  # no distribution, one process
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4))
    np.testing.assert_array_equal(kml.process_slice(x, batch_size=4, distribution=dist), x)
    assert kml.local_batch_size(64, dist) == 64
