"""Liveness of the control plane and its database (no authentication)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from app.db import database_is_reachable

router = APIRouter()


class Health(BaseModel):
    status: str
    database: str


@router.get(
    "/healthz",
    response_model=Health,
    responses={503: {"model": Health, "description": "The database is unreachable"}},
)
def read_health(request: Request) -> Health | JSONResponse:
    """200 when the database answers a query, 503 when it does not."""
    if database_is_reachable(request.app.state.engine):
        return Health(status="ok", database="ok")
    return JSONResponse(status_code=503, content={"status": "unavailable", "database": "unreachable"})
