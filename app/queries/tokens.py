"""Queries of API tokens."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from app.errors import DuplicateError, InvalidFieldError, NotFoundError
from app.models import ApiToken, TokenScope
from app.models.base import utcnow
from app.queries.common import paginate
from app.security import API_TOKEN_PREFIX, SHOWN_PREFIX_LENGTH, hash_secret, new_secret

# A token's last use is written at most this often: admins look for tokens unused for days,
# and a write per request would make the token's row the hottest in the database.
LAST_USED_RESOLUTION = timedelta(minutes=1)


def create_token(
    session: Session,
    *,
    name: str,
    scope: TokenScope,
    expires_at: datetime | None = None,
    actions: Sequence[str] | None = None,
    now: datetime | None = None,
) -> tuple[ApiToken, str]:
    """A new token and its secret; the secret is returned here once and stored only hashed."""
    now = now or utcnow()
    if session.scalar(select(ApiToken.id).where(ApiToken.name == name)) is not None:
        raise DuplicateError("token", "name", name)
    if expires_at is not None and expires_at <= now:
        raise InvalidFieldError("expires_at", f"must lie in the future, not {expires_at.isoformat()}")
    if actions is not None and scope is TokenScope.read:
        raise InvalidFieldError(
            "actions", "a read token changes nothing; actions limit ci and admin tokens"
        )
    secret = new_secret(API_TOKEN_PREFIX)
    token = ApiToken(
        name=name,
        scope=scope,
        token_hash=hash_secret(secret),
        prefix=secret[:SHOWN_PREFIX_LENGTH],
        created_at=now,
        expires_at=expires_at,
        actions=sorted(set(actions)) if actions is not None else None,
    )
    session.add(token)
    session.flush()
    return token, secret


def token_by_secret(session: Session, *, secret: str) -> ApiToken | None:
    """The token whose secret this is, if any (expired or not: the caller says which)."""
    return session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_secret(secret)))


def record_use(session: Session, token: ApiToken, *, now: datetime | None = None) -> bool:
    """Note that `token` was just accepted, unless that was noted under a minute ago."""
    now = now or utcnow()
    if token.last_used_at is not None and now - token.last_used_at < LAST_USED_RESOLUTION:
        return False
    token.last_used_at = now
    session.flush()
    return True


def list_tokens(
    session: Session,
    *,
    skip: int,
    limit: int,
    scope: TokenScope | None = None,
    unused_days: int | None = None,
    now: datetime | None = None,
) -> tuple[Sequence[ApiToken], int]:
    """A page of tokens (never their secrets), ordered by id; `unused_days` keeps only tokens
    older than that which have not been used for that long."""
    stmt = select(ApiToken).order_by(ApiToken.id)
    if scope is not None:
        stmt = stmt.where(ApiToken.scope == scope)
    if unused_days is not None:
        cutoff = (now or utcnow()) - timedelta(days=unused_days)
        stmt = stmt.where(
            ApiToken.created_at < cutoff,
            or_(ApiToken.last_used_at.is_(None), ApiToken.last_used_at < cutoff),
        )
    return paginate(session, stmt, skip=skip, limit=limit)


def delete_token(session: Session, *, token_id: int) -> None:
    """Revoke a token: requests bearing it are refused from now on."""
    token = session.get(ApiToken, token_id)
    if token is None:
        raise NotFoundError("token", token_id)
    session.delete(token)
    session.flush()
