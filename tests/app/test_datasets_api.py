"""Data sets as a resource: registered by URL from moto's S3 server (a real process), read by
runs that name them, refused clearly when they cannot be read, and kept while a run reads them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import pytest
import torch
from pydantic import SecretStr
from runs_testing import (  # noqa: F401 (fixtures)
    API,
    dispatched_fixture,
    online_node_fixture,
    post_run,
    run_body,
    runs_redis_url_fixture,
)

from app.api.deps import get_settings
from tests.app.web.conftest import admin_page, sign_in  # noqa: F401 (fixtures)
from hybridtrain.datasets import write_dataset
from tests.object_store import ACCESS_KEY, SECRET_KEY


@pytest.fixture(scope="module")
def s3_url(s3_server, tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("cp-ds")
    write_dataset([torch.tensor([i]) for i in range(50)], folder, shard_bytes=10_000)
    return s3_server.put_folder(folder, "datasets-cp", "small")


@pytest.fixture
def with_store(app, settings, s3_server):
    """The control plane holds the store's endpoint and keys."""
    changed = settings.model_copy(update={
        "dataset_s3_endpoint_url": s3_server.endpoint,
        "dataset_s3_access_key_id": SecretStr(ACCESS_KEY),
        "dataset_s3_secret_access_key": SecretStr(SECRET_KEY),
    })
    app.dependency_overrides[get_settings] = lambda: changed
    yield changed
    app.dependency_overrides.pop(get_settings, None)


def _name() -> str:
    return f"ds-{uuid.uuid4().hex[:8]}"


def _register(client, url, **fields):
    return client.post(f"{API}/datasets", json={"name": _name(), "url": url} | fields)


def test_registering_reads_the_index_for_size_shards_and_samples(client, with_store, s3_url):
    answer = _register(client, s3_url, store_provider="aws", store_continent="north_america", store_region="us-east-1")
    assert answer.status_code == 201, answer.text
    body = answer.json()
    assert body["samples"] == 50 and body["shards"] >= 2 and body["size_bytes"] > 0
    assert body["format"] == "webdataset"
    assert client.get(f"{API}/datasets/{body['name']}").json()["id"] == body["id"]
    assert body["name"] in [d["name"] for d in client.get(f"{API}/datasets").json()["data"]]


def test_an_unreadable_url_is_refused_naming_the_url(client, with_store, s3_url):
    # s3_url makes the bucket: what is missing is the data set's index, not the bucket.
    answer = _register(client, "s3://datasets-cp/not-there")
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][-1] == "url"
    assert "NoSuchKey" in answer.json()["detail"][0]["msg"]


def test_a_store_without_credentials_is_refused_naming_the_url(client, s3_url):
    answer = _register(client, s3_url)
    assert answer.status_code == 422
    assert "no credential" in answer.json()["detail"][0]["msg"]


def test_a_url_of_an_unknown_scheme_is_refused(client):
    answer = _register(client, "ftp://host/data")
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][-1] == "url"


def test_a_duplicate_name_is_a_conflict(client, with_store, s3_url):
    name = _register(client, s3_url).json()["name"]
    assert client.post(f"{API}/datasets", json={"name": name, "url": s3_url}).status_code == 409


def test_a_run_naming_an_unknown_data_set_is_refused(client, with_store, online_node, dispatched):
    answer = client.post(f"{API}/runs", json=run_body([online_node()], datasets=["no-such-set"]))
    assert answer.status_code in (404, 422)
    assert "no-such-set" in answer.text


def test_a_run_hands_its_roles_the_data_set_and_the_store_credentials(
    client, with_store, s3_url, online_node, dispatched, s3_server,
):
    dataset = _register(client, s3_url).json()
    node = online_node()
    run = post_run(client, run_body([node], datasets=[dataset["name"]]))
    assert client.get(f"{API}/runs/{run['id']}").json()["datasets"] == [dataset["name"]]
    spec = next(args[2] for _, args in dispatched.take(node.id) if args[1] == 0)
    assert spec["datasets"] == [{
        "id": dataset["id"], "name": dataset["name"], "url": s3_url, "store_url": None, "token": None,
        "endpoint_url": s3_server.endpoint, "region": "us-east-1", "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET_KEY, "cache_url": None,
    }]


