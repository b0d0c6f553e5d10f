"""Every bad input gets a keras_meshlayout error that says what, why and how to fix it.

The tables below hold one row per bad input. Each row names the error class it
must raise and fragments its message must contain: the values received, the
variable path, the rule, the mesh axis and sizes, and the fix. The model rows
build real Keras models on real meshes of the 8 emulated CPU devices.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import keras
import numpy as np
import pytest
from helpers import mlp
from jax.sharding import PartitionSpec

import keras_meshlayout as kml


class Case(NamedTuple):
    """One bad input and what it must raise.

    Attributes:
        id: Test id.
        make: Called with no arguments; must raise `error`.
        error: The expected error class (matched exactly, not as a base class).
        fragments: Substrings the error message must contain.
    """

    id: str
    make: Callable[[], Any]
    error: type[Exception]
    fragments: tuple[str, ...]


@functools.cache
def mesh(spec: str) -> kml.Mesh:
    """Returns the mesh for `spec`, built once per test session.

    Args:
        spec: A `kml.Mesh.parse` spec, e.g. `"data=2,model=4"`.
    """
    return kml.Mesh.parse(spec)


def assert_message(error: BaseException, fragments: tuple[str, ...]) -> None:
    """Asserts that the message of `error` contains every fragment.

    Args:
        error: The raised error.
        fragments: Substrings the message must contain.
    """
    message = str(error)
    missing = [fragment for fragment in fragments if fragment not in message]
    assert not missing, f"message lacks {missing!r}:\n{message}"


def raises_case(case: Case) -> None:
    """Runs `case.make` and checks the error class and message.

    Args:
        case: The row to check.
    """
    with pytest.raises(kml.MeshLayoutError) as info:
        case.make()
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    assert_message(info.value, case.fragments)


SPEC_HELP = 'Write it as "2x4"'

MESH_CASES = [
    Case(  # issue 22: a raw TypeError ('int' object is not iterable) before
        "across-processes-not-names",
        lambda: kml.Mesh(data=2, model=4, across_processes=5),
        kml.InvalidMeshError,
        (
            "across_processes must name mesh axes",
            "Received: across_processes=5",
            "The mesh has axes ('data', 'model')",
            'across_processes=("data",)',
        ),
    ),
    Case(
        "size-zero",
        lambda: kml.Mesh(data=0, model=8),
        kml.InvalidMeshError,
        ("'data'", "size 0", "{'data': 0, 'model': 8}", "sizes must be positive, or -1"),
    ),
    Case(
        "size-negative",
        lambda: kml.Mesh(data=-2, model=4),
        kml.InvalidMeshError,
        ("'data'", "size -2", "{'data': -2, 'model': 4}", "sizes must be positive, or -1"),
    ),
    Case(
        "two-inferred",
        lambda: kml.Mesh(data=-1, model=-1),
        kml.InvalidMeshError,
        (
            "Only one mesh axis can have size -1",
            "['data', 'model']",
            "{'data': -1, 'model': -1}",
            "Give all but one axis an explicit size",
        ),
    ),
    Case(
        "product-too-small",
        lambda: kml.Mesh(data=2, model=2),
        kml.InvalidMeshError,
        ("{'data': 2, 'model': 2}", "needs 4 devices", "8 are available", "use -1 for one axis"),
    ),
    Case(
        "product-too-large",
        lambda: kml.Mesh(data=4, model=4),
        kml.InvalidMeshError,
        ("{'data': 4, 'model': 4}", "needs 16 devices", "8 are available", "use -1 for one axis"),
    ),
    Case(
        "cannot-infer",
        lambda: kml.Mesh(data=-1, model=3),
        kml.InvalidMeshError,
        (
            "Cannot infer the size of mesh axis 'data'",
            "use 3 devices",
            "8 available",
            "{'data': -1, 'model': 3}",
            "Choose sizes whose product divides 8",
        ),
    ),
    Case(
        "float-size",
        lambda: kml.Mesh(data=2.0, model=4),
        kml.InvalidMeshError,
        ("'data'", "needs an integer size", "data=2.0"),
    ),
    Case(
        "string-size",
        lambda: kml.Mesh(data="2", model=4),
        kml.InvalidMeshError,
        ("'data'", "needs an integer size", "data='2'"),
    ),
    Case(
        "bool-size",
        lambda: kml.Mesh(data=True, model=8),
        kml.InvalidMeshError,
        ("'data'", "needs an integer size", "data=True"),
    ),
    Case(
        "bad-axis-name",
        lambda: kml.Mesh({"1x": 8}),
        kml.InvalidMeshError,
        ("must be identifiers such as 'data' or 'model'", "'1x'", "{'1x': 8}"),
    ),
    Case(
        "axis-name-with-dash",
        lambda: kml.Mesh({"data": 2, "tensor-parallel": 4}),
        kml.InvalidMeshError,
        ("must be identifiers", "'tensor-parallel'"),
    ),
    Case(
        "mapping-and-kwargs",
        lambda: kml.Mesh({"data": 8}, model=1),
        kml.InvalidMeshError,
        (
            "either as a mapping or as keyword arguments, not both",
            "axes={'data': 8}",
            "axis_sizes={'model': 1}",
        ),
    ),
    Case(
        "no-axes",
        lambda: kml.Mesh(),
        kml.InvalidMeshError,
        ("at least one axis", "Received no axes", "kml.Mesh(data=2, model=4)"),
    ),
    Case(
        "empty-mapping",
        lambda: kml.Mesh({}),
        kml.InvalidMeshError,
        ("at least one axis", "Received no axes"),
    ),
    Case(
        "parse-empty",
        lambda: kml.Mesh.parse(""),
        kml.InvalidMeshError,
        ("non-empty string", "Received: ''", SPEC_HELP),
    ),
    Case(
        "parse-blank",
        lambda: kml.Mesh.parse("   "),
        kml.InvalidMeshError,
        ("non-empty string", "Received: '   '", SPEC_HELP),
    ),
    Case(
        "parse-not-a-string",
        lambda: kml.Mesh.parse(None),
        kml.InvalidMeshError,
        ("non-empty string", "Received: None", SPEC_HELP),
    ),
    Case(
        "parse-trailing-x",
        lambda: kml.Mesh.parse("2x"),
        kml.InvalidMeshError,
        ("'2x'", "axis size ''", "not an integer", SPEC_HELP),
    ),
    Case(
        "parse-letters",
        lambda: kml.Mesh.parse("axb"),
        kml.InvalidMeshError,
        ("'axb'", "axis size 'a'", "not an integer", SPEC_HELP),
    ),
    Case(
        "parse-repeated-axis",
        lambda: kml.Mesh.parse("data=2,data=4"),
        kml.InvalidMeshError,
        ("'data=2,data=4'", "names axis 'data' twice", "Each axis needs its own name"),
    ),
    Case(
        "parse-missing-size",
        lambda: kml.Mesh.parse("data=2,model"),
        kml.InvalidMeshError,
        ("'data=2,model'", "malformed entry 'model'", SPEC_HELP),
    ),
    Case(
        "parse-missing-name",
        lambda: kml.Mesh.parse("data=2,=4"),
        kml.InvalidMeshError,
        ("'data=2,=4'", "malformed entry '=4'", SPEC_HELP),
    ),
    Case(
        "parse-trailing-comma",
        lambda: kml.Mesh.parse("data=2,model=4,"),
        kml.InvalidMeshError,
        ("'data=2,model=4,'", "malformed entry ''", SPEC_HELP),
    ),
    Case(
        "parse-three-positional",
        lambda: kml.Mesh.parse("2x2x2"),
        kml.InvalidMeshError,
        (
            "'2x2x2'",
            "3 positional axes",
            "('data', 'model')",
            'Name them instead, e.g. "data=2,model=2,expert=2"',
        ),
    ),
    Case(
        "parse-semicolon",
        lambda: kml.Mesh.parse("data=2;model=4"),
        kml.InvalidMeshError,
        ("'data=2;model=4'", "axis size '2;model=4'", "not an integer", SPEC_HELP),
    ),
    Case(
        "parse-named-not-integer",
        lambda: kml.Mesh.parse("data=2,model=x"),
        kml.InvalidMeshError,
        ("'data=2,model=x'", "axis size 'x'", "not an integer"),
    ),
    Case(
        "parse-bad-axis-name",
        lambda: kml.Mesh.parse("data=2,1m=4"),
        kml.InvalidMeshError,
        ("must be identifiers", "'1m'", "{'data': 2, '1m': 4}"),
    ),
    Case(
        "parse-wrong-product",
        lambda: kml.Mesh.parse("2x2"),
        kml.InvalidMeshError,
        ("{'data': 2, 'model': 2}", "needs 4 devices", "8 are available", "use -1 for one axis"),
    ),
    Case(
        "parse-zero",
        lambda: kml.Mesh.parse("0x8"),
        kml.InvalidMeshError,
        ("'data'", "size 0", "sizes must be positive"),
    ),
    # Keras's call form, kml.Mesh(shape, axis_names, devices): Keras's words, then ours.
    Case(
        "keras-empty",
        lambda: kml.Mesh((8,), []),
        kml.InvalidMeshError,
        ("Shape and axis_names cannot be empty", "Received: shape=(8,), axis_names=[]", "Fix:"),
    ),
    Case(
        "keras-sizes-differ",
        lambda: kml.Mesh((2, 4), ["data"]),
        kml.InvalidMeshError,
        ("Shape and axis_names should have same size", "2 sizes, 1 names", "one name per axis"),
    ),
    Case(
        "keras-device-count",
        lambda: kml.Mesh((2, 4), ["data", "model"], ["cpu:0", "cpu:1"]),
        kml.InvalidMeshError,
        ("Shape does not match the number of devices", "needs 8 devices, and 2 were given", "Fix: pass 8"),
    ),
    Case(
        "keras-size-zero",
        lambda: kml.Mesh((0, 8), ["data", "model"]),
        kml.InvalidMeshError,
        ("Mesh axis 'data' needs a positive integer size", "shape=(0, 8)"),
    ),
    Case(
        "keras-repeated-name",
        lambda: kml.Mesh((2, 4), ["data", "data"]),
        kml.InvalidMeshError,
        ("Mesh axis names must differ", "axis_names=['data', 'data']"),
    ),
    Case(
        "keras-and-ours",
        lambda: kml.Mesh((8,), ["data"], model=1),
        kml.InvalidMeshError,
        ("either Keras's way", "not both", "{'model': 1}"),
    ),
    Case(
        "unknown-device",
        lambda: kml.Mesh(data=8, devices=["tpu:0"] * 8),
        kml.InvalidMeshError,
        ("No device is named 'tpu:0'", "The devices are cpu:0", "keras.distribution.list_devices()"),
    ),
    Case(  # regression: accepted, then `fit` failed on a bare AssertionError inside JAX
        "repeated-device",
        lambda: kml.Mesh(data=2, model=4, devices=[jax.devices()[0]] * 8),
        kml.InvalidMeshError,
        ("is given twice, at positions 0 and 1 of the 8 devices", "a mesh holds each device once"),
    ),
    Case(
        "repeated-device-name",
        lambda: kml.Mesh((2,), ["data"], ["cpu:1", "cpu:1"]),
        kml.InvalidMeshError,
        ("is given twice",),
    ),
    Case(
        "device-of-another-type",
        lambda: kml.Mesh(data=1, devices=[3]),
        kml.InvalidMeshError,
        ("JAX devices or names such as 'cpu:0'", "Received: 3"),
    ),
]


@pytest.mark.parametrize("case", MESH_CASES, ids=lambda case: case.id)
def test_bad_mesh(case: Case):
    raises_case(case)


RULE_CASES = [
    Case(
        "invalid-regex",
        lambda: kml.LayoutRules([(r".*dense/kernel", (None, "model")), ("[unclosed", ("model",))]),
        kml.InvalidRuleError,
        (
            "rule #1",
            "'[unclosed'",
            "not a valid regular expression",
            "unterminated character set",
            "Fix the pattern",
            "escape it with a backslash",
        ),
    ),
    Case(
        "empty-pattern",
        lambda: kml.LayoutRules([("", ("model",))]),
        kml.InvalidRuleError,
        ("rule #0", "non-empty regex string", "pattern=''"),
    ),
    Case(
        "pattern-not-a-string",
        lambda: kml.LayoutRules([(3, ("model",))]),
        kml.InvalidRuleError,
        ("rule #0", "non-empty regex string", "pattern=3"),
    ),
    Case(
        "layout-is-a-string",
        lambda: kml.LayoutRules([(r".*dense/bias", "model")]),
        kml.InvalidRuleError,
        ("rule #0", "'.*dense/bias'", "needs a tuple of axes", "axes='model'", "e.g. (None, 'model')"),
    ),
    Case(
        "layout-is-none",
        lambda: kml.LayoutRules([(r".*dense/bias", None)]),
        kml.InvalidRuleError,
        ("rule #0", "'.*dense/bias'", "needs a tuple of axes", "axes=None"),
    ),
    Case(
        "layout-from-mapping-is-a-string",
        lambda: kml.LayoutRules({r".*dense/kernel": (None, "model"), r".*dense/bias": "model"}),
        kml.InvalidRuleError,
        ("rule #1", "'.*dense/bias'", "needs a tuple of axes", "axes='model'"),
    ),
    Case(
        "entry-is-an-int",
        lambda: kml.LayoutRules([(r".*dense/kernel", (None, 4))]),
        kml.InvalidRuleError,
        ("rule #0", "'.*dense/kernel'", "entry 4", "(None, 4)", "a mesh-axis name (a string), None"),
    ),
    Case(
        "axis-used-twice",
        lambda: kml.LayoutRules([(r".*dense/kernel", ("model", "model"))]),
        kml.InvalidRuleError,
        (
            "rule #0",
            "'.*dense/kernel'",
            "mesh axis 'model' on more than one dimension",
            "('model', 'model')",
            "Fix: keep 'model' on one dimension",
        ),
    ),
    Case(
        "repeated-pattern",
        lambda: kml.LayoutRules([(r".*/kernel", (None, "model")), (r".*/kernel", ("model", None))]),
        kml.InvalidRuleError,
        ("rule #1", "repeats the pattern '.*/kernel' of rule #0", "could never apply", "Remove one of them"),
    ),
    Case(
        "rule-not-a-pair",
        lambda: kml.LayoutRules([(r".*/kernel",)]),
        kml.InvalidRuleError,
        ("(pattern, axes) pair", "Received: ('.*/kernel',)", "e.g. (r'.*dense_1/kernel', (None, 'model'))"),
    ),
    Case(
        "rule-is-a-quadruple",
        lambda: kml.LayoutRules([(r".*/kernel", (None, "model"), "note", "extra")]),
        kml.InvalidRuleError,
        ("(pattern, axes) pair", "Received: ('.*/kernel', (None, 'model'), 'note', 'extra')"),
    ),
    Case(
        "note-is-not-a-string",
        lambda: kml.LayoutRules([(r".*/kernel", (None, "model"), 3)]),
        kml.InvalidRuleError,
        ("rule #0", "the note must be a string", "Received: 3"),
    ),
    Case(
        "two-ellipses",
        lambda: kml.LayoutRules([(r".*/kernel", (..., "model", ...))]),
        kml.InvalidRuleError,
        ("rule #0", "more than one '...'"),
    ),
    Case(
        "ellipsis-in-plain-keras",
        lambda: kml.LayoutRules([(r".*/kernel", (..., "model"))], mesh=mesh("data=2,model=4"))["d/kernel"],
        kml.InvalidRuleError,
        ("uses '...'", "needs the variable's rank", "kml.ModelParallel"),
    ),
    Case(
        "rule-is-a-string",
        lambda: kml.LayoutRules([r".*/kernel"]),
        kml.InvalidRuleError,
        ("(pattern, axes) pair", "Received: '.*/kernel'"),
    ),
    Case(
        "unknown-axis-in-model-parallel",
        lambda: kml.ModelParallel(mesh("data=2,model=4"), [(r".*/kernel", (None, "expert"))]),
        kml.InvalidRuleError,
        (
            "rule #0 '.*/kernel' -> (None, 'expert')",
            "names mesh axis 'expert'",
            "('data', 'model')",
            "(shape (2, 4))",
            "Fix: use one of ('data', 'model') or None",
        ),
    ),
    Case(
        "unknown-axis-in-later-rule",
        lambda: kml.ModelParallel(
            mesh("data=2,model=4"),
            kml.LayoutRules([(r".*/kernel", (None, "model")), (r".*/bias", ("tensor",))]),
        ),
        kml.InvalidRuleError,
        ("rule #1 '.*/bias' -> ('tensor',)", "names mesh axis 'tensor'", "('data', 'model')", "Fix"),
    ),
    Case(
        "unknown-axis-with-mesh-kwarg",
        lambda: kml.LayoutRules([(r".*/kernel", ("expert", None))], mesh=mesh("data=2,model=4")),
        kml.InvalidRuleError,
        (
            "rule #0 '.*/kernel' -> ('expert', None)",
            "names mesh axis 'expert'",
            "('data', 'model')",
            "(shape (2, 4))",
            "Fix",
        ),
    ),
    Case(
        "unknown-axis-added-to-bound-rules",
        lambda: kml.LayoutRules([(r".*/kernel", (None, "model"))], mesh=mesh("data=2,model=4")).__setitem__(
            r".*/bias", ("expert",)
        ),
        kml.InvalidRuleError,
        ("rule #1 '.*/bias' -> ('expert',)", "names mesh axis 'expert'", "Fix"),
    ),
    Case(
        "rules-bound-to-another-mesh",
        lambda: kml.ModelParallel(
            mesh("data=4,model=2"),
            kml.LayoutRules([(r".*/kernel", (None, "model"))], mesh=mesh("data=2,model=4")),
        ),
        kml.InvalidRuleError,
        (
            "bound to Mesh(data=2, model=4)",
            "cannot be used with Mesh(data=4, model=2)",
            "Fix: build the rules without mesh=",
        ),
    ),
    Case(
        "rules-bind-to-another-mesh",
        lambda: kml.LayoutRules([(r".*/kernel", (None, "model"))], mesh=mesh("data=2,model=4")).bind(
            mesh("8")
        ),
        kml.InvalidRuleError,
        ("bound to Mesh(data=2, model=4)", "cannot be used with Mesh(data=8)", "Fix"),
    ),
    Case(
        "rules-not-pairs",
        lambda: kml.ModelParallel(mesh("data=2,model=4"), "kernel"),
        kml.InvalidRuleError,
        (
            "kml.LayoutRules, a keras.distribution.LayoutMap or a list of (pattern, axes) pairs",
            "Received: 'kernel'",
        ),
    ),
    Case(
        "unbound-rules-handed-to-keras",
        lambda: keras.distribution.ModelParallel(
            layout_map=kml.LayoutRules([(r".*/kernel", (None, "model"))]), batch_dim_name="data"
        ),
        kml.InvalidRuleError,
        ("not bound to a mesh", "Fix: pass them to kml.ModelParallel(mesh, rules)", "rules.bind(mesh)"),
    ),
    Case(
        "output-ellipsis-first",
        lambda: kml.LayoutRules([(r"mlp/d/output", (..., "model"))]),
        kml.InvalidRuleError,
        (
            "rule #0 'mlp/d/output' -> (Ellipsis, 'model')",
            "Keras asks for an output's layout by path alone",
            "Fix: spell out one entry per dimension",
            "('data', ...)",
        ),
    ),
    Case(
        "tensor-layout-on-another-mesh",
        lambda: kml.LayoutRules(
            [(r".*kernel", keras.distribution.TensorLayout((None, "model"), mesh("data=4,model=2")))],
            mesh=mesh("data=2,model=4"),
        ),
        kml.InvalidRuleError,
        (
            "TensorLayout on Mesh(data=4, model=2)",
            "Mesh(data=2, model=4)",
            "Keras's LayoutMap would keep it",
            "Fix:",
        ),
    ),
    Case(
        "mesh-twice",
        lambda: kml.LayoutRules(mesh("data=2,model=4"), mesh=mesh("data=2,model=4")),
        kml.InvalidRuleError,
        ("The mesh is given twice", "Fix: kml.LayoutRules(mesh)"),
    ),
]


@pytest.mark.parametrize("case", RULE_CASES, ids=lambda case: case.id)
def test_bad_rules(case: Case):
    raises_case(case)


DISTRIBUTION_CASES = [
    Case(
        "batch-axis-not-in-mesh",
        lambda: kml.ModelParallel(mesh("data=2,model=4"), batch_axis="batch"),
        kml.InvalidMeshError,
        (
            "batch_axis='batch'",
            "not an axis of the mesh",
            "('data', 'model')",
            "(shape (2, 4))",
            "Fix: pass one of them",
        ),
    ),
    Case(
        "mesh-is-a-spec-string",
        lambda: kml.ModelParallel("2x4"),
        kml.InvalidMeshError,
        ("needs a mesh", "Received: '2x4'", "kml.Mesh(data=2, model=4)"),
    ),
    Case(
        "mesh-is-a-shape",
        lambda: kml.ModelParallel((2, 4), [(r".*/kernel", (None, "model"))]),
        kml.InvalidMeshError,
        ("needs a mesh", "Received: (2, 4)"),
    ),
    Case(
        "mesh-is-none",
        lambda: kml.ModelParallel(None),
        kml.InvalidMeshError,
        ("needs a mesh", "Received: None"),
    ),
    Case(
        "keras-form-unbound-map",
        lambda: kml.ModelParallel(layout_map=kml.LayoutRules(), batch_dim_name="data"),
        kml.InvalidMeshError,
        ("needs a mesh", "carried by the layout map", "You must specify a layout_map argument"),
    ),
    Case(
        "rules-and-layout-map",
        lambda: kml.ModelParallel(mesh("data=2,model=4"), [], layout_map=kml.LayoutRules()),
        kml.InvalidRuleError,
        ("both rules and layout_map=", "Fix: pass one of them"),
    ),
    Case(
        "batch-axis-and-batch-dim-name",
        lambda: kml.ModelParallel(mesh("data=2,model=4"), batch_axis="data", batch_dim_name="model"),
        kml.InvalidMeshError,
        ("batch_axis='data' and batch_dim_name='model' disagree", "Fix: pass one of them"),
    ),
    Case(
        "batch-dim-name-not-an-axis",
        lambda: kml.ModelParallel(layout_map=kml.LayoutRules(mesh("data=2,model=4")), batch_dim_name="batch"),
        kml.InvalidMeshError,
        ("batch_axis='batch' is not an axis of the mesh", "('data', 'model')"),
    ),
]


@pytest.mark.parametrize("case", DISTRIBUTION_CASES, ids=lambda case: case.id)
def test_bad_distribution(case: Case):
    raises_case(case)


@pytest.mark.parametrize(
    "kwargs, fragments",
    [
        ({"on_indivisible": "ignore"}, ("on_indivisible must be one of ('replicate', 'error')", "'ignore'")),
        ({"policy": "error"}, ("policy must be a kml.LayoutPolicy", "Received: policy='error'")),
        ({"replicate_below": -1}, ("non-negative integer element count", "replicate_below=-1")),
        ({"replicate_below": 1.5}, ("non-negative integer element count", "replicate_below=1.5")),
        ({"replicate_below": True}, ("non-negative integer element count", "replicate_below=True")),
        ({"replicate_below": "4096"}, ("non-negative integer element count", "replicate_below='4096'")),
    ],
    ids=[
        "on-indivisible-unknown",
        "policy-not-a-policy",
        "replicate-below-negative",
        "replicate-below-float",
        "replicate-below-bool",
        "replicate-below-string",
    ],
)
def test_bad_policy_is_an_invalid_option_error(kwargs: dict[str, Any], fragments: tuple[str, ...]):
    with pytest.raises(kml.InvalidOptionError) as info:
        kml.ModelParallel(mesh("data=2,model=4"), **kwargs)
    assert_message(info.value, fragments)


@pytest.mark.parametrize(
    "count, error, fragments",
    [
        (
            4,
            kml.DevicesAlreadyInitializedError,
            (
                "emulate_devices(4)",
                "already started with 8 CPU device(s)",
                "Fix: call kml.emulate_devices()",
                "XLA_FLAGS=--xla_force_host_platform_device_count=4",
            ),
        ),
        (0, kml.InvalidOptionError, ("positive integer device count", "count=0")),
        (2.0, kml.InvalidOptionError, ("positive integer device count", "count=2.0")),
    ],
    ids=["after-backend-started", "zero", "float"],
)
def test_bad_device_emulation(count: Any, error: type[Exception], fragments: tuple[str, ...]):
    with pytest.raises(error) as info:
        kml.emulate_devices(count)
    assert_message(info.value, fragments)


def test_emulating_the_running_count_again_is_harmless():
    """Issue 20: this test asserted nothing. Again with the running count: no error, no change."""
    import os

    import jax

    flags = os.environ.get("XLA_FLAGS")
    assert kml.emulate_devices(8) is None
    assert len(jax.devices("cpu")) == 8
    assert os.environ.get("XLA_FLAGS") == flags  # nothing rewritten once JAX runs
    with pytest.raises(kml.DevicesAlreadyInitializedError):
        kml.emulate_devices(4)  # and a different count is still refused


# -- a real model meets the rules ---------------------------------------------


def build_mlp(
    distribution: kml.ModelParallel, *, features: int = 8, hidden: int = 16, head: int = 8
) -> keras.Model:
    """Builds a tiny `features -> hidden -> head` MLP named `mlp` under `distribution`.

    Its variables are `mlp/hidden/kernel`, `mlp/hidden/bias`, `mlp/head/kernel`
    and `mlp/head/bias`.

    Args:
        distribution: The distribution whose scope the model is built in.
        features: Input features.
        hidden: Units of the `hidden` Dense layer.
        head: Units of the `head` Dense layer.

    Returns:
        The built model.
    """
    with distribution.scope():
        return mlp(features, ("hidden", hidden, "relu"), ("head", head))


class ModelCase(NamedTuple):
    """A model whose variables do not fit its rules.

    Attributes:
        id: Test id.
        mesh: Mesh spec.
        rules: The layout rules.
        sizes: Keyword arguments of `build_mlp`.
        error: The expected error class.
        fragments: Substrings the error message must contain.
    """

    id: str
    mesh: str
    rules: list[tuple[str, tuple[str | None, ...]]]
    sizes: dict[str, int]
    error: type[Exception]
    fragments: tuple[str, ...]


MODEL_CASES = [
    ModelCase(
        "rank-2-rule-matches-bias",
        "data=2,model=4",
        [(r".*hidden.*", (None, "model"))],
        {},
        kml.RankMismatchError,
        (
            "'mlp/hidden/bias'",
            "shape (16,)",
            "(rank 1)",
            "rule #0 '.*hidden.*' -> (None, 'model')",
            "layout of rank 2",
            "Fix: give this rule 1 entry,",
            "end it in '/kernel' or '/bias'",
        ),
    ),
    ModelCase(
        "rank-1-rule-matches-kernel",
        "data=2,model=4",
        [(r".*/bias", ("model",)), (r"mlp/head/.*", ("model",))],
        {},
        kml.RankMismatchError,
        (
            "'mlp/head/kernel'",
            "shape (16, 8)",
            "(rank 2)",
            "rule #1 'mlp/head/.*' -> ('model',)",
            "layout of rank 1",
            "Fix",
        ),
    ),
    ModelCase(
        "output-features-indivisible",
        "data=2,model=4",
        [(r".*/kernel", (None, "model"))],
        {"hidden": 10},
        kml.IndivisibleShapeError,
        (
            "'mlp/hidden/kernel'",
            "shape (8, 10)",
            "rule #0 '.*/kernel' -> (None, 'model')",
            "dimension 1 (size 10)",
            "mesh axis 'model' of size 4",
            "10 is not a multiple of 4",
            "Fix:",
            "on_indivisible='replicate'",
        ),
    ),
    ModelCase(
        "input-features-indivisible",
        "data=4,model=2",
        [(r"mlp/head/kernel", ("data", None))],
        {"hidden": 6},
        kml.IndivisibleShapeError,
        (
            "'mlp/head/kernel'",
            "shape (6, 8)",
            "rule #0 'mlp/head/kernel' -> ('data', None)",
            "dimension 0 (size 6)",
            "mesh axis 'data' of size 4",
            "6 is not a multiple of 4",
            "put None on dimension 0",
        ),
    ),
    ModelCase(
        "indivisible-on-3d-mesh",
        "a=2,b=2,c=2",
        [(r".*hidden/kernel", ("b", "c")), (r".*hidden/bias", ("c",))],
        {"hidden": 7},
        kml.IndivisibleShapeError,
        (
            "'mlp/hidden/kernel'",
            "shape (8, 7)",
            "dimension 1 (size 7)",
            "mesh axis 'c' of size 2",
            "7 is not a multiple of 2",
        ),
    ),
]


@pytest.mark.parametrize("case", MODEL_CASES, ids=lambda case: case.id)
def test_model_does_not_fit_rules(case: ModelCase):
    distribution = kml.ModelParallel(mesh(case.mesh), case.rules, on_indivisible="error", replicate_below=0)
    with pytest.raises(kml.MeshLayoutError) as info:
        build_mlp(distribution, **case.sizes)
    assert type(info.value) is case.error, f"{type(info.value).__name__}: {info.value}"
    assert_message(info.value, case.fragments)


def test_a_model_whose_layers_are_not_built_is_planned_on_a_batch_or_refused():
    """A subclassed model whose `build()` leaves its layers to the first call has no weights to plan."""
    import styles

    model = styles._LazyMLP(name="lazy")  # never built nor called
    with pytest.raises(kml.InvalidOptionError) as info:
        kml.auto_rules(model, mesh("data=2,model=4"))
    assert_message(info.value, ("5 layer(s) of model 'lazy' are not built", "'up1'", "pass batch=x"))
    assert not model.weights  # nothing was made
    x = np.zeros((8, styles.FEATURES), "float32")
    rules = kml.auto_rules(model, mesh("data=2,model=4"), batch=x, replicate_below=0)
    assert len(model.weights) == 10 and all(rules.match(v.path) for v in model.weights)
    assert rules.match("lazy/up1/kernel").axes == (None, "model")


def test_the_plan_of_a_model_whose_layers_are_not_built_says_so():
    import styles

    dist = kml.ModelParallel(mesh("data=2,model=4"), [(r".*up1/kernel", (None, "model"))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not kml.dry_plan(styles.mlp_subclassed_lazy, dist).entries
    said = [str(w.message) for w in caught if w.category is kml.MeshLayoutWarning]
    assert said and "5 layer(s) of model 'subclassed_lazy' are not built yet ('up1'" in said[0], said

    def called() -> keras.Model:
        model = styles.mlp_subclassed_lazy()
        model(np.zeros((2, styles.FEATURES), "float32"))
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kml.dry_plan(called, dist)["subclassed_lazy/up1/kernel"].axes == (None, "model")


@pytest.mark.parametrize(
    ("style", "batch", "said"),
    [
        ("subclassed_lazy", "x, y", "batch ((8, 16), (8,))"),
        ("functional_layers", "wrong features", "batch (8, 17)"),
    ],
)
def test_a_batch_the_model_cannot_be_called_on_is_one_clear_error(style: str, batch: str, said: str):
    """Not JAX's traceback from deep inside the trace: what was given, and that batch= is x alone."""
    import styles

    x, y = np.zeros((8, styles.FEATURES), "float32"), np.zeros(8, "int32")
    given = (x, y) if batch == "x, y" else np.zeros((8, styles.FEATURES + 1), "float32")
    with pytest.raises(kml.InvalidOptionError) as info:
        kml.auto_rules(styles.MLPS[style](), mesh("data=2,model=4"), batch=given)
    assert_message(info.value, ("could not be called on what was given", said, "x, not (x, y)", "Fix"))


