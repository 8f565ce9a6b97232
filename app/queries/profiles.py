"""Queries of task profiles (a task's measured speed on each node)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.dispatch import ProfileOrder
from app.errors import ConflictError, InvalidFieldError, NotFoundError
from app.models import Node, NodeStatus, ProfileStatus, TaskProfile
from app.models.base import utcnow
from app.queries.bundles import get_bundle
from app.queries.common import paginate
from app.schemas.profiles import ProfileCreate, ProfileReport
from hybridtrain.contract import check_metric_name, check_task_ref

MAX_TASK_ARGS_CHARS = 16_384
MAX_ERROR_CHARS = 4000
# The task of the profiles a script run's measurements make (app.queries.run_profiles).
SCRIPT_PREFIX = "script:"


def task_key(task: str, task_args: dict[str, Any] | None, bundle_sha256: str | None) -> str:
    """sha256 of the canonical JSON of what a profile measures: the same code, task and args."""
    canonical = json.dumps(
        {"bundle_sha256": bundle_sha256, "task": task, "task_args": task_args or {}},
        sort_keys=True, separators=(",", ":"), ensure_ascii=True,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()


def profiled_as(
    *, task: str, task_args: dict[str, Any] | None, script: str | None, script_args: list[str] | None
) -> tuple[str, dict[str, Any]]:
    """What a run's profiles are filed under: its task and arguments, or, for a script run,
    `script:PATH` and the script's arguments (a script is measured by running it)."""
    if script is None:
        return task, task_args or {}
    return f"{SCRIPT_PREFIX}{script}", {"script_args": list(script_args or [])}


def latest_profiles(
    session: Session, *, task_key: str, node_ids: Iterable[int]
) -> dict[int, TaskProfile]:
    """The newest finished (`done`) profile of `task_key` on each of `node_ids` that has one."""
    ids = sorted(set(node_ids))
    if not ids:
        return {}
    stmt = (
        select(TaskProfile)
        .where(
            TaskProfile.task_key == task_key,
            TaskProfile.node_id.in_(ids),
            TaskProfile.status == ProfileStatus.done,
        )
        .order_by(
            TaskProfile.node_id, TaskProfile.measured_at.desc().nulls_last(), TaskProfile.id.desc()
        )
    )
    newest: dict[int, TaskProfile] = {}
    for profile in session.scalars(stmt):
        newest.setdefault(profile.node_id, profile)
    return newest


def _check_task_args(task_args: dict[str, Any]) -> None:
    # JSONB holds neither NaN nor NUL characters; refuse them here rather than as a 503.
    try:
        text = json.dumps(task_args, allow_nan=False)
    except ValueError:
        raise InvalidFieldError("task_args", "task_args may not hold NaN or infinite numbers") from None
    if "\\u0000" in text:
        raise InvalidFieldError("task_args", "task_args may not hold NUL characters")
    if len(text) > MAX_TASK_ARGS_CHARS:
        raise InvalidFieldError(
            "task_args", f"task_args is longer than {MAX_TASK_ARGS_CHARS} characters as JSON"
        )


def create_profiles(
    session: Session, *, data: ProfileCreate, created_by: str
) -> list[TaskProfile]:
    """One pending profile per node; every node must exist and be online."""
    try:
        check_task_ref(data.task)
    except ValueError as exc:
        raise InvalidFieldError("task", str(exc)) from None
    _check_task_args(data.task_args)
    if data.bundle_sha256 is not None:
        get_bundle(session, sha256=data.bundle_sha256, field="bundle_sha256")
    seen: set[int] = set()
    for i, node_id in enumerate(data.node_ids):
        if node_id in seen:
            raise InvalidFieldError(f"node_ids.{i}", f"node {node_id} is listed twice")
        seen.add(node_id)
        node = session.get(Node, node_id)
        if node is None:
            raise NotFoundError("node", node_id, field=f"node_ids.{i}")
        if node.status is not NodeStatus.online:
            raise ConflictError(f"node {node_id} is {node.status}, not online: its agent cannot profile")
    key = task_key(data.task, data.task_args, data.bundle_sha256)
    profiles = [
        TaskProfile(
            node_id=node_id, task_key=key, task=data.task, task_args=data.task_args,
            bundle_sha256=data.bundle_sha256, batch_size=data.batch_size, device=data.device,
            status=ProfileStatus.pending, created_by=created_by,
        )
        for node_id in data.node_ids
    ]
    session.add_all(profiles)
    session.flush()
    return profiles


