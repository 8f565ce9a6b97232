"""Schemas of links: agents' probe reports, measurements, probe orders and declared site links."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field

from app.schemas.common import Id, LongText, PublicSchema, Schema

Mbps = Annotated[float, Field(ge=0, le=10_000_000, allow_inf_nan=False)]
Millis = Annotated[float, Field(ge=0, le=3_600_000, allow_inf_nan=False)]
# The longest bulk send an order may ask for; agents cap it again on their side.
MAX_PROBE_SECONDS = 30.0


class LinkResult(Schema):
    """One link an agent measured from its node to `dst_node_id`."""

    dst_node_id: Id
    mbps: Mbps
    rtt_ms: Millis
    bytes: Annotated[int, Field(ge=0, le=2**62)]
    seconds: Annotated[float, Field(ge=0, le=3600, allow_inf_nan=False)]


class LinkFailure(Schema):
    """A link an agent could not measure, and why."""

    dst_node_id: Id
    error: LongText


class LinkReport(Schema):
    """What an agent posts after a probe order; `src_node_id`, when sent, must be its node."""

    src_node_id: Id | None = None
    results: Annotated[list[LinkResult], Field(max_length=1024)] = []
    errors: Annotated[list[LinkFailure], Field(max_length=1024)] = []


class LinkReportStored(PublicSchema):
    stored: int
    errors: int


class LinkMeasurementPublic(PublicSchema):
    id: int
    src_node_id: int
    dst_node_id: int
    mbps: float
    rtt_ms: float
    bytes: int
    seconds: float
    measured_at: datetime


class ProbeRequest(Schema):
    """Ask every given node to probe every other given node."""

    node_ids: Annotated[list[Id], Field(max_length=256)]
    seconds: Annotated[float, Field(gt=0, le=MAX_PROBE_SECONDS, allow_inf_nan=False)] = 2.0


class ProbeOrderPublic(PublicSchema):
    node_id: int
    targets: list[int]


class ProbeSkipped(PublicSchema):
    node_id: int
    reason: str


class ProbeOrdered(PublicSchema):
    """The probe orders sent, and the nodes left out with the reason."""

    orders: list[ProbeOrderPublic]
    skipped: list[ProbeSkipped]


class SiteLinkCreate(Schema):
    src_site_id: Id
    dst_site_id: Id
    mbps: Annotated[float, Field(gt=0, le=10_000_000, allow_inf_nan=False)]
    rtt_ms: Millis


class SiteLinkPublic(PublicSchema):
    id: int
    src_site_id: int
    dst_site_id: int
    mbps: float
    rtt_ms: float
    created_by: str
    created_at: datetime
