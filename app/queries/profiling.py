"""Plans that ask for the profiles they lack: which nodes have no usable profile of a run's
task, the pending profiles to order from them, and what the plan is waiting on.

A plan request with `profile_missing` (the CLI's default) gets one pending profile per node
that has neither a usable finished profile of the task nor one under way; the route commits
and sends the orders (as POST /tasks/profiles does), and the plan's `profiling` lists every
node it is waiting on, so that a client can poll the plan until its numbers are there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import Node, NodeStatus, ProfileStatus, TaskProfile
from app.queries.predictions import usable_profile
from app.queries.profiles import latest_profiles, task_key

# A profile pending longer than this was lost (its agent died or restarted mid-profile): a new
# plan orders another. Beyond the agent's own bound: up to 4 runs of 300 s, plus the lock.
PENDING_LOST_AFTER = timedelta(minutes=30)
# A profile that failed this recently is reported, not ordered again: the same task would fail
# the same way, and a client polling the plan would otherwise order one every poll.
FAILED_RETRY_AFTER = timedelta(minutes=10)
# The batch a plan's profiles measure (as POST /tasks/profiles defaults to).
PROFILE_BATCH = 32


@dataclass(frozen=True)
class Profiling:
    """A node the plan waits on: its newest profile of the task, pending or lately failed."""

    node_id: int
    node_name: str
    profile: TaskProfile

    def public(self, now: datetime) -> dict[str, Any]:
        """The plan's JSON view of it (`ProfilingPublic`)."""
        p = self.profile
        return {
            "node_id": self.node_id, "node_name": self.node_name, "profile_id": p.id,
            "status": p.status.value, "requested_at": p.created_at,
            "age_s": max(0.0, (now - _aware(p.created_at)).total_seconds()), "error": p.error,
        }


def _aware(value: datetime) -> datetime:
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _newest_any(session: Session, *, key: str, node_ids: Sequence[int]) -> dict[int, TaskProfile]:
    stmt = (
        select(TaskProfile)
        .where(TaskProfile.task_key == key, TaskProfile.node_id.in_(sorted(set(node_ids))))
        .order_by(TaskProfile.node_id, TaskProfile.created_at.desc(), TaskProfile.id.desc())
    )
    newest: dict[int, TaskProfile] = {}
    for profile in session.scalars(stmt):
        newest.setdefault(profile.node_id, profile)
    return newest


def order_missing_profiles(
    session: Session, *, nodes: Sequence[Node], task: str, task_args: dict[str, Any],
    bundle_sha256: str | None, device: str, created_by: str, now: datetime | None = None,
) -> tuple[list[TaskProfile], list[Profiling]]:
    """Pending profiles for the `nodes` that lack a usable one of the task (flushed, not yet
    sent), and every node the plan waits on (those new ones included)."""
    now = now or datetime.now(UTC)
    ids = [n.id for n in nodes]
    key = task_key(task, task_args, bundle_sha256)
    done = latest_profiles(session, task_key=key, node_ids=ids)
    lacking = [n for n in dict.fromkeys(nodes) if not usable_profile(done.get(n.id))]
    if not lacking:
        return [], []
    newest = _newest_any(session, key=key, node_ids=[n.id for n in lacking])
    ordered: list[TaskProfile] = []
    waiting: list[Profiling] = []
    for node in lacking:
        last = newest.get(node.id)
        if last is not None and last.status is ProfileStatus.pending and now - _aware(last.created_at) < PENDING_LOST_AFTER:
            waiting.append(Profiling(node.id, node.name, last))
            continue
        ended = _aware(last.measured_at or last.created_at) if last is not None else None
        if last is not None and last.status is ProfileStatus.failed and ended is not None \
                and now - ended < FAILED_RETRY_AFTER:
            waiting.append(Profiling(node.id, node.name, last))
            continue
        if node.status is not NodeStatus.online:
            continue  # the plan itself refuses a node that is not online
        profile = TaskProfile(
            node_id=node.id, task_key=key, task=task, task_args=task_args, bundle_sha256=bundle_sha256,
            batch_size=PROFILE_BATCH, device=device, status=ProfileStatus.pending, created_by=created_by,
        )
        ordered.append(profile)
        waiting.append(Profiling(node.id, node.name, profile))
    session.add_all(ordered)
    session.flush()
    return ordered, waiting
