"""Big plans summarised (issue 23): a 7 B dry plan printed 4,907 lines, repeated blocks unfolded."""

from __future__ import annotations

import keras
import pytest

import keras_meshlayout as kml
from keras_meshlayout.core._resolve import Resolution
from keras_meshlayout.core._summary import fold


def _entry(path: str, axes=(None, "model"), shape=(4, 4)) -> Resolution:
    return Resolution(path, shape, "float32", None, None, axes, nbytes=64, shards=4)


@pytest.mark.parametrize(
    "paths, rows",
    [
        ([f"m/block_{i}/kernel" for i in range(32)], [("m/block_{0..31}/kernel", 32)]),
        (["m/block_1/kernel", "m/block_3/kernel"], [("m/block_{1,3}/kernel", 2)]),
        (
            [f"m/layer_{i}/head_{j}/kernel" for i in range(2) for j in range(3)],
            [("m/layer_{0..1}/head_{0..2}/kernel", 6)],
        ),
        (["m/dense/kernel", "m/dense_1/kernel"], [("m/dense/kernel", 1), ("m/dense_1/kernel", 1)]),
        (["m/block_0/kernel"], [("m/block_0/kernel", 1)]),
    ],
    ids=["a-range", "a-set", "two-slots", "no-number-no-fold", "one"],
)
def test_fold(paths, rows):
    assert [(row.path, row.count) for row in fold([_entry(path) for path in paths])] == rows


def test_rows_of_other_layouts_do_not_fold():
    entries = [_entry("m/block_0/kernel"), _entry("m/block_1/kernel", axes=(None, None))]
    assert [row.count for row in fold(entries)] == [1, 1]


def _deep() -> keras.Model:
    layers = [keras.Input((16,))]
    for i in range(40):
        layers += [
            keras.layers.Dense(32, name=f"block_{i}_up"),
            keras.layers.Dense(16, name=f"block_{i}_down"),
        ]
    return keras.Sequential(layers, name="deep")


def test_a_big_plan_prints_folded_in_the_cli_and_whole_with_full(tmp_path, capsys, monkeypatch):
    from keras_meshlayout.cli._main import main

    (tmp_path / "deep_models.py").write_text(
        "import keras\n\ndef deep():\n    layers = [keras.Input((16,))]\n    for i in range(40):\n"
        "        layers += [keras.layers.Dense(32, name=f'block_{i}_up'),\n"
        "                   keras.layers.Dense(16, name=f'block_{i}_down')]\n"
        "    return keras.Sequential(layers, name='deep')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    args = ["plan", "--mesh", "2x4", "--model", "deep_models:deep", "--rules", str(tmp_path / "rules.json")]
    (tmp_path / "rules.json").write_text(
        '[[".*_up/kernel", [null, "model"]], [".*_down/kernel", ["model", null]]]'
    )
    assert main(args) == 0
    summary = capsys.readouterr().out
    assert "160 variables in 4 rows" in summary
    assert "deep/block_{0..39}_up/kernel" in summary and "│ 40 │" in summary
    assert "Variables per device:" in summary
    assert main([*args, "--full"]) == 0
    full = capsys.readouterr().out
    assert "deep/block_39_down/bias" in full and "{0..39}" not in full
    assert len(full.splitlines()) > 160 > len(summary.splitlines())


def test_summary_of_a_dry_plan_lists_the_largest_rows():
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), [(r".*_up/kernel", (None, "model"))])
    plan = kml.dry_plan(_deep, dist)
    text = str(plan.summary(largest=2))
    assert "The 2 largest rows" in text
    assert text.count("deep/block_{0..39}_down/kernel") == 2  # in the table and among the largest
