"""Migration 0020: runs gain an empty final bill on Postgres, and lose it (and only it) on the
way down."""

from __future__ import annotations

import uuid

from sqlalchemy import create_engine, inspect, text

from app import db

_BILL = ("billed_usd", "billed_unpriced", "billed_at")


def _run(url: str) -> int:
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            return connection.execute(text(
                "INSERT INTO runs (name, status, strategy, task, task_args, global_batch_size, seed, allocation, "
                "device, compression, local_sgd, metrics_token_hash, created_by, created_at, updated_at, "
                "checkpoint_every, checkpoint_every_s, max_restarts, restarts, min_workers, min_workers_wait_s) "
                "VALUES ('r', 'succeeded', 'ps-bz-gc', 't:t', '{}', 64, 0, 'equal', 'cpu', '{}', '{}', :h, 'admin', "
                "now(), now(), 0, 0, 0, 0, 1, 0) RETURNING id"), {"h": uuid.uuid4().hex * 2}).scalar_one()
    finally:
        engine.dispose()


def _columns(url: str) -> set[str]:
    engine = create_engine(url)
    try:
        return {c["name"] for c in inspect(engine).get_columns("runs")}
    finally:
        engine.dispose()


def _row(url: str, sql: str, run_id: int) -> tuple:
    engine = create_engine(url)
    try:
        with engine.begin() as connection:
            return tuple(connection.execute(text(sql), {"i": run_id}).one())
    finally:
        engine.dispose()


def test_0020_gives_stored_runs_no_final_bill(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0019")
    run_id = _run(scratch_postgres_url)

    db.upgrade(scratch_postgres_url, "0020")

    assert _row(scratch_postgres_url, "SELECT billed_usd, billed_unpriced, billed_at FROM runs WHERE id = :i",
                run_id) == (None, None, None)


def test_0020_keeps_a_bill_to_the_micro_dollar(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0020")
    run_id = _run(scratch_postgres_url)

    stored = _row(scratch_postgres_url, "UPDATE runs SET billed_usd = 1234567.123456, billed_unpriced = true, "
                  "billed_at = now() WHERE id = :i RETURNING billed_usd::text, billed_unpriced", run_id)

    assert stored == ("1234567.123456", True)


def test_0020_downgrade_drops_the_final_bills_and_keeps_the_runs(scratch_postgres_url: str) -> None:
    db.upgrade(scratch_postgres_url, "0020")
    run_id = _run(scratch_postgres_url)
    _row(scratch_postgres_url, "UPDATE runs SET billed_usd = 1.5, billed_unpriced = false, billed_at = now() "
         "WHERE id = :i RETURNING id", run_id)

    db.downgrade(scratch_postgres_url, "0019")

    assert db.current_revision(scratch_postgres_url) == "0019"
    assert not _columns(scratch_postgres_url) & set(_BILL)
    assert _row(scratch_postgres_url, "SELECT name, status FROM runs WHERE id = :i", run_id) == ("r", "succeeded")
