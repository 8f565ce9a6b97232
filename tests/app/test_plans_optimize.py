"""POST /api/v1/plans/optimize: the chosen nodes, strategy and server, its explanation, and
the refusals (unknown nodes, an empty set, a budget nobody meets, too many candidates)."""

from __future__ import annotations

import uuid

import pytest

from app.models import Dataset
from runs_testing import API, online_node_fixture  # noqa: F401 (fixtures)
from predictions_testing import TASK, add_profile


@pytest.fixture
def trio(client, online_node, make_site, session):
    """Two fast nodes in one GCP site and a very slow one in another, each a priced T4 instance
    (the seeded us-west n1-standard-8) with a profile of TASK."""
    gcp = make_site(region="us-west", zone="us-west-a")
    far = make_site(region="us-west", zone="us-west-b")
    nodes = [online_node(site_id=gcp["id"]), online_node(site_id=gcp["id"]), online_node(site_id=far["id"])]
    for n, speed in zip(nodes, (500.0, 500.0, 5.0)):
        patched = client.patch(f"{API}/nodes/{n.id}", json={"instance_type": "n1-standard-8"})
        assert patched.status_code == 200, patched.text
        add_profile(session, n.id, samples_per_s=speed)
    return nodes


def optimize(client, nodes, **fields):
    body = {"node_ids": [n.id for n in nodes], "task": TASK, "global_batch_size": 64} | fields
    return client.post(f"{API}/plans/optimize", json=body)


def test_fastest_plan_leaves_out_the_straggler_and_says_so(client, trio):
    response = optimize(client, trio, goal="fastest")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["left_out_node_ids"] == [trio[2].id]
    assert trio[2].id not in {w["node_id"] for w in body["plan"]["workers"]}
    assert f"leaving out {trio[2].name}" in body["explanation"]
    assert body["plan"]["prediction"]["samples_per_s"] > body["baseline"]["samples_per_s"]


def test_the_chosen_plan_comes_back_as_a_plan_the_form_can_launch(client, trio):
    body = optimize(client, trio, goal="cost", strategies=["ps-gc"]).json()
    plan = body["plan"]
    assert plan["strategy"] == "ps-gc"
    assert plan["ps_node_id"] is not None
    assert sum(w["batch_size"] for w in plan["workers"] if w["role"] == "worker") == 64
    assert plan["prediction"]["strategy"] == "ps-gc"


def test_an_unknown_node_is_404_naming_its_place_in_node_ids(client, trio):
    response = client.post(f"{API}/plans/optimize", json={"node_ids": [trio[0].id, 999_999], "task": TASK})
    assert response.status_code == 404
    assert "node_ids.1" in response.json()["detail"]


def test_an_empty_node_set_is_422_naming_node_ids(client):
    response = client.post(f"{API}/plans/optimize", json={"node_ids": [], "task": TASK})
    assert response.status_code == 422
    assert "node_ids" in response.json()["detail"][0]["loc"]


def test_a_budget_nobody_meets_is_422_with_the_cheapest_plan(client, trio):
    response = optimize(client, trio, budget_usd_per_h=0.0)
    assert response.status_code == 422, response.text
    body = response.json()
    assert body["detail"][0]["loc"] == ["body", "budget_usd_per_h"]
    assert body["cheapest"]["costs"]["total_usd_per_h"] > 0
    assert f"${body['cheapest']['costs']['total_usd_per_h']:.2f}/h" in body["detail"][0]["msg"]


def test_a_deadline_without_max_steps_is_422_naming_max_steps(client, trio):
    response = optimize(client, trio, deadline_s=60)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "max_steps"]


def test_a_node_without_a_profile_is_422_naming_node_ids_and_the_fix(client, trio, online_node):
    bare = online_node()
    response = optimize(client, [*trio, bare])
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "node_ids"]
    assert bare.name in detail["msg"] and "POST /api/v1/tasks/profiles" in detail["msg"]


def test_more_than_twelve_candidates_are_refused_naming_node_ids(client, online_node):
    nodes = [online_node() for _ in range(13)]
    response = optimize(client, nodes)
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "node_ids"]
    assert "at most 12" in response.json()["detail"][0]["msg"]


