"""Heartbeats on the real Postgres: what a beat changes for the node page and the liveness
pass, the plain beat (nothing to reconcile) as one UPDATE that still checks the token, and a
live node kept online through a beat that a full heartbeat lane shed (issue 50)."""

from __future__ import annotations

import asyncio
import threading
from datetime import datetime, timedelta

from runs_testing import (  # noqa: F401 (fixtures)
    API, cancel_created_runs_fixture, dispatched_fixture, online_node_fixture, post_run, run_body, runs_redis_url_fixture,
)
from sqlalchemy import event
from sqlalchemy.exc import OperationalError

from app.beat_batches import BeatBatches

from app.lifecycle import check_liveness
from app.lifecycle.liveness import offline_after_s
from app.models import Node, NodeStatus
from app.models.base import utcnow
from app.queries.agents import PlainBeat, record_plain_beat, record_plain_beats
from app.schemas.agent import Heartbeat
from app.security import hash_secret

READINGS = [{"index": 0, "name": "Tesla T4", "utilization": 0.25, "memory_used_bytes": 7, "memory_total_bytes": 9}]


def _joined(online_node):
    """An online node past its first beat (which orders the probes of a node that just joined)."""
    node = online_node()
    assert node.agent.post(f"{API}/agent/heartbeat", json={"roles": []}).status_code == 200
    return node


def _fall_silent(session, node_id: int, seconds: float) -> datetime:
    stale = utcnow() - timedelta(seconds=seconds)
    session.get(Node, node_id).last_heartbeat = stale
    session.commit()
    return stale


# -- what a beat changes -----------------------------------------------------------------------


def test_a_plain_beat_moves_the_last_heartbeat_the_node_page_shows(online_node, client, session):
    node = _joined(online_node)
    stale = _fall_silent(session, node.id, 20)

    answer = node.agent.post(f"{API}/agent/heartbeat", json={"roles": [], "gpus": READINGS})

    assert answer.status_code == 200
    assert answer.json() == {"node_id": node.id, "status": "online", "stop": []}
    shown = client.get(f"{API}/nodes/{node.id}").json()
    assert datetime.fromisoformat(shown["last_heartbeat"]) > stale + timedelta(seconds=19)
    assert session.get(Node, node.id).gpu_usage == READINGS


def test_a_plain_beat_keeps_the_node_online_through_the_liveness_pass(online_node, session, settings):
    node = _joined(online_node)
    _fall_silent(session, node.id, 25)

    node.agent.post(f"{API}/agent/heartbeat", json={"roles": []})
    check_liveness(session, settings=settings, now=utcnow() + timedelta(seconds=10))
    session.commit()

    assert session.get(Node, node.id).status == NodeStatus.online


def _kind(statement: str) -> str:
    """A statement's verb; the plain beats' UPDATE starts with the WITH that brings them."""
    return "UPDATE" if statement.startswith("WITH") and "UPDATE nodes " in statement else statement.split(None, 1)[0]


def test_a_plain_beat_is_one_update_of_its_node(online_node, connection):
    node = _joined(online_node)
    statements: list[str] = []

    def record(_conn, _cursor, statement, *_args) -> None:
        if not statement.startswith(("SAVEPOINT", "RELEASE SAVEPOINT")):
            statements.append(_kind(statement))

    event.listen(connection, "before_cursor_execute", record)
    try:
        assert node.agent.post(f"{API}/agent/heartbeat", json={"roles": [], "gpus": READINGS}).status_code == 200
    finally:
        event.remove(connection, "before_cursor_execute", record)

    assert statements == ["UPDATE"]


def test_a_beat_that_brings_a_node_back_online_goes_through_the_whole_reconciliation(online_node, session):
    node = _joined(online_node)
    session.get(Node, node.id).status = NodeStatus.offline
    session.commit()

    assert record_plain_beat(session, token=node.agent_token, beat=Heartbeat(roles=[])) is None
    answer = node.agent.post(f"{API}/agent/heartbeat", json={"roles": []})

    assert answer.json()["status"] == "online"
    assert session.get(Node, node.id).status == NodeStatus.online