def profile_orders(profiles: Iterable[TaskProfile]) -> list[ProfileOrder]:
    """The order that asks each profile's node to measure it (send after commit)."""
    orders = []
    for profile in profiles:
        bundle = None
        if profile.bundle_sha256 is not None:
            bundle = {"sha256": profile.bundle_sha256, "path": agent_bundle_path(profile.id)}
        spec = {
            "task": profile.task, "task_args": profile.task_args, "bundle": bundle,
            "batch_size": profile.batch_size, "device": profile.device,
        }
        orders.append(ProfileOrder(node_id=profile.node_id, profile_id=profile.id, spec=spec))
    return orders


def agent_bundle_path(profile_id: int) -> str:
    """The path under the control plane's URL where an agent fetches a profile's bundle."""
    return f"/api/v1/agent/profiles/{profile_id}/bundle"


def get_profile(session: Session, *, profile_id: int) -> TaskProfile:
    """The profile with this id, or NotFoundError."""
    profile = session.get(TaskProfile, profile_id)
    if profile is None:
        raise NotFoundError("task profile", profile_id)
    return profile


def list_profiles(
    session: Session, *, skip: int, limit: int, task_key: str | None = None,
    node_id: int | None = None,
) -> tuple[Sequence[TaskProfile], int]:
    """A page of profiles matching the filters, newest first."""
    stmt = select(TaskProfile).order_by(TaskProfile.id.desc())
    if task_key is not None:
        stmt = stmt.where(TaskProfile.task_key == task_key)
    if node_id is not None:
        stmt = stmt.where(TaskProfile.node_id == node_id)
    return paginate(session, stmt, skip=skip, limit=limit)


def fail_profiles(session: Session, *, profiles: Iterable[TaskProfile], error: str) -> None:
    """Mark pending profiles failed (their orders could not be sent)."""
    now = utcnow()
    for profile in profiles:
        if profile.status is ProfileStatus.pending:
            profile.status = ProfileStatus.failed
            profile.error = error
            profile.measured_at = now
    session.flush()


def profile_of_agent(
    session: Session, *, profile_id: int, node: Node, lock: bool = False
) -> TaskProfile:
    """The profile, when it was ordered from this agent's node (PermissionError otherwise)."""
    stmt = select(TaskProfile).where(TaskProfile.id == profile_id)
    if lock:
        stmt = stmt.with_for_update()
    profile = session.scalar(stmt)
    if profile is None:
        raise NotFoundError("task profile", profile_id)
    if profile.node_id != node.id:
        raise PermissionError(f"task profile {profile_id} was ordered from another node")
    return profile


def record_report(session: Session, *, profile: TaskProfile, report: ProfileReport) -> TaskProfile:
    """Store an agent's result; a repeat of a finished profile changes nothing (agents retry)."""
    if profile.status is not ProfileStatus.pending:
        return profile
    if report.status == "done":
        if report.result is None:
            raise InvalidFieldError("result", "a done report needs its result")
        for name in report.result.metrics:
            try:
                check_metric_name(name)
            except ValueError as exc:
                raise InvalidFieldError("result.metrics", str(exc)) from None
        result = report.result
        profile.status = ProfileStatus.done
        profile.params = result.params
        profile.train_samples = result.train_samples
        profile.eval_samples = result.eval_samples
        profile.samples_per_s = result.samples_per_s
        profile.step_s = result.step_s
        profile.spread = result.spread
        profile.repeats = result.repeats
        profile.metrics = dict(result.metrics)
        # The whole result: the performance model's inputs ride along (app.queries.predictions).
        profile.result = result.model_dump(mode="json")
        profile.error = None
    else:
        if not report.error:
            raise InvalidFieldError("error", "a failed report needs its error")
        profile.status = ProfileStatus.failed
        # Postgres text holds no NUL; the end of a long error is where its cause is.
        profile.error = report.error.replace("\x00", "")[-MAX_ERROR_CHARS:]
    profile.measured_at = utcnow()
    session.flush()
    return profile
