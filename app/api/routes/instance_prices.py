"""Instance prices: $/h of an instance type in a region, spot and on-demand, versioned in time."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from app.api.deps import AdminDep, IdPath, IdQuery, PaginationDep, ReadDep, SessionDep, TextQuery
from app.api.responses import NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.models import Provider
from app.queries import prices as queries
from app.schemas.common import Page, Timestamp
from app.schemas.prices import InstancePriceCreate, InstancePricePublic, InstancePriceRevision

router = APIRouter()

AtQuery = Annotated[
    Timestamp | None,
    Query(description="list the versions in force at this instant (default: now)"),
]
AllVersionsQuery = Annotated[
    bool, Query(description="list every version, past and scheduled, instead")
]


@router.get("", response_model=Page[InstancePricePublic])
def read_instance_prices(
    session: SessionDep,
    _: ReadDep,
    page: PaginationDep,
    at: AtQuery = None,
    all_versions: AllVersionsQuery = False,
    provider: Annotated[Provider | None, Query()] = None,
    region: TextQuery = None,
    instance_type: TextQuery = None,
    gpu_model_id: IdQuery = None,
) -> Page[InstancePricePublic]:
    """List instance prices in force (now, or at `at`), or every version."""
    rows, count = queries.list_instance_prices(
        session,
        skip=page.skip,
        limit=page.limit,
        at=at,
        all_versions=all_versions,
        provider=provider,
        region=region,
        instance_type=instance_type,
        gpu_model_id=gpu_model_id,
    )
    return Page(data=[InstancePricePublic.model_validate(row) for row in rows], count=count)


@router.post(
    "",
    response_model=InstancePricePublic,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def create_instance_price(
    session: SessionDep, _: AdminDep, body: InstancePriceCreate
) -> InstancePricePublic:
    """Price an instance type that has no price yet (409 if it has: revise that one)."""
    price = queries.create_instance_price(session, data=body)
    session.commit()
    return InstancePricePublic.model_validate(price)


@router.get("/{price_id}", response_model=InstancePricePublic, responses=NOT_FOUND)
def read_instance_price(session: SessionDep, _: ReadDep, price_id: IdPath) -> InstancePricePublic:
    """Show one version of an instance price."""
    return InstancePricePublic.model_validate(
        queries.get_instance_price(session, price_id=price_id)
    )


@router.patch(
    "/{price_id}",
    response_model=InstancePricePublic,
    status_code=status.HTTP_201_CREATED,
    responses=NOT_FOUND_OR_CONFLICT,
)
def revise_instance_price(
    session: SessionDep, _: AdminDep, price_id: IdPath, body: InstancePriceRevision
) -> InstancePricePublic:
    """Publish a new version of this price, in force from `effective_from` (now by default).

    The old version stays, so runs before that instant keep their cost; answers the new
    version. 409 if `price_id` is not the latest version of its series.
    """
    price = queries.revise_instance_price(session, price_id=price_id, data=body)
    session.commit()
    return InstancePricePublic.model_validate(price)


@router.delete(
    "/{price_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND_OR_CONFLICT
)
def delete_instance_price(session: SessionDep, _: AdminDep, price_id: IdPath) -> None:
    """Withdraw a version that has not taken effect yet (409 for one that has)."""
    queries.delete_instance_price(session, price_id=price_id)
    session.commit()
