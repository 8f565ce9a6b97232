"""The embedded SQLite database: a run's write commits beside a page's read, and a writer waits
for another's lock rather than failing at once."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import text

from app.config import Settings
from app.db import SQLITE_BUSY_TIMEOUT_S, make_engine


def _engine(tmp_path: Path):
    return make_engine(Settings(database_url=f"sqlite:///{tmp_path / 'hybridtrain.db'}"))


def test_a_write_commits_while_a_page_is_still_reading(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    try:
        with engine.begin() as conn:
            conn.execute(text("CREATE TABLE t (x INTEGER)"))
            conn.execute(text("INSERT INTO t VALUES (1), (2), (3)"))
        with engine.connect() as reader:
            rows = reader.execute(text("SELECT x FROM t"))
            assert rows.fetchone() == (1,)  # the read is still open: it holds its snapshot
            with engine.begin() as writer:  # with a rollback journal this waits for the reader
                writer.execute(text("INSERT INTO t VALUES (4)"))
            assert [r[0] for r in rows.fetchall()] == [2, 3]
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM t")).scalar_one() == 4
    finally:
        engine.dispose()


def test_connections_wait_for_a_lock_and_journal_ahead(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar_one() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar_one() == SQLITE_BUSY_TIMEOUT_S * 1000
            assert conn.execute(text("PRAGMA foreign_keys")).scalar_one() == 1
    finally:
        engine.dispose()
