"""Schemas of API tokens."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from app.models.enums import TokenScope
from app.schemas.common import Name, PublicSchema, Schema, Timestamp
from app.token_limits import TokenAction

# Ten years: beyond that "expires" means nothing and a typo (3650 for 365) should be caught.
MAX_EXPIRY_DAYS = 3650

ExpiryDays = Annotated[int, Field(ge=1, le=MAX_EXPIRY_DAYS, strict=True)]


class TokenCreate(Schema):
    name: Name
    scope: TokenScope
    expires_in_days: ExpiryDays | None = Field(
        default=None, description="the token stops working this many days from now"
    )
    expires_at: Timestamp | None = Field(
        default=None, description="the token stops working at this instant (not with expires_in_days)"
    )
    actions: list[TokenAction] | None = Field(
        default=None, min_length=1, max_length=32,
        description="the only changes the token may make (reads follow its scope); null: no limit",
    )


class TokenPublic(PublicSchema):
    id: int
    name: str
    scope: TokenScope
    prefix: str = Field(description="the first characters of the secret, to tell tokens apart")
    created_at: datetime
    expires_at: datetime | None = Field(description="when it stops working; null: never")
    actions: list[str] | None = Field(description="the only changes it may make; null: no limit")
    last_used_at: datetime | None = Field(
        description="its last accepted request, to the minute; null: never used"
    )


class TokenCreated(TokenPublic):
    token: str = Field(description="the secret, shown once; send it as `Authorization: Bearer`")
