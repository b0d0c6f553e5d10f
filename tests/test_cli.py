"""The `keras-meshlayout` command line, run as a user runs it: in a fresh process.

The command lines whose output is read as data (`LINES`: bad input, exit statuses, JSON plans,
tracebacks) run in one fresh process for the module (the `lines` fixture): each line through
`cli._main.main`, the function the entry point calls, with its own stdout, stderr and warning
filters; one interpreter start rather than one per line. `devices --json` is its first line, so
that it starts JAX as a fresh process does. What depends on the process itself (a pipe's width, a
second call fed by the first, `--help` and `demo`'s refusal) runs in its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import fresh_env

import keras_meshlayout as kml

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

def functional_mlp():
    x = keras.Input((32,), name="x")
    hidden = keras.layers.Dense(256, activation="relu", name="fc1")(x)
    hidden = keras.layers.Dense(128, name="fc2")(hidden)
    return keras.Model(x, keras.layers.Dense(10, name="head")(hidden), name="mlp")

def boom():
    raise RuntimeError("no weights file at /data/w.h5")

def not_a_model():
    return {"layers": 3}

def tokens():
    ids = keras.Input((None,), dtype="int32", name="ids")
    hidden = keras.layers.Embedding(256, 64, name="embed")(ids)
    hidden = keras.layers.Dense(256, activation="gelu", name="up")(hidden)
    hidden = keras.layers.Dense(64, name="down")(hidden)
    return keras.Model(ids, keras.layers.Dense(4, name="head")(hidden), name="tokens")

def attention():
    x = keras.Input((8, 64), name="x")
    hidden = keras.layers.MultiHeadAttention(num_heads=4, key_dim=32, name="attn")(x, x)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden + x)
    return keras.Model(x, keras.layers.Dense(4, name="head")(hidden), name="attention")

def aborts():  # a native crash in the process that plans and compiles (as XLA's aborts look to it)
    import os
    os.abort()

def convnet():
    x = keras.Input((8, 8, 3), name="image")
    hidden = keras.layers.Conv2D(32, 3, name="conv1")(x)
    hidden = keras.layers.Conv2D(64, 3, name="conv2")(hidden)
    hidden = keras.layers.GlobalAveragePooling2D(name="pool")(hidden)
    return keras.Model(x, keras.layers.Dense(4, name="head")(hidden), name="convnet")
"""

RULES_PY = """
RULES = [(r".*fc1/kernel", (None, "model")), (r".*fc1/bias", ("model",)), (r".*fc2/kernel", ("model", None))]
"""

WEIRD_RULES = """
class Rules:
    def __iter__(self):
        raise OSError("rules store unreachable")

RULES = Rules()
"""

RULES_JSON = [[".*fc1/kernel", [None, "model"]], [".*fc1/bias", ["model"]], [".*fc2/kernel", ["model", None]]]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli")
    (path / "models.py").write_text(MODELS)
    (path / "rules.py").write_text(RULES_PY)
    (path / "rules.json").write_text(json.dumps(RULES_JSON))
    (path / "typo.json").write_text(json.dumps([*RULES_JSON, [".*fc3/kernel", [None, "model"]]]))
    (path / "broken.py").write_text("raise RuntimeError('this module fails as it is imported')\n")
    (path / "rules_fn.py").write_text("def rules(model, mesh):\n    layers = {}\n    return layers['fc9']\n")
    (path / "weird_rules.py").write_text(WEIRD_RULES)
    return path


SAVE = """
import keras, models
models.mlp().save("mlp.keras")
model = models.mlp()
model.compile(optimizer="adam", loss="mse", metrics=["mae"])
model.save("compiled.keras")
models.functional_mlp().save("functional.keras")
"""


@pytest.fixture(scope="module")
def saved(workdir) -> Path:
    """A Sequential saved before and after compile, and an uncompiled functional model."""
    env = {**os.environ, "KERAS_BACKEND": "jax"}
    subprocess.run([sys.executable, "-c", SAVE], cwd=workdir, check=True, env=env, timeout=300)
    return workdir


