"""Bundles of users' code: upload (raw and multipart), validation of the archive, reads,
deletion, storage in a directory, and the download by a run's own token."""

from __future__ import annotations

import gzip
import hashlib
import io
import secrets
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from app.api.deps import get_settings
from app.config import Settings
from app.models import Run, RunStatus, TokenScope
from app.run_secrets import run_metrics_token
from app.security import hash_secret
from hybridtrain import bundle_limits

API = "/api/v1"
GZIP = {"Content-Type": "application/gzip"}


def make_archive(files: dict[str, bytes] | None = None) -> bytes:
    """A gzipped tar holding `files` (a tiny train.py by default)."""
    files = files if files is not None else {"train.py": b"print('hello')\n"}
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def archive_with_member(info: tarfile.TarInfo) -> bytes:
    """A gzipped tar with one ordinary file and `info` (a link, a bad path...)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        ok = tarfile.TarInfo("ok.py")
        ok.size = 1
        archive.addfile(ok, io.BytesIO(b"x"))
        archive.addfile(info, io.BytesIO(b"y" * info.size) if info.isfile() else None)
    return buffer.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def upload(client: TestClient, data: bytes, **headers: str) -> Any:
    return client.post(f"{API}/bundles", content=data, headers=GZIP | headers)


def field_of(response: Any) -> str:
    """The field a 422 names (the last element of its loc)."""
    return response.json()["detail"][0]["loc"][-1]


@pytest.fixture
def override_settings(app: FastAPI, settings: Settings) -> Iterator[Callable[..., Settings]]:
    """Run the app with some settings changed for one test."""

    def _override(**changes: Any) -> Settings:
        changed = settings.model_copy(update=changes)
        app.dependency_overrides[get_settings] = lambda: changed
        return changed

    try:
        yield _override
    finally:
        app.dependency_overrides.pop(get_settings, None)


@pytest.fixture
def make_run(session: Session, settings: Settings) -> Callable[..., tuple[int, str]]:
    """Store a run directly (no nodes, no launch) that uses a bundle; returns (id, rank 0's token)."""

    def _make(bundle_sha256: str | None, status: RunStatus = RunStatus.running) -> tuple[int, str]:
        known: dict[str, Any] = {
            "name": "bundle-run", "status": status, "strategy": "allreduce",
            "global_batch_size": 8, "allocation": "equal",
            "metrics_token_hash": hash_secret("htr_" + secrets.token_urlsafe(24)),
            "created_by": "test", "max_steps": 10,
        }
        if bundle_sha256 is not None:
            known["bundle_sha256"] = bundle_sha256
        run = Run(**known)
        # Fill whatever else the runs table requires, whichever version of it is migrated.
        for column in Run.__table__.columns:
            if column.nullable or column.primary_key or column.default is not None:
                continue
            if column.server_default is not None or getattr(run, column.key, None) is not None:
                continue
            python_type = column.type.python_type if not hasattr(column.type, "impl") else dict
            filler = {str: "x", int: 1, float: 0.1, dict: {}, bool: False}.get(python_type, "x")
            setattr(run, column.key, filler)
        session.add(run)
        session.commit()
        return run.id, run_metrics_token(settings.secret_key, run_id=run.id, attempt=run.restarts, rank=0)

    return _make


# --- upload -----------------------------------------------------------------------------------


def test_raw_upload_stores_the_bundle(client: TestClient) -> None:
    data = make_archive({"train.py": b"x = 1\n", "pkg/__init__.py": b""})
    response = upload(client, data, **{"X-Bundle-Sha256": sha(data), "X-Bundle-Filename": "work.tar.gz"})
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["sha256"] == sha(data)
    assert body["size_bytes"] == len(data)
    assert body["files"] == 2
    assert body["filename"] == "work.tar.gz"
    assert body["created_by"] == "HYBRIDTRAIN_ADMIN_TOKEN"


def test_multipart_upload_stores_the_bundle(client: TestClient) -> None:
    data = make_archive()
    response = client.post(
        f"{API}/bundles", files={"file": ("code.tar.gz", data, "application/gzip")},
        data={"sha256": sha(data)},
    )
    assert response.status_code == 201, response.text
    assert response.json()["sha256"] == sha(data)
    assert response.json()["filename"] == "code.tar.gz"


def test_uploading_the_same_archive_again_answers_200_with_the_stored_bundle(client: TestClient) -> None:
    data = make_archive()
    first = upload(client, data)
    again = upload(client, data)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()


def test_ci_token_may_upload(make_client: Callable[[str | None], TestClient], token_with_scope) -> None:
    response = upload(make_client(token_with_scope(TokenScope.ci)), make_archive())
    assert response.status_code == 201, response.text


def test_read_token_may_not_upload(make_client: Callable[[str | None], TestClient], token_with_scope) -> None:
    response = upload(make_client(token_with_scope(TokenScope.read)), make_archive())
    assert response.status_code == 403


def test_raw_upload_with_another_sha256_is_422_naming_sha256(client: TestClient) -> None:
    response = upload(client, make_archive(), **{"X-Bundle-Sha256": "0" * 64})
    assert response.status_code == 422
    assert field_of(response) == "sha256"


def test_multipart_upload_with_another_sha256_is_422_naming_sha256(client: TestClient) -> None:
    response = client.post(
        f"{API}/bundles", files={"file": ("a.tar.gz", make_archive())}, data={"sha256": "f" * 64}
    )
    assert response.status_code == 422
    assert field_of(response) == "sha256"


def test_multipart_without_a_file_field_is_422_naming_file(client: TestClient) -> None:
    response = client.post(f"{API}/bundles", files={"other": ("a.tar.gz", make_archive())})
    assert response.status_code == 422
    assert field_of(response) == "file"


def test_upload_over_the_limit_is_413_naming_file(client: TestClient, override_settings) -> None:
    override_settings(bundle_max_bytes=100)
    response = upload(client, make_archive({"big.bin": secrets.token_bytes(4000)}))
    assert response.status_code == 413
    assert response.json()["detail"].startswith("file:")


def test_streamed_upload_over_the_limit_is_413(client: TestClient, override_settings) -> None:
    override_settings(bundle_max_bytes=100)
    data = make_archive({"big.bin": secrets.token_bytes(4000)})
    # A generator body goes out chunked, without Content-Length: the limit holds while reading.
    chunks = (data[i : i + 64] for i in range(0, len(data), 64))
    response = client.post(f"{API}/bundles", content=chunks, headers=GZIP)
    assert response.status_code == 413


def test_multipart_upload_over_the_limit_is_413(client: TestClient, override_settings) -> None:
    override_settings(bundle_max_bytes=100)
    data = make_archive({"big.bin": secrets.token_bytes(4000)})
    response = client.post(f"{API}/bundles", files={"file": ("a.tar.gz", data)})
    assert response.status_code == 413


def test_upload_that_is_not_gzip_is_422_naming_file(client: TestClient) -> None:
    response = upload(client, b"this is not an archive")
    assert response.status_code == 422
    assert field_of(response) == "file"


def test_gzip_that_is_not_a_tar_is_422_naming_file(client: TestClient) -> None:
    response = upload(client, gzip.compress(b"plain text, no tar inside" * 40))
    assert response.status_code == 422
    assert field_of(response) == "file"


def test_archive_without_files_is_422_naming_file(client: TestClient) -> None:
    response = upload(client, make_archive({}))
    assert response.status_code == 422
    assert field_of(response) == "file"


def _member(name: str, kind: bytes = tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    info.size = 1 if kind == tarfile.REGTYPE else 0
    return info


@pytest.mark.parametrize(
    "member",
    [
        _member("../escape.py"),
        _member("pkg/../../escape.py"),
        _member("/etc/absolute.py"),
        _member("link.py", tarfile.SYMTYPE, "/etc/passwd"),
        _member("hard.py", tarfile.LNKTYPE, "ok.py"),
        _member("fifo", tarfile.FIFOTYPE),
        _member("dev", tarfile.CHRTYPE),
    ],
    ids=["parent", "nested-parent", "absolute", "symlink", "hardlink", "fifo", "device"],
)
def test_archive_with_an_unsafe_member_is_422_naming_file(client: TestClient, member: tarfile.TarInfo) -> None:
    response = upload(client, archive_with_member(member))
    assert response.status_code == 422, response.text
    assert field_of(response) == "file"
    assert "unsafe archive member" in response.json()["detail"][0]["msg"]


def test_upload_of_another_content_type_is_415(client: TestClient) -> None:
    response = client.post(f"{API}/bundles", content=make_archive(), headers={"Content-Type": "text/plain"})
    assert response.status_code == 415


# --- reads and deletion -----------------------------------------------------------------------


def test_listing_shows_the_uploaded_bundle(client: TestClient) -> None:
    data = make_archive({"list_me.py": b"1"})
    upload(client, data)
    listed = client.get(f"{API}/bundles", params={"limit": 1000}).json()
    assert sha(data) in [b["sha256"] for b in listed["data"]]
    assert listed["count"] >= 1


def test_get_shows_one_bundle(client: TestClient, make_client, token_with_scope) -> None:
    data = make_archive()
    upload(client, data)
    reader = make_client(token_with_scope(TokenScope.read))
    response = reader.get(f"{API}/bundles/{sha(data)}")
    assert response.status_code == 200
    assert response.json()["files"] == 1


def test_unknown_bundle_is_404(client: TestClient) -> None:
    assert client.get(f"{API}/bundles/{'a' * 64}").status_code == 404


def test_download_returns_the_archive_and_names_its_sha256(client: TestClient) -> None:
    data = make_archive({"a.py": b"a", "b.py": b"b"})
    upload(client, data)
    response = client.get(f"{API}/bundles/{sha(data)}/archive")
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["content-type"] == "application/gzip"
    assert response.headers["x-bundle-sha256"] == sha(data)


def test_delete_removes_the_bundle(client: TestClient) -> None:
    data = make_archive()
    upload(client, data)
    assert client.delete(f"{API}/bundles/{sha(data)}").status_code == 204
    assert client.get(f"{API}/bundles/{sha(data)}").status_code == 404


def test_delete_is_refused_while_an_active_run_uses_the_bundle(client: TestClient, make_run) -> None:
    data = make_archive()
    upload(client, data)
    run_id, _ = make_run(sha(data), RunStatus.running)
    response = client.delete(f"{API}/bundles/{sha(data)}")
    assert response.status_code == 409
    assert str(run_id) in response.json()["detail"]


def test_delete_is_allowed_once_the_runs_using_it_finished(client: TestClient, make_run) -> None:
    data = make_archive()
    upload(client, data)
    make_run(sha(data), RunStatus.succeeded)
    assert client.delete(f"{API}/bundles/{sha(data)}").status_code == 204


# --- storage in a directory -------------------------------------------------------------------


def test_bundle_dir_keeps_the_archive_as_a_file(client: TestClient, override_settings, tmp_path: Path) -> None:
    override_settings(bundle_dir=tmp_path)
    data = make_archive({"dir.py": b"in a directory"})
    assert upload(client, data).status_code == 201
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"{sha(data)}.tar.gz"]
    assert (tmp_path / f"{sha(data)}.tar.gz").read_bytes() == data


def test_bundle_dir_download_streams_the_file(client: TestClient, override_settings, tmp_path: Path) -> None:
    override_settings(bundle_dir=tmp_path)
    data = make_archive({"dir.py": b"streamed"})
    upload(client, data)
    response = client.get(f"{API}/bundles/{sha(data)}/archive")
    assert response.status_code == 200
    assert response.content == data


def test_bundle_dir_delete_removes_the_file(client: TestClient, override_settings, tmp_path: Path) -> None:
    override_settings(bundle_dir=tmp_path)
    data = make_archive({"dir.py": b"deleted"})
    upload(client, data)
    assert client.delete(f"{API}/bundles/{sha(data)}").status_code == 204
    assert list(tmp_path.iterdir()) == []


# --- a run's bundle, fetched with the run's token ---------------------------------------------


def test_run_token_downloads_the_bundle_of_an_active_run(client: TestClient, make_client, make_run) -> None:
    data = make_archive({"run.py": b"run"})
    upload(client, data)
    run_id, token = make_run(sha(data), RunStatus.launching)
    response = make_client(token).get(f"{API}/runs/{run_id}/bundle")
    assert response.status_code == 200
    assert response.content == data
    assert response.headers["x-bundle-sha256"] == sha(data)


def test_run_bundle_is_409_once_the_run_ended(client: TestClient, make_client, make_run) -> None:
    data = make_archive({"run.py": b"ended"})
    upload(client, data)
    run_id, token = make_run(sha(data), RunStatus.failed)
    response = make_client(token).get(f"{API}/runs/{run_id}/bundle")
    assert response.status_code == 409
    assert "the run has ended" in response.json()["detail"]


def test_run_bundle_with_another_token_is_401(client: TestClient, make_client, make_run) -> None:
    data = make_archive({"run.py": b"token"})
    upload(client, data)
    run_id, _ = make_run(sha(data))
    response = make_client("htr_not-the-token").get(f"{API}/runs/{run_id}/bundle")
    assert response.status_code == 401


def test_run_without_a_bundle_is_404(make_client, make_run) -> None:
    run_id, token = make_run(None)
    response = make_client(token).get(f"{API}/runs/{run_id}/bundle")
    assert response.status_code == 404
    assert "has no bundle" in response.json()["detail"]


def test_a_bundle_with_more_members_than_the_agents_unpack_gets_422(client: TestClient) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as archive:
        for i in range(bundle_limits.MAX_MEMBERS + 1):
            archive.addfile(tarfile.TarInfo(f"d/{i}.py"), io.BytesIO(b""))
    response = upload(client, buffer.getvalue())
    assert response.status_code == 422, response.text
    assert field_of(response) == "file"
    assert f"more than {bundle_limits.MAX_MEMBERS} members" in response.text


def test_a_bundle_that_expands_beyond_the_agents_ratio_gets_422_before_it_is_unpacked(client: TestClient) -> None:
    # 64 MiB of zeros gzips to ~64 KiB; the member's header alone says it is too much.
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        archive.addfile(tarfile.TarInfo("train.py"), io.BytesIO(b""))
        big = tarfile.TarInfo("zeros.bin")
        big.size = 64 << 20
        archive.addfile(big, io.BytesIO(bytes(big.size)))
    started = time.monotonic()
    response = upload(client, buffer.getvalue())
    assert response.status_code == 422, response.text
    assert field_of(response) == "file"
    assert f"more than {bundle_limits.MAX_EXPANSION_RATIO} times" in response.text
    assert time.monotonic() - started < 2
