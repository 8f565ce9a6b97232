"""/healthz and the `hybridtrain server` command, started for real."""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fastapi.testclient import TestClient

from app.config import Settings
from app.main import create_app

REPO = Path(__file__).resolve().parents[2]
# The console script installed with the package (`pip install -e .`), as a user runs it.
HYBRIDTRAIN = str(Path(sys.executable).with_name("hybridtrain"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(env_overrides: dict[str, str], cwd: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "HYBRIDTRAIN_DATABASE_URL")}
    env.update(env_overrides)
    process = subprocess.Popen(
        [HYBRIDTRAIN, "server", "--host", "127.0.0.1", "--port", str(port)],
        cwd=cwd,
        env=env | {"PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}"


def _wait_healthy(process: subprocess.Popen[bytes], url: str, timeout_s: float = 60) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read().decode())  # type: ignore[union-attr]
        try:
            return httpx.get(f"{url}/healthz", timeout=2)
        except httpx.TransportError:
            time.sleep(0.2)
    raise AssertionError("server did not answer /healthz in time")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def test_healthz_answers_200_when_the_database_is_reachable(client: TestClient) -> None:
    response = client.get("/healthz")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


def test_healthz_answers_503_when_the_database_is_unreachable() -> None:
    settings = Settings(DATABASE_URL="postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    response = TestClient(create_app(settings)).get("/healthz")
    assert response.status_code == 503
    assert response.json()["database"] == "unreachable"


def test_server_command_migrates_the_default_sqlite_database_under_var_and_serves(tmp_path: Path) -> None:
    process, url = _serve({"HYBRIDTRAIN_ADMIN_TOKEN": "serve-test"}, cwd=tmp_path)
    try:
        assert _wait_healthy(process, url).status_code == 200
        assert (tmp_path / "var" / "hybridtrain.db").is_file()
        headers = {"Authorization": "Bearer serve-test"}
        models = httpx.get(f"{url}/api/v1/gpu-models", headers=headers, timeout=5).json()
        assert models["count"] >= 13
        assert httpx.get(f"{url}/docs", timeout=5).status_code == 200
        assert httpx.get(f"{url}/api/v1/gpu-models", timeout=5).status_code == 401
    finally:
        _stop(process)


def test_server_command_closes_a_connection_idle_for_its_keep_alive(tmp_path: Path) -> None:
    process, url = _serve({"HYBRIDTRAIN_ADMIN_TOKEN": "keep", "HYBRIDTRAIN_KEEP_ALIVE_S": "1"}, cwd=tmp_path)
    try:
        _wait_healthy(process, url)
        conn = http.client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]), timeout=10)
        try:
            conn.request("GET", "/healthz")
            assert conn.getresponse().read() and conn.sock is not None  # kept alive
            started = time.monotonic()
            assert conn.sock.recv(1) == b""  # then closed by the server, idle
            assert 0.8 < time.monotonic() - started < 5
        finally:
            conn.close()
    finally:
        _stop(process)


def test_server_command_runs_on_postgres_from_database_url(
    scratch_postgres_url: str, tmp_path: Path
) -> None:
    process, url = _serve({"DATABASE_URL": scratch_postgres_url, "HYBRIDTRAIN_ADMIN_TOKEN": "pg"}, cwd=tmp_path)
    try:
        assert _wait_healthy(process, url).status_code == 200
        sites = httpx.get(f"{url}/api/v1/sites", headers={"Authorization": "Bearer pg"}, timeout=5)
        assert sites.json() == {"data": [], "count": 0}
        assert not (tmp_path / "var").exists()
    finally:
        _stop(process)


def test_token_create_command_prints_a_working_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "HYBRIDTRAIN_DATABASE_URL")}
    env |= {"PYTHONPATH": str(REPO)}
    run = lambda *args: subprocess.run(  # noqa: E731
        [HYBRIDTRAIN, *args], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert run("db", "upgrade").returncode == 0
    created = run("token", "create", "--name", "laptop", "--scope", "read")
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip()
    assert secret.startswith("htk_")
    settings = Settings(DATABASE_URL=f"sqlite+pysqlite:///{tmp_path}/var/hybridtrain.db")
    client = TestClient(create_app(settings), headers={"Authorization": f"Bearer {secret}"})
    assert client.get("/api/v1/sites").status_code == 200
    assert client.post("/api/v1/sites", json={}).status_code == 403
    assert run("token", "create", "--name", "laptop", "--scope", "read").returncode == 1
