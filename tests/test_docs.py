"""The documentation: the site builds with no warning, covers the public API, and every
install hint works from a checkout; the README stays a landing page whose test command is CI's.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import keras_meshlayout as kml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README_MAX_LINES = 250
# Where a user meets an install hint: the pages, the README, the docstrings and error
# messages of the package, the recipes, the benchmarks, CONTRIBUTING.md.
HINT_FILES = sorted(
    [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *DOCS.rglob("*.md")]
    + [p for folder in ("keras_meshlayout", "recipes", "benchmarks") for p in (ROOT / folder).rglob("*.py")]
    + [p for p in (ROOT / "tests").glob("*.py") if p.name != "test_docs.py"]
)


def _hooks():
    spec = importlib.util.spec_from_file_location("benchmark_plots", DOCS / "hooks" / "benchmark_plots.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _install_hints(text: str) -> list[str]:
    """What `pip install` is told to fetch in `text`: each argument that is not an option."""
    return [
        word.strip("\"'")
        for arguments in re.findall(r"pip install((?:[ \t]+(?:[^\s`|()&,;\[]|\[[^\]\s]*\])+)+)", text)
        for word in arguments.split()
        if not word.startswith("-")
    ]


def _extras() -> set[str]:
    """The optional-dependency groups pyproject.toml declares."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+) = \[", section, re.M))


def test_site_builds_with_no_warning(tmp_path):
    """`mkdocs build --strict` (as in CI): every link, anchor, API page and plot resolves."""
    mkdocs = shutil.which("mkdocs") or pytest.fail('mkdocs is missing: pip install ".[docs]"')
    result = subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for plot in _hooks().PLOTS:
        assert (tmp_path / "site" / "benchmarks" / f"{plot}.svg").read_bytes().startswith(b"<?xml")
    reference = (tmp_path / "site" / "reference" / "mesh" / "index.html").read_text(encoding="utf-8")
    assert "kml.Mesh.parse" in reference or "Mesh.parse" in reference, "the docstrings did not render"


def test_every_public_name_has_a_reference_entry():
    documented = {
        name
        for page in (DOCS / "reference").glob("*.md")
        for name in re.findall(r"^::: keras_meshlayout\.(\w+)$", page.read_text(encoding="utf-8"), re.M)
    }
    assert sorted(set(kml.__all__) - documented) == [], "add them to a page of docs/reference/"
    assert sorted(documented - set(kml.__all__)) == [], "documented but not public"


