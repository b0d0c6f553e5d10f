"""Targets: the TPU machines a plan can be made for, as data, and their `tpu-v5e:16x16` form.

A `Target` is one rentable slice (or several slices) of one TPU generation: its topology,
its chip count and the published per-chip figures a planner needs (HBM, peak bf16 FLOP/s,
interconnect bandwidth). Nothing here needs libtpu or touches a device: the devices of a
target come from `_target_devices`, the mesh from `kml.Mesh(..., target=...)`.

Figures, per chip, from Google Cloud's TPU pages (read 2026-12-01):

- v4: https://cloud.google.com/tpu/docs/v4 (275 TFLOP/s bf16, 32 GiB HBM2) and the ICI row
  (2400 Gbps) of the v4/v5e/v5p comparison in the Cloud TPU v5p launch post,
  https://cloud.google.com/blog/products/ai-machine-learning/introducing-cloud-tpu-v5p-and-ai-hypercomputer.
  No per-chip DCN figure is published.
- v5e: https://cloud.google.com/tpu/docs/v5e (197 TFLOP/s bf16, "16 GB" HBM2, ICI 1600 Gbps,
  i.e. 400 GBps bidirectional; data-center network 6.4 Tbps per 256-chip pod).
- v5p: https://cloud.google.com/tpu/docs/v5p (459 TFLOP/s bf16, 95 GiB HBM2e, ICI 4800 Gbps,
  i.e. 1200 GBps bidirectional; DCN 50 Gbps per chip).
- v6e: https://cloud.google.com/tpu/docs/v6e (918 TFLOP/s bf16, "32 GB" HBM, ICI 3200 Gbps,
  i.e. 800 GBps bidirectional; data-center network 25.6 Tbps per 256-chip pod).

Interconnect figures here are one direction (half the bidirectional figure), the rate at
which a device sends, which is what `wire_bytes` counts. HBM sizes that Google writes in GB
are taken as GiB (HBM stacks are binary sizes; what XLA can use is a little less).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
from collections.abc import Mapping
from typing import Any

from .. import _compat
from ._errors import InvalidTargetError, MissingLibtpuError

__all__ = [
    "GENERATIONS",
    "LIBTPU_HINT",
    "TARGET_FORMS",
    "Generation",
    "Target",
    "parse_target",
    "quiet_libtpu",
    "target_devices",
]

_GiB = 2**30


@dataclasses.dataclass(frozen=True)
class Generation:
    """One TPU generation's published per-chip figures, and the topologies it comes in.

    Attributes:
        name: The target's name, `"tpu-v5e"`.
        libtpu_name: libtpu's name of the generation in a topology name (`"v5e"`).
        device_kind: `device_kind` of its devices as libtpu reports it (`"TPU v5 lite"`).
        rank: 2 for a 2-D torus (`16x16`), 3 for a 3-D one (`4x4x4`).
        shapes: The slice shapes Google Cloud offers (2-D generations); `()` for the 3-D
            ones, whose shapes libtpu checks.
        max_chips: The largest single slice, in chips.
        hbm_bytes: HBM per chip.
        peak_flops: Peak bf16 FLOP/s per chip.
        ici_bytes_per_s: Inter-chip interconnect bandwidth per chip, one direction.
        dcn_bytes_per_s: Data-center network bandwidth per chip (between slices), where
            Google publishes one; else `None`.
        chip_config: libtpu's `chip_config_name`, `"megacore"` where a chip's two
            TensorCores are one JAX device (v4); `None` for libtpu's default.
        on_chip_bytes: The largest transient peak of a training step XLA:TPU was measured to
            keep all in on-chip vector memory (0 B of temporaries in HBM), what the peak walk
            (`planner._tpu_memory.in_hbm`) leaves out of HBM, and part of which it leaves out of a
            larger one up to `KEPT_UP_TO` times it: 64 MiB on v5e (measured there,
            kept for v4 and v6e, whose toy steps also report 0 B); 0 on v5p, whose buffer
            assignment keeps a step's activations in HBM however small (libtpu 0.0.42.1).
        hbm_alignment: The alignment of each of a program's temporary buffers in HBM, where
            it costs bytes (`planner._tpu_memory.aligned_bytes`): 16 KiB on v5p (libtpu's
            `xla_jf_program_hbm_alignment_in_kib`); 0 where none was measured (v4, v5e, v6e).
        reduced_gather_bytes: The largest copy XLA:TPU gathers over a group of
            `planner._batch_gathers.REDUCED_GROUP` devices or more as an all-reduce of a zero-padded
            buffer (twice an all-gather's bytes; a larger one is all-gathered): 8 MiB on v5e
            (8 MiB reduced, 16 MiB gathered, over 64 and 256 devices), unbounded on v5p (reduced
            up to 1 GiB over 64), both libtpu 0.0.42.1; v5e's kept for v4 and v6e (not measured).
        vmem_bytes: The vector memory in which XLA:TPU's memory-space assignment holds short-lived
            buffers instead of HBM (`planner._liveness._short_lived`): 112 MiB on v5e, its buffer
            assignment's `vmem` space (kept for v4 and v6e, not measured); 0 on v5p, whose steps
            were measured with all their temporaries in HBM.
    """

    name: str
    libtpu_name: str
    device_kind: str
    rank: int
    shapes: tuple[str, ...]
    max_chips: int
    hbm_bytes: int
    peak_flops: float
    ici_bytes_per_s: float
    dcn_bytes_per_s: float | None
    chip_config: str | None = None
    on_chip_bytes: int = 64 * 2**20
    hbm_alignment: int = 0
    reduced_gather_bytes: float = 8 * 2**20
    vmem_bytes: int = 112 * 2**20


_TORUS_2D = ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")

#: The generations by target name (sources in the module docstring).
GENERATIONS: Mapping[str, Generation] = {
    g.name: g
    for g in (
        Generation(
            "tpu-v4", "v4", "TPU v4", 3, (), 4096, 32 * _GiB, 275e12, 2400e9 / 8, None, chip_config="megacore"
        ),
        Generation(
            "tpu-v5e",
            "v5e",
            "TPU v5 lite",
            2,
            _TORUS_2D,
            256,
            16 * _GiB,
            197e12,
            1600e9 / 8,
            6.4e12 / 8 / 256,
        ),
        Generation(
            "tpu-v5p",
            "v5p",
            "TPU v5",
            3,
            (),
            6144,
            95 * _GiB,
            459e12,
            4800e9 / 8,
            50e9 / 8,
            on_chip_bytes=0,
            hbm_alignment=16 * 1024,
            reduced_gather_bytes=math.inf,
            vmem_bytes=0,
        ),
        Generation(
            "tpu-v6e",
            "v6e",
            "TPU v6 lite",
            2,
            _TORUS_2D,
            256,
            32 * _GiB,
            918e12,
            3200e9 / 8,
            25.6e12 / 8 / 256,
        ),
    )
}

#: The forms `parse_target` takes, as one line for error messages and help texts.
TARGET_FORMS = (
    "tpu-v5e:RxC or tpu-v6e:RxC (RxC one of " + ", ".join(_TORUS_2D) + "), "
    "tpu-v4:AxBxC or tpu-v5p:AxBxC (e.g. tpu-v5p:4x4x4), each optionally followed by :slices=N "
    "(e.g. tpu-v5e:16x16:slices=2)"
)


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU machine to plan for: a generation, a slice topology, and how many slices.

    Attributes:
        generation: The generation's published figures.
        topology: The slice shape, `"16x16"` or `"4x4x4"`.
        slices: Slices joined over the data-center network (multi-slice), 1 for one slice.

    Example:
        >>> target = parse_target("tpu-v5e:16x16")
        >>> target.name, target.chips, target.device_kind
        ('tpu-v5e', 256, 'TPU v5 lite')
        >>> target.hbm_bytes / 2**30, target.peak_flops / 1e12
        (16.0, 197.0)
        >>> parse_target("tpu-v5p:4x4x4:slices=2").chips
        128
    """

    generation: Generation
    topology: str
    slices: int = 1

    @property
    def name(self) -> str:
        """The generation's target name, `"tpu-v5e"`."""
        return self.generation.name

    @property
    def platform(self) -> str:
        """JAX's platform name of the devices: `"tpu"`."""
        return "tpu"

    @property
    def device_kind(self) -> str:
        """`device_kind` of the devices as libtpu reports it, `"TPU v5 lite"`."""
        return self.generation.device_kind

    @property
    def chips_per_slice(self) -> int:
        """Chips in one slice: the product of the topology's sizes."""
        return math.prod(int(size) for size in self.topology.split("x"))

    @property
    def chips(self) -> int:
        """Chips (JAX devices) in all slices together."""
        return self.chips_per_slice * self.slices

    @property
    def hbm_bytes(self) -> int:
        """HBM per chip."""
        return self.generation.hbm_bytes

    @property
    def peak_flops(self) -> float:
        """Published peak bf16 FLOP/s per chip."""
        return self.generation.peak_flops

    @property
    def ici_bytes_per_s(self) -> float:
        """Inter-chip interconnect bandwidth per chip, one direction."""
        return self.generation.ici_bytes_per_s

    @property
    def dcn_bytes_per_s(self) -> float | None:
        """Data-center network bandwidth per chip between slices, where published."""
        return self.generation.dcn_bytes_per_s

    @property
    def libtpu_topology(self) -> str:
        """The topology name libtpu takes, `"v5e:16x16"`."""
        return f"{self.generation.libtpu_name}:{self.topology}"

    @property
    def spec(self) -> str:
        """The form `parse_target` reads back, `"tpu-v5e:16x16"`."""
        suffix = f":slices={self.slices}" if self.slices > 1 else ""
        return f"{self.name}:{self.topology}{suffix}"

    def __str__(self) -> str:
        return self.spec

    def to_dict(self) -> dict[str, object]:
        """The target as JSON-ready data: its spec and every figure."""
        return {
            "target": self.spec,
            "platform": self.platform,
            "device_kind": self.device_kind,
            "topology": self.topology,
            "slices": self.slices,
            "chips": self.chips,
            "hbm_bytes": self.hbm_bytes,
            "peak_flops": self.peak_flops,
            "ici_bytes_per_s": self.ici_bytes_per_s,
            "dcn_bytes_per_s": self.dcn_bytes_per_s,
        }


_FORM = re.compile(r"(?P<name>[a-z0-9-]+):(?P<topology>\d+(?:x\d+)*)(?::slices=(?P<slices>\d+))?")


def parse_target(spec: str | Target) -> Target:
    """The target a `tpu-v5e:16x16` string names (a `Target` is returned as it is).

    Args:
        spec: `tpu-GEN:TOPOLOGY`, optionally followed by `:slices=N`.

    Returns:
        The `Target`.

    Raises:
        InvalidTargetError: in one line, naming the valid forms, for an unknown
            generation, a topology of the wrong rank or not offered, a slice larger
            than the generation's largest, or a slice count below 1.

    Example:
        >>> parse_target("tpu-v6e:8x8").chips
        64
        >>> parse_target("tpu-v5e:3x3")
        Traceback (most recent call last):
        ...
        keras_meshlayout.core._errors.InvalidTargetError: Target 'tpu-v5e:3x3': tpu-v5e comes in ...
    """
    if isinstance(spec, Target):
        return spec
    text = str(spec).strip().lower()
    match = _FORM.fullmatch(text)
    if match is None:
        raise InvalidTargetError(f"Target {spec!r} is not of a known form. Valid forms: {TARGET_FORMS}.")
    generation = GENERATIONS.get(match["name"])
    if generation is None:
        known = ", ".join(GENERATIONS)
        raise InvalidTargetError(
            f"Target {spec!r}: no TPU generation {match['name']!r} (known: {known}). "
            f"Valid forms: {TARGET_FORMS}."
        )
    topology = match["topology"]
    sizes = [int(size) for size in topology.split("x")]
    slices = int(match["slices"] or 1)
    why = None
    if len(sizes) != generation.rank:
        why = f"{generation.name} slices are {generation.rank}-D, {topology} is {len(sizes)}-D"
    elif generation.shapes and topology not in generation.shapes:
        why = f"{generation.name} comes in {', '.join(generation.shapes)}, not {topology}"
    elif min(sizes) < 1 or math.prod(sizes) > generation.max_chips:
        chips = math.prod(sizes)
        why = f"a {generation.name} slice has 1 to {generation.max_chips} chips, {topology} has {chips}"
    elif slices < 1:
        why = "slices=N needs N of at least 1"
    if why is not None:
        raise InvalidTargetError(f"Target {spec!r}: {why}. Valid forms: {TARGET_FORMS}.")
    return Target(generation, topology, slices)


#: Set before libtpu first loads, where the user has not and no TPU is attached: several
#: processes may load it at once (without, the second waits on `/tmp/libtpu_lockfile`), and a
#: machine that is no TPU VM needs no metadata-server query, nor the host-bounds and
#: worker-address warnings libtpu prints when JAX probes for a TPU (any accelerator type will
#: do for that lookup; a target's topology is given by name).
_LIBTPU_ENV = {
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_WORKER_HOSTNAMES": "localhost",
    "TPU_ACCELERATOR_TYPE": "v5litepod-8",
}


def quiet_libtpu() -> None:
    """On a machine with no TPU attached, the environment that keeps libtpu quiet (see `_LIBTPU_ENV`).

    JAX probes for a TPU when it starts wherever libtpu is installed (the `tpu-aot` extra); on a
    TPU VM nothing is changed.
    """
    if importlib.util.find_spec("libtpu") is None or _compat.tpu_chips_attached():
        return
    for name, value in _LIBTPU_ENV.items():
        os.environ.setdefault(name, value)


#: What to install for libtpu, said the way a checkout installs it.
LIBTPU_HINT = (
    'install the libtpu that matches your jax: from the keras_meshlayout checkout pip install ".[tpu-aot]" '
    '(libtpu==0.0.42.* for jax 0.10.2), or pip install "jax[tpu]" at your jax\'s version'
)


def target_devices(target: str | Target) -> list[Any]:
    """The compile-only JAX devices of a TPU target, from libtpu; no TPU needed.

    They compile (`jax.jit(...).lower(...).compile()` with shardings over them) but hold
    no array. The same target gives the same devices each time (a `kml.Mesh` compares
    its devices).

    Raises:
        MissingLibtpuError: libtpu is not installed.
        InvalidTargetError: libtpu refuses the topology (one line, its reason and the
            valid forms).
    """
    return list(_devices(parse_target(target).spec))


@functools.cache
def _devices(spec: str) -> tuple[Any, ...]:
    target = parse_target(spec)
    try:
        import libtpu  # noqa: F401  (only whether it is there: JAX loads it)
    except ImportError:
        raise MissingLibtpuError(
            f"Target {spec!r} needs libtpu, which compiles for TPUs on any machine, and it is not "
            f"installed. Fix: {LIBTPU_HINT}. Without it, plan on jax.sharding.AbstractMesh instead."
        ) from None
    quiet_libtpu()
    from jax.experimental import topologies

    options: dict[str, Any] = {}
    if target.generation.chip_config is not None:
        options["chip_config_name"] = target.generation.chip_config
    if target.slices > 1:
        options["num_slices"] = target.slices
    try:
        topology = topologies.get_topology_desc(
            platform="tpu", topology_name=target.libtpu_topology, **options
        )
    except Exception as err:  # JaxRuntimeError (a RuntimeError) from libtpu, one line of its reason
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise InvalidTargetError(
            f"Target {spec!r}: libtpu refuses topology {target.libtpu_topology!r} ({reason}). "
            f"Valid forms: {TARGET_FORMS}."
        ) from None
    return tuple(topology.devices)
