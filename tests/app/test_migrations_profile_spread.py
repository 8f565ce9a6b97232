"""Migration 0016: a task profile's spread and repeats go up and down on Postgres;
profiles stored before keep their figures with neither."""

from __future__ import annotations

from sqlalchemy import create_engine, inspect, text

from app import db


def _columns(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("task_profiles")}
    finally:
        engine.dispose()


def test_0016_adds_spread_and_repeats_and_keeps_older_profiles(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0015")
    engine = create_engine(scratch_postgres_url)
    try:
        with engine.begin() as connection:
            site = connection.execute(text(
                "INSERT INTO sites (name, kind, provider, continent) "
                "VALUES ('s', 'onprem', 'onprem', 'europe') RETURNING id")).scalar_one()
            node = connection.execute(text(
                "INSERT INTO nodes (name, site_id, status, spot, labels, join_token_hash) "
                "VALUES ('n', :site, 'online', false, '{}', 'x') RETURNING id"),
                {"site": site}).scalar_one()
            connection.execute(text(
                "INSERT INTO task_profiles (node_id, task_key, task, task_args, batch_size, device, status, "
                "samples_per_s, created_by, created_at) VALUES (:node, :key, 't:t', '{}', 32, 'cpu', 'done', "
                "512.0, 'admin', now())"), {"node": node, "key": "0" * 64})
        db.upgrade(scratch_postgres_url, "0016")
        assert {"spread", "repeats"} <= _columns(scratch_postgres_url)
        with engine.connect() as connection:
            row = connection.execute(text("SELECT samples_per_s, spread, repeats FROM task_profiles")).one()
        assert tuple(row) == (512.0, None, None)
    finally:
        engine.dispose()


def test_0016_downgrade_drops_spread_and_repeats(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0016")
    db.downgrade(scratch_postgres_url, "0015")
    assert db.current_revision(scratch_postgres_url) == "0015"
    assert not {"spread", "repeats"} & _columns(scratch_postgres_url)
