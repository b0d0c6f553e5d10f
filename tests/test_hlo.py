"""The HLO parser on text samples of every form XLA prints, and against real compiles.

Each sample is a line (or a few) in the syntax XLA prints: the synchronous forms
as JAX 0.10 on CPU emits them, the asynchronous `-start`/`-done` pairs as XLA:GPU
emits them. Every case states the kind, groups, payloads (dtype, shape, op_name),
bytes and wire bytes it must parse to; wire bytes are written as their formula.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import keras_meshlayout as kml
from keras_meshlayout.report._hlo import Collective, parse_collectives, wire_bytes

ROWS_2x4 = ((0, 1, 2, 3), (4, 5, 6, 7))  # the two rows of a 2×4 mesh
COLUMNS_2x4 = ((0, 4), (1, 5), (2, 6), (3, 7))  # its four columns
ALL_8 = ((0, 1, 2, 3, 4, 5, 6, 7),)
DENSE = 'metadata={op_name="jit(train_step)/jvp(dense)/dot_general" stack_frame_id=51}'
GRAD = 'metadata={op_name="jit(train_step)/transpose(jvp(dense))/dot_general" stack_frame_id=51}'
GPU_CONFIG = (
    'backend_config={"operation_queue_id":"0","wait_on_operation_queues":[],'
    '"collective_backend_config":{"is_sync":false,"no_parallel_custom_call":false},'
    '"force_earliest_schedule":false}'
)


@dataclasses.dataclass(frozen=True)
class Want:
    """What one collective must parse to."""

    kind: str
    groups: tuple[tuple[int, ...], ...] | None
    group_size: int
    payloads: tuple[tuple[str, tuple[int, ...], str], ...]  # (dtype, shape, op_name)
    nbytes: int
    wire_bytes: float
    op_name: str = ""
    pairs: tuple[tuple[int, int], ...] = ()


def seen(collective: Collective) -> Want:
    return Want(
        kind=collective.kind,
        groups=collective.groups,
        group_size=collective.group_size,
        payloads=tuple((p.dtype, p.shape, p.op_name) for p in collective.payloads),
        nbytes=collective.nbytes,
        wire_bytes=collective.wire_bytes,
        op_name=collective.op_name,
        pairs=collective.pairs,
    )


# -- replica-group formats ------------------------------------------------------

GROUP_CASES = [
    (
        "explicit",
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%ynn_fusion.2), channel_id=1, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.clone, " + DENSE,
        ROWS_2x4,
    ),
    (
        "empty-means-all",  # regression: `{}` parsed as one empty group, of size 0
        "  %all-reduce.1 = f32[8,6]{1,0} all-reduce(%p), channel_id=2, replica_groups={}, "
        "use_global_device_ids=true, to_apply=%add, " + DENSE,
        ALL_8,
    ),
    (
        "absent-means-all",
        "  %all-reduce.1 = f32[8,6]{1,0} all-reduce(%p), to_apply=%add, " + DENSE,
        ALL_8,
    ),
    (
        "iota",
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%ynn_fusion.2), channel_id=1, replica_groups=[2,4]<=[8], "
        "use_global_device_ids=true, to_apply=%add.clone, " + DENSE,
        ROWS_2x4,
    ),
    (
        "iota-transposed",
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), "
        "use_global_device_ids=true, to_apply=%add, " + DENSE,
        COLUMNS_2x4,
    ),
    (
        "iota-3d",  # as JAX 0.10 prints a gather over the minor half of an axis of 4
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=2, replica_groups=[4,2]<=[2,2,2]T(0,2,1), "
        "use_global_device_ids=true, to_apply=%add, " + DENSE,
        ((0, 2), (1, 3), (4, 6), (5, 7)),
    ),
    (
        "mesh",
        "  %all-reduce.9 = f32[8,6]{1,0} all-reduce(%x), channel_id=2, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use_global_device_ids=true, "
        "to_apply=%region_2.3.clone, " + DENSE,
        COLUMNS_2x4,
    ),
    (
        "mesh-device-ids",
        "  %all-reduce.1 = f32[8,6]{1,0} all-reduce(%wrapped_reduce), channel_id=2, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, "
        "use_global_device_ids=true, to_apply=%region_0.0.clone, " + DENSE,
        ROWS_2x4,
    ),
    (
        "mesh-device-ids-size-1-axis",  # verbatim shape of a JAX 0.10 CPU line
        "  ROOT %all-reduce.1 = f32[8,6]{1,0} all-reduce(%wrapped_reduce), channel_id=2, "
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, "
        "use_global_device_ids=true, to_apply=%region_0.0.clone, " + DENSE,
        ROWS_2x4,
    ),
    (
        "mesh-device-ids-list",  # regression: a listed device order was an error
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, "
        "replica_groups=mesh['a'=2,'b'=4], device_ids=(0,4,1,5,2,6,3,7) {'a'}, to_apply=%add, " + DENSE,
        ((0, 2), (4, 6), (1, 3), (5, 7)),
    ),
    (
        "mesh-two-axes",
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_0','axis_1'}, to_apply=%add, " + DENSE,
        ALL_8,
    ),
    (
        "mesh-two-axes-minor-first",  # a group lists its devices in the order of the axes written
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1','axis_0'}, to_apply=%add, " + DENSE,
        ((0, 4, 1, 5, 2, 6, 3, 7),),
    ),
    (
        "mesh-unquoted",
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, replica_groups=mesh[x=2,y=4] {y}, "
        "to_apply=%add, " + DENSE,
        ROWS_2x4,
    ),
    (
        "mesh-major-sub-axis",  # regression (sub-axes were an error): 'x':(1)2 is the major 2 of x=8
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, replica_groups=mesh['x'=8] {'x':(1)2}, "
        "to_apply=%add, " + DENSE,
        COLUMNS_2x4,
    ),
    (
        "mesh-middle-sub-axis",  # 'x':(2)2 is the middle 2 of x=8 (2×2×2): devices 2 apart
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, replica_groups=mesh['x'=8] {'x':(2)2}, "
        "to_apply=%add, " + DENSE,
        ((0, 2), (1, 3), (4, 6), (5, 7)),
    ),
    (
        "mesh-sub-axis-and-axis",
        "  %all-reduce = f32[8,6]{1,0} all-reduce(%x), channel_id=1, "
        "replica_groups=mesh['x'=2,'y'=4] {'x','y':(2)2}, to_apply=%add, " + DENSE,
        ((0, 1, 4, 5), (2, 3, 6, 7)),
    ),
]


@pytest.mark.parametrize("line, groups", [c[1:] for c in GROUP_CASES], ids=[c[0] for c in GROUP_CASES])
def test_replica_group_formats(line, groups):
    nbytes = 8 * 6 * 4
    n = len(groups[0])
    assert [seen(c) for c in parse_collectives(line, 8)] == [
        Want(
            kind="all-reduce",
            groups=groups,
            group_size=n,
            payloads=(("f32", (8, 6), "jit(train_step)/jvp(dense)/dot_general"),),
            nbytes=nbytes,
            wire_bytes=2 * (n - 1) / n * nbytes,
            op_name="jit(train_step)/jvp(dense)/dot_general",
        )
    ]


# -- instruction forms ------------------------------------------------------------

COMBINED = (
    "  %all-reduce.9 = (f32[], f32[12,8]{1,0}, f32[12]{0}, f32[4,12]{1,0}, f32[4]{0}, "
    "/*index=5*/f32[6,4]{1,0}, f32[6]{0}) all-reduce(%multiply_reduce_fusion, %dot.5, %wrapped_reduce, "
    "%dot.6, %wrapped_reduce.1, "
    "/*index=5*/%dot.7, %reduce_negate_fusion), channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4] "
    "{'axis_0'}, use_global_device_ids=true, to_apply=%region_2.3.clone, metadata={op_name="
    '"jit(train_step)/(jvp(compile_loss)/mse/reduce_sum:transpose(jvp(pre))/dot_general:transpose(jvp(pre))'
    "/reduce_sum:transpose(jvp(up))/dot_general:transpose(jvp(up))/reduce_sum:transpose(jvp(down))/dot_general"
    ':transpose(jvp(down))/reduce_sum)" stack_frame_id=96}\n'
)
COMBINED_NAMES = [
    "jvp(compile_loss)/mse/reduce_sum",
    "transpose(jvp(pre))/dot_general",
    "transpose(jvp(pre))/reduce_sum",
    "transpose(jvp(up))/dot_general",
    "transpose(jvp(up))/reduce_sum",
    "transpose(jvp(down))/dot_general",
    "transpose(jvp(down))/reduce_sum",
]
COMBINED_SHAPES = [(), (12, 8), (12,), (4, 12), (4,), (6, 4), (6,)]


def combined_reads(operand: str) -> str:
    """The get-tuple-element lines that take each array out of `operand`."""
    return "".join(
        f"  %get-tuple-element.{i} = f32[{','.join(map(str, shape))}] get-tuple-element({operand}), "
        f'index={i}, metadata={{op_name="jit(train_step)/{name}" stack_frame_id={50 + i}}}\n'
        for i, (shape, name) in enumerate(zip(COMBINED_SHAPES, COMBINED_NAMES, strict=True))
    )


COMBINED_BYTES = 4 * (1 + 96 + 12 + 48 + 4 + 24 + 6)
COMBINED_WANT = Want(
    kind="all-reduce",
    groups=COLUMNS_2x4,
    group_size=2,
    payloads=tuple(
        ("f32", shape, "jit(train_step)/" + name)
        for shape, name in zip(COMBINED_SHAPES, COMBINED_NAMES, strict=True)
    ),
    nbytes=COMBINED_BYTES,
    wire_bytes=2 * 1 / 2 * COMBINED_BYTES,
    op_name="jit(train_step)/(" + ":".join(COMBINED_NAMES) + ")",
)

#: One asynchronous collective as XLA:TPU prints it (libtpu 0.0.42.1, a head_dim-split key kernel
#: gathered beside the query's matmul): a copy in the fusion that starts it, in each fusion that
#: computes while it moves and in the one that ends it, all with its channel_id. Regression: each
#: copy was counted, and keras-hub Mixtral's model axis read 2.3x what it sends.
KEY = 'metadata={op_name="jit(train_step)/jvp(backbone)/key/bkm,mvh->bkvh/dot_general" stack_frame_id=492}'


def tpu_gather(n: int, channel: int, space: str = "") -> str:
    """One copy of an XLA:TPU all-gather of the key kernel, in memory space `space` (`"S(1)"`)."""
    return (
        f"  %all-gather.{n} = bf16[64,2,16]{{0,1,2:T(2,128)(2,1){space}}} all-gather(%param_0.{n}), "
        f"channel_id={channel}, replica_groups={{{{0,1,2,3}},{{4,5,6,7}}}}, dimensions={{2}}, "
        f"use_global_device_ids=true, {KEY}\n"
    )


ASYNC_FUSION = "".join(
    [
        "%fused_computation.730 (param_0.63: bf16[64,2,4]) -> (bf16[64,2,4], bf16[64,2,16]) {\n",
        tpu_gather(63, 6),
        "  ROOT %custom-call.3 = (bf16[64,2,4], bf16[64,2,16]) custom-call(%all-gather.63), "
        'custom_call_target="AsyncCollectiveStart"\n}\n',
        "%async_collective_fusion.585 (param_0.65: bf16[64,2,4]) -> (f32[4,8,1,16], bf16[64,2,16]) {\n",
        tpu_gather(65, 6, "S(1)"),
        "}\n%fused_computation.732 (param_0.67: bf16[64,2,4]) -> bf16[64,2,16] {\n",
        tpu_gather(67, 6),
        "  ROOT %custom-call.5 = bf16[64,2,16] custom-call(%all-gather.67), "
        'custom_call_target="AsyncCollectiveDone"\n}\n',
        "%fused_computation.733 (param_0.69: bf16[64,2,4]) -> (bf16[64,2,4], bf16[64,2,16]) {\n",
        tpu_gather(69, 5),  # another collective: the value kernel's
        "}\n",
    ]
)
TPU_KEY_GATHER = Want(
    "all-gather",
    ROWS_2x4,
    4,
    (("bf16", (64, 2, 16), "jit(train_step)/jvp(backbone)/key/bkm,mvh->bkvh/dot_general"),),
    64 * 2 * 16 * 2,
    3 / 4 * 64 * 2 * 16 * 2,
    "jit(train_step)/jvp(backbone)/key/bkm,mvh->bkvh/dot_general",
)

FORM_CASES = [
    (
        "all-reduce-start",  # result shaped like the all-reduce; the -done is skipped
        "  %all-reduce-start = f32[64,32]{1,0} all-reduce-start(f32[64,32]{1,0} %fusion.3), "
        "channel_id=5, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add.2, "
        + GPU_CONFIG
        + ", "
        + GRAD
        + "\n"
        "  %all-reduce-done = f32[64,32]{1,0} all-reduce-done(f32[64,32]{1,0} %all-reduce-start), " + GRAD,
        [
            Want(
                "all-reduce",
                ROWS_2x4,
                4,
                (("f32", (64, 32), "jit(train_step)/transpose(jvp(dense))/dot_general"),),
                64 * 32 * 4,
                2 * 3 / 4 * 64 * 32 * 4,
                "jit(train_step)/transpose(jvp(dense))/dot_general",
            )
        ],
    ),
    (
        "all-gather-start",  # (operand, result): the payload is the gathered result
        "  %all-gather-start = (f32[4,8]{1,0}, f32[16,8]{1,0}) all-gather-start(f32[4,8]{1,0} %param.1), "
        "channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}, use_global_device_ids=true, "
        f"{GPU_CONFIG}, {DENSE}\n"
        "  %all-gather-done = f32[16,8]{1,0} all-gather-done((f32[4,8]{1,0}, f32[16,8]{1,0}) "
        "%all-gather-start), " + DENSE,
        [
            Want(
                "all-gather",
                ROWS_2x4,
                4,
                (("f32", (16, 8), "jit(train_step)/jvp(dense)/dot_general"),),
                16 * 8 * 4,
                3 / 4 * 16 * 8 * 4,
                "jit(train_step)/jvp(dense)/dot_general",
            )
        ],
    ),
    (
        "all-gather-start-combined",  # ((operands), (results))
        "  %all-gather-start.2 = ((f32[4,8]{1,0}, bf16[2]{0}), (f32[16,8]{1,0}, bf16[8]{0})) "
        "all-gather-start(%p.1, %p.2), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, "
        "use_global_device_ids=true\n"
        "  %all-gather-done.2 = (f32[16,8]{1,0}, bf16[8]{0}) all-gather-done(%all-gather-start.2)",
        [
            Want(
                "all-gather",
                ROWS_2x4,
                4,
                (("f32", (16, 8), ""), ("bf16", (8,), "")),
                16 * 8 * 4 + 8 * 2,
                3 / 4 * (16 * 8 * 4 + 8 * 2),
            )
        ],
    ),
    (
        "collective-permute-start",  # (operand, result, context words)
        "  %collective-permute-start = (f32[8]{0}, f32[8]{0}, u32[], u32[]) collective-permute-start("
        "f32[8]{0} %p), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, " + GPU_CONFIG + "\n"
        "  %collective-permute-done = f32[8]{0} collective-permute-done((f32[8]{0}, f32[8]{0}, u32[], u32[]) "
        "%collective-permute-start)",
        [
            Want(
                "collective-permute",
                None,
                2,
                (("f32", (8,), ""),),
                32,
                32.0,
                pairs=((0, 1), (1, 2), (2, 3), (3, 0)),
            )
        ],
    ),
    (
        "collective-permute-start-scalar",  # regression: a scalar payload was dropped with the context words
        "  %collective-permute-start.1 = (f32[], f32[], u32[], u32[]) collective-permute-start(%p), "
        "channel_id=4, source_target_pairs={{0,1},{1,0}}",
        [Want("collective-permute", None, 2, (("f32", (), ""),), 4, 4.0, pairs=((0, 1), (1, 0)))],
    ),
    (
        "collective-permute",
        "  %collective-permute = bf16[4,16]{1,0} collective-permute(%x), channel_id=6, "
        "source_target_pairs={{0,4},{4,0}}, " + DENSE,
        [
            Want(
                "collective-permute",
                None,
                2,
                (("bf16", (4, 16), "jit(train_step)/jvp(dense)/dot_general"),),
                4 * 16 * 2,
                4 * 16 * 2,
                "jit(train_step)/jvp(dense)/dot_general",
                ((0, 4), (4, 0)),
            )
        ],
    ),
    (
        "reduce-scatter",  # every device sends n-1 shards of the result's size
        "  %reduce-scatter = f32[2,8]{1,0} reduce-scatter(%fusion), channel_id=4, "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, dimensions={0}, to_apply=%add, "
        + GRAD,
        [
            Want(
                "reduce-scatter",
                ROWS_2x4,
                4,
                (("f32", (2, 8), "jit(train_step)/transpose(jvp(dense))/dot_general"),),
                2 * 8 * 4,
                3 * 2 * 8 * 4,
                "jit(train_step)/transpose(jvp(dense))/dot_general",
            )
        ],
    ),
    (
        "all-to-all",
        "  %all-to-all = s32[8,4]{1,0} all-to-all(%x), channel_id=5, "
        "replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={1}",
        [Want("all-to-all", ((0, 1), (2, 3), (4, 5), (6, 7)), 2, (("s32", (8, 4), ""),), 128, 1 / 2 * 128)],
    ),
    (
        "all-to-all-tuple",  # one array per peer
        "  %all-to-all.1 = (f32[2,4]{1,0}, f32[2,4]{1,0}) all-to-all(%a, %b), channel_id=7, "
        "replica_groups={{0,4},{1,5},{2,6},{3,7}}",
        [Want("all-to-all", COLUMNS_2x4, 2, (("f32", (2, 4), ""), ("f32", (2, 4), "")), 64, 1 / 2 * 64)],
    ),
    (
        "root-pred-tiled",
        "  ROOT %all-reduce.7 = pred[128]{0:T(1024)(128)(4,1)} all-reduce(%compare.2), channel_id=8, "
        "replica_groups={{0,1}}, to_apply=%or",
        [Want("all-reduce", ((0, 1),), 2, (("pred", (128,), ""),), 128, 2 * 1 / 2 * 128)],
    ),
    (
        "bf16-tiled-layout",
        "  %all-gather.3 = bf16[8,128]{1,0:T(8,128)(2,1)} all-gather(bf16[4,128]{1,0:T(8,128)(2,1)} %x), "
        "channel_id=9, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true",
        [Want("all-gather", COLUMNS_2x4, 2, (("bf16", (8, 128), ""),), 2048, 1 / 2 * 2048)],
    ),
    (
        "group-of-one-sends-nothing",
        "  %all-reduce.3 = f32[16]{0} all-reduce(%x), channel_id=3, "
        "replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_1'}, use_global_device_ids=true, to_apply=%add",
        [Want("all-reduce", tuple((i,) for i in range(8)), 1, (("f32", (16,), ""),), 64, 0.0)],
    ),
    (
        "mesh-no-axes",  # a no-op: every device its own group
        "  %all-reduce.4 = f32[16]{0} all-reduce(%x), channel_id=3, replica_groups=mesh['x'=2,'y'=4] {}, "
        "to_apply=%add",
        [Want("all-reduce", tuple((i,) for i in range(8)), 1, (("f32", (16,), ""),), 64, 0.0)],
    ),
    (
        "combined-all-reduce",  # one tuple; each array named by the get-tuple-element that reads it
        COMBINED + combined_reads("%all-reduce.9"),
        [COMBINED_WANT],
    ),
    (
        "combined-all-reduce-start",  # regression: the reads are of the -done, whose names were lost
        COMBINED.replace("all-reduce(", "all-reduce-start(").replace("%all-reduce.9 ", "%all-reduce-start.9 ")
        + "  %all-reduce-done.9 = (f32[], f32[12,8]{1,0}, f32[12]{0}, f32[4,12]{1,0}, f32[4]{0}, "
        "/*index=5*/f32[6,4]{1,0}, f32[6]{0}) all-reduce-done(%all-reduce-start.9)\n"
        + combined_reads("(f32[], f32[12,8]{1,0}) %all-reduce-done.9"),
        [COMBINED_WANT],
    ),
    ("tpu-async-collective-fusion", ASYNC_FUSION, [TPU_KEY_GATHER, TPU_KEY_GATHER]),  # channels 6 and 5
    (
        "not-collectives",  # operands, metadata and -done lines that mention collectives;
        # regression: a tuple-shaped op whose metadata says "all-reduce(" was read as one
        "  %fusion = f32[8]{0} fusion(%all-reduce.1, %all-gather), kind=kLoop, calls=%fused_computation\n"
        '  %copy = (f32[], f32[8]{0}) copy(%t), metadata={op_name="a all-reduce(b)"}\n'
        "  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)\n"
        "  %get-tuple-element = f32[] get-tuple-element(%all-reduce.9), index=0",
        [],
    ),
]


@pytest.mark.parametrize("text, want", [c[1:] for c in FORM_CASES], ids=[c[0] for c in FORM_CASES])
def test_instruction_forms(text, want):
    assert [seen(c) for c in parse_collectives(text, 8)] == want


def test_program_order_and_names():
    text = "\n".join(
        [
            "HloModule jit_train_step, is_scheduled=true, entry_computation_layout={(f32[8]{0})->f32[8]{0}}",
            "%add (x: f32[], y: f32[]) -> f32[] {",
            "  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)",
            "}",
            "ENTRY %main (p: f32[8]) -> f32[8] {",
            "  %all-gather = f32[8]{0} all-gather(%p), replica_groups={{0,1}}, dimensions={0}",
            "  %all-reduce.2 = f32[8]{0} all-reduce(%all-gather), replica_groups={{0,1}}, to_apply=%add",
            "  ROOT %collective-permute.1 = f32[8]{0} collective-permute(%all-reduce.2), "
            "source_target_pairs={{0,1},{1,0}}",
            "}",
        ]
    )
    found = parse_collectives(text, 2)
    assert [(c.name, c.kind) for c in found] == [
        ("all-gather", "all-gather"),
        ("all-reduce.2", "all-reduce"),
        ("collective-permute.1", "collective-permute"),
    ]


@pytest.mark.parametrize(
    "groups, message",
    [
        ("replica_groups=<<0,1>>", "Unrecognised replica_groups format in compiled HLO (JAX "),
        (
            "replica_groups=mesh['x'=2] {'y'}",
            "Unrecognised axis \"'y'\" in mesh replica_groups (the mesh has ['x'])",
        ),
        ("replica_groups=mesh['x'=2], device_ids=(1,0,2) {'x'}", "3 device ids for a mesh of shape [2]"),
    ],
    ids=["unknown-format", "unknown-axis", "wrong-device-count"],
)
def test_unrecognised_groups_raise(groups, message):
    """Issue 20: our own error (it was a bare ValueError), quoting the text and naming the fix."""
    with pytest.raises(kml.HloFormatError) as raised:
        parse_collectives(f"  %ar = f32[8]{{0}} all-reduce(%x), {groups}, to_apply=%add", 8)
    assert message in str(raised.value)
    assert groups.partition("=")[2][:20] in str(raised.value)
    assert "Fix: report the text above with your JAX version" in str(raised.value)


def test_an_unknown_element_type_is_an_error_naming_it():
    """Issue 20: an unknown element type counted silently as 4 bytes; now an error naming it."""
    [collective] = parse_collectives(
        "  %ar = f12[8]{0} all-reduce(%x), replica_groups={{0,1}}, to_apply=%add", 2
    )
    with pytest.raises(kml.HloFormatError, match=re.escape("Unknown HLO element type 'f12'")):
        collective.nbytes  # noqa: B018 (the property raises)


# -- wire bytes ---------------------------------------------------------------------

WIRE_CASES = [
    ("all-reduce", 1024, 4, 2 * 3 / 4 * 1024),
    ("all-reduce", 1024, 2, 1024),
    ("all-gather", 1024, 4, 3 / 4 * 1024),
    ("reduce-scatter", 256, 4, 3 * 256),
    ("all-to-all", 1024, 8, 7 / 8 * 1024),
    ("collective-permute", 1024, 2, 1024),
    ("all-reduce", 1024, 1, 0),
    ("all-gather", 1024, 1, 0),
    ("reduce-scatter", 1024, 1, 0),
    ("all-to-all", 1024, 1, 0),
    ("collective-permute", 1024, 1, 0),
]


@pytest.mark.parametrize(
    "kind, nbytes, n, want",
    WIRE_CASES,
    ids=[f"{kind}-{n}" for kind, _, n, _ in WIRE_CASES],
)
def test_wire_bytes_formula(kind, nbytes, n, want):
    assert wire_bytes(kind, nbytes, n) == pytest.approx(want)


# -- against XLA: the groups parsed are the devices that share a mesh coordinate -----


def _expected_groups(shape: tuple[int, ...], axes: tuple[int, ...]) -> set[frozenset[int]]:
    """Sets of logical ids that differ only along `axes` of a mesh of `shape`."""
    ids = np.arange(np.prod(shape)).reshape(shape)
    kept = [i for i in range(len(shape)) if i not in axes]
    rows = np.transpose(ids, kept + list(axes)).reshape(-1, int(np.prod([shape[i] for i in axes])))
    return {frozenset(int(i) for i in row) for row in rows}


MESH_CASES = [
    ((2, 4), ("a",)),
    ((2, 4), ("b",)),
    ((4, 2), ("a",)),
    ((4, 2), ("b",)),
    ((2, 2, 2), ("b",)),
    ((2, 2, 2), ("a", "c")),
    ((8,), ("a",)),
]


@pytest.mark.parametrize(
    "shape, reduced",
    MESH_CASES,
    ids=["x".join(map(str, s)) + "-over-" + "".join(r) for s, r in MESH_CASES],
)
def test_groups_match_a_real_compile(shape, reduced):
    """Summing a dimension sharded over `reduced` all-reduces over exactly those axes."""
    names = "abc"[: len(shape)]
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(shape), tuple(names))
    others = tuple(n for n in names if n not in reduced) or None
    sharding = NamedSharding(mesh, PartitionSpec(reduced, others))
    x = jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=sharding)
    # The sum over the rows stays split over the other axes: one all-reduce, no gather.
    out = NamedSharding(mesh, PartitionSpec(others))
    text = jax.jit(lambda v: v.sum(axis=0), out_shardings=out).lower(x).compile().as_text()
    [collective] = parse_collectives(text, 8)
    assert collective.kind == "all-reduce"
    axes = tuple(names.index(n) for n in reduced)
    assert {frozenset(g) for g in collective.groups} == _expected_groups(shape, axes), text


# -- multi-slice programs: what crosses slices is a send to the megascale runtime -----------------

#: Lines as libtpu 0.0.42.1 prints them for two v5e 2x2 slices (the MLP of `tests/test_targets.py`),
#: trimmed after the frontend attributes.
MEGASCALE = (
    'is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",'
)
LISTED = (100000, 100001, 100003, 100002, 200000, 200001, 200003, 200002)  # slice × 100000 + chip
SENDS = [
    pytest.param(
        "%send = (f32[17,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%bitcast, %after-all), channel_id=2, "
        + MEGASCALE
        + '_xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",'
        '_xla_megascale_transfer_type="ALL_REDUCE"}',
        ("all-reduce", ((1, 2),), (), 17 * 8 * 128 * 4, 17 * 8 * 128 * 4 * 2 * 1 / 2),
        id="all-reduce-over-2-slices",
    ),
    pytest.param(
        "%send = (f32[16,256]{1,0:T(8,128)}, u32[], token[]) send(%param.4, %after-all), channel_id=7, "
        + MEGASCALE
        + '_xla_megascale_target="{1,2,3,4}x{0:3}",_xla_megascale_transfer_type="ALL_GATHER"}',
        ("all-gather", ((1, 2, 3, 4),), (), 4 * 16 * 256 * 4, 3 * 16 * 256 * 4),
        id="all-gather-over-4-slices",
    ),
    pytest.param(
        "%send.4 = (f32[8,8,64]{2,1,0:T(8,128)}, u32[], token[]) send(%f, %after-all.4), channel_id=11, "
        + MEGASCALE
        + "_xla_megascale_target={{100000,100001,100003,100002,200000,200001,200003,200002}},"
        '_xla_megascale_transfer_type="ALL_TO_ALL"}',
        ("all-to-all", (LISTED,), (), 16384, 16384 * 7 / 8),
        id="all-to-all-of-listed-devices",
    ),
    pytest.param(
        "%send = (f32[16,64]{1,0:T(8,128)}, u32[], token[]) send(%g, %after-all), channel_id=4, "
        + MEGASCALE
        + "_xla_megascale_target={{100001->200000},{200001->100000}},"
        + '_xla_megascale_transfer_type="ONE_TO_ONE"}',
        ("collective-permute", None, ((1, 2), (2, 1)), 16 * 64 * 4, 16 * 64 * 4),
        id="one-to-one-between-slices",
    ),
]


@pytest.mark.parametrize(("line", "want"), SENDS)
def test_transfers_between_slices_are_read_as_collectives_on_the_dcn(line, want):
    from keras_meshlayout.report._megascale import parse_dcn_collectives

    kind, groups, pairs, nbytes, wire = want
    recv = line.replace("%send", "%recv").replace(" send(", " recv(")  # the receiving half is not counted
    [collective] = parse_dcn_collectives(f"{line}\n{recv}\n{DENSE}")
    assert (collective.kind, collective.groups, collective.pairs) == (kind, groups, pairs)
    assert (collective.network, collective.nbytes, collective.wire_bytes) == ("dcn", nbytes, wire)
    assert parse_collectives(line, 8) == []  # no collective instruction: the report read none before


def test_an_unknown_megascale_transfer_is_an_error_naming_it():
    from keras_meshlayout.report._megascale import parse_dcn_collectives

    line = (
        "%send = (f32[8]{0}, u32[], token[]) send(%x, %a), "
        + MEGASCALE
        + '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="BROADCAST"}'
    )
    with pytest.raises(kml.HloFormatError, match="Unrecognised megascale transfer") as info:
        parse_dcn_collectives(line)
    assert "ALL_REDUCE, ALL_GATHER" in str(info.value) and "Fix:" in str(info.value)


# -- counted loops: how often a windowed einsum's body runs ---------------------------------------

_LOOP = """%cond (p: (u32[], f32[8])) -> pred[] {
  %p = (u32[], f32[8]) parameter(0)
  %i = u32[] get-tuple-element(%p), index=0
  %n = u32[] constant(16)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}
