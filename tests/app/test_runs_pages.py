"""The run's recovery on the pages: the launch form's checkpoint and restart settings, the run
page's latest checkpoint and restart count, and its form that adds nodes."""

from __future__ import annotations

import re

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.web import run_form
from tests.app.web.conftest import admin_page, sign_in  # noqa: F401 (fixtures)

BLANK = {name: "" for name in run_form.TEXT_FIELDS}


def test_the_launch_form_checkpoints_and_restarts_by_default():
    body, errors = run_form.run_create(BLANK | run_form.DEFAULTS | {"name": "r", "node_ids": ["1"]})

    assert errors == {} and body is not None
    assert (body.checkpoint_every, body.checkpoint_every_s, body.max_restarts) == (100, 600.0, 3)
    assert (body.min_workers, body.min_workers_wait_s) == (1, 300.0)


def test_the_launch_form_carries_the_recovery_settings_typed():
    values = BLANK | run_form.DEFAULTS | {"name": "r", "node_ids": ["1", "2"], "checkpoint_every": "0",
                                          "checkpoint_every_s": "90", "max_restarts": "5",
                                          "min_workers": "2", "min_workers_wait_s": "45.5"}
    body, errors = run_form.run_create(values)

    assert errors == {} and body is not None
    assert (body.checkpoint_every, body.checkpoint_every_s, body.max_restarts) == (0, 90.0, 5)
    assert (body.min_workers, body.min_workers_wait_s) == (2, 45.5)


def test_a_bad_recovery_setting_is_shown_beside_its_field():
    body, errors = run_form.run_create(BLANK | run_form.DEFAULTS | {"name": "r", "node_ids": ["1"],
                                                                    "max_restarts": "-1", "checkpoint_every": "x"})
    assert body is None
    assert set(errors) >= {"max_restarts", "checkpoint_every"}


def test_the_run_page_shows_restarts_and_adds_nodes_to_a_running_ps_run(admin_page, online_node, client, dispatched):
    a, b = online_node(), online_node()
    rid = client.post(f"{API}/runs", json=run_body([a, b], strategy="ps", ps_node_id=a.id, max_restarts=2)).json()["id"]
    for node, rank in ((a, 0), (a, 1), (b, 2)):
        node.event(rid, rank=rank, role="ps" if rank == 0 else "worker", event="started", pid=rank + 1)
    c = online_node()

    page = admin_page.get(f"/runs/{rid}")
    assert page.status_code == 200
    assert re.search(r'id="restarts">0 of 2<', page.text)
    assert 'id="latest-checkpoint">none yet<' in page.text
    assert f'<option value="{c.id}">{c.name}</option>' in page.text
    assert f'<option value="{a.id}">' not in page.text

    added = admin_page.post(f"/runs/{rid}/nodes", {"node_ids": str(c.id)})

    assert added.status_code == 303
    assert [w["node_id"] for w in client.get(f"{API}/runs/{rid}").json()["workers"]][-1] == c.id


def test_the_run_page_of_an_all_reduce_run_offers_no_nodes(admin_page, online_node, client, dispatched):
    a = online_node()
    rid = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce")).json()["id"]
    a.event(rid, rank=0, role="worker", event="started", pid=1)

    assert 'id="add-nodes-form"' not in admin_page.get(f"/runs/{rid}").text


def test_a_cancel_from_the_run_page_reads_cancelling_with_no_second_cancel_offered(
        admin_page, online_node, client, dispatched):
    a = online_node()
    rid = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce")).json()["id"]
    a.event(rid, rank=0, role="worker", event="started", pid=1)
    assert re.search(r'id="cancel-form"\s+onsubmit', admin_page.get(f"/runs/{rid}").text)

    cancelled = admin_page.post(f"/runs/{rid}/cancel", {"reason": "from the page"})
    page = admin_page.get(f"/runs/{rid}").text

    assert cancelled.status_code == 303
    assert "is cancelling: its roles are being stopped" in page
    assert 'class="badge status-cancelling"' in page
    assert re.search(r'id="cancel-form" hidden', page)
    a.event(rid, rank=0, role="worker", event="exited", signal=15, cancelled=True, pid=1)
    assert client.get(f"{API}/runs/{rid}").json()["status"] == "cancelled"
