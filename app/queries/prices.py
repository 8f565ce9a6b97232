"""Queries of versioned prices, and `price_in_force`, the lookup cost accounting uses.

Every price row is one version of a series (see `app.models.prices`). The rules that keep past
bills stable:

1. A version is never updated in place: a revision inserts a new version.
2. A revision takes effect now or later, never earlier, and after the series' latest version,
   so the price in force at any past instant stays what it was.
3. Only versions that have not yet taken effect may be deleted (a scheduled change withdrawn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TypeAlias

from sqlalchemy import ColumnElement, Select, and_, exists, select
from sqlalchemy.orm import Session, aliased

from app.errors import ConflictError, DuplicateError, InvalidFieldError, NotFoundError
from app.models import Continent, EgressPrice, InstancePrice, Provider, TrafficClass
from app.models.base import utcnow
from app.queries.common import paginate
from app.queries.gpu_models import get_gpu_model
from app.schemas.prices import (
    EgressPriceCreate,
    EgressPriceRevision,
    InstancePriceCreate,
    InstancePriceRevision,
)

INSTANCE_KEY = ("provider", "region", "instance_type", "gpu_model_id", "gpu_count")
EGRESS_KEY = ("provider", "traffic_class", "continent")


@dataclass(frozen=True)
class InstanceKey:
    """Identifies an instance-price series."""

    provider: Provider
    region: str
    instance_type: str
    gpu_model_id: int
    gpu_count: int = 1


@dataclass(frozen=True)
class EgressKey:
    """Identifies an egress-price series; `continent=None` is the any-continent series."""

    provider: Provider
    traffic_class: TrafficClass
    continent: Continent | None = None


PriceModel: TypeAlias = type[InstancePrice] | type[EgressPrice]


def _same_series(model: PriceModel, key_columns: tuple[str, ...], other: object) -> ColumnElement[bool]:
    # IS NOT DISTINCT FROM: a NULL continent matches a NULL continent.
    return and_(
        *(
            getattr(model, column).is_not_distinct_from(getattr(other, column))
            for column in key_columns
        )
    )


def _in_force_at(model: PriceModel, key_columns: tuple[str, ...], at: datetime) -> Select:  # type: ignore[type-arg]
    """Versions in force at `at`: started by then, and no later-started version of the series."""
    newer = aliased(model)
    superseded = exists().where(
        _same_series(newer, key_columns, model),  # type: ignore[arg-type]
        newer.effective_from <= at,
        newer.effective_from > model.effective_from,
    )
    return select(model).where(model.effective_from <= at, ~superseded)


def _key_filter(model: PriceModel, key: InstanceKey | EgressKey) -> list[ColumnElement[bool]]:
    return [
        getattr(model, column).is_not_distinct_from(value)
        for column, value in vars(key).items()
    ]


def instance_price_in_force(session: Session, *, key: InstanceKey, at: datetime) -> InstancePrice | None:
    """The version of this instance price in force at `at`, or None if none had started."""
    stmt = (
        select(InstancePrice)
        .where(*_key_filter(InstancePrice, key), InstancePrice.effective_from <= at)
        .order_by(InstancePrice.effective_from.desc())
        .limit(1)
    )
    return session.scalar(stmt)


def egress_price_in_force(session: Session, *, key: EgressKey, at: datetime) -> EgressPrice | None:
    """The egress price in force at `at` for this key.

    A continent-specific series wins over the any-continent (NULL) series of the same provider
    and class; with `key.continent=None` only the any-continent series is consulted.
    """
    candidates = [key] if key.continent is None else [key, EgressKey(key.provider, key.traffic_class)]
    for candidate in candidates:
        stmt = (
            select(EgressPrice)
            .where(*_key_filter(EgressPrice, candidate), EgressPrice.effective_from <= at)
            .order_by(EgressPrice.effective_from.desc())
            .limit(1)
        )
        price = session.scalar(stmt)
        if price is not None:
            return price
    return None


def price_in_force(
    session: Session, key: InstanceKey | EgressKey, *, at: datetime
) -> InstancePrice | EgressPrice | None:
    """The price in force at `at` for an instance or egress key (see the two functions above)."""
    if at.tzinfo is None:
        raise ValueError("price_in_force needs a timezone-aware `at`")
    if isinstance(key, InstanceKey):
        return instance_price_in_force(session, key=key, at=at)
    return egress_price_in_force(session, key=key, at=at)


# --- listing --------------------------------------------------------------------------------


def list_instance_prices(
    session: Session,
    *,
    skip: int,
    limit: int,
    at: datetime | None = None,
    all_versions: bool = False,
    provider: Provider | None = None,
    region: str | None = None,
    instance_type: str | None = None,
    gpu_model_id: int | None = None,
) -> tuple[Sequence[InstancePrice], int]:
    """A page of instance prices: the versions in force at `at` (default now), or every version."""
    stmt = select(InstancePrice) if all_versions else _in_force_at(InstancePrice, INSTANCE_KEY, at or utcnow())
    for column, value in (
        (InstancePrice.provider, provider),
        (InstancePrice.region, region),
        (InstancePrice.instance_type, instance_type),
        (InstancePrice.gpu_model_id, gpu_model_id),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    stmt = stmt.order_by(*(getattr(InstancePrice, c) for c in INSTANCE_KEY), InstancePrice.effective_from)
    return paginate(session, stmt, skip=skip, limit=limit)


def list_egress_prices(
    session: Session,
    *,
    skip: int,
    limit: int,
    at: datetime | None = None,
    all_versions: bool = False,
    provider: Provider | None = None,
    traffic_class: TrafficClass | None = None,
    continent: Continent | None = None,
) -> tuple[Sequence[EgressPrice], int]:
    """A page of egress prices: the versions in force at `at` (default now), or every version."""
    stmt = select(EgressPrice) if all_versions else _in_force_at(EgressPrice, EGRESS_KEY, at or utcnow())
    for column, value in (
        (EgressPrice.provider, provider),
        (EgressPrice.traffic_class, traffic_class),
        (EgressPrice.continent, continent),
    ):
        if value is not None:
            stmt = stmt.where(column == value)
    stmt = stmt.order_by(
        EgressPrice.provider, EgressPrice.traffic_class, EgressPrice.continent, EgressPrice.effective_from
    )
    return paginate(session, stmt, skip=skip, limit=limit)


# --- writing --------------------------------------------------------------------------------


def get_instance_price(session: Session, *, price_id: int) -> InstancePrice:
    """The instance-price version with this id, or NotFoundError."""
    price = session.get(InstancePrice, price_id)
    if price is None:
        raise NotFoundError("instance price", price_id)
    return price


def get_egress_price(session: Session, *, price_id: int) -> EgressPrice:
    """The egress-price version with this id, or NotFoundError."""
    price = session.get(EgressPrice, price_id)
    if price is None:
        raise NotFoundError("egress price", price_id)
    return price


def _latest_version(session: Session, model: PriceModel, key: InstanceKey | EgressKey):  # type: ignore[no-untyped-def]
    stmt = select(model).where(*_key_filter(model, key)).order_by(model.effective_from.desc()).limit(1)
    return session.scalar(stmt)


def _series_key(price: InstancePrice | EgressPrice) -> InstanceKey | EgressKey:
    if isinstance(price, InstancePrice):
        return InstanceKey(*(getattr(price, c) for c in INSTANCE_KEY))
    return EgressKey(*(getattr(price, c) for c in EGRESS_KEY))


def _revision_start(
    session: Session, price: InstancePrice | EgressPrice, requested: datetime | None, now: datetime
) -> datetime:
    """When a revision of `price` may take effect; raises unless `price` is the latest version."""
    latest = _latest_version(session, type(price), _series_key(price))
    if latest.id != price.id:
        raise ConflictError(
            f"price {price.id} has been superseded by version {latest.id}; revise that one"
        )
    start = requested or now
    if start < now:
        raise InvalidFieldError(
            "effective_from",
            f"effective_from {start.isoformat()} is in the past: a revision may not change "
            "what past runs were charged",
        )
    if start <= latest.effective_from:
        raise InvalidFieldError(
            "effective_from",
            f"effective_from must be after the current version's "
            f"({latest.effective_from.isoformat()})",
        )
    return start


def create_instance_price(session: Session, *, data: InstancePriceCreate) -> InstancePrice:
    """Start a new instance-price series (revise an existing one instead of re-creating it); one
    started in the past clears the final bills of the runs priced since."""
    get_gpu_model(session, gpu_model_id=data.gpu_model_id, field="gpu_model_id")
    key = InstanceKey(data.provider, data.region, data.instance_type, data.gpu_model_id, data.gpu_count)
    existing = _latest_version(session, InstancePrice, key)
    if existing is not None:
        raise DuplicateError(
            "instance price",
            "instance_type",
            data.instance_type,
            within=f"for this provider, region and GPUs (id {existing.id}); revise it with PATCH",
        )
    price = InstancePrice(**data.model_dump(exclude={"effective_from"}), effective_from=data.effective_from or utcnow(), seeded=False)
    session.add(price)
    session.flush()
    _clear_bills_priced_since(session, price.effective_from)
    return price


def revise_instance_price(
    session: Session, *, price_id: int, data: InstancePriceRevision, now: datetime | None = None
) -> InstancePrice:
    """Add a new version to the series of `price_id`, which must be its latest version."""
    current = get_instance_price(session, price_id=price_id)
    start = _revision_start(session, current, data.effective_from, now or utcnow())
    changes = data.model_dump(exclude_unset=True, exclude={"effective_from"})
    if "on_demand_usd_per_h" in changes and changes["on_demand_usd_per_h"] is None:
        raise InvalidFieldError("on_demand_usd_per_h", "on_demand_usd_per_h may not be null")
    if changes.get("source") is None:
        changes.pop("source", None)
    revision = InstancePrice(
        provider=current.provider,
        region=current.region,
        instance_type=current.instance_type,
        gpu_model_id=current.gpu_model_id,
        gpu_count=current.gpu_count,
        spot_usd_per_h=changes.get("spot_usd_per_h", current.spot_usd_per_h),
        on_demand_usd_per_h=changes.get("on_demand_usd_per_h", current.on_demand_usd_per_h),
        source=changes.get("source", current.source),
        effective_from=start,
        seeded=False,
    )
    session.add(revision)
    session.flush()
    return revision


def create_egress_price(session: Session, *, data: EgressPriceCreate) -> EgressPrice:
    """Start a new egress-price series; one started in the past clears the final bills of the
    runs priced since."""
    key = EgressKey(data.provider, data.traffic_class, data.continent)
    existing = _latest_version(session, EgressPrice, key)
    if existing is not None:
        raise DuplicateError(
            "egress price",
            "traffic_class",
            data.traffic_class.value,
            within=f"for this provider and continent (id {existing.id}); revise it with PATCH",
        )
    price = EgressPrice(**data.model_dump(exclude={"effective_from"}), effective_from=data.effective_from or utcnow(), seeded=False)
    session.add(price)
    session.flush()
    _clear_bills_priced_since(session, price.effective_from)
    return price


def revise_egress_price(
    session: Session, *, price_id: int, data: EgressPriceRevision, now: datetime | None = None
) -> EgressPrice:
    """Add a new version to the series of `price_id`, which must be its latest version."""
    current = get_egress_price(session, price_id=price_id)
    start = _revision_start(session, current, data.effective_from, now or utcnow())
    if "usd_per_gb" in data.model_fields_set and data.usd_per_gb is None:
        raise InvalidFieldError("usd_per_gb", "usd_per_gb may not be null")
    revision = EgressPrice(
        provider=current.provider,
        traffic_class=current.traffic_class,
        continent=current.continent,
        usd_per_gb=data.usd_per_gb if data.usd_per_gb is not None else current.usd_per_gb,
        source=data.source if data.source is not None else current.source,
        effective_from=start,
        seeded=False,
    )
    session.add(revision)
    session.flush()
    return revision


def _clear_bills_priced_since(session: Session, since: datetime) -> None:
    """A series started in the past prices runs since then anew (`final_bills.clear_bills_priced_since`)."""
    # Imported here: final_bills bills through app.queries.price_lookups, which imports this module.
    from app.queries.final_bills import clear_bills_priced_since

    clear_bills_priced_since(session, since=since)


def _delete_scheduled(session: Session, price: InstancePrice | EgressPrice, now: datetime) -> None:
    if price.effective_from <= now:
        raise ConflictError(
            f"price {price.id} took effect on {price.effective_from.isoformat()} and bills may "
            "use it; publish a new version instead of deleting it"
        )
    session.delete(price)
    session.flush()


def delete_instance_price(session: Session, *, price_id: int, now: datetime | None = None) -> None:
    """Withdraw an instance-price version that has not taken effect yet."""
    _delete_scheduled(session, get_instance_price(session, price_id=price_id), now or utcnow())


def delete_egress_price(session: Session, *, price_id: int, now: datetime | None = None) -> None:
    """Withdraw an egress-price version that has not taken effect yet."""
    _delete_scheduled(session, get_egress_price(session, price_id=price_id), now or utcnow())
