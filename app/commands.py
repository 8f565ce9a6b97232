"""Subcommands of `hybridtrain` that belong to the control plane (server, db, token, ...).

Each `_add_*` function adds one subcommand whose handler is set with `set_defaults(func=...)`;
handlers import what they need lazily so `hybridtrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add every control-plane subcommand to the `hybridtrain` parser."""
    _add_server(sub)
    _add_db(sub)
    _add_token(sub)
    from testbed.cli import register as register_testbed  # testbed, bench paper
    from app.run_commands import register as register_runs  # runs, nodes, local
    from app.run_commands import register_bundles, register_plans

    register_runs(sub)
    register_bundles(sub)
    register_plans(sub)

    register_testbed(sub)


def _add_server(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "server",
        help="apply migrations, then serve the control plane",
        description="Apply the database migrations, then serve the control plane with uvicorn. "
        "DATABASE_URL picks the database (default: SQLite under ./var/).",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True,
        help="log every request (default: on)",
    )
    parser.set_defaults(func=_run_server)


def _run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from app import db
    from app.config import get_settings
    from app.main import create_app

    settings = get_settings()
    db.upgrade(settings.database_url)
    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    return 0


def _add_db(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("db", help="manage the database schema (Alembic migrations)")
    db_sub = parser.add_subparsers(dest="db_command", required=True)
    upgrade = db_sub.add_parser("upgrade", help="apply migrations (default: up to head)")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(func=_db_upgrade)
    downgrade = db_sub.add_parser("downgrade", help="revert migrations down to REVISION")
    downgrade.add_argument("revision", help='a revision id, or "base" to remove every table')
    downgrade.set_defaults(func=_db_downgrade)
    current = db_sub.add_parser("current", help="print the revision the database is at")
    current.set_defaults(func=_db_current)


def _db_upgrade(args: argparse.Namespace) -> int:
    from app import db
    from app.config import get_settings

    url = get_settings().database_url
    db.upgrade(url, args.revision)
    print(f"database at revision {db.current_revision(url)}")
    return 0


def _db_downgrade(args: argparse.Namespace) -> int:
    from app import db
    from app.config import get_settings

    url = get_settings().database_url
    db.downgrade(url, args.revision)
    print(f"database at revision {db.current_revision(url)}")
    return 0


def _db_current(_: argparse.Namespace) -> int:
    from app import db
    from app.config import get_settings

    print(db.current_revision(get_settings().database_url) or "none (run `hybridtrain db upgrade`)")
    return 0


def _add_token(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser("token", help="manage API tokens")
    token_sub = parser.add_subparsers(dest="token_command", required=True)
    create = token_sub.add_parser(
        "create", help="create an API token and print its secret (shown only this once)"
    )
    create.add_argument("--name", required=True)
    create.add_argument("--scope", required=True, choices=["admin", "ci", "read"])
    create.set_defaults(func=_token_create)


def _token_create(args: argparse.Namespace) -> int:
    from pydantic import TypeAdapter, ValidationError
    from sqlalchemy.exc import OperationalError

    from app import db
    from app.config import get_settings
    from app.errors import DuplicateError
    from app.models import TokenScope
    from app.queries.tokens import create_token
    from app.schemas.common import Name

    settings = get_settings()
    try:
        name = TypeAdapter(Name).validate_python(args.name)
    except ValidationError as exc:
        print(f"hybridtrain: invalid --name: {exc.errors()[0]['msg']}", file=sys.stderr)
        return 2
    try:
        revision = db.current_revision(settings.database_url)
    except OperationalError as exc:
        print(f"hybridtrain: cannot reach the database: {exc.orig}", file=sys.stderr)
        return 1
    if revision != db.head_revision():
        print("hybridtrain: the database is not migrated; run `hybridtrain db upgrade`",
              file=sys.stderr)
        return 1
    engine = db.make_engine(settings)
    try:
        with db.session_scope(db.make_sessionmaker(engine)) as session:
            token, secret = create_token(session, name=name, scope=TokenScope(args.scope))
            scope = token.scope
    except DuplicateError as exc:
        print(f"hybridtrain: {exc.message}", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    print(f"# token '{name}' (scope {scope}); the secret is shown once:", file=sys.stderr)
    print(secret)
    return 0