def test_a_batch_that_does_not_split_over_the_batch_axis_is_refused_before_planning():
    """As `fit` would refuse it, not a plan for a batch that cannot run."""
    import styles

    x = np.zeros((15, styles.FEATURES), "float32")
    with pytest.raises(kml.IndivisibleBatchError) as info:
        kml.auto_rules(styles.mlp_sequential(), mesh("data=2,model=4"), memory_budget="1GB", batch=x)
    assert_message(info.value, ("a batch of 15 samples", "batch axis 'data' of size 2", "Fix"))


def test_a_target_the_loss_cannot_take_is_one_clear_error_from_compile_step():
    def build() -> keras.Model:
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, name="d")], name="m")

    x, y = np.zeros((32, 16), "float32"), np.zeros((32, 9), "float32")
    with pytest.raises(kml.InvalidOptionError) as info:
        kml.compile_step(build, kml.ModelParallel(mesh("data=2,model=4"), []), x, y)
    assert_message(info.value, ("Model 'm'", "x (32, 16), y (32, 9)", "(32, 9), (32, 8)", "Fix: x and y"))


def _mlp() -> keras.Model:
    return mlp(16, ("up", 64, "relu"), ("down", 16))


def _compiled_mlp() -> keras.Model:
    model = _mlp()
    model.compile(optimizer="sgd", loss="mse")
    return model