def test_readme_is_a_landing_page_whose_test_command_is_what_ci_runs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= README_MAX_LINES
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    ci_commands = [
        line.strip() for line in ci.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    test_line = next(line for line in readme.splitlines() if line.endswith("&& pytest -q -n 2"))
    steps = [step.strip() for step in test_line.split("&&")]
    assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"]
    ci_steps = [c for c in ci_commands if c.startswith(("pip install", "pytest"))]
    assert steps[2:] == ci_steps, f"README runs {steps[2:]}, .ci/run runs {ci_steps}"
    assert "mkdocs build --strict" in ci


@pytest.mark.parametrize("path", HINT_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_install_hints_work_from_a_checkout(path):
    """The package is not on a registry: `pip install "keras_meshlayout[plot]"` fails there.

    A hint must install from the checkout (`.`, `".[extra]"`) or name a package that is on
    a registry (matplotlib, keras-hub==...).
    """
    hints = _install_hints(path.read_text(encoding="utf-8"))
    wrong = [h for h in hints if re.match(r"keras[-_]meshlayout", h, re.I)]
    assert wrong == [], f"{path.relative_to(ROOT)} says pip install {wrong}: use '.' or '\".[extra]\"'"


def test_install_hints_name_extras_that_exist():
    extras = _extras()
    assert {"plot", "hub", "docs", "test"} <= extras
    named = {
        extra
        for path in HINT_FILES
        for hint in _install_hints(path.read_text(encoding="utf-8"))
        for extra in re.findall(r"^\.\[([\w,]+)\]$", hint)
    }
    assert named, "no hint names an extra: the pattern is wrong"
    for group in named:
        assert set(group.split(",")) <= extras, f"pip install '.[{group}]' names an extra pyproject lacks"


@pytest.mark.parametrize("name", sorted(_hooks().PLOTS), ids=str)
def test_benchmark_plots_are_drawn_from_the_committed_json(name):
    hooks = _hooks()
    source, draw = hooks.PLOTS[name]
    svg = draw(hooks.load(source))
    assert svg.startswith(b"<?xml") and b"<svg" in svg
    assert svg == draw(hooks.load(source)), "the same JSON must draw the same file"


@pytest.mark.parametrize("name", sorted(_hooks().TABLES), ids=str)
def test_benchmark_tables_have_one_row_per_result(name):
    hooks = _hooks()
    source, draw = hooks.TABLES[name]
    data = hooks.load(source)
    rows = data["rows"] if name == "comm" else data["results"] if name == "checkpoint" else data
    table = draw(data).splitlines()
    assert len(table) == 2 + len(rows)
    assert f"<!-- bench:{name} -->" in (DOCS / "benchmarks.md").read_text(encoding="utf-8")


def test_hint_pattern_finds_what_it_should():
    """The checks above cannot pass by finding nothing."""
    text = 'run `pip install ".[plot]"` or pip install "keras_meshlayout[plot]" && pip install --no-deps x==1'
    assert _install_hints(text) == [".[plot]", "keras_meshlayout[plot]", "x==1"]
    assert _install_hints("(pip install .) then `pip install matplotlib`") == [".", "matplotlib"]
    assert _install_hints('pip install matplotlib (or, from a checkout, pip install ".[plot,docs]")') == [
        "matplotlib",
        ".[plot,docs]",
    ]


def _conftest():
    spec = importlib.util.spec_from_file_location("_conftest_for_docs", ROOT / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_slow_entry_names_an_existing_test():
    """A renamed test would silently leave the `slow` list and slow the everyday loop down."""
    missing = []
    for module, names in _conftest().SLOW.items():
        source = (ROOT / "tests" / module).read_text(encoding="utf-8")
        missing += [
            f"{module}::{n}" for n in names if n != "*" and not re.search(rf"^def {n}\(", source, re.M)
        ]
    assert missing == [], "tests/conftest.py SLOW names tests that do not exist"


def test_every_file_run_first_exists_once():
    """A renamed file in `FIRST` would silently start last again."""
    first = _conftest().FIRST
    assert len(set(first)) == len(first)
    assert [name for name in first if not (ROOT / "tests" / name).is_file()] == []


def test_slow_tests_are_marked(request):
    """Every selected test that `SLOW` lists carries the marker; this one does not."""
    slow = _conftest().SLOW
    for item in request.session.items:
        names = slow.get(item.path.name, ())
        if "*" in names or getattr(item, "originalname", item.name) in names:
            assert item.get_closest_marker("slow"), item.nodeid
    assert request.node.get_closest_marker("slow") is None


def test_contributing_lists_every_module():
    """Issue 20: CONTRIBUTING.md's "Where things live" names every module of the package, once."""
    text = (ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8")
    section = text[text.index("## Where things live") : text.index("## The test loop")]
    first_cells = [line.split("|")[1] for line in section.splitlines() if line.startswith("| `")]
    listed = [name for cell in first_cells for name in re.findall(r"`([\w/]+\.py)`", cell)]
    package = ROOT / "keras_meshlayout"
    modules = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if path.name != "__init__.py" or path.parent == package
    }
    assert sorted(modules - set(listed)) == [], "add a line for each of these to CONTRIBUTING.md"
    assert sorted(set(listed) - modules) == [], "these are listed but do not exist"


def test_planner_guide_pictures_are_what_show_sharding_draws():
    """Issue 23: the planner guide's column → row and 2-D pictures are what kml.show_sharding draws."""
    text = (DOCS / "guides" / "planner.md").read_text(encoding="utf-8")
    pictures = re.findall(r"```[^\n]*\n(shape .*?)\n```", text, flags=re.DOTALL)
    assert len(pictures) == 3, "the column, row and 2-D pictures"
    mesh = kml.Mesh(data=2, model=4)
    for picture in pictures:
        shape, layout = re.match(r"shape \(([\d, ]+)\) · layout \((.*?)\) ·", picture).groups()
        axes = tuple(None if a == "None" else a for a in layout.split(", "))
        drawn = str(kml.show_sharding(mesh, tuple(int(n) for n in shape.split(", ")), axes))
        assert [line.rstrip() for line in drawn.splitlines()] == picture.splitlines()
