"""Predictions in the API: POST /runs/plan's "prediction" (one strategy or all), the server the
model places, the prediction a run stores, and GET /runs/{id}/cost's predicted vs measured."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sqlalchemy import select

from app.models import Run, TaskProfile
from app.perfmodel.predict import predict
from app.queries.predictions import compression_spec, model_inputs
from app.queries.runs import load_plan_nodes
from hybridtrain import strategy_defaults
from hybridtrain.contract import STRATEGIES
from predictions_testing import RESULT, TASK, add_profile
from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

@pytest.fixture
def hybrid(online_node, make_site, session):
    """An on-prem node and two nodes in one GCP site, each with a profile of TASK."""
    lab = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="north_america")
    gcp = make_site()
    nodes = [online_node(site_id=lab["id"]), online_node(site_id=gcp["id"]), online_node(site_id=gcp["id"])]
    for n in nodes:
        add_profile(session, n.id)
    return nodes


def test_plan_gains_a_priced_prediction_when_every_node_is_profiled(client, hybrid):
    response = client.post(f"{API}/runs/plan", json=run_body(hybrid, task=TASK, strategy="ps-gc"))
    assert response.status_code == 200, response.text
    body = response.json()
    prediction = body["prediction"]
    assert body["prediction_unavailable"] is None
    assert prediction["strategy"] == "ps-gc"
    assert prediction["samples_per_s"] > 0
    assert set(prediction["breakdown"]) >= {"compute_s", "compress_s", "upload_s", "server_s", "download_s"}
    assert prediction["egress_bytes_per_step"] > 0
    assert prediction["costs"]["egress_usd_per_h"] > 0
    assert prediction["costs"]["usd_per_million_samples"] > 0
    assert {link["source"] for link in prediction["links"]} == {"assumed"}


def test_plan_without_a_profile_says_which_nodes_and_how_to_profile_them(client, online_node, session):
    profiled, bare = online_node(), online_node()
    add_profile(session, profiled.id)
    response = client.post(f"{API}/runs/plan", json=run_body([profiled, bare], task=TASK))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["prediction"] is None
    assert f"{bare.name} (id {bare.id})" in body["prediction_unavailable"]
    assert profiled.name not in body["prediction_unavailable"]
    assert f'POST /api/v1/tasks/profiles {{"node_ids": [{bare.id}]' in body["prediction_unavailable"]


def test_plan_of_all_strategies_gives_one_plan_and_prediction_each(client, hybrid):
    body = run_body(hybrid, task=TASK, strategies="all", ps_node_id=hybrid[0].id, rebalance_every=5)
    response = client.post(f"{API}/runs/plan", json=body)
    assert response.status_code == 200, response.text
    plans = response.json()["plans"]
    assert [p["strategy"] for p in plans] == list(STRATEGIES)
    assert all(p["prediction"]["samples_per_s"] > 0 for p in plans)
    assert [p["ps_node_id"] for p in plans if p["strategy"].startswith("allreduce")] == [None, None]


def test_plan_of_all_strategies_keeps_local_sgds_options_for_its_strategies_and_predicts_with_them(client, hybrid):
    def plans(sync_every: int) -> dict[str, dict]:
        body = run_body(hybrid, task=TASK, strategy="diloco", strategies="all", local_sgd={"sync_every": sync_every})
        response = client.post(f"{API}/runs/plan", json=body)
        assert response.status_code == 200, response.text
        return {p["strategy"]: p["prediction"] for p in response.json()["plans"]}

    rare, often = plans(40), plans(4)
    assert list(rare) == list(STRATEGIES)
    assert rare["diloco"]["egress_bytes_per_step"] < often["diloco"]["egress_bytes_per_step"]
    assert rare["ps-bz-gc"] == often["ps-bz-gc"]


def test_a_plan_that_leaves_options_unset_predicts_the_strategys_defaults_as_the_trainer_runs_them(client, hybrid):
    def prediction(**options) -> dict:
        body = run_body(hybrid, task=TASK, strategy="ps-bz-gc", ps_node_id=hybrid[0].id, **options)
        response = client.post(f"{API}/runs/plan", json=body)
        assert response.status_code == 200, response.text
        return response.json()["prediction"]

    given = strategy_defaults.effective("ps-bz-gc", {"compression": {}})
    unset = prediction()
    assert unset == prediction(**given)
    assert unset != prediction(compression=given["compression"] | {"pipeline_chunks": 1})
    chunks = strategy_defaults.default("ps-bz-gc", "compression.pipeline_chunks")
    assert any(note.startswith(f"{chunks} pipelined chunks") for note in unset["assumptions"])


def test_plan_compares_every_strategy_on_its_nodes_as_the_model_predicts_each_best_first(client, hybrid, session):
    body = run_body(hybrid, task=TASK, strategy="diloco", allocation="equal", ps_node_id=hybrid[0].id,
                    global_batch_size=60)
    response = client.post(f"{API}/runs/plan", json=body)
    assert response.status_code == 200, response.text
    plan = response.json()
    rows = plan["strategies"]
    assert sorted(r["name"] for r in rows) == sorted([*STRATEGIES, "diloco+replicas", "diloco-gc+replicas"])
    assert [r["samples_per_s"] for r in rows] == sorted((r["samples_per_s"] for r in rows), reverse=True)
    assert [r["name"] for r in rows if r["chosen"]] == ["diloco"]
    chosen = next(r for r in rows if r["chosen"])
    assert chosen["samples_per_s"] == pytest.approx(plan["prediction"]["samples_per_s"])
    nodes = load_plan_nodes(session, node_ids=[n.id for n in hybrid], cluster_id=None)
    inputs = model_inputs(session, nodes=nodes, task=TASK, task_args={}, bundle_sha256=None, compression=None,
                          eval_every=None, max_steps=body["max_steps"])
    batch = body["global_batch_size"] // len(hybrid)
    workers = [(inputs.specs[n.id], batch) for n in hybrid]
    sites = {n.id: n.site_id for n in hybrid}
    for row in rows:
        spec = compression_spec(row["strategy"], None, eval_every=None)
        server = inputs.specs[hybrid[0].id] if row["server_node_id"] is not None else None
        expected = predict(row["strategy"], workers=workers, server=server, links=inputs.links, task=inputs.task,
                           compression=replace(spec, site_replicas=row["site_replicas"]), max_steps=body["max_steps"])
        wan = sum(b for s, d, b in expected.bytes_per_step if sites[s] != sites[d])
        assert row["samples_per_s"] == pytest.approx(expected.samples_per_s), row["name"]
        assert row["ideal_share"] == pytest.approx(expected.samples_per_s / (3 * RESULT["samples_per_s"]))
        assert row["wan_bytes_per_sample"] == pytest.approx(wan / body["global_batch_size"]), row["name"]
        assert row["usd_per_million_samples"] > 0


def test_the_model_places_the_server_where_cloud_uploads_stay_inside_the_cloud(client, hybrid):
    # Link weights put it on-prem; the model sees both cloud workers' uploads billed as
    # internet egress there, and only the update's one copy to the lab from a cloud server.
    response = client.post(f"{API}/runs/plan", json=run_body(hybrid, task=TASK, strategy="ps"))
    assert response.status_code == 200, response.text
    assert response.json()["ps_node_id"] in {hybrid[1].id, hybrid[2].id}


def test_without_profiles_the_server_stays_where_the_link_weights_put_it(client, online_node, make_site):
    lab = make_site(kind="onprem", provider="onprem", region=None, zone=None, continent="north_america")
    gcp = make_site()
    nodes = [online_node(site_id=lab["id"]), online_node(site_id=gcp["id"]), online_node(site_id=gcp["id"])]
    response = client.post(f"{API}/runs/plan", json=run_body(nodes, task=TASK, strategy="ps"))
    assert response.status_code == 200, response.text
    assert response.json()["ps_node_id"] == nodes[0].id


def test_a_pinned_server_is_kept_even_where_the_model_prefers_another(client, hybrid):
    body = run_body(hybrid, task=TASK, strategy="ps", ps_node_id=hybrid[0].id)
    assert client.post(f"{API}/runs/plan", json=body).json()["ps_node_id"] == hybrid[0].id


def test_a_created_run_stores_its_prediction_and_its_cost_sets_it_beside_measured(
    client, hybrid, dispatched, session
):
    created = client.post(f"{API}/runs", json=run_body(hybrid, task=TASK, strategy="ps-gc"))
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    stored = session.scalar(select(Run.prediction).where(Run.id == run_id))
    assert stored["strategy"] == "ps-gc" and stored["samples_per_s"] > 0
    cost = client.get(f"{API}/runs/{run_id}/cost")
    assert cost.status_code == 200, cost.text
    metrics = {m["metric"]: m for m in cost.json()["predicted"]["metrics"]}
    assert set(metrics) == {"samples_per_s", "egress_bytes_per_step", "usd_per_million_samples"}
    assert metrics["samples_per_s"]["predicted"] == pytest.approx(stored["samples_per_s"])
    # Nothing measured yet: no error to state.
    assert metrics["samples_per_s"]["error_pct"] is None


def test_a_run_without_a_prediction_has_no_predicted_section_in_its_cost(client, online_node, dispatched):
    created = client.post(f"{API}/runs", json=run_body([online_node()], task=TASK))
    assert created.status_code == 201, created.text
    assert client.get(f"{API}/runs/{created.json()['id']}/cost").json()["predicted"] is None


def test_an_agents_profile_report_keeps_the_models_inputs(client, online_node, dispatched, session):
    node = online_node()
    ordered = client.post(f"{API}/tasks/profiles", json={"task": TASK, "node_ids": [node.id]})
    assert ordered.status_code == 202, ordered.text
    profile_id = ordered.json()[0]["id"]
    reported = node.agent.post(f"{API}/agent/profiles/{profile_id}",
                               json={"status": "done", "result": RESULT | {"new_field": "ignored"}})
    assert reported.status_code == 200, reported.text
    result = session.scalar(select(TaskProfile.result).where(TaskProfile.id == profile_id))
    assert result["worker_compress_s"] == 0.01 and result["dense_params"] == 10_000
    assert "new_field" not in result


def test_an_agents_profile_report_keeps_compressions_growth_with_what_is_kept(client, online_node, dispatched, session):
    node = online_node()
    profile_id = client.post(f"{API}/tasks/profiles", json={"task": TASK, "node_ids": [node.id]}).json()[0]["id"]
    slopes = {"worker_compress_s_per_kept": 2e-7, "server_compress_s_per_kept": 1e-7, "aggregate_s_per_kept": 3e-8,
              "aggregate_fixed_s": 0.001, "worker_compress_density": 0.01, "server_compress_k_fraction": 1 / 32}
    reported = node.agent.post(f"{API}/agent/profiles/{profile_id}", json={"status": "done", "result": RESULT | slopes})
    assert reported.status_code == 200, reported.text
    result = session.scalar(select(TaskProfile.result).where(TaskProfile.id == profile_id))
    assert {k: result[k] for k in slopes} == slopes


def test_an_agents_profile_report_with_a_density_above_one_is_refused(client, online_node, dispatched):
    node = online_node()
    profile_id = client.post(f"{API}/tasks/profiles", json={"task": TASK, "node_ids": [node.id]}).json()[0]["id"]
    reported = node.agent.post(f"{API}/agent/profiles/{profile_id}",
                               json={"status": "done", "result": RESULT | {"worker_compress_density": 1.5}})
    assert reported.status_code == 422
    assert reported.json()["detail"][0]["loc"][-1] == "worker_compress_density"


def test_an_agents_profile_report_with_a_negative_compression_time_is_refused(
    client, online_node, dispatched
):
    node = online_node()
    profile_id = client.post(f"{API}/tasks/profiles", json={"task": TASK, "node_ids": [node.id]}).json()[0]["id"]
    reported = node.agent.post(f"{API}/agent/profiles/{profile_id}",
                               json={"status": "done", "result": RESULT | {"aggregate_s": -1}})
    assert reported.status_code == 422
    assert reported.json()["detail"][0]["loc"][-1] == "aggregate_s"


def test_an_asynchronous_runs_prediction_hides_its_exchange_behind_up_to_max_staleness_steps():
    from app.queries.predictions import compression_spec
    from hybridtrain.train_options import LocalSgdOptions

    spec = compression_spec("diloco", None, eval_every=None, local_sgd=LocalSgdOptions(asynchronous=True))
    assert (spec.sync_every, spec.outer_delay) == (20, 19)
    bounded = LocalSgdOptions(sync_every=8, asynchronous=True, max_staleness=2)
    assert compression_spec("diloco-gc", None, eval_every=None, local_sgd=bounded).outer_delay == 2


def test_an_asynchronous_streaming_runs_prediction_streams_its_fragments_each_hidden_up_to_max_staleness():
    from app.queries.predictions import compression_spec
    from hybridtrain.train_options import LocalSgdOptions

    both = LocalSgdOptions(sync_every=8, asynchronous=True, fragments=4)
    spec = compression_spec("diloco", None, eval_every=None, local_sgd=both)
    assert (spec.sync_every, spec.outer_delay, spec.fragments) == (8, 7, 4)