def cli(*args: str, cwd: Path, python: bool = False) -> subprocess.CompletedProcess:
    """`keras-meshlayout ARGS` in a fresh process (`python ARGS` with `python=True`), in `cwd`."""
    env = fresh_env()
    # The package under test first (a worktree's, where the environment installs another).
    env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(Path(kml.__file__).parents[1])])
    return subprocess.run(
        [sys.executable, *([] if python else ["-m", "keras_meshlayout"]), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


#: Runs each command line of a JSON list through `main` in this one process, as the entry point
#: would (`sys.exit(main())`: argparse's exits and uncaught exceptions give their statuses), and
#: writes each one's status, stdout and stderr to the file named by the second argument.
BATCH = """
import contextlib, io, json, sys, traceback, warnings
from keras_meshlayout.cli._main import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("default")
        try:
            status = main(argv)
        except SystemExit as exit:
            status = 0 if exit.code is None else exit.code if isinstance(exit.code, int) else 1
        except Exception:
            traceback.print_exc()
            status = 1
    results.append([status, out.getvalue(), err.getvalue()])
with open(sys.argv[2], "w") as f:
    json.dump(results, f)
"""

#: Every command line the `lines` fixture runs, in this order, in one process; `line` adds one as
#: the module's tables are built.
LINES: list[tuple[str, ...]] = []


def line(*argv: str) -> tuple[str, ...]:
    """`argv`, added to the module's batch (`LINES`); tests read its result with `lines(*argv)`."""
    if argv not in LINES:
        LINES.append(argv)
    return argv


@pytest.fixture(scope="module")
def lines(saved) -> Callable[..., subprocess.CompletedProcess]:
    """Each of `LINES` run in one fresh process (`BATCH`, in `saved`'s directory); a look-up by argv."""
    out = saved / "lines.json"
    done = cli("-c", BATCH, json.dumps(LINES), str(out), cwd=saved, python=True)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {
        argv: subprocess.CompletedProcess(argv, status, stdout, stderr)
        for argv, (status, stdout, stderr) in zip(LINES, json.loads(out.read_text()), strict=True)
    }

    def result(*argv: str) -> subprocess.CompletedProcess:
        assert argv in results, f"{argv} is not in LINES: build it with line(...) at module level"
        return results[argv]

    return result


#: The batch's first line, so that it starts JAX as a fresh `keras-meshlayout devices` would.
DEVICES = line("devices", "--json")


def test_devices_lists_emulated_devices_and_meshes(lines):
    assert LINES[0] == DEVICES
    result = lines(*DEVICES)
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


#: One plan of the MLP per way of giving rules.
VALID = {
    name: line("plan", "--mesh", "data=2,model=4", "--model", "models:mlp", *source, "--json")
    for name, source in {
        "auto": ["--auto"],
        "preset": ["--preset", "mlp:fc1,fc2"],
        "json-rules": ["--rules", "rules.json"],
        "python-rules": ["--rules", "rules.py"],
    }.items()
}


@pytest.mark.parametrize("source", VALID, ids=list(VALID))
def test_plan_is_valid(source, lines):
    result = lines(*VALID[source])
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["valid"] is True and plan["failure"] is None
    axes = {v["path"]: v["axes"] for v in plan["variables"]}
    assert axes["mlp/fc1/kernel"] == [None, "model"]
    assert axes["mlp/fc2/kernel"] == ["model", None]
    assert plan["memory_per_device"]["gradients"] == (32 * 256 + 256 + 256 * 128) + (128 + 128 * 10 + 10) * 4


SAVED_TABLE = line("plan", "--mesh", "2x4", "--model", "mlp.keras", "--auto", "--optimizer", "adam")


def test_plan_of_a_saved_model_with_optimizer_table(lines):
    result = lines(*SAVED_TABLE)
    assert result.returncode == 0, result.stderr
    assert "column-parallel:" in result.stdout and "row-parallel:" in result.stdout
    assert "Training state per device" in result.stdout


#: `plan` lines with their exit status and what stderr must say (one fresh process for all).
EXIT_CASES = [
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
    # A first axis inferred: `-1x4` is the mesh, not an unknown option (argparse read it as one).
    (["--mesh", "-1x4", "--model", "models:mlp", "--auto"], 0, []),
    (["--mesh", "2x4", "--model", "models:mlp", "--rules", "."], 2, ["error: --rules .: a directory, not a"]),
]
for case in EXIT_CASES:
    line("plan", *case[0])
EXIT_IDS = [
    "bad-mesh", "bad-function", "no-file", "bad-preset", "guard", "strict-typo", "capacity", "inferred-axis",
    "rules-directory",
]  # fmt: skip


@pytest.mark.parametrize("args, status, fragments", EXIT_CASES, ids=EXIT_IDS)
def test_plan_exit_status_and_one_clear_message(args, status, fragments, lines):
    result = lines("plan", *args)
    assert result.returncode == status, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


BUDGETED = ("plan", "--mesh", "2x4", "--model", "models:tokens", "--auto", "--optimizer", "adam", "--json",
            "--batch-size", "16", "--sequence-length", "32")  # fmt: skip
ROOMY = line(*BUDGETED, "--memory-budget", "1GB")


def test_plan_within_a_memory_budget_prints_the_prediction(lines, workdir):
    """A roomy budget, then one a byte under its prediction (a second process, fed by the first)."""
    roomy = lines(*ROOMY)
    assert roomy.returncode == 0, roomy.stderr
    roomy = json.loads(roomy.stdout)["predicted"]
    assert roomy["budget"] == 10**9 and roomy["wire_bytes_per_device"] > 0
    tight_budget = roomy["state_bytes_per_device"] + roomy["activation_bytes_per_device"] - 1
    tight = cli(*BUDGETED, "--memory-budget", str(tight_budget), cwd=workdir)
    assert tight.returncode == 0, tight.stderr
    tight = json.loads(tight.stdout)
    assert tight["predicted"]["state_bytes_per_device"] < roomy["state_bytes_per_device"]
    assert tight["predicted"]["wire_bytes_per_device"] >= roomy["wire_bytes_per_device"]
    assert tight["valid"] is True


#: memory-budget `plan` lines, their exit status and a fragment of stderr (one process for all).
BUDGET_CASES = [
    (["--memory-budget", "1GB", "--batch-size", "16"], 2, "add --auto"),
    (["--auto", "--memory-budget", "1GB"], 2, "needs --batch-size"),
    (["--auto", "--memory-budget", "1GB", "--batch-size", "16"], 2, "--sequence-length"),
    (
        ["--auto", "--memory-budget", "1KB", "--batch-size", "16", "--sequence-length", "32"],
        1,
        "smallest plan",
    ),
]
for case in BUDGET_CASES:
    line("plan", "--mesh", "2x4", "--model", "models:tokens", *case[0])
BUDGET_IDS = ["no-auto", "no-batch", "no-length", "too-small"]


@pytest.mark.parametrize("args, status, fragment", BUDGET_CASES, ids=BUDGET_IDS)
def test_plan_memory_budget_errors(args, status, fragment, lines):
    result = lines("plan", "--mesh", "2x4", "--model", "models:tokens", *args)
    assert result.returncode == status, (result.stdout, result.stderr)
    assert fragment in result.stderr and "Traceback" not in result.stderr


# -- issue 13: every bad input is one line on stderr, exit 2; no traceback ---------------------


MLP_AUTO = ["--model", "models:mlp", "--auto"]
#: Command lines that crashed before they were fixed.
USED_TO_CRASH = {
    name: line("plan", "--mesh", "2x4", *args, "--json")
    for name, args in {
        "saved-after-compile": ["--model", "compiled.keras", "--auto", "--optimizer", "adam"],
        "saved-functional-auto": ["--model", "functional.keras", "--auto"],
        "saved-after-compile-rules": ["--model", "compiled.keras", "--rules", "rules.json"],
        "sequential-batch-size": [*MLP_AUTO, "--batch-size", "16"],
        "sequential-budget": [*MLP_AUTO, "--memory-budget", "1GB", "--batch-size", "16"],
    }.items()
}


@pytest.mark.parametrize("name", USED_TO_CRASH, ids=list(USED_TO_CRASH))
def test_plan_models_that_used_to_crash(name, lines):
    args = USED_TO_CRASH[name]
    result = lines(*args)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    plan = json.loads(result.stdout)
    axes = {v["path"].removeprefix("mlp/"): v["axes"] for v in plan["variables"]}
    assert axes["fc1/kernel"] == [None, "model"] and axes["fc2/kernel"] == ["model", None]
    if "--memory-budget" in args:
        assert plan["predicted"]["budget"] == 10**9


#: bad `plan` input and the one line it must give (one process for all).
BAD_INPUT_CASES = [
    (
        ["--model", "models:mlp", "--optimizer", "adamm"],
        "error: --optimizer 'adamm': Keras knows no optimizer named 'adamm'. Did you mean 'adam'? "
        "Fix: pass one of adadelta,",
    ),
    (
        ["--model", "models:boom"],
        "error: --model 'models:boom': building the model from boom() raised RuntimeError: "
        "no weights file at /data/w.h5",
    ),
    (
        ["--model", "models:boom", "--auto"],
        "error: --model 'models:boom': building the model from boom() raised RuntimeError: "
        "no weights file at /data/w.h5",
    ),
    (
        ["--model", "models:not_a_model"],
        "error: --model 'models:not_a_model': not_a_model() returned dict ({'layers': 3}), "
        "not a keras.Model.",
    ),
    (
        ["--model", "broken.py:build"],
        "error: --model broken.py: cannot import it (RuntimeError: this module fails as it is imported).",
    ),
    (
        ["--model", "models:tokens", "--auto", "--batch-size", "0", "--sequence-length", "8"],
        "error: keras-meshlayout plan: argument --batch-size: expected a positive integer, got 0 "
        "(see keras-meshlayout plan --help)",
    ),
    (
        ["--model", "models:tokens", "--auto", "--batch-size", "3", "--sequence-length", "8"],
        "error: --batch-size 3 cannot be split over batch axis 'data' of size 2: use a multiple of 2.",
    ),
    (
        ["--model", "models:tokens", "--auto", "--batch-size", "4", "--sequence-length", "-3"],
        "error: keras-meshlayout plan: argument --sequence-length: expected a positive integer, got -3",
    ),
    (
        ["--model", "models:mlp", "--max-replicated-fraction", "1.5"],
        "error: keras-meshlayout plan: argument --max-replicated-fraction: expected a number from 0 to 1",
    ),
    (["--auto"], "error: keras-meshlayout plan: the following arguments are required: --model"),
    (  # a negative size is the option's value, not an unknown option (argparse read `-5GiB` as one)
        ["--model", "models:mlp", "--auto", "--batch-size", "8", "--memory-budget", "-5GiB"],
        "error: Cannot read a memory size from '-5GiB' (a memory size is positive). Write it as a number "
        'of bytes or with a unit, e.g. "80GB" or "16GiB".',
    ),
]
for case in BAD_INPUT_CASES:
    line("plan", "--mesh", "2x4", *case[0])
BAD_INPUT_IDS = [
    "unknown-optimizer",
    "builder-raises",
    "builder-raises-auto",
    "builder-not-a-model",
    "module-raises",
    "batch-size-0",
    "batch-size-indivisible",
    "negative-length",
    "fraction-above-1",
    "missing-model",
    "negative-budget",
]


@pytest.mark.parametrize("args, message", BAD_INPUT_CASES, ids=BAD_INPUT_IDS)
def test_bad_input_is_one_line_and_exit_2(args, message, lines):
    result = lines("plan", "--mesh", "2x4", *args)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(message), result.stderr
    assert result.stdout == ""


def test_demo_refuses_a_zero_batch(workdir):
    result = cli("demo", "--batch-size", "0", cwd=workdir)
    assert result.returncode == 2
    assert result.stderr == (
        "error: keras-meshlayout demo: argument --batch-size: expected a positive integer, got 0 "
        "(see keras-meshlayout demo --help)\n"
    )


STRICT = {
    output: line("plan", "--mesh", "2x4", "--model", "models:mlp", "--rules", "typo.json", "--strict", *extra)
    for output, extra in {"table": [], "json": ["--json"]}.items()
}


@pytest.mark.parametrize("output", STRICT)
def test_strict_prints_an_unmatched_rule_once(output, lines):
    result = lines(*STRICT[output])
    assert result.returncode == 1, result.stderr
    assert result.stderr == "plan fails: 1 warning(s) with --strict\n"
    if output == "json":
        warnings = json.loads(result.stdout)["warnings"]
        assert len(warnings) == 1 and "'.*fc3/kernel'" in warnings[0]
    else:
        assert result.stdout.count("'.*fc3/kernel'") == 1, result.stdout


#: The user's builder or rules function that raises (`rules_fn.py`, written by `workdir`), and where
#: its traceback must point.
USER_CODE = {
    "builder": (["--model", "models:boom"], 'models.py", line'),
    "rules-function": (["--model", "models:mlp", "--rules", "rules_fn.py"], 'rules_fn.py", line 3, in rules'),
}
for args, _ in USER_CODE.values():
    line("plan", "--mesh", "2x4", *args)
    line("--traceback", "plan", "--mesh", "2x4", *args)


@pytest.mark.parametrize("name", USER_CODE, ids=list(USER_CODE))
def test_user_code_that_raises_shows_its_traceback_on_request(name, lines):
    args, where = USER_CODE[name]
    short = lines("plan", "--mesh", "2x4", *args)
    assert short.returncode == 2 and len(short.stderr.splitlines()) == 1, short.stderr
    assert short.stderr.endswith("(rerun with --traceback to see where)\n")
    long = lines("--traceback", "plan", "--mesh", "2x4", *args)
    assert long.returncode == 2
    assert long.stderr.startswith("Traceback") and where in long.stderr
    assert long.stderr.splitlines()[-1] == short.stderr.strip()


WEIRD = line("plan", "--mesh", "2x4", "--model", "models:mlp", "--rules", "weird_rules.py")
line("--traceback", *WEIRD)


def test_an_unexpected_error_is_one_line_unless_traceback_is_asked(lines):
    """Anything the command line does not anticipate is still one line, exit 2; --traceback shows it."""
    short = lines(*WEIRD)
    assert short.returncode == 2, short.stderr
    assert short.stderr == "error: OSError: rules store unreachable (rerun with --traceback for details)\n"
    long = lines("--traceback", *WEIRD)
    assert long.returncode == 1 and long.stderr.startswith("Traceback")
    assert 'weird_rules.py", line 4, in __iter__' in long.stderr


# -- issue 15: one preset registry for the API and the command line ------------------------------

#: Each registered preset, planned through `keras-meshlayout plan --preset`: its spelling there,
#: the model, and the layouts it must give. A new preset needs a row here (the test checks).
PRESET_CASES = {
    "mlp": (
        "mlp:fc1,fc2",
        "models:mlp",
        {"mlp/fc1/kernel": [None, "model"], "mlp/fc2/kernel": ["model", None]},
    ),
    "transformer": (
        "transformer",
        "models:attention",
        {
            "attn/query/kernel": [None, "model", None],
            "attn/attention_output/kernel": ["model", None, None],
            "norm/gamma": [None],
        },
    ),
    "conv": (
        "conv",
        "models:convnet",
        {"conv2/kernel": [None, None, None, "model"], "conv2/bias": ["model"]},
    ),
}

#: Each row's `plan` line, run with the module's batch (`lines`).
PRESET_LINES = {
    name: line("plan", "--mesh", "data=2,model=4", "--model", model, "--preset", preset, "--json")
    for name, (preset, model, _) in PRESET_CASES.items()
}


def test_the_command_line_offers_exactly_the_registered_presets():
    """The registry is the one list: kml exports each preset function, the CLI offers each name."""
    from keras_meshlayout.cli import _args, _main, _plan, _plan_inputs
    from keras_meshlayout.planner import _presets

    registry = _presets.PRESETS
    assert {p.rules.__name__ for p in registry.values()} == set(_presets.__all__), "register every preset"
    for preset in registry.values():
        assert getattr(kml, preset.rules.__name__) is preset.rules and preset.rules.__name__ in kml.__all__
    assert _plan.PRESETS == tuple(p.usage for p in registry.values())
    plan_parser = _main.build_parser()._subparsers._group_actions[0].choices["plan"]
    (option,) = [a for a in plan_parser._actions if "--preset" in a.option_strings]
    for preset in registry.values():
        assert f"{preset.usage} ({preset.summary})" in option.help
    with pytest.raises(_args.InputError) as unknown:
        _plan_inputs.preset_rules("bogus", "model")
    assert str(unknown.value) == (
        f"--preset 'bogus': unknown preset. Choose one of: {', '.join(p.usage for p in registry.values())}."
    )


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "mlp",
            "--preset 'mlp': the 'mlp' preset needs layer names in data-flow order, "
            "e.g. --preset mlp:fc1,fc2",
        ),
        ("mlp:fc1,,fc2", "--preset 'mlp:fc1,,fc2': the 'mlp' preset needs layer names in data-flow order"),
        ("conv:conv1", "--preset 'conv:conv1': the 'conv' preset takes no layer names; use --preset conv."),
    ],
    ids=["mlp-without-layers", "mlp-empty-layer", "conv-with-layers"],
)
def test_a_preset_spelled_wrong_says_how_to_spell_it(spec, message):
    from keras_meshlayout.cli import _args, _plan_inputs

    with pytest.raises(_args.InputError) as error:
        _plan_inputs.preset_rules(spec, "model")
    assert str(error.value).startswith(message), str(error.value)


