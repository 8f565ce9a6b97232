"""The overview: sites and their nodes by status, runs in flight, and spend so far."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from app.api.deps import SessionDep
from app.queries import dashboard as queries
from app.web.auth import ViewerDep
from app.web.templating import render

router = APIRouter()


@router.get("/")
def read_overview(request: Request, session: SessionDep, viewer: ViewerDep) -> Response:
    """Sites and nodes by status, runs in flight and what runs have spent."""
    from app.web import run_data

    context = {
        "viewer": viewer,
        "sites": queries.site_summaries(session),
        "totals": queries.node_status_totals(session),
        "gpus": queries.gpu_totals_by_model(session),
        "runs": run_data.overview(session),
    }
    return render(request, "index.html", context, cookie=viewer.session)
