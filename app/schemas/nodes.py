"""Schemas of nodes and the GPUs they declare."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import Field, field_validator

from app.models.enums import NodeStatus
from app.schemas.common import Count, Flag, Id, Name, PublicSchema, Schema, ShortText, UsdPerHour

LabelKey = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[^\x00-\x1f\x7f]*$")]
LabelValue = Annotated[str, Field(max_length=256, pattern=r"^[^\x00-\x1f\x7f]*$")]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=64)]


class GpuCount(Schema):
    """`count` GPUs of the catalog model named `model`."""

    model: ShortText = Field(description="name of a GPU model in /api/v1/gpu-models")
    count: Count


def _distinct_models(gpus: list[GpuCount] | None) -> list[GpuCount] | None:
    if gpus is not None:
        names = [gpu.model for gpu in gpus]
        if len(set(names)) != len(names):
            raise ValueError("each GPU model may appear once; add up the counts instead")
    return gpus


GpuList = Annotated[list[GpuCount], Field(max_length=16)]


class NodeCreate(Schema):
    site_id: Id
    name: Name
    address: Annotated[str, Field(max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")] | None = None
    gpus: GpuList = []
    instance_type: ShortText | None = None
    spot: Flag = False
    labels: Labels = {}
    amortised_usd_per_h: UsdPerHour = Field(
        default=0.0, description="hourly cost of an owned machine (0 for cloud instances)"
    )

    _gpus = field_validator("gpus")(_distinct_models)


class NodeUpdate(Schema):
    site_id: Id | None = None
    name: Name | None = None
    address: Annotated[str, Field(max_length=255, pattern=r"^[^\x00-\x1f\x7f]*$")] | None = None
    gpus: GpuList | None = None
    instance_type: ShortText | None = None
    spot: Flag | None = None
    labels: Labels | None = None
    status: NodeStatus | None = None
    amortised_usd_per_h: UsdPerHour | None = None

    _gpus = field_validator("gpus")(_distinct_models)


class GpuCountPublic(PublicSchema):
    model: str
    count: int


class NodePublic(PublicSchema):
    id: int
    site_id: int
    name: str
    address: str | None
    gpus: list[GpuCountPublic]
    instance_type: str | None
    spot: bool
    labels: dict[str, str]
    status: NodeStatus
    last_heartbeat: datetime | None
    amortised_usd_per_h: float
    detected_hardware: dict[str, Any] | None
    measured_samples_per_s: float | None
    created_at: datetime
    updated_at: datetime


class JoinToken(PublicSchema):
    join_token: str = Field(description="shown once: the node's agent presents it to join")


class NodeCreated(NodePublic):
    """A new node and its one-time join token."""

    join_token: str = Field(description="shown once: the node's agent presents it to join")
