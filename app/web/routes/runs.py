"""Run pages: the list, the launch form with its plan preview, one run's live page (charts fed
by server-sent events, plan, status, logs, cancel).

Launching, previewing and cancelling call the REST handlers of `app.api.routes.runs` as plain
functions, so the pages and the API plan, launch and cancel runs the same way.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio.to_thread
from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse
from fastapi.sse import EventSourceResponse, ServerSentEvent
from sqlalchemy import select
from sqlalchemy.orm import Session, selectinload
from starlette.datastructures import UploadFile
from starlette.responses import Response

from app import bundles as bundle_storage
from app import lifecycle
from app.api.deps import DispatcherDep, SessionDep, SettingsDep
from app.capacity import stream_limiter
from app.config import Settings
from app.api.routes import plans as plans_api
from app.api.routes import runs as runs_api
from app.errors import HybridtrainError, NotFoundError
from app.lifecycle.launch import TRAINING
from app.models import Bundle, Cluster, Node, NodeStatus, RunStatus
from app.models.runs import FINISHED_WORKER_STATUSES
from app.queries import costs, dashboard
from app.queries.predictions import predicted_vs_measured
from app.queries import datasets as dataset_queries
from app.queries import runs as run_queries
from app.queries.agents import read_logs
from app.schemas.common import MAX_ID
from app.queries.bundles import list_bundles
from app.schemas.predictions import PlanRequest
from app.schemas.runs import RunAddNodes, RunCancel
from app.web import run_data, run_form
from app.web.auth import CiViewerDep, FormDep, StreamViewerDep, UploadFormDep, Viewer, ViewerDep
from app.web.live import EventFeed, IdCursor, MetricRow
from app.web.pages import PageNotFound, Paging
from app.web.templating import redirect, render
from hybridtrain.contract import STRATEGIES, is_ps

router = APIRouter()

RunIdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
PER_PAGE = 25
# Earlier bundles offered on the launch form, newest first.
BUNDLE_CHOICES = 50
# How often an open run page looks for new rows: well under the 1 s a new point may take.
POLL_S = 0.25
LOG_TAIL = 100


# --- list -----------------------------------------------------------------------------------


@router.get("/runs")
def read_runs_page(
    request: Request, session: SessionDep, viewer: ViewerDep, page: Annotated[int, Query(ge=1, le=100_000)] = 1
) -> Response:
    """Every run, newest first, with progress and spend; tick runs to compare them."""
    runs, total = run_queries.list_runs(session, skip=(page - 1) * PER_PAGE, limit=PER_PAGE)
    context = {
        "viewer": viewer,
        "runs": run_data.run_rows(session, list(runs)),
        "paging": Paging(page=page, per_page=PER_PAGE, total=total),
    }
    return render(request, "runs.html", context, cookie=viewer.session)


# --- launch ---------------------------------------------------------------------------------


def _form_page(
    request: Request, session: Session, viewer: Viewer, *, values: dict[str, Any], errors: dict[str, str],
    status_code: int = 200,
) -> Response:
    nodes = session.scalars(select(Node).options(selectinload(Node.site), selectinload(Node.gpus)).order_by(Node.name)).all()
    context = {
        "viewer": viewer,
        "values": values,
        "errors": errors,
        "nodes": nodes,
        "cluster_options": [(c.id, c.name) for c in session.scalars(select(Cluster).order_by(Cluster.name))],
        "ps_options": [(n.id, f"{n.name} ({n.site.name})") for n in nodes],
        "strategy_options": [(s, s) for s in STRATEGIES],
        "defaults": run_form.strategy_placeholders(),
        "bundle_options": [
            (b.sha256, f"{b.filename or 'bundle'} · {b.sha256[:12]} · {b.created_at:%Y-%m-%d %H:%M}")
            for b in list_bundles(session, skip=0, limit=BUNDLE_CHOICES)[0]
        ],
    }
    return render(request, "run_new.html", context, cookie=viewer.session, status_code=status_code)


@router.get("/runs/new")
def read_launch_form(request: Request, session: SessionDep, viewer: CiViewerDep) -> Response:
    """The launch form."""
    values: dict[str, Any] = run_form.DEFAULTS | {"node_ids": [], "idempotency_key": uuid.uuid4().hex}
    return _form_page(request, session, viewer, values=values, errors={})


@router.post("/runs/plan")
def preview_plan(session: SessionDep, viewer: CiViewerDep, dispatcher: DispatcherDep, form: FormDep) -> JSONResponse:
    """The plan the form would launch (batch split, server placement) with every strategy's
    prediction side by side, or its errors, as JSON."""
    body, errors = run_form.run_create(run_form.echoed(form))
    if body is None:
        return JSONResponse({"errors": errors}, status_code=422)
    try:
        plan = runs_api.plan_run(session=session, principal=viewer.principal, dispatcher=dispatcher,
                                 body=PlanRequest.model_validate(body.model_dump()))
    except HybridtrainError as exc:
        return JSONResponse({"errors": run_form.launch_errors(exc)}, status_code=422)
    out: dict[str, Any] = {"plan": plan.model_dump(mode="json")}
    try:
        every = runs_api.plan_run(session=session, principal=viewer.principal, dispatcher=dispatcher,
                                  body=PlanRequest.model_validate(body.model_dump() | {"strategies": "all"}))
    except HybridtrainError as exc:
        # The chosen strategy plans; another (a server without an address, say) may not.
        out["predictions_unavailable"] = exc.message
    else:
        out |= run_form.prediction_rows(every.plans)  # type: ignore[union-attr]
    return JSONResponse(out)


@router.post("/runs/suggest")
def suggest_plan(session: SessionDep, viewer: CiViewerDep, dispatcher: DispatcherDep, form: FormDep) -> JSONResponse:
    """The optimizer's plan for the form's nodes, task and batch under the chosen goal (and
    budget), as the fields to fill in and the explanation; or the errors by field."""
    request, errors = run_form.optimize_request(run_form.echoed(form))
    if request is None:
        return JSONResponse({"errors": errors}, status_code=422)
    try:
        answer = plans_api.optimize_plan(session=session, principal=viewer.principal, dispatcher=dispatcher,
                                         body=request)
    except HybridtrainError as exc:
        return JSONResponse({"errors": run_form.launch_errors(exc)}, status_code=422)
    if isinstance(answer, JSONResponse):  # no plan within the budget: the cheapest there is
        detail = json.loads(answer.body)
        return JSONResponse({"errors": {"suggest_budget": detail["detail"][0]["msg"]},
                             "cheapest": detail.get("cheapest")}, status_code=422)
    return JSONResponse({"suggestion": run_form.suggestion(answer)})


def _store_upload(session: Session, settings: Settings, file: UploadFile, created_by: str) -> str:
    """Keep an archive uploaded with the launch form as a bundle (checked as the API checks
    one) and return its sha256; an archive stored before is not stored again."""
    upload = bundle_storage.spool_file(
        file.file, limit=settings.bundle_max_bytes, filename=bundle_storage.clean_filename(file.filename)
    )
    try:
        if session.get(Bundle, upload.sha256) is None:
            files = bundle_storage.count_files(upload.file)
            bundle_storage.store_bundle(
                session, upload=upload, files=files, created_by=created_by, bundle_dir=settings.bundle_dir
            )
        return upload.sha256
    finally:
        upload.close()


@router.post("/runs")
def launch_run(
    request: Request, session: SessionDep, settings: SettingsDep, dispatcher: DispatcherDep,
    viewer: CiViewerDep, form: UploadFormDep,
) -> Response:
    """Launch the run the form describes (storing an uploaded bundle first); on any error, the
    form again with it beside its field."""
    values = run_form.echoed(form)
    uploaded: str | None = None
    errors: dict[str, str] = {}
    file = form.get("bundle_file")
    if isinstance(file, UploadFile) and file.filename:
        try:
            uploaded = _store_upload(session, settings, file, viewer.principal.name)
            # Kept whatever becomes of the run: a form with an error offers it in the list.
            session.commit()
        except HybridtrainError as exc:
            session.rollback()
            errors = run_form.launch_errors(exc)
    body, form_errors = run_form.run_create(values, bundle_sha256=uploaded)
    errors |= form_errors
    if body is not None and not errors:
        try:
            # The form's one-time key makes a double-click launch one run, not two.
            run = runs_api.create_run(
                session=session, principal=viewer.principal, settings=settings, dispatcher=dispatcher,
                body=body, response=Response(), idempotency_key=values.get("idempotency_key") or None,
            )
        except HybridtrainError as exc:
            session.rollback()
            errors = run_form.launch_errors(exc)
        else:
            return redirect(request, f"/runs/{run.id}", cookie=viewer.session, flash=("ok", f"Run #{run.id} launched."))
    if uploaded:
        values["bundle_sha256"] = uploaded
    return _form_page(request, session, viewer, values=values, errors=errors, status_code=422)


# --- one run --------------------------------------------------------------------------------


def _run_or_404(session: Session, run_id: int):  # type: ignore[no-untyped-def]
    try:
        return run_queries.get_run(session, run_id=run_id)
    except NotFoundError as exc:
        raise PageNotFound(f"There is no run {run_id}.") from exc


def _log_line(line: Any) -> dict[str, Any]:
    return {"rank": line.rank, "t": line.t, "line": line.line}


@router.get("/runs/{run_id}")
def read_run_page(request: Request, session: SessionDep, viewer: ViewerDep, run_id: RunIdPath) -> Response:
    """A run: live charts, plan, status, logs and (while active) a cancel button."""
    run = _run_or_404(session, run_id)
    charts = run_data.run_charts(session, run)
    logs = sorted(read_logs(session, run_id=run.id, rank=None, tail=LOG_TAIL), key=lambda line: (line.t, line.id))
    context = {
        "viewer": viewer,
        "run": run,
        "charts": charts,
        "bill": charts.bill,
        "predicted": predicted_vs_measured(session, run=run, bill=charts.bill, links=charts.link_totals,
                                                 sites=charts.sites),
        # Each data set's first epoch through the caches, up to the rows the stream goes on from.
        "warmup": dataset_queries.run_warmup(session, run=run, max_metric_id=charts.metrics_after or None),
        "logs": [_log_line(line) for line in logs],
        "active": run.status in run_data.ACTIVE,
        "addable_nodes": _addable_nodes(session, run, viewer),
        # A queued run's place in the queue and why it waits (app.lifecycle.schedule).
        "queue": lifecycle.queue_view(session) if run.status == RunStatus.queued else None,
        "live": {
            "run_id": run.id,
            "metrics_after": charts.metrics_after,
            "logs_after": charts.logs_after,
            "active": run.status in run_data.ACTIVE,
        },
    }
    return render(request, "run_detail.html", context, cookie=viewer.session)


@router.post("/runs/{run_id}/cancel")
def cancel_run(
    request: Request, session: SessionDep, settings: SettingsDep, dispatcher: DispatcherDep,
    viewer: CiViewerDep, form: FormDep, run_id: RunIdPath,
) -> Response:
    """Cancel an active run (its roles are stopped on every node)."""
    _run_or_404(session, run_id)
    reason = str(form.get("reason") or "").strip()[:500] or None
    try:
        run = runs_api.cancel_run(
            session=session, principal=viewer.principal, settings=settings, dispatcher=dispatcher,
            run_id=run_id, body=RunCancel(reason=reason),
        )
    except HybridtrainError as exc:
        session.rollback()
        return redirect(request, f"/runs/{run_id}", cookie=viewer.session, flash=("error", exc.message))
    said = (f"Run #{run_id} is cancelling: its roles are being stopped, and its GPUs are free once its "
            "agents report them gone." if run.status == "cancelling" else f"Run #{run_id} cancelled.")
    return redirect(request, f"/runs/{run_id}", cookie=viewer.session, flash=("ok", said))


def _addable_nodes(session: Session, run: Any, viewer: Any) -> list[Any]:
    """(id, name) of the online nodes without a live rank in a training PS run, for a viewer who
    may add them (none otherwise): names only, a fleet of thousands is one light query."""
    if not viewer.can("ci") or not is_ps(run.strategy) or run.status not in TRAINING:
        return []
    inside = {w.node_id for w in run.workers if w.status not in FINISHED_WORKER_STATUSES and w.node_id is not None}
    return list(session.execute(
        select(Node.id, Node.name).where(Node.status == NodeStatus.online, Node.id.not_in(inside)).order_by(Node.name)
    ))


@router.post("/runs/{run_id}/nodes")
def add_run_nodes(
    request: Request, session: SessionDep, settings: SettingsDep, dispatcher: DispatcherDep,
    viewer: CiViewerDep, form: FormDep, run_id: RunIdPath,
) -> Response:
    """Add workers on the chosen nodes to a running PS run."""
    _run_or_404(session, run_id)
    raw = [str(v) for v in form.getlist("node_ids")]
    if not raw or not all(v.isdigit() and len(v) <= 10 for v in raw):
        return redirect(request, f"/runs/{run_id}", cookie=viewer.session, flash=("error", "choose the nodes to add"))
    try:
        runs_api.add_run_nodes(
            session=session, _=viewer.principal, settings=settings, dispatcher=dispatcher,
            run_id=run_id, body=RunAddNodes(node_ids=[int(v) for v in raw]),
        )
    except (HybridtrainError, ValueError) as exc:
        session.rollback()
        message = exc.message if isinstance(exc, HybridtrainError) else str(exc)
        return redirect(request, f"/runs/{run_id}", cookie=viewer.session, flash=("error", message))
    added = len(raw)
    return redirect(request, f"/runs/{run_id}", cookie=viewer.session,
                    flash=("ok", f"{added} node{'s' if added != 1 else ''} added to run #{run_id}."))


# --- the live stream ------------------------------------------------------------------------


def _status(run: Any) -> dict[str, Any]:
    return {
        "status": str(run.status),
        "reason": run.reason,
        "finished": run.status not in run_data.ACTIVE,
        "workers": [
            {"rank": w.rank, "status": str(w.status), "exit_code": w.exit_code, "reason": w.reason}
            for w in run.workers
        ],
    }


class _Stream:
    """One open run page: its cursors and chart state, polled in a worker thread."""

    def __init__(self, request: Request, run_id: int, metrics_after: int, logs_after: int, events_after: int = 0) -> None:
        self.factory = request.app.state.sessionmaker
        self.run_id = run_id
        self.metrics = IdCursor(metrics_after)
        self.logs = IdCursor(logs_after)
        self.last_status: dict[str, Any] | None = None
        self.warmup_changed: list[dict[str, Any]] | None = None
        # The highest ids passed on: a client that reconnects resumes from them.
        self.sent_metrics = metrics_after
        self.sent_logs = logs_after
        with self.factory() as session:
            run = run_queries.get_run(session, run_id=run_id)
            self.state = run_data.live_state(
                session, run, t0=run_data.run_t0(session, run), metrics_after=metrics_after
            )
            # The warm-up as of the rows the page showed: the new rows bring it up to date.
            self.warmup = dataset_queries.warmup_feed(session, run=run, max_metric_id=metrics_after)
            if self.warmup is not None:
                self.warmup.take(active=True)
        self.events = EventFeed(events_after, t0=self.state.t0)

    def warmup_view(self, rows: list[MetricRow], finished: bool) -> list[dict[str, Any]] | None:
        """The data sets' warm-up after `rows`, when it changed (while a first epoch is read)."""
        if self.warmup is None:
            return None
        self.warmup.add((r.name, r.rank, r.peer, r.step, r.value) for r in rows)
        return self.warmup.take(active=not finished)

    def poll(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any] | None, bool]:
        """New chart points, new log lines, the status if it changed, and whether it ended (the
        warm-up, when it changed, waits in `warmup_changed`)."""
        now = time.monotonic()
        with self.factory() as session:
            run = run_queries.get_run(session, run_id=self.run_id)
            rows = dashboard.metrics_after(session, run_id=self.run_id, after_id=self.metrics.floor)
            lines = dashboard.logs_after(session, run_id=self.run_id, after_id=self.logs.floor)
            self.events.read(run_data.events_after(session, run_id=self.run_id, after_id=self.events.floor), now)
            status = _status(run)
        fresh = self.metrics.fresh(
            ((r.id, MetricRow(r.id, r.name, r.rank, r.peer, r.step, r.t, r.value)) for r in rows), now
        )
        new_lines = self.logs.fresh(((line.id, (line.id, _log_line(line))) for line in lines), now)
        self.sent_metrics = max([self.sent_metrics, *(r.id for r in fresh)])
        self.sent_logs = max([self.sent_logs, *(i for i, _ in new_lines)])
        changed = status if status != self.last_status else None
        self.last_status = status
        self.warmup_changed = self.warmup_view(fresh, status["finished"])
        return self.state.apply(fresh), [line for _, line in new_lines], changed, status["finished"]