def test_every_registered_preset_plans_through_the_command_line(lines):
    from keras_meshlayout.planner import _presets

    assert set(PRESET_CASES) == set(_presets.PRESETS), "add a PRESET_CASES row for each registered preset"
    for name, (_, _, expected) in PRESET_CASES.items():
        result = lines(*PRESET_LINES[name])
        assert result.returncode == 0, (name, result.stderr)
        plan = json.loads(result.stdout)
        assert plan["valid"], (name, result.stderr)
        axes = {v["path"]: v["axes"] for v in plan["variables"]}
        assert {path: axes.get(path) for path in expected} == expected, name


def test_each_subcommand_lives_in_its_own_module():
    """`keras-meshlayout --help` lists the commands in this order; each one's code is `cli/_<command>.py`."""
    import importlib

    from keras_meshlayout.cli._main import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    assert list(commands) == ["devices", "launch", "plan", "demo"]
    for name, parser in commands.items():
        module = importlib.import_module(f"keras_meshlayout.cli._{name}")
        assert callable(module.add_parser) and callable(module.run), name
        if name != "launch":  # `main` hands launch's arguments to the launcher before parsing
            assert parser.get_default("run") is module.run, name


def test_piped_output_keeps_every_row_whole_and_names_the_optimizer_as_the_readme(workdir):
    """Issue 23: a pipe got 120 columns (`adam_1/learning_rat` / `e`), and the optimizer `adam_1/`."""
    result = cli(
        "plan", "--mesh", "2x4", "--model", "models:mlp", "--preset", "mlp:fc1,fc2", "--optimizer", "adam",
        cwd=workdir,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith("│")]
    paths = [row.split("│")[1].strip() for row in rows]
    assert "adam/learning_rate" in paths and "adam/mlp_fc1_kernel_momentum" in paths
    assert all(path for path in paths), "a row continued on the next line: wrapped mid-name"
    assert not any("adam_1" in path for path in paths)


