"""Subcommands of `hybridtrain` that belong to the control plane (server, db, token, ...).

Each `_add_*` function adds one subcommand whose handler is set with `set_defaults(func=...)`;
handlers import what they need lazily so `hybridtrain --help` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add every control-plane subcommand to the `hybridtrain` parser."""
    _add_server(sub)
    _add_db(sub)
    from testbed.cli import register as register_testbed  # testbed, bench paper
    from app.cli.run_commands import register as register_runs  # runs, nodes, local
    from app.cli.run_commands import register_bundles, register_plans

    register_runs(sub)
    register_bundles(sub)
    register_plans(sub)
    from app.cli.cluster_commands import register_clusters

    register_clusters(sub)
    from app.cli.dataset_commands import register_datasets

    register_datasets(sub)
    from app.cli.profile_commands import register_profiles

    register_profiles(sub)

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
        "--workers", type=_positive_int, default=1,
        help="server processes sharing the port (default 1; more than 1 needs Postgres)",
    )
    parser.add_argument(
        "--access-log", action=argparse.BooleanOptionalAction, default=True,
        help="log every request (default: on)",
    )
    parser.set_defaults(func=_run_server)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {number}")
    return number


def _run_server(args: argparse.Namespace) -> int:
    import uvicorn

    from app import db
    from app.config import get_settings
    from app.main import create_app

    settings = get_settings()
    if args.workers > 1 and settings.is_sqlite:
        # SQLite's run-state lock is a lock of one process (app/lifecycle/lock.py): two
        # processes could both start a run on the same GPU.
        print("hybridtrain server: --workers above 1 needs Postgres (set DATABASE_URL); "
              "on SQLite the control plane is one process", file=sys.stderr)
        return 2
    db.upgrade(settings.database_url)
    options: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": args.access_log,
        # Forwarded headers are honoured only from HYBRIDTRAIN_TRUSTED_PROXIES (app/main.py);
        # uvicorn's own default would trust any client on 127.0.0.1.
        "proxy_headers": False,
        "timeout_keep_alive": settings.keep_alive_s,
    }
    if args.workers == 1:
        uvicorn.run(create_app(settings), **options)
    else:
        # uvicorn's supervisor binds the port once and spawns N processes that accept on it;
        # each builds its own app from the same environment (docs/deploy.md, "Several processes").
        uvicorn.run("app.main:create_app", factory=True, workers=args.workers, **options)
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
