"""The launcher's failure report: which process failed first and how, what was stopped, the exit status."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._cluster import INIT_TIMEOUT_EXIT_STATUS
from ._supervise import Outcome, reports

__all__ = ["describe_exit", "report"]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"was killed by signal {-code} ({_signal_name(-code)})"
    return f"exited with status {code}"


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return "unknown signal"


def report(
    outcome: Outcome,
    processes: list[subprocess.Popen],
    survivors: list[int],
    killed: list[int],
    status_dir: Path,
    init_timeout: float,
    grace: float,
    timeout: float | None,
    say: Any,
) -> int:
    """Says what happened and returns the launcher's exit status."""
    if outcome.kind == "done":
        return 0
    stopped = _stopped(survivors, killed, grace)
    if outcome.kind == "failed":
        code = processes[outcome.rank].returncode
        say(_failure(outcome.rank, processes, survivors, status_dir, init_timeout, stopped))
        return code if code > 0 else 128 - code
    if outcome.kind == "timeout":
        say(f"--timeout {timeout:g} s passed with {_ranks(survivors)} still running{stopped}.")
        return 124
    say(_interrupted(outcome.signum, processes, survivors, killed, grace))
    return 128 + outcome.signum


def _interrupted(
    signum: int, processes: list[subprocess.Popen], survivors: list[int], killed: list[int], grace: float
) -> str:
    """What came of the SIGTERM the launcher forwarded to every process when it was told to stop."""
    message = f"received {_signal_name(signum)}"
    if not survivors:
        return message + "."
    message += (
        f": sent SIGTERM to {_ranks(survivors)} as a preemption notice (a kml.ResumableCheckpoint "
        "backs up after the step under way, then exits with status 143)"
    )
    ended = [r for r in survivors if r not in killed]
    if ended:
        message += "; " + ", ".join(f"rank {r} {describe_exit(processes[r].returncode)}" for r in ended)
    if killed:
        message += f"; {_ranks(killed)} still running after --grace {grace:g} s, stopped by SIGKILL"
    return message + "."


def _stopped(survivors: list[int], killed: list[int], grace: float) -> str:
    """ "; stopped rank 1 by SIGTERM and rank 2 by SIGKILL after 5 s", or "" when none was running."""
    if not survivors:
        return ""
    termed = [r for r in survivors if r not in killed]
    parts = [f"{_ranks(termed)} by SIGTERM"] if termed else []
    if killed:
        parts.append(f"{_ranks(killed)} by SIGKILL after {grace:g} s")
    return f"; stopped {' and '.join(parts)}"


def _failure(
    rank: int,
    processes: list[subprocess.Popen],
    survivors: list[int],
    status_dir: Path,
    init_timeout: float,
    stopped: str,
) -> str:
    """Which rank failed first and how, and what the others did then."""
    code = processes[rank].returncode
    message = f"rank {rank} (pid {processes[rank].pid}) {describe_exit(code)}{stopped}."
    if code == INIT_TIMEOUT_EXIT_STATUS:
        return message + _not_joined(rank, processes, survivors, status_dir, init_timeout)
    after = [
        r
        for r, process in enumerate(processes)
        if r != rank and r not in survivors and process.returncode not in (None, 0)
    ]
    reported = reports(range(len(processes)), status_dir)
    own = [r for r in after if r in reported and not reported[r][1]]
    lost = [r for r in after if r not in own]
    if own:
        message += (
            " "
            + "; ".join(f"Rank {r} {describe_exit(processes[r].returncode)}" for r in own)
            + " too, by an error of its own (its output above), not by losing a peer."
        )
        if len(own) == len(processes) - 1:
            message += " Every process failed by itself: the script fails on its own, not the job."
    if lost:
        message += (
            " Then "
            + "; ".join(f"rank {r} {describe_exit(processes[r].returncode)}" for r in lost)
            + " (a process fails once a collective loses its peer)."
        )
    return message


def _not_joined(
    rank: int, processes: list[subprocess.Popen], survivors: list[int], status_dir: Path, init_timeout: float
) -> str:
    """Why `rank` gave up waiting for the others to join: who ended or hung without joining."""
    message = f" It gave up waiting for the other processes to join (--init-timeout {init_timeout:g} s)."
    joined = {int(p.suffix[1:]) for p in status_dir.glob("joined.*") if p.suffix[1:].isdigit()}
    early = [
        r
        for r, process in enumerate(processes)
        if r != rank and r not in joined and r not in survivors and process.returncode is not None
    ]
    if early:
        message += " " + "; ".join(
            f"Rank {r} {describe_exit(processes[r].returncode)} without joining "
            "(before or in kml.initialize())"
            for r in early
        )
        message += "."
    hung = [r for r in survivors if r != rank and r not in joined]
    if hung:
        message += (
            f" {_ranks(hung).capitalize()} had not joined and was still running: it hung before "
            "or in kml.initialize()."
        )
    return message


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
