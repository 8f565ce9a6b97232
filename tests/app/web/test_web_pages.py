"""Pages without a browser: nodes, prices, runs and the static files (the rolled-back session)."""

from __future__ import annotations

import gzip
import hashlib
import io
import re
import tarfile
import uuid
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.models import Bundle, Dataset, Run, TokenScope
from app.queries.metrics import store_metrics
from app.schemas.runs import MetricRecord
from app.queries.nodes import node_by_join_token
from app.web import run_form
from app.web.assets import plotly_js_path
from hybridtrain.strategy_defaults import default
from tests.app.web.conftest import ROOT, PageClient, field_errors
from tests.app.web.run_seed import seed_run


def test_add_site_keeps_what_was_typed_and_names_the_bad_field(admin_page: PageClient) -> None:
    response = admin_page.post("/nodes/sites", {"name": "room-1", "kind": "onprem", "provider": "gcp", "continent": "europe"})
    assert response.status_code == 422
    assert "onprem site" in field_errors(response.text)["provider"]
    assert 'value="room-1"' in response.text


def test_add_node_shows_the_agent_command_with_a_working_join_token(
    admin_page: PageClient, make_site: Callable[..., dict], session: Session
) -> None:
    site = make_site()
    response = admin_page.post("/nodes", {"site_id": str(site["id"]), "name": "box-1", "gpu_model_0": "T4", "gpu_count_0": "2", "labels": "rack=b2"})
    assert response.status_code == 201
    token = response.text.split("data-join-token>")[1].split("<")[0]
    assert f"~/.hybridtrain/bin/hybridtrain agent --server http://127.0.0.1:8000 --token {token}" in response.text
    assert ("python3 -m venv ~/.hybridtrain &amp;&amp; ~/.hybridtrain/bin/pip install "
            "&#39;hybridtrain[agent] @ http://127.0.0.1:8000/dist/hybridtrain-") in response.text
    node = node_by_join_token(session, join_token=token)
    assert node is not None and node.labels == {"rack": "b2"} and node.gpus[0].count == 2


def test_node_form_errors_land_beside_their_fields(admin_page: PageClient, make_site: Callable[..., dict]) -> None:
    site = make_site()
    response = admin_page.post("/nodes", {"site_id": str(site["id"]), "name": "", "gpu_model_0": "No-Such-GPU", "gpu_count_0": "x", "labels": "oops"})
    errors = field_errors(response.text)
    assert response.status_code == 422
    assert set(errors) == {"gpu_count_0", "labels"}  # text that is not a number is caught first
    response = admin_page.post("/nodes", {"site_id": str(site["id"]), "name": "", "gpu_model_0": "No-Such-GPU", "gpu_count_0": "1"})
    assert set(field_errors(response.text)) == {"name"}
    response = admin_page.post("/nodes", {"site_id": str(site["id"]), "name": "n", "gpu_model_0": "No-Such-GPU", "gpu_count_0": "1"})
    assert "not found" in field_errors(response.text)["gpu_model_0"]


def test_edit_and_drain_a_node(admin_page: PageClient, make_node: Callable[..., dict], client: TestClient) -> None:
    node = make_node()
    response = admin_page.post(f"/nodes/{node['id']}", {"site_id": str(node["site_id"]), "name": "renamed", "gpu_model_0": "T4", "gpu_count_0": "4", "amortised_usd_per_h": "0"})
    assert response.status_code == 303, response.text
    assert admin_page.post(f"/nodes/{node['id']}/drain").status_code == 303
    stored = client.get(f"/api/v1/nodes/{node['id']}").json()
    assert (stored["name"], stored["gpus"][0]["count"], stored["status"]) == ("renamed", 4, "draining")


