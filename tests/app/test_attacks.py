"""Attacks on the control plane's credentials, each expecting a refusal (issue 17, "Secrets
and trust"): API tokens beyond their scope, expiry, revocation or actions; forged and orphaned
dashboard sessions; a node's agent token on another node's ranks; a rank's report token on
another rank's records, on another run, or after its run ended. An order for a node put on
its queue by anything but the control plane (another node's broker user) is refused by the
broker: test_agent_broker.py."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from itsdangerous import URLSafeTimedSerializer

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.config import Settings
from app.models import Run, TokenScope
from app.models.base import utcnow
from app.run_secrets import run_metrics_token
from app.queries.tokens import create_token
from app.security import hash_secret
from app.web import session as web_session
from tests.app.conftest import ADMIN_TOKEN
from tests.app.web.conftest import PageClient

MakeClient = Callable[[str | None], TestClient]


@pytest.fixture
def run_on_two_nodes(online_node, client, dispatched):
    """An all-reduce run with rank 0 on node a and rank 1 on node b, both started."""
    a, b = online_node(), online_node()
    created = client.post(f"{API}/runs", json=run_body([a, b], strategy="allreduce"))
    assert created.status_code == 201, created.text
    rid = created.json()["id"]
    a.event(rid, rank=0, role="worker", event="started", pid=100)
    b.event(rid, rank=1, role="worker", event="started", pid=101)
    return rid, a, b


def _run(client: TestClient, rid: int) -> dict:
    return client.get(f"{API}/runs/{rid}").json()


def _metrics(rank: int = 0) -> dict:
    return {"records": [{"rank": rank, "step": 1, "t": 1.0, "name": "bytes_sent", "value": 5e10, "peer": 1}]}


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- API tokens -------------------------------------------------------------------------------


def test_a_read_token_cannot_cancel_a_run(run_on_two_nodes, client, make_client, token_with_scope):
    rid, _, _ = run_on_two_nodes
    response = make_client(token_with_scope(TokenScope.read)).post(f"{API}/runs/{rid}/cancel")
    assert response.status_code == 403
    assert _run(client, rid)["status"] == "running"


def test_a_read_token_cannot_create_a_run(online_node, make_client, token_with_scope, dispatched):
    a = online_node()
    response = make_client(token_with_scope(TokenScope.read)).post(f"{API}/runs", json=run_body([a]))
    assert response.status_code == 403


def test_an_expired_token_cannot_create_a_run(online_node, session, make_client, dispatched):
    a = online_node()
    created = utcnow() - timedelta(days=31)
    _, secret = create_token(session, name="last-month", scope=TokenScope.ci,
                             expires_at=created + timedelta(days=30), now=created)
    session.commit()
    response = make_client(secret).post(f"{API}/runs", json=run_body([a]))
    assert response.status_code == 401
    assert "expired at" in response.json()["detail"]


def test_a_deleted_token_cannot_cancel_a_run(run_on_two_nodes, client, make_client):
    rid, _, _ = run_on_two_nodes
    created = client.post(f"{API}/tokens", json={"name": "leaked", "scope": "ci"}).json()
    assert client.delete(f"{API}/tokens/{created['id']}").status_code == 204
    response = make_client(created["token"]).post(f"{API}/runs/{rid}/cancel")
    assert response.status_code == 401
    assert _run(client, rid)["status"] == "running"


def test_a_token_limited_to_creating_runs_cannot_cancel_one(run_on_two_nodes, client, make_client):
    rid, _, _ = run_on_two_nodes
    secret = client.post(
        f"{API}/tokens", json={"name": "ci-launcher", "scope": "ci", "actions": ["runs:create"]}
    ).json()["token"]
    response = make_client(secret).post(f"{API}/runs/{rid}/cancel")
    assert response.status_code == 403
    assert "this needs 'runs:cancel'" in response.json()["detail"]
    assert _run(client, rid)["status"] == "running"


# --- dashboard sessions -----------------------------------------------------------------------


def _visit_with_cookie(make_client: MakeClient, cookie: str) -> int:
    browser = make_client(None)
    browser.cookies.set(web_session.COOKIE_NAME, cookie)
    return browser.get("/nodes", follow_redirects=False).status_code


def _admin_claim(secret_key: str) -> dict:
    return {"csrf": "x" * 43, "token_id": None, "admin": True, "flashes": [],
            "fingerprint": web_session.fingerprint(secret_key, hash_secret(ADMIN_TOKEN))}


def test_a_forged_session_cookie_is_signed_out(make_client, settings: Settings):
    genuine = URLSafeTimedSerializer(settings.secret_key, salt="hybridtrain.web.session.v1").dumps(
        _admin_claim(settings.secret_key)
    )
    assert _visit_with_cookie(make_client, genuine) == 200  # the claim itself would sign in
    payload, _, signature = genuine.rpartition(".")
    forged = payload + "." + hashlib.sha256(signature.encode()).hexdigest()[:27]
    assert _visit_with_cookie(make_client, forged) == 303


def test_a_session_cookie_signed_with_another_secret_key_is_signed_out(make_client, settings: Settings):
    other_key = "an-attackers-own-secret-key"
    assert other_key != settings.secret_key
    cookie = URLSafeTimedSerializer(other_key, salt="hybridtrain.web.session.v1").dumps(_admin_claim(other_key))
    assert _visit_with_cookie(make_client, cookie) == 303


def test_a_session_whose_token_was_deleted_is_signed_out(client, make_client):
    created = client.post(f"{API}/tokens", json={"name": "signed-in", "scope": "admin"}).json()
    page = PageClient(make_client(None))
    page.get("/login")
    assert page.post("/login", {"token": created["token"], "next": "/"}).status_code == 303
    cookie = page.http.cookies.get(web_session.COOKIE_NAME)
    assert _visit_with_cookie(make_client, cookie) == 200
    assert client.delete(f"{API}/tokens/{created['id']}").status_code == 204
    assert _visit_with_cookie(make_client, cookie) == 303


# --- agent tokens -----------------------------------------------------------------------------


def test_an_agent_cannot_report_the_end_of_a_rank_on_another_node(run_on_two_nodes, client):
    rid, a, _ = run_on_two_nodes
    response = a.event(rid, rank=1, role="worker", event="exited", exit_code=1, pid=101)
    assert response.status_code == 409
    assert [w["status"] for w in _run(client, rid)["workers"]] == ["running", "running"]


def test_an_agent_cannot_ship_logs_for_a_rank_on_another_node(run_on_two_nodes, client):
    rid, a, _ = run_on_two_nodes
    batch = {"rank": 1, "lines": [{"seq": 0, "t": 1.0, "line": "forged line"}]}
    response = a.agent.post(f"{API}/agent/runs/{rid}/logs", json=batch)
    assert response.status_code == 409
    logs = client.get(f"{API}/runs/{rid}/logs").json()
    assert all(line["line"] != "forged line" for line in logs["lines"])


def test_an_agents_heartbeat_cannot_end_a_rank_on_another_node(run_on_two_nodes, client):
    rid, a, _ = run_on_two_nodes
    beat = {"roles": [{"run_id": rid, "rank": 1, "role": "worker", "pid": 101, "state": "exited",
                       "exit_code": 1}]}
    assert a.agent.post(f"{API}/agent/heartbeat", json=beat).status_code == 200
    assert [w["status"] for w in _run(client, rid)["workers"]] == ["running", "running"]


# --- run metrics tokens -----------------------------------------------------------------------


@pytest.fixture
def two_runs(online_node, client, dispatched, settings: Settings):
    """Two single-node runs and the report token of the first one's rank 0."""
    a, b = online_node(), online_node()
    first = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce")).json()["id"]
    second = client.post(f"{API}/runs", json=run_body([b], strategy="allreduce")).json()["id"]
    return first, second, run_metrics_token(settings.secret_key, run_id=first, attempt=0, rank=0), a


