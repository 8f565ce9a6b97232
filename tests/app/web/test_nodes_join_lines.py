"""The node page's join lines: a virtual environment of the agent's own (PEP 668), and a clear
warning, naming what to set, when only this machine could join."""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterator

import pytest
from fastapi import FastAPI

from app.api.deps import get_settings
from app.config import Settings
from tests.app.web.conftest import PageClient

OBSTACLES = re.compile(r'<div class="flash flash-warn" id="join-obstacles">(.*?)</div>', re.S)


def _code(page: str, element: str) -> str:
    return html.unescape(re.search(rf'<code id="{element}">([^<]+)</code>', page).group(1))


def _declare(admin_page: PageClient, make_site: Callable[..., dict]) -> str:
    response = admin_page.post("/nodes", {"site_id": str(make_site()["id"]), "name": "far-box",
                                          "gpu_model_0": "T4", "gpu_count_0": "1"})
    assert response.status_code == 201, response.text[-2000:]
    return response.text


@pytest.fixture
def reachable(app: FastAPI, settings: Settings) -> Iterator[Settings]:
    """The app as a control plane that other machines reach: a public address and Redis."""
    public = settings.model_copy(update={"public_url": "http://cp.example.org:8000",
                                         "celery_broker_url": "redis://cp.example.org:6379/0"})
    app.dependency_overrides[get_settings] = lambda: public
    try:
        yield public
    finally:
        app.dependency_overrides.pop(get_settings, None)


def test_the_join_lines_install_into_a_virtual_environment_and_start_the_agent_from_it(admin_page, make_site):
    page = _declare(admin_page, make_site)
    install, command = _code(page, "agent-install-text"), _code(page, "agent-command-text")
    assert install.startswith("python3 -m venv ~/.hybridtrain && ~/.hybridtrain/bin/pip install "
                              "'hybridtrain[agent] @ http://127.0.0.1:8000/dist/hybridtrain-")
    assert command.startswith("~/.hybridtrain/bin/hybridtrain agent --server http://127.0.0.1:8000 --token htj_")
    assert "python3-venv" in page


def test_a_localhost_public_url_and_the_embedded_broker_are_said_to_keep_other_machines_out(admin_page, make_site):
    warning = html.unescape(OBSTACLES.search(_declare(admin_page, make_site)).group(1))
    assert "Only this machine can join as things are." in warning
    assert ("The control plane's public URL is http://127.0.0.1:8000, which only this machine reaches: "
            "set HYBRIDTRAIN_PUBLIC_URL") in warning
    assert "the embedded SQLite broker" in warning and "CELERY_BROKER_URL=redis://" in warning


def test_a_reachable_control_plane_shows_the_lines_without_a_warning(reachable, admin_page, make_site):
    page = _declare(admin_page, make_site)
    assert OBSTACLES.search(page) is None and 'id="join-obstacles"' not in page
    assert _code(page, "agent-command-text").startswith(
        "~/.hybridtrain/bin/hybridtrain agent --server http://cp.example.org:8000 --token htj_")


def test_a_broker_on_loopback_is_named_with_the_setting_that_hands_agents_another(
    app: FastAPI, settings: Settings, admin_page, make_site
):
    app.dependency_overrides[get_settings] = lambda: settings.model_copy(
        update={"public_url": "http://cp.example.org:8000", "celery_broker_url": "redis://:pw@127.0.0.1:6379/0"})
    try:
        warning = html.unescape(OBSTACLES.search(_declare(admin_page, make_site)).group(1))
    finally:
        app.dependency_overrides.pop(get_settings, None)
    assert "public URL" not in warning
    assert "Agents are handed the broker redis://:***@127.0.0.1:6379/0" in warning
    assert "HYBRIDTRAIN_BROKER_URL_FOR_AGENTS" in warning


def test_a_new_join_token_on_the_node_page_shows_the_same_lines_and_warning(admin_page, make_node):
    node = make_node()
    response = admin_page.post(f"/nodes/{node['id']}/join-token")
    assert response.status_code == 201, response.text[-2000:]
    assert _code(response.text, "agent-install-text").startswith("python3 -m venv ~/.hybridtrain && ")
    assert "HYBRIDTRAIN_PUBLIC_URL" in OBSTACLES.search(response.text).group(1)
