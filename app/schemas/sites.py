"""Schemas of sites."""

from __future__ import annotations

from datetime import datetime

from app.models.enums import Continent, Provider, SiteKind
from app.schemas.common import Name, PublicSchema, Schema, ShortText


class SiteCreate(Schema):
    name: Name
    kind: SiteKind
    provider: Provider
    region: ShortText | None = None
    zone: ShortText | None = None
    continent: Continent


class SiteUpdate(Schema):
    name: Name | None = None
    kind: SiteKind | None = None
    provider: Provider | None = None
    region: ShortText | None = None
    zone: ShortText | None = None
    continent: Continent | None = None


class SitePublic(PublicSchema):
    id: int
    name: str
    kind: SiteKind
    provider: Provider
    region: str | None
    zone: str | None
    continent: Continent
    created_at: datetime
    updated_at: datetime
