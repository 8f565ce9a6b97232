"""The node agents' endpoints: register, heartbeat, role events, logs and spooled metrics
(docs/architecture.md, "Agent ↔ control plane")."""

from __future__ import annotations

import logging

import anyio.to_thread
from fastapi import APIRouter, HTTPException, Request, Response, status
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from app.api.deps import AgentNodeDep, AgentTokenDep, BeatBatchesDep, DispatcherDep, IdPath, SessionDep, SettingsDep, agent_node
from app.api.responses import CONFLICT, NOT_FOUND_OR_CONFLICT
from app.broker_access import BrokerAccessError, BrokerOutOfReach, agent_broker, keep_node_user
from app.capacity import heartbeat_limiter
from app.config import Settings
from app.models import NodeAgent, NodeStatus
from app.schemas.common import ErrorMessage
from app.dispatch import Dispatcher, LaunchOrder, node_queue
from app.queries import agents as queries
from app.queries.reports import store_spooled_report
from app.queries.runs import get_run
from app.schemas.reports import ReportBatch
from app.schemas.runs import MetricsStored
from app.lifecycle import run_state_lock, start_queued
from app.lifecycle.liveness import heartbeat_interval_s
from app.security import hash_secret
from app.schemas.agent import (
    AgentBroker,
    AgentRegister,
    AgentRegistered,
    Heartbeat,
    HeartbeatAnswer,
    LogBatch,
    LogsStored,
    RoleEvent,
    RoleEventAnswer,
    StopOrder,
)

log = logging.getLogger(__name__)
router = APIRouter()


@router.post(
    "/register",
    response_model=AgentRegistered,
    status_code=status.HTTP_201_CREATED,
    responses={**CONFLICT, 200: {"model": AgentRegistered, "description": "Already bound to this agent"}},
)
def register_agent(
    session: SessionDep, settings: SettingsDep, body: AgentRegister, response: Response
) -> AgentRegistered:
    """Bind the agent that presents a node's join token to that node."""
    try:
        node, created = queries.register_agent(
            session, join_token=body.join_token, agent_token=body.agent_token, hardware=body.hardware
        )
    except queries.JoinRefused as exc:
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "unknown join token", headers={"WWW-Authenticate": "Bearer"}
        ) from exc
    session.commit()
    if not created:
        response.status_code = status.HTTP_200_OK
    return AgentRegistered(
        node_id=node.id, node_name=node.name, queue=node_queue(node.id),
        heartbeat_interval_s=heartbeat_interval_s(settings),
    )


@router.post(
    "/broker",
    response_model=AgentBroker,
    responses={
        409: {"model": ErrorMessage, "description": "The broker is on loopback and the agent on another host"},
        503: {"model": ErrorMessage, "description": "The broker refused to set up the node's user"},
    },
)
def broker_for_agent(session: SessionDep, settings: SettingsDep, node: AgentNodeDep, request: Request) -> AgentBroker:
    """The broker this node's agent takes its orders from; on Redis with a user of the node's
    own, limited to its queue, (re)set by this call."""
    agent = session.get(NodeAgent, node.id)
    assert agent is not None  # the agent token just resolved to this node through it
    client_host = request.client.host if request.client else None
    try:
        broker = agent_broker(settings, node_id=node.id, agent_token_hash=agent.token_hash, client_host=client_host)
    except BrokerOutOfReach as exc:
        raise HTTPException(status.HTTP_409_CONFLICT, str(exc)) from exc
    except BrokerAccessError as exc:
        raise HTTPException(status.HTTP_503_SERVICE_UNAVAILABLE, str(exc)) from exc
    return AgentBroker(url=broker.url, node_user=broker.node_user)


@router.post("/heartbeat", response_model=HeartbeatAnswer)
async def heartbeat(
    session: SessionDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    token: AgentTokenDep,
    body: Heartbeat,
    batches: BeatBatchesDep,
) -> HeartbeatAnswer:
    """Keep the node online; answer with the roles it should stop."""
    tried_plain = False
    if batches is not None and queries.is_plain(body):
        # Most beats say "alive, nothing changed": written with the others arriving together, in
        # one UPDATE that also checks each token (app/beat_batches.py).
        node_id = await batches.record(session, queries.plain_beat(token, body), heartbeat_limiter(settings))
        if node_id is not None:
            if body.broker_user:
                await run_in_threadpool(_keep_broker_user, settings, node_id=node_id, agent_token_hash=hash_secret(token))
            return HeartbeatAnswer(node_id=node_id, status=str(NodeStatus.online), stop=[])
        tried_plain = True
    # One worker thread, of the heartbeats' few, for the whole beat (docs/control-plane.md, "Capacity").
    return await anyio.to_thread.run_sync(_beat, session, settings, dispatcher, token, body, tried_plain,
                                          limiter=heartbeat_limiter(settings))


