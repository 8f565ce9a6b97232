"""Schemas of clusters."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from pydantic import Field, field_validator

from app.schemas.common import Id, LongText, Name, PublicSchema, Schema

NodeIds = Annotated[list[Id], Field(max_length=10_000)]


def _distinct(ids: list[int] | None) -> list[int] | None:
    if ids is not None and len(set(ids)) != len(ids):
        raise ValueError("node ids must be distinct")
    return ids


class ClusterCreate(Schema):
    name: Name
    description: LongText = ""
    node_ids: NodeIds = []

    _node_ids = field_validator("node_ids")(_distinct)


class ClusterUpdate(Schema):
    name: Name | None = None
    description: LongText | None = None
    node_ids: NodeIds | None = None

    _node_ids = field_validator("node_ids")(_distinct)


class ClusterPublic(PublicSchema):
    id: int
    name: str
    description: str
    node_ids: list[int]
    created_at: datetime
    updated_at: datetime