@pytest.fixture
def near_and_far(client, online_node, make_site, session):
    """A priced GCP node in us-west-a and a cheaper on-prem one in Europe, equally fast, and a
    1 TiB data set stored in us-west-a."""
    cloud = make_site(region="us-west", zone="us-west-a")
    lab = make_site(kind="onprem", provider="onprem", continent="europe", region=None, zone=None)
    near, far = online_node(site_id=cloud["id"]), online_node(site_id=lab["id"])
    assert client.patch(f"{API}/nodes/{near.id}", json={"instance_type": "n1-standard-8"}).status_code == 200
    assert client.patch(f"{API}/nodes/{far.id}", json={"amortised_usd_per_h": 0.1}).status_code == 200
    for n in (near, far):
        add_profile(session, n.id, samples_per_s=500.0)
    name = f"ds-{uuid.uuid4().hex[:8]}"
    session.add(Dataset(name=name, url=f"s3://bucket/{name}", format="webdataset", size_bytes=2**40, shards=16_384,
                        samples=10_000, store_provider="gcp", store_continent="north_america",
                        store_region="us-west", store_zone="us-west-a", created_by="admin"))
    session.commit()
    return near, far, name


def test_the_data_sets_reads_move_the_plan_to_the_nodes_beside_the_store(client, near_and_far):
    near, far, dataset = near_and_far
    kw = {"goal": "cost", "strategies": ["allreduce"], "max_steps": 100}
    assert optimize(client, [near, far], **kw).json()["plan"]["workers"][0]["node_id"] == far.id
    body = optimize(client, [near, far], datasets=[dataset], **kw).json()
    plan = body["plan"]
    assert [w["node_id"] for w in plan["workers"]] == [near.id]
    costs = plan["prediction"]["costs"]
    assert costs["data_usd"] == 0 and costs["data_bytes"] == round(0.64 * 2**40)  # 6,400 of 10,000 samples
    [read] = plan["data_reads"]
    assert (read["node_id"], read["via"], read["traffic_class"], read["usd"]) == (near.id, "node cache", "intra_zone", 0)
    # Every candidate together pays the on-prem node's internet egress for its 0.64 TiB.
    assert body["baseline"]["costs"]["data_usd"] > 50
    assert "Reading the data sets costs $0 over the run here" in body["explanation"]


def test_an_unknown_data_set_is_404_naming_datasets(client, near_and_far):
    near, far, _ = near_and_far
    response = optimize(client, [near, far], datasets=["no-such-data"])
    assert response.status_code == 404
    assert "datasets" in response.json()["detail"]


def test_nodes_behind_a_site_cache_fetch_the_data_set_once_for_their_site(client, online_node, make_site, session):
    lab = make_site(kind="onprem", provider="onprem", continent="europe", region=None, zone=None)
    nodes = [online_node(site_id=lab["id"], data_cache={"bytes": 2**30, "site_cache": True}) for _ in range(2)]
    for n in nodes:
        add_profile(session, n.id, samples_per_s=500.0)
    name = f"ds-{uuid.uuid4().hex[:8]}"
    session.add(Dataset(name=name, url=f"s3://bucket/{name}", format="webdataset", size_bytes=2**30, shards=16,
                        samples=640, store_provider="aws", store_continent="north_america", store_region="us-east-1",
                        created_by="admin"))
    session.commit()
    body = {"name": "p", "node_ids": [n.id for n in nodes], "task": TASK, "strategy": "allreduce",
            "global_batch_size": 64, "max_steps": 100, "datasets": [name]}
    plan = client.post(f"{API}/runs/plan", json=body).json()
    # 10 epochs; the site cache holds the data set, so its site fetches it once.
    [read] = plan["data_reads"]
    assert (read["node_ids"], read["via"], read["epochs"], read["bytes"]) == ([n.id for n in nodes], "site cache", 1, 2**30)
    assert read["traffic_class"] == "internet"
    assert plan["prediction"]["costs"]["data_bytes"] == 2**30
