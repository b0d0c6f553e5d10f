"""Properties of layout resolution over random meshes, shapes and rules.

Whatever the mesh (any shape of the 8 emulated devices), the variable shape and
the rules, resolving a layout either raises a `kml.MeshLayoutError` or gives a
layout that JAX accepts, with the shard shape and byte counts it claims. An
independent model of the documented resolution order says which of the two
happens, and which layout or error it is. And the first matching rule wins.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml

#: Every way of laying 8 devices on 1, 2 or 3 axes.
MESH_SHAPES = [
    (8,),
    (1, 8),
    (2, 4),
    (4, 2),
    (8, 1),
    (2, 2, 2),
    (1, 2, 4),
    (1, 4, 2),
    (2, 1, 4),
    (2, 4, 1),
    (4, 1, 2),
    (4, 2, 1),
    (1, 1, 8),
    (1, 8, 1),
    (8, 1, 1),
]
AXIS_NAMES = ("a", "b", "c")
#: Layout entries: the mesh axes, an axis no mesh has, and None.
LAYOUT_ENTRIES = ["a", "b", "c", "z", None]

PATHS = [
    "net/dense/kernel",
    "net/dense/bias",
    "net/attn/query/kernel",
    "net/attn/query/bias",
    "net/embed/embeddings",
    "net/dense/output",
]
#: Patterns that overlap on the paths above, and some that match none of them.
PATTERNS = [
    r".*",
    r".*kernel",
    r".*/bias",
    r"net/dense/.*",
    r"net/attn/.*",
    r".*embed.*",
    r"net/.*/kernel",
    r"net/(dense|attn/query)/bias",
    r".*/output",
    r"net/dense/output",
    r".*/query/.*",
    r"net/dense",
    r"kernel",
]

#: True four times in five.
MOSTLY = st.sampled_from([True, True, True, True, False])

#: Element budget of one generated variable, so each `device_put` stays cheap.
MAX_ELEMENTS = 1 << 15

_MESHES: dict[tuple[int, ...], kml.Mesh] = {}


def mesh_for(shape: tuple[int, ...]) -> kml.Mesh:
    """Returns the mesh of this shape on axes `a`, `b`, `c`, built once.

    Args:
        shape: Axis sizes, multiplying to 8.
    """
    if shape not in _MESHES:
        _MESHES[shape] = kml.Mesh(dict(zip(AXIS_NAMES[: len(shape)], shape, strict=True)))
    return _MESHES[shape]


@st.composite
def variable_shapes(draw: st.DrawFn, rank: int | None = None) -> tuple[int, ...]:
    """Draws a shape with dimensions 1 to 64 and at most `MAX_ELEMENTS` elements.

    Dimensions favour powers of two so that many of them divide the mesh axes.

    Args:
        draw: Hypothesis's draw function.
        rank: The rank; drawn from 0 to 4 when `None`.
    """
    if rank is None:
        rank = draw(st.integers(0, 4))
    budget = MAX_ELEMENTS
    shape = []
    for _ in range(rank):
        dim = draw(st.one_of(st.sampled_from([1, 2, 4, 8, 16, 32, 64]), st.integers(1, 64)))
        dim = min(dim, budget)
        budget //= dim
        shape.append(dim)
    return tuple(shape)


def repeats_an_axis(axes: tuple) -> bool:
    """Whether `axes` names one mesh axis on more than one dimension.

    Args:
        axes: A layout.
    """
    named = [axis for axis in axes if axis is not None]
    return len(set(named)) < len(named)


def fitting_layouts(axis_names: tuple[str, ...]) -> st.SearchStrategy[tuple]:
    """Layouts of rank 1 to 4 on `axis_names`, none repeated.

    Args:
        axis_names: The mesh axes.
    """
    entries = [*axis_names, None, None][: len(axis_names) + 1]
    return st.tuples(st.permutations(entries), st.integers(1, 4)).map(
        lambda drawn: tuple(drawn[0][: drawn[1]])
    )


#: Any layout: unknown axes (`z`), axes a 1-D or 2-D mesh lacks (`c`), repeated axes.
any_layouts = st.lists(st.sampled_from(LAYOUT_ENTRIES), max_size=4).map(tuple)


def rule_lists(axis_names: tuple[str, ...]) -> st.SearchStrategy[list[tuple[str, tuple]]]:
    """Up to 4 rules; mostly valid on `axis_names`, sometimes malformed or repeated.

    Args:
        axis_names: The mesh axes.
    """
    fitting = fitting_layouts(axis_names)
    layout = st.integers(0, 9).flatmap(lambda n: any_layouts if n == 0 else fitting)
    rule = st.tuples(st.sampled_from(PATTERNS), layout)
    return st.one_of(
        st.lists(rule, min_size=1, max_size=4, unique_by=lambda r: r[0]), st.lists(rule, max_size=4)
    )


def first_match(rules: list[tuple[str, tuple]], path: str) -> int | None:
    """The index of the rule that should apply to `path`, by the documented semantics.

    Patterns are matched with `re.fullmatch`; paths ending in `/output` only
    match patterns ending in `/output`, and other paths only other patterns. A
    pattern equal to the path (an exact key, as in Keras's `LayoutMap`) wins first.

    Args:
        rules: `(pattern, axes)` pairs in priority order.
        path: The variable path.
    """
    for index, (pattern, _) in enumerate(rules):
        if pattern == path:
            return index
    for index, (pattern, _) in enumerate(rules):
        if pattern.endswith("/output") == path.endswith("/output") and re.fullmatch(pattern, path):
            return index
    return None


def expected_outcome(
    rules: list[tuple[str, tuple]],
    axis_sizes: dict[str, int],
    path: str,
    shape: tuple[int, ...],
    on_indivisible: str,
    replicate_below: int,
    suggested: bool = False,
) -> type[kml.MeshLayoutError] | tuple:
    """What resolving should give: an error class, or the final axes.

    A model of the documented order: malformed rules, then axes the mesh lacks
    (any rule), then the first match's rank, the small-variable threshold and
    divisibility.

    Args:
        rules: `(pattern, axes)` pairs in priority order.
        axis_sizes: Mesh axis sizes by name.
        path: The variable path.
        shape: The variable shape.
        on_indivisible: `"replicate"` or `"error"`.
        replicate_below: The small-variable threshold (for suggested rules only).
        suggested: Whether the rules are suggested (a preset's or the planner's).
    """
    patterns = [pattern for pattern, _ in rules]
    if len(set(patterns)) < len(patterns):
        return kml.InvalidRuleError
    if any(repeats_an_axis(axes) for _, axes in rules):
        return kml.InvalidRuleError
    if any(axis not in axis_sizes for _, axes in rules for axis in axes if axis is not None):
        return kml.InvalidRuleError
    index = first_match(rules, path)
    replicated = (None,) * len(shape)
    if index is None or not shape:  # scalars have nothing to split
        return replicated
    requested = rules[index][1]
    if len(requested) != len(shape):
        return kml.RankMismatchError
    if all(axis is None for axis in requested):
        return requested
    small = len(shape) >= 2 and not path.endswith("/bias") and math.prod(shape) < replicate_below
    if small and suggested:
        return replicated
    final = []
    for dim, axis in zip(shape, requested, strict=True):
        if axis is not None and dim % axis_sizes[axis]:
            if on_indivisible == "error":
                return kml.IndivisibleShapeError
            axis = None
        final.append(axis)
    return tuple(final)


@settings(max_examples=200, deadline=None)
@given(
    mesh_shape=st.sampled_from(MESH_SHAPES),
    on_indivisible=st.sampled_from(["replicate", "error"]),
    replicate_below=st.one_of(st.just(0), st.integers(0, 2048), st.just(kml.DEFAULT_REPLICATE_BELOW)),
    data=st.data(),
)
def test_resolution_is_an_error_or_a_layout_jax_accepts(
    mesh_shape: tuple[int, ...],
    on_indivisible: str,
    replicate_below: int,
    data: st.DataObject,
):
    mesh = mesh_for(mesh_shape)
    axis_sizes = dict(zip(AXIS_NAMES[: len(mesh_shape)], mesh_shape, strict=True))
    rules = data.draw(rule_lists(tuple(axis_sizes)), label="rules")
    # Mostly take a path some rule matches, and give the variable the rank of
    # that rule, so that resolution gets past the rank check; sometimes any.
    matched = [path for path in PATHS if first_match(rules, path) is not None]
    if matched and data.draw(MOSTLY, label="matched path"):
        path = data.draw(st.sampled_from(matched), label="path")
    else:
        path = data.draw(st.sampled_from(PATHS), label="path")
    index = first_match(rules, path)
    same_rank = index is not None and data.draw(MOSTLY, label="same rank")
    shape = data.draw(variable_shapes(len(rules[index][1]) if same_rank else None), label="shape")
    suggested = data.draw(st.booleans(), label="suggested")
    expected = expected_outcome(rules, axis_sizes, path, shape, on_indivisible, replicate_below, suggested)
    try:
        layout_rules = kml.LayoutRules(rules, suggested=suggested)
        distribution = kml.ModelParallel(
            mesh, layout_rules, on_indivisible=on_indivisible, replicate_below=replicate_below
        )
        res = distribution.resolve(path, shape, "float32", warn=False)
    except kml.MeshLayoutError as error:
        event(f"raised {type(error).__name__}")
        assert type(error) is expected, f"raised {type(error).__name__}: {error}; expected {expected!r}"
        return

    assert not isinstance(expected, type), f"expected {expected.__name__}, got {res}"
    if res.rule is None:
        event("no rule matched")
    else:
        event(f"split {res.shards} ways" if res.shards > 1 else "replicated")
    if res.reasons:
        event("kept whole: small" if res.reasons[0].startswith("small") else "kept whole: indivisible")
    assert res.axes == expected
    assert len(res.axes) == len(shape)
    assert res.path == path and res.shape == shape and res.dtype == "float32"
    assert (res.rule is None) == (index is None)
    if index is not None:
        assert res.rule.index == index
        assert res.requested == tuple(rules[index][1])
        # Every change from the request is explained (and a user's rule splitting a small matrix).
        assert bool(res.reasons) >= (res.axes != res.requested)

    sharding = NamedSharding(mesh.backend_mesh, PartitionSpec(*res.axes))
    array = jax.device_put(np.zeros(shape, np.float32), sharding)
    shard_shape = tuple(
        dim if axis is None else dim // axis_sizes[axis] for dim, axis in zip(shape, res.axes, strict=True)
    )
    assert array.sharding.shard_shape(shape) == shard_shape
    assert {shard.data.shape for shard in array.addressable_shards} == {shard_shape}
    assert res.shards == math.prod(axis_sizes[axis] for axis in res.axes if axis is not None)
    assert res.nbytes == math.prod(shape) * 4
    assert res.bytes_per_device * res.shards == res.nbytes
    assert res.bytes_per_device == math.prod(shard_shape) * 4


@settings(max_examples=200, deadline=None)
@given(
    patterns=st.lists(st.sampled_from(PATTERNS), min_size=2, max_size=4, unique=True),
    path=st.one_of(
        st.sampled_from(PATHS),
        st.lists(
            st.sampled_from(["net", "dense", "attn", "query", "kernel", "bias", "output"]),
            min_size=1,
            max_size=4,
        ).map("/".join),
    ),
    data=st.data(),
)
def test_first_matching_rule_wins(patterns: list[str], path: str, data: st.DataObject):
    rules = [(pattern, data.draw(fitting_layouts(AXIS_NAMES))) for pattern in patterns]
    layout_rules = kml.LayoutRules(rules)
    expected = first_match(rules, path)

    rule = layout_rules.match(path)
    if expected is None:
        assert rule is None
        assert layout_rules[path] is None
        return
    assert rule is not None
    assert rule.index == expected
    assert rule.pattern == patterns[expected]
    assert re.fullmatch(rule.pattern, path)
    assert rule.axes == tuple(rules[expected][1])
    assert (
        rule.pattern == path
        or not any(  # an exact key wins wherever it stands
            re.fullmatch(pattern, path) and pattern.endswith("/output") == path.endswith("/output")
            for pattern in patterns[:expected]
        )
    )
    assert tuple(layout_rules[path].axes) == rule.axes
