"""GET /metrics on the real Postgres, parsed by prometheus_client's own parser: the families,
requests by route template, runs by state, ingestion, live runs' training figures, and who
may scrape."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from pydantic import SecretStr
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)
from sqlalchemy.orm import Session

from agents.celery_app import LAUNCH_ROLE
from app.api.deps import get_session
from app.main import create_app
from app.models import Node, NodeStatus, Run, RunStatus, RunWorker, WorkerStatus
from app.queries.metrics import store_metrics
from app.schemas.runs import MetricRecord
from app.security import hash_secret, new_secret

METRICS_TOKEN = "scrape-token-5b0e7c1d9a"
GIB = 2**30

Families = dict[str, Any]


def _parse(text: str) -> Families:
    return {family.name: family for family in text_string_to_metric_families(text)}


def _samples(families: Families, name: str, **labels: str) -> list[Sample]:
    """The samples of family `name` whose labels include `labels`."""
    family = families.get(name)
    assert family is not None, f"no family {name}"
    return [s for s in family.samples if labels.items() <= s.labels.items()]


def _value(families: Families, name: str, sample: str | None = None, **labels: str) -> float:
    """The one sample's value (0 when no sample matches, as for a counter not yet touched)."""
    found = [s for s in _samples(families, name, **labels) if sample is None or s.name == sample]
    assert len(found) <= 1, found
    return found[0].value if found else 0.0


@pytest.fixture
def scraper(app: FastAPI, make_client: Callable[[str | None], TestClient]) -> TestClient:
    """A client on this host (no metrics token is set) of the app the other clients call."""
    make_client(None)  # puts the test's session into the app
    return TestClient(app, client=("127.0.0.1", 40000))


@pytest.fixture
def scrape(scraper: TestClient) -> Callable[[], Families]:
    """Scrape the app and parse the answer."""

    def _scrape() -> Families:
        response = scraper.get("/metrics")
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
        return _parse(response.text)

    return _scrape


@pytest.fixture(scope="module")
def token_app(settings) -> FastAPI:
    """An app that wants HYBRIDTRAIN_METRICS_TOKEN from its scrapers."""
    return create_app(settings.model_copy(update={"metrics_token": SecretStr(METRICS_TOKEN)}))


# -- what a scrape holds ----------------------------------------------------------------------


def test_a_scrape_has_every_family_of_the_control_plane(scrape):
    families = scrape()

    kinds = {name: family.type for name, family in families.items()}
    assert kinds == kinds | {
        "hybridtrain_http_requests": "counter",
        "hybridtrain_http_request_duration_seconds": "histogram",
        "hybridtrain_metric_records_received": "counter",
        "hybridtrain_metric_records_stored": "counter",
        "hybridtrain_database_up": "gauge",
        "hybridtrain_runs": "gauge",
        "hybridtrain_launch_queue_length": "gauge",
        "hybridtrain_nodes": "gauge",
        "hybridtrain_run_samples_per_second": "gauge",
        "hybridtrain_run_step_seconds": "gauge",
        "hybridtrain_run_info": "gauge",
        "hybridtrain_run_link_bytes": "counter",
        "hybridtrain_run_egress_usd": "gauge",
        "hybridtrain_run_compute_usd": "gauge",
    }
    assert _value(families, "hybridtrain_database_up") == 1
    # Every state has its series, so an alert on one never sees a missing series.
    assert {s.labels["state"] for s in _samples(families, "hybridtrain_runs")} == set(RunStatus)


def test_a_run_created_through_the_api_counts_in_its_state_and_the_launch_queue(
    scrape, client, online_node, dispatched
):
    node = online_node()
    before = scrape()

    created = client.post(f"{API}/runs", json=run_body([node]))
    assert created.status_code == 201, created.text
    state = created.json()["status"]
    after = scrape()

    assert state in ("queued", "launching")
    assert _value(after, "hybridtrain_runs", state=state) == _value(before, "hybridtrain_runs", state=state) + 1
    assert _value(after, "hybridtrain_launch_queue_length") == (
        _value(before, "hybridtrain_launch_queue_length") + 1
    )


