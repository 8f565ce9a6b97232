"""Migration 0006: bundles and task profiles go up and down on Postgres and match the models."""

from __future__ import annotations

from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect

from app import db
from app.models import Base

_TABLES = {"bundles", "task_profiles"}


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _differences_in_new_tables(url: str) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            diffs = compare_metadata(context, Base.metadata)
    finally:
        engine.dispose()
    return [d for d in diffs if any(t in repr(d) for t in _TABLES)]


def test_0006_upgrade_creates_bundles_and_task_profiles(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0006")
    assert _TABLES <= _tables(scratch_postgres_url)


def test_0006_downgrade_drops_bundles_and_task_profiles(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0006")
    db.downgrade(scratch_postgres_url, "0005")
    assert db.current_revision(scratch_postgres_url) == "0005"
    assert not _TABLES & _tables(scratch_postgres_url)


def test_0006_tables_match_the_models(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url)
    assert _differences_in_new_tables(scratch_postgres_url) == []