TOO_LARGE = line("plan", "--mesh", "data=4,model=4", "--model", "models:mlp")


def test_a_mesh_that_does_not_fit_says_how_to_on_the_command_line(lines):
    result = lines(*TOO_LARGE)
    assert result.returncode == 2
    assert "plan on that many emulated CPU devices with --emulate-devices N (now 8)" in result.stderr
    assert "devices=" not in result.stderr  # a Python argument, not the command line's


ON_TARGET = line(
    *("plan", "--mesh", "data=2,model=4", "--target", "tpu-v5e:2x4", "--model", "models:mlp", "--auto"),
    *("--optimizer", "adam", "--compile", "--batch-size", "16", "--json"),
)
OFF_TARGET = line("plan", "--mesh", "data=2,model=2", "--target", "tpu-v5e:2x4", "--model", "models:mlp")


def test_plan_for_a_tpu_target_compiles_the_step_and_reports_it_as_json(lines):
    """Issue 21: `--target` lays the mesh over a TPU v5e's chips; `--compile` adds XLA:TPU's figures."""
    result = lines(*ON_TARGET)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["target"]["chips"] == 8 and data["target"]["hbm_bytes"] == 16 * 2**30
    compiled = data["compiled"]
    assert (compiled["platform"], compiled["device_kind"]) == ("tpu", "TPU v5 lite")
    assert compiled["peak_bytes"] == (
        compiled["argument_bytes"]
        + compiled["output_bytes"]
        - compiled["alias_bytes"]
        + compiled["temp_bytes"]
    )
    assert data["memory"]["state_bytes"] == data["memory_per_device"]["total"]
    assert compiled["wire_bytes_by_axis"]["model"] == pytest.approx(
        data["predicted"]["wire_bytes_by_axis"]["model"], rel=0.02
    )
    wrong = lines(*OFF_TARGET)
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1
    assert "does not fit target tpu-v5e:2x4" in wrong.stderr and "Valid forms: tpu-v5e:RxC" in wrong.stderr


