"""Collectives between slices in XLA:TPU's multi-slice HLO: megascale host transfers.

On a multi-slice target (`tpu-v5e:2x2:slices=2`) XLA:TPU compiles one program per slice: its
`replica_groups` hold one slice's devices (ids `0..chips per slice - 1`), and what crosses the
data-center network (DCN) is no collective instruction but a `send` to the megascale runtime,
whose frontend attributes name the transfer:

    %send = (f32[17,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%bitcast, %after-all),
        channel_id=2, is_host_transfer=true,
        frontend_attributes={_xla_host_transfer_handler_name="xla_megascale_runtime",
        _xla_megascale_reduce_operation="SUM",_xla_megascale_target="{1,2}x{0:3}",
        _xla_megascale_transfer_type="ALL_REDUCE"}

The target is `{slices}x{devices in each}`; the array sent is the send's operand (XLA pads it to
its tiles first, `ZeroCrop`: a combined gradient of 16,577 floats goes as 17,408). A collective
over a mesh axis laid over slices and chips is decomposed (libtpu 0.0.42): an all-reduce is a
reduce-scatter over the axis's devices within the slice, this all-reduce of the shard across the
slices, then an all-gather within the slice again (`_collectives.dcn_share`). The gathers of a
fully sharded plan's kernels have their part across the slices here too; an all-to-all over the
slices lists all its devices, and its whole exchange is counted here. `parse_dcn_collectives`
reads these sends as `Collective`s on the `"dcn"` network.
"""

from __future__ import annotations

import math
import re

from ..core._errors import HloFormatError
from ._hlo import Collective, Payload, _arrays, _tuple_elements

__all__ = ["parse_dcn_collectives"]

#: `%name = (shape, u32[], token[]) send(...)` of a host transfer to the megascale runtime.
_SEND = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\))\s+send\((?P<rest>.*)$")
_ATTRIBUTE = re.compile(r'_xla_megascale_(?P<key>[a-z_]+)="(?P<value>[^"]*)"')
_TARGET = re.compile(r"^\{(?P<slices>[\d,:]+)\}x")
#: A point-to-point transfer's pairs, unquoted: `_xla_megascale_target={{100001->200000},...}`
#: (slice × 100000 + device, slices from 1).
_PAIR = re.compile(r"(?P<source>\d+)->(?P<target>\d+)")
#: A transfer among listed devices, unquoted (an all-to-all): `_xla_megascale_target={{100000,100001,...}}`.
_DEVICES = re.compile(r"_xla_megascale_target=\{\{(?P<ids>[\d,\s]+)\}\}")
_ONE_TO_ONE = re.compile(r"_xla_megascale_target=\{(?P<pairs>\{[\d\->,{}\s]*\})\}")

#: The megascale transfer types and the collective each is.
_KINDS = {
    "ALL_REDUCE": "all-reduce",
    "ALL_GATHER": "all-gather",
    "REDUCE_SCATTER": "reduce-scatter",
    "ALL_TO_ALL": "all-to-all",
    "ONE_TO_ONE": "collective-permute",
}


def parse_dcn_collectives(hlo_text: str) -> list[Collective]:
    """Every transfer between slices in `hlo_text`, as a `Collective` on the `"dcn"` network.

    Its `groups` hold one group of slice indices (the devices of a group are the same chip of
    each slice), a point-to-point transfer's `pairs` the slices it goes between; its payload is
    the array a collective of its kind delivers: the array sent for an all-reduce, an all-to-all
    or a point-to-point transfer, the array sent times the slices for an all-gather, the array
    sent over the slices for a reduce-scatter.

    Raises:
        HloFormatError: a megascale transfer type or target not understood.

    Example:
        >>> text = ('%send = (f32[17,8,128]{2,1,0:T(8,128)}, u32[], token[]) send(%b, %a), channel_id=2, '
        ...         'is_host_transfer=true, frontend_attributes={_xla_host_transfer_handler_name='
        ...         '"xla_megascale_runtime",_xla_megascale_reduce_operation="SUM",'
        ...         '_xla_megascale_target="{1,2}x{0:3}",_xla_megascale_transfer_type="ALL_REDUCE"}')
        >>> [c] = parse_dcn_collectives(text)
        >>> c.kind, c.network, c.group_size, c.nbytes, c.wire_bytes
        ('all-reduce', 'dcn', 2, 69632, 69632.0)
    """
    found = []
    for line in hlo_text.splitlines():
        match = _SEND.match(line) if "xla_megascale_runtime" in line else None
        if match is not None:  # not its recv, nor the -done halves
            found.append(_collective(match["name"], match["shape"], match["rest"], line))
    return found


def _collective(name: str, shape_text: str, rest: str, line: str) -> Collective:
    """One send to the megascale runtime as a collective on the DCN."""
    attributes = {m["key"]: m["value"] for m in _ATTRIBUTE.finditer(rest)}
    kind = _KINDS.get(attributes.get("transfer_type", ""))
    elements = _tuple_elements(shape_text)
    (dtype, shape), *_ = _arrays(elements[0] if elements else shape_text)
    if kind == "collective-permute":
        pairs = _ONE_TO_ONE.search(rest)
        if pairs is None:
            raise _unreadable(line)
        ends = tuple((int(m["source"]) // 100000, int(m["target"]) // 100000)
                     for m in _PAIR.finditer(pairs["pairs"]))  # fmt: skip
        return Collective(name, kind, (Payload(dtype, shape),), None, ends, network="dcn")
    target = _TARGET.match(attributes.get("target", ""))
    devices = _DEVICES.search(rest)
    if kind is None or (target is None and devices is None):
        raise _unreadable(line)
    if target is None:  # every device of the group listed: their whole exchange, counted as DCN
        ids = tuple(int(i) for i in devices["ids"].split(","))
        return Collective(name, kind, (Payload(dtype, shape),), (ids,), network="dcn")
    slices = _slices(target["slices"])
    payload = Payload(dtype, _delivered(kind, shape, len(slices)))
    return Collective(name, kind, (payload,), (slices,), network="dcn")


def _slices(text: str) -> tuple[int, ...]:
    """`1,2` or `1:4` (a range, inclusive) → the slice indices."""
    ids: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition(":")
        ids.extend(range(int(low), int(high or low) + 1))
    return tuple(ids)


def _delivered(kind: str, shape: tuple[int, ...], slices: int) -> tuple[int, ...]:
    """The shape of what a collective of `kind` delivers, from the array each slice sends."""
    if kind == "all-gather":
        return (slices, *shape)
    if kind == "reduce-scatter":
        return (max(1, math.prod(shape) // slices),)
    return shape


def _unreadable(line: str) -> HloFormatError:
    import jax

    return HloFormatError(
        f"Unrecognised megascale transfer in compiled HLO (JAX {jax.__version__}): {line.strip()[:160]!r}. "
        f"The communication report reads the transfer types {', '.join(_KINDS)} with a target "
        "{slices}x{devices}; it refuses to guess the traffic of another. Fix: report the text above "
        "with your JAX and libtpu versions; kml.comm_report cannot count this program's traffic "
        "between slices."
    )