def _beat(session: Session, settings: Settings, dispatcher: Dispatcher, token: str, body: Heartbeat,
          tried_plain: bool) -> HeartbeatAnswer:
    outcome = queries.HeartbeatOutcome()
    launches: list[LaunchOrder] = []
    with run_state_lock(settings.is_sqlite):
        # On SQLite (one writer) a plain beat is one UPDATE of its own, which also checks the token.
        node_id = None if tried_plain else queries.record_plain_beat(session, token=token, beat=body)
        status_now = NodeStatus.online
        if node_id is None:
            node = agent_node(session, token)
            grace = max(10.0, 2 * heartbeat_interval_s(settings))
            outcome = queries.apply_heartbeat(session, node=node, beat=body, grace_s=grace, settings=settings)
            # A run this beat ended, or a node back online, may let queued runs start.
            launches = start_queued(session, settings=settings)
            node_id, status_now = node.id, node.status
        session.commit()
    dispatcher.send_quietly([*outcome.orders, *launches])
    if body.broker_user:
        _keep_broker_user(settings, node_id=node_id, agent_token_hash=hash_secret(token))
    return HeartbeatAnswer(node_id=node_id, status=str(status_now), stop=[StopOrder(**s) for s in outcome.stop])


def _keep_broker_user(settings: Settings, *, node_id: int, agent_token_hash: str) -> None:
    try:
        if keep_node_user(settings, node_id=node_id, agent_token_hash=agent_token_hash):
            log.warning("the broker had lost node %s's user (restarted without an ACL file?); re-created it", node_id)
    except BrokerAccessError as exc:
        log.warning("%s", exc)


@router.post("/runs/{run_id}/events", response_model=RoleEventAnswer, responses=NOT_FOUND_OR_CONFLICT)
def report_role_event(
    session: SessionDep,
    settings: SettingsDep,
    dispatcher: DispatcherDep,
    node: AgentNodeDep,
    run_id: IdPath,
    body: RoleEvent,
) -> RoleEventAnswer:
    """Record that a rank started or exited; the run moves on (or ends) accordingly."""
    with run_state_lock(settings.is_sqlite):
        outcome = queries.apply_role_event(session, node=node, run_id=run_id, event=body, settings=settings)
        # A run that ended frees its GPUs for the queued runs waiting on them.
        launches = start_queued(session, settings=settings) if outcome.run_status.finished else []
        session.commit()
    dispatcher.send_quietly([*outcome.orders, *launches])
    return RoleEventAnswer(
        run_status=str(outcome.run_status),
        action="stop" if outcome.stop_reason else None,
        reason=outcome.stop_reason,
    )


@router.post("/runs/{run_id}/metrics", response_model=MetricsStored, responses=NOT_FOUND_OR_CONFLICT)
def deliver_spooled_metrics(session: SessionDep, node: AgentNodeDep, run_id: IdPath, body: ReportBatch) -> MetricsStored:
    """Store what this node's trainers spooled (records of its own ranks only), also after the
    run has ended, when the run's own token reports no more; each record once."""
    run = get_run(session, run_id=run_id)
    stored = store_spooled_report(session, node=node, run=run, batch=body)
    session.commit()
    return MetricsStored(received=len(body.records), stored=stored)


@router.post("/runs/{run_id}/logs", response_model=LogsStored, responses=NOT_FOUND_OR_CONFLICT)
def ship_logs(session: SessionDep, node: AgentNodeDep, run_id: IdPath, body: LogBatch) -> LogsStored:
    """Store a batch of a rank's output lines."""
    stored = queries.store_logs(session, node=node, run_id=run_id, batch=body)
    session.commit()
    return LogsStored(stored=stored)
