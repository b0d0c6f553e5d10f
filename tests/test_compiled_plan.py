"""`kml.plan_and_compile`: a plan said to fit its budget fits once compiled (issue 21, item 3), in Python.

The model is Keras's own attention layer under a norm and a head, on XLA:CPU's 2x4 mesh: its
no-budget plan is predicted to peak at 242,893 bytes and compiles to 268,660 (predicted ÷
compiled 0.904), so a budget between the two is met as predicted and missed as compiled:
`plan --compile`'s case (`tests/test_cli.py`), here through the Python function.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import keras_meshlayout as kml

X, Y = np.zeros((16, 8, 64), "float32"), np.zeros((16, 8, 4), "float32")
#: Met by the first plan's prediction (with its 5% for the prediction's error), missed once compiled.
OVER_ONCE_COMPILED = 262_000


def attention() -> keras.Model:
    x = keras.Input((8, 64), name="x")
    hidden = keras.layers.MultiHeadAttention(num_heads=4, key_dim=32, name="attn")(x, x)
    hidden = keras.layers.LayerNormalization(name="norm")(hidden + x)
    return keras.Model(x, keras.layers.Dense(4, name="head")(hidden), name="attention")


def mesh() -> kml.Mesh:
    return kml.Mesh(data=2, model=4)


def test_a_plan_compiled_over_its_budget_is_made_again_and_the_one_returned_fits():
    planned = kml.plan_and_compile(attention, mesh(), X, Y, memory_budget=OVER_ONCE_COMPILED)
    (first,) = planned.refits
    assert first.budget == OVER_ONCE_COMPILED and first.predicted_peak <= 0.95 * OVER_ONCE_COMPILED
    assert first.compiled_peak > OVER_ONCE_COMPILED
    # Planned again under the prediction less its measured error, not the budget less the excess.
    assert first.next_budget == first.predicted_peak * OVER_ONCE_COMPILED // first.compiled_peak
    assert planned.rules.cost.budget == first.next_budget
    assert planned.step.peak_bytes <= OVER_ONCE_COMPILED
    assert planned.rules.cost.peak_bytes < first.predicted_peak
    # What it returns is what compiling its rules gives.
    again = kml.compile_step(attention, kml.ModelParallel(mesh(), planned.rules), X, Y, optimizer="adam")
    assert again.peak_bytes == planned.step.peak_bytes


def test_without_a_budget_the_least_traffic_plan_is_compiled_once():
    planned = kml.plan_and_compile(attention, mesh(), X, Y)
    assert planned.refits == ()
    assert planned.rules.cost.budget is None
    assert planned.step.peak_bytes > planned.rules.cost.peak_bytes  # the 0.904 above
    # XLA:CPU's `peak_memory_in_bytes` leaves out the temporaries: not reported as the live peak.
    assert planned.step.live_peak_bytes is None and planned.step.to_dict()["live_peak_bytes"] is None
    assert "live at once" not in str(planned.step)


def test_where_no_plan_meets_the_shrunk_budget_the_smallest_plan_is_compiled_and_fits():
    """211,000 bytes on 2x4: the plan made first (predicted 200,301) compiles to 217,940; under the budget
    that error shrinks to (193,922) no plan is predicted to fit, but the smallest plan (fully sharded,
    predicted 199,317) is predicted closer, and compiles to 201,596: it is made under its own budget."""
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.auto_rules(attention(), mesh(), memory_budget=1, batch=X, optimizer="adam")
    smallest = error.value.smallest_bytes
    assert error.value.smallest_peak_bytes < smallest < 211_000
    planned = kml.plan_and_compile(attention, mesh(), X, Y, memory_budget=211_000)
    (first,) = planned.refits
    assert first.compiled_peak > 211_000 and first.next_budget == smallest
    assert first.predicted_peak * 211_000 // first.compiled_peak < error.value.smallest_peak_bytes
    assert planned.rules.cost.peak_bytes == error.value.smallest_peak_bytes < first.predicted_peak
    assert planned.step.peak_bytes <= 211_000


#: 64 rows of the attention model; on `data=8,model=1` within 360,000 bytes the plan made first is
#: predicted at 340,376 and compiles to 386,100, and the smallest plan (fully sharded, predicted
#: 338,360) to 368,724: no plan fits once compiled.
X64, Y64 = np.zeros((64, 8, 64), "float32"), np.zeros((64, 8, 4), "float32")


def test_a_budget_no_plan_meets_once_compiled_names_both_peaks_and_the_fix():
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.plan_and_compile(attention, kml.Mesh(data=8, model=1), X64, Y64, memory_budget=360_000)
    message = str(error.value)
    assert message.startswith(
        "plan_and_compile: the compiled training step needs 360.1 KiB per device at its peak (XLA's "
        "memory_analysis), more than the memory budget of 351.6 KiB; the plan was predicted to peak at "
        "330.4 KiB. Planned again under 347.8 KiB, 322.6 KiB (the last met by no plan, as predicted), "
        "without fitting once compiled. Fix:"
    )
    assert error.value.smallest_bytes == 368_724


def test_given_a_device_count_the_mesh_is_chosen_and_the_plan_compiled_for_it_fits():
    """The attention model on 8 devices: `kml.choose_mesh` ranks the splits within the budget, the best is
    laid over this process's devices and compiled; what is returned is that mesh, its rules and step."""
    planned = kml.plan_and_compile(attention, 8, X, Y, memory_budget=OVER_ONCE_COMPILED)
    assert planned.choice is not None and not planned.mesh.is_abstract
    assert planned.mesh.axis_sizes == planned.choice.mesh.axis_sizes
    assert planned.rules is planned.choice.rules
    assert planned.step.peak_bytes <= OVER_ONCE_COMPILED
    again = kml.compile_step(
        attention, kml.ModelParallel(planned.mesh, planned.rules), X, Y, optimizer="adam"
    )
    assert again.peak_bytes == planned.step.peak_bytes
    assert again.comm.wire_bytes == planned.step.comm.wire_bytes