def _planned(**kwargs: Any) -> Callable[[], Any]:
    """`auto_rules` of a small MLP on data=2 × model=4 with `kwargs` (`model=`/`mesh=` replace them)."""

    def make() -> Any:
        given = dict(kwargs)
        model = given.pop("model", None) or _mlp()
        return kml.auto_rules(model, given.pop("mesh", mesh("data=2,model=4")), **given)

    return make


#: Arguments of the planner and the compiled step that are not what they must be: refused before
#: any tracing, naming what was given (a typo'd batch axis had planned with no data parallelism).
ARGUMENT_CASES = [
    Case("batch-axis-typo", _planned(batch_axis="dta"), kml.InvalidMeshError,
         ("batch_axis='dta' is not an axis", "('data', 'model')", "Did you mean 'data'?", "Fix")),
    Case("batch-axis-is-the-model-axis", _planned(batch_axis="model"), kml.InvalidMeshError,
         ("batch_axis and model_axis are both 'model'", "Fix")),
    Case("model-axis-typo", _planned(model_axis="modle"), kml.InvalidRuleError,
         ("model_axis='modle'", "Did you mean 'model'?", "Fix")),
    Case("mesh-as-text", _planned(mesh="2x4"), kml.InvalidMeshError,
         ("received str '2x4'", "kml.Mesh.parse('2x4')")),
    Case("a-builder-not-a-model", _planned(model=_mlp), kml.InvalidOptionError,
         ("received function", "kml.dry_build(fn)")),
    Case("optimizer-not-a-name", _planned(optimizer=3, batch=np.zeros((8, 16), "float32")),
         kml.InvalidOptionError, ("received int 3", "optimizer='adam'")),
    Case("loss-typo",
         lambda: kml.compile_step(_mlp, kml.ModelParallel(mesh("data=2,model=4"), []), np.zeros((8, 16)),
                                  np.zeros((8, 16)), loss="crossentropyy"),
         kml.InvalidOptionError, ("no loss named 'crossentropyy'", "sparse_categorical_crossentropy", "Fix")),
    Case("comm-report-of-an-uncompiled-model",
         lambda: kml.comm_report(_mlp(), np.zeros((8, 16), "float32")), kml.InvalidOptionError,
         ("is not compiled", "model.compile(", "kml.compile_step")),
    Case("comm-report-without-targets",
         lambda: kml.comm_report(_compiled_mlp(), np.zeros((8, 16), "float32")), kml.InvalidOptionError,
         ("compiled with loss='mse', which needs targets", "comm_report(model, x, y)")),
]  # fmt: skip


