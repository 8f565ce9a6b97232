"""Links: probe orders, agents' probe reports, declared site links, `link_estimates`, and the
probes ordered when an agent first registers."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from runs_testing import (  # noqa: F401 (fixtures)
    API,
    dispatched_fixture,
    runs_redis_url_fixture,
)
from sqlalchemy.orm import Session

from app.api.deps import get_dispatcher
from app.dispatch import Order, ProbeOrder
from app.models import LinkMeasurement, Node, NodeStatus, SiteLink, TokenScope
from app.queries.links import JOIN_PROBE_PEERS, PROBE_SLOT_OVERHEAD_S, LinkEstimate, link_estimates, probe_rounds
from hybridtrain.contract import PROBE_LINKS_TASK


class RecordingDispatcher:
    """Keeps the orders instead of publishing them."""

    def __init__(self) -> None:
        self.sent: list[Order] = []
        self.fail = False

    def send(self, orders: Iterable[Order]) -> None:
        if self.fail:
            raise ConnectionError("broker unreachable")
        self.sent.extend(orders)

    def send_quietly(self, orders: Iterable[Order]) -> None:
        self.sent.extend(orders)


@pytest.fixture
def recorded(app: FastAPI) -> Iterator[RecordingDispatcher]:
    dispatcher = RecordingDispatcher()
    app.dependency_overrides[get_dispatcher] = lambda: dispatcher
    try:
        yield dispatcher
    finally:
        app.dependency_overrides.pop(get_dispatcher, None)


@dataclass
class Joined:
    id: int
    name: str
    site_id: int
    agent: TestClient
    port: int | None


@pytest.fixture
def joined(
    client: TestClient, make_site: Callable[..., dict[str, Any]],
    make_client: Callable[[str | None], TestClient],
) -> Callable[..., Joined]:
    """A node whose agent registered, advertising a probe port unless `port` is None."""
    ports = iter(range(41000, 42000))

    def _make(*, site_id: int | None = None, port: int | None = -1, address: str | None = "10.0.0.1",
              join_token_of: dict[str, Any] | None = None) -> Joined:
        site_id = site_id or make_site()["id"]
        node = client.post(f"{API}/nodes", json={
            "name": f"node-{uuid.uuid4().hex[:8]}", "site_id": site_id, "gpus": []}).json()
        port = next(ports) if port == -1 else port
        hardware: dict[str, Any] = {"hostname": node["name"], "gpus": []}
        if address:
            hardware["address"] = address
        if port is not None:
            hardware["probe_port"] = port
        token = "hta_" + secrets.token_urlsafe(32)
        registered = client.post(f"{API}/agent/register", json={
            "join_token": node["join_token"], "agent_token": token, "hardware": hardware})
        assert registered.status_code == 201, registered.text
        return Joined(node["id"], node["name"], site_id, make_client(token), port)

    return _make


def _measure(session: Session, src: int, dst: int, mbps: float, *, ago_s: float = 0, rtt_ms: float = 1.0) -> None:
    session.add(LinkMeasurement(
        src_node_id=src, dst_node_id=dst, mbps=mbps, rtt_ms=rtt_ms, bytes=1000, seconds=1.0,
        measured_at=datetime.now(UTC) - timedelta(seconds=ago_s),
    ))
    session.flush()


def _result(dst: int, **fields: Any) -> dict[str, Any]:
    return {"dst_node_id": dst, "mbps": 940.5, "rtt_ms": 0.3, "bytes": 117_000_000, "seconds": 1.0} | fields


# -- probe orders -------------------------------------------------------------------------------


def test_probe_orders_every_node_to_probe_every_other_node(client, joined, recorded):
    a, b, c = joined(), joined(), joined(address="10.0.0.3")

    response = client.post(f"{API}/links/probe", json={"node_ids": [a.id, b.id, c.id], "seconds": 1.5})

    assert response.status_code == 202, response.text
    assert response.json() == {
        "orders": [{"node_id": a.id, "targets": [b.id, c.id]}, {"node_id": b.id, "targets": [a.id, c.id]},
                   {"node_id": c.id, "targets": [a.id, b.id]}],
        "skipped": [],
    }
    first = recorded.sent[0]
    targets = first.spec["targets"]
    assert first == ProbeOrder(node_id=a.id, spec={"targets": [
        {"node_id": b.id, "host": "10.0.0.1", "port": b.port, "round": 0, "start_at": targets[0]["start_at"]},
        {"node_id": c.id, "host": "10.0.0.3", "port": c.port, "round": 1, "start_at": targets[1]["start_at"]},
    ], "seconds": 1.5})
    # Three nodes, three sites: one probe at a time, each slot its seconds plus the overhead.
    assert targets[1]["start_at"] - targets[0]["start_at"] == pytest.approx(1.5 + PROBE_SLOT_OVERHEAD_S)
    assert [t["round"] for o in recorded.sent for t in o.spec["targets"]] == [0, 1, 2, 3, 4, 5]


def test_probe_rounds_share_no_node_and_no_site_pipe():
    # Sites 1 (nodes 1, 2) and 2 (nodes 3, 4): every direction of every pair.
    site_of = {1: 1, 2: 1, 3: 2, 4: 2}
    pairs = [(a, b) for a in site_of for b in site_of if a != b]

    rounds = probe_rounds(pairs, site_of)

    assert sorted(p for r in rounds for p in r) == sorted(pairs)
    for r in rounds:
        nodes = [n for p in r for n in p]
        assert len(nodes) == len(set(nodes))  # one probe per node: one direction at a time
        assert sum(site_of[a] != site_of[b] for a, b in r) <= 1  # one probe on the WAN
    # The 8 WAN probes first, one per round (each keeps a node of both sites busy), then the LAN
    # probes, two at a time: 1 -> 2 beside 3 -> 4, then back.
    assert [sum(site_of[a] != site_of[b] for a, b in r) for r in rounds[:8]] == [1] * 8
    assert rounds[8:] == [[(1, 2), (3, 4)], [(2, 1), (4, 3)]]


def test_probe_skips_nodes_that_cannot_be_probed_with_the_reason(client, joined, recorded, session):
    a, b = joined(), joined()
    portless, offline = joined(port=None), joined()
    session.get(Node, offline.id).status = NodeStatus.offline
    session.flush()

    body = client.post(f"{API}/links/probe", json={
        "node_ids": [a.id, b.id, portless.id, offline.id]}).json()

    assert [o["node_id"] for o in body["orders"]] == [a.id, b.id, portless.id]
    assert body["orders"][2]["targets"] == [a.id, b.id]
    reasons = {s["node_id"]: s["reason"] for s in body["skipped"]}
    assert "advertises no probe port" in reasons[portless.id]
    assert "is offline" in reasons[offline.id] and "neither probes nor is probed" in reasons[offline.id]


def test_probe_rejects_fewer_than_two_distinct_nodes_naming_node_ids(client, joined, recorded):
    a = joined()
    response = client.post(f"{API}/links/probe", json={"node_ids": [a.id, a.id]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "node_ids"]
    assert recorded.sent == []


def test_probe_names_the_unknown_node_by_its_position(client, joined, recorded):
    a = joined()
    response = client.post(f"{API}/links/probe", json={"node_ids": [a.id, 2_000_000_000]})
    assert response.status_code == 404
    assert response.json()["detail"] == "node_ids.1: node 2000000000 not found"


def test_probe_needs_the_ci_scope(make_client, token_with_scope, joined, recorded):
    a, b = joined(), joined()
    reader = make_client(token_with_scope(TokenScope.read))
    assert reader.post(f"{API}/links/probe", json={"node_ids": [a.id, b.id]}).status_code == 403
    ci = make_client(token_with_scope(TokenScope.ci))
    assert ci.post(f"{API}/links/probe", json={"node_ids": [a.id, b.id]}).status_code == 202


def test_probe_answers_503_when_the_broker_is_down(client, joined, recorded):
    a, b = joined(), joined()
    recorded.fail = True
    response = client.post(f"{API}/links/probe", json={"node_ids": [a.id, b.id]})
    assert response.status_code == 503
    assert "broker unreachable" in response.json()["detail"]


def test_probe_order_reaches_the_nodes_queue_as_the_probe_links_task(client, joined, dispatched):
    a, b = joined(), joined()
    dispatched.take(a.id)
    dispatched.take(b.id)

    client.post(f"{API}/links/probe", json={"node_ids": [a.id, b.id], "seconds": 0.5})

    [(task, [spec])] = dispatched.take(a.id)
    assert task == PROBE_LINKS_TASK and spec["seconds"] == 0.5
    [target] = spec["targets"]
    assert {k: target[k] for k in ("node_id", "host", "port", "round")} == {
        "node_id": b.id, "host": "10.0.0.1", "port": b.port, "round": 0}


# -- agents' reports ----------------------------------------------------------------------------


def test_agent_link_report_is_stored_and_listed_for_both_ends(client, joined):
    a, b = joined(), joined()

    response = a.agent.post(f"{API}/agent/links", json={
        "src_node_id": a.id, "results": [_result(b.id)],
        "errors": [{"dst_node_id": b.id, "error": "probe of 10.0.0.1:1 refused"}]})

    assert response.status_code == 200, response.text
    assert response.json() == {"stored": 1, "errors": 1}
    for node_id in (a.id, b.id):
        page = client.get(f"{API}/links", params={"node_id": node_id}).json()
        assert page["count"] == 1
        assert page["data"][0] | {"id": 0, "measured_at": ""} == {
            "id": 0, "src_node_id": a.id, "dst_node_id": b.id, "mbps": 940.5, "rtt_ms": 0.3,
            "bytes": 117_000_000, "seconds": 1.0, "measured_at": ""}


def test_agent_may_not_report_the_links_of_another_node(joined):
    a, b = joined(), joined()
    response = a.agent.post(f"{API}/agent/links", json={"src_node_id": b.id, "results": [_result(a.id)]})
    assert response.status_code == 403
    assert "src_node_id" in response.json()["detail"]


def test_agent_link_report_names_an_unknown_destination(joined):
    a, b = joined(), joined()
    response = a.agent.post(f"{API}/agent/links", json={
        "results": [_result(b.id), _result(2_000_000_000)]})
    assert response.status_code == 404
    assert response.json()["detail"] == "results.1.dst_node_id: node 2000000000 not found"


def test_agent_link_report_rejects_a_link_to_its_own_node(joined):
    a = joined()
    response = a.agent.post(f"{API}/agent/links", json={"results": [_result(a.id)]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "results", 0, "dst_node_id"]


def test_agent_link_report_needs_an_agent_token(client, joined):
    a, b = joined(), joined()
    assert client.post(f"{API}/agent/links", json={"results": [_result(b.id)]}).status_code == 401


# -- estimates ----------------------------------------------------------------------------------


def test_estimate_takes_the_newest_probe_of_the_pair(session, joined):
    a, b = joined(), joined()
    _measure(session, a.id, b.id, 10.0, ago_s=60)
    _measure(session, a.id, b.id, 20.0, ago_s=1)
    _measure(session, a.id, b.id, 30.0, ago_s=30)

    estimate = link_estimates(session, node_ids=[a.id, b.id])[a.id, b.id]

    assert (estimate.mbps, estimate.source) == (20.0, "measured")
    assert estimate.measured_at is not None


def test_estimate_falls_back_to_the_reverse_probe(session, joined):
    a, b = joined(), joined()
    _measure(session, b.id, a.id, 55.0, rtt_ms=12.0)
    _measure(session, a.id, b.id, 77.0, ago_s=3600)

    estimates = link_estimates(session, node_ids=[a.id, b.id])

    assert (estimates[a.id, b.id].mbps, estimates[a.id, b.id].source) == (77.0, "measured")
    assert (estimates[b.id, a.id].mbps, estimates[b.id, a.id].rtt_ms) == (55.0, 12.0)
    c = joined()
    _measure(session, c.id, a.id, 5.0)
    assert link_estimates(session, node_ids=[a.id, c.id])[a.id, c.id].mbps == 5.0


def test_estimate_uses_a_declared_site_link_both_ways_unless_the_reverse_is_declared(session, joined, make_site):
    s1, s2, s3 = make_site()["id"], make_site()["id"], make_site()["id"]
    a, b, c = joined(site_id=s1), joined(site_id=s2), joined(site_id=s3)
    session.add_all([
        SiteLink(src_site_id=s1, dst_site_id=s2, mbps=300.0, rtt_ms=20.0, created_by="t"),
        SiteLink(src_site_id=s1, dst_site_id=s3, mbps=400.0, rtt_ms=30.0, created_by="t"),
        SiteLink(src_site_id=s3, dst_site_id=s1, mbps=40.0, rtt_ms=31.0, created_by="t"),
    ])
    session.flush()

    e = link_estimates(session, node_ids=[a.id, b.id, c.id])

    assert e[a.id, b.id] == LinkEstimate(300.0, 20.0, "declared", None)
    assert e[b.id, a.id] == LinkEstimate(300.0, 20.0, "declared", None)
    assert (e[a.id, c.id].mbps, e[c.id, a.id].mbps) == (400.0, 40.0)
    assert e[b.id, c.id] == LinkEstimate(100.0, 50.0, "assumed", None)


def test_estimate_prefers_a_measured_probe_to_a_declared_link(session, joined, make_site):
    s1, s2 = make_site()["id"], make_site()["id"]
    a, b = joined(site_id=s1), joined(site_id=s2)
    session.add(SiteLink(src_site_id=s1, dst_site_id=s2, mbps=300.0, rtt_ms=20.0, created_by="t"))
    _measure(session, b.id, a.id, 90.0)

    assert link_estimates(session, node_ids=[a.id, b.id])[a.id, b.id].source == "measured"


def test_estimate_assumes_a_lan_inside_a_site_and_an_internet_path_between(session, joined, make_site):
    site = make_site()["id"]
    a, b, c = joined(site_id=site), joined(site_id=site), joined()

    e = link_estimates(session, node_ids=[a.id, b.id, c.id])

    assert len(e) == 6
    assert e[a.id, b.id] == LinkEstimate(1000.0, 0.5, "assumed", None)
    assert e[c.id, a.id] == LinkEstimate(100.0, 50.0, "assumed", None)


# -- declared site links ------------------------------------------------------------------------


def test_site_links_are_created_listed_and_deleted(client, make_site):
    s1, s2 = make_site()["id"], make_site()["id"]

    created = client.post(f"{API}/site-links", json={
        "src_site_id": s1, "dst_site_id": s2, "mbps": 250.0, "rtt_ms": 35.0})

    assert created.status_code == 201, created.text
    link = created.json()
    assert link["created_by"] == "HYBRIDTRAIN_ADMIN_TOKEN" and link["mbps"] == 250.0
    assert link in client.get(f"{API}/site-links").json()["data"]
    assert client.delete(f"{API}/site-links/{link['id']}").status_code == 204
    assert link not in client.get(f"{API}/site-links").json()["data"]
    assert client.delete(f"{API}/site-links/{link['id']}").status_code == 404


def test_site_link_names_an_unknown_site(client, make_site):
    s1 = make_site()["id"]
    response = client.post(f"{API}/site-links", json={
        "src_site_id": s1, "dst_site_id": 2_000_000_000, "mbps": 1.0, "rtt_ms": 1.0})
    assert response.status_code == 404
    assert response.json()["detail"] == "dst_site_id: site 2000000000 not found"


def test_site_link_declared_twice_conflicts(client, make_site):
    body = {"src_site_id": make_site()["id"], "dst_site_id": make_site()["id"], "mbps": 1.0, "rtt_ms": 1.0}
    assert client.post(f"{API}/site-links", json=body).status_code == 201
    assert client.post(f"{API}/site-links", json=body).status_code == 409


def test_site_link_rejects_a_bandwidth_of_zero(client, make_site):
    response = client.post(f"{API}/site-links", json={
        "src_site_id": make_site()["id"], "dst_site_id": make_site()["id"], "mbps": 0, "rtt_ms": 1.0})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "mbps"]


def test_site_links_are_declared_by_admins_only(make_client, token_with_scope, make_site):
    ci = make_client(token_with_scope(TokenScope.ci))
    body = {"src_site_id": make_site()["id"], "dst_site_id": make_site()["id"], "mbps": 1.0, "rtt_ms": 1.0}
    assert ci.post(f"{API}/site-links", json=body).status_code == 403
    assert ci.get(f"{API}/site-links").status_code == 200


# -- probes when an agent joins -----------------------------------------------------------------


def test_first_registration_orders_probes_both_ways_at_the_next_heartbeat(joined, recorded):
    a, b = joined(), joined()
    recorded.sent.clear()
    c = joined(address="10.0.0.9")
    assert recorded.sent == []  # nothing before the registration's commit and the agent's queue

    assert c.agent.post(f"{API}/agent/heartbeat", json={"roles": []}).status_code == 200

    by_node = {o.node_id: o.spec for o in recorded.sent}
    assert sorted(by_node) == sorted([a.id, b.id, c.id])
    assert sorted(t["node_id"] for t in by_node[c.id]["targets"]) == sorted([a.id, b.id])
    assert by_node[a.id]["targets"] == [{"node_id": c.id, "host": "10.0.0.9", "port": c.port}]
    recorded.sent.clear()
    c.agent.post(f"{API}/agent/heartbeat", json={"roles": []})
    assert recorded.sent == []  # once only


def test_join_probes_leave_out_nodes_without_a_probe_server(joined, recorded):
    joined(port=None)
    c = joined()
    c.agent.post(f"{API}/agent/heartbeat", json={"roles": []})
    assert recorded.sent == []


def test_join_probes_take_the_peers_that_beat_last_sixteen_at_most_from_a_site(joined, recorded, session):
    site = joined().site_id
    peers = [joined(site_id=site) for _ in range(JOIN_PROBE_PEERS + 1)]
    # The first-made peer has been silent longest: it is the one left out.
    session.get(Node, peers[0].id).last_heartbeat = datetime.now(UTC) - timedelta(seconds=20)
    session.commit()
    recorded.sent.clear()
    c = joined()

    c.agent.post(f"{API}/agent/heartbeat", json={"roles": []})

    targets = {t["node_id"] for o in recorded.sent if o.node_id == c.id for t in o.spec["targets"]}
    assert len(targets) == JOIN_PROBE_PEERS and peers[0].id not in targets