%body (q: (u32[], f32[8])) -> (u32[], f32[8]) {
  %q = (u32[], f32[8]) parameter(0)
  %j = u32[] get-tuple-element(%q), index=0
  %x = f32[8] get-tuple-element(%q), index=1
  {counter}
  %two = u32[] constant(2)
  %next = u32[] add(%c, %two)
  %y = f32[8] collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (u32[], f32[8]) tuple(%next, %y)
}
ENTRY %main (a: f32[8]) -> (u32[], f32[8]) {
  %a = f32[8] parameter(0)
  %zero = u32[] constant(0)
  %start = u32[] copy(%zero)
  %init = (u32[], f32[8]) tuple(%start, %a)
  ROOT %w = (u32[], f32[8]) while(%init), condition=%cond, body=%body
}"""


@pytest.mark.parametrize("form", ["copied", "direct"])
def test_a_loop_counter_read_directly_or_through_a_copy_gives_the_runs(form):
    """16 / 2 runs. XLA:TPU copies the counter of a windowed einsum's loop over `data=32` (Llama-3 8 B
    widths on v5p `data=32,model=2`) before adding to it: such a loop was counted as run once, its 33
    permutes a kernel as 5, and the report gave 0.75 of the bytes the step sends."""
    from keras_meshlayout.report._loops import loop_runs

    text = _LOOP.replace("{counter}", "%c = u32[] copy(%j)" if form == "copied" else "")
    if form == "direct":
        text = text.replace("add(%c, %two)", "add(%j, %two)")
    assert loop_runs(text.splitlines()) == {"body": 8}
