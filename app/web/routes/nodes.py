"""The nodes page: every node with its site, GPUs, status and last heartbeat; forms to add a
site and a node (which then shows the agent command with its join token), to edit and drain."""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.datastructures import FormData
from starlette.responses import Response

from app.api.deps import DispatcherDep, SessionDep, SettingsDep
from app.agent_wheel import AgentWheel
from app.api.routes import nodes as nodes_api
from app.api.routes.dist import AgentWheelDep
from app.config import Settings
from app.errors import HybridtrainError, NotFoundError
from app.join_reach import AGENT_VENV, join_obstacles
from app.models import Continent, GpuModel, Node, NodeStatus, Provider, Site, SiteKind
from app.queries import dashboard
from app.queries import nodes as node_queries
from app.queries import sites as site_queries
from app.schemas.common import MAX_ID
from app.schemas.nodes import NodeCreate, NodeUpdate
from app.schemas.sites import SiteCreate
from app.web import forms
from app.web.auth import AdminViewerDep, FormDep, Viewer, ViewerDep
from app.web.pages import PageNotFound, Paging
from app.web.templating import redirect, render

router = APIRouter()

PER_PAGE = 100
SITE_FIELDS = ("name", "kind", "provider", "region", "zone", "continent")
NODE_FIELDS = ("site_id", "name", "address", "instance_type", "spot", "amortised_usd_per_h", "labels")
MAX_GPU_ROWS = 4
NodeIdPath = Annotated[int, Path(ge=1, le=MAX_ID)]


def agent_command(server_url: str, join_token: str) -> str:
    """The command that joins a machine to its node, from the environment `install_command` made."""
    return (f"{AGENT_VENV}/bin/hybridtrain agent --server {shlex.quote(server_url)} "
            f"--token {shlex.quote(join_token)}")


def install_command(server_url: str, wheel: str) -> str:
    """The one line that installs the agent from this control plane's own wheel into a virtual
    environment of its own (Debian 12 and Ubuntu 24.04 refuse pip into the system's Python,
    PEP 668); its dependencies come from the machine's package index."""
    requirement = f"hybridtrain[agent] @ {server_url.rstrip('/')}/dist/{wheel}"
    return f"python3 -m venv {AGENT_VENV} && {AGENT_VENV}/bin/pip install {shlex.quote(requirement)}"


def _gpu_field(loc: str) -> str:
    # "gpus.1.count" -> "gpu_count_1"; a list-level error goes beside the first row.
    match = re.fullmatch(r"gpus\.(\d+)\.(model|count)", loc)
    if match:
        return f"gpu_{match.group(2)}_{match.group(1)}"
    return "gpu_model_0" if loc.startswith("gpus") else loc


def parse_labels(text: str) -> dict[str, str] | None:
    """'team=vision, rack=b2' -> {'team': 'vision', 'rack': 'b2'}; None if not of that shape."""
    labels: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            return None
        labels[key.strip()] = value.strip()
    return labels


def format_labels(labels: dict[str, Any]) -> str:
    """The inverse of `parse_labels`."""
    return ", ".join(f"{k}={v}" for k, v in labels.items())


def _gpu_rows(form: FormData) -> tuple[list[dict[str, Any]], dict[str, str], dict[str, str]]:
    """The GPU rows of a node form: (gpus for the schema, echoed values, errors)."""
    gpus: list[dict[str, Any]] = []
    echoed: dict[str, str] = {}
    errors: dict[str, str] = {}
    for index in range(MAX_GPU_ROWS):
        model = str(form.get(f"gpu_model_{index}") or "").strip()
        count = str(form.get(f"gpu_count_{index}") or "").strip()
        echoed[f"gpu_model_{index}"], echoed[f"gpu_count_{index}"] = model, count
        if not model and not count:
            continue
        if not model:
            errors[f"gpu_model_{index}"] = "choose a GPU model for this count"
            continue
        row, row_errors = forms.typed({"count": count or "1"}, ints=("count",))
        if row_errors:
            errors[f"gpu_count_{index}"] = row_errors["count"]
            continue
        # Rows are renumbered densely, so the schema's "gpus.N" must map back to the form's row.
        gpus.append({"model": model, "count": row["count"], "_row": index})
    return gpus, echoed, errors


def _node_payload(form: FormData) -> tuple[dict[str, Any], dict[str, str], dict[str, str], list[int]]:
    """A node form as schema input: (data, echoed values, errors so far, form row of each GPU)."""
    echoed = forms.values(form, NODE_FIELDS)
    echoed["spot"] = "on" if form.get("spot") else ""
    data, errors = forms.typed(echoed, ints=("site_id",), floats=("amortised_usd_per_h",), flags=("spot",))
    gpus, gpu_echo, gpu_errors = _gpu_rows(form)
    echoed |= gpu_echo
    errors |= gpu_errors
    rows = [gpu.pop("_row") for gpu in gpus]
    data["gpus"] = gpus
    labels = parse_labels(echoed["labels"])
    if labels is None:
        errors["labels"] = "write labels as key=value pairs separated by commas"
    data["labels"] = labels or {}
    return data, echoed, errors, rows


