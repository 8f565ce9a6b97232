"""`hybridtrain runs create --plan-only --all-strategies` and `hybridtrain plans optimize`
against a served control plane (uvicorn in a thread, FastAPI on Postgres)."""

from __future__ import annotations

import uuid

import pytest
from predictions_testing import TASK, add_profile
from runs_testing import API, online_node_fixture  # noqa: F401 (fixture)
from test_client_cli import _cli, server  # noqa: F401 (fixture)

from app.models import Dataset


@pytest.fixture
def trio(client, online_node, make_site, session):
    """Two fast priced T4 nodes in one GCP zone and a very slow one in another, profiled."""
    gcp = make_site(region="us-west", zone="us-west-a")
    far = make_site(region="us-west", zone="us-west-b")
    nodes = [online_node(site_id=gcp["id"]), online_node(site_id=gcp["id"]), online_node(site_id=far["id"])]
    for n, speed in zip(nodes, (500.0, 500.0, 5.0)):
        assert client.patch(f"{API}/nodes/{n.id}", json={"instance_type": "n1-standard-8"}).status_code == 200
        add_profile(session, n.id, samples_per_s=speed)
    return nodes


def test_plan_only_with_all_strategies_prints_each_strategys_prediction_as_a_table(server, trio, capsys):
    nodes = ",".join(str(n.id) for n in trio)
    code, out, err = _cli(capsys, "runs", "create", "--name", "p", "--nodes", nodes, *server, "--task", TASK,
                          "--plan-only", "--all-strategies")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("| strategy | samples/s |")
    assert [line.split("|")[1].strip() for line in lines[2:7]] == [
        "allreduce", "allreduce-powersgd", "ps", "ps-gc", "ps-bz-gc"]


def test_plans_optimize_explains_the_plan_it_chose(server, trio, capsys):
    nodes = ",".join(str(n.id) for n in trio)
    code, out, err = _cli(capsys, "plans", "optimize", "--nodes", nodes, *server, "--task", TASK,
                          "--global-batch", "64", "--goal", "fastest")
    assert code == 0, err
    assert "leaving out" in out.splitlines()[0]
    [chosen] = [line for line in out.splitlines() if line.startswith("nodes: ")]
    assert "strategy " in chosen and str(trio[2].id) not in chosen.split(";")[0]
    assert "inputs:" in out and "samples/s noise unknown (one run), measured" in out


def test_plans_optimize_refuses_an_unknown_node_naming_it(server, trio, capsys):
    code, _, err = _cli(capsys, "plans", "optimize", "--nodes", "999999", *server, "--task", TASK)
    assert code != 0 and "node_ids" in err and "999999" in err


def test_plans_optimize_with_a_data_set_prints_its_reads_as_their_own_column(server, trio, session, capsys):
    name = f"ds-{uuid.uuid4().hex[:8]}"
    # 1 GiB in the other zone of the region: the fast nodes read it as inter-zone traffic.
    session.add(Dataset(name=name, url=f"s3://bucket/{name}", format="webdataset", size_bytes=2**30, shards=16,
                        samples=10_000, store_provider="gcp", store_continent="north_america",
                        store_region="us-west", store_zone="us-west-b", created_by="admin"))
    session.commit()
    nodes = ",".join(str(n.id) for n in trio)
    code, out, err = _cli(capsys, "plans", "optimize", "--nodes", nodes, *server, "--task", TASK,
                          "--global-batch", "64", "--max-steps", "100", "--dataset", name)
    assert code == 0, err
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("| strategy"))
    row = lines[lines.index(header) + 2]
    column = [c.strip() for c in header.split("|")].index("data $/h")
    assert float(row.split("|")[column]) > 0
    # Each chosen node fetches what the run's 6,400 samples read of it: 0.64 of the data set.
    [chosen] = [line for line in lines if line.startswith("nodes: ")]
    workers = len(chosen.split(";")[0].removeprefix("nodes: ").split(", "))
    assert f"data sets: {workers * 0.64:.3g} GB from their stores over the run" in out