def test_requests_are_counted_by_route_template_and_status_never_by_raw_path(scrape, client, make_node):
    node = make_node()
    before = scrape()

    assert client.get(f"{API}/nodes/{node['id']}").status_code == 200
    assert client.get(f"{API}/nodes/987654321").status_code == 404
    assert client.get("/no/such/page-3f9c2b").status_code == 404
    families = scrape()

    route = f"{API}/nodes/{{node_id}}"

    def delta(**labels: str) -> float:
        return (_value(families, "hybridtrain_http_requests", **labels)
                - _value(before, "hybridtrain_http_requests", **labels))

    assert delta(method="GET", route=route, status="200") == 1
    assert delta(method="GET", route=route, status="404") == 1
    assert delta(method="GET", route="<unmatched>", status="404") >= 1
    routes = {s.labels["route"] for s in _samples(families, "hybridtrain_http_requests")}
    assert not any("987654321" in r or "page-3f9c2b" in r for r in routes)


def test_each_request_is_timed_in_the_latency_histogram(scrape, client):
    before = scrape()

    for _ in range(3):
        assert client.get(f"{API}/sites").status_code == 200
    families = scrape()

    def count(f: Families) -> float:
        return _value(f, "hybridtrain_http_request_duration_seconds",
                      "hybridtrain_http_request_duration_seconds_count", method="GET", route=f"{API}/sites")

    assert count(families) - count(before) == 3
    total = _value(families, "hybridtrain_http_request_duration_seconds",
                   "hybridtrain_http_request_duration_seconds_sum", method="GET", route=f"{API}/sites")
    assert total > 0


def test_ingested_records_are_counted_received_and_stored(scrape, client, online_node, dispatched, make_client):
    node = online_node()
    run = client.post(f"{API}/runs", json=run_body([node])).json()
    token = next(args for task, args in dispatched.take(node.id) if task == LAUNCH_ROLE)[2]["report_token"]
    trainer = make_client(token)
    # Rank 0's order goes out first; its token reports rank 0's records.
    records = [{"rank": 0, "role": "ps", "step": s, "t": 1_763_779_200.0 + s, "name": "loss", "value": 1.0}
               for s in range(4)]
    before = scrape()

    assert trainer.post(f"{API}/runs/{run['id']}/metrics", json={"records": records}).status_code == 200
    # A re-delivery of the same batch is received again but stores nothing new.
    assert trainer.post(f"{API}/runs/{run['id']}/metrics", json={"records": records}).status_code == 200
    # A refused batch counts nowhere.
    assert client.post(f"{API}/runs/{run['id']}/metrics", json={"records": records}).status_code == 401
    after = scrape()

    def delta(name: str) -> float:
        return _value(after, name) - _value(before, name)

    assert delta("hybridtrain_metric_records_received") == 8
    assert delta("hybridtrain_metric_records_stored") == 4


# -- live runs' training figures --------------------------------------------------------------


