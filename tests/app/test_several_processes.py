"""Several control-plane processes on one Postgres database (`hybridtrain server --workers 2`):
each runs the liveness monitor, yet a silent node is marked offline once and a queued run is
started once, because a liveness pass runs only while it holds a Postgres advisory lock; on
SQLite more than one process is refused (issue 50)."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, event
from sqlalchemy.orm import Session, sessionmaker

from runs_testing import Orders

from agents.celery_app import LAUNCH_ROLE
from app.dispatch import Dispatcher
from app.lifecycle import end_run
from app.models import RunStatus
from app.monitor import Monitor, take_liveness_turn
from app.queries.runs import get_run
from tests.app.conftest import ADMIN_TOKEN, API, make_settings
from tests.redis_dbs import private_redis

HYBRIDTRAIN = [sys.executable, "-m", "app.cli"]
REPO = Path(__file__).resolve().parents[2]
WORKERS = 2
# Both processes' monitors pass every 0.2 s, so their passes would overlap many times over
# within the few seconds each test waits.
MONITOR_INTERVAL_S = 0.2
HEARTBEAT_TIMEOUT_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_processes(pid: int) -> list[int]:
    """The processes serving under uvicorn's supervisor `pid` (not multiprocessing's helpers)."""
    children = [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [child for child in children
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()]


def _server_env(database_url: str, broker_url: str, heartbeat_timeout_s: float = 600.0) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("HYBRIDTRAIN_")}
    return env | {
        "DATABASE_URL": database_url,
        "CELERY_BROKER_URL": broker_url,
        "HYBRIDTRAIN_ADMIN_TOKEN": ADMIN_TOKEN,
        "HYBRIDTRAIN_MONITOR_INTERVAL_S": str(MONITOR_INTERVAL_S),
        "HYBRIDTRAIN_HEARTBEAT_TIMEOUT_S": str(heartbeat_timeout_s),
        # Nothing here acknowledges a launch: no resend may blur the count of launch orders.
        "HYBRIDTRAIN_LAUNCH_RESEND_S": "600",
        "HYBRIDTRAIN_LAUNCH_TIMEOUT_S": "600",
    }


@pytest.fixture(scope="module")
def broker_url(redis_url: str) -> str:
    """A Redis database of this module's own, so that no other suite takes its orders."""
    return private_redis(redis_url, 14)


@pytest.fixture
def two_processes(scratch_postgres_url: str, broker_url: str) -> Iterator[tuple[str, str, int]]:
    """`hybridtrain server --workers 2` on a fresh database: its base URL, the database URL
    and its pid; nodes stay online for 600 s without a heartbeat."""
    with _serve_two(scratch_postgres_url, broker_url, 600.0) as served:
        yield served


@pytest.fixture
def two_processes_quick_offline(scratch_postgres_url: str, broker_url: str) -> Iterator[tuple[str, str, int]]:
    """As `two_processes`, with nodes offline after `HEARTBEAT_TIMEOUT_S` without a heartbeat."""
    with _serve_two(scratch_postgres_url, broker_url, HEARTBEAT_TIMEOUT_S) as served:
        yield served


@contextmanager
def _serve_two(database_url: str, broker_url: str, heartbeat_timeout_s: float) -> Iterator[tuple[str, str, int]]:
    port = _free_port()
    server = subprocess.Popen(
        [*HYBRIDTRAIN, "server", "--port", str(port), "--workers", str(WORKERS), "--log-level", "warning",
         "--no-access-log"],
        cwd=REPO, env=_server_env(database_url, broker_url, heartbeat_timeout_s),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert server.poll() is None, server.stderr.read().decode() if server.stderr else ""
            assert time.monotonic() < deadline, "the server did not start within 90 s"
            try:
                if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        # Every process has started its monitor once all have answered their own start-up.
        time.sleep(2)
        yield base, database_url, server.pid
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)


def _joined_node(base: str) -> tuple[httpx.Client, int, httpx.Client]:
    """An admin client, and a node (one T4) whose agent has registered, with the agent's client."""
    admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=20)
    site = admin.post(f"{API}/sites", json={"name": f"site-{uuid.uuid4().hex[:8]}", "kind": "cloud", "provider": "gcp",
                                            "region": "us-west1", "zone": "us-west1-b", "continent": "north_america"})
    assert site.status_code == 201, site.text
    node = admin.post(f"{API}/nodes", json={"name": f"node-{uuid.uuid4().hex[:8]}", "site_id": site.json()["id"],
                                           "gpus": [{"model": "T4", "count": 1}]})
    assert node.status_code == 201, node.text
    agent_token = "hta_" + secrets.token_urlsafe(32)
    joined = httpx.post(f"{base}{API}/agent/register", timeout=20, json={
        "join_token": node.json()["join_token"], "agent_token": agent_token,
        "hardware": {"hostname": "h", "address": "127.0.0.1", "cpu_cores": 4, "gpus": [],
                     "benchmark": {"samples_per_s": 500.0}}})
    assert joined.status_code == 201, joined.text
    agent = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {agent_token}"}, timeout=20)
    return admin, node.json()["id"], agent


