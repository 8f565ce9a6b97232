"""Tokens limited to named actions: every change they make must be one of them; reading
follows the scope; every write route of the API and the dashboard has a named action."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.routing import APIRoute, iter_route_contexts
from fastapi.testclient import TestClient

from app.token_limits import ACTIONS, HANDLER_ACTIONS, READ_METHODS

API = "/api/v1"
MakeClient = Callable[[str | None], TestClient]
SITE = {"kind": "cloud", "provider": "gcp", "continent": "europe"}


@pytest.fixture
def limited(client: TestClient, make_client: MakeClient) -> Callable[..., TestClient]:
    """A client holding a new token of `scope` limited to `actions`."""

    def _make(*actions: str, scope: str = "admin") -> TestClient:
        body = {"name": f"limited-{len(actions)}-{'-'.join(actions)}"[:128], "scope": scope, "actions": list(actions)}
        created = client.post(f"{API}/tokens", json=body)
        assert created.status_code == 201, created.text
        return make_client(created.json()["token"])

    return _make


def test_a_limited_token_may_perform_its_actions(limited: Callable[..., TestClient]) -> None:
    response = limited("sites:write").post(f"{API}/sites", json={"name": "allowed", **SITE})
    assert response.status_code == 201


def test_a_limited_token_is_refused_other_actions_naming_the_needed_one(
    limited: Callable[..., TestClient], make_site: Callable[..., dict[str, Any]]
) -> None:
    site = make_site()
    body = {"name": "n", "site_id": site["id"], "gpus": [{"model": "T4", "count": 1}]}
    response = limited("sites:write").post(f"{API}/nodes", json=body)
    assert response.status_code == 403
    assert response.json()["detail"] == "token 'limited-1-sites:write' is limited to sites:write; this needs 'nodes:write'"


def test_a_limited_token_reads_what_its_scope_allows(limited: Callable[..., TestClient]) -> None:
    reader = limited("runs:create", scope="ci")
    for path in ("/sites", "/nodes", "/runs", "/prices/instances"):
        assert reader.get(API + path).status_code == 200, path


def test_actions_never_widen_a_scope(limited: Callable[..., TestClient]) -> None:
    response = limited("sites:write", scope="ci").post(f"{API}/sites", json={"name": "wider", **SITE})
    assert response.status_code == 403
    assert "scope 'ci'" in response.json()["detail"]


def test_create_token_lists_its_actions(client: TestClient) -> None:
    body = client.post(
        f"{API}/tokens", json={"name": "ci-bot", "scope": "ci", "actions": ["runs:plan", "runs:create", "runs:plan"]}
    ).json()
    assert body["actions"] == ["runs:create", "runs:plan"]


def test_create_token_refuses_an_unknown_action_naming_the_field(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={"name": "typo", "scope": "ci", "actions": ["runs:cancle"]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "actions", 0]


def test_create_token_refuses_actions_on_a_read_token_naming_the_field(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={"name": "r", "scope": "read", "actions": ["runs:create"]})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "actions"]


def test_create_token_refuses_an_empty_action_list(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={"name": "none", "scope": "ci", "actions": []})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "actions"]


def _scope_guarded_writes(app: FastAPI) -> dict[str, str]:
    """Handler name -> path of every write route behind a scope check (API and pages)."""
    out: dict[str, str] = {}
    for context in iter_route_contexts(app.routes):
        route = context.original_route
        if not isinstance(route, APIRoute) or not set(route.methods) - READ_METHODS:
            continue
        names = set()
        stack = list(route.dependant.dependencies)
        while stack:
            dep = stack.pop()
            names.add(getattr(dep.call, "__name__", ""))
            stack.extend(dep.dependencies)
        if any(n.startswith(("require_", "check_scope", "check_page_scope")) for n in names):
            out[route.name] = context.path or route.path
    return out


def test_every_write_route_behind_a_scope_has_a_named_action(app: FastAPI) -> None:
    writes = _scope_guarded_writes(app)
    assert len(writes) >= 30
    unnamed = {name: path for name, path in writes.items() if name not in HANDLER_ACTIONS}
    assert unnamed == {}, "name them in app/token_limits.py"


def test_every_named_handler_is_a_write_route(app: FastAPI) -> None:
    assert set(HANDLER_ACTIONS) - set(_scope_guarded_writes(app)) == set()
    assert set(HANDLER_ACTIONS.values()) == set(ACTIONS)
