"""The launch form's predictions and "Suggest", and the run page's predicted beside measured,
through the page routes (the browser tests drive the same routes from the form's script)."""

from __future__ import annotations

import pytest

from app.web import run_form
from hybridtrain.contract import STRATEGIES
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)
from predictions_testing import TASK, add_profile
from tests.app.web.conftest import PageClient


@pytest.fixture
def hybrid(client, online_node, make_site, session):
    """An on-prem node ($0.30/h amortised) and two priced T4 instances in one GCP site, each
    profiled."""
    lab = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="north_america")
    gcp = make_site(region="us-west", zone="us-west-a")
    nodes = [online_node(site_id=lab["id"]), online_node(site_id=gcp["id"]), online_node(site_id=gcp["id"])]
    assert client.patch(f"{API}/nodes/{nodes[0].id}", json={"amortised_usd_per_h": 0.3}).status_code == 200
    for n in nodes[1:]:
        assert client.patch(f"{API}/nodes/{n.id}", json={"instance_type": "n1-standard-8"}).status_code == 200
    for n in nodes:
        add_profile(session, n.id)
    return nodes


def form(nodes, **fields: str) -> dict:
    return ({name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS
            | {"name": "r", "task": TASK, "node_ids": [str(n.id) for n in nodes]} | fields)


def test_preview_gives_every_strategys_prediction_and_calls_out_heavy_egress(admin_page: PageClient, hybrid) -> None:
    admin_page.get("/runs/new")
    response = admin_page.post("/runs/plan", form(hybrid, strategy="ps"))
    assert response.status_code == 200, response.text
    body = response.json()
    assert [row["strategy"] for row in body["predictions"]] == list(STRATEGIES)
    ps = next(row for row in body["predictions"] if row["strategy"] == "ps")
    assert ps["egress_share"] > 1 / 3
    assert "ps (" in body["egress_callout"]


def test_preview_plan_compares_the_strategies_best_first_with_the_chosen_one_marked(admin_page: PageClient, hybrid) -> None:
    admin_page.get("/runs/new")
    body = admin_page.post("/runs/plan", form(hybrid, strategy="diloco-gc")).json()
    rows = body["plan"]["strategies"]
    assert [r["samples_per_s"] for r in rows] == sorted((r["samples_per_s"] for r in rows), reverse=True)
    assert [r["name"] for r in rows if r["chosen"]] == ["diloco-gc"]
    assert {"diloco+replicas", "diloco-gc+replicas"} <= {r["name"] for r in rows}


def test_preview_says_how_old_and_noisy_each_input_is_and_where_it_comes_from(admin_page: PageClient, hybrid) -> None:
    admin_page.get("/runs/new")
    body = admin_page.post("/runs/plan", form(hybrid)).json()
    profiles = [line for line in body["inputs"] if line.startswith("profile of ")]
    assert len(profiles) == len(hybrid)
    assert all("samples/s" in line and " ago by the profiler (profile " in line for line in profiles)
    assert any(line.startswith("link ") for line in body["inputs"])


def test_preview_without_profiles_says_why_there_is_no_prediction(admin_page: PageClient, online_node) -> None:
    admin_page.get("/runs/new")
    body = admin_page.post("/runs/plan", form([online_node()])).json()
    assert body["predictions"] == []
    assert "POST /api/v1/tasks/profiles" in body["predictions_unavailable"]


def test_suggest_answers_with_the_fields_to_fill_and_the_explanation(admin_page: PageClient, hybrid) -> None:
    admin_page.get("/runs/new")
    response = admin_page.post("/runs/suggest", form(hybrid, suggest_goal="fastest"))
    assert response.status_code == 200, response.text
    suggestion = response.json()["suggestion"]
    assert suggestion["strategy"] in STRATEGIES
    assert set(suggestion["node_ids"]) <= {n.id for n in hybrid}
    assert suggestion["explanation"]


def test_suggest_with_a_budget_nobody_meets_names_the_budget_and_the_cheapest(admin_page: PageClient, hybrid) -> None:
    admin_page.get("/runs/new")
    response = admin_page.post("/runs/suggest", form(hybrid, suggest_budget="0"))
    assert response.status_code == 422
    body = response.json()
    assert "cheapest is" in body["errors"]["suggest_budget"]
    assert body["cheapest"]["costs"]["total_usd_per_h"] > 0


def test_suggest_refuses_a_budget_that_is_not_a_number_beside_its_field(admin_page: PageClient, hybrid) -> None:
    admin_page.get("/runs/new")
    response = admin_page.post("/runs/suggest", form(hybrid, suggest_budget="cheap"))
    assert response.status_code == 422
    assert "suggest_budget" in response.json()["errors"]


def test_run_page_sets_the_prediction_beside_what_was_measured(
    admin_page: PageClient, client, hybrid, dispatched
) -> None:
    created = client.post(f"{API}/runs", json=run_body(hybrid, task=TASK, strategy="ps-gc"))
    assert created.status_code == 201, created.text
    page = admin_page.get(f"/runs/{created.json()['id']}")
    assert page.status_code == 200
    assert 'id="predicted-table"' in page.text
    for metric in ("samples_per_s", "egress_bytes_per_step", "usd_per_million_samples"):
        assert f'data-metric="{metric}"' in page.text
