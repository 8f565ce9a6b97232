"""Schemas of checkpoints: what a stored one looks like to the API and the trainer."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.schemas.common import PublicSchema


class CheckpointPublic(PublicSchema):
    """A stored checkpoint of a run (its bytes are at GET /runs/{id}/checkpoint)."""

    step: int
    size: int = Field(validation_alias="size_bytes", description="bytes")
    sha256: str
    created_at: datetime
