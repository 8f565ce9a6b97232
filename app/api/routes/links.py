"""Links between nodes: their probes (measured by agents) and the links declared between sites."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, HTTPException, status

from app.api.deps import (
    AdminDep,
    CiDep,
    DispatcherDep,
    IdPath,
    IdQuery,
    PaginationDep,
    ReadDep,
    SessionDep,
)
from app.api.responses import CONFLICT, NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.queries import links as queries
from app.schemas.common import ErrorMessage, Page
from app.schemas.links import (
    LinkMeasurementPublic,
    ProbeOrdered,
    ProbeOrderPublic,
    ProbeRequest,
    ProbeSkipped,
    SiteLinkCreate,
    SiteLinkPublic,
)

log = logging.getLogger(__name__)

UNAVAILABLE: dict[int | str, dict[str, Any]] = {
    503: {"model": ErrorMessage, "description": "The broker is unreachable: no order was sent"},
}

router = APIRouter()
site_router = APIRouter()


@router.get("", response_model=Page[LinkMeasurementPublic])
def read_links(
    session: SessionDep, _: ReadDep, page: PaginationDep, node_id: IdQuery = None
) -> Page[LinkMeasurementPublic]:
    """List link probes from or to a node (or all), newest first."""
    rows, count = queries.list_measurements(session, node_id=node_id, skip=page.skip, limit=page.limit)
    return Page(data=[LinkMeasurementPublic.model_validate(r) for r in rows], count=count)


@router.post(
    "/probe", response_model=ProbeOrdered, status_code=status.HTTP_202_ACCEPTED,
    responses={**NOT_FOUND, **UNAVAILABLE},
)
def probe_links(
    session: SessionDep, _: CiDep, dispatcher: DispatcherDep, body: ProbeRequest
) -> ProbeOrdered:
    """Order every given node to probe every other given node; the results arrive later."""
    orders, skipped = queries.probe_orders(session, node_ids=body.node_ids, seconds=body.seconds)
    # Nothing is stored: the measurements arrive later from the agents (POST /agent/links).
    try:
        dispatcher.send(orders)
    except Exception as exc:  # noqa: BLE001 - any broker failure is the broker's, not the caller's
        log.error("could not send probe orders: %s", exc)
        raise HTTPException(
            status.HTTP_503_SERVICE_UNAVAILABLE, f"could not send the probe orders to the broker: {exc}"
        ) from None
    return ProbeOrdered(
        orders=[
            ProbeOrderPublic(node_id=o.node_id, targets=[t["node_id"] for t in o.spec["targets"]])
            for o in orders
        ],
        skipped=[ProbeSkipped(**s) for s in skipped],
    )


@site_router.get("", response_model=Page[SiteLinkPublic])
def read_site_links(session: SessionDep, _: ReadDep) -> Page[SiteLinkPublic]:
    """List the links declared between sites."""
    rows, count = queries.list_site_links(session)
    return Page(data=[SiteLinkPublic.model_validate(r) for r in rows], count=count)


@site_router.post(
    "", response_model=SiteLinkPublic, status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def create_site_link(session: SessionDep, principal: AdminDep, body: SiteLinkCreate) -> SiteLinkPublic:
    """Declare the link from one site to another; it applies both ways unless the reverse is
    declared too, and a measured probe between two nodes overrides it."""
    link = queries.create_site_link(session, data=body, created_by=principal.name)
    session.commit()
    return SiteLinkPublic.model_validate(link)


@site_router.delete(
    "/{site_link_id}", status_code=status.HTTP_204_NO_CONTENT, responses={**NOT_FOUND, **CONFLICT}
)
def delete_site_link(session: SessionDep, _: AdminDep, site_link_id: IdPath) -> None:
    """Remove a declared site link."""
    queries.delete_site_link(session, site_link_id=site_link_id)
    session.commit()
