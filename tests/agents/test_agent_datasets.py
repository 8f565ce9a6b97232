"""A launch order's data sets reach the role in an owner-only file named by --datasets-file,
read through the node's cache and its site's cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from agent_testing import role_spec
from pydantic import ValidationError

from agents.role_files import DataCache, lay_out
from agents.spec import RoleSpec
from hybridtrain.datasets import load_datasets_file

ACCESS = {"id": 3, "name": "images", "url": "s3://bucket/images", "endpoint_url": "http://10.0.0.9:9000",
          "region": "us-east-1", "access_key_id": "AKIA-test", "secret_access_key": "s3cr3t"}


def _files(tmp_path: Path, cache: DataCache | None, **fields):
    spec = RoleSpec.model_validate({**role_spec(9, 1), "datasets": [ACCESS], **fields})
    return lay_out(spec, ["python", "-m", "trainer"], tmp_path / "rank1", None, cache)


def test_the_data_sets_and_their_credentials_go_in_an_owner_only_file(tmp_path):
    files = _files(tmp_path, DataCache(tmp_path / "cache", 10**9))
    path = Path(files.argv[files.argv.index("--datasets-file") + 1])
    assert path.stat().st_mode & 0o777 == 0o600
    assert "s3cr3t" not in " ".join(files.argv)
    handed = load_datasets_file(path)
    assert handed.datasets[0].secret_access_key == "s3cr3t"
    assert handed.cache_dir == str((tmp_path / "cache").resolve()) and handed.cache_bytes == 10**9


def test_the_sites_cache_is_named_for_every_data_set(tmp_path):
    files = _files(tmp_path, DataCache(tmp_path / "cache", 10**9, "http://10.0.0.5:8700"))
    doc = json.loads(Path(files.argv[files.argv.index("--datasets-file") + 1]).read_text())
    assert doc["datasets"][0]["cache_url"] == "http://10.0.0.5:8700"


def test_a_role_without_data_sets_gets_no_file(tmp_path):
    files = _files(tmp_path, DataCache(tmp_path / "cache", 10**9), datasets=[])
    assert "--datasets-file" not in files.argv


def test_a_data_set_url_of_an_unknown_scheme_is_refused_in_the_order():
    with pytest.raises(ValidationError, match="url"):
        RoleSpec.model_validate({**role_spec(9, 1), "datasets": [{**ACCESS, "url": "ftp://x/y"}]})


def test_an_uploaded_data_set_is_read_from_the_server_address_the_agent_uses():
    from agents.reports import toward_server

    uploaded = {"id": 5, "name": "up", "url": "store:", "token": "htm_x",
                "store_url": "http://localhost:8000/api/v1/runs/9/datasets/up/files"}
    spec = RoleSpec.model_validate({**role_spec(9, 1), "datasets": [uploaded, ACCESS]})
    moved = toward_server(spec, "https://cp.internal:8443")
    assert moved.datasets[0].store_url == "https://cp.internal:8443/api/v1/runs/9/datasets/up/files"
    assert moved.datasets[1] == spec.datasets[1]
