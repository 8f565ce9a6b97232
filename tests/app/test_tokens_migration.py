"""Migration 0012 on Postgres: tokens gain an expiry, an action list and their last use; tokens
stored before keep working as they did; the downgrade takes the columns away again."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect, text

from app import db

_NEW = {"expires_at", "actions", "last_used_at"}


def _columns(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("api_tokens")}
    finally:
        engine.dispose()


def _execute(url: str, sql: str) -> list[tuple]:
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            result = connection.execute(text(sql))
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def test_0012_keeps_earlier_tokens_unlimited_and_never_expiring(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0011")
    _execute(scratch_postgres_url, "INSERT INTO api_tokens (name, scope, token_hash, prefix, created_at) "
                                   "VALUES ('ci', 'ci', repeat('a', 64), 'htk_aaaaaaaa', now())")
    db.upgrade(scratch_postgres_url, "0012")
    rows = _execute(scratch_postgres_url, "SELECT name, expires_at, actions, last_used_at FROM api_tokens")
    assert rows == [("ci", None, None, None)]


def test_0012_downgrade_removes_the_new_columns(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0012")
    db.downgrade(scratch_postgres_url, "0011")
    assert db.current_revision(scratch_postgres_url) == "0011"
    assert not _NEW & _columns(scratch_postgres_url)
