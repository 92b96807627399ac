"""The benchmarks' one way to hand a results table over: printed, and appended to the
markdown file the user named (RESULTS.md takes these tables as they are)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional


def emit_table(table: str, out: Optional[str]) -> None:
    """Print `table` and, when `out` is set, append it (and a blank line) to that file,
    creating its folder."""
    print(table, flush=True)
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(table.rstrip("\n") + "\n\n")
