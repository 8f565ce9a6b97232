"""Fixtures of the dashboard tests: signed-in page clients (on the rolled-back test session)
and, for the browser tests, a live uvicorn server on a database of its own with Chromium."""

from __future__ import annotations

import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
import uvicorn
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from app import db
from app.main import create_app
from tests.app.conftest import ADMIN_TOKEN, make_settings

ROOT = Path(__file__).resolve().parents[3]
# The browser tests' screenshots go to a scratch folder, to look at after a failure; the
# pictures the docs show come from `make screenshots` (docs/screenshots.py).
SCREENSHOTS = Path(tempfile.gettempdir()) / "hybridtrain-screenshots"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
_CSRF = re.compile(r'name="csrf_token" value="([^"]+)"')


def csrf_of(html: str) -> str:
    """The CSRF token embedded in a page's forms."""
    match = _CSRF.search(html)
    assert match, "the page carries no CSRF token"
    return match.group(1)


def field_errors(html: str) -> dict[str, str]:
    """The messages shown beside fields, by field name (HTML entities of quotes undone)."""
    found = re.findall(r'data-error-for="([\w]+)">([^<]*)<', html)
    return {name: msg.replace("&#39;", "'").replace("&#34;", '"') for name, msg in found}


@dataclass
class PageClient:
    """A browser-like client: cookies kept, and the CSRF token of the last page it read."""

    http: TestClient
    csrf: str = ""

    def get(self, url: str, **kwargs):  # type: ignore[no-untyped-def]
        response = self.http.get(url, **kwargs)
        if response.status_code == 200 and "csrf_token" in response.text:
            self.csrf = csrf_of(response.text)
        return response

    def post(self, url: str, data: dict[str, str] | None = None, *, csrf: bool = True, **kwargs):  # type: ignore[no-untyped-def]
        body = dict(data or {})
        if csrf:
            body.setdefault("csrf_token", self.csrf)
        return self.http.post(url, data=body, follow_redirects=kwargs.pop("follow_redirects", False), **kwargs)


@pytest.fixture
def sign_in(make_client: Callable[[str | None], TestClient]) -> Callable[[str], PageClient]:
    """Sign a fresh cookie-holding client in with an API token, through the login form."""

    def _sign_in(token: str) -> PageClient:
        page = PageClient(make_client(None))
        page.get("/login")
        response = page.post("/login", {"token": token, "next": "/"})
        assert response.status_code == 303, response.text
        page.get("/")
        return page

    return _sign_in


@pytest.fixture
def admin_page(sign_in: Callable[[str], PageClient]) -> PageClient:
    """A page client signed in with the admin token."""
    return sign_in(ADMIN_TOKEN)


# --- live server for the browser --------------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="session")
def live_database_url(postgres_url: str) -> Iterator[str]:
    """A migrated database of the live server's own: its commits are real, so it is kept apart
    from the rolled-back database the other tests share."""
    server = make_url(postgres_url)
    name = f"hybridtrain_web_{uuid.uuid4().hex[:12]}"
    dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = server.set(database=name).render_as_string(hide_password=False)
    db.upgrade(url)
    try:
        yield url
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@dataclass
class LiveServer:
    url: str
    app: object
    server: uvicorn.Server


@pytest.fixture(scope="session")
def live_server(live_database_url: str, redis_url: str) -> Iterator[LiveServer]:
    """The control plane served by uvicorn in a thread on a free port, dispatching to Redis."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    app = create_app(make_settings(
        live_database_url, public_url=url, celery_broker_url=redis_url, secret_key="web-tests-" + "k" * 32,
    ))
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn-live", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            pytest.fail("the live server did not start")
        time.sleep(0.05)
    try:
        yield LiveServer(url=url, app=app, server=server)
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    """Headless Debian Chromium driven by Playwright (never a downloaded browser)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser, live_server: LiveServer) -> Iterator[object]:  # type: ignore[no-untyped-def]
    """A fresh browser tab (its own cookies) that fails the test on any page error."""
    context = browser.new_context(base_url=live_server.url, viewport={"width": 1440, "height": 900})
    tab = context.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda exc: errors.append(str(exc)))
    # Every request must stay on the control plane: no CDN, nothing from the internet.
    outside: list[str] = []
    tab.on("request", lambda req: outside.append(req.url) if not req.url.startswith(live_server.url) and not req.url.startswith("data:") else None)
    try:
        yield tab
    finally:
        context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"
    assert not outside, f"the page fetched from outside the control plane: {outside}"


def sign_in_browser(tab, token: str = ADMIN_TOKEN, next_path: str = "/") -> None:  # type: ignore[no-untyped-def]
    """Sign a browser tab in through the login form."""
    tab.goto(f"/login?next={next_path}")
    tab.fill("#f-token", token)
    tab.click("button[type=submit]")
    tab.wait_for_url(f"**{next_path}")


def screenshot(tab, name: str) -> None:  # type: ignore[no-untyped-def]
    """Save a full-page screenshot into SCREENSHOTS (a scratch folder: see above)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    tab.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


# --- live agents ----------------------------------------------------------------------------------


@dataclass
class LiveNode:
    id: int
    name: str


@pytest.fixture
def live_agents(live_server: LiveServer, redis_url: str, tmp_path: Path) -> Iterator[Callable[[int], list[LiveNode]]]:
    """Declare nodes through the API and start a real `hybridtrain agent` for each, running the
    real trainer on CPU; waits until every node is online. Agents and their roles are stopped
    (then killed) at the end."""
    import json
    import subprocess
    import sys

    import httpx
    import psutil

    processes: list[subprocess.Popen[bytes]] = []
    api = httpx.Client(base_url=live_server.url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)

    def start(count: int) -> list[LiveNode]:
        tag = uuid.uuid4().hex[:6]
        site = api.post("/api/v1/sites", json={"name": f"lab-{tag}", "kind": "onprem", "provider": "onprem", "continent": "europe"})
        assert site.status_code == 201, site.text
        nodes = []
        for i in range(count):
            created = api.post("/api/v1/nodes", json={"site_id": site.json()["id"], "name": f"agent-{tag}-{i}", "gpus": [{"model": "T4", "count": 1}]})
            assert created.status_code == 201, created.text
            node = created.json()
            log = open(tmp_path / f"agent-{i}.log", "wb")  # noqa: SIM115 - closed with the process
            argv = [
                sys.executable, "-m", "app.cli", "agent",
                "--server", live_server.url, "--token", node["join_token"],
                "--state-dir", str(tmp_path / f"agent-{i}"), "--broker-url", redis_url,
                "--heartbeat-interval", "0.5", "--benchmark-seconds", "0", "--role-threads", "1",
                "--advertise-address", "127.0.0.1", "--kill-grace", "3",
                "--trainer-command", json.dumps([sys.executable, "-m", "trainer"]),
            ]
            processes.append(subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT))
            nodes.append(LiveNode(node["id"], node["name"]))
        deadline = time.monotonic() + 60
        while any(api.get(f"/api/v1/nodes/{n.id}").json()["status"] != "online" for n in nodes):
            if time.monotonic() > deadline:
                logs = "\n".join((tmp_path / f"agent-{i}.log").read_text(errors="replace")[-2000:] for i in range(count))
                pytest.fail(f"the agents did not bring their nodes online:\n{logs}")
            time.sleep(0.3)
        return nodes

    try:
        yield start
    finally:
        api.close()
        for proc in processes:
            family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))] if proc.poll() is None else []
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for pid in family:
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