def test_read_scope_sees_pages_but_may_not_change_anything(
    sign_in: Callable[[str], PageClient], token_with_scope: Callable[[TokenScope], str]
) -> None:
    page = sign_in(token_with_scope(TokenScope.read))
    nodes = page.get("/nodes")
    assert nodes.status_code == 200 and 'id="add-node"' not in nodes.text
    assert page.post("/nodes/sites", {"name": "x"}).status_code == 403
    assert page.get("/runs/new").status_code == 403


def test_revising_a_price_publishes_a_new_version_and_a_bad_one_is_refused(admin_page: PageClient, client: TestClient) -> None:
    price = client.get("/api/v1/prices/egress").json()["data"][0]
    bad = admin_page.post(f"/prices/egress/{price['id']}", {"usd_per_gb": "abc"})
    assert field_errors(bad.text) == {"usd_per_gb": "must be a number, not 'abc'"}
    past = admin_page.post(f"/prices/egress/{price['id']}", {"usd_per_gb": "0.5", "effective_from": "2020-01-01T00:00"})
    assert "in the past" in field_errors(past.text)["effective_from"]
    assert admin_page.post(f"/prices/egress/{price['id']}", {"usd_per_gb": "0.5"}).status_code == 303
    versions = client.get("/api/v1/prices/egress", params={"all_versions": True, "provider": price["provider"], "traffic_class": price["traffic_class"]}).json()["data"]
    assert [v["usd_per_gb"] for v in versions][-1] == 0.5 and len(versions) >= 2


def test_invalid_launch_keeps_input_and_shows_errors(admin_page: PageClient) -> None:
    response = admin_page.post("/runs", {"name": "r", "place": "nodes", "length": "steps", "max_steps": "-5", "global_batch_size": "64", "compression_density": "2"})
    errors = field_errors(response.text)
    assert response.status_code == 422
    assert set(errors) >= {"node_ids", "max_steps", "compression_density"}
    assert 'value="-5"' in response.text


def test_launch_form_carries_evaluation_and_rebalancing_periods() -> None:
    # As `echoed` gives them: every text field, blank unless typed.
    values = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {
        "name": "r", "node_ids": ["1", "2"], "eval_every": "25", "rebalance_every": "10"}
    body, errors = run_form.run_create(values)
    assert errors == {} and body is not None
    assert (body.eval_every, body.rebalance_every) == (25, 10)


def test_launch_form_can_record_the_target_and_train_on() -> None:
    base = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {
        "name": "r", "node_ids": ["1"], "target": "accuracy>=0.9"}
    stops, _ = run_form.run_create(base)
    trains_on, errors = run_form.run_create(base | {"at_target": "continue"})
    assert errors == {} and stops is not None and trains_on is not None
    assert stops.stop_at_target is True and trains_on.stop_at_target is False
    assert stops.target == "accuracy>=0.9"


def test_launch_form_turns_momentum_correction_off_or_leaves_the_default() -> None:
    base = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {"name": "r", "node_ids": ["1"]}
    default, _ = run_form.run_create(base)
    off, errors = run_form.run_create(base | {"compression_momentum_correction": "off"})
    assert errors == {} and default is not None and off is not None
    assert (default.compression is None or default.compression.momentum_correction is None)
    assert off.compression is not None and off.compression.momentum_correction is False


def test_launch_form_sends_local_sgds_fields_as_their_own_section() -> None:
    base = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {
        "name": "r", "node_ids": ["1"], "strategy": "diloco"}
    body, errors = run_form.run_create(base | {"local_sgd_sync_every": "12", "local_sgd_outer_lr": "0.7"})
    assert errors == {} and body is not None and body.local_sgd is not None
    assert (body.local_sgd.sync_every, body.local_sgd.outer_lr) == (12, 0.7)
    replicas, errors = run_form.run_create(base | {"local_sgd_site_replicas": "on"})
    assert errors == {} and replicas is not None and replicas.local_sgd is not None
    assert replicas.local_sgd.site_replicas is True and body.local_sgd.site_replicas is None


