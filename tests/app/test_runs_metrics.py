"""Metric ingestion and reads, and run logs, on Postgres and on the embedded SQLite database:
per-rank tokens, deduplication, filters and server-side downsampling."""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from runs_testing import API, Orders, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from agents.celery_app import LAUNCH_ROLE
from app import db
from app.config import Settings
from app.main import create_app
from app.run_secrets import run_metrics_token


@dataclass
class MetricsRun:
    """A launched run, a client for each of its trainers (its rank's token) and one for its agent."""

    client: TestClient
    agent: TestClient
    run_id: int
    trainer_of: Callable[[int], TestClient]

    @property
    def trainer(self) -> TestClient:
        """Rank 1's trainer, the run's first worker."""
        return self.trainer_of(1)


def _launch(client: TestClient, orders: Orders, node_id: int, body: dict) -> tuple[int, str]:
    run = client.post(f"{API}/runs", json=body)
    assert run.status_code == 201, run.text
    launches = [args for task, args in orders.take(node_id) if task == LAUNCH_ROLE]
    return run.json()["id"], launches[0][2]["report_token"]


def _trainers(make: Callable[[str], TestClient], secret_key: str, run_id: int) -> Callable[[int], TestClient]:
    """A client per rank with that rank's token, as its launch order carries it."""
    return lambda rank: make(run_metrics_token(secret_key, run_id=run_id, attempt=0, rank=rank))


@pytest.fixture
def pg_run(client, online_node, dispatched, make_client, settings) -> MetricsRun:
    node = online_node()
    run_id, _ = _launch(client, dispatched, node.id, run_body([node]))
    return MetricsRun(client, node.agent, run_id, _trainers(make_client, settings.secret_key, run_id))


@pytest.fixture
def sqlite_run(tmp_path: Path) -> Iterator[MetricsRun]:
    url = f"sqlite+pysqlite:///{tmp_path}/cp.db"
    broker = f"sqla+sqlite:///{tmp_path}/broker.db"
    db.upgrade(url)
    settings = Settings(DATABASE_URL=url, CELERY_BROKER_URL=broker, admin_token="adm-token")
    app = create_app(settings)
    client = TestClient(app, headers={"Authorization": "Bearer adm-token"})
    site = client.post(f"{API}/sites", json={"name": "s", "kind": "onprem", "provider": "onprem",
                                             "continent": "europe"}).json()
    node = client.post(f"{API}/nodes", json={"name": "n", "site_id": site["id"],
                                             "gpus": [{"model": "T4", "count": 1}]}).json()
    agent_token = "hta_" + secrets.token_urlsafe(32)
    client.post(f"{API}/agent/register", json={"join_token": node["join_token"], "agent_token": agent_token,
                                               "hardware": {"address": "127.0.0.1", "gpus": []}})
    run_id, _ = _launch(client, Orders(broker), node["id"], {"name": "r", "node_ids": [node["id"]], "max_steps": 5})

    def make(token: str) -> TestClient:
        return TestClient(app, headers={"Authorization": f"Bearer {token}"})

    yield MetricsRun(client, make(agent_token), run_id, _trainers(make, settings.secret_key, run_id))
    app.state.engine.dispose()


@pytest.fixture(params=["postgres", "sqlite"])
def metrics_run(request: pytest.FixtureRequest) -> MetricsRun:
    return request.getfixturevalue("pg_run" if request.param == "postgres" else "sqlite_run")


def _records(steps, *, rank=1, name="loss", t0=1_763_779_200.0):
    return [{"rank": rank, "role": "worker", "step": s, "t": t0 + s, "name": name, "value": 1.0 / (s + 1)}
            for s in steps]


def test_ingestion_needs_the_runs_own_token(metrics_run):
    body = {"records": _records(range(3))}
    admin = metrics_run.client.post(f"{API}/runs/{metrics_run.run_id}/metrics", json=body)
    forged = TestClient(metrics_run.client.app, headers={"Authorization": "Bearer htr_" + "x" * 40}).post(
        f"{API}/runs/{metrics_run.run_id}/metrics", json=body)
    missing = metrics_run.trainer.post(f"{API}/runs/2000000000/metrics", json=body)
    assert admin.status_code == forged.status_code == 401
    assert missing.status_code == 404


def test_a_redelivered_batch_is_stored_once(metrics_run):
    url = f"{API}/runs/{metrics_run.run_id}/metrics"
    batch = _records(range(100)) + [
        {"rank": 1, "role": "worker", "step": 3, "t": 1.0, "name": "bytes_sent", "value": 10, "peer": 0},
        {"rank": 1, "role": "worker", "step": 3, "t": 1.0, "name": "bytes_sent", "value": 10, "peer": 2},
    ]

    first = metrics_run.trainer.post(url, json={"records": batch}).json()
    again = metrics_run.trainer.post(url, json={"records": batch}).json()

    assert first == {"received": 102, "stored": 102}
    assert again == {"received": 102, "stored": 0}
    series = metrics_run.client.get(url).json()["series"]
    assert {(s["name"], s["peer"], s["count"]) for s in series} == {
        ("loss", None, 100), ("bytes_sent", 0, 1), ("bytes_sent", 2, 1)}


