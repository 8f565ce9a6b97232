"""Celery tasks on a node's own queue: launch one trainer role, cancel a run's roles.

Each task is a thin wrapper: `launch_role` and `cancel_run` below are plain functions that
take the supervisor explicitly, so tests call them without a broker; the tasks hand them the
supervisor of the running agent.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import ValidationError

from agents import supervisor as supervision
from agents.celery_app import CANCEL_RUN, LAUNCH_ROLE, app
from agents.errors import LaunchError
from agents.spec import RoleSpec

log = logging.getLogger(__name__)


def launch_role(run_id: int, rank: int, spec: dict[str, Any], *, supervisor: supervision.Supervisor) -> dict[str, Any]:
    """Validate a launch order and start the role; returns its run, rank and pid."""
    if spec.get("run_id", run_id) != run_id or spec.get("rank", rank) != rank:
        raise LaunchError(
            f"launch order for run {run_id} rank {rank} carries a spec for "
            f"run {spec.get('run_id')} rank {spec.get('rank')}"
        )
    try:
        role_spec = RoleSpec.model_validate({**spec, "run_id": run_id, "rank": rank})
    except ValidationError as exc:
        raise LaunchError(f"invalid launch order for run {run_id} rank {rank}: {exc}") from exc
    role = supervisor.launch(role_spec)
    return {"run_id": run_id, "rank": rank, "pid": role.pid}


def cancel_run(run_id: int, reason: str, *, supervisor: supervision.Supervisor) -> dict[str, Any]:
    """Stop every role of the run on this node; returns the ranks that were running."""
    ranks = supervisor.cancel(run_id, reason=reason)
    return {"run_id": run_id, "cancelled_ranks": ranks}


# Early ack (the app default): starting a process twice is worse than not at all, and the
# control plane notices a role that never reports "started". No retries: a LaunchError is a
# bad order or a stopping agent, which a retry would not fix.
@app.task(name=LAUNCH_ROLE)
def launch_role_task(run_id: int, rank: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Celery entry point of `launch_role`."""
    return launch_role(run_id, rank, spec, supervisor=supervision.current())


# Cancelling is idempotent (a run with nothing running is a no-op), so it acks late: an
# agent that dies mid-cancel gets the order again when it comes back.
@app.task(name=CANCEL_RUN, acks_late=True)
def cancel_run_task(run_id: int, reason: str = "cancelled") -> dict[str, Any]:
    """Celery entry point of `cancel_run`."""
    return cancel_run(run_id, reason, supervisor=supervision.current())
