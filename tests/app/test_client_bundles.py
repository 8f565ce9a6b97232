"""The client's bundle calls against the real control plane (FastAPI on Postgres): a packed
work dir uploads once, reads back as the same bundle, lists and deletes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from app.cli.client import ApiError, HybridtrainClient
from hybridtrain.packing import PackedBundle, pack_workdir
from app.cli.run_flags import upload
from tests.app.conftest import ADMIN_TOKEN


@pytest.fixture
def api(make_client: Callable[[str | None], TestClient]) -> Iterator[HybridtrainClient]:
    """The client of the CLI, sending its requests into the test app (one rolled-back
    transaction per test) through the test client's in-process transport."""
    with HybridtrainClient("http://testserver", ADMIN_TOKEN, transport=make_client(None)._transport) as client:
        yield client


@pytest.fixture
def packed(tmp_path: Path) -> PackedBundle:
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "model.py").write_text("X = 1\n")
    return pack_workdir(tmp_path)


def test_an_uploaded_work_dir_reads_back_as_the_same_bundle(api, packed):
    stored = api.upload_bundle(packed.data, packed.sha256, "work.tar.gz")
    assert (stored["sha256"], stored["files"], stored["size_bytes"], stored["filename"]) == (
        packed.sha256, packed.files, packed.size_bytes, "work.tar.gz")
    assert api.get_bundle(packed.sha256)["sha256"] == packed.sha256


def test_an_unchanged_work_dir_is_not_uploaded_twice(api, packed, tmp_path, capsys):
    upload(api, packed, str(tmp_path))
    upload(api, packed, str(tmp_path))
    err = capsys.readouterr().err.splitlines()
    assert err[0].endswith("(uploaded)") and err[1].endswith("(already on the server)")
    assert err[1].startswith(f"hybridtrain: packed 2 files, 0.0 MB, sha256 {packed.sha256[:12]}")


def test_a_sha256_that_does_not_match_the_bytes_is_refused(api, packed):
    with pytest.raises(ApiError) as exc:
        api.upload_bundle(packed.data, "0" * 64)
    assert exc.value.status_code == 422 and "sha256" in str(exc.value.detail)


def test_a_bundle_is_listed_then_deleted(api, packed):
    api.upload_bundle(packed.data, packed.sha256)
    assert packed.sha256 in [b["sha256"] for b in api.list_bundles()["data"]]
    api.delete_bundle(packed.sha256)
    with pytest.raises(ApiError) as exc:
        api.get_bundle(packed.sha256)
    assert exc.value.status_code == 404
