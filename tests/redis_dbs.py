"""The Redis databases of the suites, apart for each pytest-xdist worker.

`make test` runs the suite in two workers against the one Redis on this machine. Suites flush
their database when they start, and their agents consume `node.<id>` queues whose node ids
both workers' fresh databases reuse, so each worker needs databases of its own: a suite names
a database of 9-15, worker gw0 (and a run without xdist) uses it as it is, worker gw1 the same
less 8 (1-7). Database 0, where a deployment's broker URL points by default, is never touched.
"""

from __future__ import annotations

import os

FIRST, LAST, WORKERS = 9, 15, 2


def worker_index() -> int:
    """This process's pytest-xdist worker (0 for gw0, or without xdist)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker.removeprefix("gw"))
    if index >= WORKERS:
        raise RuntimeError(f"the suite shares one Redis among at most {WORKERS} workers, not {worker}'s")
    return index


def database(db: int) -> int:
    """The database this worker uses for a suite's database `db` (9-15)."""
    if not FIRST <= db <= LAST:
        raise ValueError(f"suites take Redis databases {FIRST}-{LAST}, not {db}")
    return db - (LAST - FIRST + 2) * worker_index()


def on_database(redis_url: str, db: int) -> str:
    """`redis_url` on this worker's database for `db`."""
    return redis_url.rsplit("/", 1)[0] + f"/{database(db)}"


def private_redis(redis_url: str, db: int) -> str:
    """`redis_url` on this worker's database for `db`, flushed: other suites flush the shared
    database at their start, and agents of theirs consuming `node.<id>` there would take this
    suite's orders."""
    import redis

    url = on_database(redis_url, db)
    redis.Redis.from_url(url).flushdb()
    return url
