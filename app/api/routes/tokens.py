"""API tokens: created with a scope, shown once, revoked by deletion."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from app.api.deps import AdminDep, IdPath, PaginationDep, SessionDep
from app.api.responses import CONFLICT, NOT_FOUND
from app.models import TokenScope
from app.queries import tokens as queries
from app.schemas.common import Page
from app.schemas.tokens import TokenCreate, TokenCreated, TokenPublic

router = APIRouter()


@router.get("", response_model=Page[TokenPublic])
def read_tokens(
    session: SessionDep,
    _: AdminDep,
    page: PaginationDep,
    scope: Annotated[TokenScope | None, Query()] = None,
) -> Page[TokenPublic]:
    """List tokens (names, scopes and prefixes; never the secrets)."""
    rows, count = queries.list_tokens(session, skip=page.skip, limit=page.limit, scope=scope)
    return Page(data=[TokenPublic.model_validate(row) for row in rows], count=count)


@router.post(
    "", response_model=TokenCreated, status_code=status.HTTP_201_CREATED, responses=CONFLICT
)
def create_token(session: SessionDep, _: AdminDep, body: TokenCreate) -> TokenCreated:
    """Create a token; its secret is in this answer and nowhere else."""
    token, secret = queries.create_token(session, name=body.name, scope=body.scope)
    session.commit()
    return TokenCreated(**TokenPublic.model_validate(token).model_dump(), token=secret)


@router.delete("/{token_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def delete_token(session: SessionDep, _: AdminDep, token_id: IdPath) -> None:
    """Revoke a token."""
    queries.delete_token(session, token_id=token_id)
    session.commit()
