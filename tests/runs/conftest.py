"""Fixtures of the end-to-end tests: a control plane and agents as separate processes, on
the real Postgres and Redis or on the embedded defaults."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from sqlalchemy.engine import make_url

from tests.redis_dbs import private_redis

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "e2e-admin-" + uuid.uuid4().hex[:8]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, every: float = 0.25) -> Any:
    """Poll until `predicate` returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def group_alive(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


class Service:
    """A child process with its output in a file, stopped with SIGTERM at the end."""

    def __init__(self, argv: list[str], log_path: Path, *, env: dict[str, str], cwd: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 40) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


class Deployment:
    """A control plane and its agents; helpers to declare nodes and drive runs over REST."""

    def __init__(self, tmp: Path, env: dict[str, str], url: str, cwd: Path) -> None:
        self.tmp, self.env, self.url, self.cwd = tmp, env, url, cwd
        self.api = httpx.Client(base_url=url + "/api/v1", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
        self.services: list[Service] = []
        self.agents: dict[int, Service] = {}

    def start(self, argv: list[str], name: str) -> Service:
        service = Service([sys.executable, "-m", "app.cli", *argv], self.tmp / f"{name}.log", env=self.env, cwd=self.cwd)
        self.services.append(service)
        return service

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        return self.api.post(path, json=body, **kw)

    def get(self, path: str, **kw: Any) -> Any:
        response = self.api.get(path, **kw)
        assert response.status_code == 200, response.text
        return response.json()

    def add_node(self, site_id: int, gpu: str, *, broker_url: str) -> int:
        """Declare a node with one GPU of model `gpu` and start its agent; wait until online."""
        created = self.post("/nodes", {"name": f"node-{gpu.replace(' ', '-').lower()}", "site_id": site_id,
                                       "gpus": [{"model": gpu, "count": 1}]})
        assert created.status_code == 201, created.text
        node = created.json()
        agent = self.start([
            "agent", "--server", self.url, "--token", node["join_token"],
            "--state-dir", str(self.tmp / f"agent-{node['id']}"), "--broker-url", broker_url,
            "--heartbeat-interval", "1", "--benchmark-seconds", "0", "--kill-grace", "5",
            "--role-threads", "1",
        ], f"agent-{node['id']}")
        self.agents[node["id"]] = agent
        return int(node["id"])

    def wait_online(self, node_ids: list[int], timeout: float = 90) -> None:
        def online() -> bool:
            for node_id, agent in self.agents.items():
                if agent.proc.poll() is not None:
                    pytest.fail(f"agent of node {node_id} exited:\n{agent.output()[-3000:]}")
            return all(self.get(f"/nodes/{n}")["status"] == "online" for n in node_ids) and all(
                "agent ready" in self.agents[n].output() for n in node_ids if n in self.agents
            )

        wait_until(online, timeout, f"nodes {node_ids} to come online")

    def run(self, run_id: int) -> dict[str, Any]:
        return self.get(f"/runs/{run_id}")

    def wait_status(self, run_id: int, statuses: set[str], timeout: float) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            run = self.run(run_id)
            return run if run["status"] in statuses else None

        try:
            return wait_until(reached, timeout, f"run {run_id} to become {statuses}", every=0.5)
        except pytest.fail.Exception:
            print(self.run(run_id))
            print(self.get(f"/runs/{run_id}/logs", params={"tail": 30}))
            raise

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop()
        self.api.close()


def _scratch_database(postgres_url: str) -> tuple[str, Callable[[], None]]:
    import psycopg

    name = f"hybridtrain_e2e_{uuid.uuid4().hex[:10]}"
    server = make_url(postgres_url)
    dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return server.set(database=name).render_as_string(hide_password=False), drop


def _base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYBRIDTRAIN_", "CELERY_", "DATABASE_URL"))}
    env.update(
        HYBRIDTRAIN_ADMIN_TOKEN=ADMIN,
        # Liveness on a short fuse so the dead-agent test takes seconds (the 30 s default is
        # covered by tests/app/test_runs_api.py); 12 heartbeat intervals, since at 6 a loaded
        # 2-CPU host once starved a live agent for 8 s and the test lost the server's node too.
        HYBRIDTRAIN_HEARTBEAT_TIMEOUT_S="12",
        HYBRIDTRAIN_MONITOR_INTERVAL_S="1",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env



@pytest.fixture(scope="module")
def cluster(postgres_url: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """Control plane on a fresh Postgres database and Redis, three agents on three nodes with
    different GPU models (two on-prem, one cloud)."""
    tmp = tmp_path_factory.mktemp("e2e-pg")
    redis_url = private_redis(redis_url, 12)
    database_url, drop = _scratch_database(postgres_url)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _base_env(DATABASE_URL=database_url, CELERY_BROKER_URL=redis_url, HYBRIDTRAIN_PUBLIC_URL=url)
    deployment = Deployment(tmp, env, url, ROOT)
    try:
        server = deployment.start(["server", "--host", "127.0.0.1", "--port", str(port), "--no-access-log"], "server")
        wait_until(lambda: _healthy(url, server), 60, "the control plane to serve")
        onprem = deployment.post("/sites", {"name": "lab", "kind": "onprem", "provider": "onprem",
                                            "continent": "europe"}).json()["id"]
        cloud = deployment.post("/sites", {"name": "gcp-eu", "kind": "cloud", "provider": "gcp",
                                           "region": "europe-west4", "continent": "europe"}).json()["id"]
        deployment.nodes = [  # type: ignore[attr-defined]
            deployment.add_node(onprem, "RTX 3090 Ti", broker_url=redis_url),
            deployment.add_node(onprem, "RTX 3090", broker_url=redis_url),
            deployment.add_node(cloud, "V100 PCIe", broker_url=redis_url),
        ]
        deployment.wait_online(deployment.nodes)  # type: ignore[attr-defined]
        yield deployment
    finally:
        deployment.close()
        drop()


def _healthy(url: str, server: Service) -> bool:
    if server.proc.poll() is not None:
        pytest.fail(f"the control plane exited:\n{server.output()[-3000:]}")
    try:
        return httpx.get(url + "/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