def test_a_runs_metrics_token_cannot_post_another_runs_metrics(two_runs, make_client):
    first, second, token, _ = two_runs
    trainer = make_client(token)
    assert trainer.post(f"{API}/runs/{first}/metrics", json=_metrics()).status_code == 200
    assert trainer.post(f"{API}/runs/{second}/metrics", json=_metrics()).status_code == 401


def test_a_ranks_token_cannot_post_another_ranks_bytes(run_on_two_nodes, make_client, settings: Settings):
    rid, _, _ = run_on_two_nodes
    rank1 = make_client(run_metrics_token(settings.secret_key, run_id=rid, attempt=0, rank=1))

    response = rank1.post(f"{API}/runs/{rid}/metrics", json=_metrics(rank=0))

    assert response.status_code == 403 and "rank 1's token reports rank 1's records only" in response.json()["detail"]
    assert rank1.post(f"{API}/runs/{rid}/metrics", json=_metrics(rank=1)).status_code == 200


def test_a_token_naming_another_rank_than_it_was_made_for_is_refused(run_on_two_nodes, make_client, settings):
    rid, _, _ = run_on_two_nodes
    token = run_metrics_token(settings.secret_key, run_id=rid, attempt=0, rank=1)
    forged = make_client(token.replace("htr_1.", "htr_0.", 1))

    assert forged.post(f"{API}/runs/{rid}/metrics", json=_metrics(rank=0)).status_code == 401


