"""Every /api/v1 call needs a bearer token; scopes nest admin > ci > read."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from app.api.deps import require_scope
from app.models import TokenScope

API = "/api/v1"
MakeClient = Callable[[str | None], TestClient]


INVENTORY = ("/gpu-models", "/sites", "/nodes", "/clusters", "/prices/", "/tokens")


def _inventory_routes(app: FastAPI) -> list[tuple[str, str]]:
    routes = []
    for path, operations in app.openapi()["paths"].items():
        if path.startswith(tuple(API + prefix for prefix in INVENTORY)):
            concrete = "/".join("1" if part.startswith("{") else part for part in path.split("/"))
            routes.extend((method.upper(), concrete) for method in operations)
    return sorted(routes)


def test_every_inventory_route_answers_401_without_a_token(app: FastAPI, make_client: MakeClient) -> None:
    anonymous = make_client(None)
    routes = _inventory_routes(app)
    assert len(routes) >= 30
    for method, path in routes:
        response = anonymous.request(method, path)
        assert response.status_code == 401, (method, path, response.text)
        assert response.headers["www-authenticate"] == "Bearer"


def test_unknown_token_is_refused_with_401(make_client: MakeClient) -> None:
    response = make_client("htk_not-a-real-token").get(f"{API}/sites")
    assert response.status_code == 401
    assert response.json() == {"detail": "invalid or revoked token"}


def test_non_bearer_authorization_is_refused_with_401(app: FastAPI, make_client: MakeClient) -> None:
    client = make_client(None)
    response = client.get(f"{API}/sites", headers={"Authorization": "Basic dXNlcjpwYXNz"})
    assert response.status_code == 401


def test_admin_token_from_settings_is_accepted_as_admin(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={"name": "from-env-admin", "scope": "read"})
    assert response.status_code == 201


def test_stored_token_is_accepted(make_client: MakeClient, token_with_scope: Callable[[TokenScope], str]) -> None:
    response = make_client(token_with_scope(TokenScope.read)).get(f"{API}/gpu-models")
    assert response.status_code == 200


@pytest.mark.parametrize("scope", [TokenScope.read, TokenScope.ci])
def test_read_and_ci_scopes_may_read_the_inventory(
    scope: TokenScope, make_client: MakeClient, token_with_scope: Callable[[TokenScope], str]
) -> None:
    client = make_client(token_with_scope(scope))
    for path in ("/gpu-models", "/sites", "/nodes", "/clusters", "/prices/instances", "/prices/egress"):
        assert client.get(API + path).status_code == 200, path


@pytest.mark.parametrize("scope", [TokenScope.read, TokenScope.ci])
def test_read_and_ci_scopes_may_not_change_the_inventory(
    scope: TokenScope, make_client: MakeClient, token_with_scope: Callable[[TokenScope], str]
) -> None:
    client = make_client(token_with_scope(scope))
    body = {"name": "x", "kind": "cloud", "provider": "gcp", "continent": "europe"}
    response = client.post(f"{API}/sites", json=body)
    assert response.status_code == 403
    assert f"scope '{scope}'" in response.json()["detail"]


@pytest.mark.parametrize("scope", [TokenScope.read, TokenScope.ci])
def test_only_admins_may_list_or_create_tokens(
    scope: TokenScope, make_client: MakeClient, token_with_scope: Callable[[TokenScope], str]
) -> None:
    client = make_client(token_with_scope(scope))
    assert client.get(f"{API}/tokens").status_code == 403
    assert client.post(f"{API}/tokens", json={"name": "n", "scope": "read"}).status_code == 403


def test_admin_token_created_through_the_api_may_change_the_inventory(
    client: TestClient, make_client: MakeClient
) -> None:
    secret = client.post(f"{API}/tokens", json={"name": "ops", "scope": "admin"}).json()["token"]
    body = {"name": "by-ops", "kind": "onprem", "provider": "onprem", "continent": "europe"}
    assert make_client(secret).post(f"{API}/sites", json=body).status_code == 201


@pytest.mark.parametrize(
    ("held", "needed", "allowed"),
    [
        (TokenScope.read, TokenScope.read, True),
        (TokenScope.read, TokenScope.ci, False),
        (TokenScope.ci, TokenScope.ci, True),
        (TokenScope.ci, TokenScope.admin, False),
        (TokenScope.admin, TokenScope.ci, True),
        (TokenScope.admin, TokenScope.admin, True),
    ],
)
def test_require_scope_admits_the_needed_scope_and_those_above(
    held: TokenScope, needed: TokenScope, allowed: bool
) -> None:
    from fastapi import HTTPException
    from starlette.requests import Request

    from app.api.deps import Principal

    check = require_scope(needed)
    principal = Principal(name="t", scope=held)
    request = Request({"type": "http", "method": "POST", "path": "/", "headers": []})
    if allowed:
        assert asyncio.run(check(request, principal)) is principal
    else:
        with pytest.raises(HTTPException) as raised:
            asyncio.run(check(request, principal))
        assert raised.value.status_code == 403
