"""The recipes and the demo run end to end, as a user runs them, in fresh processes.

Each run is a new Python process started from a temporary directory with an
environment that has no XLA_FLAGS or KERAS_BACKEND, so the script itself must
choose the JAX backend and emulate its devices, exactly as on a user's machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_env

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.py"))
# The first line of the plan table and its totals line (see keras_meshlayout/core/_plan.py).
PLAN_MARKERS = (
    "Layout plan on mesh data=2",
    "model=4 (8 devices), batch over 'data'",
    "Variables per device:",
)
TIMEOUT_S = 300


def run_fresh(args: list[str], cwd: Path, **extra: str) -> subprocess.CompletedProcess:
    """Runs `args` in `cwd` with this environment minus JAX and Keras settings, plus `extra`."""
    env = fresh_env()
    env.update(PYTHONIOENCODING="utf-8", **extra)
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, encoding="utf-8", timeout=TIMEOUT_S
    )


def assert_ran_with_plan(result: subprocess.CompletedProcess) -> None:
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, f"exit status {result.returncode}\n{output}"
    for marker in PLAN_MARKERS:
        assert marker in result.stdout, f"{marker!r} not in the output\n{output}"


def test_there_are_recipes():
    assert RECIPES, "recipes/ holds no *.py script"


@pytest.mark.parametrize("recipe", RECIPES, ids=[path.name for path in RECIPES])
def test_recipe_runs(recipe: Path, tmp_path: Path):
    """Each recipe, with a temporary directory of its own that it leaves as it found it.

    Regression (issue 23): recipes/checkpoint_resume.py left its checkpoint in the temporary
    directory. (A test of its own ran that recipe a second time for this.)
    """
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = [sys.executable, str(recipe), "--epochs", "2", "--steps", "4"]
    result = run_fresh(args, cwd=tmp_path, TMPDIR=str(temp))
    assert_ran_with_plan(result)
    assert sorted(p.name for p in temp.iterdir()) == [], "left in the temporary directory"


def test_multi_process_recipe_under_the_launcher_with_its_defaults(tmp_path: Path):
    """The README's command, with the recipe's default 32 steps.

    Regression (issue 13): it hung in every run, because XLA's CPU client
    deadlocks once about 32 computations are in flight per device while
    collectives cross processes (`kml.initialize` now paces Keras's loops).
    """
    recipe = next(path for path in RECIPES if path.name == "multi_process_2x4.py")
    launch = [sys.executable, "-m", "keras_meshlayout.launch", "-n", "2", "--devices-per-process", "4"]
    # Exactly the README's command. A hung run is killed at TIMEOUT_S; its processes die with the
    # launcher (PR_SET_PDEATHSIG), so none is left behind.
    result = run_fresh([*launch, str(recipe), "--epochs", "1"], cwd=tmp_path)
    assert_ran_with_plan(result)
    assert "[0] 32/32 - " in result.stdout, result.stdout  # the epoch's 32 steps, as the README shows
    assert "after" in result.stdout and "[0] loss: " in result.stdout
    assert "[Gloo]" not in result.stdout + result.stderr  # the launcher drops gloo's connection lines


def test_python_m_demo(tmp_path: Path):
    result = run_fresh([sys.executable, "-m", "keras_meshlayout", "demo", "--steps", "4"], cwd=tmp_path)
    assert_ran_with_plan(result)


def test_console_script_demo(tmp_path: Path):
    script = Path(sys.executable).parent / ("keras-meshlayout.exe" if os.name == "nt" else "keras-meshlayout")
    assert script.exists(), (
        f"The console script {script} is missing: install the package (pip install .) into the "
        f"environment of {sys.executable}."
    )
    result = run_fresh([str(script), "demo", "--steps", "4"], cwd=tmp_path)
    assert_ran_with_plan(result)
