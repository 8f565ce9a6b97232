"""Joining from another machine with the node page's command alone: the agent runs in a network
namespace whose only route is to the control plane's host (control plane and broker listen
there), from an empty environment and a fresh working directory, and its node runs a run."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ADMIN, ROOT, Deployment, _base_env, _healthy, _scratch_database, wait_until
from shaped_link import ShapedLink, shaped_link

pytestmark = pytest.mark.e2e

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
COMMAND = re.compile(r'<code id="agent-command-text">([^<]+)</code>')


def _free_port_on(address: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((address, 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def remote_host() -> Iterator[ShapedLink]:
    """A namespace joined to this host by one veth pair: its only route is to the host's end."""
    with shaped_link("htjoin", "1gbit", "1mb") as link:
        yield link


@pytest.fixture
def deployment(remote_host: ShapedLink, postgres_url: str, tmp_path: Path) -> Iterator[Deployment]:
    """Control plane and a password-protected Redis, both listening on the host's end of the link."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        pytest.fail("this test needs redis-server on PATH for a broker on the link's address")
    host = remote_host.host_address
    redis_port, port = _free_port_on(host), _free_port_on(host)
    password = secrets.token_hex(16)
    broker = subprocess.Popen(
        [redis_server, "--bind", host, "--port", str(redis_port), "--requirepass", password, "--save", "",
         "--appendonly", "no", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    database_url, drop = _scratch_database(postgres_url)
    url = f"http://{host}:{port}"
    env = _base_env(DATABASE_URL=database_url, CELERY_BROKER_URL=f"redis://:{password}@{host}:{redis_port}/0",
                    HYBRIDTRAIN_PUBLIC_URL=url, HYBRIDTRAIN_SECRET_KEY="join-test-" + secrets.token_hex(16))
    plane = Deployment(tmp_path, env, url, ROOT)
    try:
        server = plane.start(["server", "--host", host, "--port", str(port), "--no-access-log"], "server")
        wait_until(lambda: _healthy(url, server), 60, "the control plane to serve")
        yield plane
    finally:
        plane.close()
        broker.terminate()
        broker.wait(timeout=10)
        drop()


def _join_command_from_the_page(url: str, site_id: int) -> tuple[int, str]:
    """Sign in to the dashboard, declare a node with its form, and read the command it shows."""
    with httpx.Client(base_url=url, timeout=30, follow_redirects=True) as web:
        csrf = CSRF.search(web.get("/login").text).group(1)
        assert web.post("/login", data={"token": ADMIN, "csrf_token": csrf, "next": "/"}).status_code == 200
        csrf = CSRF.search(web.get("/nodes").text).group(1)
        page = web.post("/nodes", data={"csrf_token": csrf, "site_id": str(site_id), "name": "gpu-far",
                                         "gpu_model_0": "T4", "gpu_count_0": "1"})
        assert page.status_code == 201, page.text[-2000:]
        node_id = int(re.search(r'id="agent-command" data-node-id="(\d+)"', page.text).group(1))
        return node_id, COMMAND.search(page.text).group(1).replace("&#39;", "'").replace("&amp;", "&")


def test_the_node_pages_command_alone_joins_a_machine_that_reaches_only_the_control_plane(
    deployment: Deployment, remote_host: ShapedLink, tmp_path: Path
):
    site = deployment.post("/sites", {"name": "far", "kind": "cloud", "provider": "gcp",
                                      "region": "europe-west4", "continent": "europe"}).json()["id"]
    node_id, command = _join_command_from_the_page(deployment.url, site)
    assert command.startswith(f"hybridtrain agent --server {deployment.url} --token htj_")
    routes = subprocess.run(["ip", "netns", "exec", remote_host.ns, "ip", "route"], capture_output=True,
                            text=True, check=True).stdout
    assert "default" not in routes  # nothing but the link to the control plane's host

    workdir = tmp_path / "elsewhere"
    workdir.mkdir()
    # An empty environment but for PATH (where the one-line install put `hybridtrain`) and HOME.
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(workdir)}
    log = open(tmp_path / "remote-agent.log", "wb")
    agent = subprocess.Popen(["ip", "netns", "exec", remote_host.ns, "sh", "-c", command], cwd=workdir, env=env,
                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready() -> bool:
            if agent.poll() is not None:
                pytest.fail(f"the agent exited: {(tmp_path / 'remote-agent.log').read_text()[-3000:]}")
            return "agent ready" in (tmp_path / "remote-agent.log").read_text()

        wait_until(ready, 120, "the agent to register and consume its queue")
        output = (tmp_path / "remote-agent.log").read_text()
        assert f"node {node_id} takes its orders from redis://hybridtrain-node-{node_id}:***@" in output
        node = deployment.get(f"/nodes/{node_id}")
        assert node["status"] == "online" and node["address"] == remote_host.address

        run = deployment.post("/runs", {"name": "far-away", "node_ids": [node_id], "strategy": "ps",
                                        "global_batch_size": 32, "max_steps": 4, "device": "cpu"})
        assert run.status_code == 201, run.text
        done = deployment.wait_status(run.json()["id"], {"succeeded", "failed", "cancelled"}, 240)

        assert done["status"] == "succeeded", done.get("reason")
        # The trainers reported to the address the agent registered with: the chart is not empty.
        series = deployment.get(f"/runs/{done['id']}/metrics", params={"name": "loss"})["series"]
        assert series and series[0]["points"], series
        assert (workdir / "var" / "agent" / "agent.json").exists()
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        try:
            agent.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()
