"""Egress prices: $/GB of outbound traffic per provider and traffic class, versioned in time."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from app.api.deps import AdminDep, IdPath, PaginationDep, ReadDep, SessionDep
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.models import Continent, Provider, TrafficClass
from app.queries import prices as queries
from app.schemas.common import Page, Timestamp
from app.schemas.prices import EgressPriceCreate, EgressPricePublic, EgressPriceRevision

router = APIRouter()

AtQuery = Annotated[
    Timestamp | None,
    Query(description="list the versions in force at this instant (default: now)"),
]
AllVersionsQuery = Annotated[
    bool, Query(description="list every version, past and scheduled, instead")
]


@router.get("", response_model=Page[EgressPricePublic])
def read_egress_prices(
    session: SessionDep,
    _: ReadDep,
    page: PaginationDep,
    at: AtQuery = None,
    all_versions: AllVersionsQuery = False,
    provider: Annotated[Provider | None, Query()] = None,
    traffic_class: Annotated[TrafficClass | None, Query()] = None,
    continent: Annotated[Continent | None, Query()] = None,
) -> Page[EgressPricePublic]:
    """List egress prices in force (now, or at `at`), or every version."""
    rows, count = queries.list_egress_prices(
        session,
        skip=page.skip,
        limit=page.limit,
        at=at,
        all_versions=all_versions,
        provider=provider,
        traffic_class=traffic_class,
        continent=continent,
    )
    return Page(data=[EgressPricePublic.model_validate(row) for row in rows], count=count)


@router.post(
    "",
    response_model=EgressPricePublic,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def create_egress_price(
    session: SessionDep, _: AdminDep, body: EgressPriceCreate
) -> EgressPricePublic:
    """Price a (provider, traffic class, continent) that has no price yet (409 if it has)."""
    price = queries.create_egress_price(session, data=body)
    session.commit()
    return EgressPricePublic.model_validate(price)


@router.get("/{price_id}", response_model=EgressPricePublic, responses=NOT_FOUND)
def read_egress_price(session: SessionDep, _: ReadDep, price_id: IdPath) -> EgressPricePublic:
    """Show one version of an egress price."""
    return EgressPricePublic.model_validate(
        queries.get_egress_price(session, price_id=price_id)
    )


@router.patch(
    "/{price_id}",
    response_model=EgressPricePublic,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def revise_egress_price(
    session: SessionDep, _: AdminDep, price_id: IdPath, body: EgressPriceRevision
) -> EgressPricePublic:
    """Publish a new version of this price, in force from `effective_from` (now by default).

    The old version stays, so runs before that instant keep their cost; answers the new
    version. 409 if `price_id` is not the latest version of its series.
    """
    price = queries.revise_egress_price(session, price_id=price_id, data=body)
    session.commit()
    return EgressPricePublic.model_validate(price)


@router.delete(
    "/{price_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND_OR_CONFLICT
)
def delete_egress_price(session: SessionDep, _: AdminDep, price_id: IdPath) -> None:
    """Withdraw a version that has not taken effect yet (409 for one that has)."""
    queries.delete_egress_price(session, price_id=price_id)
    session.commit()
