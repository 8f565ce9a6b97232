"""The queue for GPUs: which GPUs each active run holds, which queued runs may start, and
starting them.

A run holds the GPU of each of its ranks (node, `gpu_index`) from its launch until it ends,
whatever its ranks are doing meanwhile. A rank without a GPU (a PS server, a CPU-only node)
holds nothing: a server is CPU-side and may sit beside any run. Two runs hold one GPU
together only when both asked to share (`share_gpus`).

Queued runs are taken in (priority desc, id) order. A run starts when none of its GPUs is held
by a run it may not share with, none is claimed by a run ahead of it in the queue, and all its
nodes are online (a draining or offline node keeps it waiting). A run ahead that waits claims
its GPUs, so a later run needing one of them waits behind it (first come, first served on
each GPU), while a later run on other GPUs starts at once rather than idle behind it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy import exists, select
from sqlalchemy.orm import Session, selectinload

from app.config import Settings
from app.dispatch import LaunchOrder
from app.lifecycle.launch import launch_leader, orders_for
from app.lifecycle.lock import schedule_lock
from app.lifecycle.ports import suggest_port
from app.lifecycle.states import move
from app.models import Node, NodeStatus, Run, RunStatus, RunWorker
from app.models.base import utcnow
from app.models.runs import ACTIVE_RUN_STATUSES

# Active runs past the queue: these hold their GPUs.
HOLDING = ACTIVE_RUN_STATUSES - {RunStatus.queued}
# How many reasons a waiting run lists (a run on many GPUs of one busy run would repeat it).
MAX_REASONS = 8

Gpu = tuple[int, int]  # (node id, GPU index on it)


@dataclass(frozen=True)
class Holder:
    """A run holding (or about to hold) a GPU."""

    run_id: int
    share: bool


@dataclass
class QueueView:
    """The queue as it stands: each queued run's position (1 starts next), why it waits, and
    the runs that may start now."""

    position: dict[int, int] = field(default_factory=dict)
    waiting_for: dict[int, list[str]] = field(default_factory=dict)
    ready: list[Run] = field(default_factory=list)


def gpus_of(run: Run) -> set[Gpu]:
    """The GPUs `run` holds while active: one per rank that has a GPU index."""
    return {(w.node_id, w.gpu_index) for w in run.workers if w.node_id is not None and w.gpu_index is not None}


def _held(session: Session) -> dict[Gpu, list[Holder]]:
    rows = session.execute(
        select(RunWorker.node_id, RunWorker.gpu_index, Run.id, Run.share_gpus)
        .join(Run, Run.id == RunWorker.run_id)
        .where(Run.status.in_(HOLDING), RunWorker.node_id.is_not(None), RunWorker.gpu_index.is_not(None))
        .distinct()
    ).all()
    held: dict[Gpu, list[Holder]] = defaultdict(list)
    for node_id, index, run_id, share in rows:
        held[(node_id, index)].append(Holder(run_id, bool(share)))
    return held


def _conflicts(run: Run, holders: list[Holder]) -> list[int]:
    return sorted({h.run_id for h in holders if h.run_id != run.id and not (run.share_gpus and h.share)})


def queue_view(session: Session) -> QueueView:
    """Walk the queue in order and say which runs may start and why the others wait."""
    queued = session.scalars(
        select(Run).where(Run.status == RunStatus.queued)
        .order_by(Run.priority.desc(), Run.id).options(selectinload(Run.workers))
    ).all()
    view = QueueView()
    if not queued:
        return view
    held = _held(session)
    node_ids = {w.node_id for r in queued for w in r.workers if w.node_id is not None}
    nodes = {n.id: n for n in session.scalars(select(Node).where(Node.id.in_(node_ids))).all()}
    claimed: dict[Gpu, list[Holder]] = defaultdict(list)
    for position, run in enumerate(queued, start=1):
        view.position[run.id] = position
        reasons: list[str] = []
        for worker in run.workers:
            node = nodes.get(worker.node_id) if worker.node_id is not None else None
            if node is None:
                reasons.append(f"rank {worker.rank}'s node {worker.node_name} was deleted")
            elif node.status != NodeStatus.online:
                reasons.append(f"node {node.name} is {node.status}")
        for gpu in sorted(gpus_of(run)):
            name = nodes[gpu[0]].name if gpu[0] in nodes else str(gpu[0])
            reasons += [f"node {name} GPU {gpu[1]} is held by run {r}" for r in _conflicts(run, held.get(gpu, []))]
            reasons += [f"run {r}, ahead in the queue, needs node {name} GPU {gpu[1]}"
                        for r in _conflicts(run, claimed.get(gpu, []))]
        reasons = list(dict.fromkeys(reasons))[:MAX_REASONS]
        mine = Holder(run.id, run.share_gpus)
        for gpu in gpus_of(run):
            (claimed if reasons else held)[gpu].append(mine)
        if reasons:
            view.waiting_for[run.id] = reasons
        else:
            view.ready.append(run)
    return view


def start_queued(session: Session, *, settings: Settings, now: datetime | None = None) -> list[LaunchOrder]:
    """Start every queued run that may start now; returns their launch orders, to send after
    commit (an order lost on the way is sent again by the liveness pass)."""
    if not session.scalar(select(exists().where(Run.status == RunStatus.queued))):
        return []
    now = now or utcnow()
    # One scheduler at a time: two would both see a GPU free and start two runs on it.
    schedule_lock(session)
    view = queue_view(session)
    held = _held(session)
    orders: list[LaunchOrder] = []
    for candidate in view.ready:
        # A queued run locked by another transaction is being cancelled or started: leave it.
        run = session.scalar(
            select(Run).where(Run.id == candidate.id, Run.status == RunStatus.queued)
            .with_for_update(skip_locked=True).execution_options(populate_existing=True)
        )
        if run is None:
            continue
        session.refresh(run, ["workers"])
        for worker in run.workers:
            if worker.node_id is not None and worker.gpu_index is not None:
                # The share at launch: this run and the sharing runs already on the GPU.
                others = {h.run_id for h in held.get((worker.node_id, worker.gpu_index), []) if h.run_id != run.id}
                worker.sharers = 1 + len(others)
        for gpu in gpus_of(run):
            held[gpu].append(Holder(run.id, run.share_gpus))
        move(run, RunStatus.launching, now=now)
        # Suggested now rather than at creation: a run may wait long in the queue.
        run.master_port = suggest_port(session, run=run)
        # Rank 0 first: the others follow once it has named its port (launch.release_held).
        leader = launch_leader(run, now=now)
        session.flush()
        orders += orders_for(session, run=run, settings=settings, ranks=leader)
    return orders