def test_auto_rules_options_with_devices_to_choose_for_are_refused_before_any_planning():
    with pytest.raises(kml.InvalidOptionError) as error:
        kml.plan_and_compile(attention, 8, X, Y, replicate_below=0)
    assert str(error.value) == (
        "plan_and_compile: ['replicate_below'] are kml.auto_rules options for a mesh you give; with devices "
        "(8) the mesh is chosen by kml.choose_mesh, which plans with the defaults. Fix: drop them, or pass a "
        "kml.Mesh."
    )


def test_more_devices_than_the_process_has_are_refused_before_any_planning():
    with pytest.raises(
        kml.InvalidOptionError, match=r"^plan_and_compile: 16 devices to choose a mesh for, but "
    ):
        kml.plan_and_compile(attention, 16, X, Y)


def test_given_a_tpu_target_the_mesh_is_chosen_within_its_hbm_and_compiled_by_xla_tpu():
    planned = kml.plan_and_compile(attention, "tpu-v5e:2x4", X, Y)
    assert planned.step.platform == "tpu" and planned.refits == ()
    assert planned.choice.budget == planned.choice.target.hbm_bytes
    assert planned.mesh.axis_sizes == planned.choice.mesh.axis_sizes
    assert planned.step.peak_bytes <= planned.choice.target.hbm_bytes


#: On 8 devices within 375,000 bytes, the best split, `data=8,model=1`, compiles over the budget (as
#: above); the next in rank, the same split fully sharded, fits.


