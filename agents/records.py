"""The node's ledger of roles: one JSON file per (run, rank) under `{state_dir}/roles/`,
written when the role starts and kept, with its exit event, once it ends.

It outlives the agent process, so a restarted agent knows which roles died with its
predecessor (they are "running" here) and a launch order that comes again, re-delivered by a
restarted broker, finds the rank already run instead of starting it twice. Files are mode 0600:
a record holds the run's report token, to post the role's spooled reports after a crash.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

RUNNING = "running"
EXITED = "exited"
# Long enough for any re-delivery of a launch (Redis restores within its visibility timeout,
# launches expire within minutes), short enough that the directory stays small.
RETENTION_S = 7 * 24 * 3600.0


class RoleRecords:
    """Read and write the role records of one state dir."""

    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "roles"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, run_id: int, rank: int) -> Path:
        """The record file of (run, rank)."""
        return self.dir / f"{int(run_id)}-{int(rank)}.json"

    def get(self, run_id: int, rank: int) -> dict[str, Any] | None:
        """The record of (run, rank), or None."""
        return _read(self.path(run_id, rank))

    def started(self, record: dict[str, Any]) -> None:
        """Record a role that was just started (or failed before it could start)."""
        self._write({**record, "state": RUNNING, "updated": time.time()})

    def exited(self, run_id: int, rank: int, event: dict[str, Any]) -> None:
        """Mark (run, rank) ended, keeping the exit event it reported."""
        record = self.get(run_id, rank) or {"run_id": run_id, "rank": rank, "role": event.get("role")}
        # The run's token is no longer needed once the exit and its reports are queued.
        record.pop("report_token", None)
        self._write({**record, "state": EXITED, "event": event, "updated": time.time()})

    def running(self) -> list[dict[str, Any]]:
        """Every record of a role not known to have ended; unreadable records are removed."""
        out = []
        for path in sorted(self.dir.glob("*.json")):
            record = _read(path)
            if record is None:
                path.unlink(missing_ok=True)
            elif record.get("state", RUNNING) == RUNNING:
                out.append(record)
        return out

    def prune(self, *, older_than_s: float = RETENTION_S) -> int:
        """Forget ended roles older than `older_than_s`; returns how many."""
        now, removed = time.time(), 0
        for path in self.dir.glob("*.json"):
            record = _read(path)
            if record is not None and record.get("state") == EXITED and now - float(record.get("updated", 0)) > older_than_s:
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def _write(self, record: dict[str, Any]) -> None:
        path = self.path(record["run_id"], record["rank"])
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def _read(path: Path) -> dict[str, Any] | None:
    with contextlib.suppress(OSError, ValueError):
        record = json.loads(path.read_text())
        if isinstance(record, dict) and "run_id" in record and "rank" in record:
            return record
    return None
