"""The prices page: instance and egress price tables, editable.

An edit never rewrites a price: it publishes a new version through `app.queries.prices`, which
refuses start times in the past, so bills already computed keep the prices they used.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.responses import Response

from app.api.deps import SessionDep
from app.errors import HybridtrainError
from app.models import Continent, GpuModel, Provider, TrafficClass
from app.queries import dashboard
from app.queries import prices as queries
from app.schemas.common import MAX_ID
from app.schemas.prices import (
    EgressPriceCreate,
    EgressPriceRevision,
    InstancePriceCreate,
    InstancePriceRevision,
)
from app.web import forms
from app.web.auth import AdminViewerDep, FormDep, Viewer, ViewerDep
from app.web.templating import redirect, render

router = APIRouter()

PriceIdPath = Annotated[int, Path(ge=1, le=MAX_ID)]
INSTANCE_REVISION_FIELDS = ("spot_usd_per_h", "on_demand_usd_per_h", "effective_from", "source")
EGRESS_REVISION_FIELDS = ("usd_per_gb", "effective_from", "source")
INSTANCE_CREATE_FIELDS = (
    "provider", "region", "instance_type", "gpu_model_id", "gpu_count",
    "spot_usd_per_h", "on_demand_usd_per_h", "effective_from", "source",
)
EGRESS_CREATE_FIELDS = ("provider", "traffic_class", "continent", "usd_per_gb", "effective_from", "source")


def effective_from_field(text: str) -> str | None:
    """A datetime-local value ('2026-05-01T12:00'), read as UTC, as the RFC 3339 the schemas take."""
    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return text  # the schema names the field and the format it wants
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.isoformat()


def _schema_input(echoed: dict[str, str], *, ints: tuple[str, ...], floats: tuple[str, ...]) -> tuple[dict[str, Any], dict[str, str]]:
    data, errors = forms.typed(echoed, ints=ints, floats=floats)
    data["effective_from"] = effective_from_field(echoed.get("effective_from", ""))
    return data, errors


def _prices_page(
    request: Request,
    session: Session,
    viewer: Viewer,
    *,
    editing: tuple[str, int] | None = None,
    adding: str | None = None,
    values: dict[str, str] | None = None,
    errors: dict[str, str] | None = None,
    status_code: int = 200,
) -> Response:
    instances, _ = queries.list_instance_prices(session, skip=0, limit=1000)
    egress, _ = queries.list_egress_prices(session, skip=0, limit=1000)
    scheduled_instances, scheduled_egress = dashboard.scheduled_prices(session)
    shown = {("instance", p.id) for p in instances} | {("egress", p.id) for p in egress}
    context = {
        "viewer": viewer,
        # Errors of a version that is no longer in force (superseded meanwhile) go above the tables.
        "stray_errors": (errors or {}) if editing and editing not in shown else {},
        "instances": instances,
        "egress": egress,
        "scheduled_instances": scheduled_instances,
        "scheduled_egress": scheduled_egress,
        "editing": editing,
        "adding": adding,
        "values": values or {},
        "errors": errors or {},
        "provider_options": [(p.value, p.value) for p in Provider if p is not Provider.onprem],
        "class_options": [(c.value, c.value.replace("_", " ")) for c in TrafficClass],
        "continent_options": [(c.value, c.value.replace("_", " ")) for c in Continent],
        "gpu_options": [(str(g.id), g.name) for g in session.scalars(select(GpuModel).order_by(GpuModel.name))],
        "now_local": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M"),
    }
    return render(request, "prices.html", context, cookie=viewer.session, status_code=status_code)


@router.get("/prices")
def read_prices_page(request: Request, session: SessionDep, viewer: ViewerDep) -> Response:
    """Instance and egress prices in force now, and versions scheduled for later."""
    return _prices_page(request, session, viewer)


def _saved(request: Request, viewer: Viewer, what: str, version: Any) -> Response:
    start = version.effective_from.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return redirect(
        request, "/prices", cookie=viewer.session,
        flash=("ok", f"{what}: version {version.id} in force from {start}."),
    )


@router.post("/prices/instances/{price_id}")
def revise_instance_price(
    request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep, price_id: PriceIdPath
) -> Response:
    """Publish a new version of an instance price."""
    echoed = forms.values(form, INSTANCE_REVISION_FIELDS)
    data, errors = _schema_input(echoed, ints=(), floats=("spot_usd_per_h", "on_demand_usd_per_h"))
    if not errors:
        # A cleared spot price means "no spot offer"; the other blanks keep the current value.
        data["spot_usd_per_h"] = data["spot_usd_per_h"] if data["spot_usd_per_h"] != "" else None
        body, errors = forms.parse(InstancePriceRevision, {k: v for k, v in data.items() if v not in ("", None) or k == "spot_usd_per_h"})
        if body is not None:
            try:
                version = queries.revise_instance_price(session, price_id=price_id, data=body)
                session.commit()
                return _saved(request, viewer, f"{version.instance_type} in {version.region}", version)
            except HybridtrainError as exc:
                session.rollback()
                errors = forms.domain_errors(exc)
    return _prices_page(request, session, viewer, editing=("instance", price_id), values=echoed, errors=errors, status_code=422)


@router.post("/prices/egress/{price_id}")
def revise_egress_price(
    request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep, price_id: PriceIdPath
) -> Response:
    """Publish a new version of an egress price."""
    echoed = forms.values(form, EGRESS_REVISION_FIELDS)
    data, errors = _schema_input(echoed, ints=(), floats=("usd_per_gb",))
    if not errors:
        body, errors = forms.parse(EgressPriceRevision, {k: v for k, v in data.items() if v not in ("", None)})
        if body is not None:
            try:
                version = queries.revise_egress_price(session, price_id=price_id, data=body)
                session.commit()
                return _saved(request, viewer, f"{version.provider} {version.traffic_class} egress", version)
            except HybridtrainError as exc:
                session.rollback()
                errors = forms.domain_errors(exc)
    return _prices_page(request, session, viewer, editing=("egress", price_id), values=echoed, errors=errors, status_code=422)


@router.post("/prices/instances")
def create_instance_price(request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep) -> Response:
    """Price an instance type that has no price yet."""
    echoed = forms.values(form, INSTANCE_CREATE_FIELDS)
    data, errors = _schema_input(echoed, ints=("gpu_model_id", "gpu_count"), floats=("spot_usd_per_h", "on_demand_usd_per_h"))
    if not errors:
        body, errors = forms.parse(InstancePriceCreate, {k: v for k, v in data.items() if v not in ("", None)})
        if body is not None:
            try:
                version = queries.create_instance_price(session, data=body)
                session.commit()
                return _saved(request, viewer, f"{version.instance_type} in {version.region}", version)
            except HybridtrainError as exc:
                session.rollback()
                errors = forms.domain_errors(exc)
    return _prices_page(request, session, viewer, adding="instance", values=echoed, errors=errors, status_code=422)


@router.post("/prices/egress")
def create_egress_price(request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep) -> Response:
    """Start a new egress price series."""
    echoed = forms.values(form, EGRESS_CREATE_FIELDS)
    data, errors = _schema_input(echoed, ints=(), floats=("usd_per_gb",))
    if not errors:
        body, errors = forms.parse(EgressPriceCreate, {k: v for k, v in data.items() if v not in ("", None)})
        if body is not None:
            try:
                version = queries.create_egress_price(session, data=body)
                session.commit()
                return _saved(request, viewer, f"{version.provider} {version.traffic_class} egress", version)
            except HybridtrainError as exc:
                session.rollback()
                errors = forms.domain_errors(exc)
    return _prices_page(request, session, viewer, adding="egress", values=echoed, errors=errors, status_code=422)
