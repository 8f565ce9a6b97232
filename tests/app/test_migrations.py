"""The schema comes only from Alembic: migrations go up, down and up again, and match the models."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from app import db
from app.models import Base


def _sqlite_url(tmp_path: Path) -> str:
    return f"sqlite+pysqlite:///{tmp_path}/nested/folder/hybridtrain.db"


@pytest.fixture(params=["postgres", "sqlite"])
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgres":
        return request.getfixturevalue("scratch_postgres_url")
    return _sqlite_url(tmp_path)


def _tables(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def _differences(url: str) -> list[object]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_migrations_upgrade_downgrade_and_upgrade_again(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    assert db.current_revision(empty_database_url) == db.head_revision()
    assert _tables(empty_database_url) == set(Base.metadata.tables)

    db.downgrade(empty_database_url, "base")
    assert db.current_revision(empty_database_url) is None
    assert _tables(empty_database_url) == set()

    db.upgrade(empty_database_url)
    assert db.current_revision(empty_database_url) == db.head_revision()


def test_migrated_schema_matches_the_models(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    assert _differences(empty_database_url) == []


def test_upgrade_creates_the_sqlite_folder(tmp_path: Path) -> None:
    url = _sqlite_url(tmp_path)
    db.upgrade(url)
    assert (tmp_path / "nested" / "folder" / "hybridtrain.db").is_file()


def test_migrations_seed_the_catalog_and_table1_prices(empty_database_url: str) -> None:
    db.upgrade(empty_database_url)
    engine = create_engine(empty_database_url)
    try:
        with engine.connect() as connection:
            gpus = connection.execute(text("SELECT count(*) FROM gpu_models WHERE seeded")).scalar()
            instances = connection.execute(text("SELECT count(*) FROM instance_prices")).scalar()
            egress = connection.execute(text("SELECT count(*) FROM egress_prices")).scalar()
    finally:
        engine.dispose()
    assert gpus == 13
    assert instances == 3  # T4 on GC, AWS and Azure
    assert egress == 3 * 9  # Table 1's seven traffic rows, plus intra-zone and internet


def test_downgrading_the_seed_removes_the_seeded_rows(empty_database_url: str) -> None:
    db.upgrade(empty_database_url, "0002")
    db.downgrade(empty_database_url, "0001")
    engine = create_engine(empty_database_url)
    try:
        with engine.connect() as connection:
            assert connection.execute(text("SELECT count(*) FROM gpu_models")).scalar() == 0
    finally:
        engine.dispose()


_OLD_RUN = (
    "INSERT INTO runs (name, status, strategy, model, dataset, global_batch_size, lr, max_steps, "
    "target_accuracy, seed, allocation, device, compression, metrics_token_hash, created_by) VALUES "
    "(:name, 'succeeded', 'ps-bz-gc', :model, :dataset, 64, :lr, 200, :target, 0, 'flops', 'auto', "
    "'{}', :token, 'admin')"
)


def _insert_old_runs(url: str) -> None:
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(text(_OLD_RUN), [
                {"name": "a", "model": "resnet18", "dataset": "shapes", "lr": 0.05, "target": 0.9, "token": "t1"},
                {"name": "b", "model": "smallcnn", "dataset": "digits", "lr": 0.1, "target": None, "token": "t2"},
            ])
    finally:
        engine.dispose()


def _rows(url: str, sql: str) -> list[tuple]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return [tuple(r) for r in connection.execute(text(sql))]
    finally:
        engine.dispose()


def test_run_tasks_migration_turns_model_and_data_set_into_a_task(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0006")
    _insert_old_runs(scratch_postgres_url)

    db.upgrade(scratch_postgres_url, "0007")

    assert _rows(scratch_postgres_url, "SELECT name, task, task_args, target, max_steps FROM runs ORDER BY name") == [
        ("a", "hybridtrain.tasks.shapes:resnet18", {"lr": 0.05}, "accuracy>=0.9", 200),
        ("b", "hybridtrain.tasks.digits:smallcnn", {"lr": 0.1}, None, 200),
    ]


def test_run_tasks_migration_downgrades_with_the_data(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0006")
    _insert_old_runs(scratch_postgres_url)
    db.upgrade(scratch_postgres_url, "0007")
    engine = create_engine(scratch_postgres_url)
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "UPDATE runs SET task = 'mycode.train:task', max_steps = NULL, target = 'val_loss<=0.3' WHERE name = 'b'"))
    finally:
        engine.dispose()

    db.downgrade(scratch_postgres_url, "0006")

    assert _rows(scratch_postgres_url, "SELECT name, model, dataset, lr, target_accuracy, max_steps FROM runs ORDER BY name") == [
        ("a", "resnet18", "shapes", 0.05, 0.9, 200),
        ("b", "custom", "custom", 0.1, None, 300),
    ]