def open_stream(
    request: Request,
    _: StreamViewerDep,
    run_id: RunIdPath,
    metrics_after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    logs_after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
    events_after: Annotated[int, Query(ge=0, le=2**63 - 1)] = 0,
) -> _Stream:
    """The stream of a run the viewer may see, from the rows the page already showed."""
    try:
        return _Stream(request, run_id, metrics_after, logs_after, events_after)
    except NotFoundError as exc:
        raise PageNotFound(f"There is no run {run_id}.") from exc


@router.get("/runs/{run_id}/stream", response_class=EventSourceResponse)
async def stream_run(request: Request, stream: Annotated[_Stream, Depends(open_stream)]) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events of a run: `metrics` (points to append), `logs`, `events`, `data` (the
    data sets' warm-up), `status`, `end`."""
    # The polls of every open stream share a few threads (each holds a connection meanwhile).
    limiter = stream_limiter(request.app.state.settings)
    ended_at: float | None = None
    while True:
        appends, lines, status, finished = await anyio.to_thread.run_sync(stream.poll, limiter=limiter)
        if appends:
            yield ServerSentEvent(event="metrics", data={"appends": appends, "after": stream.sent_metrics})
        if lines:
            yield ServerSentEvent(event="logs", data={"lines": lines, "after": stream.sent_logs})
        events = stream.events.take()
        if events:
            yield ServerSentEvent(event="events", data={"events": events, "after": stream.events.sent})
        if stream.warmup_changed is not None:
            yield ServerSentEvent(event="data", data={"datasets": stream.warmup_changed})
        if status is not None:
            yield ServerSentEvent(event="status", data=status)
        if finished:
            # Reports sent just before the end may still be committing: drain for a moment.
            ended_at = ended_at or time.monotonic()
            if time.monotonic() - ended_at > stream.metrics.settle_s:
                yield ServerSentEvent(event="end", data={"status": stream.last_status})
                return
        await asyncio.sleep(POLL_S)
