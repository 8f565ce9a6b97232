"""A run's events: recorded by the control plane, shown oldest first in GET /runs/{id}, in
GET /runs/{id}/events and by `hybridtrain runs events`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.cli import main
from app.cli.event_commands import timeline
from app.errors import InvalidFieldError
from app.models import Node, Run, RunStatus, RunWorker, Site, WorkerStatus
from app.models.enums import Continent, Provider, SiteKind
from app.queries.events import list_events, record_event
from app.security import hash_secret, new_secret
from tests.app.serving import cli_server

API = "/api/v1"
T0 = datetime(2026, 11, 24, 12, 0, tzinfo=UTC)


@pytest.fixture
def run(session: Session) -> Run:
    site = Site(name=f"site-{new_secret('x')[-8:]}", kind=SiteKind.onprem, provider=Provider.onprem,
                continent=Continent.europe)
    node = Node(site=site, name="gpu-b", join_token_hash=hash_secret(new_secret("htj_")))
    session.add_all([site, node])
    session.flush()
    run = Run(name="elastic", status=RunStatus.running, strategy="ps", task="hybridtrain.tasks.digits:smallcnn",
              global_batch_size=64, max_steps=100, allocation="equal", compression={},
              metrics_token_hash=hash_secret(new_secret("htr_")), created_by="test",
              workers=[RunWorker(rank=2, role="worker", node_id=node.id, node_name=node.name,
                                 status=WorkerStatus.running)])
    session.add(run)
    session.commit()
    return run


def test_record_event_takes_the_node_of_its_subject_rank(session: Session, run: Run):
    event = record_event(session, run=run, kind="worker_lost", subject=2, step=40, detail="silent for 3 steps")
    assert event.node_id == run.workers[0].node_id
    assert event.source.value == "control_plane" and event.t.tzinfo is not None


def test_record_event_refuses_an_unknown_source_naming_the_field(session: Session, run: Run):
    with pytest.raises(InvalidFieldError) as raised:
        record_event(session, run=run, kind="restarting", source="cron")
    assert raised.value.field == "source"


def test_the_run_lists_its_events_oldest_first(client: TestClient, session: Session, run: Run):
    record_event(session, run=run, kind="worker_joined", subject=2, t=T0 + timedelta(minutes=5))
    record_event(session, run=run, kind="restarting", detail="server died", t=T0 + timedelta(minutes=1))
    record_event(session, run=run, kind="worker_left", subject=2, t=T0 + timedelta(minutes=9),
                 source="agent", detail="spot notice")
    session.commit()

    shown = client.get(f"{API}/runs/{run.id}").json()["events"]
    listed = client.get(f"{API}/runs/{run.id}/events").json()

    assert [(e["kind"], e["subject"], e["source"]) for e in shown] == [
        ("restarting", None, "control_plane"), ("worker_joined", 2, "control_plane"), ("worker_left", 2, "agent")]
    assert listed["run_id"] == run.id and listed["events"] == shown


def test_events_of_a_run_that_does_not_exist_are_404(client: TestClient, session: Session):
    assert client.get(f"{API}/runs/2000000000/events").status_code == 404
    with pytest.raises(Exception, match="run 2000000000 not found"):
        list_events(session, run_id=2000000000)


def test_runs_events_prints_one_line_per_event_with_its_step_rank_and_source():
    run = {"id": 7, "name": "elastic", "status": "degraded", "reason": None, "events": [
        {"t": "2026-11-24T12:01:00Z", "kind": "worker_lost", "subject": 3, "step": 40, "detail": "silent",
         "source": "trainer", "node_id": 4, "id": 1},
        {"t": "2026-11-24T12:05:00Z", "kind": "restarting", "subject": None, "step": None, "detail": "",
         "source": "control_plane", "node_id": None, "id": 2},
    ]}
    lines = timeline(run).splitlines()
    assert lines[0] == "run 7 elastic: degraded"
    assert "2026-11-24 12:01:00" in lines[1] and "step 40" in lines[1] and "worker_lost" in lines[1]
    assert "rank 3" in lines[1] and "[trainer]" in lines[1] and lines[1].endswith("silent")
    assert "restarting" in lines[2] and "run" in lines[2] and "[control_plane]" in lines[2]


@pytest.fixture
def server(app: FastAPI, client: TestClient) -> Iterator[list[str]]:
    """`--server URL --token T` of the test app served over real HTTP, sharing the test's session."""
    with cli_server(app, "uvicorn-events-cli") as argv:
        yield argv


def test_runs_events_command_shows_the_runs_timeline(server, session: Session, run: Run, capsys):
    record_event(session, run=run, kind="worker_lost", subject=2, step=40, t=T0, detail="silent")
    session.commit()

    table = main(["runs", "events", str(run.id), *server])
    out = capsys.readouterr().out
    as_json = main(["runs", "events", str(run.id), "--json", *server])
    events = json.loads(capsys.readouterr().out)

    assert table == 0 and out.splitlines()[0] == f"run {run.id} elastic: running"
    assert "worker_lost" in out and "rank 2" in out and "step 40" in out
    assert as_json == 0 and [(e["kind"], e["subject"]) for e in events] == [("worker_lost", 2)]


def test_runs_events_of_a_missing_run_exits_1_with_one_line(server, capsys):
    assert main(["runs", "events", "2000000000", *server]) == 1
    assert "not found" in capsys.readouterr().err
