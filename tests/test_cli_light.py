"""The command line is light where it can be (issue 23): `--help`, `devices --help` and argument
errors answer without importing Keras or JAX (273 MB and seconds before), in a fresh process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import fresh_env

import keras_meshlayout as kml

PROBE = """
import json, sys
from keras_meshlayout.cli._main import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status, "keras": "keras" in sys.modules, "jax": "jax" in sys.modules}))
"""


def probe(*args: str) -> tuple[dict, str]:
    """Runs the command line in a fresh interpreter: (what it loaded and returned, its output)."""
    env = fresh_env()
    env["PYTHONPATH"] = str(Path(kml.__file__).parents[1])  # the package under test
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args], env=env, capture_output=True, text=True, timeout=60
    )
    *output, last = result.stdout.strip().splitlines()
    return json.loads(last), "\n".join(output) + result.stderr


@pytest.mark.parametrize(
    "args, status, fragment",
    [
        (["--help"], 0, "plan       plan a model on a mesh without allocating its weights"),
        (["devices", "--help"], 0, "--emulate-devices N"),
        (["devices", "--bogus"], 2, "error: keras-meshlayout: unrecognized arguments: --bogus"),
        (["bogus"], 2, "invalid choice: 'bogus' (choose from 'devices', 'launch', 'plan', 'demo')"),
        ([], 2, "the following arguments are required: COMMAND"),
        (["plan", "--help"], 0, "exit status: 0 valid, 1 the plan fails a check, 2 invalid input."),
        (["plan", "--mesh", "2x4"], 2, "the following arguments are required: --model"),
        (["plan", "--mesh", "2x4", "--model", "m.keras", "--bogus"], 2, "unrecognized arguments: --bogus"),
        (
            ["plan", "--mesh", "2x4", "--model", "m.keras", "--preset", "conv", "--auto"],
            2,
            "not allowed with",
        ),
    ],
    ids=[
        "help",
        "devices-help",
        "devices-bad-argument",
        "unknown-command",
        "no-command",
        "plan-help",
        "plan-without-model",
        "plan-bad-argument",
        "plan-preset-and-auto",
    ],
)
def test_help_and_argument_errors_import_neither_keras_nor_jax(args, status, fragment):
    loaded, output = probe(*args)
    assert loaded == {"status": status, "keras": False, "jax": False}, output
    assert fragment in output


def test_the_package_itself_imports_neither_until_a_name_is_used():
    code = (
        "import json, sys; import keras_meshlayout as kml; "
        "before = 'keras' in sys.modules or 'jax' in sys.modules; "
        "kml.MeshLayoutError; errors = 'keras' in sys.modules; kml.Mesh; "
        "print(json.dumps([before, errors, 'keras' in sys.modules and 'jax' in sys.modules]))"
    )
    env = fresh_env()
    env["PYTHONPATH"] = str(Path(kml.__file__).parents[1])
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [False, False, True], result.stderr


def test_plan_help_lists_exactly_the_registered_presets():
    """`plan --help` reads a light table, not the registry (which imports Keras): they must agree."""
    from keras_meshlayout.cli._preset_table import PRESET_TABLE
    from keras_meshlayout.planner._presets import PRESETS

    assert PRESET_TABLE == tuple((preset.usage, preset.summary) for preset in PRESETS.values()), (
        "cli/_preset_table.py must list every preset of planner/_presets.py, in order, with its summary"
    )
    loaded, output = probe("plan", "--help")
    assert loaded == {"status": 0, "keras": False, "jax": False}, output
    flat = " ".join(output.split())  # argparse wraps the help
    for usage, summary in PRESET_TABLE:
        assert f"{usage} ({summary})" in flat
