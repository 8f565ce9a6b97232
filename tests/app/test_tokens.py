"""API tokens: the secret is shown once, only its hash is stored, deletion revokes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from fastapi.testclient import TestClient
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import ApiToken

API = "/api/v1"


def test_create_token_shows_the_secret_once_and_stores_only_its_sha256(
    client: TestClient, session: Session
) -> None:
    response = client.post(f"{API}/tokens", json={"name": "ci-pipeline", "scope": "ci"})
    assert response.status_code == 201
    body = response.json()
    secret = body["token"]
    assert secret.startswith("htk_") and len(secret) > 40
    stored = session.scalars(select(ApiToken).where(ApiToken.name == "ci-pipeline")).one()
    assert stored.token_hash == hashlib.sha256(secret.encode()).hexdigest()
    assert secret not in {stored.token_hash, stored.prefix, stored.name}
    listed = client.get(f"{API}/tokens").json()["data"]
    assert all("token" not in row for row in listed)
    assert {"name": "ci-pipeline", "scope": "ci", "prefix": secret[:12]}.items() <= next(
        row for row in listed if row["name"] == "ci-pipeline"
    ).items()


def test_create_token_rejects_duplicate_name(client: TestClient) -> None:
    client.post(f"{API}/tokens", json={"name": "twice", "scope": "read"})
    response = client.post(f"{API}/tokens", json={"name": "twice", "scope": "admin"})
    assert response.status_code == 409


def test_create_token_rejects_unknown_scope_naming_the_field(client: TestClient) -> None:
    response = client.post(f"{API}/tokens", json={"name": "x", "scope": "root"})
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "scope"]


def test_deleted_token_is_refused(client: TestClient, make_client: Callable[[str | None], TestClient]) -> None:
    created = client.post(f"{API}/tokens", json={"name": "short-lived", "scope": "read"}).json()
    reader = make_client(created["token"])
    assert reader.get(f"{API}/sites").status_code == 200
    assert client.delete(f"{API}/tokens/{created['id']}").status_code == 204
    assert reader.get(f"{API}/sites").status_code == 401


def test_delete_unknown_token_answers_404(client: TestClient) -> None:
    assert client.delete(f"{API}/tokens/999999").status_code == 404


def test_list_tokens_filters_by_scope(client: TestClient) -> None:
    client.post(f"{API}/tokens", json={"name": "r1", "scope": "read"})
    client.post(f"{API}/tokens", json={"name": "c1", "scope": "ci"})
    page = client.get(f"{API}/tokens", params={"scope": "ci"}).json()
    assert [row["name"] for row in page["data"]] == ["c1"]
    assert page["count"] == 1