@pytest.mark.parametrize("case", ARGUMENT_CASES, ids=lambda case: case.id)
def test_bad_planner_arguments(case: Case):
    raises_case(case)


@pytest.mark.parametrize(
    ("size", "said"),
    [
        ("-1GB", "(a memory size is positive)"),
        ("0", "(a memory size is positive)"),
        (0, "not a whole, positive number of bytes"),
        (1.5, '("1.5GB" or "1.5GiB", if that is what you meant)'),
        ("lots", 'e.g. "80GB"'),
    ],
)
def test_a_memory_size_that_is_no_positive_number_of_bytes_is_refused(size: Any, said: str):
    """Not silently 1 byte (a float) or a negative budget that no plan meets."""
    import styles

    with pytest.raises(kml.InvalidOptionError) as info:
        kml.auto_rules(
            styles.mlp_sequential(), mesh("data=2,model=4"), memory_budget=size, batch=np.zeros((8, 16))
        )
    assert said in str(info.value)


def test_a_plan_without_a_budget_does_not_say_a_budget_allowed_a_weight_whole():
    """Its notes do not speak of a budget it was not given."""
    import styles

    x = np.zeros((64, styles.FEATURES), "float32")
    rules = kml.auto_rules(styles.mlp_functional_layers(), mesh("data=2,model=4"), batch=x, replicate_below=0)
    notes = [rule.note for rule in rules.rules if rule.note.startswith("replicated:")]
    said = "replicated: no memory budget asks for it; splitting"
    assert notes and all(note.startswith(said) for note in notes), notes
    budgeted = kml.auto_rules(
        styles.mlp_functional_layers(),
        mesh("data=2,model=4"),
        batch=x,
        replicate_below=0,
        memory_budget="1GB",
    )
    assert any(rule.note.startswith("replicated: the budget allows it") for rule in budgeted.rules)


