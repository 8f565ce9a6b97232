"""Predictions in real headless Chromium against the live server: the launch form's table of
every strategy's predicted throughput and cost with the egress callout and where each wins, its Suggest button
filling the form with the optimizer's choice, and a run page's predicted beside measured."""

from __future__ import annotations

import pytest

from app.models import Run
from app.models.base import utcnow
from hybridtrain.contract import STRATEGIES
from tests.app.predictions_testing import TASK, add_profile
from tests.app.web.conftest import LiveServer, screenshot, sign_in_browser
from tests.app.web.run_seed import seed_run, seed_sites_and_nodes

pytestmark = pytest.mark.browser

@pytest.fixture
def profiled_nodes(live_server: LiveServer) -> list[int]:
    """An on-prem node and two GCP T4 nodes, online, each with a profile of TASK (ids)."""
    with live_server.app.state.sessionmaker() as session:
        server, workers = seed_sites_and_nodes(session, workers=2)
        nodes = [server, *workers]
        for node in nodes:
            node.last_heartbeat = utcnow()
        session.commit()
        for node in nodes:
            add_profile(session, node.id)
        return [n.id for n in nodes]


def fill_form(page, node_ids: list[int], strategy: str) -> None:  # type: ignore[no-untyped-def]
    sign_in_browser(page, next_path="/runs/new")
    page.fill("#f-name", "predicted")
    page.fill("#f-task", TASK)
    page.select_option("#f-strategy", strategy)
    for node_id in node_ids:
        page.check(f'input[name=node_ids][value="{node_id}"]')


def test_the_preview_shows_every_strategys_prediction_and_the_egress_callout(
    page, live_server: LiveServer, profiled_nodes: list[int]
) -> None:
    fill_form(page, profiled_nodes, "ps")
    page.wait_for_selector("#prediction-table tbody tr")
    rows = page.locator("#prediction-table tbody tr")
    assert [rows.nth(i).get_attribute("data-strategy") for i in range(rows.count())] == list(STRATEGIES)
    chosen = page.locator('#prediction-table tr[data-strategy="ps"]')
    assert chosen.get_attribute("class") == "chosen"
    cells = chosen.locator("td")
    assert float(cells.nth(1).inner_text()) > 0  # samples/s
    assert cells.nth(6).inner_text().startswith("$")  # $ per 1M samples
    assert "Egress is over a third of the bill" in page.inner_text("#egress-callout")
    # Where each strategy wins: local SGD with and without sites as replicas too, ps marked.
    assert page.locator("#strategy-table tbody tr").count() == len(STRATEGIES) + 2
    assert page.locator("#strategy-table tr.chosen").get_attribute("data-strategy") == "ps"
    screenshot(page, "launch-predictions")


def test_suggest_fills_the_form_with_the_optimizers_plan_and_explains_it(
    page, live_server: LiveServer, profiled_nodes: list[int]
) -> None:
    fill_form(page, profiled_nodes, "ps")
    page.wait_for_selector("#prediction-table tbody tr")
    page.select_option("#f-suggest_goal", "fastest")
    page.click("#suggest-button")
    page.wait_for_function(
        "() => { const e = document.getElementById('suggest-explanation');"
        " return !e.hidden && e.textContent && e.textContent !== 'searching…'; }"
    )
    explanation = page.inner_text("#suggest-explanation")
    assert "samples/s" in explanation, explanation
    strategy = page.input_value("#f-strategy")
    assert strategy in STRATEGIES
    checked = [int(v) for v in page.eval_on_selector_all(
        "input[name=node_ids]:checked", "boxes => boxes.map(b => b.value)")]
    assert checked and set(checked) <= set(profiled_nodes)
    page.wait_for_selector(f'#prediction-table tr.chosen[data-strategy="{strategy}"]')
    screenshot(page, "launch-suggest")


def test_a_finished_runs_page_sets_its_prediction_beside_what_it_measured(page, live_server: LiveServer) -> None:
    with live_server.app.state.sessionmaker() as session:
        seeded = seed_run(session, steps=200, workers=2, name="predicted-run")
        run = session.get(Run, seeded.run_id)
        run.prediction = {"strategy": "ps-bz-gc", "samples_per_s": 1000.0, "egress_bytes_per_step": 50_000,
                          "costs": {"usd_per_million_samples": 0.5}, "assumptions": ["links: assumed"]}
        session.commit()
    sign_in_browser(page, next_path=f"/runs/{seeded.run_id}")
    row = page.locator('#predicted-table tr[data-metric="samples_per_s"] td')
    assert row.nth(1).inner_text() == "1000.0"
    measured = float(row.nth(2).inner_text())
    assert measured > 0
    assert row.nth(3).inner_text() == f"{(1000.0 - measured) / measured * 100:+.0f}%"
    page.locator("#predicted").scroll_into_view_if_needed()
    screenshot(page, "run-predicted")
