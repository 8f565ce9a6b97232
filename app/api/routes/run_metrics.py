"""Metrics of a run: ingestion from its trainer processes, and series for charts and CI."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from app.api.deps import IdPath, MetricsTokenDep, ReadDep, SessionDep, SettingsDep
from app.api.responses import NOT_FOUND
from app.queries import metrics as queries
from app.queries.reports import store_report
from app.schemas.reports import ReportBatch
from app.schemas.runs import MetricName, MetricsStored, RunMetrics

router = APIRouter()


@router.post("/{run_id}/metrics", response_model=MetricsStored, responses=NOT_FOUND)
def ingest_metrics(
    session: SessionDep, settings: SettingsDep, token: MetricsTokenDep, run_id: IdPath, body: ReportBatch
) -> MetricsStored:
    """Store a batch of trainer records (measurements and run events); a record already
    stored is skipped, not doubled. A rank's token reports its own rank's records only, and only
    while the run is active (and `finish_grace_s` after): 403 otherwise."""
    refusal = queries.report_refusal(
        session, run_id=run_id, token=token, secret_key=settings.secret_key, grace_s=settings.finish_grace_s,
        ranks={r.rank for r in body.records},
    )
    if refusal is not None:
        code, detail = refusal
        headers = {"WWW-Authenticate": "Bearer"} if code == status.HTTP_401_UNAUTHORIZED else None
        raise HTTPException(code, detail, headers=headers)
    stored = store_report(session, run_id=run_id, batch=body)
    session.commit()
    return MetricsStored(received=len(body.records), stored=stored)


@router.get("/{run_id}/metrics", response_model=RunMetrics, responses=NOT_FOUND)
def read_metrics(
    session: SessionDep,
    _: ReadDep,
    run_id: IdPath,
    name: Annotated[list[MetricName] | None, Query(max_length=32, description="repeatable")] = None,
    rank: Annotated[int | None, Query(ge=0, le=1_000_000)] = None,
    since: Annotated[float | None, Query(ge=0, le=7.3e9, description="only points with t > since (unix s)")] = None,
    max_points: Annotated[int, Query(ge=2, le=20_000, description="per series; longer ones are downsampled")] = 1000,
) -> RunMetrics:
    """A run's series by name and rank, downsampled on the server for long runs."""
    series, last_t = queries.read_metrics(
        session, run_id=run_id, names=name or (), rank=rank, since=since, max_points=max_points
    )
    return RunMetrics(run_id=run_id, series=series, last_t=last_t)