@pytest.mark.parametrize("optimizer", ["muon", "adam"])
def test_planning_for_muon_warns_that_the_peak_of_its_update_of_split_kernels_is_estimated(optimizer: str):
    import styles

    x = np.zeros((16, styles.FEATURES), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kml.auto_rules(
            styles.mlp_functional_layers(),
            mesh("data=2,model=4"),
            batch=x,
            optimizer=optimizer,
            replicate_below=0,
        )
    said = [str(w.message) for w in caught if issubclass(w.category, kml.MeshLayoutWarning)]
    if optimizer == "muon":
        assert len(said) == 1 and "Muon orthogonalises each matrix's update whole" in said[0], said
        assert "rules.cost.peak_bytes only estimates" in said[0], said
    else:
        assert not said, said


def _unnamed_mlp() -> keras.Model:
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(32), keras.layers.Dense(8)])


def test_rules_of_a_model_built_again_say_that_keras_renumbered_its_layers():
    """Rules planned on one build miss a second build's new numbers: the warning says so and the fix."""
    grid = mesh("data=2,model=4")
    rules = kml.auto_rules(_unnamed_mlp(), grid, replicate_below=0)
    dist = kml.ModelParallel(grid, rules, replicate_below=0)
    with dist.scope():
        model = _unnamed_mlp()
    with pytest.warns(kml.UnmatchedRuleWarning) as caught:
        dist.plan(model)
    message = str(caught[0].message)
    for fragment in ("matched no variable", "built again", "name the layers", "kml.dry_build(build)"):
        assert fragment in message, message
    with kml.dry_build(_unnamed_mlp) as probe:  # hands Keras's names back: the next build matches
        rules = kml.auto_rules(probe, grid, replicate_below=0)
    dist = kml.ModelParallel(grid, rules, replicate_below=0)
    with dist.scope():
        model = _unnamed_mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("error", kml.UnmatchedRuleWarning)
        dist.plan(model)
    assert model.weights[0].value.sharding.spec == PartitionSpec(None, "model")


