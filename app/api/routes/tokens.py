"""API tokens: created with a scope (and optionally an expiry and a list of actions), shown
once, revoked by deletion."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, Query, status

from app.api.deps import AdminDep, IdPath, PaginationDep, SessionDep
from app.api.responses import CONFLICT, NOT_FOUND
from app.errors import InvalidFieldError
from app.models import TokenScope
from app.models.base import utcnow
from app.queries import tokens as queries
from app.schemas.common import Page
from app.schemas.tokens import MAX_EXPIRY_DAYS, TokenCreate, TokenCreated, TokenPublic

router = APIRouter()


@router.get("", response_model=Page[TokenPublic])
def read_tokens(
    session: SessionDep,
    _: AdminDep,
    page: PaginationDep,
    scope: Annotated[TokenScope | None, Query()] = None,
    unused_days: Annotated[
        int | None,
        Query(ge=1, le=MAX_EXPIRY_DAYS, description="only tokens not used for this many days"),
    ] = None,
) -> Page[TokenPublic]:
    """List tokens (names, scopes, prefixes, expiry, last use; never the secrets)."""
    rows, count = queries.list_tokens(
        session, skip=page.skip, limit=page.limit, scope=scope, unused_days=unused_days
    )
    return Page(data=[TokenPublic.model_validate(row) for row in rows], count=count)


@router.post(
    "", response_model=TokenCreated, status_code=status.HTTP_201_CREATED, responses=CONFLICT
)
def create_token(session: SessionDep, _: AdminDep, body: TokenCreate) -> TokenCreated:
    """Create a token; its secret is in this answer and nowhere else."""
    now = utcnow()
    expires_at = body.expires_at
    if body.expires_in_days is not None:
        if expires_at is not None:
            raise InvalidFieldError("expires_at", "give expires_in_days or expires_at, not both")
        expires_at = now + timedelta(days=body.expires_in_days)
    token, secret = queries.create_token(
        session, name=body.name, scope=body.scope, expires_at=expires_at,
        actions=body.actions, now=now,
    )
    session.commit()
    return TokenCreated(**TokenPublic.model_validate(token).model_dump(), token=secret)


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def delete_token(session: SessionDep, _: AdminDep, token_id: IdPath) -> None:
    """Revoke a token."""
    queries.delete_token(session, token_id=token_id)
    session.commit()