def _create_run(admin: httpx.Client, node_id: int) -> dict[str, Any]:
    answer = admin.post(f"{API}/runs", json={
        "name": f"run-{uuid.uuid4().hex[:6]}", "node_ids": [node_id], "strategy": "ps", "ps_node_id": node_id,
        "global_batch_size": 64, "max_steps": 20})
    assert answer.status_code == 201, answer.text
    return dict(answer.json())


def test_the_server_runs_the_number_of_processes_asked_for(two_processes):
    base, _, pid = two_processes

    assert len(_server_processes(pid)) == WORKERS
    assert [httpx.get(f"{base}/healthz", timeout=5).status_code for _ in range(10)] == [200] * 10


def test_a_silent_node_is_marked_offline_once_by_two_processes(two_processes_quick_offline):
    base, _, _ = two_processes_quick_offline
    admin, node_id, agent = _joined_node(base)
    run = _create_run(admin, node_id)
    assert agent.post(f"{API}/agent/heartbeat", json={"roles": []}).status_code == 200

    # The agent falls silent: both processes' monitors look for silent nodes every 0.2 s.
    deadline = time.monotonic() + HEARTBEAT_TIMEOUT_S + 15
    while admin.get(f"{API}/nodes/{node_id}").json()["status"] != "offline":
        assert time.monotonic() < deadline, "the silent node was never marked offline"
        time.sleep(0.2)
    time.sleep(2)  # more passes of both monitors, which must change nothing

    events = admin.get(f"{API}/runs/{run['id']}/events").json()["events"]
    offline = [(e["kind"], e["subject"], e["detail"]) for e in events if "went offline" in e["detail"]]
    assert len(offline) == len(set(offline)) >= 1, offline
    # One rank (the server, rank 0) was launched on the node; it is lost once.
    assert len([e for e in offline if e[1] == 0]) == 1, offline


def test_a_queued_run_is_started_once_by_two_processes(two_processes, broker_url):
    base, database_url, _ = two_processes
    admin, node_id, _ = _joined_node(base)
    first = _create_run(admin, node_id)
    second = _create_run(admin, node_id)
    assert second["status"] == "queued"
    orders = Orders(broker_url)
    orders.take(node_id)
    engine = create_engine(database_url)
    try:
        # The first run ends behind the scheduler's back (a crash between its commit and the
        # queue's hand-out): only the monitors' safety net can start the second.
        with Session(engine) as session:
            end_run(session, run=get_run(session, run_id=first["id"], lock=True), status=RunStatus.failed,
                    reason="ended behind the scheduler's back")
            session.commit()

        deadline = time.monotonic() + 15
        while admin.get(f"{API}/runs/{second['id']}").json()["status"] == "queued":
            assert time.monotonic() < deadline, "no monitor started the queued run"
            time.sleep(0.1)
        time.sleep(2)  # more passes of both monitors, which must send nothing more

        launches = [args for task, args in orders.take(node_id) if task == LAUNCH_ROLE and args[0] == second["id"]]
        assert len(launches) == 1, launches
    finally:
        engine.dispose()


def test_more_than_one_process_is_refused_on_sqlite(tmp_path):
    env = _server_env(f"sqlite+pysqlite:///{tmp_path / 'cp.db'}", "memory://")

    done = subprocess.run([*HYBRIDTRAIN, "server", "--workers", "2", "--port", str(_free_port())],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    assert done.returncode == 2
    assert "--workers above 1 needs Postgres" in done.stderr
    assert not (tmp_path / "cp.db").exists()  # refused before migrating anything


def test_a_liveness_pass_is_skipped_while_another_process_holds_the_turn(migrated_postgres_url):
    engine = create_engine(migrated_postgres_url)
    try:
        with Session(engine) as first, Session(engine) as second:
            assert take_liveness_turn(first) is True
            assert take_liveness_turn(second) is False
            first.commit()  # the pass ends with its transaction, and so does its turn
            assert take_liveness_turn(second) is True
            second.rollback()
    finally:
        engine.dispose()


def test_the_monitor_does_nothing_while_another_process_passes(migrated_postgres_url, broker_url):
    settings = make_settings(migrated_postgres_url, celery_broker_url=broker_url)
    engine = create_engine(migrated_postgres_url)
    dispatcher = Dispatcher(broker_url)
    try:
        with Session(engine) as other:
            assert take_liveness_turn(other) is True
            queries: list[str] = []
            event.listen(engine, "before_cursor_execute", lambda *args: queries.append(args[2]))
            monitor = Monitor(sessionmaker(engine), settings, dispatcher)

            assert monitor.check_once() == []
            # It asked for the turn and, refused, looked at no node and no run.
            assert len(queries) == 1 and "pg_try_advisory_xact_lock" in queries[0]
            other.rollback()
    finally:
        dispatcher.close()
        engine.dispose()