def test_a_chosen_mesh_compiled_over_the_budget_gives_way_to_the_next_in_rank():
    planned = kml.plan_and_compile(attention, 8, X64, Y64, memory_budget=375_000)
    (over,) = planned.refits
    assert over.mesh == "data=8,model=1" and over.next_budget == over.budget == 375_000
    assert over.predicted_peak <= 0.95 * 375_000 < 375_000 < over.compiled_peak
    assert over.to_dict()["mesh"] == "data=8,model=1"
    # The choice lists the split compiled first, then the others in rank, the one given up among them.
    compiled, given_up = planned.choice.alternatives[:2]
    assert (compiled.spec, compiled.fsdp, given_up.spec, given_up.fsdp) == (
        "data=8,model=1",
        True,
        "data=8,model=1",
        False,
    )
    assert planned.choice.rules is planned.rules and planned.rules.cost.peak_bytes == compiled.peak_bytes
    assert planned.mesh.axis_sizes == planned.choice.mesh.axis_sizes == {"data": 8, "model": 1}
    assert planned.step.peak_bytes <= 375_000
    again = kml.compile_step(
        attention, kml.ModelParallel(planned.mesh, planned.rules), X64, Y64, optimizer="adam"
    )
    assert again.peak_bytes == planned.step.peak_bytes


def test_when_no_mesh_ranked_within_the_budget_fits_once_compiled_each_is_named():
    with pytest.raises(kml.MemoryBudgetError) as error:
        kml.plan_and_compile(attention, 8, X64, Y64, memory_budget=360_000)
    message = str(error.value)
    assert message.startswith(
        "plan_and_compile: no mesh for 8 fits the memory budget of 351.6 KiB per device"
    )
    tried = re.findall(r"(data=\d,model=\d(?: fsdp)?): predicted [\d.]+ KiB, compiled ([\d.]+) KiB", message)
    assert [mesh for mesh, _ in tried] == ["data=8,model=1", "data=8,model=1 fsdp"]
    assert all(float(compiled) > 351.6 for _, compiled in tried)
    assert message.endswith("Fix: a smaller batch, or a larger memory_budget.")
    assert error.value.smallest_bytes > 360_000


#: keras.applications' MobileNetV2 at 32 × 32 on 2×4 with blocks 12 to 14 as a memory-budget plan laid
#: them out (2-D, tensor-parallel, 2-D; batch norms' vectors over both axes, one fully sharded), the
#: rest replicated.
SHARDY_ABORTS = textwrap.dedent(
    """
    import keras, numpy as np, keras_meshlayout as kml
    both = (("model", "data"),)
    def block(i, two_d):
        rules = [(f"block_{i}_depthwise/kernel", (None, None, "model", None))]
        rules += [(f"block_{i}_{part}_BN/moving_mean", ("model",)) for part in ("expand", "depthwise")]
        rules += [(f"block_{i}_{part}_BN/{name}", both if two_d else ("model",))
                  for part in ("expand", "depthwise") for name in ("gamma", "beta", "moving_variance")]
        inner = ("data", "model") if two_d else (None, "model")
        return rules + [(f"block_{i}_expand/kernel", (None, None, *inner)),
                        (f"block_{i}_project/kernel", (None, None, *inner[::-1]))]
    fully_sharded = [("block_12_project_BN/beta", (("data", "model"),))]
    rules = kml.LayoutRules([*block(12, True), *block(13, False), *block(14, True), *fully_sharded])
    build = lambda: keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), classes=10)
    x, y = np.zeros((16, 32, 32, 3), "float32"), np.zeros(16, "int32")
    dist = kml.ModelParallel(kml.Mesh(data=2, model=4), rules, replicate_below=0)
    kml.compile_step(build, dist, x, y, optimizer="adam", loss="sparse_categorical_crossentropy")
    """
)


@pytest.mark.xfail(
    strict=True,
    reason="XLA bug (jax 0.10.2, XLA:CPU): JAX's Shardy partitioner aborts the process with "
    "`free(): invalid pointer` compiling this plan (JAX_USE_SHARDY_PARTITIONER=false compiles it, and so "
    "does XLA:TPU for tpu-v5e:2x4). `plan --compile` runs in a child process and says so in one line "
    "(tests/test_cli.py). If this passes, Shardy is fixed: drop the advice from cli/_compile_guard.py.",
)
def test_shardy_compiles_a_mobilenet_v2_plan_without_aborting():
    env = {**os.environ, "KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    done = subprocess.run(
        [sys.executable, "-c", SHARDY_ABORTS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
