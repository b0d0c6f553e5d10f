"""Progress on a terminal only (issue 23): a spinner and a bytes bar for plans, checkpoints, the launcher.

Drawn where a person watches (a terminal, or forced with `KML_PROGRESS=1`), never in a pipe,
a CI log or `--json`. The checkpoint and launcher cases are real saves, loads and joins; under
pytest stderr is captured, which is no terminal, so the default is silence.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
from helpers import fresh_env, mlp
from rich.console import Console

import keras_meshlayout as kml
from keras_meshlayout.core._progress import ENV, bytes_bar, shown, spinner, watch_bytes
from keras_meshlayout.runtime._supervise import joining

LAUNCH_TIMEOUT_S = 120


def terminal() -> Console:
    return Console(file=io.StringIO(), force_terminal=True, width=100)


def pipe() -> Console:
    return Console(file=io.StringIO(), force_terminal=False, width=100)


@pytest.fixture
def no_override(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("CI", raising=False)


def test_spinner_and_bar_draw_on_a_terminal(no_override):
    console = terminal()
    with spinner("plan", console=console) as step:
        step("resolving every variable")
    with bytes_bar("reading model.orbax", 3 << 20, console=console) as advance:
        advance(1 << 20)
        advance(2 << 20)
    written = iter([1 << 20, 2 << 20])
    with watch_bytes("writing model.orbax", 2 << 20, lambda: next(written, 2 << 20), console=console):
        pass
    text = console.file.getvalue()
    assert "plan" in text and "resolving every variable" in text
    assert "reading model.orbax" in text and "3.0/3.0 MiB" in text
    assert "writing model.orbax" in text and "2.0/2.0 MiB" in text


@pytest.mark.parametrize(
    ("wanted", "make", "env"),
    [
        (True, pipe, {}),  # a pipe, a file
        (False, terminal, {}),  # --json
        (True, terminal, {"CI": "true"}),  # a CI job's log, though it claims a terminal
        (True, terminal, {ENV: "0"}),  # turned off
    ],
    ids=["pipe", "json", "ci", "turned-off"],
)
def test_progress_is_silent_where_no_one_watches(wanted, make, env, no_override, monkeypatch):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    console = make()
    measured = []
    with spinner("plan", wanted=wanted, console=console) as step:
        step("resolving every variable")
    with bytes_bar("reading model.orbax", 10, wanted=wanted, console=console) as advance:
        advance(10)
    with watch_bytes("writing", 10, lambda: measured.append(1) or 10, wanted=wanted, console=console):
        pass
    assert console.file.getvalue() == ""
    assert measured == []  # nothing looked at either


def test_progress_is_off_under_pytest_and_forced_on_by_the_environment(no_override, monkeypatch):
    assert not shown()  # stderr is captured: no terminal
    monkeypatch.setenv(ENV, "1")
    assert shown()


def compiled_mlp() -> keras.Model:
    model = mlp(16, ("fc1", 64, "relu"), ("head", 8))
    model.compile(optimizer="adam", loss="mse")
    return model


@pytest.mark.parametrize("storage", ["orbax", "h5"], ids=["orbax", "h5"])
@pytest.mark.parametrize("forced", [False, True], ids=["default", "forced"])
def test_checkpoint_save_and_load_show_their_bytes(
    storage, forced, tmp_path, no_override, monkeypatch, capsys
):
    if forced:
        monkeypatch.setenv(ENV, "1")
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r"fc1/kernel", (None, "model"))], replicate_below=0)
    keras.distribution.set_distribution(dist)
    model = compiled_mlp()
    model.optimizer.build(model.trainable_variables)
    expected = [np.asarray(v.value) for v in model.weights]
    kml.save_checkpoint(model, tmp_path / "ckpt", storage=storage)
    saved = capsys.readouterr().err
    for variable in model.weights:
        variable.assign(np.zeros(variable.shape, variable.dtype))
    kml.load_checkpoint(model, tmp_path / "ckpt")
    loaded = capsys.readouterr().err
    for value, variable in zip(expected, model.weights, strict=True):
        np.testing.assert_array_equal(np.asarray(variable.value), value)
    if not forced:
        assert saved == "" and loaded == ""
    elif storage == "orbax":
        kib = sum(v.nbytes for v in expected) / 1024
        assert "writing model.orbax" in saved and "writing optimizer.orbax" in saved
        assert "reading model.orbax" in loaded and "reading optimizer.orbax" in loaded
        assert f"{kib:.1f}/{kib:.1f} KiB" in loaded, loaded  # every byte of the model counted
    else:
        assert "writing model.weights.h5" in saved
        assert "reading model.weights.h5" in loaded


def test_launcher_counts_the_processes_that_joined(tmp_path, no_override, monkeypatch, capsys):
    monkeypatch.setenv(ENV, "1")
    with joining(tmp_path, 2) as progress:
        (tmp_path / "joined.0").write_text("1")
        progress.tick()
        (tmp_path / "joined.1").write_text("2")
        progress.tick()
        drawn = capsys.readouterr().err
        progress.tick()  # after all joined: nothing more drawn
        progress.stop()
        assert capsys.readouterr().err == ""
    err = drawn + capsys.readouterr().err
    for count in ("1 of 2", "2 of 2"):
        assert f"waiting for the processes to join the run: {count}" in err
    assert err.endswith("\x1b[2K")  # erased once all joined


def test_launcher_spinner_is_gone_before_a_process_line_is_relayed(
    tmp_path, no_override, monkeypatch, capsys
):
    """A process's first line must not land on the spinner's line: the spinner is erased first."""
    monkeypatch.setenv(ENV, "1")
    with joining(tmp_path, 2) as progress:
        progress.stop()  # what the relay calls before writing a line
        drawn = capsys.readouterr().err
        (tmp_path / "joined.0").write_text("1")
        progress.tick()
        assert capsys.readouterr().err == ""  # nothing drawn once stopped
    assert "0 of 2" in drawn and drawn.endswith("\x1b[2K")  # its last act: the line erased
    monkeypatch.delenv(ENV)
    with joining(tmp_path, 2) as progress:
        progress.tick()  # not a terminal: nothing drawn
    assert capsys.readouterr().err == ""


JOINS = """
import keras_meshlayout as kml
kml.initialize()
print("joined")
"""


@pytest.mark.parametrize("forced", [False, True], ids=["pipe", "forced"])
def test_launcher_shows_the_join_only_where_someone_watches(forced, tmp_path):
    """A real 2-process launch: the join spinner on a (forced) terminal, nothing in a pipe."""
    script = tmp_path / "joins.py"
    script.write_text(textwrap.dedent(JOINS))
    env = {
        k: v for k, v in fresh_env("JAX_NUM_CPU_DEVICES").items() if not k.startswith("KML_") and k != "CI"
    }
    if forced:
        env[ENV] = "1"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "keras_meshlayout.launch",
            "-n",
            "2",
            "--devices-per-process",
            "1",
            str(script),
        ],
        cwd=tmp_path,
        env={**env, "PYTHONIOENCODING": "utf-8"},
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("joined") == 2
    assert ("waiting for the processes to join the run" in result.stderr) == forced, result.stderr


def test_bytes_written_count_orbaxs_temporary_directory(tmp_path):
    """Orbax writes into `model.orbax.orbax-checkpoint-tmp-N` and renames it last: the bar counts both."""
    from keras_meshlayout.checkpoint._orbax_store import _on_disk

    target = tmp_path / "model.orbax"
    (tmp_path / "model.orbax.orbax-checkpoint-tmp-1" / "d").mkdir(parents=True)
    (tmp_path / "model.orbax.orbax-checkpoint-tmp-1" / "d" / "chunk").write_bytes(b"x" * 1000)
    (tmp_path / "optimizer.orbax").mkdir()
    (tmp_path / "optimizer.orbax" / "chunk").write_bytes(b"x" * 10)  # another kind's: not counted
    assert _on_disk(target) == 1000
    target.mkdir()
    (target / "chunk").write_bytes(b"x" * 24)
    assert _on_disk(target) == 1024