def _renamer(rows: list[int]):  # type: ignore[no-untyped-def]
    def rename(loc: str) -> str:
        match = re.fullmatch(r"gpus\.(\d+)\.(model|count)", loc)
        if match and int(match.group(1)) < len(rows):
            return f"gpu_{match.group(2)}_{rows[int(match.group(1))]}"
        return _gpu_field(loc)

    return rename


def _choices(session: Session) -> dict[str, Any]:
    return {
        "site_options": [(s.id, s.name) for s in session.scalars(select(Site).order_by(Site.name))],
        "gpu_options": [(g.name, g.name) for g in session.scalars(select(GpuModel).order_by(GpuModel.name))],
        "kind_options": [(k.value, k.value) for k in SiteKind],
        "provider_options": [(p.value, p.value) for p in Provider],
        "continent_options": [(c.value, c.value.replace("_", " ")) for c in Continent],
    }


def _nodes_page(
    request: Request,
    session: Session,
    viewer: Viewer,
    *,
    page: int = 1,
    site_values: dict[str, str] | None = None,
    site_errors: dict[str, str] | None = None,
    node_values: dict[str, str] | None = None,
    node_errors: dict[str, str] | None = None,
    created: dict[str, str] | None = None,
    status_code: int = 200,
) -> Response:
    rows, total = dashboard.nodes_with_sites(session, skip=(page - 1) * PER_PAGE, limit=PER_PAGE)
    paging = Paging(page=page, per_page=PER_PAGE, total=total)
    context = {
        "viewer": viewer,
        "nodes": rows,
        "paging": paging,
        "sites": dashboard.site_summaries(session),
        "site_values": site_values or {"kind": "cloud", "provider": "gcp", "continent": "north_america"},
        "site_errors": site_errors or {},
        "node_values": node_values or {"gpu_count_0": "1"},
        "node_errors": node_errors or {},
        "created": created,
        "open_form": "site" if site_errors else "node" if node_errors else None,
    } | _choices(session)
    return render(request, "nodes.html", context, cookie=viewer.session, status_code=status_code)


@router.get("/nodes")
def read_nodes_page(
    request: Request, session: SessionDep, viewer: ViewerDep, page: Annotated[int, Query(ge=1, le=100_000)] = 1
) -> Response:
    """Every node with its site, GPUs, status and last heartbeat."""
    return _nodes_page(request, session, viewer, page=page)


@router.post("/nodes/sites")
def create_site(request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep) -> Response:
    """Add a site from the form (errors shown beside their fields)."""
    echoed = forms.values(form, SITE_FIELDS)
    data, errors = forms.parse(SiteCreate, forms.non_blank(echoed))
    if data is not None:
        try:
            site = site_queries.create_site(session, data=data)
            session.commit()
        except HybridtrainError as exc:
            session.rollback()
            errors = forms.domain_errors(exc)
        else:
            return redirect(request, "/nodes", cookie=viewer.session, flash=("ok", f"Site {site.name} added."))
    return _nodes_page(request, session, viewer, site_values=echoed, site_errors=errors, status_code=422)


@router.post("/nodes")
def create_node(
    request: Request, session: SessionDep, settings: SettingsDep, wheel: AgentWheelDep, viewer: AdminViewerDep,
    form: FormDep,
) -> Response:
    """Declare a node from the form, then show the agent command with its one-time join token."""
    data, echoed, errors, rows = _node_payload(form)
    created = None
    if not errors:
        body, errors = forms.parse(NodeCreate, forms.non_blank(data), _renamer(rows))
        if body is not None:
            try:
                node, join_token = node_queries.create_node(session, data=body)
                session.commit()
            except HybridtrainError as exc:
                session.rollback()
                errors = forms.domain_errors(exc, _renamer(rows))
            else:
                created = _created(settings, wheel, node, join_token)
    if created is None:
        return _nodes_page(request, session, viewer, node_values=echoed, node_errors=errors, status_code=422)
    # Rendered, not redirected: the join token is shown this once and stored nowhere.
    return _nodes_page(request, session, viewer, created=created, status_code=201)


def _created(settings: Settings, wheel: AgentWheel, node: Node, join_token: str) -> dict[str, Any]:
    return {
        "node_id": str(node.id),
        "name": node.name,
        "join_token": join_token,
        "install": install_command(settings.public_url, wheel.filename),
        "command": agent_command(settings.public_url, join_token),
        "obstacles": join_obstacles(
            public_url=settings.public_url,
            agent_broker_url=settings.broker_url_for_agents or settings.celery_broker_url,
        ),
    }


