"""Joining from another machine with the node page's two lines alone: the agent is installed
from the control plane's own wheel and runs in a network namespace whose only route is to the
control plane's host (control plane and broker listen there), from an empty environment and a
fresh working directory, and its node runs a run."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import ADMIN, ROOT, Deployment, _base_env, _healthy, _scratch_database, wait_until
from shaped_link import ShapedLink, shaped_link

pytestmark = pytest.mark.e2e

CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')
COMMAND = re.compile(r'<code id="agent-command-text">([^<]+)</code>')
INSTALL = re.compile(r'<code id="agent-install-text">([^<]+)</code>')


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
def home(tmp_path: Path) -> Path:
    """The joining machine's home directory, where the agent's lines run."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    return path


@pytest.fixture
def fresh_python(home: Path) -> Path:
    """The virtual environment the install line makes, ~/.hybridtrain, already holding
    hybridtrain's dependencies but not hybridtrain: the machine's package index, as it were,
    already delivered (torch is 5 GB; the namespace has no index to reach). Its entries are
    links to this environment's, hybridtrain's left out; the line's `python3 -m venv` keeps
    them, and its pip adds hybridtrain from the control plane's wheel."""
    venv = home / ".hybridtrain"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    theirs = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    present = {entry.name for entry in theirs.iterdir()}
    for entry in ours.iterdir():
        if entry.name in present or "hybridtrain" in entry.name:
            continue
        (theirs / entry.name).symlink_to(entry)
    return venv


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


def _join_lines_from_the_page(url: str, site_id: int) -> tuple[int, str, str]:
    """Sign in to the dashboard, declare a node with its form, and read the two lines it shows:
    the install and the agent's command."""
    with httpx.Client(base_url=url, timeout=30, follow_redirects=True) as web:
        csrf = CSRF.search(web.get("/login").text).group(1)
        assert web.post("/login", data={"token": ADMIN, "csrf_token": csrf, "next": "/"}).status_code == 200
        csrf = CSRF.search(web.get("/nodes").text).group(1)
        page = web.post("/nodes", data={"csrf_token": csrf, "site_id": str(site_id), "name": "gpu-far",
                                         "gpu_model_0": "T4", "gpu_count_0": "1"})
        assert page.status_code == 201, page.text[-2000:]
        node_id = int(re.search(r'id="agent-command" data-node-id="(\d+)"', page.text).group(1))
        install, command = (pattern.search(page.text).group(1).replace("&#39;", "'").replace("&amp;", "&")
                            for pattern in (INSTALL, COMMAND))
        return node_id, install, command


def test_the_node_pages_two_lines_alone_join_a_machine_that_reaches_only_the_control_plane(
    deployment: Deployment, remote_host: ShapedLink, fresh_python: Path, home: Path, tmp_path: Path
):
    site = deployment.post("/sites", {"name": "far", "kind": "cloud", "provider": "gcp",
                                      "region": "europe-west4", "continent": "europe"}).json()["id"]
    node_id, install, command = _join_lines_from_the_page(deployment.url, site)
    assert install.startswith("python3 -m venv ~/.hybridtrain && ~/.hybridtrain/bin/pip install "
                              f"'hybridtrain[agent] @ {deployment.url}/dist/hybridtrain-")
    assert command.startswith(f"~/.hybridtrain/bin/hybridtrain agent --server {deployment.url} --token htj_")
    routes = subprocess.run(["ip", "netns", "exec", remote_host.ns, "ip", "route"], capture_output=True,
                            text=True, check=True).stdout
    assert "default" not in routes  # nothing but the link to the control plane's host

    workdir = home
    # An empty environment but for PATH (a python3) and HOME (where ~/.hybridtrain is).
    env = {"PATH": f"{fresh_python / 'bin'}:/usr/bin:/bin", "HOME": str(workdir)}
    installed = subprocess.run(["ip", "netns", "exec", remote_host.ns, "sh", "-c", install], cwd=workdir, env=env,
                               capture_output=True, text=True, timeout=300)
    assert installed.returncode == 0, installed.stdout[-2000:] + installed.stderr[-2000:]
    where = subprocess.run([fresh_python / "bin" / "python3", "-c", "import agents; print(agents.__file__)"],
                           cwd=workdir, env=env, capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(fresh_python)), where  # the agent runs from the wheel, not this tree

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
        # Its consumer stayed connected: nothing it does is beyond its node's broker user.
        assert "NoPermissionError" not in (tmp_path / "remote-agent.log").read_text()
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        try:
            agent.wait(timeout=40)
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        log.close()
