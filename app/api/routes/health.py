"""Liveness of the control plane and its database (no authentication).

/healthz takes no admission slot and probes on an engine and a thread of its own, within
`PROBE_S`: however busy the request lanes are, it answers at once (app/capacity.py).
"""

from __future__ import annotations

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from app.db import database_is_reachable

router = APIRouter()

# The database must answer the probe within this; a slower one is reported unavailable.
PROBE_S = 3.0
_PROBE_THREADS: RunVar[anyio.CapacityLimiter] = RunVar("hybridtrain_health_threads")


class Health(BaseModel):
    status: str
    database: str


def _probe_threads() -> anyio.CapacityLimiter:
    try:
        return _PROBE_THREADS.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(2)
        _PROBE_THREADS.set(limiter)
        return limiter


@router.get(
    "/healthz",
    response_model=Health,
    responses={503: {"model": Health, "description": "The database is unreachable"}},
)
async def read_health(request: Request) -> Health | JSONResponse:
    """200 when the database answers a query, 503 when it does not (within a few seconds)."""
    reachable = False
    with anyio.move_on_after(PROBE_S):
        reachable = await anyio.to_thread.run_sync(
            database_is_reachable, request.app.state.health_engine,
            limiter=_probe_threads(), abandon_on_cancel=True,
        )
    if reachable:
        return Health(status="ok", database="ok")
    return JSONResponse(status_code=503, content={"status": "unavailable", "database": "unreachable"})
