"""Queries behind the agent endpoints and the liveness check: registration, heartbeats, role
events and logs (docs/architecture.md, "Agent ↔ control plane")."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, selectinload

from app.dispatch import CancelOrder, Order
from app.errors import ConflictError, NotFoundError
from app.models import Node, NodeAgent, NodeStatus, Run, RunLog, RunStatus, RunWorker, WorkerStatus
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES, FINISHED_WORKER_STATUSES
from app.queries.links import join_probe_orders
from app.queries.nodes import node_by_join_token
from app.queries.runs import end_run, get_run
from app.schemas.agent import MAX_LINE, HardwareReport, Heartbeat, LogBatch, RoleEvent
from app.security import hash_secret

log = logging.getLogger(__name__)

# Lines kept per rank; older ones are deleted as new ones arrive.
LOG_LINES_KEPT = 2000
# Set in a node's detected hardware when its agent first registers; its next heartbeat (the
# registration's own commit is long done by then, and the agent is consuming its queue) orders
# the probes between it and other nodes, and clears the mark.
PROBE_ON_JOIN = "probe_on_join"


class JoinRefused(Exception):
    """The join token is unknown (401)."""


# -- registration ------------------------------------------------------------------------------


def hardware_mismatch(node: Node, detected_gpus: list[dict[str, Any]]) -> str | None:
    """A warning when the declared GPUs differ from the detected ones, else None."""
    declared = {g.gpu_model.name: g.count for g in node.gpus}
    detected: dict[str, int] = {}
    for gpu in detected_gpus:
        detected[gpu["model"]] = detected.get(gpu["model"], 0) + int(gpu["count"])
    if declared == detected:
        return None

    def show(gpus: dict[str, int]) -> str:
        return ", ".join(f"{n}x {m}" for m, n in sorted(gpus.items())) or "no GPU"

    return (
        f"declared {show(declared)} but the agent detected {show(detected)}; runs are planned "
        "with the declared GPUs unless allocation 'measured' is asked for"
    )


def record_hardware(node: Node, hardware: HardwareReport) -> None:
    """Store what the agent detected next to the declared GPUs, with any mismatch warning."""
    node.detected_hardware = hardware.model_dump(mode="json")
    refresh_mismatch(node)
    if hardware.benchmark is not None:
        node.measured_samples_per_s = hardware.benchmark.samples_per_s


def refresh_mismatch(node: Node) -> None:
    """Recompute the declared-versus-detected warning (the declared GPUs may have been edited)."""
    if node.detected_hardware is None:
        return
    warning = hardware_mismatch(node, node.detected_hardware.get("gpus") or [])
    if node.detected_hardware.get("mismatch", "unset") != warning:
        if warning:
            log.warning("node %s (id %s): %s", node.name, node.id, warning)
        # A new dict: the JSON column sees assignments, not in-place changes.
        node.detected_hardware = {**node.detected_hardware, "mismatch": warning}


def register_agent(
    session: Session, *, join_token: str, agent_token: str, hardware: HardwareReport
) -> tuple[Node, bool]:
    """Bind an agent to the node of `join_token`; idempotent for the same agent token.

    Returns the node and whether this call bound the agent (False for a repeat)."""
    node = node_by_join_token(session, join_token=join_token)
    if node is None:
        raise JoinRefused("unknown join token")
    token_hash = hash_secret(agent_token)
    agent = session.get(NodeAgent, node.id)
    if agent is not None and agent.token_hash != token_hash:
        if agent.join_token_hash == node.join_token_hash:
            raise ConflictError(
                f"the join token of node {node.name} was already used by another agent; issue a "
                f"new one (POST /api/v1/nodes/{node.id}/join-token) to move the node"
            )
        # The join token was rotated since: the new one may bind a new agent.
        session.delete(agent)
        session.flush()
        agent = None
    created = agent is None
    if agent is None:
        clash = session.scalar(select(NodeAgent).where(NodeAgent.token_hash == token_hash))
        if clash is not None:
            raise ConflictError("this agent token is already bound to another node")
        session.add(
            NodeAgent(
                node_id=node.id, token_hash=token_hash, join_token_hash=node.join_token_hash,
                hostname=hardware.hostname,
            )
        )
    record_hardware(node, hardware)
    if created:
        node.detected_hardware = {**(node.detected_hardware or {}), PROBE_ON_JOIN: True}
    if not node.address and hardware.address:
        node.address = hardware.address
    node.last_heartbeat = utcnow()
    if node.status in (NodeStatus.pending, NodeStatus.offline):
        node.status = NodeStatus.online
    session.flush()
    return node, created


def node_by_agent_token(session: Session, *, token: str) -> Node | None:
    """The node whose agent holds this token, if any."""
    return session.scalar(
        select(Node)
        .join(NodeAgent, NodeAgent.node_id == Node.id)
        .where(NodeAgent.token_hash == hash_secret(token))
        .options(selectinload(Node.gpus))
    )


# -- role events -------------------------------------------------------------------------------


@dataclass
class EventOutcome:
    """What a role event did: the run's status, orders to send, and whether the role must stop."""

    run_status: RunStatus
    stop_reason: str | None = None
    orders: list[CancelOrder] = field(default_factory=list)


