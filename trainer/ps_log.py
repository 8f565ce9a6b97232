"""The parameter server's lines in the run's log (its stderr), each prefixed `[ps]`."""

from __future__ import annotations

import sys


def say(text: str) -> None:
    """One line on stderr (the run's log)."""
    # One write, not print's two: a joiner is heard on another thread than the step lines'.
    sys.stderr.write(f"[ps] {text}\n")
    sys.stderr.flush()
