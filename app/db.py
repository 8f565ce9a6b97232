"""Database engines and sessions, and the Alembic calls that own the schema."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic_core import from_json
from sqlalchemy import Engine, create_engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from sqlalchemy.pool import NullPool

from app.config import Settings

REPO_ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_INI = REPO_ROOT / "alembic.ini"
MIGRATIONS_DIR = REPO_ROOT / "migrations"


# How long a connection waits for another's write lock before "database is locked" (a 503): the
# embedded control plane, its agent's reports and a run's metrics write to one file, and on a
# loaded host sqlite3's default 5 s was seen to run out.
SQLITE_BUSY_TIMEOUT_S = 30.0


def _configure_sqlite(dbapi_connection, _record) -> None:  # type: ignore[no-untyped-def]
    # SQLite ignores REFERENCES unless asked per connection; without this a site with nodes
    # could be deleted. WAL lets a write commit while pages are still reading.
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


def ensure_sqlite_directory(database_url: str) -> None:
    """Create the folder of a file-backed SQLite database (./var/ by default) if missing."""
    url = make_url(database_url)
    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)


def make_engine(settings: Settings) -> Engine:
    """An engine for `settings.database_url`, tuned per backend."""
    url = settings.database_url
    if settings.is_sqlite:
        ensure_sqlite_directory(url)
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S},
            json_deserializer=from_json,
        )
        event.listen(engine, "connect", _configure_sqlite)
        return engine
    # Sized with the admission lanes (app/capacity.py): an admitted request never waits here.
    return create_engine(
        url,
        pool_size=settings.db_pool_size,
        max_overflow=0,
        pool_timeout=settings.db_pool_timeout_s,
        pool_pre_ping=True,
        connect_args={"connect_timeout": 5},
        # JSON columns read with pydantic-core's parser, which gives what `json.loads` gives
        # ten times faster: a page of 100 nodes decodes 100 label objects.
        json_deserializer=from_json,
    )


def make_health_engine(settings: Settings, main: Engine) -> Engine:
    """The engine /healthz probes with: one connection of its own, so a busy pool cannot make
    the health check wait (SQLite: the main engine)."""
    if settings.is_sqlite:
        return main
    return create_engine(
        settings.database_url,
        pool_size=1,
        max_overflow=0,
        pool_timeout=2,
        pool_pre_ping=True,
        # A dead server should make /healthz answer 503 promptly, not hang on TCP.
        connect_args={"connect_timeout": 2},
    )


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    """Sessions that keep loaded objects usable after commit (responses are built after it)."""
    return sessionmaker(bind=engine, expire_on_commit=False, autoflush=True)


@contextmanager
def session_scope(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A unit of work outside a request (CLI, tasks): commit on success, roll back on error."""
    with factory() as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def database_is_reachable(engine: Engine) -> bool:
    """Whether a trivial query succeeds within the pool's connect timeout."""
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any failure means "not reachable" to the health check
        return False
    return True


def alembic_config(database_url: str):  # type: ignore[no-untyped-def]
    """The Alembic configuration of this repository, pointed at `database_url`."""
    from alembic.config import Config

    config = Config(str(ALEMBIC_INI))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    # env.py reads this attribute; without it env.py falls back to get_settings().
    config.attributes["database_url"] = database_url
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    """Apply migrations up to `revision` (creating ./var/ for the embedded SQLite database)."""
    from alembic import command

    ensure_sqlite_directory(database_url)
    with _migration_lock(database_url):
        command.upgrade(alembic_config(database_url), revision)


# Any fixed number: it names the migrations' Postgres advisory lock ("htmg").
MIGRATION_LOCK_KEY = 0x68746D67


@contextmanager
def _migration_lock(database_url: str) -> Iterator[None]:
    # Replicas started together each migrate first: the second waits, then finds it done,
    # instead of both creating the same tables.
    if not database_url.startswith("postgresql"):
        yield
        return
    engine = create_engine(database_url, poolclass=NullPool)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:key)"), {"key": MIGRATION_LOCK_KEY})
            connection.commit()
            try:
                yield
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": MIGRATION_LOCK_KEY})
                connection.commit()
    finally:
        engine.dispose()


def downgrade(database_url: str, revision: str) -> None:
    """Revert migrations down to `revision` ("base" removes every table)."""
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)


def current_revision(database_url: str) -> str | None:
    """The revision the database is at, or None before the first migration."""
    from alembic.runtime.migration import MigrationContext

    ensure_sqlite_directory(database_url)
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def head_revision() -> str | None:
    """The newest revision in migrations/."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