AUTO = line(
    *("plan", "--mesh", "auto", "--target", "tpu-v5e:16x16", "--model", "models:mlp"),
    *("--optimizer", "adam", "--batch-size", "256", "--json"),
)
AUTO_NO_BATCH = line("plan", "--mesh", "auto", "--model", "models:mlp")
AUTO_TIGHT = line(
    "plan", "--mesh", "auto", "--model", "models:mlp", "--batch-size", "8", "--memory-budget", "1KB"
)


def test_plan_mesh_auto_on_a_v5e_16x16_lists_the_alternatives_and_plans_the_best(lines):
    """Issue 21: `--mesh auto` ranks the 9 splits of 256 chips, each with data ≥ 2 also fully sharded
    (`"fsdp": true`), and plans the first; bad input is one line."""
    result = lines(*AUTO)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    alternatives = data["alternatives"]
    assert (
        len({option["mesh"] for option in alternatives}) == 9
        and alternatives[0]["axis_sizes"] == data["mesh"]
    )
    assert {o["mesh"] for o in alternatives if o["fsdp"]} == {
        f"data={2**k},model={256 // 2**k}" for k in range(1, 9)
    }
    assert data["fsdp"] is alternatives[0]["fsdp"] and "layouts" in alternatives[0]
    times = [option["step_seconds"] for option in alternatives]
    assert (
        times == sorted(times)
        and data["predicted"]["wire_bytes_per_device"] == alternatives[0]["wire_bytes_per_device"]
    )
    missing = lines(*AUTO_NO_BATCH)
    assert missing.returncode == 2 and missing.stderr.startswith("error: --mesh auto needs --batch-size")
    tight = lines(*AUTO_TIGHT)
    assert tight.returncode == 1 and len(tight.stderr.strip().splitlines()) == 1
    assert "no data × model split of 8 devices fits" in tight.stderr and "Fix:" in tight.stderr


