"""API tokens: a name, a scope and the hash of a secret that was shown once; optionally an
expiry and a list of the actions it may perform (app/token_limits.py)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, String
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, str_enum, utcnow
from app.models.enums import TokenScope

__all__ = ["ApiToken"]


class ApiToken(Base):
    """A bearer token; only the sha256 of its secret is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    scope: Mapped[TokenScope] = mapped_column(str_enum(TokenScope, "scope"))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The first characters of the secret, so a user can tell tokens apart in a list.
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # None: valid until deleted.
    expires_at: Mapped[datetime | None]
    # None: whatever the scope allows; else the only writes it may make.
    actions: Mapped[list[str] | None] = mapped_column(JSON().with_variant(JSONB(), "postgresql"))
    # Written at most once a minute per token (a write per request would be a hot row).
    last_used_at: Mapped[datetime | None]

    def expired(self, now: datetime) -> bool:
        """Whether the token's expiry has passed at `now`."""
        return self.expires_at is not None and self.expires_at <= now
