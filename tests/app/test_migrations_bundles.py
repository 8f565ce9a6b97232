"""Migration 0006: bundles and task profiles go up and down on Postgres."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect

from app import db

_TABLES = {"bundles", "task_profiles"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def test_0006_upgrade_creates_bundles_and_task_profiles(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0006")
    assert _TABLES <= _tables(scratch_postgres_url)


def test_0006_downgrade_drops_bundles_and_task_profiles(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0006")
    db.downgrade(scratch_postgres_url, "0005")
    assert db.current_revision(scratch_postgres_url) == "0005"
    assert not _TABLES & _tables(scratch_postgres_url)
