"""`keras-meshlayout devices`: the devices JAX sees, and the meshes that fit them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ._args import EXIT_OK, add_emulate

__all__ = ["HELP", "NAME", "add_parser", "run"]

NAME = "devices"
HELP = "list the devices JAX sees and the meshes that fit them"


def add_parser(commands: Any) -> None:
    """Adds the `devices` subcommand to `commands` (the parser's subparsers)."""
    devices = commands.add_parser(
        NAME,
        help=HELP,
        description="List devices (platform, kind, process, topology coordinates, memory) and the 1-D "
        "and 2-D meshes that fit them.",
    )
    add_emulate(devices)
    devices.add_argument("--json", action="store_true", help="print JSON instead of tables")
    devices.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Prints the devices and the meshes that fit them, as tables or (`--json`) JSON."""
    from ..core._backend import emulate_devices

    emulate_devices(args.emulate_devices)
    import jax

    devices = jax.devices()
    rows = [_device_row(d) for d in devices]
    meshes = _meshes_that_fit(len(devices))
    if args.json:
        print(json.dumps({"process_count": jax.process_count(), "devices": rows, "meshes": meshes}, indent=2))
        return EXIT_OK
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(devices)} devices, {jax.process_count()} process(es)", title_justify="left")
    for column in ("id", "platform", "kind", "process", "coords", "memory"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[key]) if row[key] is not None else "-" for key in row))
    console = Console()
    console.print(table)
    console.print("Meshes that fit: " + "  ".join(meshes))
    return EXIT_OK


def _device_row(device: Any) -> dict[str, Any]:
    from ..core._format import format_bytes

    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    limit = (stats or {}).get("bytes_limit")
    coords = getattr(device, "coords", None)
    return {
        "id": device.id,
        "platform": device.platform,
        "kind": device.device_kind,
        "process": device.process_index,
        "coords": list(coords) if coords is not None else None,
        "memory": format_bytes(limit) if limit else None,
    }


def _meshes_that_fit(count: int) -> list[str]:
    return [str(count)] + [f"{d}x{count // d}" for d in range(1, count + 1) if count % d == 0]