def test_the_first_beat_after_joining_is_not_a_plain_one(online_node, session):
    node = online_node()

    assert record_plain_beat(session, token=node.agent_token, beat=Heartbeat(roles=[])) is None


def test_a_beat_from_a_node_running_a_rank_is_not_a_plain_one(online_node, client, dispatched, session):
    a, b = _joined(online_node), _joined(online_node)
    run = post_run(client, run_body([a, b], strategy="ps", ps_node_id=a.id))
    assert a.event(run["id"], rank=0, role="ps", event="started", pid=5, port=29500).status_code == 200

    assert record_plain_beat(session, token=a.agent_token, beat=Heartbeat(roles=[])) is None
    assert record_plain_beat(session, token=b.agent_token, beat=Heartbeat(roles=[])) == b.id


def test_a_beat_reporting_roles_or_hardware_is_not_a_plain_one(online_node, session):
    node = _joined(online_node)
    role = {"run_id": 1, "rank": 0, "role": "ps", "pid": 5, "state": "running"}

    assert record_plain_beat(session, token=node.agent_token, beat=Heartbeat(roles=[role])) is None
    assert record_plain_beat(session, token=node.agent_token, beat=Heartbeat(hardware={"gpus": []})) is None


# -- the token ---------------------------------------------------------------------------------


def test_a_beat_with_an_unknown_token_or_none_is_refused(make_client):
    unknown = make_client("hta_" + "u" * 40).post(f"{API}/agent/heartbeat", json={"roles": []})
    missing = make_client(None).post(f"{API}/agent/heartbeat", json={"roles": []})

    assert unknown.status_code == 401 and "unknown agent token" in unknown.json()["detail"]
    assert missing.status_code == 401 and "missing agent token" in missing.json()["detail"]


def test_a_beat_of_a_deleted_node_is_refused(online_node, client):
    node = _joined(online_node)
    assert client.delete(f"{API}/nodes/{node.id}").status_code == 204

    assert node.agent.post(f"{API}/agent/heartbeat", json={"roles": []}).status_code == 401


# -- the declared hardware ---------------------------------------------------------------------


def test_editing_the_declared_gpus_updates_the_mismatch_warning_at_once(online_node, client):
    node = online_node("T4", detected=[{"model": "T4", "count": 1, "memory_gb": 15.0}])

    edited = client.patch(f"{API}/nodes/{node.id}", json={"gpus": [{"model": "RTX 3090", "count": 1}]})

    assert edited.status_code == 200
    assert client.get(f"{API}/nodes/{node.id}").json()["detected_hardware"]["mismatch"] == (
        "declared 1x RTX 3090 but the agent detected 1x T4; runs are planned with the declared "
        "GPUs unless allocation 'measured' is asked for"
    )


# -- a shed beat -------------------------------------------------------------------------------


def test_by_default_a_node_goes_offline_after_the_heartbeat_timeout(settings):
    assert offline_after_s(settings) == settings.heartbeat_timeout_s == 30.0


def test_a_node_silent_through_one_shed_beat_stays_online(online_node, session, settings):
    # Beats every 0.5 s; a beat waits up to 2 s in the full lane's queue, is refused with
    # Retry-After 1, and its retry (after up to 1.5 s) may wait 2 s more: 6 s without a beat.
    fast = settings.model_copy(update={"heartbeat_timeout_s": 3.0, "admission_wait_s": 2.0})
    node = _joined(online_node)
    beat = session.get(Node, node.id).last_heartbeat
    shed_silence = 0.5 + 2.0 + 1.5 + 2.0

    check_liveness(session, settings=fast, now=beat + timedelta(seconds=shed_silence))
    session.commit()
    assert session.get(Node, node.id).status == NodeStatus.online

    check_liveness(session, settings=fast, now=beat + timedelta(seconds=offline_after_s(fast) + 1))
    session.commit()
    assert session.get(Node, node.id).status == NodeStatus.offline


