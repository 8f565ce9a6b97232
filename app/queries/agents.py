"""Queries behind the agent endpoints: registration, heartbeats, role events and logs
(docs/architecture.md, "Agent ↔ control plane"); what they do to a run is `app.lifecycle`'s."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Boolean, String, Update, bindparam, case, column, delete, exists, func, select, update, values
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.orm import Session, selectinload
from sqlalchemy.orm.util import identity_key

from app import lifecycle
from app.config import Settings
from app.dispatch import CancelOrder, Order
from app.errors import ConflictError, NotFoundError
from app.models import Node, NodeAgent, NodeStatus, Run, RunLog, RunStatus, RunWorker, WorkerStatus
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES, FINISHED_WORKER_STATUSES
from app.queries.links import join_probe_orders
from app.queries.nodes import node_by_join_token, refresh_mismatch
from app.queries.runs import get_run
from app.schemas.agent import MAX_LINE, HardwareReport, Heartbeat, LogBatch, RoleEvent, RoleState
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


def record_hardware(node: Node, hardware: HardwareReport) -> None:
    """Store what the agent detected next to the declared GPUs, with any mismatch warning."""
    node.detected_hardware = hardware.model_dump(mode="json")
    refresh_mismatch(node)
    if hardware.benchmark is not None:
        node.measured_samples_per_s = hardware.benchmark.samples_per_s


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
    orders: list[Order] = field(default_factory=list)


def _worker(run: Run, rank: int, node: Node) -> RunWorker:
    worker = next((w for w in run.workers if w.rank == rank), None)
    if worker is None:
        raise NotFoundError(f"rank {rank} of run", run.id)
    if worker.node_id != node.id:
        raise ConflictError(f"rank {rank} of run {run.id} is not planned on node {node.name}")
    return worker


def apply_role_event(
    session: Session, *, node: Node, run_id: int, event: RoleEvent, settings: Settings,
    now: datetime | None = None,
) -> EventOutcome:
    """Record a role's start or exit and move the run along its lifecycle."""
    now = now or utcnow()
    run = get_run(session, run_id=run_id, lock=True)
    worker = _worker(run, event.rank, node)
    if event.event == "started":
        stop = lifecycle.rank_started(session, run=run, worker=worker, pid=event.pid, now=now,
                                      attempt=event.attempt)
        held: list[Order] = []
        if stop is None and worker.rank == 0:
            # Rank 0 listens now, on the port its agent names: the other ranks may follow.
            held += lifecycle.release_held(session, run=run, settings=settings, port=event.port, now=now)
        return EventOutcome(run.status, stop_reason=stop, orders=held)
    orders = lifecycle.rank_exited(
        session, run=run, worker=worker, node_name=node.name, exit=_exit(event), settings=settings, now=now,
    )
    return EventOutcome(run.status, orders=orders)


def _exit(event: RoleEvent | RoleState) -> lifecycle.Exit:
    # `attempt` and `cause` arrive from agents that name them (older ones leave them out).
    return lifecycle.Exit(exit_code=event.exit_code, signal=event.signal, cancelled=event.cancelled,
                          reason=event.reason, pid=event.pid, attempt=event.attempt, cause=event.cause)


# -- heartbeats --------------------------------------------------------------------------------


@dataclass
class HeartbeatOutcome:
    stop: list[dict[str, Any]] = field(default_factory=list)
    orders: list[Order] = field(default_factory=list)


@dataclass(frozen=True)
class PlainBeat:
    """A beat `record_plain_beats` may record: its agent token's hash, when, and its GPU readings
    (None: the agent has none to report, and the node keeps its last)."""

    token_hash: str
    at: datetime
    gpus: list[dict[str, Any]] | None


def is_plain(beat: Heartbeat) -> bool:
    """Whether `beat` reports nothing to reconcile (no role, no hardware); its node decides the rest."""
    return not beat.roles and beat.hardware is None


