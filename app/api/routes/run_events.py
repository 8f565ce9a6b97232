"""Events of a run: its timeline of membership changes, restarts and checkpoints."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import IdPath, ReadDep, SessionDep
from app.api.responses import NOT_FOUND
from app.queries.events import list_events
from app.schemas.events import RunEventPublic, RunEvents

router = APIRouter()


@router.get("/{run_id}/events", response_model=RunEvents, responses=NOT_FOUND)
def read_run_events(session: SessionDep, _: ReadDep, run_id: IdPath) -> RunEvents:
    """The run's events, oldest first."""
    events = list_events(session, run_id=run_id)
    return RunEvents(run_id=run_id, events=[RunEventPublic.model_validate(e) for e in events])
