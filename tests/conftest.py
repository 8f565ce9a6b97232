"""Fixtures for the real services every integration test uses: Postgres and Redis on this machine.

A missing service fails the test (never skips it): CI must not pass by testing nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

POSTGRES_ADMIN_DSN = os.environ.get(
    "HYBRIDTRAIN_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
# Under pytest-xdist (`make test` runs two processes) each process flushes and uses a Redis
# database of its own (HYBRIDTRAIN_TEST_REDIS names the first's); the suites' private databases
# (10, 11, 12, 14) stay with their folder, which runs in one process (see below).
_OTHER_REDIS_DBS = {"gw1": 13, "gw2": 15}
_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
REDIS_URL = os.environ.get("HYBRIDTRAIN_TEST_REDIS", "redis://127.0.0.1:6379/9")
if _WORKER != "gw0":
    REDIS_URL = REDIS_URL.rsplit("/", 1)[0] + f"/{_OTHER_REDIS_DBS.get(_WORKER, -1)}"


# The longest folders first, so that the two processes end together (xdist hands out groups in
# the order collected); the rest follow in their own order.
_LONGEST_FIRST = ("trainer", "app", "runs", "docs", "testbed", "examples", "agents")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep each top folder of tests (agents, app, runs, trainer, testbed, ...) in one xdist
    process (`--dist loadgroup`): a folder's tests share its private Redis database, the
    testbed's its namespaces and cgroups, and module fixtures are built once."""

    def folder(item: pytest.Item) -> str:
        parts = item.path.relative_to(config.rootpath / "tests").parts
        return parts[0] if len(parts) > 1 else "tests"

    for item in items:
        item.add_marker(pytest.mark.xdist_group(folder(item)))
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(folder(item), len(rank)))


def _sqlalchemy_url(dsn: str) -> str:
    return dsn.replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A fresh, empty Postgres database for this test session, dropped at the end."""
    import psycopg

    name = f"hybridtrain_test_{uuid.uuid4().hex[:12]}"
    try:
        admin = psycopg.connect(POSTGRES_ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        pytest.fail(f"Postgres is required at {POSTGRES_ADMIN_DSN}: {exc}")
    with admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    base = POSTGRES_ADMIN_DSN.rsplit("/", 1)[0]
    try:
        yield _sqlalchemy_url(f"{base}/{name}")
    finally:
        with psycopg.connect(POSTGRES_ADMIN_DSN, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def redis_url() -> str:
    """The URL of the real Redis on this machine, on a database the tests may flush."""
    import redis

    if REDIS_URL.endswith("/-1"):
        pytest.fail(f"no Redis database is set aside for xdist process {_WORKER}: run at most 3 (-n 3)")
    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {REDIS_URL}: {exc}")
    client.flushdb()
    return REDIS_URL


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, a real process over HTTP, for the whole session (tests/object_store.py)."""
    from tests.object_store import moto_server

    with moto_server() as server:
        yield server
