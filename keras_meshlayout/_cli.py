"""The `keras-meshlayout` command line (also `python -m keras_meshlayout`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._errors import MeshLayoutError

#: Exit status for a rejected input (a `MeshLayoutError`), distinct from crashes.
EXIT_INVALID = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="keras-meshlayout",
        description="Named device meshes and checked layout rules for Keras on JAX.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="train an MLP on a 2x4 mesh (8 emulated CPU devices without accelerators) and print its plan",
    )
    demo.add_argument("--steps", type=int, default=20, help="training steps per epoch (default: 20)")
    demo.add_argument("--batch-size", type=int, default=64, help="global batch size (default: 64)")
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            from ._demo import run_demo

            run_demo(steps=args.steps, batch_size=args.batch_size)
    except MeshLayoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_INVALID
    return 0