def plain_beat(token: str, beat: Heartbeat, now: datetime | None = None) -> PlainBeat:
    """`beat` of the agent holding `token` as `record_plain_beats` takes it."""
    gpus = [gpu.model_dump() for gpu in beat.gpus] if beat.gpus is not None else None
    return PlainBeat(hash_secret(token), now or utcnow(), gpus)


def record_plain_beat(session: Session, *, token: str, beat: Heartbeat, now: datetime | None = None) -> int | None:
    """Record one beat that has nothing to reconcile (`record_plain_beats`), and return its node's
    id; None if it has work to do, and nothing changed: the beat is `apply_heartbeat`'s."""
    if not is_plain(beat):
        return None
    return next(iter(record_plain_beats(session, [plain_beat(token, beat, now)]).values()), None)


def record_plain_beats(session: Session, beats: Sequence[PlainBeat]) -> dict[str, int]:
    """Record many agents' plain beats in one UPDATE; returns the node id of each token
    hash whose node took its beat. A beat left out changed nothing and is `apply_heartbeat`'s: its
    node is not online, runs a rank or awaits its join probe, or no agent holds its token."""
    if not beats:
        return {}
    nodes, agents, workers, runs = (m.__table__ for m in (Node, NodeAgent, RunWorker, Run))
    given = values(
        column("token_hash", String), column("at", nodes.c.last_heartbeat.type),
        column("gpus", nodes.c.gpu_usage.type), column("has_gpus", Boolean), name="beats",
    ).data([(b.token_hash, b.at, b.gpus, b.gpus is not None) for b in beats]).cte("beats")
    running_here = exists().where(
        workers.c.node_id == nodes.c.id,
        workers.c.status == WorkerStatus.running,
        runs.c.id == workers.c.run_id,
        runs.c.status.in_(ACTIVE_RUN_STATUSES),
    )
    token_hash: Any = given.c.token_hash
    if session.get_bind().dialect.name == "sqlite":
        # SQLite's RETURNING names only the updated table's columns, not UPDATE FROM's others.
        holder = agents.alias("holder")
        token_hash = select(holder.c.token_hash).where(
            holder.c.node_id == nodes.c.id, holder.c.token_hash.in_(select(given.c.token_hash).correlate(None)),
        ).correlate(nodes).scalar_subquery()
    stmt = (
        update(nodes)
        .where(
            agents.c.token_hash == given.c.token_hash,
            nodes.c.id == agents.c.node_id,
            nodes.c.status == NodeStatus.online,
            nodes.c.detected_hardware[PROBE_ON_JOIN].as_boolean().is_not(True),
            ~running_here,
        )
        .values(last_heartbeat=given.c.at, gpu_usage=case((given.c.has_gpus, given.c.gpus), else_=nodes.c.gpu_usage))
        .returning(nodes.c.id, token_hash)
    )
    found = {token_hash: node_id for node_id, token_hash in session.connection().execute(stmt)}
    for node_id in found.values():
        loaded = session.identity_map.get(identity_key(Node, node_id))
        if loaded is not None:
            session.expire(loaded, ["last_heartbeat", "gpu_usage", "updated_at"])
    return found


