"""A benchmark's rows, each measured in a fresh process of its own script (`--measure CASE...`).

A row's process prints its result as JSON on its last line; the rows are printed as they come
and, given a path, written after each one, so that a long run keeps what it measured.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterable, Sequence


def run_rows(
    script: str,
    cases: Iterable[Sequence[str]],
    row: Callable[[dict], str],
    *,
    extra: Sequence[str] = (),
    json_path: str | None = None,
    timeout: float = 3600,
) -> list[dict]:
    """Runs `script --measure *case *extra` for each case and prints `row(result)` for each."""
    results = []
    for case in cases:
        command = [sys.executable, script, "--measure", *case, *extra]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if out.returncode:
            sys.exit(f"{' '.join(case)} failed:\n{out.stderr[-4000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(row(results[-1]), flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(results, f, indent=2)
    return results