def _worker(run: Run, rank: int, node: Node) -> RunWorker:
    worker = next((w for w in run.workers if w.rank == rank), None)
    if worker is None:
        raise NotFoundError(f"rank {rank} of run", run.id)
    if worker.node_id != node.id:
        raise ConflictError(f"rank {rank} of run {run.id} is not planned on node {node.name}")
    return worker


def apply_role_event(
    session: Session, *, node: Node, run_id: int, event: RoleEvent, now: datetime | None = None
) -> EventOutcome:
    """Record a role's start or exit and move the run along its lifecycle."""
    now = now or utcnow()
    run = get_run(session, run_id=run_id, lock=True)
    worker = _worker(run, event.rank, node)
    if event.event == "started":
        if run.status.finished:
            return EventOutcome(run.status, stop_reason=f"run {run.id} has {run.status}")
        if worker.status in (WorkerStatus.planned, WorkerStatus.launched):
            worker.status = WorkerStatus.running
            worker.pid = event.pid
            worker.started_at = now
        if run.status in (RunStatus.queued, RunStatus.launching) and all(
            w.status == WorkerStatus.running or w.status in FINISHED_WORKER_STATUSES
            for w in run.workers
        ):
            run.status = RunStatus.running
            run.started_at = now
        session.flush()
        return EventOutcome(run.status)
    return EventOutcome(run.status, orders=_apply_exit(session, run=run, worker=worker, node=node, event=event, now=now))


def _apply_exit(
    session: Session, *, run: Run, worker: RunWorker, node: Node, event: RoleEvent, now: datetime
) -> list[CancelOrder]:
    # The first report of an exit wins (an event and a heartbeat may both carry it); a rank
    # that the run's end already marked cancelled still gets its exit code.
    if worker.exit_code is None and worker.signal is None:
        worker.exit_code = event.exit_code
        worker.signal = event.signal
        worker.pid = worker.pid or event.pid
    if worker.status in FINISHED_WORKER_STATUSES:
        worker.finished_at = worker.finished_at or now
        session.flush()
        return []
    worker.finished_at = now
    where = f"on node {node.name}"
    if event.cancelled:
        worker.status = WorkerStatus.cancelled
        worker.reason = event.reason
        failure = f"{event.reason or f'rank {worker.rank} was stopped'} {where}"
    elif event.exit_code == 0:
        worker.status = WorkerStatus.succeeded
        failure = None
    else:
        worker.status = WorkerStatus.failed
        worker.reason = event.reason or _exit_text(worker.rank, worker.role, event)
        failure = f"{worker.reason} {where}"
    session.flush()
    if run.status.finished:
        return []
    if failure is not None:
        # A rank that stops early leaves the others waiting on it: the run cannot go on.
        return end_run(session, run=run, status=RunStatus.failed, reason=failure, now=now)
    if all(w.status == WorkerStatus.succeeded for w in run.workers):
        end_run(session, run=run, status=RunStatus.succeeded, reason=None, now=now)
    return []


def _exit_text(rank: int, role: str, event: RoleEvent) -> str:
    if event.signal:
        return f"rank {rank} ({role}) was killed by signal {event.signal}"
    return f"rank {rank} ({role}) exited with code {event.exit_code}"


# -- heartbeats --------------------------------------------------------------------------------


@dataclass
class HeartbeatOutcome:
    stop: list[dict[str, Any]] = field(default_factory=list)
    orders: list[Order] = field(default_factory=list)


