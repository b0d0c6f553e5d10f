"""What every subcommand shares: exit statuses, the one-line error, argument types.

A subcommand module (`_devices`, `_plan`, `_demo`, `_launch`) has `add_parser(commands)`,
which adds its subparser with `run` as the function `main` calls, and raises
`InputError` (or a `MeshLayoutError`) for input it cannot use; `main` turns either into
one line on stderr and `EXIT_INVALID`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence

__all__ = [
    "EXIT_HELP",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_PLAN_FAILS",
    "InputError",
    "Parser",
    "SIZE_OPTIONS",
    "add_emulate",
    "fraction",
    "lines",
    "one_line",
    "sizes_joined",
    "positive_int",
]

#: The plan is valid.
EXIT_OK = 0
#: The plan was made but fails a check: the memory budget, the replication
#: guard, or (with `--strict`) a warning such as a rule that matched nothing.
EXIT_PLAN_FAILS = 1
#: The input was rejected: a bad mesh, rule, model or option.
EXIT_INVALID = 2

EXIT_HELP = (
    f"exit status: {EXIT_OK} valid, {EXIT_PLAN_FAILS} the plan fails a check, {EXIT_INVALID} invalid input."
)


#: Options whose value may start with a minus: a negative memory size (`-5GiB`), refused by its own
#: check, and a mesh whose first axis is inferred (`-1x4`).
SIZE_OPTIONS = ("--memory-budget", "--device-memory", "--mesh")


def sizes_joined(argv: Sequence[str]) -> list[str]:
    """`argv` with `--memory-budget -5GiB` as `--memory-budget=-5GiB` (and `--mesh -1x4` as
    `--mesh=-1x4`), so that argparse hands the value to its check ("a memory size is positive") or
    to the mesh instead of reading it as an unknown option."""
    out: list[str] = []
    for word in argv:
        if out and out[-1] in SIZE_OPTIONS and re.match(r"-[\d.]", word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out


class InputError(Exception):
    """A model, rules file or option the command line cannot use."""


class Parser(argparse.ArgumentParser):
    """Reports a bad argument in one line on stderr (exit 2), not the usage text as well."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(EXIT_INVALID, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def lines(err: BaseException) -> list[str]:
    """The non-blank lines of an error's message, stripped (its class name when it has none)."""
    return [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]


def one_line(err: BaseException) -> str:
    """The first line of another library's error message, marked when more lines follow."""
    found = lines(err)
    return found[0] + (" [...]" if len(found) > 1 else "")


def positive_int(text: str) -> int:
    """An argument type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def fraction(text: str) -> float:
    """An argument type: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number from 0 to 1, got {value}")
    return value


def add_emulate(parser: argparse.ArgumentParser) -> None:
    """Adds `--emulate-devices N` (default 8) to a subcommand that starts JAX."""
    parser.add_argument(
        "--emulate-devices",
        type=positive_int,
        default=8,
        metavar="N",
        help="CPU devices to emulate (default 8); accelerators, if present, stay the default devices",
    )
