"""The `keras-meshlayout` command line, run as a user runs it: in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

MODELS = """
import keras

def mlp():
    return keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(256, activation="relu", name="fc1"),
            keras.layers.Dense(128, name="fc2"),
            keras.layers.Dense(10, name="head"),
        ],
        name="mlp",
    )

def tokens():
    ids = keras.Input((None,), dtype="int32", name="ids")
    hidden = keras.layers.Embedding(256, 64, name="embed")(ids)
    hidden = keras.layers.Dense(256, activation="gelu", name="up")(hidden)
    hidden = keras.layers.Dense(64, name="down")(hidden)
    return keras.Model(ids, keras.layers.Dense(4, name="head")(hidden), name="tokens")
"""

RULES_PY = """
RULES = [(r".*fc1/kernel", (None, "model")), (r".*fc1/bias", ("model",)), (r".*fc2/kernel", ("model", None))]
"""

RULES_JSON = [[".*fc1/kernel", [None, "model"]], [".*fc1/bias", ["model"]], [".*fc2/kernel", ["model", None]]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    (path / "models.py").write_text(MODELS)
    (path / "rules.py").write_text(RULES_PY)
    (path / "rules.json").write_text(json.dumps(RULES_JSON))
    (path / "typo.json").write_text(json.dumps([*RULES_JSON, [".*fc3/kernel", [None, "model"]]]))
    return path


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    env["PYTHONPATH"] = str(cwd)
    return subprocess.run(
        [sys.executable, "-m", "keras_meshlayout", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_devices_lists_emulated_devices_and_meshes(workdir):
    result = cli("devices", "--json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert [d["id"] for d in data["devices"]] == list(range(8))
    assert {d["platform"] for d in data["devices"]} == {"cpu"}
    assert data["process_count"] == 1
    assert {"8", "2x4", "4x2", "1x8", "8x1"} <= set(data["meshes"])


@pytest.mark.parametrize(
    "command, fragments",
    [
        (
            "plan",
            ["--mesh", "--model", "--rules", "--preset", "--auto", "--optimizer", "--json", "exit status"],
        ),
        ("devices", ["--json", "--emulate-devices"]),
        ("demo", ["--steps", "--batch-size"]),
    ],
)
def test_help(command, fragments, workdir):
    result = cli(command, "--help", cwd=workdir)
    assert result.returncode == 0
    for fragment in fragments:
        assert fragment in result.stdout


@pytest.mark.parametrize(
    "source",
    [["--auto"], ["--preset", "mlp:fc1,fc2"], ["--rules", "rules.json"], ["--rules", "rules.py"]],
    ids=["auto", "preset", "json-rules", "python-rules"],
)
def test_plan_is_valid(source, workdir):
    result = cli("plan", "--mesh", "data=2,model=4", "--model", "models:mlp", *source, "--json", cwd=workdir)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["valid"] is True and plan["failure"] is None
    axes = {v["path"]: v["axes"] for v in plan["variables"]}
    assert axes["mlp/fc1/kernel"] == [None, "model"]
    assert axes["mlp/fc2/kernel"] == ["model", None]
    assert plan["memory_per_device"]["gradients"] == (32 * 256 + 256 + 256 * 128) + (128 + 128 * 10 + 10) * 4


def test_plan_of_a_saved_model_with_optimizer_table(workdir):
    saved = workdir / "mlp.keras"
    script = "import models; models.mlp().save('mlp.keras')"
    subprocess.run(
        [sys.executable, "-c", script], cwd=workdir, check=True, env={**os.environ, "KERAS_BACKEND": "jax"}
    )
    result = cli("plan", "--mesh", "2x4", "--model", str(saved), "--auto", "--optimizer", "adam", cwd=workdir)
    assert result.returncode == 0, result.stderr
    assert "column-parallel:" in result.stdout and "row-parallel:" in result.stdout
    assert "Training state per device" in result.stdout


@pytest.mark.parametrize(
    "args, status, fragments",
    [
        (
            ["--mesh", "3x3", "--model", "models:mlp"],
            2,
            ["error: Mesh", "needs 9 devices, but 8 are available"],
        ),
        (
            ["--mesh", "2x4", "--model", "models:nothing"],
            2,
            ["error: --model 'models:nothing'", "no function"],
        ),
        (["--mesh", "2x4", "--model", "nowhere.keras"], 2, ["error: --model nowhere.keras: no such file"]),
        (["--mesh", "2x4", "--model", "models:mlp", "--preset", "bogus"], 2, ["unknown preset"]),
        (
            ["--mesh", "2x4", "--model", "models:mlp"],
            1,
            ["plan fails", "100% of each device", "mlp/fc2/kernel"],
        ),
        (["--mesh", "2x4", "--model", "models:mlp", "--rules", "typo.json", "--strict"], 1, ["1 warning(s)"]),
        (
            ["--mesh", "2x4", "--model", "models:mlp", "--auto", "--device-memory", "10KB"],
            1,
            ["more than the"],
        ),
    ],
    ids=["bad-mesh", "bad-function", "no-file", "bad-preset", "guard", "strict-typo", "capacity"],
)
def test_plan_exit_status_and_one_clear_message(args, status, fragments, workdir):
    result = cli("plan", *args, cwd=workdir)
    assert result.returncode == status, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_plan_within_a_memory_budget_prints_the_prediction(workdir):
    common = ["--mesh", "2x4", "--model", "models:tokens", "--auto", "--optimizer", "adam", "--json"]
    sizes = ["--batch-size", "16", "--sequence-length", "32"]
    roomy = cli("plan", *common, *sizes, "--memory-budget", "1GB", cwd=workdir)
    assert roomy.returncode == 0, roomy.stderr
    roomy = json.loads(roomy.stdout)["predicted"]
    assert roomy["budget"] == 10**9 and roomy["wire_bytes_per_device"] > 0
    tight_budget = roomy["state_bytes_per_device"] + roomy["activation_bytes_per_device"] - 1
    tight = cli("plan", *common, *sizes, "--memory-budget", str(tight_budget), cwd=workdir)
    assert tight.returncode == 0, tight.stderr
    tight = json.loads(tight.stdout)
    assert tight["predicted"]["state_bytes_per_device"] < roomy["state_bytes_per_device"]
    assert tight["predicted"]["wire_bytes_per_device"] >= roomy["wire_bytes_per_device"]
    assert tight["valid"] is True


@pytest.mark.parametrize(
    "args, status, fragment",
    [
        (["--memory-budget", "1GB", "--batch-size", "16"], 2, "add --auto"),
        (["--auto", "--memory-budget", "1GB"], 2, "needs --batch-size"),
        (["--auto", "--memory-budget", "1GB", "--batch-size", "16"], 2, "--sequence-length"),
        (
            ["--auto", "--memory-budget", "1KB", "--batch-size", "16", "--sequence-length", "32"],
            1,
            "smallest plan",
        ),
    ],
    ids=["no-auto", "no-batch", "no-length", "too-small"],
)
def test_plan_memory_budget_errors(args, status, fragment, workdir):
    result = cli("plan", "--mesh", "2x4", "--model", "models:tokens", *args, cwd=workdir)
    assert result.returncode == status, (result.stdout, result.stderr)
    assert fragment in result.stderr and "Traceback" not in result.stderr
