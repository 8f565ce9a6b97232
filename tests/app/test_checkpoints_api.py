"""The checkpoint store over REST: the trainer's upload (digest, size limit, finished runs,
the newest two kept) and the download a restarted server makes, kept in the database or in a
directory that another control-plane host could read."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runs_testing import API, dispatched_fixture, online_node_fixture, run_body, runs_redis_url_fixture  # noqa: F401 (fixtures)

from app.api.deps import get_settings
from app.models import TokenScope
from app.run_secrets import run_metrics_token
from tests.app.serving import MiB, body_chunks, drive_asgi


@pytest.fixture(params=["db", "dir"])
def store_settings(request, app, settings, tmp_path) -> Iterator[object]:
    """The app with a small checkpoint size limit, keeping checkpoints in the database or a dir."""
    folder = tmp_path / "checkpoints" if request.param == "dir" else None
    patched = settings.model_copy(update={"checkpoint_max_bytes": 1000, "checkpoint_dir": folder})
    app.dependency_overrides[get_settings] = lambda: patched
    try:
        yield patched
    finally:
        app.dependency_overrides.pop(get_settings, None)


@pytest.fixture
def run_and_token(online_node, client, dispatched, store_settings):
    a = online_node()
    run = client.post(f"{API}/runs", json=run_body([a], strategy="allreduce")).json()
    return run["id"], run_metrics_token(store_settings.secret_key, run_id=run["id"], attempt=0, rank=0)


def _put(client, rid, token, step, data, digest=None):
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/octet-stream",
               "X-Content-Sha256": digest or hashlib.sha256(data).hexdigest()}
    return client.put(f"{API}/runs/{rid}/checkpoint", params={"step": step}, content=data, headers=headers)


def _get(client, rid, token):
    return client.get(f"{API}/runs/{rid}/checkpoint", headers={"Authorization": f"Bearer {token}"})


def test_an_uploaded_checkpoint_is_the_latest_one_downloaded(make_client, run_and_token):
    rid, token = run_and_token
    trainer = make_client(None)

    stored = _put(trainer, rid, token, 100, b"model at step 100")
    latest = _get(trainer, rid, token)

    assert stored.status_code == 201
    assert stored.json() == {"step": 100, "size": 17, "sha256": hashlib.sha256(b"model at step 100").hexdigest(),
                             "created_at": stored.json()["created_at"]}
    assert latest.status_code == 200 and latest.content == b"model at step 100"
    assert latest.headers["X-Checkpoint-Step"] == "100"
    assert latest.headers["X-Content-Sha256"] == hashlib.sha256(b"model at step 100").hexdigest()


def test_only_the_newest_two_are_kept(make_client, client, run_and_token, store_settings, session):
    rid, token = run_and_token
    trainer = make_client(None)
    for step in (100, 200, 300):
        assert _put(trainer, rid, token, step, f"step {step}".encode()).status_code == 201

    from app.models.checkpoints import RunCheckpoint
    from sqlalchemy import select

    session.expire_all()
    steps = session.scalars(select(RunCheckpoint.step).where(RunCheckpoint.run_id == rid)).all()
    assert sorted(steps) == [200, 300]
    assert _get(trainer, rid, token).content == b"step 300"
    if store_settings.checkpoint_dir is not None:
        files = sorted(p.name for p in Path(store_settings.checkpoint_dir).rglob("*.ckpt"))
        assert files == ["step-000000000200.ckpt", "step-000000000300.ckpt"]
    assert client.get(f"{API}/runs/{rid}").json()["latest_checkpoint"]["step"] == 300


def test_a_body_whose_digest_differs_is_refused(make_client, run_and_token):
    rid, token = run_and_token

    answer = _put(make_client(None), rid, token, 5, b"bytes", digest="0" * 64)

    assert answer.status_code == 400 and "X-Content-Sha256" in answer.json()["detail"]
    assert _get(make_client(None), rid, token).status_code == 404


def test_a_checkpoint_over_the_size_limit_is_refused(make_client, run_and_token):
    rid, token = run_and_token

    answer = _put(make_client(None), rid, token, 5, b"x" * 1001)

    assert answer.status_code == 413 and "HYBRIDTRAIN_CHECKPOINT_MAX_BYTES" in answer.json()["detail"]


def test_a_finished_run_takes_no_more_checkpoints(make_client, client, run_and_token):
    rid, token = run_and_token
    client.post(f"{API}/runs/{rid}/cancel")

    assert _put(make_client(None), rid, token, 5, b"late").status_code == 409


def test_uploads_need_the_runs_own_token(make_client, run_and_token, token_with_scope):
    rid, _ = run_and_token

    assert _put(make_client(None), rid, "htr_" + "x" * 43, 5, b"data").status_code == 401
    assert _put(make_client(None), rid, token_with_scope(TokenScope.admin), 5, b"data").status_code == 401


def test_a_user_with_read_scope_may_download_and_a_stranger_may_not(make_client, run_and_token, token_with_scope):
    rid, token = run_and_token
    _put(make_client(None), rid, token, 7, b"weights")

    assert _get(make_client(None), rid, token_with_scope(TokenScope.read)).content == b"weights"
    assert _get(make_client(None), rid, "htk_" + "n" * 40).status_code == 401


def test_a_run_without_checkpoints_answers_404(make_client, run_and_token):
    rid, token = run_and_token

    assert _get(make_client(None), rid, token).status_code == 404


def test_a_checkpoint_with_a_bad_token_is_refused_before_its_body_is_read(app, run_and_token):
    rid, _ = run_and_token
    headers = {"content-type": "application/octet-stream", "authorization": "Bearer not-this-runs-token",
               "x-content-sha256": "0" * 64}
    started = time.monotonic()
    status, body, pulled = drive_asgi(app, "PUT", f"{API}/runs/{rid}/checkpoint?step=1", headers, body_chunks(200 * MiB))
    assert status == 401, body
    assert pulled == 0
    assert time.monotonic() - started < 5