def _node_or_404(session: Session, node_id: int) -> Node:
    try:
        return node_queries.get_node(session, node_id=node_id)
    except NotFoundError as exc:
        raise PageNotFound(f"There is no node {node_id}.") from exc


def _edit_values(node: Node) -> dict[str, str]:
    values = {
        "site_id": str(node.site_id),
        "name": node.name,
        "address": node.address or "",
        "instance_type": node.instance_type or "",
        "spot": "on" if node.spot else "",
        "amortised_usd_per_h": f"{node.amortised_usd_per_h:g}",
        "labels": format_labels(node.labels or {}),
    }
    for index, gpu in enumerate(node.gpus[:MAX_GPU_ROWS]):
        values[f"gpu_model_{index}"] = gpu.model
        values[f"gpu_count_{index}"] = str(gpu.count)
    return values


def _edit_page(
    request: Request,
    session: Session,
    viewer: Viewer,
    node: Node,
    *,
    values: dict[str, str] | None = None,
    errors: dict[str, str] | None = None,
    created: dict[str, str] | None = None,
    status_code: int = 200,
) -> Response:
    context = {
        "viewer": viewer,
        "node": node,
        "values": values or _edit_values(node),
        "errors": errors or {},
        "created": created,
        "gpu_rows": max(len(node.gpus) + 1, 2),
    } | _choices(session)
    return render(request, "node_edit.html", context, cookie=viewer.session, status_code=status_code)


@router.get("/nodes/{node_id}")
def read_node_page(request: Request, session: SessionDep, viewer: ViewerDep, node_id: NodeIdPath) -> Response:
    """One node: its details, and (for admins) the edit form."""
    return _edit_page(request, session, viewer, _node_or_404(session, node_id))


@router.post("/nodes/{node_id}")
def update_node(
    request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep, node_id: NodeIdPath
) -> Response:
    """Apply the edit form to a node."""
    node = _node_or_404(session, node_id)
    data, echoed, errors, rows = _node_payload(form)
    if not errors:
        # Blank optional text clears the field; every other field is always sent by the form.
        for optional in ("address", "instance_type"):
            data[optional] = data[optional] or None
        if data["amortised_usd_per_h"] == "":
            data["amortised_usd_per_h"] = 0.0
        body, errors = forms.parse(NodeUpdate, {k: v for k, v in data.items() if v != ""}, _renamer(rows))
        if body is not None:
            try:
                node_queries.update_node(session, node_id=node_id, data=body)
                session.commit()
            except HybridtrainError as exc:
                session.rollback()
                errors = forms.domain_errors(exc, _renamer(rows))
            else:
                return redirect(request, f"/nodes/{node_id}", cookie=viewer.session, flash=("ok", "Node saved."))
        session.expire_all()
        node = _node_or_404(session, node_id)
    return _edit_page(request, session, viewer, node, values=echoed, errors=errors, status_code=422)


@router.post("/nodes/{node_id}/drain")
def drain_node(
    request: Request, session: SessionDep, viewer: AdminViewerDep, form: FormDep, node_id: NodeIdPath
) -> Response:
    """Mark a node draining: it finishes its current work and is given no new runs."""
    node = _node_or_404(session, node_id)
    node_queries.update_node(session, node_id=node.id, data=NodeUpdate(status=NodeStatus.draining))
    session.commit()
    target = f"/nodes/{node_id}" if form.get("back") == "node" else "/nodes"
    return redirect(request, target, cookie=viewer.session, flash=("ok", f"Node {node.name} is draining."))


@router.post("/nodes/{node_id}/undrain")
def undrain_node(
    request: Request, session: SessionDep, settings: SettingsDep, dispatcher: DispatcherDep,
    viewer: AdminViewerDep, _: FormDep, node_id: NodeIdPath,
) -> Response:
    """End a node's drain: it takes runs again, and queued runs waiting for it may start."""
    node = _node_or_404(session, node_id)
    nodes_api.undrain_node(session=session, _=viewer.principal, settings=settings, dispatcher=dispatcher,
                           node_id=node.id)
    return redirect(request, f"/nodes/{node_id}", cookie=viewer.session, flash=("ok", f"Node {node.name} takes runs again."))


@router.post("/nodes/{node_id}/join-token")
def rotate_join_token(
    request: Request, session: SessionDep, settings: SettingsDep, wheel: AgentWheelDep, viewer: AdminViewerDep,
    _: FormDep, node_id: NodeIdPath,
) -> Response:
    """Issue a new join token (the old one stops working) and show the agent command again."""
    node = _node_or_404(session, node_id)
    join_token = node_queries.rotate_join_token(session, node_id=node.id)
    session.commit()
    return _edit_page(request, session, viewer, node, created=_created(settings, wheel, node, join_token), status_code=201)
