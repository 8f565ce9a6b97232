"""Every record the trainer logs is stored exactly once: ingestion keys records by (run, rank,
stream, seq) on Postgres and SQLite, events in the stream become run events the same way, and a
real reporter against a control plane that goes down and comes back (or a spool posted later)
completes the set without a gap or a double."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app import db
from app.config import Settings
from app.main import create_app
from app.models import Node, NodeAgent, Run, RunEvent, RunMetric, RunStatus, RunWorker, Site, WorkerStatus
from app.models.enums import Continent, Provider, SiteKind
from app.run_secrets import run_metrics_token
from app.security import hash_secret, new_secret
from trainer.metrics import HttpReporter, MetricsLogger

API = "/api/v1"


@dataclass
class IngestRun:
    """A running three-rank run, a session on its database, and its ranks' report tokens."""

    session: Session
    run_id: int
    node_ids: list[int]
    # The agent token of the node of each rank.
    agent_tokens: dict[int, str]
    secret_key: str
    client_with: Callable[[str], TestClient]

    @property
    def url(self) -> str:
        return f"{API}/runs/{self.run_id}/metrics"

    def token_of(self, rank: int) -> str:
        """Rank `rank`'s report token, as its launch order carries it."""
        return run_metrics_token(self.secret_key, run_id=self.run_id, attempt=0, rank=rank)

    @property
    def trainer(self) -> TestClient:
        """Rank 1's trainer."""
        return self.client_with(self.token_of(1))

    def post(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Each rank's records with its own token, as its trainer posts them; the answers summed."""
        total = {"received": 0, "stored": 0}
        for rank in sorted({r["rank"] for r in records}):
            answer = self.client_with(self.token_of(rank)).post(
                self.url, json={"records": [r for r in records if r["rank"] == rank]})
            assert answer.status_code == 200, answer.text
            total = {k: v + answer.json()[k] for k, v in total.items()}
        return total

    def count(self, model: type[RunMetric] | type[RunEvent]) -> int:
        self.session.expire_all()
        return int(self.session.scalar(select(func.count()).select_from(model).where(model.run_id == self.run_id)) or 0)


def _running_run(session: Session) -> tuple[Run, dict[int, str]]:
    tag = uuid.uuid4().hex[:8]
    site = Site(name=f"site-{tag}", kind=SiteKind.onprem, provider=Provider.onprem, continent=Continent.europe)
    nodes = [Node(site=site, name=f"{name}-{tag}", join_token_hash=hash_secret(new_secret("htj_")))
             for name in ("a", "b")]
    session.add_all([site, *nodes])
    session.flush()
    agent_tokens = {node.id: new_secret("hta_") for node in nodes}
    session.add_all([NodeAgent(node_id=node_id, token_hash=hash_secret(t), join_token_hash=hash_secret(new_secret("htj_")))
                     for node_id, t in agent_tokens.items()])
    now = datetime.now(UTC)
    run = Run(
        name=f"run-{tag}", status=RunStatus.running, strategy="ps-bz-gc", task="hybridtrain.tasks.digits:smallcnn",
        global_batch_size=64, max_steps=100, allocation="flops", compression={},
        metrics_token_hash=hash_secret(new_secret("htr_")), created_by="test", launched_at=now, started_at=now,
        workers=[RunWorker(rank=rank, role=role, node_id=node.id, node_name=node.name,
                           status=WorkerStatus.running, started_at=now)
                 for rank, role, node in ((0, "ps", nodes[0]), (1, "worker", nodes[0]), (2, "worker", nodes[1]))],
    )
    session.add(run)
    session.commit()
    return run, {w.rank: agent_tokens[w.node_id] for w in run.workers}


@pytest.fixture
def pg_ingest(session: Session, make_client: Callable[[str | None], TestClient], settings: Settings) -> IngestRun:
    run, agents = _running_run(session)
    return IngestRun(session, run.id, [w.node_id for w in run.workers], agents, settings.secret_key, make_client)  # type: ignore[misc]


@pytest.fixture
def sqlite_ingest(tmp_path: Path) -> Iterator[IngestRun]:
    url = f"sqlite+pysqlite:///{tmp_path}/cp.db"
    db.upgrade(url)
    settings = Settings(DATABASE_URL=url, CELERY_BROKER_URL=f"sqla+sqlite:///{tmp_path}/broker.db",
                        admin_token="adm-token")
    app = create_app(settings)

    def client_with(token: str) -> TestClient:
        return TestClient(app, headers={"Authorization": f"Bearer {token}"})

    with Session(app.state.engine, expire_on_commit=False) as session:
        run, agents = _running_run(session)
        yield IngestRun(session, run.id, [w.node_id for w in run.workers], agents,  # type: ignore[misc]
                        settings.secret_key, client_with)
    app.state.engine.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def ingest(request: pytest.FixtureRequest) -> IngestRun:
    return request.getfixturevalue("pg_ingest" if request.param == "postgres" else "sqlite_ingest")


def _metric(seq: int, *, stream: str = "s1", rank: int = 1, step: int | None = None, name: str = "loss",
            peer: int | None = None) -> dict[str, Any]:
    record = {"rank": rank, "role": "worker", "step": seq if step is None else step, "t": 1_763_779_200.0 + seq,
              "name": name, "value": 1.0, "stream": stream, "seq": seq}
    if peer is not None:
        record["peer"] = peer
    return record


def _event(seq: int, kind: str, subject: int | None, *, stream: str = "s0") -> dict[str, Any]:
    return {"rank": 0, "role": "ps", "step": 40, "t": 1_763_779_300.0 + seq, "event": kind,
            "subject": subject, "detail": f"rank {subject} {kind}", "stream": stream, "seq": seq}


def test_a_batch_posted_twice_is_stored_once(ingest):
    batch = [_metric(seq) for seq in range(50)] + [
        _metric(50, name="bytes_sent", step=3, peer=0), _metric(51, name="bytes_recv", step=3, peer=0),
    ]
    assert ingest.post(batch) == {"received": 52, "stored": 52}
    assert ingest.post(batch) == {"received": 52, "stored": 0}
    assert ingest.count(RunMetric) == 52


def test_a_step_trained_again_by_a_restarted_process_is_kept_beside_the_first(ingest):
    ingest.post([_metric(0, stream="before", step=40)])
    stored = ingest.post([_metric(0, stream="after", step=40)])
    assert stored["stored"] == 1 and ingest.count(RunMetric) == 2


def test_the_same_sequence_number_of_another_rank_is_another_record(ingest):
    stored = ingest.post([_metric(0, rank=1), _metric(0, rank=2)])
    assert stored["stored"] == 2


def test_records_without_a_stream_are_deduplicated_by_name_peer_and_step(ingest):
    legacy = [{"rank": 1, "step": s, "t": 1.0 + s, "name": "loss", "value": 0.5} for s in range(5)]
    assert ingest.post(legacy)["stored"] == 5
    assert ingest.post(legacy)["stored"] == 0


def test_a_record_with_a_stream_but_no_seq_is_refused_naming_the_field(ingest):
    record = _metric(0)
    del record["seq"]
    answer = ingest.trainer.post(ingest.url, json={"records": [record]})
    assert answer.status_code == 422
    assert "seq" in answer.text


def test_events_in_the_stream_become_run_events_once_with_the_subjects_node(ingest):
    batch = [_metric(0, stream="s0", rank=0), _event(1, "worker_lost", 2), _event(2, "checkpoint", None)]
    assert ingest.post(batch)["stored"] == 3
    assert ingest.post(batch)["stored"] == 0
    ingest.session.expire_all()
    events = ingest.session.scalars(select(RunEvent).where(RunEvent.run_id == ingest.run_id)
                                    .order_by(RunEvent.t)).all()
    assert [(e.kind, e.subject, e.step, e.source.value) for e in events] == [
        ("worker_lost", 2, 40, "trainer"), ("checkpoint", None, 40, "trainer")]
    assert events[0].node_id == ingest.node_ids[2] and events[1].node_id is None
    assert events[0].t == datetime.fromtimestamp(1_763_779_301.0, UTC)


def test_an_unknown_event_kind_is_refused_naming_the_kind(ingest):
    answer = ingest.trainer.post(ingest.url, json={"records": [_event(0, "exploded", 1)]})
    assert answer.status_code == 422
    assert "worker_lost" in answer.text  # the answer lists the kinds there are


# -- a real reporter against a served control plane -----------------------------------------------


class ServedControlPlane:
    """The test app served by uvicorn on a fixed port, which can be stopped and started again."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="uvicorn-exactly-once", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                pytest.fail("the control plane did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None and self._thread is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
        self._server = self._thread = None


@pytest.fixture
def served(app: FastAPI, pg_ingest: IngestRun) -> Iterator[ServedControlPlane]:
    plane = ServedControlPlane(app)
    plane.start()
    try:
        yield plane
    finally:
        plane.stop()


def _reporter(plane: ServedControlPlane, run: IngestRun, spool: Path, *, rank: int) -> HttpReporter:
    return HttpReporter(f"http://127.0.0.1:{plane.port}{run.url}", run.token_of(rank), spool=str(spool),
                        interval_s=0.05, backoff_s=0.05, max_backoff_s=0.2, timeout_s=2.0)


def _log_steps(metrics: MetricsLogger, steps: range) -> None:
    for step in steps:
        metrics.log(step, "loss", 1.0 / (step + 1))
        metrics.log_bytes(step, {0: 1000 + step}, {0: 2000 + step})


def _stored_keys(run: IngestRun) -> list[tuple[str, int]]:
    run.session.expire_all()
    rows = run.session.execute(select(RunMetric.stream, RunMetric.seq).where(RunMetric.run_id == run.run_id))
    events = run.session.execute(select(RunEvent.stream, RunEvent.seq).where(RunEvent.run_id == run.run_id))
    return sorted([(s, q) for s, q in rows] + [(s, q) for s, q in events if s is not None])


def test_a_reporter_rides_out_a_control_plane_restart_and_every_record_is_stored_once(
    served: ServedControlPlane, pg_ingest: IngestRun, tmp_path: Path
):
    spool = tmp_path / "spool.jsonl"
    metrics = MetricsLogger(1, "worker", reporter=_reporter(served, pg_ingest, spool, rank=1))
    _log_steps(metrics, range(0, 20))
    time.sleep(0.5)
    served.stop()
    _log_steps(metrics, range(20, 40))
    metrics.event(40, "worker_left", subject=1, detail="spot notice")
    time.sleep(1.0)  # the reporter retries against a closed port
    served.start()
    metrics.close()
    assert _stored_keys(pg_ingest) == [(metrics.stream, seq) for seq in range(40 * 3 + 1)]
    assert not spool.exists()


def test_the_spool_written_at_close_completes_the_set_when_posted_later(
    served: ServedControlPlane, pg_ingest: IngestRun, tmp_path: Path
):
    spool = tmp_path / "spool.jsonl"
    reporter = _reporter(served, pg_ingest, spool, rank=2)
    metrics = MetricsLogger(2, "worker", reporter=reporter)
    _log_steps(metrics, range(0, 10))
    time.sleep(0.5)
    served.stop()
    _log_steps(metrics, range(10, 30))
    reporter.close(deadline_s=0.5)
    spooled = [json.loads(line) for line in spool.read_text().splitlines()]
    assert sorted((r["stream"], r["seq"]) for r in spooled) == [(metrics.stream, s) for s in range(30, 90)]

    served.start()
    first, again = (_deliver_spool(served, pg_ingest, spooled, rank=2) for _ in range(2))
    assert first["stored"] == 60 and again["stored"] == 0
    assert _stored_keys(pg_ingest) == [(metrics.stream, seq) for seq in range(90)]


def _deliver_spool(plane: ServedControlPlane, run: IngestRun, records: list[dict[str, Any]], *, rank: int) -> dict:
    """What the agent does after the role exits: post the spool's records as they are, with
    its own token (a retry after a lost answer posts them again)."""
    answer = httpx.post(f"http://127.0.0.1:{plane.port}{API}/agent/runs/{run.run_id}/metrics",
                        json={"records": records}, headers={"Authorization": f"Bearer {run.agent_tokens[rank]}"})
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_records_an_ended_run_refuses_go_to_the_spool_and_its_agent_delivers_them(
    served: ServedControlPlane, pg_ingest: IngestRun, tmp_path: Path
):
    run = pg_ingest.session.get(Run, pg_ingest.run_id)
    run.status, run.finished_at = RunStatus.succeeded, datetime.now(UTC).replace(year=2020)
    pg_ingest.session.commit()
    spool = tmp_path / "spool.jsonl"
    metrics = MetricsLogger(2, "worker", reporter=_reporter(served, pg_ingest, spool, rank=2))

    _log_steps(metrics, range(0, 5))
    metrics.close()

    spooled = [json.loads(line) for line in spool.read_text().splitlines()]
    assert _stored_keys(pg_ingest) == [] and len(spooled) == 15
    assert _deliver_spool(served, pg_ingest, spooled, rank=2)["stored"] == 15
    assert _stored_keys(pg_ingest) == [(metrics.stream, seq) for seq in range(15)]
