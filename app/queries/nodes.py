"""Queries of nodes."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session, selectinload

from app.errors import DuplicateError, NotFoundError
from app.models import GpuModel, Node, NodeGpu, NodeStatus, Provider, Site, SiteKind
from app.queries.common import apply_changes
from app.queries.final_bills import NODE_BILLING_FIELDS, clear_bills_on_nodes
from app.queries.gpu_models import gpu_models_by_name
from app.queries.sites import get_site
from app.schemas.nodes import GpuCount, NodeCreate, NodePublic, NodeUpdate
from app.security import JOIN_TOKEN_PREFIX, hash_secret, new_secret

log = logging.getLogger(__name__)

T = TypeVar("T", bound=tuple[Any, ...])


def get_node(session: Session, *, node_id: int, field: str | None = None) -> Node:
    """The node with this id (its GPUs loaded), or NotFoundError."""
    node = session.get(Node, node_id, options=[selectinload(Node.gpus)])
    if node is None:
        raise NotFoundError("node", node_id, field=field)
    return node


# Core tables: the REST list's statements skip the ORM (see `list_node_rows`).
_NODES, _SITES = Node.__table__, Site.__table__
_NODE_GPUS, _GPU_MODELS = NodeGpu.__table__, GpuModel.__table__


def _filtered(
    stmt: Select[T],
    *,
    site_id: int | None,
    status: NodeStatus | None,
    spot: bool | None,
    provider: Provider | None,
    kind: SiteKind | None,
) -> Select[T]:
    if site_id is not None:
        stmt = stmt.where(_NODES.c.site_id == site_id)
    if status is not None:
        stmt = stmt.where(_NODES.c.status == status)
    if spot is not None:
        stmt = stmt.where(_NODES.c.spot == spot)
    if provider is not None or kind is not None:
        stmt = stmt.join(_SITES, _SITES.c.id == _NODES.c.site_id)
        if provider is not None:
            stmt = stmt.where(_SITES.c.provider == provider)
        if kind is not None:
            stmt = stmt.where(_SITES.c.kind == kind)
    return stmt


# The columns a listed node shows (NodePublic's, less its GPUs): never the join token's hash,
# and not `gpu_usage`, whose JSON the page would decode only to drop.
_LISTED_COLUMNS = [_NODES.c[name] for name in NodePublic.model_fields if name != "gpus"]


def list_node_rows(
    session: Session,
    *,
    skip: int,
    limit: int,
    site_id: int | None = None,
    status: NodeStatus | None = None,
    spot: bool | None = None,
    provider: Provider | None = None,
    kind: SiteKind | None = None,
) -> tuple[list[dict[str, Any]], int]:
    """A page of nodes matching every given filter, ordered by id, as plain dicts (with `gpus` as
    [{model, count}]) for the REST list.

    The API's busiest read, in two statements on the connection and no ORM objects: the page
    carries the filtered count as a column (a page past the end asks for it alone), and the
    GPUs are read for the page's range of ids, through the primary keys.
    """
    filters = {"site_id": site_id, "status": status, "spot": spot, "provider": provider, "kind": kind}
    matching = _filtered(select(func.count()).select_from(_NODES), **filters)
    total = matching.correlate(None).scalar_subquery()  # not correlated to the page's `nodes`
    page = (
        _filtered(select(*_LISTED_COLUMNS, total.label("total")), **filters)
        .order_by(_NODES.c.id).offset(skip).limit(limit)
    )
    # Core statements on the session's connection: the ORM's compile and loading steps would
    # cost more than the queries themselves.
    connection = session.connection()
    result = connection.execute(page)
    names = list(result.keys())[:-1]  # the node's columns; the count comes last
    values = result.all()
    if not values:
        return [], int(connection.scalar(select(total)) or 0)
    rows: list[dict[str, Any]] = []
    by_node: dict[int, list[dict[str, Any]]] = {}
    for node in values:
        row = dict(zip(names, node))  # zip stops before the count
        row["gpus"] = by_node[row["id"]] = []
        rows.append(row)
    # The page's ids as a range with the same filters, not as an IN list: a statement of fixed
    # text, which SQLAlchemy and psycopg cache (and Postgres prepares) instead of rendering and
    # parsing 100 parameters anew for each page.
    gpus = _filtered(
        select(_NODE_GPUS.c.node_id, _GPU_MODELS.c.name, _NODE_GPUS.c.count)
        .select_from(_NODES)
        .join(_NODE_GPUS, _NODE_GPUS.c.node_id == _NODES.c.id)
        .join(_GPU_MODELS, _GPU_MODELS.c.id == _NODE_GPUS.c.gpu_model_id),
        **filters,
    ).where(_NODES.c.id.between(rows[0]["id"], rows[-1]["id"]))
    for node_id, model, gpu_count in connection.execute(
        gpus.order_by(_NODE_GPUS.c.node_id, _NODE_GPUS.c.gpu_model_id)
    ).all():
        # Under READ COMMITTED the second statement sees the latest commits: a node that came
        # to match the filters in between, inside the range, is not on this page.
        if node_id in by_node:
            by_node[node_id].append({"model": model, "count": gpu_count})
    return rows, int(values[0][-1])


def _check_name_free(
    session: Session, *, site_id: int, name: str, except_id: int | None = None
) -> None:
    clash = session.scalar(select(Node.id).where(Node.site_id == site_id, Node.name == name))
    if clash is not None and clash != except_id:
        raise DuplicateError("node", "name", name, within=f"in site {site_id}")


def _declared_gpus(session: Session, gpus: list[GpuCount]) -> list[NodeGpu]:
    catalog = gpu_models_by_name(session, names=(gpu.model for gpu in gpus))
    declared = []
    for index, gpu in enumerate(gpus):
        if gpu.model not in catalog:
            raise NotFoundError("GPU model", gpu.model, field=f"gpus.{index}.model")
        declared.append(NodeGpu(gpu_model=catalog[gpu.model], count=gpu.count))
    return declared


def create_node(session: Session, *, data: NodeCreate) -> tuple[Node, str]:
    """Declare a node; returns it with its join token, whose hash alone is stored."""
    get_site(session, site_id=data.site_id, field="site_id")
    _check_name_free(session, site_id=data.site_id, name=data.name)
    join_token = new_secret(JOIN_TOKEN_PREFIX)
    node = Node(
        **data.model_dump(exclude={"gpus"}),
        gpus=_declared_gpus(session, data.gpus),
        status=NodeStatus.pending,
        join_token_hash=hash_secret(join_token),
    )
    session.add(node)
    session.flush()
    return node, join_token


def update_node(session: Session, *, node_id: int, data: NodeUpdate) -> Node:
    """Change some fields of a node; `gpus`, when given, replaces the declared list. A change
    of what prices the node clears the final bills of the runs that used it."""
    node = get_node(session, node_id=node_id)
    if data.model_fields_set & NODE_BILLING_FIELDS:
        # Before the node's own row: the lifecycle, too, locks runs before nodes.
        clear_bills_on_nodes(session, node_ids=[node.id])
    changes = data.model_dump(exclude_unset=True, exclude={"gpus"})
    if changes.get("site_id") is not None:
        get_site(session, site_id=changes["site_id"], field="site_id")
    if changes.get("site_id") is not None or changes.get("name") is not None:
        _check_name_free(
            session,
            site_id=changes.get("site_id") or node.site_id,
            name=changes.get("name") or node.name,
            except_id=node.id,
        )
    if "gpus" in data.model_fields_set:
        if data.gpus is None:
            changes["gpus"] = None  # refused by apply_changes, naming the field
        else:
            node.gpus.clear()
            session.flush()  # the old rows go before new ones reuse their keys
            node.gpus.extend(_declared_gpus(session, data.gpus))
            refresh_mismatch(node)
    apply_changes(node, changes, nullable={"address", "instance_type"})
    session.flush()
    return node


def rotate_join_token(session: Session, *, node_id: int) -> str:
    """Replace a node's join token (the old one stops working) and return the new secret."""
    node = get_node(session, node_id=node_id)
    join_token = new_secret(JOIN_TOKEN_PREFIX)
    node.join_token_hash = hash_secret(join_token)
    session.flush()
    return join_token


