"""The parameter server's lines in the run's log (its stderr), each prefixed `[ps]`."""

from __future__ import annotations

import sys


def say(text: str) -> None:
    """One line on stderr (the run's log)."""
    print(f"[ps] {text}", file=sys.stderr, flush=True)