def apply_heartbeat(
    session: Session, *, node: Node, beat: Heartbeat, grace_s: float, now: datetime | None = None
) -> HeartbeatOutcome:
    """Mark the node alive and reconcile its roles with the runs' state.

    Roles still running for a run that has ended are listed to stop; exits whose event was
    lost are applied; a rank the control plane believes running but the agent no longer has
    (its agent restarted) fails its run. `grace_s` covers a heartbeat built before a start.
    """
    now = now or utcnow()
    node.last_heartbeat = now
    if node.status in (NodeStatus.pending, NodeStatus.offline):
        log.info("node %s (id %s) is online", node.name, node.id)
        node.status = NodeStatus.online
    just_joined = bool((node.detected_hardware or {}).get(PROBE_ON_JOIN))
    if beat.hardware is not None:
        record_hardware(node, beat.hardware)
        if not node.address and beat.hardware.address:
            node.address = beat.hardware.address
    else:
        refresh_mismatch(node)
    out = HeartbeatOutcome()
    if just_joined:
        node.detected_hardware = {
            k: v for k, v in (node.detected_hardware or {}).items() if k != PROBE_ON_JOIN
        }
        out.orders += join_probe_orders(session, node=node)
    reported = {(r.run_id, r.rank): r for r in beat.roles}
    runs: dict[int, Run] = {}
    for (run_id, rank), role in sorted(reported.items()):
        run = runs.get(run_id) or session.get(Run, run_id)
        if run is None:
            out.stop.append({"run_id": run_id, "rank": rank, "reason": f"run {run_id} does not exist"})
            continue
        runs[run_id] = run
        worker = next((w for w in run.workers if w.rank == rank and w.node_id == node.id), None)
        if worker is None:
            if role.state == "running":
                out.stop.append({"run_id": run_id, "rank": rank,
                                 "reason": f"rank {rank} of run {run_id} is not planned here"})
            continue
        if role.state == "running":
            if run.status.finished or worker.status in FINISHED_WORKER_STATUSES:
                out.stop.append({"run_id": run_id, "rank": rank,
                                 "reason": run.reason or f"run {run_id} has {run.status}"})
            continue
        if worker.status not in FINISHED_WORKER_STATUSES or worker.exit_code is None:
            locked = get_run(session, run_id=run_id, lock=True)
            locked_worker = next(w for w in locked.workers if w.rank == rank)
            event = RoleEvent(
                rank=rank, role=role.role, event="exited", pid=role.pid, exit_code=role.exit_code,
                signal=role.signal, cancelled=role.cancelled, reason=role.reason,
            )
            out.orders += _apply_exit(session, run=locked, worker=locked_worker, node=node, event=event, now=now)
    # Ranks this node should be running but no longer reports.
    missing = session.scalars(
        select(RunWorker)
        .join(Run, Run.id == RunWorker.run_id)
        .where(
            RunWorker.node_id == node.id,
            RunWorker.status == WorkerStatus.running,
            RunWorker.started_at < now - timedelta(seconds=grace_s),
            Run.status.in_(ACTIVE_RUN_STATUSES),
        )
    ).all()
    for worker in missing:
        if (worker.run_id, worker.rank) in reported:
            continue
        run = get_run(session, run_id=worker.run_id, lock=True)
        w = next(x for x in run.workers if x.rank == worker.rank)
        w.status = WorkerStatus.failed
        w.finished_at = now
        w.reason = f"rank {w.rank} ({w.role}) is no longer running on node {node.name} (agent restarted?)"
        out.orders += end_run(session, run=run, status=RunStatus.failed, reason=w.reason, now=now)
    session.flush()
    return out


# -- liveness (the periodic check) -------------------------------------------------------------