def test_a_runs_metrics_token_cannot_upload_another_runs_checkpoint(two_runs, make_client):
    _, second, token, _ = two_runs
    data = b"not your model"
    headers = {**_bearer(token), "Content-Type": "application/octet-stream",
               "X-Content-Sha256": hashlib.sha256(data).hexdigest()}
    response = make_client(None).put(f"{API}/runs/{second}/checkpoint", params={"step": 1},
                                     content=data, headers=headers)
    assert response.status_code == 401


def test_a_runs_metrics_token_cannot_download_another_runs_checkpoint(two_runs, make_client):
    _, second, token, _ = two_runs
    assert make_client(token).get(f"{API}/runs/{second}/checkpoint").status_code == 401


def test_a_runs_metrics_token_cannot_download_another_runs_bundle(two_runs, make_client):
    _, second, token, _ = two_runs
    assert make_client(token).get(f"{API}/runs/{second}/bundle").status_code == 401


def _finish(client: TestClient, node, rid: int) -> None:
    node.event(rid, rank=0, role="worker", event="started", pid=100)
    node.event(rid, rank=0, role="worker", event="exited", exit_code=0, pid=100)
    assert _run(client, rid)["status"] == "succeeded"


def test_a_finished_runs_metrics_token_is_refused_once_the_grace_has_passed(
        two_runs, client, make_client, session, settings: Settings):
    first, _, token, a = two_runs
    _finish(client, a, first)
    run = session.get(Run, first)
    run.finished_at = utcnow() - timedelta(seconds=settings.finish_grace_s + 1)
    session.commit()

    response = make_client(token).post(f"{API}/runs/{first}/metrics", json=_metrics())

    assert response.status_code == 403 and "reports no more" in response.json()["detail"]


def test_a_just_finished_runs_metrics_token_still_delivers_the_records_in_flight(two_runs, client, make_client):
    first, _, token, a = two_runs
    _finish(client, a, first)

    assert make_client(token).post(f"{API}/runs/{first}/metrics", json=_metrics()).status_code == 200


def test_an_agent_cannot_deliver_spooled_records_of_a_rank_on_another_node(run_on_two_nodes, client):
    rid, a, _ = run_on_two_nodes

    response = a.agent.post(f"{API}/agent/runs/{rid}/metrics", json=_metrics(rank=1))

    assert response.status_code == 409 and f"rank 1 of run {rid} is not planned on node" in response.json()["detail"]
    assert client.get(f"{API}/runs/{rid}/metrics", params={"name": "bytes_sent"}).json()["series"] == []


def test_an_agent_cannot_bloat_its_node_with_a_heartbeat(online_node, client):
    a = online_node()
    huge = "x" * (5 << 20)
    for body, field in (
        ({"roles": [], "hardware": {"hostname": "h", "cpu_cores": 4, "notes": huge}}, "hardware"),
        ({"roles": [], "hardware": {"hostname": "h", "gpus": [{"model": "T4", "count": 1, "x": huge}]}}, "hardware"),
        ({"roles": [], "load": {"cpu_percent": 5, "notes": huge}}, "load"),
        ({"roles": [], "load": {"cpu_percent": float("nan")}}, "load"),
    ):
        beat = a.agent.post(f"{API}/agent/heartbeat", content=json.dumps(body), headers={"Content-Type": "application/json"})
        assert beat.status_code == 422, beat.text[:300]
        assert beat.json()["detail"][0]["loc"][:2] == ["body", field]
        assert len(beat.content) < 4000
    assert a.agent.post(f"{API}/agent/heartbeat", json={"roles": [], "load": {"cpu_percent": 5.0}}).status_code == 200
    node = client.get(f"{API}/nodes/{a.id}").json()
    assert len(json.dumps(node)) < 10_000
