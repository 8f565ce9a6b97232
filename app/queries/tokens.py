"""Queries of API tokens."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.errors import DuplicateError, NotFoundError
from app.models import ApiToken, TokenScope
from app.queries.common import paginate
from app.security import API_TOKEN_PREFIX, SHOWN_PREFIX_LENGTH, hash_secret, new_secret


def create_token(session: Session, *, name: str, scope: TokenScope) -> tuple[ApiToken, str]:
    """A new token and its secret; the secret is returned here once and stored only hashed."""
    if session.scalar(select(ApiToken.id).where(ApiToken.name == name)) is not None:
        raise DuplicateError("token", "name", name)
    secret = new_secret(API_TOKEN_PREFIX)
    token = ApiToken(
        name=name,
        scope=scope,
        token_hash=hash_secret(secret),
        prefix=secret[:SHOWN_PREFIX_LENGTH],
    )
    session.add(token)
    session.flush()
    return token, secret


def token_by_secret(session: Session, *, secret: str) -> ApiToken | None:
    """The token whose secret this is, if any."""
    return session.scalar(select(ApiToken).where(ApiToken.token_hash == hash_secret(secret)))


def list_tokens(
    session: Session, *, skip: int, limit: int, scope: TokenScope | None = None
) -> tuple[Sequence[ApiToken], int]:
    """A page of tokens (never their secrets), ordered by id."""
    stmt = select(ApiToken).order_by(ApiToken.id)
    if scope is not None:
        stmt = stmt.where(ApiToken.scope == scope)
    return paginate(session, stmt, skip=skip, limit=limit)


def delete_token(session: Session, *, token_id: int) -> None:
    """Revoke a token: requests bearing it are refused from now on."""
    token = session.get(ApiToken, token_id)
    if token is None:
        raise NotFoundError("token", token_id)
    session.delete(token)
    session.flush()