# -- plain beats written together ----------------------------------------------------------------


def test_plain_beats_of_several_nodes_are_one_update(online_node, session, connection):
    a, b = _joined(online_node), _joined(online_node)
    session.get(Node, b.id).gpu_usage = READINGS
    session.commit()
    at = utcnow()
    statements: list[str] = []

    def record(_conn, _cursor, statement, *_args) -> None:
        statements.append(statement)

    event.listen(connection, "before_cursor_execute", record)
    try:
        found = record_plain_beats(session, [
            PlainBeat(hash_secret(a.agent_token), at, READINGS), PlainBeat(hash_secret(b.agent_token), at, None),
            PlainBeat(hash_secret("hta_" + "u" * 40), at, None),
        ])
    finally:
        event.remove(connection, "before_cursor_execute", record)

    assert found == {hash_secret(a.agent_token): a.id, hash_secret(b.agent_token): b.id}
    assert [_kind(s) for s in statements if not s.startswith(("SAVEPOINT", "RELEASE"))] == ["UPDATE"]
    assert session.get(Node, a.id).last_heartbeat == at and session.get(Node, b.id).last_heartbeat == at
    assert session.get(Node, a.id).gpu_usage == READINGS
    assert session.get(Node, b.id).gpu_usage == READINGS  # no readings in its beat: it keeps its last


def test_a_plain_beat_of_a_node_with_work_to_do_is_left_to_the_full_heartbeat(online_node, session):
    node = online_node()  # its first beat orders the join probes

    assert record_plain_beats(session, [PlainBeat(hash_secret(node.agent_token), utcnow(), None)]) == {}


def _blocked_writer():
    """A writer that records each batch and holds the first until `release` is set."""
    batches: list[list[str]] = []
    release = threading.Event()

    def write(_session, beats):
        batches.append([b.token_hash for b in beats])
        if len(batches) == 1:
            release.wait(5)
        return {b.token_hash: i for i, b in enumerate(beats)}

    return write, batches, release


def test_beats_arriving_while_a_batch_is_written_go_together_in_the_next(session):
    write, batches, release = _blocked_writer()
    beats = BeatBatches(write)

    async def scenario():
        first = asyncio.create_task(beats.record(session, PlainBeat("a", utcnow(), None)))
        await asyncio.sleep(0.05)  # "a" is being written
        rest = [asyncio.create_task(beats.record(session, PlainBeat(t, utcnow(), None))) for t in "bcd"]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(first, *rest)

    answers = asyncio.run(scenario())

    assert batches == [["a"], ["b", "c", "d"]]
    assert answers == [0, 0, 1, 2]


def test_a_failed_write_fails_every_beat_of_its_batch():
    def write(_session, _beats):
        raise OperationalError("UPDATE", {}, Exception("the database is gone"))

    beats = BeatBatches(write)

    async def scenario():
        return await asyncio.gather(*(beats.record(None, PlainBeat(t, utcnow(), None)) for t in "ab"),
                                    return_exceptions=True)

    assert all(isinstance(answer, OperationalError) for answer in asyncio.run(scenario()))


def test_beats_beyond_one_batchs_bound_go_in_the_next(session, monkeypatch):
    monkeypatch.setattr("app.beat_batches.MAX_BATCH", 2)
    write, batches, release = _blocked_writer()
    beats = BeatBatches(write)

    async def scenario():
        first = asyncio.create_task(beats.record(session, PlainBeat("a", utcnow(), None)))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(beats.record(session, PlainBeat(t, utcnow(), None))) for t in "bcde"]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(first, *rest)

    answers = asyncio.run(scenario())

    assert batches == [["a"], ["b", "c"], ["d", "e"]]
    assert answers == [0, 0, 1, 0, 1]