def check_liveness(
    session: Session,
    *,
    heartbeat_timeout_s: float,
    launch_timeout_s: float,
    now: datetime | None = None,
) -> list[CancelOrder]:
    """Mark silent nodes offline and fail the runs that depended on them or never started.

    1. Online nodes whose last heartbeat is older than `heartbeat_timeout_s` go offline.
    2. Active runs with an unfinished rank on an offline node fail, naming the node.
    3. Runs still launching after `launch_timeout_s` fail, naming the ranks that never started.
    """
    now = now or utcnow()
    cutoff = now - timedelta(seconds=heartbeat_timeout_s)
    orders: list[CancelOrder] = []
    stale = session.scalars(
        select(Node)
        .where(Node.status == NodeStatus.online, Node.last_heartbeat < cutoff)
        .with_for_update(skip_locked=True)
    ).all()
    for node in stale:
        log.warning("node %s (id %s) missed heartbeats since %s: offline", node.name, node.id, node.last_heartbeat)
        node.status = NodeStatus.offline
    session.flush()

    affected = session.scalars(
        select(Run)
        .join(RunWorker, RunWorker.run_id == Run.id)
        .join(Node, Node.id == RunWorker.node_id)
        .where(
            Run.status.in_(ACTIVE_RUN_STATUSES),
            Node.status == NodeStatus.offline,
            RunWorker.status.not_in(FINISHED_WORKER_STATUSES),
        )
        .distinct()
    ).all()
    for candidate in affected:
        run = get_run(session, run_id=candidate.id, lock=True)
        if run.status.finished:
            continue
        dead = [w for w in run.workers if w.status not in FINISHED_WORKER_STATUSES
                and w.node_id is not None and session.get(Node, w.node_id).status == NodeStatus.offline]
        if not dead:
            continue
        node = session.get(Node, dead[0].node_id)
        seen = node.last_heartbeat.isoformat(timespec="seconds") if node.last_heartbeat else "never"
        reason = (
            f"node {node.name} went offline: no heartbeat for {heartbeat_timeout_s:.0f} s "
            f"(last {seen}); rank(s) {', '.join(str(w.rank) for w in dead)} lost"
        )
        for w in dead:
            w.status = WorkerStatus.failed
            w.reason = reason
            w.finished_at = now
        orders += end_run(session, run=run, status=RunStatus.failed, reason=reason, now=now,
                          skip_nodes=[w.node_id for w in dead if w.node_id is not None])

    late = session.scalars(
        select(Run).where(
            Run.status == RunStatus.launching,
            Run.launched_at < now - timedelta(seconds=launch_timeout_s),
        )
    ).all()
    for candidate in late:
        run = get_run(session, run_id=candidate.id, lock=True)
        if run.status != RunStatus.launching:
            continue
        waiting = [w for w in run.workers if w.status in (WorkerStatus.planned, WorkerStatus.launched)]
        if not waiting:
            continue
        reason = "rank(s) {} did not start within {:.0f} s (on {})".format(
            ", ".join(str(w.rank) for w in waiting), launch_timeout_s,
            ", ".join(sorted({w.node_name for w in waiting})),
        )
        orders += end_run(session, run=run, status=RunStatus.failed, reason=reason, now=now)
    session.flush()
    return orders


# -- logs --------------------------------------------------------------------------------------


def store_logs(session: Session, *, node: Node, run_id: int, batch: LogBatch) -> int:
    """Store a batch of a role's output once per (run, rank, seq); keep the newest lines."""
    run = session.get(Run, run_id)
    if run is None:
        raise NotFoundError("run", run_id)
    if not any(w.rank == batch.rank and w.node_id == node.id for w in run.workers):
        raise ConflictError(f"rank {batch.rank} of run {run_id} is not planned on node {node.name}")
    rows = [
        {"run_id": run_id, "rank": batch.rank, "seq": line.seq, "t": line.t, "line": line.line}
        for line in batch.lines
    ]
    if batch.dropped and rows:
        # The gap is noted on the first line after it, so the log reads as it happened.
        note = f"[agent: {batch.dropped} line(s) dropped while the control plane was unreachable] "
        rows[0]["line"] = (note + rows[0]["line"])[:MAX_LINE]
    if not rows:
        return 0
    insert = pg_insert if session.get_bind().dialect.name == "postgresql" else sqlite_insert
    stmt = insert(RunLog.__table__).on_conflict_do_nothing(index_elements=["run_id", "rank", "seq"])
    stored = session.connection().execute(stmt, rows).rowcount or 0
    newest = session.scalar(
        select(func.max(RunLog.seq)).where(RunLog.run_id == run_id, RunLog.rank == batch.rank)
    )
    if newest is not None and newest >= LOG_LINES_KEPT:
        session.execute(
            delete(RunLog).where(
                RunLog.run_id == run_id, RunLog.rank == batch.rank,
                RunLog.seq <= newest - LOG_LINES_KEPT,
            )
        )
    session.flush()
    return stored


def read_logs(session: Session, *, run_id: int, rank: int | None, tail: int) -> Sequence[RunLog]:
    """The newest `tail` lines of each rank (or of one), oldest first within a rank."""
    get_run(session, run_id=run_id)
    ranks = [rank] if rank is not None else session.scalars(
        select(RunLog.rank).where(RunLog.run_id == run_id).distinct().order_by(RunLog.rank)
    ).all()
    lines: list[RunLog] = []
    for r in ranks:
        newest = session.scalars(
            select(RunLog)
            .where(RunLog.run_id == run_id, RunLog.rank == r)
            .order_by(RunLog.seq.desc())
            .limit(tail)
        ).all()
        lines.extend(reversed(newest))
    return lines
