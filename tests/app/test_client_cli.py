"""The `hybridtrain` command line end to end against a served control plane (uvicorn in a
thread, FastAPI on Postgres): `runs create --workdir` packs and uploads once, `bundles list`
shows the bundle and `bundles delete` removes it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from runs_testing import online_node_fixture  # noqa: F401 (fixture)

from app.cli import main
from tests.app.conftest import ADMIN_TOKEN


@pytest.fixture
def server(app: FastAPI, make_client: Callable[[str | None], TestClient]) -> Iterator[list[str]]:
    """`--server URL --token T` of the test app served over real HTTP; requests share the test's
    rolled-back transaction (make_client installs it), and no lifespan starts the monitor."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, name="uvicorn-cli-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not served.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the control plane did not start")
        time.sleep(0.02)
    port = served.servers[0].sockets[0].getsockname()[1]
    try:
        yield ["--server", f"http://127.0.0.1:{port}", "--token", ADMIN_TOKEN]
    finally:
        served.should_exit = True
        thread.join(timeout=10)


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