def apply_heartbeat(
    session: Session, *, node: Node, beat: Heartbeat, grace_s: float, settings: Settings,
    now: datetime | None = None,
) -> HeartbeatOutcome:
    """Mark the node alive and reconcile its roles with the runs' state.

    Roles still running for a run that has ended are listed to stop (a succeeded run's after
    `finish_grace_s`: its workers end by themselves) and their nodes get cancel orders; exits
    whose event was lost are applied; a rank the control plane believes running but the agent
    no longer has (its agent restarted) is lost. `grace_s` covers a heartbeat built before a
    start.
    """
    now = now or utcnow()
    node.last_heartbeat = now
    back = node.status == NodeStatus.offline
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
    if beat.gpus is not None:
        node.gpu_usage = [gpu.model_dump() for gpu in beat.gpus]
    out = HeartbeatOutcome()
    if just_joined:
        node.detected_hardware = {
            k: v for k, v in (node.detected_hardware or {}).items() if k != PROBE_ON_JOIN
        }
        out.orders += join_probe_orders(session, node=node)
    reported = {(r.run_id, r.rank): r for r in beat.roles}
    ended: dict[int, str] = {}
    for (run_id, rank), role in sorted(reported.items()):
        run = session.get(Run, run_id)
        if run is None:
            out.stop.append({"run_id": run_id, "rank": rank, "reason": f"run {run_id} does not exist"})
            continue
        worker = next((w for w in run.workers if w.rank == rank and w.node_id == node.id), None)
        if worker is None:
            if role.state == "running":
                out.stop.append({"run_id": run_id, "rank": rank,
                                 "reason": f"rank {rank} of run {run_id} is not planned here"})
            continue
        if role.state == "running":
            attempt = getattr(role, "attempt", None)
            if attempt is not None and attempt < run.restarts and not run.status.finished:
                # A process of an attempt the run restarted from: only that role stops.
                out.stop.append({"run_id": run_id, "rank": rank, "before_attempt": run.restarts,
                                 "reason": f"run {run_id} restarted: attempt {attempt} is over"})
            elif _must_stop(run, worker, grace_s=settings.finish_grace_s, now=now):
                reason = run.reason or f"run {run_id} has {run.status}"
                out.stop.append({"run_id": run_id, "rank": rank, "reason": reason})
                if _cancel_again(run, now=now, cancel_timeout_s=settings.cancel_timeout_s):
                    ended[run_id] = reason
            continue
        if worker.status not in FINISHED_WORKER_STATUSES or worker.exit_code is None:
            locked = get_run(session, run_id=run_id, lock=True)
            locked_worker = next(w for w in locked.workers if w.rank == rank)
            out.orders += lifecycle.rank_exited(
                session, run=locked, worker=locked_worker, node_name=node.name, exit=_exit(role),
                settings=settings, now=now,
            )
    # The stop list reaches an agent that heartbeats; the cancel order also reaches one whose
    # heartbeat answer is lost, through its queue.
    out.orders += [CancelOrder(node_id=node.id, run_id=r, reason=why) for r, why in sorted(ended.items())]
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
        if w.status != WorkerStatus.running:
            continue
        reason = f"rank {w.rank} ({w.role}) is no longer running on node {node.name} (agent restarted?)"
        out.orders += lifecycle.rank_lost(session, run=run, worker=w, reason=reason, settings=settings, now=now)
    if back:
        # Runs that lost this node's workers while it was away take it back.
        out.orders += lifecycle.rejoin_node(session, node=node, settings=settings, now=now)
    session.flush()
    return out


def _must_stop(run: Run, worker: RunWorker, *, grace_s: float, now: datetime) -> bool:
    if run.status == RunStatus.succeeded and worker.status not in FINISHED_WORKER_STATUSES:
        return run.finished_at is not None and run.finished_at < now - timedelta(seconds=grace_s)
    return run.status.over or worker.status in FINISHED_WORKER_STATUSES


def _cancel_again(run: Run, *, now: datetime, cancel_timeout_s: float) -> bool:
    """Whether a node still running a role of `run` gets a cancel order with its stop list: a
    `cancelling` run's first order is being carried out (a stop waits out the kill grace), so
    only one that seems lost, halfway to the timeout that gives up on the node, is repeated."""
    if run.status != RunStatus.cancelling:
        return True
    asked = run.cancel_requested_at
    return asked is None or asked < now - timedelta(seconds=cancel_timeout_s / 2)


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
    """The newest `tail` lines of each rank (or of one), oldest first within a rank; the caller
    has the run (its page) or checks that it exists (the API)."""
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
