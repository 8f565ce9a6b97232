"""Sites: where nodes live."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from app.api.deps import AdminDep, IdPath, PaginationDep, ReadDep, SessionDep, TextQuery
from app.api.responses import CONFLICT, NOT_FOUND, NOT_FOUND_OR_CONFLICT
from app.models import Continent, Provider, SiteKind
from app.queries import sites as queries
from app.schemas.common import Page
from app.schemas.sites import SiteCreate, SitePublic, SiteUpdate

router = APIRouter()


@router.get("", response_model=Page[SitePublic])
def read_sites(
    session: SessionDep,
    _: ReadDep,
    page: PaginationDep,
    kind: Annotated[SiteKind | None, Query()] = None,
    provider: Annotated[Provider | None, Query()] = None,
    region: TextQuery = None,
    continent: Annotated[Continent | None, Query()] = None,
) -> Page[SitePublic]:
    """List sites, filtered by kind, provider, region and continent."""
    rows, count = queries.list_sites(
        session,
        skip=page.skip,
        limit=page.limit,
        kind=kind,
        provider=provider,
        region=region,
        continent=continent,
    )
    return Page(data=[SitePublic.model_validate(row) for row in rows], count=count)


@router.post("", response_model=SitePublic, status_code=status.HTTP_201_CREATED, responses=CONFLICT)
def create_site(session: SessionDep, _: AdminDep, body: SiteCreate) -> SitePublic:
    """Add a site."""
    site = queries.create_site(session, data=body)
    session.commit()
    return SitePublic.model_validate(site)


@router.get("/{site_id}", response_model=SitePublic, responses=NOT_FOUND)
def read_site(session: SessionDep, _: ReadDep, site_id: IdPath) -> SitePublic:
    """Show one site."""
    return SitePublic.model_validate(queries.get_site(session, site_id=site_id))


@router.patch("/{site_id}", response_model=SitePublic, responses=NOT_FOUND_OR_CONFLICT)
def update_site(session: SessionDep, _: AdminDep, site_id: IdPath, body: SiteUpdate) -> SitePublic:
    """Change some fields of a site."""
    site = queries.update_site(session, site_id=site_id, data=body)
    session.commit()
    return SitePublic.model_validate(site)


@router.delete(
    "/{site_id}", status_code=status.HTTP_204_NO_CONTENT, responses=NOT_FOUND_OR_CONFLICT
)
def delete_site(session: SessionDep, _: AdminDep, site_id: IdPath) -> None:
    """Remove a site; 409 while it still has nodes (they are never removed with it)."""
    queries.delete_site(session, site_id=site_id)
    session.commit()