ABORTED = line("plan", "--mesh", "2x4", "--model", "models:aborts", "--compile", "--batch-size", "16")


def test_a_compile_check_whose_process_dies_is_one_line_and_exit_1(lines):
    """`--compile` runs in a child process: one that dies by a signal (XLA's compiler aborts so on some
    plans, JAX's Shardy partitioner with `free(): invalid pointer`) ends in one `plan fails:` line
    naming the signal and the way around it, not a core dump of the shell's command."""
    result = lines(*ABORTED)
    assert result.returncode == 1
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("plan fails: the process compiling the training step died of SIGABRT")
    assert "JAX_USE_SHARDY_PARTITIONER=false" in message and "Fix:" in message


IDLE = line("plan", "--mesh", "auto", "--target", "tpu-v5e:2x4", "--model", "models:mlp", "--batch-size", "8")


def test_mesh_auto_says_when_its_choice_runs_the_same_step_on_every_device(lines):
    """The small MLP at 8 rows on v5e 2×4: no split pays for its traffic, so `data=1,model=8` with every
    weight whole ranks first; one device would be as fast, and the output says so."""
    result = lines(*IDLE)
    assert result.returncode == 0, result.stderr
    assert "data=1,model=8 │ least traffic" in result.stdout
    assert "note: the chosen split runs the same step on each of its 8 devices" in result.stdout


