"""Where a role's reports go: the trainer's URLs pointed at the control plane this agent
reaches, and, once the role has ended, what its trainer did not deliver turned into outbox
messages: its report spool and, after a crash or a kill, its metrics file.

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
METRICS_FILE = "metrics.jsonl"
METRICS_OPTIONS = ("metrics-out", "metrics_out")
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
    """`spec` with its report, checkpoint and data set store URLs rebased onto `server_url`."""
    if not server_url:
        return spec
    update: dict[str, object] = {}
    if spec.report_url:
        update["report_url"] = rebase_url(spec.report_url, server_url)
    if spec.checkpoint_url:
        update["checkpoint_url"] = rebase_url(spec.checkpoint_url, server_url)
    if any(d.store_url for d in spec.datasets):
        # Data sets uploaded to the control plane are read from it, at the address this agent uses.
        update["datasets"] = [d.model_copy(update={"store_url": rebase_url(d.store_url, server_url)})
                              if d.store_url else d for d in spec.datasets]
    return spec.model_copy(update=update) if update else spec


def with_flag(argv: list[str], flag: str, value: str, *, after: int) -> list[str]:
    """`argv` with `flag value` among the trainer's options: right after its first `after`
    words (the configured trainer command, which may hold a `--` of its own, as the testbed's
    `python -m testbed.incgroup CG -- python -m trainer` does; a script's `--` comes later)."""
    return [*argv[:after], flag, value, *argv[after:]]


def metrics_file(options: dict[str, object], rank_dir: Path) -> Path:
    """Where a role's trainer writes its metrics: the launch order's path when absolute, else
    that file name (metrics.jsonl by default) in the rank's own directory, so two ranks of a
    run on one node never share a file and the agent always has one to read after a crash."""
    given = next((options[k] for k in METRICS_OPTIONS if isinstance(options.get(k), str)), None)
    if given and Path(str(given)).is_absolute():
        return Path(str(given))
    return rank_dir / (Path(str(given)).name if given else METRICS_FILE)


def undelivered_messages(*, run_id: int, rank: int, spool: Path | None, metrics: Path | None,
                         metrics_from: int, clean: bool) -> list[Message]:
    """What the agent delivers for a role that ended: what its trainer spooled and, unless it
    exited cleanly, this rank's records in its metrics file written since its launch (byte
    `metrics_from` on). A killed trainer's reporter dies with records it had not yet sent, and
    every record is in the file before the reporter may send it; the control plane stores each
    (stream, seq) once, so resending those it already has costs only the upload."""
    records = _records(spool, run_id=run_id) if spool is not None else []
    if not clean and metrics is not None:
        seen = {_key(r) for r in records}
        for record in _records(metrics, run_id=run_id, offset=metrics_from):
            key = _key(record)
            if record.get("rank") == rank and key not in seen:
                seen.add(key)
                records.append(record)
    return _batched(records, run_id)


def file_size(path: Path) -> int:
    """`path`'s size in bytes, 0 when it does not exist (yet)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _key(record: dict) -> tuple[object, object]:
    return record.get("stream"), record.get("seq")


def _batched(records: list[dict], run_id: int) -> list[Message]:
    return [
        Message(REPORT, run_id, {"records": records[i:i + REPORT_BATCH]})
        for i in range(0, len(records), REPORT_BATCH)
    ]


def _records(path: Path, *, run_id: int, offset: int = 0) -> list[dict]:
    """The JSON objects of `path`'s lines from byte `offset`; a line that is not one (the torn
    last line of a killed trainer) is skipped."""
    if not path.exists():
        return []
    records = []
    skipped = 0
    with open(path, "rb") as fh:
        fh.seek(offset)
        for raw in fh:
            line = raw.decode("utf-8", errors="replace")
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
    return records
