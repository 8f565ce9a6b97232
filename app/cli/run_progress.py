"""A run as the CLI shows it: `runs show`'s description, and `runs create --wait`'s progress
(hybridtrain.progress) on this client."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TextIO

from app.cli.client import ApiError, HybridtrainClient
from hybridtrain.progress import RunProgress, status_text


def describe_run(run: Mapping[str, Any]) -> str:
    """A run as `runs show` prints it: its state, each rank, the latest checkpoint."""
    lines = [f"run {run['id']} {run['name']}: {status_text(run)}"]
    if run.get("reason"):
        lines.append(f"  reason: {run['reason']}")
    lines.append(f"  {run['strategy']}, global batch {run['global_batch_size']}, "
                 f"max steps {run.get('max_steps') or '?'}, min workers {run.get('min_workers', 1)}")
    checkpoint = run.get("latest_checkpoint")
    every = run.get("checkpoint_every") or 0
    if checkpoint:
        lines.append(f"  checkpoint: step {checkpoint['step']}, {checkpoint['size']} bytes, "
                     f"at {checkpoint['created_at']}")
    else:
        lines.append("  checkpoint: none yet" if every or run.get("checkpoint_every_s") else "  checkpoint: off")
    for w in run.get("workers", []):
        why = f" ({w['reason']})" if w.get("reason") else ""
        lines.append(f"  rank {w['rank']:>3} {w['role']:<6} {w['node_name']:<20} {w['status']}{why}")
    return "\n".join(lines)


def run_progress(client: HybridtrainClient, stream: TextIO, **options: Any) -> RunProgress:
    """Progress of a run read through `client` (RunProgress's `options`); a poll the API fails
    is skipped: the wait loop itself decides when the control plane is gone."""
    return RunProgress(client.metrics, stream, missed=(ApiError,), **options)
