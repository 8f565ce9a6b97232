"""A trainer's report batch stored: its measurements and its run events, each once, whether
the trainer posts it with the run's token or its agent delivers it from the spool."""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.errors import ConflictError
from app.models import Node, Run
from app.queries.events import store_trainer_events
from app.queries.metrics import store_metrics
from app.schemas.reports import ReportBatch, TrainerEventRecord
from app.schemas.runs import MetricRecord


def store_report(session: Session, *, run_id: int, batch: ReportBatch) -> int:
    """Store a batch's measurements and trainer events once each; returns how many were new."""
    measurements: list[MetricRecord] = []
    events: list[TrainerEventRecord] = []
    for record in batch.records:
        if isinstance(record, TrainerEventRecord):
            events.append(record)
        else:
            measurements.append(record)
    stored = store_metrics(session, run_id=run_id, records=measurements)
    return stored + store_trainer_events(session, run_id=run_id, records=events)


def store_spooled_report(session: Session, *, node: Node, run: Run, batch: ReportBatch) -> int:
    """Store what a node's trainers spooled: only records of ranks the run planned on `node`
    (ConflictError naming the first other one), at any time, also after the run ended."""
    mine = {w.rank for w in run.workers if w.node_id == node.id}
    foreign = sorted({r.rank for r in batch.records} - mine)
    if foreign:
        raise ConflictError(f"rank {foreign[0]} of run {run.id} is not planned on node {node.name}")
    return store_report(session, run_id=run.id, batch=batch)
