"""The `keras-meshlayout` command line (also `python -m keras_meshlayout`).

Commands: `devices` (what JAX sees, and the meshes that fit), `launch` (a script in
several local processes, as `python -m keras_meshlayout.launch`), `plan` (the plan
of a model on a mesh, built without allocating weights, with its memory per
device; exit status 0 when the plan is valid, so it can gate a CI job), and
`demo` (trains an MLP on a 2×4 mesh). Each lives in its own module; this one
assembles the parser and turns errors into exit statuses.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence

from ..core._errors import MemoryBudgetError, MeshLayoutError
from . import _demo, _devices, _launch, _plan
from ._args import EXIT_HELP, EXIT_INVALID, EXIT_PLAN_FAILS, InputError, Parser, lines, one_line, sizes_joined
from ._compile_guard import CHILD, in_child

__all__ = ["build_parser", "main"]

_NAMES = {module.NAME for module in (_devices, _launch, _plan, _demo)}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line; returns its exit status.

    Args:
        argv: The arguments; defaults to `sys.argv[1:]`.

    Returns:
        0 on success (a valid plan), 1 when the plan fails a check, 2 for
        input the command cannot use (one line on stderr, no traceback unless
        `--traceback`). `launch` returns the launcher's status.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # everything after it is the launcher's and the script's
        return _launch.run(argv[1:])
    argv = sizes_joined(argv)
    named = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser(named if named in _NAMES else "")
    args = parser.parse_args(argv)
    if getattr(args, "compile", False) and not os.environ.get(CHILD):
        return in_child(argv)  # XLA may abort while compiling: a child process dies in its place
    try:
        return args.run(args)
    except MemoryBudgetError as err:
        print(f"plan fails: {err}", file=sys.stderr)
        return EXIT_PLAN_FAILS
    except (MeshLayoutError, InputError) as err:
        if args.traceback and err.__cause__ is not None:  # the user's code that failed
            traceback.print_exception(err.__cause__)
        print(f"error: {' '.join(lines(err))}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as err:  # never a traceback: one line, unless asked for
        if args.traceback:
            raise
        print(
            f"error: {type(err).__name__}: {one_line(err)} (rerun with --traceback for details)",
            file=sys.stderr,
        )
        return EXIT_INVALID


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The `keras-meshlayout` parser: `--traceback`, then one subparser per command module.

    With `command`, only that command's arguments are built (the others are listed by name
    and help line), so `--help`, `devices --help` and argument errors load no more than the
    command at hand needs: neither Keras nor JAX before `devices` runs.
    """
    parser = Parser(
        prog="keras-meshlayout",
        description="Named device meshes and checked layout rules for Keras on JAX.",
        epilog=EXIT_HELP,
    )
    parser.add_argument(
        "--traceback",
        action="store_true",
        help="show the traceback of an unexpected error, or of your builder or rules function that raised",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (_devices, _launch, _plan, _demo):  # the order `--help` lists them in
        if command is None or command == module.NAME:
            module.add_parser(commands)
        else:
            commands.add_parser(module.NAME, help=module.HELP, add_help=False)
    return parser
