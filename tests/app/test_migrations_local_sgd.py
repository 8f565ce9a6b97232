"""Migration 0017: runs' local SGD options move out of `compression` into their own column on
Postgres, and back on the way down."""

from __future__ import annotations

import json
import uuid

from sqlalchemy import create_engine, text

from app import db

_OLD = {"sync_every": 10, "outer_lr": 0.5, "value_dtype": "fp16"}


def _run_with(url: str, compression: dict) -> int:
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            return connection.execute(text(
                "INSERT INTO runs (name, status, strategy, task, task_args, global_batch_size, seed, allocation, "
                "device, compression, metrics_token_hash, created_by, created_at, updated_at, checkpoint_every, "
                "checkpoint_every_s, max_restarts, restarts, min_workers, min_workers_wait_s) VALUES ('r', 'queued', "
                "'diloco', 't:t', '{}', 64, 0, 'equal', 'cpu', CAST(:c AS jsonb), :h, 'admin', now(), now(), 0, 0, "
                "0, 0, 1, 0) RETURNING id"), {"c": json.dumps(compression), "h": uuid.uuid4().hex * 2}).scalar_one()
    finally:
        engine.dispose()


def _row(url: str, run_id: int, columns: str) -> tuple:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return tuple(connection.execute(text(f"SELECT {columns} FROM runs WHERE id = :i"), {"i": run_id}).one())
    finally:
        engine.dispose()


def test_0017_moves_the_outer_knobs_of_stored_runs_into_local_sgd(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0016")
    moved, plain = _run_with(scratch_postgres_url, _OLD), _run_with(scratch_postgres_url, {"density": 0.02})

    db.upgrade(scratch_postgres_url, "0017")

    assert _row(scratch_postgres_url, moved, "compression, local_sgd") == (
        {"value_dtype": "fp16"}, {"sync_every": 10, "outer_lr": 0.5})
    assert _row(scratch_postgres_url, plain, "compression, local_sgd") == ({"density": 0.02}, {})


def test_0017_downgrade_puts_them_back_under_compression(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0016")
    run_id = _run_with(scratch_postgres_url, _OLD)
    db.upgrade(scratch_postgres_url, "0017")

    db.downgrade(scratch_postgres_url, "0016")

    assert db.current_revision(scratch_postgres_url) == "0016"
    assert _row(scratch_postgres_url, run_id, "compression") == (_OLD,)