def hardware_mismatch(node: Node, detected_gpus: list[dict[str, Any]]) -> str | None:
    """A warning when the declared GPUs differ from the detected ones, else None."""
    declared = {g.gpu_model.name: g.count for g in node.gpus}
    detected: dict[str, int] = {}
    for gpu in detected_gpus:
        detected[gpu["model"]] = detected.get(gpu["model"], 0) + int(gpu["count"])
    if declared == detected:
        return None

    def show(gpus: dict[str, int]) -> str:
        return ", ".join(f"{n}x {m}" for m, n in sorted(gpus.items())) or "no GPU"

    return (
        f"declared {show(declared)} but the agent detected {show(detected)}; runs are planned "
        "with the declared GPUs unless allocation 'measured' is asked for"
    )


def refresh_mismatch(node: Node) -> None:
    """Recompute the declared-versus-detected warning (the declared GPUs may have been edited)."""
    if node.detected_hardware is None:
        return
    warning = hardware_mismatch(node, node.detected_hardware.get("gpus") or [])
    if node.detected_hardware.get("mismatch", "unset") != warning:
        if warning:
            log.warning("node %s (id %s): %s", node.name, node.id, warning)
        # A new dict: the JSON column sees assignments, not in-place changes.
        node.detected_hardware = {**node.detected_hardware, "mismatch": warning}


def node_by_join_token(session: Session, *, join_token: str) -> Node | None:
    """The node this join token belongs to, if any (for the agent's registration)."""
    return session.scalar(select(Node).where(Node.join_token_hash == hash_secret(join_token)))


def delete_node(session: Session, *, node_id: int) -> None:
    """Remove a node (its declared GPUs and cluster memberships go with it); the runs that used
    it no longer bill it, so their final bills are cleared."""
    node = get_node(session, node_id=node_id)
    # While their ranks still name the node (its delete sets their node_id to NULL).
    clear_bills_on_nodes(session, node_ids=[node.id])
    session.delete(node)
    session.flush()


def drain_node(session: Session, *, node_id: int) -> Node:
    """Mark a node draining: its runs finish, no new run may name it, queued ones wait."""
    node = get_node(session, node_id=node_id)
    node.status = NodeStatus.draining
    session.flush()
    return node


def undrain_node(session: Session, *, node_id: int, heartbeat_timeout_s: float, now: datetime) -> Node:
    """End a node's drain: online again if its agent beat within the timeout, else offline
    (its next heartbeat brings it online)."""
    node = get_node(session, node_id=node_id)
    if node.status != NodeStatus.draining:
        return node
    fresh = node.last_heartbeat is not None and now - node.last_heartbeat < timedelta(seconds=heartbeat_timeout_s)
    node.status = NodeStatus.online if fresh else NodeStatus.offline
    session.flush()
    return node
