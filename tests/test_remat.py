"""Under `keras.RematScope` the backward pass recomputes blocks, and their forward collectives with them.

A row-parallel projection whose output an activation's gradient needs (a `gelu` after it, a norm
after the residual it feeds) is recomputed and all-reduces its output over `model` again; one whose
output nothing in the backward pass reads (the last projection, no activation) is not; a
vocab-parallel table looked up again all-reduces its rows again (`planner/_remat.py`). Without a
budget the predicted bytes per axis are the compiled step's, exactly, in every remat mode that
recomputes (and in those that do not).
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
import styles

import keras_meshlayout as kml

LOSS = {"mlp": "mse", "block": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}


def mlp(scope: keras.RematScope | None = None) -> keras.Model:
    """Three `gelu` projections of 128, one of 64 and a head; the first four made in `scope` if given."""
    dense = keras.layers.Dense
    with scope or contextlib.nullcontext():
        layers = [*(dense(128, activation="gelu", name=f"fc{i}") for i in (1, 2, 3)), dense(64, name="fc4")]
    return keras.Sequential([keras.Input((64,)), *layers, dense(8, name="head")], name="mlp")


BUILDERS = {"mlp": mlp, "block": styles.block_functional}


def data(family: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    if family == "mlp":
        return rng.normal(size=(32, 64)).astype("float32"), rng.normal(size=(32, 8)).astype("float32")
    x = rng.integers(0, styles.VOCAB, (16, styles.LENGTH)).astype("int32")
    return x, np.zeros(16, "int32")


MODES = [("mlp", "full"), ("mlp", "activations"), ("block", "full")]
CASES = [
    *((family, mode, shape, None) for family, mode in MODES for shape in [(2, 4), (4, 2)]),
    ("mlp", "full", (2, 4), "tpu-v5e:2x4"),
    ("block", "full", (2, 4), "tpu-v5e:2x4"),
]


@pytest.mark.parametrize(("family", "mode", "shape", "target"), CASES)
def test_a_rematerialised_step_sends_what_is_predicted(family, mode, shape, target):
    """XLA:CPU and XLA:TPU alike (v5e 2×4)."""

    def build() -> keras.Model:
        with keras.RematScope(mode=mode):
            return BUILDERS[family]()

    mesh = kml.Mesh(data=shape[0], model=shape[1], target=target)
    x, y = data(family)
    with kml.dry_build(build) as model:
        rules = kml.auto_rules(model, mesh, batch=x, optimizer="adam", replicate_below=0)
    dist = kml.ModelParallel(mesh, rules, replicate_below=0)
    step = kml.compile_step(build, dist, x, y, optimizer="adam", loss=LOSS[family])
    assert dict(rules.cost.wire_bytes_by_axis) == pytest.approx(dict(step.comm.wire_bytes_by_axis), rel=1e-9)


def test_full_remat_sends_a_recomputed_row_projections_all_reduce_twice():
    """The MLP's layers (not the model) rematerialised, on 2×4: `fc2`'s output all-reduce (under
    `gelu`) twice, `fc4`'s (no activation) once. (The whole model in the scope, as above, is
    recomputed once more around its layers' own recomputation: every projection again.)"""
    x, _ = data("mlp")
    plain = kml.auto_rules(mlp(), kml.Mesh(data=2, model=4), batch=x, replicate_below=0)
    again = kml.auto_rules(
        mlp(keras.RematScope(mode="full")), kml.Mesh(data=2, model=4), batch=x, replicate_below=0
    )
    extra = again.cost.wire_bytes_by_axis["model"] - plain.cost.wire_bytes_by_axis["model"]
    assert extra == 16 * 128 * 4 * 2 * 3 / 4  # one all-reduce of fc2's (16 rows, 128) output over 4
