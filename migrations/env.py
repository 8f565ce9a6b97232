"""Alembic environment: the URL comes from the caller (app.db) or from app.config's settings."""

from __future__ import annotations

from logging.config import fileConfig

from alembic import context
from sqlalchemy import create_engine, pool

from app.config import get_settings
from app.models import Base

config = context.config
# Only the `alembic` command line configures logging; app.db (which passes the URL in
# `attributes`) leaves the host program's logging alone.
if config.config_file_name is not None and "database_url" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _database_url() -> str:
    return config.attributes.get("database_url") or get_settings().database_url


def _configure(**kwargs: object) -> None:
    url = _database_url()
    context.configure(
        target_metadata=target_metadata,
        compare_type=True,
        # SQLite cannot ALTER most things; batch mode recreates the table instead.
        render_as_batch=url.startswith("sqlite"),
        **kwargs,  # type: ignore[arg-type]
    )


def run_migrations_offline() -> None:
    _configure(url=_database_url(), literal_binds=True, dialect_opts={"paramstyle": "named"})
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    url = _database_url()
    connect_args = {"check_same_thread": False} if url.startswith("sqlite") else {}
    engine = create_engine(url, poolclass=pool.NullPool, connect_args=connect_args)
    with engine.connect() as connection:
        if url.startswith("sqlite"):
            # Batch mode copies tables; foreign keys would fire half-way through the copy.
            connection.exec_driver_sql("PRAGMA foreign_keys=OFF")
            # End SQLAlchemy's implicit transaction so Alembic's own one commits the migration.
            connection.commit()
        _configure(connection=connection)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