@pytest.fixture
def hybrid_live_run(session: Session, make_site, make_node) -> tuple[Run, dict, dict]:
    """A running ps-bz-gc run: the server on an on-prem node, a worker on a spot GCP T4 node,
    with two steps of metrics (the GCP worker sends 1 GiB to the server per step)."""
    lab = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="asia")
    gcp = make_site(provider="gcp", region="us-west", zone="us-west-a", continent="north_america")
    onprem = make_node(site_id=lab["id"], gpus=[{"model": "RTX 3090", "count": 1}])
    cloud = make_node(site_id=gcp["id"], instance_type="n1-standard-8", spot=True,
                      gpus=[{"model": "T4", "count": 1}])
    started = datetime.now(UTC) - timedelta(minutes=30)
    run = Run(
        name=f"live-{uuid.uuid4().hex[:6]}", status=RunStatus.running, strategy="ps-bz-gc",
        task="hybridtrain.tasks.digits:smallcnn", global_batch_size=64, max_steps=100,
        allocation="flops", compression={}, metrics_token_hash=hash_secret(new_secret("htr_")),
        created_by="test", launched_at=started, started_at=started,
        workers=[
            RunWorker(rank=0, role="ps", node_id=onprem["id"], node_name=onprem["name"],
                      status=WorkerStatus.running, started_at=started),
            RunWorker(rank=1, role="worker", node_id=cloud["id"], node_name=cloud["name"],
                      batch_size=64, status=WorkerStatus.running, started_at=started),
        ],
    )
    session.add(run)
    session.flush()
    t0 = started.timestamp()
    records = []
    for step, samples_per_s in ((1, 100.0), (2, 128.0)):
        records += [
            MetricRecord(rank=1, role="worker", step=step, t=t0 + step, name="samples_per_s", value=samples_per_s),
            MetricRecord(rank=1, role="worker", step=step, t=t0 + step, name="batch_size", value=64),
            MetricRecord(rank=1, role="worker", step=step, t=t0 + step, name="bytes_sent", value=GIB, peer=0),
            MetricRecord(rank=0, role="ps", step=step, t=t0 + step, name="bytes_sent", value=GIB // 4, peer=1),
        ]
    store_metrics(session, run_id=run.id, records=records)
    session.commit()
    return run, onprem, cloud


GPU_READINGS = [
    {"index": 0, "name": "Tesla T4", "utilization": 0.87, "memory_used_bytes": 9 * GIB, "memory_total_bytes": 15 * GIB},
    {"index": 1, "name": "Tesla T4", "utilization": 0.0, "memory_used_bytes": 0, "memory_total_bytes": 15 * GIB},
]


def test_a_nodes_gpus_show_their_utilisation_and_memory_from_its_heartbeat(scrape, online_node):
    node = online_node()
    assert node.agent.post(f"{API}/agent/heartbeat", json={"gpus": GPU_READINGS}).status_code == 200
    families = scrape()

    assert _value(families, "hybridtrain_node_gpu_utilization_ratio", node=node.name, gpu="0", model="Tesla T4") == 0.87
    assert _value(families, "hybridtrain_node_gpu_utilization_ratio", node=node.name, gpu="1") == 0.0
    assert _value(families, "hybridtrain_node_gpu_memory_used_bytes", node=node.name, gpu="0") == 9 * GIB
    assert _value(families, "hybridtrain_node_gpu_memory_total_bytes", node=node.name, gpu="1") == 15 * GIB


def test_a_heartbeat_without_readings_keeps_the_last_ones(scrape, online_node):
    node = online_node()
    node.agent.post(f"{API}/agent/heartbeat", json={"gpus": GPU_READINGS})
    assert node.agent.post(f"{API}/agent/heartbeat", json={}).status_code == 200
    assert _value(scrape(), "hybridtrain_node_gpu_utilization_ratio", node=node.name, gpu="0") == 0.87


def test_an_offline_nodes_gpus_leave_the_scrape(scrape, online_node, session):
    node = online_node()
    node.agent.post(f"{API}/agent/heartbeat", json={"gpus": GPU_READINGS})
    session.get(Node, node.id).status = NodeStatus.offline
    session.commit()
    assert not _samples(scrape(), "hybridtrain_node_gpu_utilization_ratio", node=node.name)


def test_a_reading_out_of_range_is_refused(online_node):
    node = online_node()
    bad = [GPU_READINGS[0] | {"utilization": 87}]
    assert node.agent.post(f"{API}/agent/heartbeat", json={"gpus": bad}).status_code == 422


def test_a_running_rank_shows_its_latest_samples_per_second_and_step_time(scrape, hybrid_live_run):
    run, _, cloud = hybrid_live_run

    families = scrape()

    labels = {"run_id": str(run.id), "rank": "1", "role": "worker", "node": cloud["name"]}
    assert _value(families, "hybridtrain_run_samples_per_second", **labels) == 128.0
    assert _value(families, "hybridtrain_run_step_seconds", **labels) == pytest.approx(64 / 128.0)
    # The server reported no throughput of its own yet: no sample rather than a made-up 0.
    assert _samples(families, "hybridtrain_run_samples_per_second", run_id=str(run.id), rank="0") == []


def test_a_live_run_shows_its_bytes_by_link_and_its_bill_so_far(scrape, client, hybrid_live_run):
    run, onprem, cloud = hybrid_live_run

    families = scrape()

    link = "hybridtrain_run_link_bytes"
    assert _value(families, link, run_id=str(run.id), src_node=cloud["name"], dst_node=onprem["name"]) == 2 * GIB
    assert _value(families, link, run_id=str(run.id), src_node=onprem["name"], dst_node=cloud["name"]) == GIB // 2
    cost = client.get(f"{API}/runs/{run.id}/cost").json()
    assert cost["egress_usd"] > 0
    assert _value(families, "hybridtrain_run_egress_usd", run_id=str(run.id)) == pytest.approx(cost["egress_usd"])
    assert _value(families, "hybridtrain_run_compute_usd", run_id=str(run.id)) == pytest.approx(
        cost["compute_usd"], rel=0.01)
    assert _value(families, "hybridtrain_run_info", run_id=str(run.id), run_name=run.name, strategy="ps-bz-gc") == 1


def test_a_finished_run_leaves_the_live_figures(scrape, session, hybrid_live_run):
    run, _, _ = hybrid_live_run
    run.status = RunStatus.succeeded
    run.finished_at = datetime.now(UTC)
    session.commit()

    families = scrape()

    for name in ("hybridtrain_run_samples_per_second", "hybridtrain_run_link_bytes", "hybridtrain_run_egress_usd"):
        assert _samples(families, name, run_id=str(run.id)) == []


def test_a_run_whose_figures_cannot_be_billed_loses_only_its_bill(scrape, session, hybrid_live_run):
    run, _, _ = hybrid_live_run
    # A faulty rank reports a negative byte count: the bill refuses it.
    store_metrics(session, run_id=run.id, records=[
        MetricRecord(rank=1, role="worker", step=3, t=1.0, name="bytes_sent", value=-10 * GIB, peer=0)])
    session.commit()

    families = scrape()

    assert _samples(families, "hybridtrain_run_egress_usd", run_id=str(run.id)) == []
    assert _value(families, "hybridtrain_run_samples_per_second", run_id=str(run.id), rank="1") == 128.0
    assert _value(families, "hybridtrain_database_up") == 1


# -- who may scrape ---------------------------------------------------------------------------


def test_with_a_metrics_token_only_a_scrape_that_sends_it_is_answered(token_app, session):
    token_app.dependency_overrides[get_session] = lambda: session
    try:
        bare = TestClient(token_app, client=("127.0.0.1", 40000))
        wrong = TestClient(token_app, headers={"Authorization": "Bearer not-the-token-0000"})
        right = TestClient(token_app, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})

        assert bare.get("/metrics").status_code == 401
        refused = wrong.get("/metrics")
        assert refused.status_code == 401 and "HYBRIDTRAIN_METRICS_TOKEN" in refused.json()["detail"]
        assert right.get("/metrics").status_code == 200
    finally:
        token_app.dependency_overrides.pop(get_session, None)


