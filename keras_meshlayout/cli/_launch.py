"""`keras-meshlayout launch`: the local launcher, as `python -m keras_meshlayout.launch`.

The launcher parses its own arguments (`runtime._launch`), and everything after the
script is the script's, so `main` hands it the arguments before the parser sees them;
the subparser here only lists the command in `keras-meshlayout --help`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["HELP", "NAME", "PROG", "add_parser", "run"]

NAME = "launch"
HELP = "run a script in N local processes, as on N hosts (see: launch --help)"

#: The launcher's name in its help and usage messages when started from here.
PROG = "keras-meshlayout launch"


def add_parser(commands: Any) -> None:
    """Lists `launch` among the subcommands (its arguments never reach this parser)."""
    commands.add_parser(NAME, help=HELP, add_help=False)


def run(argv: Sequence[str]) -> int:
    """Runs the launcher with the arguments that follow `launch`; returns its exit status."""
    from ..runtime._launch import main as launch

    return launch(list(argv), prog=PROG)