def test_deleting_a_data_set_a_run_reads_is_a_conflict(client, with_store, s3_url, online_node, dispatched):
    dataset = _register(client, s3_url).json()
    node = online_node()
    run = post_run(client, run_body([node], datasets=[dataset["name"]]))
    answer = client.delete(f"{API}/datasets/{dataset['name']}")
    assert answer.status_code == 409
    assert f"run {run['id']}" in answer.text
    client.post(f"{API}/runs/{run['id']}/cancel")
    # Cancelling, its roles may still read the data set: in use until the agent reports them gone.
    assert client.delete(f"{API}/datasets/{dataset['name']}").status_code == 409
    node.event(run["id"], rank=0, role="ps", event="exited", signal=None, exit_code=143, cancelled=True, pid=100,
               reason="rank 0 stopped")
    assert client.get(f"{API}/runs/{run['id']}").json()["status"] == "cancelled"
    assert client.delete(f"{API}/datasets/{dataset['name']}").status_code == 204
    assert client.get(f"{API}/datasets/{dataset['name']}").status_code == 404


def test_a_run_on_s3_data_needs_the_control_planes_credential(client, with_store, s3_url, online_node, app, settings):
    name = _register(client, s3_url).json()["name"]
    app.dependency_overrides[get_settings] = lambda: settings
    answer = client.post(f"{API}/runs", json=run_body([online_node()], datasets=[name]))
    assert answer.status_code == 422
    assert answer.json()["detail"][0]["loc"][-1] == "datasets"


def test_the_runs_bill_prices_the_bytes_its_nodes_read_from_the_store(
    client, session, with_store, s3_url, online_node, dispatched, make_site, admin_page,
):
    from decimal import Decimal

    from app.billing import BYTES_PER_GB, EgressKey, Provider, TrafficClass
    from app.models import Run, RunMetric
    from app.queries.costs import run_bill, run_priced_at
    from app.queries.price_lookups import DbPriceLookup

    dataset = _register(client, s3_url, store_provider="aws", store_continent="north_america",
                        store_region="us-east-1").json()
    node = online_node(site_id=make_site(kind="onprem", provider="onprem", continent="europe", region=None, zone=None)["id"])
    run_id = post_run(client, run_body([node], datasets=[dataset["name"]], strategy="allreduce"))["id"]
    for seq, n in enumerate((3 * BYTES_PER_GB, BYTES_PER_GB)):
        session.add(RunMetric(run_id=run_id, name="data_bytes", rank=0, peer=dataset["id"], step=seq + 1,
                              t=float(seq), value=float(n), stream="test", seq=seq))
    session.commit()
    run = session.get(Run, run_id)
    bill = run_bill(session, run=run)
    read = next(c for c in bill.egress_by_link if c.src == f"store of {dataset['name']}")
    # The store is AWS's, the node on-prem: 4 GB out to the internet at AWS's rate in force.
    rate = DbPriceLookup(session).egress_usd_per_gb(
        EgressKey(Provider.aws, TrafficClass.internet, "north_america"), run_priced_at(run))
    assert read.bytes == 4 * BYTES_PER_GB and read.traffic_class is TrafficClass.internet
    assert rate is not None and read.usd == (4 * rate).quantize(Decimal("0.000001"))
    answer = client.get(f"{API}/runs/{run_id}/cost").json()
    assert answer["data_read_bytes"] == 4 * BYTES_PER_GB
    assert answer["data_read_usd"] == pytest.approx(float(4 * rate))
    assert "4096.0 MiB)" in admin_page.get(f"/runs/{run_id}").text


def test_the_run_page_names_the_data_sets_it_reads(client, admin_page, with_store, s3_url, online_node, dispatched):
    name = _register(client, s3_url).json()["name"]
    run = post_run(client, run_body([online_node()], datasets=[name]))
    page = admin_page.get(f"/runs/{run['id']}")
    assert page.status_code == 200
    assert f'<a href="/api/v1/datasets/{name}"><code>{name}</code></a>' in page.text


