"""Schemas of API tokens."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.models.enums import TokenScope
from app.schemas.common import Name, PublicSchema, Schema


class TokenCreate(Schema):
    name: Name
    scope: TokenScope


class TokenPublic(PublicSchema):
    id: int
    name: str
    scope: TokenScope
    prefix: str = Field(description="the first characters of the secret, to tell tokens apart")
    created_at: datetime


class TokenCreated(TokenPublic):
    token: str = Field(description="the secret, shown once; send it as `Authorization: Bearer`")
