"""Metrics of a run: ingestion from its trainer processes, and series for charts and CI."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, status

from app.api.deps import IdPath, MetricsTokenDep, ReadDep, SessionDep
from app.api.responses import NOT_FOUND
from app.queries import events as event_queries
from app.queries import metrics as queries
from app.schemas.reports import ReportBatch, TrainerEventRecord
from app.schemas.runs import MetricName, MetricRecord, MetricsStored, RunMetrics

router = APIRouter()


@router.post("/{run_id}/metrics", response_model=MetricsStored, responses=NOT_FOUND)
def ingest_metrics(
    session: SessionDep, token: MetricsTokenDep, run_id: IdPath, body: ReportBatch
) -> MetricsStored:
    """Store a batch of trainer records (measurements and run events); a record already
    stored is skipped, not doubled."""
    if not queries.metrics_token_valid(session, run_id=run_id, token=token):
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "not this run's metrics token",
            headers={"WWW-Authenticate": "Bearer"},
        )
    measurements: list[MetricRecord] = []
    events: list[TrainerEventRecord] = []
    for record in body.records:
        if isinstance(record, TrainerEventRecord):
            events.append(record)
        else:
            measurements.append(record)
    stored = queries.store_metrics(session, run_id=run_id, records=measurements)
    stored += event_queries.store_trainer_events(session, run_id=run_id, records=events)
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
