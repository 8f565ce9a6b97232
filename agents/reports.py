"""Where a role's reports go: the trainer's URLs pointed at the control plane this agent
reaches, and the trainer's report spool turned into outbox messages once the role has ended.

The control plane names report and checkpoint URLs from its configured public URL, which may
be wrong or a default that points nowhere (issue 17); the agent knows an address that works,
the one it registered with, so it keeps each URL's path and replaces scheme, host and port.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from agents.outbox import REPORT, Message
from agents.spec import RoleSpec

log = logging.getLogger(__name__)

SPOOL_FILE = "report-spool.jsonl"
REPORT_BATCH = 500


def rebase_url(url: str, server_url: str) -> str:
    """`url` with the scheme and host:port of `server_url`, keeping its path and query."""
    target = urlsplit(server_url)
    parts = urlsplit(url)
    if not target.scheme or not target.netloc:
        return url
    # A server URL behind a path prefix (https://host/hybridtrain) keeps that prefix too.
    prefix = target.path.rstrip("/")
    path = parts.path if not prefix or parts.path.startswith(prefix + "/") else prefix + parts.path
    return urlunsplit((target.scheme, target.netloc, path, parts.query, parts.fragment))


def toward_server(spec: RoleSpec, server_url: str | None) -> RoleSpec:
    """`spec` with its report URL and checkpoint URL rebased onto `server_url`."""
    if not server_url:
        return spec
    update: dict[str, object] = {}
    if spec.report_url:
        update["report_url"] = rebase_url(spec.report_url, server_url)
    if spec.checkpoint_url:
        update["checkpoint_url"] = rebase_url(spec.checkpoint_url, server_url)
    return spec.model_copy(update=update) if update else spec


def with_flag(argv: list[str], flag: str, value: str, *, after: int) -> list[str]:
    """`argv` with `flag value` among the trainer's options: right after its first `after`
    words (the configured trainer command, which may hold a `--` of its own, as the testbed's
    `python -m testbed.incgroup CG -- python -m trainer` does; a script's `--` comes later)."""
    return [*argv[:after], flag, value, *argv[after:]]


def spool_messages(path: Path, *, run_id: int) -> list[Message]:
    """The records a trainer spooled in `path`, as outbox messages of at most 500 records,
    which the agent delivers with its own token (the run's may no longer report by then).

    A line that is not a JSON object (the torn last line of a killed trainer) is skipped.
    """
    if not path.exists():
        return []
    records = []
    skipped = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                skipped += 1
                continue
            if isinstance(record, dict):
                records.append(record)
            else:
                skipped += 1
    if skipped:
        log.warning("run %s: skipped %d unreadable line(s) of %s", run_id, skipped, path)
    return [
        Message(REPORT, run_id, {"records": records[i:i + REPORT_BATCH]})
        for i in range(0, len(records), REPORT_BATCH)
    ]