def test_launch_form_sends_asynchronous_outer_steps_and_shows_their_rule_beside_the_field() -> None:
    base = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {
        "name": "r", "node_ids": ["1"], "strategy": "diloco"}
    body, errors = run_form.run_create(base | {"local_sgd_asynchronous": "on", "local_sgd_max_staleness": "5"})
    assert errors == {} and body is not None and body.local_sgd is not None
    assert (body.local_sgd.asynchronous, body.local_sgd.max_staleness) == (True, 5)
    _, errors = run_form.run_create(base | {"local_sgd_asynchronous": "on", "local_sgd_outer_delay": "2"})
    assert "local_sgd.outer_delay" in errors["local_sgd_outer_delay"]


def test_launch_form_takes_streaming_fragments_and_shows_their_rule_beside_the_field() -> None:
    base = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {
        "name": "r", "node_ids": ["1"], "strategy": "diloco"}
    body, errors = run_form.run_create(base | {"local_sgd_sync_every": "12", "local_sgd_fragments": "4"})
    assert errors == {} and body is not None and body.local_sgd is not None and body.local_sgd.fragments == 4
    _, errors = run_form.run_create(base | {"local_sgd_sync_every": "3", "local_sgd_fragments": "4"})
    assert "local_sgd_fragments" in errors


def test_launch_form_shows_a_local_sgd_rule_beside_its_field() -> None:
    base = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {"name": "r", "node_ids": ["1"]}
    _, errors = run_form.run_create(base | {"local_sgd_sync_every": "12"})  # ps-bz-gc has no outer steps
    assert "local_sgd.sync_every" in errors["local_sgd_sync_every"]


