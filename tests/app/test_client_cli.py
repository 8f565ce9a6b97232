"""The `hybridtrain` command line end to end against a served control plane (uvicorn in a
thread, FastAPI on Postgres): `runs create --workdir` packs and uploads once, `bundles list`
shows the bundle and `bundles delete` removes it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from runs_testing import online_node_fixture  # noqa: F401 (fixture)

from app.cli import main
from tests.app.serving import cli_server


@pytest.fixture
def server(app: FastAPI, make_client: Callable[[str | None], TestClient]) -> Iterator[list[str]]:
    """`--server URL --token T` of the test app served over real HTTP; requests share the test's
    rolled-back transaction (make_client installs it), and no lifespan starts the monitor."""
    with cli_server(app, "uvicorn-cli-test") as argv:
        yield argv


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _plan(server: list[str], node_id: int, workdir: str) -> list[str]:
    return ["runs", "create", "--name", "r", "--nodes", str(node_id), *server, "--workdir", workdir,
            "--script", "train.py", "--plan-only", "--", "--epochs", "1"]


def test_runs_create_uploads_an_unchanged_work_dir_once(server, online_node, tmp_path, capsys):
    (tmp_path / "train.py").write_text("print('train')\n")
    plan = _plan(server, online_node().id, str(tmp_path))

    first, second = _cli(capsys, *plan), _cli(capsys, *plan)

    assert (first[0], second[0]) == (0, 0), first[2] + second[2]
    assert first[2].startswith("hybridtrain: packed 1 files, 0.0 MB, sha256 ") and "(uploaded)" in first[2]
    assert "(already on the server)" in second[2]
    assert json.loads(first[1])["workers"]


def test_bundles_list_shows_an_upload_and_delete_removes_it(server, online_node, tmp_path, capsys):
    (tmp_path / "train.py").write_text("print('train')\n")
    uploaded = _cli(capsys, *_plan(server, online_node().id, str(tmp_path)))[2]
    sha256 = json.loads(_cli(capsys, "bundles", "list", *server, "--json")[1])["data"][0]["sha256"]
    assert uploaded.split("sha256 ")[1].startswith(sha256[:12])
    assert sha256 in _cli(capsys, "bundles", "list", *server)[1]
    assert _cli(capsys, "bundles", "delete", sha256, *server)[0] == 0
    assert sha256 not in _cli(capsys, "bundles", "list", *server)[1]


def test_deleting_a_bundle_the_server_lacks_fails_with_one_line(server, capsys):
    code, _, err = _cli(capsys, "bundles", "delete", "e" * 64, *server)
    assert code == 1 and err.startswith("hybridtrain: 404: ") and err.count("\n") == 1


def test_deleting_by_something_not_a_sha256_is_a_usage_error(capsys):
    code, _, err = _cli(capsys, "bundles", "delete", "not-a-sha")
    assert code == 2 and "SHA256: expected the 64 hex digits" in err