def test_rank_mismatch_is_an_error_under_the_replicate_policy_too():
    distribution = kml.ModelParallel(
        mesh("data=2,model=4"), [(r".*hidden.*", (None, "model"))], replicate_below=0
    )
    with pytest.raises(kml.RankMismatchError, match=r"'mlp/hidden/bias'"):
        build_mlp(distribution)


def test_indivisible_dimension_is_replicated_with_a_warning():
    distribution = kml.ModelParallel(
        mesh("data=2,model=4"), [(r".*/kernel", (None, "model"))], replicate_below=0
    )
    with pytest.warns(kml.IndivisibleShapeWarning) as record:
        model = build_mlp(distribution, hidden=16, head=10)

    assert len(record) == 1, [str(w.message) for w in record]
    assert_message(
        record[0].message,
        (
            "'mlp/head/kernel'",
            "(shape (16, 10))",
            "replicated on dimension 1",
            "size 10",
            "mesh axis 'model' of size 4",
            "rule #0 '.*/kernel' -> (None, 'model')",
            "costs 4x the memory",
            "on_indivisible='error'",
        ),
    )

    plan = distribution.plan(model)
    head = plan["mlp/head/kernel"]
    assert head.requested == (None, "model")
    assert head.axes == (None, None)
    assert head.shards == 1
    assert head.reasons == ("dimension 1 (size 10) does not divide by mesh axis 'model' (size 4)",)
    (recorded,) = [entry for entry in plan.to_dict()["variables"] if entry["path"] == "mlp/head/kernel"]
    assert recorded["reasons"] == list(head.reasons)
    assert recorded["axes"] == [None, None]
    # The divisible kernel next to it is still split.
    assert plan["mlp/hidden/kernel"].axes == (None, "model")
    assert plan["mlp/hidden/kernel"].shards == 4

    variables = {variable.path: variable for variable in model.weights}
    assert variables["mlp/head/kernel"].value.sharding.spec == PartitionSpec(None, None)
    assert variables["mlp/hidden/kernel"].value.sharding.spec == PartitionSpec(None, "model")
    assert variables["mlp/head/kernel"].value.sharding.shard_shape((16, 10)) == (16, 10)


