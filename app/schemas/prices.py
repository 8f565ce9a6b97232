"""Schemas of instance and egress prices (each row one version of a price series)."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.models.enums import Continent, Provider, TrafficClass
from app.schemas.common import (
    Count,
    Id,
    LongText,
    PublicSchema,
    Schema,
    ShortText,
    Timestamp,
    UsdPerGb,
    UsdPerHour,
)

_EFFECTIVE = "when this version takes effect (default: now)"
_REVISION_EFFECTIVE = (
    "when the new version takes effect (default: now); never in the past, so bills already "
    "computed keep their prices"
)


class InstancePriceCreate(Schema):
    provider: Provider
    region: ShortText
    instance_type: ShortText
    gpu_model_id: Id
    gpu_count: Count = 1
    spot_usd_per_h: UsdPerHour | None = Field(default=None, description="null: no spot offer")
    on_demand_usd_per_h: UsdPerHour
    effective_from: Timestamp | None = Field(default=None, description=_EFFECTIVE)
    source: LongText = ""


class InstancePriceRevision(Schema):
    """A new version of a price; fields left out keep the current version's value."""

    spot_usd_per_h: UsdPerHour | None = None
    on_demand_usd_per_h: UsdPerHour | None = None
    effective_from: Timestamp | None = Field(default=None, description=_REVISION_EFFECTIVE)
    source: LongText | None = None


class InstancePricePublic(PublicSchema):
    id: int
    provider: Provider
    region: str
    instance_type: str
    gpu_model_id: int
    gpu_model: str = Field(validation_alias="gpu_model_name", description="the GPU's name")
    gpu_count: int
    spot_usd_per_h: float | None
    on_demand_usd_per_h: float
    effective_from: datetime
    source: str
    seeded: bool
    created_at: datetime


class EgressPriceCreate(Schema):
    provider: Provider
    traffic_class: TrafficClass
    continent: Continent | None = Field(
        default=None,
        description="inter_region: the continent both regions are on; other classes: the "
        "source continent; null: any continent",
    )
    usd_per_gb: UsdPerGb
    effective_from: Timestamp | None = Field(default=None, description=_EFFECTIVE)
    source: LongText = ""


class EgressPriceRevision(Schema):
    """A new version of an egress price; fields left out keep the current version's value."""

    usd_per_gb: UsdPerGb | None = None
    effective_from: Timestamp | None = Field(default=None, description=_REVISION_EFFECTIVE)
    source: LongText | None = None


class EgressPricePublic(PublicSchema):
    id: int
    provider: Provider
    traffic_class: TrafficClass
    continent: Continent | None
    usd_per_gb: float
    effective_from: datetime
    source: str
    seeded: bool
    created_at: datetime