def test_a_diverged_loss_is_stored_as_null(metrics_run):
    url = f"{API}/runs/{metrics_run.run_id}/metrics"
    body = '{"records": [{"rank": 1, "step": 1, "t": 5.0, "name": "loss", "value": NaN}]}'
    stored = metrics_run.trainer.post(url, content=body, headers={"Content-Type": "application/json"})
    assert stored.status_code == 200, stored.text
    points = metrics_run.client.get(url, params={"name": "loss"}).json()["series"][0]["points"]
    assert points == [[1, 5.0, None]]


def test_metrics_filter_by_name_rank_and_since(metrics_run):
    url = f"{API}/runs/{metrics_run.run_id}/metrics"
    metrics_run.trainer.post(url, json={"records": _records(range(10)) + _records(range(10), name="accuracy")})
    metrics_run.trainer_of(2).post(url, json={"records": _records(range(10), rank=2)})

    loss_rank2 = metrics_run.client.get(url, params={"name": "loss", "rank": 2}).json()
    newer = metrics_run.client.get(url, params={"name": "loss", "rank": 1, "since": 1_763_779_200.0 + 6}).json()

    assert [(s["name"], s["rank"]) for s in loss_rank2["series"]] == [("loss", 2)]
    assert [p[0] for p in loss_rank2["series"][0]["points"]] == list(range(10))
    assert [p[0] for p in newer["series"][0]["points"]] == [7, 8, 9]
    assert newer["last_t"] == 1_763_779_200.0 + 9


def test_long_series_are_downsampled_on_the_server(metrics_run):
    url = f"{API}/runs/{metrics_run.run_id}/metrics"
    for start in range(0, 5000, 1000):
        metrics_run.trainer.post(url, json={"records": _records(range(start, start + 1000))})

    data = metrics_run.client.get(url, params={"name": "loss", "max_points": 100}).json()

    series = data["series"][0]
    assert series["count"] == 5000 and series["downsampled"] is True
    assert len(series["points"]) == 100
    step, _, value = series["points"][0]
    # The first bucket holds steps 0..49: its point is the last step and the mean value.
    assert step == 49
    assert math.isclose(value, sum(1.0 / (s + 1) for s in range(50)) / 50, rel_tol=1e-9)
    assert series["points"][-1][0] == 4999


def test_a_short_series_comes_back_whole_with_replayed_steps_in_time_order(metrics_run):
    url = f"{API}/runs/{metrics_run.run_id}/metrics"
    # A resumed run trains steps 3..4 a second time, later and in a new process (stream).
    first = _records(range(5))
    replay = [{**r, "t": r["t"] + 100, "value": r["value"] / 2, "stream": "b" * 16, "seq": i}
              for i, r in enumerate(_records(range(3, 6)))]
    metrics_run.trainer.post(url, json={"records": first})
    metrics_run.trainer.post(url, json={"records": replay})

    series = metrics_run.client.get(url, params={"name": "loss", "max_points": 8}).json()["series"][0]

    assert series["count"] == 8 and series["downsampled"] is False
    assert [p[0] for p in series["points"]] == [0, 1, 2, 3, 4, 3, 4, 5]
    assert [p[1] for p in series["points"]] == sorted(p[1] for p in series["points"])


def test_logs_are_stored_once_per_line_and_read_newest_last(metrics_run):
    url = f"{API}/agent/runs/{metrics_run.run_id}/logs"
    lines = [{"seq": i, "t": 1.0 + i, "line": f"step {i}"} for i in range(5)]
    metrics_run.agent.post(url, json={"rank": 1, "lines": lines[:3]})
    metrics_run.agent.post(url, json={"rank": 1, "lines": lines[2:], "dropped": 2})
    metrics_run.agent.post(url, json={"rank": 0, "lines": [{"seq": 0, "t": 1.0, "line": "server up\x00"}]})

    all_ranks = metrics_run.client.get(f"{API}/runs/{metrics_run.run_id}/logs").json()["lines"]
    tail = metrics_run.client.get(f"{API}/runs/{metrics_run.run_id}/logs", params={"rank": 1, "tail": 2}).json()

    assert [(x["rank"], x["line"]) for x in all_ranks] == [
        (0, "server up\ufffd"), (1, "step 0"), (1, "step 1"), (1, "step 2"),
        (1, "step 3"), (1, "step 4"),
    ]
    assert [x["line"] for x in tail["lines"]] == ["step 3", "step 4"]


def test_logs_of_a_rank_planned_elsewhere_are_refused(metrics_run):
    url = f"{API}/agent/runs/{metrics_run.run_id}/logs"
    answer = metrics_run.agent.post(url, json={"rank": 7, "lines": []})
    assert answer.status_code == 409