def test_without_a_metrics_token_only_this_host_may_scrape(app, make_client):
    make_client(None)
    local = TestClient(app, client=("127.0.0.1", 40000))
    local_v6 = TestClient(app, client=("::1", 40000))
    remote = TestClient(app, client=("10.1.2.3", 40000))
    relayed = TestClient(app, client=("127.0.0.1", 40000), headers={"X-Forwarded-For": "203.0.113.9"})

    assert local.get("/metrics").status_code == 200
    assert local_v6.get("/metrics").status_code == 200
    refused = remote.get("/metrics")
    assert refused.status_code == 403 and "HYBRIDTRAIN_METRICS_TOKEN" in refused.json()["detail"]
    assert relayed.get("/metrics").status_code == 403


def test_the_metrics_token_must_be_long_enough(settings):
    with pytest.raises(ValueError, match="metrics_token"):
        type(settings)(DATABASE_URL=settings.database_url, metrics_token="short")


def test_a_scrape_still_answers_when_the_database_is_down(settings):
    # Port 1 on this host refuses connections at once.
    down = create_app(settings.model_copy(update={
        "database_url": "postgresql+psycopg://nobody@127.0.0.1:1/none",
        "metrics_token": SecretStr(METRICS_TOKEN),
    }))
    scraper = TestClient(down, headers={"Authorization": f"Bearer {METRICS_TOKEN}"})

    response = scraper.get("/metrics")

    assert response.status_code == 200
    families = _parse(response.text)
    assert _value(families, "hybridtrain_database_up") == 0
    assert "hybridtrain_http_requests" in families and "hybridtrain_runs" not in families
    down.state.engine.dispose()


def test_an_empty_metrics_token_counts_as_unset(settings):
    # What `HYBRIDTRAIN_METRICS_TOKEN: ${HYBRIDTRAIN_METRICS_TOKEN:-}` in a compose file gives.
    assert type(settings)(DATABASE_URL=settings.database_url, metrics_token="").metrics_token is None
