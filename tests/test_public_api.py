"""The public surface: names, docstring examples, backend and device guards, base classes."""

from __future__ import annotations

import doctest
import importlib
import io
import json
import os
import pkgutil
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import pytest
from helpers import fresh_env

import keras_meshlayout as kml

# -- every public name importable ---------------------------------------------


@pytest.mark.parametrize("name", kml.__all__, ids=kml.__all__)
def test_public_name_importable(name: str):
    namespace: dict = {}
    exec(f"from keras_meshlayout import {name}", namespace)
    assert namespace[name] is getattr(kml, name)


def test_all_has_no_duplicates():
    assert len(set(kml.__all__)) == len(kml.__all__)


def test_version_is_a_string():
    assert isinstance(kml.__version__, str) and kml.__version__


@pytest.mark.skipif(not os.environ.get("CI"), reason="a development checkout may use an editable install")
def test_ci_tests_the_installed_package():
    """In CI the tests must exercise what `pip install .` installed, not the source tree."""
    source = Path(__file__).resolve().parent.parent / "keras_meshlayout"
    assert Path(kml.__file__).resolve().parent != source, (
        f"keras_meshlayout was imported from the source tree {source}; run the tests with "
        "`pytest` (not `python -m pytest`, which puts the current directory first on sys.path)."
    )


# -- docstring examples run -----------------------------------------------------


def _modules_with_docstrings() -> list:
    """The package and every module in it, as installed (`__main__` would exit)."""
    names = [info.name for info in pkgutil.walk_packages(kml.__path__, kml.__name__ + ".")]
    return [kml] + [importlib.import_module(name) for name in sorted(names) if not name.endswith(".__main__")]


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    for module in _modules_with_docstrings():
        found += [test for test in finder.find(module) if test.examples]
    return sorted(found, key=lambda test: test.name)


DOCTESTS = _doctests()


def test_doctests_cover_the_modules_with_examples():
    """Guards the finder: every module known to carry examples is collected."""
    names = [test.name for test in DOCTESTS]
    assert "keras_meshlayout" in names, names
    for module in ("core._backend", "core._mesh", "core._rules", "core._resolve", "core._distribution"):
        assert any(name.startswith(f"keras_meshlayout.{module}.") for name in names), (module, names)


@pytest.mark.parametrize("test", DOCTESTS, ids=[test.name for test in DOCTESTS])
def test_docstring_examples(test: doctest.DocTest):
    # conftest.py has already emulated 8 CPU devices, which the examples assume.
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    try:
        result = runner.run(test, out=report.write, clear_globs=True)
    finally:
        keras.distribution.set_distribution(None)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed:\n{report.getvalue()}"


# -- guards that need a fresh process ------------------------------------------


def run_python(code: str, **env: str) -> dict:
    """Runs `code` in a fresh interpreter; it prints one JSON object, returned here."""
    base = fresh_env()
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"exit status {result.returncode}\n{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_other_keras_backend_is_a_clear_error():
    out = run_python(
        """
        import json
        import keras
        import keras_meshlayout as kml
        out = {"backend": keras.backend.backend(), "error": None}
        try:
            kml.Mesh(data=8)
        except Exception as err:
            out.update(error=type(err).__name__, message=str(err))
            out["is_kml"] = isinstance(err, kml.UnsupportedBackendError)
        print(json.dumps(out))
        """,
        KERAS_BACKEND="numpy",
    )
    assert out["error"] == "UnsupportedBackendError" and out["is_kml"], out
    assert out["backend"] == "numpy"
    assert "'numpy'" in out["message"]
    assert "KERAS_BACKEND=jax" in out["message"]


def test_emulate_devices_after_jax_started():
    out = run_python(
        """
        import json
        import keras_meshlayout as kml
        import jax
        out = {"started": len(jax.devices()), "error": None}
        try:
            kml.emulate_devices(8)
        except Exception as err:
            out.update(error=type(err).__name__, message=str(err))
            out["is_kml"] = isinstance(err, kml.DevicesAlreadyInitializedError)
        kml.emulate_devices(4)  # the count JAX already has: nothing to do
        out["after"] = len(jax.devices())
        print(json.dumps(out))
        """,
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
    )
    assert out["started"] == 4
    assert out["error"] == "DevicesAlreadyInitializedError" and out["is_kml"], out
    assert "emulate_devices(8)" in out["message"]
    assert "with 4 CPU device(s)" in out["message"]
    assert out["after"] == 4


def test_import_does_not_start_jax():
    out = run_python(
        """
        import json
        import keras_meshlayout
        from jax._src import xla_bridge
        print(json.dumps({"started": xla_bridge.backends_are_initialized()}))
        """
    )
    assert out == {"started": False}


# -- the public classes are the Keras classes ------------------------------------


@pytest.mark.parametrize(
    ("ours", "keras_base"),
    [
        (kml.Mesh, keras.distribution.DeviceMesh),
        (kml.LayoutRules, keras.distribution.LayoutMap),
        (kml.ModelParallel, keras.distribution.ModelParallel),
    ],
    ids=["Mesh", "LayoutRules", "ModelParallel"],
)
def test_subclasses_keras(ours: type, keras_base: type):
    assert issubclass(ours, keras_base)


def test_errors_are_value_errors_and_warnings_user_warnings():
    errors = [getattr(kml, name) for name in kml.__all__ if name.endswith("Error")]
    assert all(issubclass(error, kml.MeshLayoutError) for error in errors)
    assert issubclass(kml.MeshLayoutError, ValueError)
    for name in ("IndivisibleShapeWarning", "UnmatchedRuleWarning"):
        assert issubclass(getattr(kml, name), kml.MeshLayoutWarning)
    assert issubclass(kml.MeshLayoutWarning, UserWarning)


def test_the_lazy_table_and_the_type_checking_imports_agree():
    """`__init__.py` lists each public name twice (for type checkers, and to load it on first use)."""
    import ast

    tree = ast.parse(Path(kml.__file__).read_text(encoding="utf-8"))
    [block] = [
        node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
    ]
    imported = {alias.asname: node.module for node in block.body for alias in node.names}
    assert imported == kml._LAZY
    assert set(kml._LAZY) | {"__version__"} >= set(kml.__all__) and set(kml._LAZY) <= set(kml.__all__)
    assert all(getattr(kml, name) is getattr(importlib.import_module(f"keras_meshlayout.{module}"), name)
               for name, module in kml._LAZY.items())  # fmt: skip
    with pytest.raises(AttributeError, match="has no attribute 'Meshh'"):
        kml.Meshh  # noqa: B018
