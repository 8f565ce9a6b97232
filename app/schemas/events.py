"""Schemas of run events: the run's timeline of membership changes, restarts and checkpoints."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from app.models.events import EventSource
from app.schemas.common import PublicSchema


class RunEventPublic(PublicSchema):
    id: int
    t: datetime
    kind: str
    subject: int | None = Field(description="the rank the event is about; null: the whole run")
    node_id: int | None
    step: int | None
    detail: str
    source: EventSource


class RunEvents(PublicSchema):
    """GET /runs/{id}/events: the run's events, oldest first."""

    run_id: int
    events: list[RunEventPublic]
