"""Queries of sites."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import exists, select
from sqlalchemy.orm import Session

from app.errors import DuplicateError, InUseError, InvalidFieldError, NotFoundError
from app.models import Continent, Node, Provider, Site, SiteKind
from app.queries.common import apply_changes, paginate
from app.queries.final_bills import clear_bills_at_site
from app.schemas.sites import SiteCreate, SiteUpdate


def get_site(session: Session, *, site_id: int, field: str | None = None) -> Site:
    """The site with this id, or NotFoundError (naming `field` when the id came in a body)."""
    site = session.get(Site, site_id)
    if site is None:
        raise NotFoundError("site", site_id, field=field)
    return site


def list_sites(
    session: Session,
    *,
    skip: int,
    limit: int,
    kind: SiteKind | None = None,
    provider: Provider | None = None,
    region: str | None = None,
    continent: Continent | None = None,
) -> tuple[Sequence[Site], int]:
    """A page of sites matching every given filter, ordered by id."""
    stmt = select(Site).order_by(Site.id)
    if kind is not None:
        stmt = stmt.where(Site.kind == kind)
    if provider is not None:
        stmt = stmt.where(Site.provider == provider)
    if region is not None:
        stmt = stmt.where(Site.region == region)
    if continent is not None:
        stmt = stmt.where(Site.continent == continent)
    return paginate(session, stmt, skip=skip, limit=limit)


def _check_consistent(kind: SiteKind, provider: Provider) -> None:
    # An on-prem room is run by its owner (or "other", e.g. a colocation); a cloud site is not.
    if kind is SiteKind.cloud and provider is Provider.onprem:
        raise InvalidFieldError("provider", "a cloud site needs a cloud provider, not 'onprem'")
    if kind is SiteKind.onprem and provider not in (Provider.onprem, Provider.other):
        raise InvalidFieldError(
            "provider", f"an onprem site has provider 'onprem' or 'other', not '{provider}'"
        )


def _check_name_free(session: Session, name: str, *, except_id: int | None = None) -> None:
    clash = session.scalar(select(Site.id).where(Site.name == name))
    if clash is not None and clash != except_id:
        raise DuplicateError("site", "name", name)


def create_site(session: Session, *, data: SiteCreate) -> Site:
    """Add a site."""
    _check_consistent(data.kind, data.provider)
    _check_name_free(session, data.name)
    site = Site(**data.model_dump())
    session.add(site)
    session.flush()
    return site


def update_site(session: Session, *, site_id: int, data: SiteUpdate) -> Site:
    """Change some fields of a site; the final bills of the runs on its nodes are cleared (its
    provider, region, zone or continent price their traffic and instances)."""
    site = get_site(session, site_id=site_id)
    clear_bills_at_site(session, site_id=site.id)
    changes = data.model_dump(exclude_unset=True)
    _check_consistent(
        changes.get("kind") or site.kind, changes.get("provider") or site.provider
    )
    if changes.get("name") is not None:
        _check_name_free(session, changes["name"], except_id=site.id)
    apply_changes(site, changes, nullable={"region", "zone"})
    session.flush()
    return site


def delete_site(session: Session, *, site_id: int) -> None:
    """Remove a site that has no nodes left (its nodes are never removed along with it)."""
    site = get_site(session, site_id=site_id)
    if session.scalar(select(exists().where(Node.site_id == site.id))):
        raise InUseError(f"site {site.id} still has nodes; delete or move them first")
    session.delete(site)
    session.flush()