# -- a batch that does not split ----------------------------------------------


@pytest.mark.parametrize(
    "spec, batch_axis, batch_size, fragments",
    [
        (
            "data=4,model=2",
            None,
            6,
            (
                "A batch of 6 samples",
                "batch axis 'data' of size 4",
                "6 is not a multiple of 4",
                "Fix: use a batch_size that is a multiple of 4",
            ),
        ),
        (
            "data=2,model=4",
            "data",
            5,
            ("A batch of 5 samples", "batch axis 'data' of size 2", "5 is not a multiple of 2", "Fix"),
        ),
        (
            "data=2,model=4",
            "model",
            6,
            ("A batch of 6 samples", "batch axis 'model' of size 4", "6 is not a multiple of 4", "Fix"),
        ),
    ],
    ids=["batch-6-on-data-4", "batch-5-on-data-2", "batch-6-on-model-4"],
)
def test_fit_rejects_indivisible_batch_before_training(
    spec: str, batch_axis: str | None, batch_size: int, fragments: tuple[str, ...]
):
    distribution = kml.ModelParallel(
        mesh(spec), [(r".*hidden/kernel", (None, "model"))], batch_axis=batch_axis, replicate_below=0
    )
    model = build_mlp(distribution)
    with distribution.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = {variable.path: np.array(variable.value) for variable in model.weights}
    x = np.ones((batch_size * 2, 8), "float32")
    y = np.ones((batch_size * 2, 8), "float32")

    with distribution.scope(), pytest.raises(kml.IndivisibleBatchError) as info:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    assert_message(info.value, (*fragments, f"input shape ({batch_size}, 8)"))

    # Nothing the user had is lost: no step ran, and the weights are untouched.
    assert int(model.optimizer.iterations.numpy()) == 0
    for variable in model.weights:
        np.testing.assert_array_equal(np.array(variable.value), before[variable.path], err_msg=variable.path)