#: The Keras attention model planned and compiled on XLA:CPU's 2x4 mesh: its no-budget plan is
#: predicted to peak at 242,893 bytes and compiles to 268,660 (predicted ÷ compiled 0.904).
COMPILED = ("plan", "--mesh", "2x4", "--model", "models:attention", "--auto", "--optimizer", "adam",
            "--compile", "--batch-size", "16", "--json")  # fmt: skip
#: A budget the first plan is predicted to fit (242,893 ≤ 95% of it) and compiles over.
OVER_ONCE_COMPILED = line(*COMPILED, "--memory-budget", "262000")
#: No budget, and a device said to hold the predicted peak but not the compiled one.
SMALL_DEVICE = line(*COMPILED, "--device-memory", "250000")


def test_a_plan_compiled_over_its_budget_is_made_again_under_a_tighter_one(lines):
    """Issue 21: a plan said to fit never exceeds the budget once compiled. `--compile` confirms the
    budget plan; compiled over it, the plan is made again under a budget shrunk by the excess (the
    first plan is in `"refits"`), and the one printed fits."""
    result = lines(*OVER_ONCE_COMPILED)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (first,) = data["refits"]
    assert first["budget_bytes"] == 262_000 and first["predicted_peak_bytes"] <= 0.95 * 262_000
    assert first["compiled_peak_bytes"] > 262_000
    assert data["compiled"]["peak_bytes"] <= 262_000 and data["valid"] is True
    assert data["memory"]["peak_bytes"] < first["predicted_peak_bytes"]


