"""The bill of a run: egress and compute spend, cost per million samples and granularity."""

from __future__ import annotations

from fastapi import APIRouter

from app.api.deps import IdPath, ReadDep, SessionDep
from app.api.responses import NOT_FOUND
from app.billing import Bill, Granularity
from app.models.runs import Run
from app.queries import costs
from app.queries.predictions import predicted_vs_measured
from app.queries.runs import get_run
from app.schemas.costs import GranularityPublic, LinkSpend, NodeSpend, PredictedVsMeasured, RunCost

router = APIRouter()


@router.get("/{run_id}/cost", response_model=RunCost, responses=NOT_FOUND)
def read_run_cost(session: SessionDep, _: ReadDep, run_id: IdPath) -> RunCost:
    """The run's bill at the prices in force when it started: live while it runs, then final."""
    run = get_run(session, run_id=run_id)
    totals = costs.metric_totals(session, run_id=run.id)
    bill = costs.run_bill(session, run=run, totals=totals)
    public = bill_public(run, bill)
    compared = predicted_vs_measured(session, run=run, bill=bill, links=totals.links)
    if compared is not None:
        public.predicted = PredictedVsMeasured.model_validate(compared)
    return public


def _granularity(g: Granularity) -> GranularityPublic:
    return GranularityPublic(compute_s=g.compute_s, comm_s=g.comm_s, ratio=g.ratio)


def bill_public(run: Run, bill: Bill) -> RunCost:
    """The API's view of a bill."""
    return RunCost(
        run_id=run.id,
        status=run.status.value,
        final=run.status.finished,
        priced_at=costs.run_priced_at(run),
        egress_usd=float(bill.egress_usd),
        data_read_usd=float(bill.reads_usd),
        data_read_bytes=bill.read_bytes,
        egress_by_class={str(k): float(v) for k, v in bill.egress_by_class.items()},
        bytes_by_class={str(k): int(v) for k, v in bill.bytes_by_class.items()},
        egress_by_link=[
            LinkSpend(
                src=link.src,
                dst=link.dst,
                bytes=link.bytes,
                traffic_class=str(link.traffic_class),
                continent=None if link.scope is None else str(link.scope),
                payer=None if link.payer is None else str(link.payer),
                usd_per_gb=float(link.usd_per_gb),
                usd=float(link.usd),
            )
            for link in bill.egress_by_link
        ],
        compute_usd=float(bill.compute_usd),
        compute_by_node=[
            NodeSpend(
                node=node.name,
                seconds=node.seconds,
                basis=node.basis.value,
                usd_per_hour=float(node.usd_per_hour),
                usd=float(node.usd),
            )
            for node in bill.compute_by_node
        ],
        total_usd=float(bill.total_usd),
        samples=bill.samples,
        usd_per_million_samples=(
            None if bill.usd_per_million_samples is None else float(bill.usd_per_million_samples)
        ),
        samples_per_s=bill.samples_per_s,
        time_to_target_s=bill.time_to_target_s,
        time_to_accuracy_s=bill.time_to_target_s,
        granularity=_granularity(bill.granularity),
        granularity_by_worker={k: _granularity(v) for k, v in bill.granularity_by_worker.items()},
        unpriced=list(bill.unpriced),
    )
