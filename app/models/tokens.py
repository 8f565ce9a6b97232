"""API tokens: a name, a scope and the hash of a secret that was shown once."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import String
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