def test_an_unknown_choice_at_the_target_is_refused_beside_the_field() -> None:
    values = {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {
        "name": "r", "node_ids": ["1"], "at_target": "maybe"}
    _, errors = run_form.run_create(values)
    assert "at_target" in errors


def test_rebalancing_an_all_reduce_run_is_refused_beside_the_field(admin_page: PageClient) -> None:
    response = admin_page.post("/runs", {"name": "r", "place": "nodes", "strategy": "allreduce", "length": "steps",
                                         "max_steps": "10", "global_batch_size": "64", "rebalance_every": "10"})
    assert response.status_code == 422
    assert "rebalance_every" in field_errors(response.text)
    assert 'value="10"' in response.text


def test_run_and_compare_pages_of_a_seeded_run(admin_page: PageClient, session: Session) -> None:
    run = seed_run(session, steps=300, workers=2, finished=True)
    session.commit()
    page = admin_page.get(f"/runs/{run.run_id}")
    assert page.status_code == 200
    for word in ("Throughput", "Loss", "Compression", "Egress"):
        assert word in page.text
    assert admin_page.get(f"/compare?runs={run.run_id},x").status_code == 200


def test_plotly_comes_from_the_installed_package_gzipped(admin_page: PageClient) -> None:
    response = admin_page.http.get("/static/vendor/plotly.min.js?v=1", headers={"Accept-Encoding": "gzip"})
    assert response.status_code == 200 and response.headers["content-encoding"] == "gzip"
    assert response.content == plotly_js_path().read_bytes()  # httpx undoes the gzip
    assert len(gzip.compress(response.content)) < len(response.content)


def test_templates_and_static_files_reach_nothing_outside() -> None:
    for path in [*Path(ROOT, "templates").rglob("*.html"), *Path(ROOT, "static").rglob("*.*")]:
        text = path.read_text()
        assert "http://" not in text and "https://" not in text and "//cdn" not in text, path


def _launch_values(**fields: str) -> dict:
    return {name: "" for name in run_form.TEXT_FIELDS} | run_form.DEFAULTS | {"name": "r", "node_ids": ["1"]} | fields


def test_launch_form_sends_the_task_and_its_json_arguments() -> None:
    body, errors = run_form.run_create(_launch_values(task="examples.diabetes:task", task_args='{"hidden": 32}'))
    assert errors == {} and body is not None
    assert (body.task, body.task_args) == ("examples.diabetes:task", {"hidden": 32})


def test_launch_form_refuses_task_arguments_that_are_not_a_json_object_beside_the_field() -> None:
    _, errors = run_form.run_create(_launch_values(task_args="[1, 2]"))
    assert "JSON object" in errors["task_args"]


def test_launch_form_splits_a_scripts_arguments_like_a_shell() -> None:
    body, errors = run_form.run_create(_launch_values(
        kind="script", bundle_sha256="ab" * 32, script="train.py", script_args="--name 'a b' --epochs 3"))
    assert errors == {} and body is not None
    assert body.script == "train.py" and body.script_args == ["--name", "a b", "--epochs", "3"]


def test_launch_form_needs_a_bundle_for_a_script_beside_the_script_field() -> None:
    _, errors = run_form.run_create(_launch_values(kind="script", script="train.py"))
    assert "bundle" in errors["script"]


def _tar_gz(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def _post_launch_with_file(admin_page: PageClient, content: bytes):  # type: ignore[no-untyped-def]
    admin_page.get("/runs/new")
    data = {"csrf_token": admin_page.csrf, "name": "r", "place": "nodes", "kind": "task", "length": "steps",
            "max_steps": "10", "global_batch_size": "64"}
    return admin_page.http.post("/runs", data=data, files={"bundle_file": ("code.tar.gz", content, "application/gzip")})


def test_an_archive_uploaded_with_the_launch_form_is_kept_and_offered_again(admin_page: PageClient, session: Session) -> None:
    content = _tar_gz({"mycode/task.py": b"def task(): pass\n"})
    sha = hashlib.sha256(content).hexdigest()

    response = _post_launch_with_file(admin_page, content)

    assert response.status_code == 422 and "node_ids" in field_errors(response.text)  # no node chosen
    assert session.get(Bundle, sha) is not None
    assert f'value="{sha}" selected' in response.text


def test_an_unsafe_archive_uploaded_with_the_launch_form_is_refused_beside_the_file_input(admin_page: PageClient) -> None:
    response = _post_launch_with_file(admin_page, _tar_gz({"../escape.py": b"x = 1\n"}))
    assert response.status_code == 422 and "unsafe" in field_errors(response.text)["bundle_file"]


def test_run_page_shows_the_task_its_bundle_target_and_evaluation_chart(admin_page: PageClient, session: Session) -> None:
    run = seed_run(session, steps=300, workers=2, finished=True)
    session.get(Run, run.run_id).bundle_sha256 = "ab" * 32
    session.commit()

    page = admin_page.get(f"/runs/{run.run_id}").text

    assert "hybridtrain.tasks.digits:smallcnn" in page and "accuracy&gt;=0.9" in page
    assert f'href="/api/v1/bundles/{"ab" * 32}/archive"' in page
    assert 'id="chart-evaluation"' in page and "eval:accuracy:1" in page


def test_run_page_and_api_show_the_first_epoch_warming_the_caches_from_stored_metrics(
    admin_page: PageClient, client: TestClient, session: Session,
) -> None:
    seeded = seed_run(session, steps=100, workers=2, finished=False, metrics_steps=16)  # steps 0-15
    dataset = Dataset(name=f"ds-{uuid.uuid4().hex[:8]}", url="s3://bucket/images", format="webdataset",
                      size_bytes=400 * 10**6, shards=40, samples=6400, store_provider="aws",
                      store_continent="north_america", store_region="us-east-1", created_by="admin")
    session.add(dataset)
    session.flush()
    run = session.get(Run, seeded.run_id)
    run.datasets = [dataset.name]
    # Rank 1 fetched 12 shards from the store through the site cache, rank 2 got 10 from it.
    store_metrics(session, run_id=run.id, records=[
        MetricRecord(rank=1, step=s, t=seeded.t0 + s, name="data_bytes", value=30 * 10**6, peer=dataset.id)
        for s in range(4)] + [
        MetricRecord(rank=2, step=s, t=seeded.t0 + s, name="data_cache_bytes", value=25 * 10**6, peer=dataset.id)
        for s in range(4)])
    session.commit()

    # 15 steps of 128 samples: 1,920 of the epoch's 6,400 (30 %), 12 of its 40 shards.
    page = admin_page.get(f"/runs/{run.id}").text
    panel = page[page.index('id="data-warmup"'):page.index('id="recovery"')]
    assert "warming caches: 12 / 40 shards (30%), 114.4 MiB from the store" in panel
    assert "114.4 MiB from the store, 95.4 MiB from the site cache" in panel

    [warmup] = client.get(f"/api/v1/runs/{run.id}").json()["data_warmup"]
    assert (warmup["dataset"], warmup["state"], warmup["shards_read"], warmup["store_bytes"]) == (
        dataset.name, "warming", 12, 120 * 10**6)
    [by_site] = warmup["sites"]
    assert by_site["site_cache_bytes"] == 100 * 10**6 and len(by_site["node_ids"]) == 2


def test_an_asynchronous_runs_page_draws_the_servers_late_change_counts(admin_page: PageClient, session: Session) -> None:
    seeded = seed_run(session, steps=40, workers=2, finished=True)
    run = session.get(Run, seeded.run_id)
    run.strategy, run.compression, run.local_sgd = "diloco", {}, {"sync_every": 10, "asynchronous": True}
    store_metrics(session, run_id=run.id, records=[
        MetricRecord(rank=0, role="ps", step=s, t=seeded.t0 + s, name=name, value=1)
        for s in (10, 20, 30) for name in ("outer_deferred", "outer_folded", "outer_dropped")])
    session.commit()

    page = admin_page.get(f"/runs/{run.id}").text

    assert all(f'"{name}:0"' in page for name in ("outer_deferred", "outer_folded", "outer_dropped"))


def test_run_page_shows_the_options_it_runs_with_marking_its_strategys_defaults(admin_page: PageClient,
                                                                                 session: Session) -> None:
    run = seed_run(session, steps=10, workers=2, finished=True)  # ps-bz-gc, compression {"density": 0.01}

    page = admin_page.get(f"/runs/{run.run_id}").text

    compression = page.split('id="run-compression">')[1].split("</strong>")[0]
    assert compression.startswith("density=0.01,")  # given: no mark
    chunks = default("ps-bz-gc", "compression.pipeline_chunks")
    assert f'pipeline_chunks={chunks}<span class="muted"> (default)</span>' in compression
    rebalance = page.split('id="run-rebalance">')[1].split("</strong>")[0]
    assert rebalance.startswith(f"{default('ps-bz-gc', 'rebalance_every')} steps") and "(default)" in rebalance


def test_launch_form_shows_the_chosen_strategys_defaults_as_placeholders(admin_page: PageClient) -> None:
    page = admin_page.get("/runs/new").text

    def placeholder(name: str) -> str:
        found = re.search(rf'name="{name}"[^>]*placeholder="([^"]*)"', page)
        assert found, name
        return found.group(1)

    assert placeholder("compression_pipeline_chunks") == str(default("ps-bz-gc", "compression.pipeline_chunks"))
    assert placeholder("rebalance_every") == str(default("ps-bz-gc", "rebalance_every"))
    assert placeholder("local_sgd_sync_every") == ""  # not an option of ps-bz-gc's
    # The page switches them with the strategy (static/js/run_new.js) from every strategy's own.
    assert run_form.strategy_placeholders()["diloco"]["local_sgd_outer_delay"] == str(default("diloco", "local_sgd.outer_delay"))
    assert "data-defaults=" in page