def test_a_plan_that_fits_the_device_only_as_predicted_fails_once_compiled(lines):
    """The predicted peak (242,893 B) fits 250,000 bytes of device memory; XLA's compiled one does not,
    and `--compile` says so: exit 1, a line naming both figures and the fix."""
    result = lines(*SMALL_DEVICE)
    assert result.returncode == 1
    data = json.loads(result.stdout)
    assert data["valid"] is False and data["refits"] == []
    message = result.stderr.strip().splitlines()[-1]  # after Keras's own warnings, if Python shows them
    assert message.startswith("plan fails: the compiled training step needs 262.4 KiB per device")
    assert "more than the 244.1 KiB of device memory" in message
    assert "predicted to peak at 237.2 KiB" in message
    assert "Fix:" in message


#: `--mesh auto` on this process's 8 devices, the choice compiled (it was ranked on abstract meshes).
AUTO_COMPILED = line(
    "plan", "--mesh", "auto", "--model", "models:attention", "--optimizer", "adam", "--compile",
    "--batch-size", "16", "--json",
)  # fmt: skip


#: `--mesh auto --compile` within 375,000 bytes at 64 rows: the best split, `data=8,model=1`, compiles
#: over it (`tests/test_compiled_plan.py` has the figures); the next in rank, the same split fully
#: sharded, fits.
AUTO_OVER_ONCE_COMPILED = line(
    "plan", "--mesh", "auto", "--model", "models:attention", "--optimizer", "adam", "--compile",
    "--batch-size", "64", "--auto", "--memory-budget", "375000", "--json",
)  # fmt: skip


def test_a_chosen_mesh_compiled_over_the_budget_gives_way_to_the_next_in_rank(lines):
    result = lines(*AUTO_OVER_ONCE_COMPILED)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    (over,) = data["refits"]
    assert over["mesh"] == "data=8,model=1" and over["compiled_peak_bytes"] > 375_000
    assert over["budget_bytes"] == over["next_budget_bytes"] == 375_000
    assert data["mesh"] == {"data": 8, "model": 1} == data["alternatives"][0]["axis_sizes"]
    assert data["fsdp"] is True and data["alternatives"][0]["fsdp"] is True
    assert data["compiled"]["peak_bytes"] <= 375_000 and data["valid"] is True


def test_the_mesh_chosen_for_the_local_devices_compiles_on_them(lines):
    """Regression: `--mesh auto --compile` without `--target` failed with JAX's "AbstractMesh does not
    implement devices": the choice is laid over the local devices before it is planned and compiled."""
    result = lines(*AUTO_COMPILED)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["alternatives"][0]["axis_sizes"] == data["mesh"] and data["compiled"]["platform"] == "cpu"
    assert data["compiled"]["peak_bytes"] == pytest.approx(data["memory"]["peak_bytes"], rel=0.1)
