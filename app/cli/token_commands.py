"""`hybridtrain tokens create|list|delete`: API tokens, managed on the control plane's host.

These talk to the database directly, not to the API: the first token has to come from
somewhere, and whoever can read the database's settings is the control plane's admin anyway.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

_DURATION = re.compile(r"^(\d{1,5})([hdw])$")
_UNITS = {"h": timedelta(hours=1), "d": timedelta(days=1), "w": timedelta(weeks=1)}


class CommandError(Exception):
    """A message for the user, and the exit status to leave with."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def parse_duration(text: str) -> timedelta:
    """`30d`, `12h` or `2w` as a timedelta; ValueError naming the accepted forms otherwise."""
    match = _DURATION.match(text.strip())
    if not match or int(match.group(1)) == 0:
        raise ValueError(f"{text!r} is not a duration such as 30d, 12h or 2w")
    return int(match.group(1)) * _UNITS[match.group(2)]


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `tokens` (and `token`, when no other command holds that name)."""
    from app.token_limits import ACTIONS

    # `token create` (app/cli/commands.py) came first; it keeps its name until it goes.
    aliases = [] if "token" in sub.choices else ["token"]
    parser = sub.add_parser("tokens", aliases=aliases, help="manage API tokens (on the server's host)")
    tokens = parser.add_subparsers(dest="tokens_command", required=True)

    create = tokens.add_parser("create", help="create a token and print its secret (shown only this once)")
    create.add_argument("--name", required=True)
    create.add_argument("--scope", required=True, choices=["admin", "ci", "read"])
    create.add_argument("--expires-in", metavar="DURATION", help="e.g. 30d, 12h or 2w (default: never)")
    create.add_argument(
        "--action", dest="actions", action="append", choices=ACTIONS, metavar="ACTION",
        help=f"the only changes it may make, repeatable (default: whatever its scope allows): {', '.join(ACTIONS)}",
    )
    create.set_defaults(func=_run(_create))

    listing = tokens.add_parser("list", help="list tokens: scope, expiry, actions, last use")
    listing.add_argument("--unused-days", type=int, metavar="N", help="only tokens not used for N days")
    listing.set_defaults(func=_run(_list))

    delete = tokens.add_parser("delete", help="revoke a token by its id")
    delete.add_argument("token_id", type=int)
    delete.set_defaults(func=_run(_delete))


def _run(body):  # type: ignore[no-untyped-def]
    def handler(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except CommandError as exc:
            print(f"hybridtrain: {exc}", file=sys.stderr)
            return exc.status

    return handler


@contextmanager
def _database() -> Iterator[Session]:
    from sqlalchemy.exc import OperationalError

    from app import db
    from app.config import get_settings

    settings = get_settings()
    try:
        revision = db.current_revision(settings.database_url)
    except OperationalError as exc:
        raise CommandError(f"cannot reach the database: {exc.orig}") from exc
    if revision != db.head_revision():
        raise CommandError("the database is not migrated; run `hybridtrain db upgrade`")
    engine = db.make_engine(settings)
    try:
        with db.session_scope(db.make_sessionmaker(engine)) as session:
            yield session
    finally:
        engine.dispose()


def _create(args: argparse.Namespace) -> int:
    from pydantic import TypeAdapter, ValidationError

    from app.errors import DuplicateError, InvalidFieldError
    from app.models import TokenScope
    from app.models.base import utcnow
    from app.queries.tokens import create_token
    from app.schemas.common import Name

    try:
        name = TypeAdapter(Name).validate_python(args.name)
    except ValidationError as exc:
        raise CommandError(f"invalid --name: {exc.errors()[0]['msg']}", status=2) from exc
    now = utcnow()
    try:
        expires_at = now + parse_duration(args.expires_in) if args.expires_in else None
    except ValueError as exc:
        raise CommandError(f"invalid --expires-in: {exc}", status=2) from exc
    try:
        with _database() as session:
            token, secret = create_token(
                session, name=name, scope=TokenScope(args.scope), expires_at=expires_at,
                actions=args.actions, now=now,
            )
            summary = _describe(token.scope, token.expires_at, token.actions)
    except DuplicateError as exc:
        raise CommandError(exc.message) from exc
    except InvalidFieldError as exc:
        raise CommandError(f"invalid --{exc.field.replace('_', '-')}: {exc.message}", status=2) from exc
    print(f"# token '{name}' ({summary}); the secret is shown once:", file=sys.stderr)
    print(secret)
    return 0


def _describe(scope: object, expires_at: object, actions: list[str] | None) -> str:
    expiry = f"expires {expires_at:%Y-%m-%d %H:%M} UTC" if expires_at else "never expires"
    limit = f"limited to {', '.join(actions)}" if actions is not None else "no action limit"
    return f"scope {scope}, {expiry}, {limit}"


def _list(args: argparse.Namespace) -> int:
    from app.models.base import utcnow
    from app.queries.tokens import list_tokens

    if args.unused_days is not None and args.unused_days < 1:
        raise CommandError("invalid --unused-days: must be 1 or more", status=2)
    now = utcnow()
    with _database() as session:
        rows, _ = list_tokens(session, skip=0, limit=1000, unused_days=args.unused_days, now=now)
        lines = [
            (
                str(t.id), t.name, str(t.scope), t.prefix,
                ("EXPIRED " if t.expired(now) else "") + (f"{t.expires_at:%Y-%m-%d %H:%M}" if t.expires_at else "never"),
                f"{t.last_used_at:%Y-%m-%d %H:%M}" if t.last_used_at else "never",
                ",".join(t.actions) if t.actions is not None else "-",
            )
            for t in rows
        ]
    header = ("ID", "NAME", "SCOPE", "PREFIX", "EXPIRES (UTC)", "LAST USED (UTC)", "ACTIONS")
    widths = [max(len(row[i]) for row in (header, *lines)) for i in range(len(header))]
    for row in (header, *lines):
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    return 0


def _delete(args: argparse.Namespace) -> int:
    from app.errors import NotFoundError
    from app.queries.tokens import delete_token

    try:
        with _database() as session:
            delete_token(session, token_id=args.token_id)
    except NotFoundError as exc:
        raise CommandError(exc.message) from exc
    print(f"token {args.token_id} deleted: requests bearing it are refused from now on", file=sys.stderr)
    return 0
