"""Logs of a run: the last lines of each rank's output, as the agents shipped them."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from app.api.deps import IdPath, ReadDep, SessionDep
from app.api.responses import NOT_FOUND
from app.queries.agents import LOG_LINES_KEPT, read_logs
from app.queries.runs import get_run
from app.schemas.runs import RunLogLine, RunLogs

router = APIRouter()


@router.get("/{run_id}/logs", response_model=RunLogs, responses=NOT_FOUND)
def read_run_logs(
    session: SessionDep,
    _: ReadDep,
    run_id: IdPath,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000)] = None,
    tail: Annotated[int, Query(ge=1, le=LOG_LINES_KEPT)] = 200,
) -> RunLogs:
    """The newest `tail` lines of every rank (or of one), oldest first within a rank."""
    get_run(session, run_id=run_id)
    lines = read_logs(session, run_id=run_id, rank=rank, tail=tail)
    return RunLogs(run_id=run_id, lines=[RunLogLine.model_validate(x) for x in lines])