@pytest.fixture
def with_dir(app, settings, tmp_path):
    """The control plane keeps uploaded data sets under a folder of the test's."""
    changed = settings.model_copy(update={"dataset_dir": tmp_path / "datasets"})
    app.dependency_overrides[get_settings] = lambda: changed
    yield changed
    app.dependency_overrides.pop(get_settings, None)


def _upload(client, name, folder, files):
    for file in files:
        answer = client.put(f"{API}/datasets/{name}/files/{file}", content=(folder / file).read_bytes(),
                            headers={"Content-Type": "application/octet-stream"})
        assert answer.status_code == 201, answer.text


def test_an_uploaded_data_set_is_served_to_the_ranks_of_a_run_that_reads_it(
    client, make_client, with_dir, tmp_path, online_node, dispatched,
):
    index = write_dataset([torch.tensor([i]) for i in range(20)], tmp_path / "up", shard_bytes=4000)
    name = _name()
    _upload(client, name, tmp_path / "up", [s.name for s in index.shards] + ["index.json"])
    answer = client.post(f"{API}/datasets", json={"name": name, "url": "store:"})
    assert answer.status_code == 201, answer.text
    assert answer.json()["samples"] == 20
    node = online_node()
    run = post_run(client, run_body([node], datasets=[name]))
    spec = next(args[2] for _, args in dispatched.take(node.id) if args[1] == 0)
    access = spec["datasets"][0]
    assert access["url"] == "store:" and access["token"] == spec["report_token"]
    assert access["store_url"].endswith(f"/api/v1/runs/{run['id']}/datasets/{name}/files")
    shard = index.shards[0].name
    got = make_client(access["token"]).get(f"{API}/runs/{run['id']}/datasets/{name}/files/{shard}")
    assert got.status_code == 200 and got.content == (tmp_path / "up" / shard).read_bytes()
    assert make_client("htm_wrong").get(f"{API}/runs/{run['id']}/datasets/{name}/files/{shard}").status_code == 401


def test_an_upload_whose_shards_are_missing_is_refused_at_registration(client, with_dir, tmp_path):
    write_dataset([torch.tensor([i]) for i in range(20)], tmp_path / "up", shard_bytes=4000)
    name = _name()
    _upload(client, name, tmp_path / "up", ["index.json"])
    answer = client.post(f"{API}/datasets", json={"name": name, "url": "store:"})
    assert answer.status_code == 422
    assert "was not uploaded whole" in answer.text


def test_uploads_need_a_folder_on_the_control_plane(client, tmp_path):
    answer = client.put(f"{API}/datasets/{_name()}/files/index.json", content=b"{}")
    assert answer.status_code == 422
    assert "HYBRIDTRAIN_DATASET_DIR" in answer.text


def test_the_plan_preview_prices_each_nodes_first_epoch_of_the_data_set(
    client, session, with_store, s3_url, online_node, make_site,
):
    from app.billing import BYTES_PER_GB, EgressKey, Provider, TrafficClass
    from app.queries.price_lookups import DbPriceLookup

    dataset = _register(client, s3_url, store_provider="aws", store_continent="north_america").json()
    node = online_node(site_id=make_site(kind="onprem", provider="onprem", continent="europe", region=None, zone=None)["id"])
    answer = client.post(f"{API}/runs/plan", json=run_body([node], datasets=[dataset["name"]], strategy="allreduce"))
    assert answer.status_code == 200, answer.text
    [read] = answer.json()["data_reads"]
    rate = DbPriceLookup(session).egress_usd_per_gb(
        EgressKey(Provider.aws, TrafficClass.internet, "north_america"), datetime.now(UTC))
    assert (read["dataset"], read["node_id"], read["bytes"]) == (dataset["name"], node.id, dataset["size_bytes"])
    assert read["traffic_class"] == "internet"
    assert read["usd"] == pytest.approx(float(rate) * dataset["size_bytes"] / BYTES_PER_GB, abs=1e-6)


def test_a_data_set_file_is_an_upload_held_to_its_own_limit(settings):
    from app.request_limits import body_limit, is_upload

    path = f"{API}/datasets/images/files/shard-000001.tar"
    assert is_upload("PUT", path)
    assert body_limit(settings, "PUT", path) == settings.dataset_file_max_bytes
    assert not is_upload("POST", f"{API}/datasets")
