"""Nodes: the machines at each site, with the GPUs they declare."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from pydantic import TypeAdapter

from app.api.deps import AdminDep, DispatcherDep, IdPath, IdQuery, PaginationDep, ReadDep, SessionDep, SettingsDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.broker_access import drop_node_user
from app.lifecycle import run_state_lock, start_queued
from app.models import NodeStatus, Provider, SiteKind
from app.models.base import utcnow
from app.queries import nodes as queries
from app.schemas.common import Page
from app.schemas.nodes import JoinToken, NodeCreate, NodeCreated, NodePublic, NodeUpdate

router = APIRouter()
_NODE_PAGE = TypeAdapter(Page[NodePublic])


@router.get("", response_model=Page[NodePublic])
def read_nodes(
    session: SessionDep,
    _: ReadDep,
    page: PaginationDep,
    site_id: IdQuery = None,
    status: Annotated[NodeStatus | None, Query()] = None,
    spot: Annotated[bool | None, Query()] = None,
    provider: Annotated[Provider | None, Query(description="the site's provider")] = None,
    kind: Annotated[SiteKind | None, Query(description="the site's kind")] = None,
) -> Response:
    """List nodes, filtered by site, status, spot, and their site's provider and kind."""
    rows, count = queries.list_node_rows(
        session,
        skip=page.skip,
        limit=page.limit,
        site_id=site_id,
        status=status,
        spot=spot,
        provider=provider,
        kind=kind,
    )
    # The API's hot path (agents and dashboards poll it): the page is validated once and
    # serialised once, instead of being dumped, re-validated and dumped again by FastAPI's
    # response_model handling (which still documents the schema).
    listed = _NODE_PAGE.validate_python({"data": rows, "count": count})
    return Response(_NODE_PAGE.dump_json(listed), media_type="application/json")


@router.post(
    "",
    response_model=NodeCreated,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def create_node(session: SessionDep, _: AdminDep, body: NodeCreate) -> NodeCreated:
    """Declare a node; the answer carries its join token, shown this once."""
    node, join_token = queries.create_node(session, data=body)
    session.commit()
    public = NodePublic.model_validate(node)
    return NodeCreated(**public.model_dump(), join_token=join_token)


@router.get("/{node_id}", response_model=NodePublic, responses=NOT_FOUND)
def read_node(session: SessionDep, _: ReadDep, node_id: IdPath) -> NodePublic:
    """Show one node."""
    return NodePublic.model_validate(queries.get_node(session, node_id=node_id))


@router.patch("/{node_id}", response_model=NodePublic, responses=NOT_FOUND_OR_CONFLICT)
def update_node(session: SessionDep, _: AdminDep, node_id: IdPath, body: NodeUpdate) -> NodePublic:
    """Change some fields of a node; `gpus`, when given, replaces the declared list."""
    node = queries.update_node(session, node_id=node_id, data=body)
    session.commit()
    return NodePublic.model_validate(node)


@router.post("/{node_id}/drain", response_model=NodePublic, responses=NOT_FOUND)
def drain_node(session: SessionDep, _: AdminDep, node_id: IdPath) -> NodePublic:
    """Drain a node: it finishes its runs and takes no new one (new runs naming it get 409)."""
    node = queries.drain_node(session, node_id=node_id)
    session.commit()
    return NodePublic.model_validate(node)


@router.post("/{node_id}/undrain", response_model=NodePublic, responses=NOT_FOUND)
def undrain_node(
    session: SessionDep, _: AdminDep, settings: SettingsDep, dispatcher: DispatcherDep, node_id: IdPath
) -> NodePublic:
    """End a node's drain; queued runs waiting for it start if their GPUs are free."""
    with run_state_lock(settings.is_sqlite):
        node = queries.undrain_node(session, node_id=node_id, heartbeat_timeout_s=settings.heartbeat_timeout_s,
                                    now=utcnow())
        launches = start_queued(session, settings=settings)
        session.commit()
    dispatcher.send_quietly(launches)
    return NodePublic.model_validate(node)


@router.post(
    "/{node_id}/join-token",
    response_model=JoinToken,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND,
)
def rotate_join_token(session: SessionDep, _: AdminDep, node_id: IdPath) -> JoinToken:
    """Issue a new join token for a node; the previous one stops working."""
    join_token = queries.rotate_join_token(session, node_id=node_id)
    session.commit()
    return JoinToken(join_token=join_token)


@router.delete("/{node_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND)
def delete_node(session: SessionDep, settings: SettingsDep, _: AdminDep, node_id: IdPath) -> None:
    """Remove a node (it leaves its clusters, and its agent its broker user)."""
    queries.delete_node(session, node_id=node_id)
    session.commit()
    drop_node_user(settings, node_id)