@pytest.mark.parametrize(
    "samples, batch_size, short",
    [(10, 8, 2), (14, 4, 2)],
    ids=["10-samples-batch-8", "14-samples-batch-4"],
)
def test_fit_rejects_a_short_last_batch_that_does_not_split(samples: int, batch_size: int, short: int):
    # Keras derives the input sharding from the first batch only: the short last
    # batch must still get an IndivisibleBatchError, not a raw JAX error.
    distribution = kml.ModelParallel(mesh("data=4,model=2"), [(r".*hidden/kernel", (None, "model"))])
    model = build_mlp(distribution)
    with distribution.scope():
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.ones((samples, 8), "float32")
    y = np.ones((samples, 8), "float32")

    with distribution.scope(), pytest.raises(kml.IndivisibleBatchError) as info:
        model.fit(x, y, batch_size=batch_size, epochs=1, verbose=0)
    assert_message(
        info.value,
        (
            f"A batch of {short} samples",
            f"input shape ({short}, 8)",
            "batch axis 'data' of size 4",
            f"{short} is not a multiple of 4",
            "short last batch",
            "make the number of samples a multiple of the batch size",
        ),
    )


# -- the error hierarchy --------------------------------------------------------

ERRORS = [
    kml.MemoryBudgetError,
    kml.CheckpointError,
    kml.InvalidOptionError,
    kml.InvalidMeshError,
    kml.InvalidTargetError,
    kml.MissingLibtpuError,
    kml.InvalidRuleError,
    kml.RankMismatchError,
    kml.IndivisibleShapeError,
    kml.IndivisibleBatchError,
    kml.UnsupportedBackendError,
    kml.DevicesAlreadyInitializedError,
    kml.HloFormatError,
    kml.LayoutMismatchError,
]

WARNINGS = [
    kml.LayoutMismatchWarning,
    kml.IndivisibleShapeWarning,
    kml.UnmatchedRuleWarning,
    kml.ProcessSplitWarning,
    kml.GroupedConvWarning,
]


@pytest.mark.parametrize("error", ERRORS, ids=lambda error: error.__name__)
def test_every_error_is_a_mesh_layout_error_and_a_value_error(error: type[Exception]):
    assert issubclass(error, kml.MeshLayoutError)
    assert issubclass(error, ValueError)
    assert issubclass(kml.MeshLayoutError, ValueError)


@pytest.mark.parametrize("warning", WARNINGS, ids=lambda warning: warning.__name__)
def test_every_warning_is_a_mesh_layout_warning(warning: type[Warning]):
    assert issubclass(warning, kml.MeshLayoutWarning)
    assert issubclass(warning, UserWarning)


def test_the_tables_cover_every_exported_error_and_warning():
    exported = {getattr(kml, name) for name in kml.__all__}
    errors = {item for item in exported if isinstance(item, type) and issubclass(item, BaseException)}
    assert errors == {*ERRORS, *WARNINGS, kml.MeshLayoutError, kml.MeshLayoutWarning}


def test_a_rules_json_nested_3000_deep_is_one_clear_line(tmp_path, capsys):
    """Issue 22: a raw RecursionError line before; now what is wrong and what a rules file looks like."""
    from keras_meshlayout.cli._main import main

    deep = tmp_path / "deep.json"
    deep.write_text("[" * 3000 + "]" * 3000)
    models = tmp_path / "deep_models.py"
    models.write_text(
        "import keras\n\ndef mlp():\n"
        "    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])\n"
    )
    status = main(["plan", "--mesh", "8", "--model", f"{models}:mlp", "--rules", str(deep)])
    err = capsys.readouterr().err
    assert status == 2
    assert f"--rules {deep} nests its JSON too deeply to read" in err
    assert "[pattern, axes] pairs" in err and "RecursionError" not in err
    assert len(err.strip().splitlines()) == 1
