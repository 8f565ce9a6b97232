"""`hybridtrain runs events ID`: a run's timeline (membership changes, restarts, checkpoints)
as a table, or as JSON with `--json`."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `events` under the `runs` command (which app.cli.run_commands has added already)."""
    runs = sub.choices["runs"]
    runs_sub = next(a for a in runs._actions if isinstance(a, argparse._SubParsersAction))
    events = runs_sub.add_parser("events", help="a run's events: workers lost, left or joined, restarts")
    events.add_argument("--server", help="control plane URL (default $HYBRIDTRAIN_URL or http://127.0.0.1:8000)")
    events.add_argument("--token", help="API token (default $HYBRIDTRAIN_TOKEN)")
    events.add_argument("run_id", type=int)
    events.add_argument("--json", action="store_true", help="print the run's events as JSON")
    events.set_defaults(func=_runs_events)


def _runs_events(args: argparse.Namespace) -> int:
    from app.cli.run_commands import _client, _guard

    @_guard
    def show(args: argparse.Namespace) -> int:
        with _client(args) as client:
            run = client.get_run(args.run_id)
        if args.json:
            print(json.dumps(run["events"], indent=2))
            return 0
        print(timeline(run))
        return 0

    return int(show(args))


def timeline(run: dict[str, Any]) -> str:
    """The run's state and one line per event, oldest first."""
    lines = [f"run {run['id']} {run['name']}: {run['status']}"
             + (f" ({run['reason']})" if run.get("reason") else "")]
    events = run.get("events") or []
    if not events:
        lines.append("  no events")
    for e in events:
        at = datetime.fromisoformat(e["t"]).strftime("%Y-%m-%d %H:%M:%S")
        step = f"step {e['step']}" if e.get("step") is not None else ""
        who = f"rank {e['subject']}" if e.get("subject") is not None else "run"
        detail = f"  {e['detail']}" if e.get("detail") else ""
        lines.append(f"  {at}  {step:>10}  {e['kind']:<20} {who:<8} [{e['source']}]{detail}")
    return "\n".join(lines)
