"""Fixtures of the control-plane tests: a migrated Postgres, the app, clients and factories.

Each test runs inside one outer transaction that is rolled back at its end: the handlers'
`session.commit()` only releases a savepoint, so every test starts from the freshly migrated
(seeded) database, and tests need no cleanup.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import Connection
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from app import db
from app.api.deps import get_session
from app.config import Settings
from app.main import create_app
from app.models import TokenScope
from app.queries.tokens import create_token

ADMIN_TOKEN = "test-admin-token-9c1f0e"
API = "/api/v1"


def make_settings(database_url: str, **overrides: Any) -> Settings:
    """Settings for a test app (never the environment's database)."""
    return Settings(DATABASE_URL=database_url, admin_token=ADMIN_TOKEN, **overrides)


@pytest.fixture
def scratch_postgres_url(postgres_url: str) -> Iterator[str]:
    """An empty Postgres database of its own (on the session's server), dropped afterwards."""
    name = f"hybridtrain_scratch_{uuid.uuid4().hex[:12]}"
    server = make_url(postgres_url)
    dsn = server.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield server.set(database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def migrated_postgres_url(postgres_url: str) -> str:
    """The session's Postgres database, migrated to head (so seeded) once."""
    db.upgrade(postgres_url)
    return postgres_url


@pytest.fixture(scope="session")
def admin_token() -> str:
    """The HYBRIDTRAIN_ADMIN_TOKEN of the test app."""
    return ADMIN_TOKEN


@pytest.fixture(scope="session")
def settings(migrated_postgres_url: str) -> Settings:
    return make_settings(migrated_postgres_url)


@pytest.fixture(scope="session")
def app(settings: Settings) -> FastAPI:
    """One app for the session; each test swaps its session dependency (see `client`)."""
    return create_app(settings)


@pytest.fixture
def connection(app: FastAPI) -> Iterator[Connection]:
    """A connection inside a transaction that is rolled back after the test."""
    with app.state.engine.connect() as connection:
        transaction = connection.begin()
        try:
            yield connection
        finally:
            transaction.rollback()


@pytest.fixture
def session(connection: Connection) -> Iterator[Session]:
    """The test's session; commits release savepoints of the outer, rolled-back transaction."""
    with Session(
        bind=connection, join_transaction_mode="create_savepoint", expire_on_commit=False
    ) as session:
        yield session


@pytest.fixture
def make_client(app: FastAPI, session: Session) -> Iterator[Callable[[str | None], TestClient]]:
    """Clients that send `Authorization: Bearer <token>` (no header for None)."""
    app.dependency_overrides[get_session] = lambda: session

    def _make(token: str | None) -> TestClient:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return TestClient(app, headers=headers, raise_server_exceptions=True)

    try:
        yield _make
    finally:
        app.dependency_overrides.pop(get_session, None)


@pytest.fixture
def client(make_client: Callable[[str | None], TestClient]) -> TestClient:
    """A client holding the admin token."""
    return make_client(ADMIN_TOKEN)


@pytest.fixture
def token_with_scope(session: Session) -> Callable[[TokenScope], str]:
    """Create an API token of a scope and return its secret."""

    def _make(scope: TokenScope) -> str:
        _, secret = create_token(session, name=f"{scope}-{uuid.uuid4().hex[:8]}", scope=scope)
        session.commit()
        return secret

    return _make


@pytest.fixture
def make_site(client: TestClient) -> Callable[..., dict[str, Any]]:
    """Create a site through the API (a unique cloud site unless told otherwise)."""

    def _make(**fields: Any) -> dict[str, Any]:
        body = {
            "name": f"site-{uuid.uuid4().hex[:8]}",
            "kind": "cloud",
            "provider": "gcp",
            "region": "us-west1",
            "zone": "us-west1-b",
            "continent": "north_america",
        } | fields
        response = client.post(f"{API}/sites", json=body)
        assert response.status_code == 201, response.text
        return response.json()

    return _make


@pytest.fixture
def make_node(client: TestClient, make_site: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Create a node through the API (in a new site unless `site_id` is given)."""

    def _make(**fields: Any) -> dict[str, Any]:
        if "site_id" not in fields:
            fields["site_id"] = make_site()["id"]
        body = {"name": f"node-{uuid.uuid4().hex[:8]}", "gpus": [{"model": "T4", "count": 1}]}
        response = client.post(f"{API}/nodes", json=body | fields)
        assert response.status_code == 201, response.text
        return response.json()

    return _make

