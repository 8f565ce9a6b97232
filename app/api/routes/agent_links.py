"""The agent's side of link probes: report what its node measured."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException, status

from app.api.deps import AgentNodeDep, SessionDep
from app.api.responses import NOT_FOUND
from app.queries import links as queries
from app.schemas.links import LinkReport, LinkReportStored

router = APIRouter()


@router.post("/links", response_model=LinkReportStored, responses=NOT_FOUND)
def report_links(session: SessionDep, node: AgentNodeDep, body: LinkReport) -> LinkReportStored:
    """Store the links this agent's node measured to other nodes."""
    try:
        rows = queries.record_results(session, node=node, report=body)
    except PermissionError as exc:
        raise HTTPException(status.HTTP_403_FORBIDDEN, str(exc)) from None
    session.commit()
    return LinkReportStored(stored=len(rows), errors=len(body.errors))
