"""Runs side by side: loss against time, throughput, time to target and spend."""

from __future__ import annotations

import re
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from app.api.deps import SessionDep
from app.errors import NotFoundError
from app.queries import costs, dashboard
from app.queries import runs as run_queries
from app.web import compare_figures, figures, run_data
from app.web.auth import ViewerDep
from app.web.templating import render

router = APIRouter()

MAX_RUNS = 10
MAX_POINTS = 400


def parse_run_ids(values: list[str]) -> tuple[list[int], list[str]]:
    """Run ids from `?runs=1,2&runs=3` (deduplicated, in order), and what was not an id."""
    ids: list[int] = []
    bad: list[str] = []
    for value in values:
        for part in filter(None, (p.strip() for p in value.split(","))):
            if re.fullmatch(r"\d{1,9}", part) and int(part) > 0:
                if int(part) not in ids:
                    ids.append(int(part))
            else:
                bad.append(part[:20])
    return ids, bad


def summary(session, run) -> compare_figures.RunSummary:  # type: ignore[no-untyped-def]
    """What the comparison shows of one run."""
    data = run_data.run_series(session, run, names=("loss", "samples_per_s"), max_points=MAX_POINTS)
    series = data.series
    servers = run_data.server_ranks(run)
    bill = costs.run_bill(session, run=run, links=data.link_totals, samples=data.samples)
    return compare_figures.RunSummary(
        run_id=run.id,
        label=f"#{run.id} {run.name}",
        t0=run_data.run_t0(session, run),
        loss=figures.mean_by_bucket(figures.by_name(series, "loss", skip=servers),
                                    dashboard.bucket_width(run.max_steps or 0, MAX_POINTS)),
        throughput=figures.total_throughput(figures.by_name(series, "samples_per_s", skip=servers)),
        # The bill reads the legacy metric name of older runs too.
        time_to_target_s=bill.time_to_target_s,
        egress_usd=float(bill.egress_usd),
        compute_usd=float(bill.compute_usd),
        target=run.target,
        samples_per_s=bill.samples_per_s,
        usd_per_million_samples=(
            None if bill.usd_per_million_samples is None else float(bill.usd_per_million_samples)
        ),
        granularity=bill.granularity.ratio,
    )


@router.get("/compare")
def read_compare_page(
    request: Request, session: SessionDep, viewer: ViewerDep,
    runs: Annotated[list[str], Query(max_length=MAX_RUNS * 2)] = [],  # noqa: B006 - FastAPI copies it
) -> Response:
    """The chosen runs overlaid; a picker of recent runs to choose from."""
    ids, bad = parse_run_ids(runs)
    errors = [f"'{b}' is not a run id" for b in bad]
    if len(ids) > MAX_RUNS:
        errors.append(f"showing the first {MAX_RUNS} of {len(ids)} runs")
        ids = ids[:MAX_RUNS]
    chosen = []
    for run_id in ids:
        try:
            chosen.append(run_queries.get_run(session, run_id=run_id))
        except NotFoundError:
            errors.append(f"there is no run {run_id}")
    summaries = [summary(session, run) for run in chosen]
    recent, _ = run_queries.list_runs(session, skip=0, limit=30)
    context = {
        "viewer": viewer,
        "chosen": chosen,
        "errors": errors,
        "recent": recent,
        "selected": {run.id for run in chosen},
        "summaries": summaries,
        "figures": {
            "loss": compare_figures.compare_loss_figure(summaries),
            "throughput": compare_figures.compare_throughput_figure(summaries),
            "tta": compare_figures.time_to_target_figure(summaries),
            "spend": compare_figures.spend_figure(summaries),
        } if summaries else {},
    }
    return render(request, "compare.html", context, cookie=viewer.session)
