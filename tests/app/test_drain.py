"""Draining a node over the real API and CLI on the real Postgres: it finishes its runs, takes
no new one, and queued runs that need it wait until it is undrained."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.cli import main
from tests.app.conftest import ADMIN_TOKEN
from tests.app.serving import cli_server


def _create(client, nodes, **fields):
    return client.post(f"{API}/runs", json=run_body(nodes, strategy="ps", ps_node_id=nodes[0].id, **fields))


def _run(client, rid):
    return client.get(f"{API}/runs/{rid}").json()


def test_draining_a_node_refuses_new_runs_naming_it(online_node, client, dispatched):
    a = online_node()

    drained = client.post(f"{API}/nodes/{a.id}/drain")
    refused = _create(client, [a])

    assert drained.status_code == 200 and drained.json()["status"] == "draining"
    assert refused.status_code == 409
    assert f"node {a.name} (id {a.id}) is draining" in refused.json()["detail"]


def test_a_drained_node_lets_its_current_run_finish(online_node, client, dispatched):
    a = online_node()
    rid = _create(client, [a]).json()["id"]
    a.event(rid, rank=0, role="ps", event="started", pid=1)
    a.event(rid, rank=1, role="worker", event="started", pid=2)

    client.post(f"{API}/nodes/{a.id}/drain")
    beat = a.agent.post(f"{API}/agent/heartbeat", json={"roles": []})
    assert _run(client, rid)["status"] == "running"
    a.event(rid, rank=0, role="ps", event="exited", exit_code=0, pid=1)

    assert _run(client, rid)["status"] == "succeeded"
    assert beat.json()["status"] == "draining"
    assert client.get(f"{API}/nodes/{a.id}").json()["status"] == "draining"


def test_a_queued_run_that_needs_a_draining_node_waits_and_starts_once_undrained(online_node, client, dispatched):
    a = online_node()
    holder = _create(client, [a]).json()["id"]
    queued = _create(client, [a]).json()["id"]
    client.post(f"{API}/nodes/{a.id}/drain")
    a.event(holder, rank=0, role="ps", event="started", pid=1)
    a.event(holder, rank=0, role="ps", event="exited", exit_code=0, pid=1)

    waiting = _run(client, queued)
    assert waiting["status"] == "queued" and f"node {a.name} is draining" in waiting["waiting_for"]

    undrained = client.post(f"{API}/nodes/{a.id}/undrain")

    assert undrained.json()["status"] == "online"
    assert _run(client, queued)["status"] == "launching"
    client.post(f"{API}/runs/{queued}/cancel")


@pytest.fixture
def server(app, make_client) -> Iterator[list[str]]:
    """`--server URL --token T` of the test app served over real HTTP."""
    with cli_server(app, "uvicorn-drain-test") as argv:
        yield argv


def test_the_cli_drains_and_undrains_a_node_by_name(server, online_node, client, capsys):
    a = online_node()

    drained = main(["nodes", "drain", a.name, *server])
    assert client.get(f"{API}/nodes/{a.id}").json()["status"] == "draining"
    undrained = main(["nodes", "undrain", str(a.id), *server])
    out = capsys.readouterr().out

    assert (drained, undrained) == (0, 0)
    assert f"node {a.name} (id {a.id}) is draining" in out and f"node {a.name} (id {a.id}) is online" in out
    assert client.get(f"{API}/nodes/{a.id}").json()["status"] == "online"


def test_the_cli_names_an_unknown_node(server, capsys):
    code = main(["nodes", "drain", "no-such-node", *server])
    assert code != 0 and "no node named 'no-such-node'" in capsys.readouterr().err


@pytest.fixture
def admin_page(make_client):
    """A cookie-holding client signed in through the login form, with its page's CSRF token."""
    from tests.app.web.conftest import PageClient

    page = PageClient(make_client(None))
    page.get("/login")
    assert page.post("/login", {"token": ADMIN_TOKEN, "next": "/"}).status_code == 303
    return page


def test_the_node_page_undrains_a_draining_node(online_node, client, dispatched, admin_page):
    a = online_node()
    client.post(f"{API}/nodes/{a.id}/drain")

    page = admin_page.get(f"/nodes/{a.id}")
    assert f'action="/nodes/{a.id}/undrain"' in page.text
    answer = admin_page.post(f"/nodes/{a.id}/undrain")

    assert answer.status_code == 303
    assert client.get(f"{API}/nodes/{a.id}").json()["status"] == "online"


def test_a_queued_runs_page_shows_its_place_and_why_it_waits(online_node, client, dispatched, admin_page):
    a = online_node()
    holder = _create(client, [a]).json()["id"]
    queued = _create(client, [a]).json()["id"]

    page = admin_page.get(f"/runs/{queued}").text

    assert 'id="run-queue"' in page and "in the queue" in page
    assert f"node {a.name} GPU 0 is held by run {holder}" in page
    for rid in (queued, holder):
        client.post(f"{API}/runs/{rid}/cancel")
