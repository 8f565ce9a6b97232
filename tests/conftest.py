"""Fixtures for the real services every integration test uses: Postgres and Redis on this machine.

A missing service fails the test (never skips it): CI must not pass by testing nothing.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from collections.abc import Iterator

import pytest

POSTGRES_ADMIN_DSN = os.environ.get(
    "HYBRIDTRAIN_TEST_POSTGRES", "postgresql://postgres@127.0.0.1:5432/postgres"
)
REDIS_URL = os.environ.get("HYBRIDTRAIN_TEST_REDIS", "redis://127.0.0.1:6379/9")


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
    """The URL of the real Redis on this machine, on a database the tests may flush (this
    test worker's own: tests/redis_dbs.py)."""
    import redis

    from tests.redis_dbs import on_database

    url = on_database(REDIS_URL, 9)  # the databases are the suite's to choose, whatever REDIS_URL's is
    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis is required at {url}: {exc}")
    client.flushdb()
    return url


@pytest.fixture(scope="session")
def s3_server():
    """moto's S3 server, a real process over HTTP, for the whole session (tests/object_store.py)."""
    from tests.object_store import moto_server

    with moto_server() as server:
        yield server


# The folders whose files take longest, first (a file of tests/trainer/ takes up to 3 minutes,
# most of tests/app/'s a few seconds): the workers end together when the short files come last.
SLOW_FIRST = ("tests/trainer/", "tests/docs/", "tests/runs/", "tests/testbed/", "tests/agents/", "tests/examples/")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`make test` spreads the suite over two pytest-xdist workers (`--dist loadgroup`), meant a
    file at a time so that a module's fixtures start once, the testbed's files in one worker as
    every testbed takes 10.213.0.0/16 and the cgroup tree. Slow folders go first (a stable sort:
    a file's own order stays). `pytest_collection_finish` below makes the groups take effect."""
    def rank(item: pytest.Item) -> int:
        return next((i for i, folder in enumerate(SLOW_FIRST) if item.nodeid.startswith(folder)), len(SLOW_FIRST))

    items.sort(key=rank)
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        group = "testbed" if path.startswith("tests/testbed/") else path
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Carry xdist's group suffix into the node id. xdist 3.8 marks a group by rewriting
    `item._nodeid` ("...::test@group"), which pytest 9.2 no longer reads (the id is `item._id`),
    so without this every test was scheduled alone: a module's fixtures started on both workers
    and testbed files ran side by side. Runs before xdist's own hook sends the ids."""
    from _pytest.nodeid import coerce_node_id

    for item in session.items:
        grouped = item.__dict__.get("_nodeid")
        if grouped is not None and grouped != item.nodeid:
            item._id = coerce_node_id(grouped)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Refuse items that share a node id: xdist schedules by node id and would run the first of
    them alone. Schemathesis names each operation's item (`test[GET /healthz]`) but gives all one
    node id, so its file runs in `make test`'s second, one-process pass (ONE_PROCESS_TESTS)."""
    shared = sorted(nodeid for nodeid, n in Counter(ids).items() if n > 1)
    if shared:
        raise pytest.UsageError(f"under xdist only the first item of each of these node ids would run: {shared}; "
                                "run their files without -n (the Makefile's ONE_PROCESS_TESTS)")
